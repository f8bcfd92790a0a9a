# The resolved config (config files and --config overrides) becomes one validated case file
# (CASE_JSON, made when the Snakefile is parsed); the plan is built from that file alone, and
# each topology runs from the plan.


rule case:
    output:
        f"{RUN}/case.json",
    log:
        f"{RUN}/logs/case.log",
    params:
        case=CASE_JSON,
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine case --json {params.case:q} --output {output} > {log} 2>&1"


rule plan:
    input:
        case=f"{RUN}/case.json",
        sources=SOURCES,
    output:
        f"{RUN}/plan.json",
    log:
        f"{RUN}/logs/plan.log",
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine plan --case {input.case} --output {output} > {log} 2>&1"
