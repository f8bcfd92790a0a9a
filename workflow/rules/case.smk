# The resolved config (config files and --config overrides) becomes one validated case file
# (CASE_JSON, made when the Snakefile is parsed); the plan is built from that file alone.


rule case:
    output:
        stage_output("case"),
    log:
        stage_log("case"),
    params:
        case=CASE_JSON,
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine case --json {params.case:q} --output {output:q} > {log:q} 2>&1"
