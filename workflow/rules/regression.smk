# The time limit is the verb's own (--timeout-s): GNU timeout would move pytest out of the
# terminal's process group, and Ctrl-C would not reach it. Every test path and pytest argument is
# quoted (:q), so shell metacharacters in the config reach pytest as text and run nothing. Its
# progress goes to the console (fd 3, the job's stderr before the log takes it): the focused
# suite is the run's longest wait.


rule regression:
    input:
        # the files; a test id (FILE::NAME) runs as given but depends on its file
        tests=list(dict.fromkeys(test.split("::", 1)[0] for test in config["regression"]["tests"])),
        sources=SOURCES,
    output:
        json=stage_output("regression", 0),
        log=stage_output("regression", 1),
        junit=stage_output("regression", 2),
    log:
        stage_log("regression"),
    params:
        run=lambda wildcards, output: os.path.dirname(output.json),
        tests=config["regression"]["tests"],
        extra=[f"--pytest-arg={arg}" for arg in config["regression"].get("pytest_args", [])],
        timeout=config["regression"].get("timeout_s", 1800),
        reuse=REUSE_DIR,
    threads: 2
    conda:
        "../envs/rl_engine.yaml"
    shell:
        "exec python -m rl_engine regression --output-dir {params.run:q} --tests {params.tests:q} "
        "{params.extra:q} --timeout-s {params.timeout:q} --reuse-dir {params.reuse:q} --progress-fd 3 3>&2 > {log:q} 2>&1"
