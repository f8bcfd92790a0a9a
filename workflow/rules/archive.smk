# The archive packs exactly its declared inputs (the run's evidence, the rules' logs, the
# schemas), so Snakemake decides what is stale: an edited report or tensor reruns the gates, the
# summary and the archive; a file no rule declares is never packed. The archive's own logs live
# outside the run directory. Each rule `exec`s its verb: the process Snakemake starts is the verb
# itself, so a SIGKILL of the job kills the archive writer, which no shell wrapper outlives.

STAGE_LOGS = [
    f"{RUN}/logs/{stage}.log"
    for stage in ("environment", "regression", "case", "plan", *[t.stem for t in TOPOLOGIES], "validation", "crosscheck",
                  "summary")
]


rule archive:
    input:
        environment=[f"{RUN}/environment.json", f"{RUN}/environment.txt"],
        regression=[f"{RUN}/regression.json", f"{RUN}/pytest-focused.log", f"{RUN}/pytest-junit.xml"],
        case=f"{RUN}/case.json",
        plan=f"{RUN}/plan.json",
        reports=REPORTS,
        tensors=TENSORS,
        validation=f"{RUN}/validation.json",
        crosscheck=f"{RUN}/crosscheck.json",
        summary=f"{RUN}/SUMMARY.md",
        logs=STAGE_LOGS,
        schemas=SCHEMAS,
    output:
        archive=f"results/{RUN_NAME}.tar.gz",
        checksum=f"results/{RUN_NAME}.tar.gz.sha256",
    log:
        f"results/logs/{RUN_NAME}-archive.log",
    params:
        run=lambda wildcards, input: os.path.dirname(input.summary),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine archive --run-dir {params.run} --output {output.archive} "
        "--schemas {input.schemas:q} --files {input.environment:q} {input.regression:q} {input.case:q} {input.plan:q} "
        "{input.reports:q} {input.tensors:q} {input.validation:q} {input.crosscheck:q} {input.summary:q} "
        "{input.logs:q} > {log} 2>&1"


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
        "exec python -m rl_engine verify {input.archive} --json {output} > {log} 2>&1"
