# The engine's sources as one input: regression, plan and topology depend on this file, not on
# every rl_engine/ source. The digest (computed when the Snakefile is parsed) is a param, so an
# edited source reruns this rule (Snakemake's params trigger), and the rewritten file reruns what
# depends on it. It lives beside the archive's logs, outside the run directory.


rule sources:
    output:
        SOURCES,
    log:
        stage_log("sources"),
    params:
        digest=SOURCE_DIGEST,
        repo=REPO,
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine sources --repo {params.repo:q} --digest {params.digest:q} --output {output:q} > {log:q} 2>&1"
