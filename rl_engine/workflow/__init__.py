"""The one module ``workflow/Snakefile`` and its rules import, in four parts:

- :mod:`rl_engine.workflow.config`: the config check (schema, the case's rules, this machine),
  before any rule exists, so ``snakemake -n`` refuses a campaign that cannot run;
- :mod:`rl_engine.workflow.naming`: the run's name and its case file;
- :mod:`rl_engine.workflow.resources`: a topology job's Slurm resources and the GPU accounting;
- :mod:`rl_engine.workflow.closing`: the console's closing table and the report's labels.

The run directory's file names and stage list are :mod:`rl_engine.rundir`'s (re-exported here
for the rules: ``workflow/rules/common.smk`` builds the workflow's shared state from
:func:`rl_engine.rundir.stages`), the case's facts :mod:`rl_engine.campaign.case`'s.
"""

from __future__ import annotations

from rl_engine.record.sources import source_digest  # the sources rule's param
from rl_engine.rundir import Stage, Topology, run_stages, stages, topology_rule_files
from rl_engine.workflow.closing import (
    LOG_TAIL_LINES,
    VERIFIED,
    Closing,
    closing,
    log_tail,
    print_closing,
    print_closing_at_exit,
    print_closing_when_nothing_to_do,
    report_closing_labels,
    report_crosscheck_labels,
    report_parity_labels,
)
from rl_engine.workflow.config import (
    ARCHIVE_PACKAGES,
    PARITY_DEFAULTS,
    REGRESSION_ROOT,
    Origin,
    WorkflowConfigError,
    archive_problems,
    case_values,
    check_capture_location,
    check_config,
    check_workflow_config,
    closest_keys,
    config_capture,
    config_parity,
    config_topologies,
    load_config,
    machine_problems,
    main,
    parity_settings,
    regression_problems,
    resolve_auto_tiles,
    stage_flags,
    workflow_origin,
)
from rl_engine.workflow.naming import (
    config_case,
    config_case_hash,
    run_name,
)
from rl_engine.workflow.resources import (
    GPUS,
    MEM_MB_LAUNCH,
    MEM_MB_PER_RANK,
    RUNTIME_MARGIN_MIN,
    TOPOLOGY_RESOURCES,
    machine_gpus,
    provide_gpus,
    provided_gpus,
    register_gpus,
    topology_gpus,
    topology_resource_functions,
    topology_resources,
)

__all__ = [
    "ARCHIVE_PACKAGES",
    "archive_problems",
    "Closing",
    "GPUS",
    "LOG_TAIL_LINES",
    "MEM_MB_LAUNCH",
    "MEM_MB_PER_RANK",
    "Origin",
    "PARITY_DEFAULTS",
    "REGRESSION_ROOT",
    "RUNTIME_MARGIN_MIN",
    "Stage",
    "TOPOLOGY_RESOURCES",
    "Topology",
    "VERIFIED",
    "WorkflowConfigError",
    "case_values",
    "check_capture_location",
    "check_config",
    "check_workflow_config",
    "closest_keys",
    "closing",
    "config_capture",
    "config_case",
    "config_case_hash",
    "config_parity",
    "config_topologies",
    "load_config",
    "log_tail",
    "machine_gpus",
    "machine_problems",
    "main",
    "parity_settings",
    "print_closing",
    "print_closing_at_exit",
    "print_closing_when_nothing_to_do",
    "provide_gpus",
    "provided_gpus",
    "register_gpus",
    "regression_problems",
    "report_closing_labels",
    "report_crosscheck_labels",
    "report_parity_labels",
    "resolve_auto_tiles",
    "run_name",
    "run_stages",
    "source_digest",
    "stage_flags",
    "stages",
    "topology_gpus",
    "topology_resource_functions",
    "topology_resources",
    "topology_rule_files",
    "workflow_origin",
]
