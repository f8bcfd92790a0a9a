# One torchrun per topology. A report that fails acceptance is kept (the runner exits 1
# after writing it) so the validation gate can name what failed; any other failure
# (crash, killed rank, time limit) fails the rule and leaves no report. On cuda each rank
# holds a GPU: the local scheduler never runs topologies that together need more than `gpus`.
# The other resources are what a Slurm job of this topology asks for (topology_resources:
# nodes from ranks_per_node, one task per node, mpi="srun" across nodes, GPUs on cuda,
# runtime from topology_timeout_s); the local executor ignores them. With more than one
# node, launch runs one torchrun per node under srun and needs that Slurm job.

from rl_engine.workflow import topology_gpus, topology_resource_functions


rule topology:
    input:
        plan=stage_output("plan"),
        sources=SOURCES,
    output:
        **TOPOLOGY_OUTPUTS,
    log:
        TOPOLOGY_LOG,
    wildcard_constraints:
        tp=r"[1-9][0-9]*",
        cp=r"[1-9][0-9]*",
    params:
        name=lambda wildcards: f"tp{wildcards.tp}-cp{wildcards.cp}",
        timeout=config["topology_timeout_s"],
        ranks_per_node=config["ranks_per_node"],
    threads: lambda wildcards: int(wildcards.tp) * int(wildcards.cp) * config["threads_per_rank"]
    resources:
        gpus=lambda wildcards: topology_gpus(config["device"], int(wildcards.tp), int(wildcards.cp)),
        **topology_resource_functions(config),
    conda:
        "../envs/rl_engine.yaml"
    # The console names each job by its topology (Snakemake's own lines say only "Rule: topology").
    shell:
        'job="topology "{params.name:q}; echo "$job: started"; '
        "rc=0; python -m rl_engine launch --plan {input.plan:q} --tp {wildcards.tp:q} "
        "--cp {wildcards.cp:q} --timeout-s {params.timeout:q} --ranks-per-node {params.ranks_per_node:q} "
        "> {log:q} 2>&1 || rc=$?; "
        'if [ "$rc" -eq 1 ]; then echo "acceptance failed; report kept for the validation gate" >> {log:q}; '
        'echo "$job: acceptance failed, report kept for the validation gate"; '
        'elif [ "$rc" -ne 0 ]; then echo "$job: FAILED (exit $rc), log "{log:q}; exit "$rc"; '
        'else echo "$job: report written"; fi'
