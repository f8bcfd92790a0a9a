"""The benchmark behind ``python -m rl_engine bench`` (issue 6).

config: what to run; paths: the candidate, naive and floor paths and their inputs;
memory: the peak-RSS probe; tp: the torchrun mode; report: ratios, targets, table, JSON.
"""
