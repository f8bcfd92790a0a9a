rule summary:
    input:
        validation=f"{RUN}/validation.json",
        crosscheck=f"{RUN}/crosscheck.json",
    output:
        f"{RUN}/SUMMARY.md",
    log:
        f"{RUN}/logs/summary.log",
    params:
        run=lambda wildcards, output: os.path.dirname(output[0]),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine summary --run-dir {params.run} --output {output} > {log} 2>&1"
