"""The one module ``workflow/Snakefile`` imports: config check, run name, Slurm resources, closing table.

Config: ``check_config`` is what ``workflow/Snakefile`` calls before any rule exists, so
``snakemake -n`` already refuses a campaign that cannot run. After the schema it runs the
case's rules (:mod:`rl_engine.campaign.case`: the case's parameters, each topology, the
matrix) on the config's values, and finally builds the case file (:func:`config_case`, what the
case rule writes and the plan is built from), so a config that passes here cannot fail at plan
time. Nothing here imports torch at import time or builds a command. Every error names the
config key, the value and the fix, and says when the value came from ``--config`` rather than
the config file. :func:`check_workflow_config` adds what only this machine can answer (CUDA for
``device: cuda``); it is what the Snakefile calls, so ``snakemake -n`` refuses a campaign that
cannot run here before any job.

Resources: what a topology job asks a cluster for (:func:`topology_resources`) and the GPU
accounting of a local run (:func:`provide_gpus`).

Closing: the console's last table (:func:`print_closing`), from the files the stages left.

The run directory's file names and stage list are :mod:`rl_engine.rundir`'s; ``workflow/rules/
common.smk`` builds the workflow's shared state from :func:`rl_engine.rundir.stages`.
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import functools
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rl_engine import jsonio, schemas
from rl_engine.campaign.case import (
    TOPOLOGY_FIELDS,
    Case,
    CaseError,
    case_document,
    case_problems,
    check_topology,
    config_case_fields,
    config_key_of,
    matrix_problem,
    parse_topologies,
)
from rl_engine.campaign.casename import NOGIT, RunName, parity_identity
from rl_engine.campaign.nodes import NodeLayout, fitting_ranks_per_node, layout_problem
from rl_engine.distributed.bounds import BoundsError, auto_vocab_tiles
from rl_engine.record.gitstate import GitStateError, read_git_state
from rl_engine.record.sources import source_digest  # noqa: F401 (the Snakefile's: the sources rule's param)
from rl_engine.rundir import Stage, Topology, run_stages, stages, topology_rule_files  # noqa: F401 (the Snakefile's)

RUNTIME_MARGIN_MIN = 5  # a topology job's Slurm time limit beyond topology_timeout_s
MEM_MB_PER_RANK = 2000  # a topology job's memory per node: this per rank on the node, plus the launchers'
MEM_MB_LAUNCH = 1000


class WorkflowConfigError(ValueError):
    """A config.yaml that cannot drive a campaign; names the key, the value and the fix."""


@dataclass(frozen=True)
class Origin:
    """Where the config's values came from: ``cli`` holds Snakemake's ``--config`` values
    (top-level keys), ``files`` the config files' merged values before ``--config`` and
    ``file_of`` the config file that set each top-level key last (default: config.yaml)."""

    cli: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, Any] = field(default_factory=dict)
    file_of: Mapping[str, str] = field(default_factory=dict)

    def top(self, key: str) -> str:
        return re.split(r"[.\[]", key, maxsplit=1)[0]

    def from_cli(self, key: str) -> bool:
        return self.top(key) in self.cli

    def describe(self, key: str, value: Any) -> str:
        """``config key 'K' has value V``, plus where V came from when it was ``--config``."""
        text = f"config key {key!r} has value {value!r}"
        if self.from_cli(key):
            top = self.top(key)
            text += f" (given with --config {top}=...; "
            text += (f"the config file has {top}: {self.files[top]!r})" if top in self.files
                     else "the config file does not set it)")
        return text

    def fix(self, key: str) -> str:
        if self.from_cli(key):
            return f"fix the value given with --config {self.top(key)}=... (see schemas/config.schema.json)"
        return f"fix the value in {self.file_of.get(self.top(key), 'config.yaml')} (see schemas/config.schema.json)"


def _key(path: Any) -> str:
    parts = [str(p) for p in path]
    return ".".join(parts) if parts else "<top level>"


def closest_keys(unknown: Sequence[str], allowed: Sequence[str]) -> str:
    """``did you mean 'seed' for 'sead'? `` for every unknown key with a close allowed one (difflib),
    else the empty string."""
    pairs = [(key, difflib.get_close_matches(key, allowed, n=1)) for key in unknown]
    hints = [f"{match[0]!r} for {key!r}" for key, match in pairs if match]
    return f"did you mean {', '.join(hints)}? " if hints else ""


def _schema_message(error: Any, origin: Origin) -> str:
    key = _key(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        where = f" under {key!r}" if error.absolute_path else ""
        if not error.absolute_path and any(k in origin.cli for k in extra):
            where = " (given with --config)"
        return (
            f"unknown config key(s) {extra}{where}; {closest_keys(extra, allowed)}remove or rename them "
            f"(allowed keys: {allowed})"
        )
    if error.validator == "required":
        return f"config key {key!r}: {error.message}; add it (see the default config.yaml)"
    if error.validator == "minItems" and key == "topologies":
        return f"{origin.describe('topologies', error.instance)}: {matrix_problem(len(error.instance))}"
    return f"{origin.describe(key, error.instance)}: {error.message}; {origin.fix(key)}"


def _non_finite(value: Any) -> list[tuple[str, float]]:
    """Key paths of NaN/infinite numbers (YAML ``.nan``/``.inf``; the schema's bounds pass NaN)."""
    return [(_key(path), leaf) for path, leaf in jsonio.find_leaves(value, jsonio.is_non_finite_float)]


def config_topologies(config: Mapping[str, Any]) -> list[Topology]:
    """The config's ``topologies`` (``"<tp>x<cp>"`` strings) as run-directory topologies, parsed by
    the case's parser (:func:`rl_engine.campaign.case.parse_topologies`)."""
    items = config["topologies"]
    try:
        return [Topology(tp, cp) for tp, cp in parse_topologies(items)]
    except CaseError as exc:
        raise WorkflowConfigError(f"config key 'topologies' has value {items!r}: {exc}") from None


@functools.lru_cache(maxsize=8)
def _capture_record(path: str, archive: bool, size: int, mtime_ns: int) -> tuple[str, str]:
    """The case's capture record of a file, once per file state in a process (it hashes the file)."""
    from rl_engine.campaign.captured import capture_record  # imports torch
    from rl_engine.capture.format import CaptureError

    try:
        return "", jsonio.dumps(capture_record(path, archive))
    except CaptureError as exc:
        return str(exc), ""


def config_capture(config: dict[str, Any], origin: Origin = Origin()) -> dict[str, Any] | None:
    """The case's ``capture`` record of ``inputs: {capture: PATH[, archive: BOOL]}`` (a path relative
    to the working directory), or None for the input recipe; refuses a file that is not a capture.
    With ``archive: true`` the workflow's capture stage copies the file into the run directory and the
    archive packs it (:data:`rl_engine.rundir.CAPTURE`)."""
    inputs = config.get("inputs")
    if inputs is None:
        return None
    path = inputs["capture"]
    problem, record = _capture_record(str(path), bool(inputs.get("archive", False)), *_file_state(path))
    if problem:
        raise WorkflowConfigError(f"{origin.describe('inputs.capture', path)}: {problem}; "
                                  f"{origin.fix('inputs.capture')}")
    value: dict[str, Any] = jsonio.loads(record)
    return value


def check_capture_location(config: dict[str, Any], run_dir: str | os.PathLike[str]) -> None:
    """Refuse ``inputs.capture`` inside the run directory this config writes (``results/<run>``):
    the workflow would take the file for one of its own outputs (with ``archive: true``, the
    capture stage's ``capture.safetensors``) and remove it, the only copy; a reviewer reproducing
    from an extracted archive copies the capture out first."""
    inputs = config.get("inputs")
    if inputs is None:
        return
    capture, run = Path(inputs["capture"]).resolve(), Path(run_dir).resolve()
    if capture == run or run in capture.parents:
        raise WorkflowConfigError(
            f"config key 'inputs.capture' has value {str(inputs['capture'])!r}, inside the run directory "
            f"{run_dir} that this config writes: the workflow would treat it as its own output and could "
            "remove it; copy the capture out of the run directory (for example next to config.yaml) and "
            "point inputs.capture there")


def _file_state(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a file (``(-1, -1)`` when it cannot be read): a cache key of what was read."""
    try:
        stat = os.stat(path)
        return stat.st_size, stat.st_mtime_ns
    except OSError:
        return -1, -1


# ----- the parity stage (config ``parity:``) ------------------------------------------------------
PARITY_DEFAULTS: dict[str, Any] = {"ratio_bounds": [0.8, 1.2], "num_vocab_tiles": 1,
                                   "backend": "pytorch-vocab-parallel-logp-ws2"}


def parity_settings(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``parity:`` section with its defaults filled (what the parity rule passes the verb), or None."""
    section = config.get("parity")
    return None if section is None else {**PARITY_DEFAULTS, **section}


@functools.lru_cache(maxsize=8)
def _parity_check(rollout: str, trainer: str, bounds: tuple[float, float], tiles: int, backend: str,
                  states: tuple[int, ...]) -> tuple[str, str, str]:
    """``(problem, rollout sha256, trainer sha256)`` of a parity section, once per file state in a
    process (it reads both captures' headers, targets and masks, and hashes both files)."""
    from rl_engine.campaign.captured import file_sha256  # imports torch
    from rl_engine.capture.parity import ParityError, ParityOptions, check_pair

    try:
        check_pair(Path(rollout), Path(trainer), ParityOptions(backend, tiles, bounds))
        return "", file_sha256(rollout), file_sha256(trainer)
    except (ParityError, OSError) as exc:
        return str(exc), "", ""


def config_parity(config: dict[str, Any], origin: Origin = Origin()) -> dict[str, Any] | None:
    """The parity stage's part of the case hash (:func:`rl_engine.campaign.casename.parity_identity`:
    both captures' SHA-256 and the verb's options), or None without a ``parity:`` section.

    Refuses, naming the key, the value and the fix, what the parity verb would refuse without
    reading logits: a missing file or one that is not a capture, two captures of different tokens,
    targets or masks, a tile count that does not divide the vocabulary, bounds outside
    ``0 < LOW < 1 < HIGH``, or a backend that does not run on the CPU.
    """
    settings = parity_settings(config)
    if settings is None:
        return None
    missing = [side for side in ("rollout", "trainer") if not Path(settings[side]).is_file()]
    if missing:
        side = missing[0]
        raise WorkflowConfigError(f"{origin.describe(f'parity.{side}', settings[side])}: no such file (looked in "
                                  f"{Path.cwd()}); name the {side} engine's capture (docs/capture.md); "
                                  f"{origin.fix(f'parity.{side}')}")
    bounds = tuple(float(b) for b in settings["ratio_bounds"])
    states = (*_file_state(settings["rollout"]), *_file_state(settings["trainer"]))
    problem, rollout_sha, trainer_sha = _parity_check(str(settings["rollout"]), str(settings["trainer"]), bounds,
                                                      settings["num_vocab_tiles"], settings["backend"], states)
    if problem:
        raise WorkflowConfigError(f"{origin.describe('parity', config['parity'])}: the parity stage would refuse "
                                  f"these captures: {problem}; {origin.fix('parity')}")
    return parity_identity(rollout_sha, trainer_sha, list(bounds), settings["num_vocab_tiles"], settings["backend"])


def stage_flags(config: dict[str, Any]) -> dict[str, bool]:
    """The optional stages a checked config asks for (:func:`rl_engine.rundir.stages`' keywords):
    ``capture`` (``inputs.archive: true``) and ``parity`` (a ``parity:`` section)."""
    inputs = config.get("inputs") or {}
    return {"capture": inputs.get("archive", False) is True, "parity": config.get("parity") is not None}


def case_values(config: dict[str, Any], origin: Origin = Origin()) -> dict[str, Any]:
    """The :class:`Case` fields of a schema-valid config (:func:`rl_engine.campaign.case.config_case_fields`),
    with the record of its capture (:func:`config_capture`: the file is read here)."""
    return config_case_fields(config, config_capture(config, origin))


REGRESSION_ROOT = "tests"  # the focused regression runs test files of the checkout's tests/ only


def regression_problems(config: dict[str, Any], origin: Origin, root: Path | None = None) -> list[str]:
    """``regression.tests``: each a file inside ``<root>/tests/`` (default root: the working
    directory, where Snakemake resolves the rule's inputs), named without ``..`` or an absolute
    path; a ``::`` test id after the file is allowed."""
    base = Path.cwd() if root is None else Path(root)
    tests_dir = (base / REGRESSION_ROOT).resolve()
    problems = []
    for index, item in enumerate(config["regression"]["tests"]):
        key = f"regression.tests[{index}]"
        path = item.split("::", 1)[0]
        parts = Path(path).parts
        if Path(path).is_absolute() or ".." in parts or not parts or parts[0] != REGRESSION_ROOT:
            why = "must be a relative path inside tests/ without '..'"
        elif not (base / path).resolve().is_relative_to(tests_dir):
            why = "leads out of tests/ (through a symbolic link)"
        elif not (base / path).is_file():
            why = f"does not exist (looked in {base})"
        else:
            continue
        problems.append(f"{origin.describe(key, item)}: the test file {why}; name a test file of tests/ "
                        f"(e.g. tests/test_logprob_contract.py); {origin.fix(key)}")
    return problems


def _campaign_problems(config: dict[str, Any], origin: Origin) -> list[str]:
    """The runner's plan-time rules on a schema-valid config, as config-key messages."""
    problems: list[str] = regression_problems(config, origin)
    dtype = config["dtype"]
    has_tolerance = dtype in config["tolerances"]
    if not has_tolerance:
        problems.append(
            f"config key 'tolerances' has no entry for dtype {dtype!r}; add "
            f"tolerances.{dtype}: {{atol: ..., rtol: ...}}"
        )
    try:
        values = case_values(config, origin)
    except WorkflowConfigError as exc:
        return [*problems, str(exc)]
    broken: set[str] = set()
    for case_field, message in case_problems(values):
        broken.add(case_field)
        if case_field in ("atol", "rtol") and not has_tolerance:
            continue  # already reported: the whole entry is missing
        key, value = config_key_of(case_field, config)
        problems.append(f"{origin.describe(key, value)}: {message}")
    pairs = config_topologies(config)
    if not broken & set(TOPOLOGY_FIELDS):  # the topology rules need those fields valid
        for index, topo in enumerate(pairs):
            try:
                check_topology(topo.tp, topo.cp, **{name: values[name] for name in TOPOLOGY_FIELDS})
            except CaseError as exc:
                problems.append(f"{origin.describe(f'topologies[{index}]', config['topologies'][index])}: {exc}")
    problem = matrix_problem(len(pairs))
    if problem is not None:
        problems.append(f"{origin.describe('topologies', config['topologies'])}: {problem}")
    for index, topo in enumerate(pairs):
        problem = layout_problem(topo.world_size, config["ranks_per_node"])
        if problem is not None:
            fitting = fitting_ranks_per_node([t.world_size for t in pairs])
            problems.append(
                f"{origin.describe('ranks_per_node', config['ranks_per_node'])}: topology "
                f"{config['topologies'][index]!r} (topologies[{index}]): {problem}; values that fit every "
                f"listed topology: {fitting}"
            )
    if not problems:
        # the case rule's own path: a schema-valid case file, or this names why not
        try:
            document = case_document(Case(**values), tuple((t.tp, t.cp) for t in pairs))
        except CaseError as exc:
            return [f"the runner refuses this campaign at plan time: {exc}; fix the config key it names"]
        problems += [f"the case file of this config does not match schemas/case.schema.json: {p}"
                     for p in schemas.errors(document, "case")]
    return problems


def topology_resources(config: dict[str, Any], tp: int, cp: int) -> dict[str, Any]:
    """What the topology rule of ``tp x cp`` asks a cluster for (Snakemake resources).

    ``nodes`` from ``ranks_per_node``; one task per node (each runs that node's torchrun);
    ``cpus_per_task`` the node's ranks x ``threads_per_rank``; ``mem_mb`` (per node)
    :data:`MEM_MB_PER_RANK` per rank on the node plus :data:`MEM_MB_LAUNCH`; ``runtime`` (minutes) the
    topology's time limit plus :data:`RUNTIME_MARGIN_MIN` for start-up and clean-up, so
    ``launch``'s own limit always fires first; ``mpi="srun"`` when it spans nodes (the
    executor then leaves the srun to the rule); on cuda ``gres=gpu:<ranks on a node>``. One
    node keeps ``tasks=1`` and no ``mpi``: Snakemake's Slurm executor refuses MPI with one task.
    """
    layout = NodeLayout(tp * cp, config["ranks_per_node"])
    resources: dict[str, Any] = {
        "nodes": layout.nodes,
        "tasks": layout.nodes,
        "cpus_per_task": layout.ranks_on_node * config["threads_per_rank"],
        "mem_mb": layout.ranks_on_node * MEM_MB_PER_RANK + MEM_MB_LAUNCH,
        "runtime": math.ceil(config["topology_timeout_s"] / 60) + RUNTIME_MARGIN_MIN,
        "mpi": "srun" if layout.nodes > 1 else None,
        "gres": f"gpu:{layout.ranks_on_node}" if config["device"] == "cuda" else None,
        # with gres the executor would turn `tasks` into --ntasks-per-gpu; 0 keeps it out
        "tasks_per_gpu": 0 if config["device"] == "cuda" else None,
    }
    return resources


TOPOLOGY_RESOURCES = ("nodes", "tasks", "cpus_per_task", "mem_mb", "runtime", "mpi", "gres", "tasks_per_gpu")


def topology_resource_functions(config: dict[str, Any]) -> dict[str, Callable[[Any], Any]]:
    """The topology rule's ``resources:``, one function of the wildcards per resource."""

    def resource(key: str) -> Callable[[Any], Any]:
        return lambda wildcards: topology_resources(config, int(wildcards.tp), int(wildcards.cp))[key]

    return {key: resource(key) for key in TOPOLOGY_RESOURCES}


def check_config(config: dict[str, Any], origin: Origin = Origin()) -> dict[str, Any]:
    """Validate ``config`` against its schema and the runner's plan-time rules; return it, with
    ``num_vocab_tiles: auto`` replaced in place by the count it resolves to (:func:`resolve_auto_tiles`).

    ``origin`` says which values came from ``--config``: their messages say so.
    """
    validator = schemas.validator("config")
    found = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if found:
        raise WorkflowConfigError(_schema_message(found[0], origin))
    resolve_auto_tiles(config, origin)
    bad_numbers = _non_finite(config)
    if bad_numbers:
        raise WorkflowConfigError("; ".join(
            f"{origin.describe(key, value)}: not a finite number; use a finite value" for key, value in bad_numbers
        ))
    problems = _campaign_problems(config, origin)
    try:
        config_parity(config, origin)
    except WorkflowConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise WorkflowConfigError("; ".join(problems))
    return config


def resolve_auto_tiles(config: dict[str, Any], origin: Origin = Origin()) -> None:
    """``num_vocab_tiles: auto``: the count :func:`rl_engine.distributed.bounds.auto_vocab_tiles`
    gives for ``padded_vocab`` and the largest TP degree of ``topologies`` (the API's rule), written
    into ``config`` before anything reads it. The case, its hash and the run name then hold the
    count itself: ``auto`` and the count it resolves to are the same run."""
    if config.get("num_vocab_tiles") != "auto":
        return
    max_tp = max(t.tp for t in config_topologies(config))
    try:
        config["num_vocab_tiles"] = auto_vocab_tiles(config["padded_vocab"], max_tp)
    except BoundsError as exc:
        raise WorkflowConfigError(f"{origin.describe('num_vocab_tiles', 'auto')}: {exc}") from None


def machine_problems(config: dict[str, Any], origin: Origin = Origin()) -> list[str]:
    """What this machine cannot run of a schema-valid config: ``device: cuda`` without CUDA/NCCL.

    The message is the one the ranks would raise (:func:`rl_engine.distributed.mesh.check_device`),
    given before any job instead of in every topology's log. ``device: cpu`` is not checked here
    (its only requirement, a torch build with gloo, the ranks check): the check imports torch,
    about 3 s in every parse of the Snakefile, and every Slurm job parses it again.
    """
    if config["device"] == "cpu":
        return []
    from rl_engine.distributed.mesh import MeshError, check_device  # imports torch.distributed

    try:
        check_device(config["device"])
    except MeshError as exc:
        return [f"{origin.describe('device', config['device'])}: {exc}"]
    return []


def check_workflow_config(config: dict[str, Any], origin: Origin = Origin()) -> dict[str, Any]:
    """:func:`check_config`, then :func:`machine_problems`: what ``workflow/Snakefile`` calls."""
    check_config(config, origin)
    problems = machine_problems(config, origin)
    if problems:
        raise WorkflowConfigError("; ".join(problems))
    return config


def workflow_origin(cli: Mapping[str, Any], configfiles: Sequence[str | Path]) -> Origin:
    """The :class:`Origin` of a Snakemake run: ``--config`` values and the config files' merged values."""
    files: dict[str, Any] = {}
    file_of: dict[str, str] = {}
    for path in configfiles:
        try:
            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle)
        except OSError:
            continue  # Snakemake itself reports a config file it cannot read
        if isinstance(data, dict):
            files.update(data)
            file_of.update({key: Path(path).name for key in data})
    return Origin(dict(cli), files, file_of)


def load_config(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict):
        raise WorkflowConfigError(f"{path}: the top level must be a mapping of config keys")
    return check_config(data)


def config_case_hash(config: dict[str, Any]) -> str:
    """The case hash (:meth:`rl_engine.campaign.case.Case.run_hash`) of a checked config (a capture's
    path does not count; a ``parity:`` section's captures and options do, by hash)."""
    regression = config["regression"]
    return Case.from_config(config, config_capture(config)).run_hash(config["topologies"], regression["tests"],
                                                regression.get("pytest_args", []), config_parity(config))


def run_name(config: dict[str, Any], repo: str | Path) -> str:
    """``<campaign>-<short commit>[-dirty]-case-<hash>``; ``nogit`` for the commit when git cannot be read.

    The case hash (:func:`config_case_hash`) covers every value that determines the evidence, so
    a changed topology list, seed or device is a new run directory and a new archive, and never
    meets the files of another campaign. Dirty means what environment.json's ``git.dirty`` means
    (:mod:`rl_engine.record.gitstate`: a changed tracked file or an untracked file that is not
    ignored), so the two always agree. Stable across reruns of the same tree and case, so a
    rerun completes the same run directory.
    """
    digest = config_case_hash(config)
    try:
        state = read_git_state(repo)
    except GitStateError:
        return str(RunName(config["campaign"], NOGIT, False, digest))
    return str(RunName(config["campaign"], state.short_commit, state.dirty, digest))


def config_case(config: dict[str, Any]) -> dict[str, Any]:
    """The case file's JSON of a checked config: what the case rule writes to case.json."""
    topologies = tuple((t.tp, t.cp) for t in config_topologies(config))
    return case_document(Case.from_config(config, config_capture(config)), topologies)


# ----- GPU accounting ----------------------------------------------------------------------
# GPU accounting for the topology rule: one GPU per rank on ``device: cuda``, none on the CPU.
#
# Each topology job claims ``gpus = tp * cp`` (:func:`topology_gpus`) when the campaign runs on
# CUDA. Snakemake only limits a resource that the run provides, so :func:`register_gpus` provides
# ``gpus`` = the GPUs this machine shows (``torch.cuda.device_count()``, which honours
# ``CUDA_VISIBLE_DEVICES``) unless ``--resources gpus=N`` (command line or profile) already set it.
# With ``--cores 8`` on a node with 8 GPUs, TP=4 x CP=2 then never runs beside another topology,
# and two 4-rank topologies run together. Snakemake scales a claim larger than what is provided
# down to it and starts the job anyway, so a topology with more ranks than GPUs would start ranks
# without a GPU: :func:`provide_gpus` refuses it when the workflow is parsed, naming the topology.

GPUS = "gpus"


def topology_gpus(device: str, tp: int, cp: int) -> int:
    """GPUs one ``tp x cp`` topology job occupies: one per rank on cuda, none on cpu."""
    return tp * cp if device == "cuda" else 0


def machine_gpus() -> int:
    """GPUs this process can use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def register_gpus(workflow: Any, device: str) -> int | None:
    """Provide ``gpus`` to Snakemake's scheduler for a cuda campaign run on this machine.

    Returns the registered count, or None when nothing was registered: a cpu campaign (no job
    claims a GPU) or a run whose ``--resources`` (command line or profile) already names
    ``gpus``. Snakemake picks its executor after it parses the workflow, so this cannot tell a
    cluster run from a local one: a cluster profile sets ``resources: [gpus=N]`` itself.
    """
    if device != "cuda" or GPUS in workflow.global_resources:
        return None
    count = machine_gpus()
    workflow.register_resource(GPUS, count)
    return count


def provided_gpus(workflow: Any) -> int:
    """The ``gpus`` Snakemake provides (a ``Resource`` holds it in ``.value``)."""
    held = workflow.global_resources[GPUS]
    value = held.value if hasattr(held, "value") else held
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkflowConfigError(f"--resources gpus={value!r} must be an integer number of GPUs")
    return value


def provide_gpus(workflow: Any, config: dict[str, Any]) -> int | None:
    """:func:`register_gpus`, then refuse a cuda topology with more ranks than the GPUs provided.

    Returns the GPUs provided on cuda (None on cpu). Raises :class:`WorkflowConfigError` naming
    each topology that needs more.
    """
    registered = register_gpus(workflow, config["device"])
    if config["device"] != "cuda":
        return None
    provided = provided_gpus(workflow)
    source = ("torch.cuda.device_count() on this machine" if registered is not None
              else "--resources gpus (command line or profile)")
    problems = [
        f"config key 'topologies[{index}]' has value {config['topologies'][index]!r}: needs "
        f"{topology_gpus('cuda', topo.tp, topo.cp)} GPUs (one per rank) but {provided} are provided ({source}); "
        "Snakemake would scale the claim down and start ranks without a GPU: drop the topology, run on a node "
        "with that many GPUs, or set --resources gpus=N for a cluster"
        for index, topo in enumerate(config_topologies(config))
        if topology_gpus("cuda", topo.tp, topo.cp) > provided
    ]
    if problems:
        raise WorkflowConfigError("; ".join(problems))
    return provided


# ----- the closing table -------------------------------------------------------------------
# The workflow's closing message: the verdict, the archive, its SHA-256, SUMMARY.md, how to verify.
#
# ``workflow/Snakefile`` calls :func:`print_closing` from its ``onsuccess:`` and ``onerror:``
# handlers, so the console's last table says what the run established. Everything is read from
# the files the stages left (Snakemake deletes the outputs of a failed job), in stage order:
#
# * ``VERIFIED``: the verifier's ``results/<name>.verify.json`` passed, is not older than the
#   archive it checked, and names it;
# * ``FAILED at <stage>``: the run ended in an error and ``<stage>`` is the first stage whose
#   output is missing (the gate that failed, or the stage that failed before it), with its log;
# * ``INCOMPLETE``: the run succeeded but was asked for less than everything (explicit targets),
#   and names the first stage not built.
#
# An archive at the final path that this run did not rebuild (it is older than this run's
# evidence, or a gate before it failed) is shown as such, never as this run's result.
# Snakemake calls no handler when there is nothing to be done and in a dry run.

VERIFIED = "VERIFIED"
# The default profile quiets Snakemake's per-job blocks (its error block and failed log included),
# so a failed run's table shows the end of the failed stage's log itself.
LOG_TAIL_LINES = 15


@dataclass(frozen=True)
class Closing:
    """The verdict and the rows of the closing table (label, value)."""

    verdict: str
    rows: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not self.verdict:
            raise ValueError("Closing.verdict must be non-empty")

    def table(self) -> Table:
        colour = "bold green" if self.verdict == VERIFIED else "bold red"
        table = Table(title="rl_engine evidence workflow: result", title_justify="left", show_header=False)
        table.add_column("Item", style="bold")
        table.add_column("Value", overflow="fold")
        table.add_row("Verdict", f"[{colour}]{self.verdict}[/]")
        for label, value in self.rows:
            table.add_row(label, value)
        return table


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``log``, shown as text (rich markup escaped, undecodable bytes replaced)."""
    text = log.read_bytes()[-64 * 1024:].decode("utf-8", errors="replace")
    return escape("\n".join(text.splitlines()[-lines:])) or "(empty)"


def _sha256_of(sidecar: Path) -> str:
    try:
        text = sidecar.read_text(encoding="utf-8").split()
    except OSError:
        return "(no .sha256 file)"
    return text[0] if text else "(empty .sha256 file)"


def closing(run: str | Path, topologies: list[Topology], succeeded: bool, *, capture: bool = False,
            parity: bool = False) -> Closing:
    """The closing message of a run of ``run`` with ``topologies``; ``succeeded`` as Snakemake says;
    ``capture`` and ``parity``: the optional stages of the run (:func:`stage_flags`)."""
    run = Path(run)
    all_stages = stages(run, topologies, capture=capture, parity=parity)
    stage_of = {s.rule: s for s in all_stages}  # (the topology stages share a rule; not looked up here)
    summary_stage, archive_stage, verify_stage = stage_of["summary"], stage_of["archive"], stage_of["verify_archive"]
    archive, sidecar = archive_stage.outputs
    verify_json = verify_stage.outputs[0]
    verify_cmd = f"python -m rl_engine verify {archive}"
    first_missing = next((s for s in all_stages if s.missing()), None)
    verified = None
    if first_missing is None:
        try:
            result = jsonio.load(verify_json)
            verified = (isinstance(result, dict) and result.get("passed") is True
                        and result.get("archive") == archive.name
                        and verify_json.stat().st_mtime_ns >= archive.stat().st_mtime_ns)
        except (OSError, ValueError):
            verified = False
    rows: list[tuple[str, str]] = [("Run directory", f"{run}/")]
    if verified:
        verdict = VERIFIED
    elif first_missing is None:
        verdict = f"FAILED at verify_archive: {verify_json} does not record a pass for {archive.name}"
        rows.append(("Log", str(verify_stage.log)))
    else:
        missing = ", ".join(p.name for p in first_missing.missing())
        if succeeded:
            verdict = f"INCOMPLETE: {first_missing.label} not built by this run (missing {missing})"
        else:
            verdict = f"FAILED at {first_missing.label} (missing {missing})"
            rows.append(("Log", f"{first_missing.log}" + ("" if first_missing.log.is_file() else " (not written)")))
            if first_missing.log.is_file():
                rows.append((f"Log, last {LOG_TAIL_LINES} lines", log_tail(first_missing.log)))
    def done(stage: Stage) -> bool:  # built, and no stage before it is missing
        return first_missing is None or all_stages.index(first_missing) > all_stages.index(stage)

    built_here = done(archive_stage)
    if archive.is_file() and built_here:
        rows += [("Archive", str(archive)), ("SHA-256", _sha256_of(sidecar))]
    elif archive.is_file():
        rows.append(("Archive", f"none from this run; {archive} is from an earlier run of this case, older than "
                                "this run's evidence, and is rebuilt once every gate passes"))
    else:
        rows.append(("Archive", "none: no archive is built until every stage before it passes"))
    rows.append(("SUMMARY.md", str(summary_stage.outputs[0]) if done(summary_stage) else "not written by this run"))
    rows.append(("Verify (reviewer)", verify_cmd if archive.is_file() and built_here else
                 f"{verify_cmd}  (once the archive is built)"))
    return Closing(verdict, tuple(rows))


def print_closing(run: str | Path, topologies: list[Topology], succeeded: bool,
                  console: Console | None = None, **flags: bool) -> Closing:
    """Print :func:`closing` as a rich table (what the Snakefile's handlers call) and return it;
    ``flags``: :func:`stage_flags`."""
    result = closing(run, topologies, succeeded, **flags)
    (console or Console(width=160)).print(result.table())
    return result


def print_closing_at_exit(run: str | Path, topologies: list[Topology], succeeded: bool, **flags: bool) -> None:
    """:func:`print_closing` when the Snakemake process exits (what the Snakefile's handlers call).

    Snakemake logs the complete log's path and the elapsed time after ``onsuccess:`` and
    ``onerror:`` return (and on error its final error line); printing at interpreter exit keeps
    the table the last thing on the console. The files are read then, when every job
    is over."""
    atexit.register(functools.partial(print_closing, run, topologies, succeeded, **flags))


# ----- Snakemake's HTML report (snakemake --report report.html) -------------------------------
# The outputs a reviewer looks at are marked with report() in their rules (SUMMARY.md, verify.json,
# crosscheck.json, parity.png); each gets labels read from the run's files when the report is made,
# so the report's table shows the closing table's rows, the cross-topology result and the parity
# counts beside the embedded files. A label function never raises: a file it cannot read is named.

def _plain(value: str) -> str:
    from rich.text import Text

    return Text.from_markup(value).plain


def _read_json(path: str | Path) -> dict[str, Any] | None:
    try:
        data = jsonio.load(Path(path))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def report_closing_labels(run: str | Path, topologies: list[Topology], **flags: bool) -> Callable[..., dict[str, str]]:
    """Labels of the verify_archive output: the closing table's rows, as the console's closing table shows them."""
    def labels(wildcards: Any) -> dict[str, str]:
        result = closing(run, topologies, True, **flags)
        return {"Verdict": result.verdict, **{label: _plain(value) for label, value in result.rows}}
    return labels


def report_crosscheck_labels(wildcards: Any, output: Any) -> dict[str, str]:
    """Labels of crosscheck.json: the result, the reference topology and what was compared."""
    data = _read_json(output[0])
    if data is None:
        return {"Cross-topology check": f"{output[0]} cannot be read"}
    topologies = [t.get("topology", t) if isinstance(t, dict) else t for t in data.get("topologies", [])]
    return {"Cross-topology check": "PASSED: bitwise equal" if data.get("passed") is True else
            f"FAILED: {len(data.get('failures', []))} difference(s)",
            "Reference": str(data.get("reference")), "Topologies": str(len(topologies)),
            "Fields compared": ", ".join(str(f) for f in data.get("fields", []))}


def report_parity_labels(wildcards: Any, output: Any) -> dict[str, str]:
    """Labels of parity.png: the verdict and the counts the figure shows, from parity.json."""
    data = _read_json(output.json)
    if data is None:
        return {"Parity": f"{output.json} cannot be read"}
    try:
        active = data["targets_and_mask"]["active_tokens"]
        ours = data["our_logprob"]
        equal = sum(1 for a, e in zip(data["targets_and_mask"]["per_token"]["active"],
                                      ours["per_token"]["bitwise_equal"]) if a and e)
        ratio = data["importance_ratio"]["ours"]
        return {"Parity": str(data["verdict"]), "Active tokens": str(active),
                "Logprob bitwise equal": f"{equal} of {active}",
                "Logits bitwise equal": str(data["logits"]["bitwise_equal"]),
                "Ratio outside bounds": f"{ratio['outside_bounds']} of {active}"}
    except (KeyError, TypeError) as exc:
        return {"Parity": f"{output.json} lacks {exc}"}


class _NothingToDo(logging.Filter):
    """Notes whether Snakemake logged "Nothing to be done" (it then returns before ``onsuccess:``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Nothing to be done"):
            self.seen = True
        return True


def print_closing_when_nothing_to_do(workflow: Any, run: str | Path, topologies: list[Topology],
                                     **flags: bool) -> None:
    """The closing table of the run the config names, at exit, when a real run (not a dry run, in
    the main process) ended with "Nothing to be done": its evidence is on disk and up to date, so the
    table says its verdict, archive and verify command as the run that made them did. Snakemake
    returns before ``onsuccess:`` then, so this watches its log for the message."""
    seen = _NothingToDo()
    logging.getLogger("snakemake.logging").addFilter(seen)

    def at_exit() -> None:
        if seen.seen and workflow.is_main_process and not workflow.dryrun:
            print_closing(run, topologies, True, **flags)

    atexit.register(at_exit)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rl_engine check-config",
        description="Check a workflow config file against schemas/config.schema.json, the runner's "
                    "plan-time rules and this machine (device: cuda needs CUDA), as snakemake does when "
                    "it parses the workflow. Exit 0 when valid, 2 with the key, value and fix otherwise.")
    parser.add_argument("config", nargs="?", default="config.yaml", help="config file (default: config.yaml)")
    args = parser.parse_args(argv)
    try:
        check_workflow_config(load_config(args.config))
    except (OSError, yaml.YAMLError) as exc:
        print(f"{args.config}: cannot be read: {exc}", file=sys.stderr)
        return 2
    except WorkflowConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    print(f"{args.config}: valid")
    return 0
