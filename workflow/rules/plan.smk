rule plan:
    input:
        sources=SOURCES,
    output:
        f"{RUN}/plan.json",
    log:
        f"{RUN}/logs/plan.log",
    params:
        device=config["device"],
        backend=config["backend"],
        dtype=config["dtype"],
        real_vocab=config["real_vocab"],
        padded_vocab=config["padded_vocab"],
        tiles=config["num_vocab_tiles"],
        batch=config["batch"],
        seq=config["seq"],
        prompt_tokens=config["prompt_tokens"],
        seed=config["seed"],
        logit_scale=config["logit_scale"],
        cp_layout=config["cp_layout"],
        topologies=",".join(config["topologies"]),
        atol=config["tolerances"][config["dtype"]]["atol"],
        rtol=config["tolerances"][config["dtype"]]["rtol"],
        threads=config["threads_per_rank"],
        pg_timeout=config["pg_timeout_s"],
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "python -m rl_engine plan --device {params.device} --backend {params.backend} "
        "--dtype {params.dtype} --real-vocab {params.real_vocab} "
        "--padded-vocab {params.padded_vocab} --num-vocab-tiles {params.tiles} "
        "--batch {params.batch} --seq {params.seq} --prompt-tokens {params.prompt_tokens} "
        "--seed {params.seed} --logit-scale {params.logit_scale} "
        "--cp-layout {params.cp_layout} --topologies {params.topologies} "
        "--atol {params.atol} --rtol {params.rtol} --threads-per-rank {params.threads} "
        "--timeout-s {params.pg_timeout} --output {output} > {log} 2>&1"
