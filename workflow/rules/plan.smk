# The plan is built from the case file alone, and each topology runs from the plan.


rule plan:
    input:
        case=stage_output("case"),
        sources=SOURCES,
    output:
        stage_output("plan"),
    log:
        stage_log("plan"),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine plan --case {input.case:q} --output {output:q} > {log:q} 2>&1"
