rule environment:
    output:
        json=stage_output("environment", 0),
        txt=stage_output("environment", 1),
    log:
        stage_log("environment"),
    params:
        run=lambda wildcards, output: os.path.dirname(output.json),
        repo=REPO,
        reuse=REUSE_DIR,
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine env --output-dir {params.run:q} --repo {params.repo:q} --reuse-dir {params.reuse:q} "
        "> {log:q} 2>&1"
