# The archive's own logs live outside the run directory, which the archive packs whole.


rule archive:
    input:
        summary=f"{RUN}/SUMMARY.md",
        validation=f"{RUN}/validation.json",
        crosscheck=f"{RUN}/crosscheck.json",
    output:
        archive=f"results/{RUN_NAME}.tar.gz",
        checksum=f"results/{RUN_NAME}.tar.gz.sha256",
    log:
        f"results/logs/{RUN_NAME}-archive.log",
    params:
        run=lambda wildcards, input: os.path.dirname(input.summary),
        schemas="schemas",
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine archive --run-dir {params.run} --schemas {params.schemas} "
        "--output {output.archive} > {log} 2>&1"


rule verify_archive:
    input:
        archive=f"results/{RUN_NAME}.tar.gz",
        checksum=f"results/{RUN_NAME}.tar.gz.sha256",
    output:
        f"results/{RUN_NAME}.verify.json",
    log:
        f"results/logs/{RUN_NAME}-verify.log",
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine verify {input.archive} --json {output} > {log} 2>&1"
