# The archive packs exactly its declared inputs (the run's evidence, the rules' logs, the
# schemas, the workflow's Snakefile and rules; the archived capture and the parity report when the
# config asks for them), so Snakemake decides what is stale: an edited report or tensor reruns the
# gates, the summary and the archive; a file no rule declares is never packed. Its times come from
# SOURCE_DATE_EPOCH (0 when unset): Snakemake does not rerun the archive when only that changes, so
# delete the archive to rebuild it under another one. The archive's own logs live
# outside the run directory. Each rule `exec`s its verb: the process Snakemake starts is the verb
# itself, so a SIGKILL of the job kills the archive writer, which no shell wrapper outlives.


rule archive:
    input:
        environment=[str(p) for p in STAGE_OF["environment"].outputs],
        regression=[str(p) for p in STAGE_OF["regression"].outputs],
        case=stage_output("case"),
        plan=stage_output("plan"),
        reports=REPORTS,
        tensors=TENSORS,
        validation=stage_output("validation"),
        crosscheck=stage_output("crosscheck"),
        summary=stage_output("summary"),
        capture=CAPTURE_COPY,
        parity=PARITY_OUTPUTS,
        logs=STAGE_LOGS,
        schemas=SCHEMAS,
        spec="docs/arithmetic.md",
        workflow=WORKFLOW_FILES,
    output:
        archive=stage_output("archive", 0),
        checksum=stage_output("archive", 1),
    log:
        stage_log("archive"),
    params:
        run=lambda wildcards, input: os.path.dirname(input.summary),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine archive --run-dir {params.run:q} --output {output.archive:q} --spec {input.spec:q} "
        "--workflow {input.workflow:q} --schemas {input.schemas:q} --files {input.environment:q} {input.regression:q} "
        "{input.case:q} {input.plan:q} {input.reports:q} {input.tensors:q} {input.validation:q} {input.crosscheck:q} {input.summary:q} "
        "{input.capture:q} {input.parity:q} {input.logs:q} > {log:q} 2>&1"


rule verify_archive:
    input:
        archive=stage_output("archive", 0),
        checksum=stage_output("archive", 1),
    output:
        report(stage_output("verify_archive"), caption="../report/verdict.rst", category="1. Verdict",
               labels=report_closing_labels(RUN, TOPOLOGIES, **STAGE_FLAGS)),
    log:
        stage_log("verify_archive"),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine verify {input.archive:q} --json {output:q} > {log:q} 2>&1"
