# What the gate validates: every artifact against the schemas (SCHEMAS, common.smk), every report against the
# acceptance, and the optional stages' outputs (parity.json's schema; the archived capture's SHA-256).


rule validation:
    input:
        environment=stage_output("environment"),
        regression=stage_output("regression"),
        case=stage_output("case"),
        plan=stage_output("plan"),
        reports=REPORTS,
        tensors=TENSORS,
        capture=CAPTURE_COPY,
        parity=PARITY_OUTPUTS,
        schemas=SCHEMAS,
    output:
        stage_output("validation"),
    log:
        stage_log("validation"),
    params:
        run=lambda wildcards, output: os.path.dirname(output[0]),
        schemas=lambda wildcards, input: os.path.dirname(input.schemas[0]),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine validate --run-dir {params.run:q} --schemas {params.schemas:q} "
        "--output {output:q} > {log:q} 2>&1"
