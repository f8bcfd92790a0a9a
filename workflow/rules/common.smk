# The workflow's shared state, built from rl_engine.rundir's one stage list (through
# rl_engine.workflow, the one module the workflow imports): the run directory, every stage's
# outputs and log, the reports and tensors, the schemas and the logs the archive packs.

from rl_engine.workflow import (
    check_capture_location,
    config_case,
    config_topologies,
    parity_settings,
    report_closing_labels,
    report_crosscheck_labels,
    report_parity_labels,
    run_name,
    run_stages,
    source_digest,
    stage_flags,
    stages,
    topology_rule_files,
)

REPO = str(Path(workflow.basedir).parent)
RUN_NAME = run_name(config, REPO)
RUN = f"results/{RUN_NAME}"
# environment captures and passing focused suites, shared by the runs of the same code, tests and
# environment (rl_engine/record/reuse.py): a new case copies them instead of capturing and testing again
REUSE_DIR = "results/.reuse"
check_capture_location(config, RUN)  # before any job: a capture inside RUN would be taken for an output
TOPOLOGIES = config_topologies(config)
# The case file's JSON (case rule): the one thing of the config that the plan and the runs read.
CASE_JSON = json.dumps(config_case(config), sort_keys=True, allow_nan=False, separators=(",", ":"))

# The optional stages the config asks for: capture (inputs.archive: true) and parity (a parity: section).
STAGE_FLAGS = stage_flags(config)
PARITY = parity_settings(config)  # the parity: section with its defaults, or None
STAGES = stages(RUN, TOPOLOGIES, **STAGE_FLAGS)
STAGE_OF = {stage.rule: stage for stage in STAGES if stage.rule != "topology"}
# The engine's sources as one input (rules/sources.smk): their digest now, and the file that records it.
SOURCE_DIGEST = source_digest(REPO)
SOURCES = str(STAGE_OF["sources"].outputs[0])
TOPOLOGY_OUTPUTS, TOPOLOGY_LOG = topology_rule_files(RUN)  # with the {tp} and {cp} wildcards
TOPOLOGY_STAGES = [stage for stage in STAGES if stage.rule == "topology"]
REPORTS = [str(stage.outputs[0]) for stage in TOPOLOGY_STAGES]
TENSORS = [str(path) for stage in TOPOLOGY_STAGES for path in stage.outputs[1:]]
# Every stage's output: rule all's targets, so a deleted or failed one is rebuilt on the next run.
ALL_OUTPUTS = [str(path) for stage in STAGES for path in stage.outputs]
# The optional stages' outputs (empty lists when the config leaves the stage out): what the gates,
# the summary and the archive take as inputs besides the rest.
CAPTURE_COPY = [str(p) for p in STAGE_OF["capture"].outputs] if "capture" in STAGE_OF else []
PARITY_OUTPUTS = [str(p) for p in STAGE_OF["parity"].outputs] if "parity" in STAGE_OF else []
# The logs of the run directory's stages: the archive packs them.
STAGE_LOGS = [str(stage.log) for stage in run_stages(STAGES)]
# What the gate validates against; the archive ships the same files (and validation.json records their hashes).
SCHEMAS = sorted(str(p.relative_to(REPO)) for p in Path(REPO, "schemas").glob("*.schema.json"))
# The workflow's definition the archive packs under workflow/ (the RO-Crate's main entity and its rules).
WORKFLOW_FILES = [str(Path(workflow.basedir, "Snakefile").relative_to(REPO)),
                  *sorted(str(p.relative_to(REPO)) for p in Path(workflow.basedir, "rules").glob("*.smk"))]


def stage_output(rule, index=0):
    """The rule's ``index``-th output, as rundir.stages lists it."""
    return str(STAGE_OF[rule].outputs[index])


def stage_log(rule):
    return str(STAGE_OF[rule].log)
