rule crosscheck:
    input:
        validation=f"{RUN}/validation.json",
        reports=REPORTS,
        tensors=TENSORS,
    output:
        f"{RUN}/crosscheck.json",
    log:
        f"{RUN}/logs/crosscheck.log",
    params:
        run=lambda wildcards, output: os.path.dirname(output[0]),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine crosscheck --run-dir {params.run} --output {output} > {log} 2>&1"
