"""The benchmark behind ``python -m rl_engine bench``.

cli: the command; config: what to run; inputs: the seeded logits (whole or a TP shard);
paths: the candidate, fused, naive and floor steps; timing: the round-robin loop; memory: the
peak-RSS probe; single: the TP=1 mode; tp: the torchrun mode; report: ratios, targets, table,
JSON.
"""
