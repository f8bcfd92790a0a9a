rule environment:
    output:
        json=stage_output("environment", 0),
        txt=stage_output("environment", 1),
    log:
        stage_log("environment"),
    params:
        run=lambda wildcards, output: os.path.dirname(output.json),
        repo=REPO,
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine env --output-dir {params.run} --repo {params.repo} > {log} 2>&1"
