rule environment:
    output:
        json=f"{RUN}/environment.json",
        txt=f"{RUN}/environment.txt",
    log:
        f"{RUN}/logs/environment.log",
    params:
        run=lambda wildcards, output: os.path.dirname(output.json),
        repo=REPO,
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine env --output-dir {params.run} --repo {params.repo} > {log} 2>&1"
