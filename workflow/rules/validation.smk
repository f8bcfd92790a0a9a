REPORTS = [f"{RUN}/{t.stem}.json" for t in TOPOLOGIES]
TENSORS = [f"{RUN}/{t.stem}.{name}.f32" for t in TOPOLOGIES for name in ("logp", "lse", "entropy")]
# What the gate validates against; the archive ships the same files (and validation.json records their hashes).
SCHEMAS = sorted(str(p.relative_to(REPO)) for p in Path(REPO, "schemas").glob("*.schema.json"))


rule validation:
    input:
        environment=f"{RUN}/environment.json",
        regression=f"{RUN}/regression.json",
        case=f"{RUN}/case.json",
        plan=f"{RUN}/plan.json",
        reports=REPORTS,
        tensors=TENSORS,
        schemas=SCHEMAS,
    output:
        f"{RUN}/validation.json",
    log:
        f"{RUN}/logs/validation.log",
    params:
        run=lambda wildcards, output: os.path.dirname(output[0]),
        schemas=lambda wildcards, input: os.path.dirname(input.schemas[0]),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine validate --run-dir {params.run} --schemas {params.schemas} "
        "--output {output} > {log} 2>&1"
