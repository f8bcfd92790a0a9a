# Config parity: {rollout: PATH, trainer: PATH[, ratio_bounds, num_vocab_tiles, backend]}: the
# parity report of two captures of the same tokens, in the run directory (parity.json and
# parity.png, rundir's stage list), checked by the validation gate, summarised and archived. A
# difference between the two sides is a finding the report records, not a failed stage: the verb
# exits 0 for it (--difference-exit-code 0); a refusal (exit 2) or a crash fails the rule. The
# engine's sources are an input, as for the topologies: our logprob is computed here.


rule parity:
    input:
        rollout=PARITY["rollout"],
        trainer=PARITY["trainer"],
        sources=SOURCES,
    output:
        json=stage_output("parity", 0),
        png=report(stage_output("parity", 1), caption="../report/parity.rst", category="3. Parity",
                   labels=report_parity_labels),
    log:
        stage_log("parity"),
    params:
        run=lambda wildcards, output: os.path.dirname(output.json),
        bounds=[str(bound) for bound in PARITY["ratio_bounds"]],
        tiles=PARITY["num_vocab_tiles"],
        backend=PARITY["backend"],
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine parity {input.rollout:q} {input.trainer:q} --output-dir {params.run:q} "
        "--backend {params.backend:q} --num-vocab-tiles {params.tiles:q} --ratio-bounds {params.bounds:q} "
        "--difference-exit-code 0 > {log:q} 2>&1"
