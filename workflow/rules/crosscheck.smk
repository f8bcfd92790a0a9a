rule crosscheck:
    input:
        validation=stage_output("validation"),
        reports=REPORTS,
        tensors=TENSORS,
    output:
        report(stage_output("crosscheck"), caption="../report/crosscheck.rst", category="2. Cross-topology check",
               labels=report_crosscheck_labels),
    log:
        stage_log("crosscheck"),
    params:
        run=lambda wildcards, output: os.path.dirname(output[0]),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine crosscheck --run-dir {params.run:q} --output {output:q} > {log:q} 2>&1"
