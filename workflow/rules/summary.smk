rule summary:
    input:
        validation=stage_output("validation"),
        crosscheck=stage_output("crosscheck"),
        capture=CAPTURE_COPY,
        parity=PARITY_OUTPUTS,
    output:
        stage_output("summary"),
    log:
        stage_log("summary"),
    params:
        run=lambda wildcards, output: os.path.dirname(output[0]),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine summary --run-dir {params.run} --output {output} > {log} 2>&1"
