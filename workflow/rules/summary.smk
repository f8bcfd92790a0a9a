rule summary:
    input:
        validation=stage_output("validation"),
        crosscheck=stage_output("crosscheck"),
        capture=CAPTURE_COPY,
        parity=PARITY_OUTPUTS,
    output:
        report(stage_output("summary"), caption="../report/summary.rst", category="1. Verdict",
               labels={"What": "the run's summary, in Markdown"}),
    log:
        stage_log("summary"),
    params:
        run=lambda wildcards, output: os.path.dirname(output[0]),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine summary --run-dir {params.run:q} --output {output:q} > {log:q} 2>&1"
