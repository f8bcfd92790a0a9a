# Config inputs: {capture: PATH, archive: true}: the case's captured file is copied into the run
# directory (rundir.CAPTURE) in one streamed pass that checks its SHA-256 against the case, so
# the archive packs it and `verify --recompute` replays from it without --capture. The source is
# an input: a file changed after the case was made is refused (its case would be another run).
# Like the archive (which packs the copy), it runs where snakemake runs: file I/O, no compute.


localrules:
    capture,


rule capture:
    input:
        case=stage_output("case"),
        source=config["inputs"]["capture"],
    output:
        stage_output("capture"),
    log:
        stage_log("capture"),
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine copy-capture --case {input.case:q} --output {output:q} > {log:q} 2>&1"
