# The workflow's shared state, built from rl_engine.rundir's one stage list (through
# rl_engine.workflow, the one module the workflow imports): the run directory, every stage's
# outputs and log, the reports and tensors, the schemas and the logs the archive packs.

from rl_engine.workflow import (
    config_case,
    engine_sources,
    parse_topologies,
    run_name,
    run_stages,
    stages,
    topology_rule_files,
)

REPO = str(Path(workflow.basedir).parent)
RUN_NAME = run_name(config, REPO)
RUN = f"results/{RUN_NAME}"
TOPOLOGIES = parse_topologies(config["topologies"])
# The case file's JSON (case rule): the one thing of the config that the plan and the runs read.
CASE_JSON = json.dumps(config_case(config), sort_keys=True, allow_nan=False, separators=(",", ":"))
SOURCES = engine_sources(REPO)

STAGES = stages(RUN, TOPOLOGIES)
STAGE_OF = {stage.rule: stage for stage in STAGES if stage.rule != "topology"}
TOPOLOGY_OUTPUTS, TOPOLOGY_LOG = topology_rule_files(RUN)  # with the {tp} and {cp} wildcards
TOPOLOGY_STAGES = [stage for stage in STAGES if stage.rule == "topology"]
REPORTS = [str(stage.outputs[0]) for stage in TOPOLOGY_STAGES]
TENSORS = [str(path) for stage in TOPOLOGY_STAGES for path in stage.outputs[1:]]
# Every stage's output: rule all's targets, so a deleted or failed one is rebuilt on the next run.
ALL_OUTPUTS = [str(path) for stage in STAGES for path in stage.outputs]
# The logs of the run directory's stages: the archive packs them.
STAGE_LOGS = [str(stage.log) for stage in run_stages(STAGES)]
# What the gate validates against; the archive ships the same files (and validation.json records their hashes).
SCHEMAS = sorted(str(p.relative_to(REPO)) for p in Path(REPO, "schemas").glob("*.schema.json"))


def stage_output(rule, index=0):
    """The rule's ``index``-th output, as rundir.stages lists it."""
    return str(STAGE_OF[rule].outputs[index])


def stage_log(rule):
    return str(STAGE_OF[rule].log)
