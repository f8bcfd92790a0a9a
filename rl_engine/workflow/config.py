"""The workflow's config check: what ``workflow/Snakefile`` calls before any rule exists, so
``snakemake -n`` already refuses a campaign that cannot run.

After the schema, :func:`check_config` runs the case's rules (:mod:`rl_engine.campaign.case`: the
case's parameters, each topology, the matrix) on the config's values, and finally builds the
case file the case rule writes, so a config that passes here cannot fail at plan time. Nothing
here imports torch at import time or builds a command. Every error names the config key, the
value and the fix, and says when the value came from ``--config`` rather than the config file
(:class:`Origin`). :func:`check_workflow_config` adds what only this machine can answer (CUDA for
``device: cuda``; a ``SOURCE_DATE_EPOCH`` the archive can record and the packages it is written
with). ``python -m rl_engine check-config`` is :func:`main`.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from rl_engine import jsonio, schemas
from rl_engine.campaign.case import (
    TOPOLOGY_FIELDS,
    Case,
    CaseError,
    captures_sampling,
    case_document,
    case_problems,
    check_topology,
    config_case_fields,
    config_key_of,
    matrix_problem,
    parse_topologies,
)
from rl_engine.campaign.casename import parity_identity
from rl_engine.campaign.nodes import fitting_ranks_per_node, layout_problem
from rl_engine.distributed.bounds import AUTO_TILES, BoundsError, auto_vocab_tiles
from rl_engine.rundir import Topology
from rl_engine.tables import UNPRINTABLE_CLASS
from rl_engine.validators import finite_float, shown


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
        text = f"config key {key!r} has value {shown(value)}"
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
    """``tolerances.bf16.atol``, ``topologies[1]``: list items by index, as every other message names them."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<top level>"


TOPOLOGY_FORM = ("write each topology as a string '<tp>x<cp>' in a list: topologies: [1x1, 2x1] in config.yaml, "
                 "or --config topologies='[\"1x1\",\"2x1\"]' on the command line")


def _first_error(found: list[Any]) -> Any:
    """The error to report: an item's own error before its list's (``topologies: [3]`` is a bad item
    before it is a list too short)."""
    first = found[0]
    deeper = [e for e in found[1:] if list(e.absolute_path)[:len(first.absolute_path)] == list(first.absolute_path)
              and len(e.absolute_path) > len(first.absolute_path)]
    return deeper[0] if first.validator == "minItems" and deeper else first


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
    path = list(error.absolute_path)
    if path[:1] == ["topologies"] and len(path) == 2 and error.validator in ("type", "pattern"):
        return f"{origin.describe(key, error.instance)}: {shown(error.instance)} is not <tp>x<cp>; {TOPOLOGY_FORM}"
    if key == "topologies" and error.validator == "type":
        return f"{origin.describe(key, error.instance)}: not a list; {TOPOLOGY_FORM}"
    if error.validator == "minItems" and key == "topologies":
        return f"{origin.describe('topologies', error.instance)}: {matrix_problem(len(error.instance))}"
    return f"{origin.describe(key, error.instance)}: {error.message}; {origin.fix(key)}"


def _not_a_float(value: Any) -> bool:
    """A number of the config with no finite binary64 value: NaN or an infinity (YAML ``.nan``/``.inf``;
    the schema's bounds pass NaN), or an integer beyond binary64's range (``10**400``: the schema
    passes it, and every later ``float()`` or ``math.isfinite`` of it raises a bare ``OverflowError``)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and finite_float(value) is None


def _non_finite(value: Any) -> list[tuple[str, Any]]:
    """Key paths and values of the numbers of :func:`_not_a_float`."""
    return [(_key(path), leaf) for path, leaf in jsonio.find_leaves(value, _not_a_float)]


def _not_finite_why(value: Any) -> str:
    if isinstance(value, int):
        return "not a finite number: an integer beyond binary64's range (about 1.8e308) has no float value"
    return "not a finite number"


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
PARITY_DEFAULTS: dict[str, Any] = {"ratio_bounds": [0.8, 1.2], "num_vocab_tiles": AUTO_TILES,
                                   "backend": "pytorch-vocab-parallel-logp-ws2"}


def parity_settings(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``parity:`` section with its defaults filled (what the parity rule passes the verb), or None.
    ``num_vocab_tiles`` defaults to ``auto``, the verb's default (the API's rule)."""
    section = config.get("parity")
    return None if section is None else {**PARITY_DEFAULTS, **section}


@functools.lru_cache(maxsize=8)
def _parity_check(rollout: str, trainer: str, bounds: tuple[float, float], tiles: int | str, backend: str,
                  states: tuple[int, ...]) -> tuple[str, str, str, int]:
    """``(problem, rollout sha256, trainer sha256, tile count)`` of a parity section, once per file
    state in a process (it reads both captures' headers, targets and masks, and hashes both files);
    the tile count is ``auto`` resolved for the captures' vocabulary, as the verb resolves it."""
    from rl_engine.campaign.captured import file_sha256  # imports torch
    from rl_engine.capture.parity import ParityError, ParityOptions, check_pair

    try:
        resolved = check_pair(Path(rollout), Path(trainer), ParityOptions(backend, tiles, bounds))
        return "", file_sha256(rollout), file_sha256(trainer), resolved
    except (ParityError, OSError) as exc:
        return str(exc), "", "", 0


def config_parity(config: dict[str, Any], origin: Origin = Origin()) -> dict[str, Any] | None:
    """The parity stage's part of the case hash (:func:`rl_engine.campaign.casename.parity_identity`:
    both captures' SHA-256 and the verb's options, ``auto`` tiles as the count they resolve to, which
    parity.json records), or None without a ``parity:`` section.

    Refuses, naming the key, the value and the fix, what the parity verb would refuse without
    reading logits: a missing file or one that is not a capture, two captures of different tokens,
    targets or masks, a tile count that does not divide the vocabulary (or ``auto`` with no count
    for it), bounds outside ``0 < LOW < 1 < HIGH``, or a backend that does not run on the CPU.
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
    problem, rollout_sha, trainer_sha, tiles = _parity_check(
        str(settings["rollout"]), str(settings["trainer"]), bounds, settings["num_vocab_tiles"], settings["backend"],
        states)
    if problem:
        raise WorkflowConfigError(f"{origin.describe('parity', config['parity'])}: the parity stage would refuse "
                                  f"these captures: {problem}; {origin.fix('parity')}")
    return parity_identity(rollout_sha, trainer_sha, list(bounds), tiles, settings["backend"])


# ----- the paths the config names ------------------------------------------------------------------
# '<' and '>' would open a tag where the path reaches HTML (snakemake --report's page embeds the
# rules' inputs: a capture named caps/</script><img src=x onerror=...>.safetensors ran there as
# script), and a control character or bidirectional override would reach a terminal or SUMMARY.md
# as a sequence; a file name needs neither.
UNSAFE_PATH = re.compile(f"[<>{UNPRINTABLE_CLASS}]")


def path_problems(config: dict[str, Any], origin: Origin = Origin()) -> list[str]:
    """One message per path of a schema-valid config (``inputs.capture``, ``parity.rollout``,
    ``parity.trainer``, ``regression.tests[i]``) holding ``<``, ``>``, a control character or a
    bidirectional override, naming the key, the value, the character and the fix; checked before
    any of those files is read."""
    named: list[tuple[str, Any]] = [(f"regression.tests[{i}]", t) for i, t in enumerate(config["regression"]["tests"])]
    if config.get("inputs") is not None:
        named.append(("inputs.capture", config["inputs"]["capture"]))
    if config.get("parity") is not None:
        named += [(f"parity.{side}", config["parity"][side]) for side in ("rollout", "trainer")]
    problems = []
    for key, value in named:
        bad = UNSAFE_PATH.search(str(value))
        if bad:
            problems.append(
                f"{origin.describe(key, value)}: the path holds {bad.group()!r} (U+{ord(bad.group()):04X}) at "
                f"position {bad.start()}; '<', '>' and control characters are refused in the paths a config "
                "names, since a path reaches snakemake --report's HTML page (where '<' opens a tag, e.g. a "
                "script) and SUMMARY.md and the terminal: rename the file, or link it, to a name without "
                f"them; {origin.fix(key)}")
    return problems


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


def _sampling_tensor_problems(config: dict[str, Any], values: dict[str, Any], origin: Origin) -> list[str]:
    """``sampling: capture`` on a capture without the four sampling tensors, named under ``sampling``
    (the header is read, no tensor: :func:`rl_engine.campaign.captured.require_sampling_tensors`)."""
    if not captures_sampling(values):
        return []  # no capture: the case rule names it
    from rl_engine.campaign.captured import require_sampling_tensors  # imports torch
    from rl_engine.capture.format import CaptureError

    try:
        require_sampling_tensors(values, config["inputs"]["capture"])
    except CaptureError as exc:
        return [f"{origin.describe('sampling', config['sampling'])}: {exc}; {origin.fix('sampling')}"]
    return []


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
    problems += _sampling_tensor_problems(config, values, origin)
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


def check_config(config: dict[str, Any], origin: Origin = Origin()) -> dict[str, Any]:
    """Validate ``config`` against its schema and the runner's plan-time rules; return it, with
    ``num_vocab_tiles: auto`` replaced in place by the count it resolves to (:func:`resolve_auto_tiles`).

    ``origin`` says which values came from ``--config``: their messages say so.
    """
    validator = schemas.validator("config")
    found = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if found:
        raise WorkflowConfigError(_schema_message(_first_error(found), origin))
    unsafe = path_problems(config, origin)
    if unsafe:
        raise WorkflowConfigError("; ".join(unsafe))
    bad_numbers = _non_finite(config)  # before anything converts a number of the config to a float
    if bad_numbers:
        raise WorkflowConfigError("; ".join(
            f"{origin.describe(key, value)}: {_not_finite_why(value)}; use a finite value" for key, value in bad_numbers
        ))
    resolve_auto_tiles(config, origin)
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
        # the campaign's rule: a count that divides padded_vocab (the case and its hash hold one)
        config["num_vocab_tiles"] = auto_vocab_tiles(config["padded_vocab"], max_tp, divisible=True)
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


# The packages the archive verb builds the provenance statement and the RO-Crate with (pyproject's
# provenance extra), by the module each provides.
ARCHIVE_PACKAGES = {"in_toto_attestation": "in-toto-attestation", "google.protobuf": "protobuf", "rocrate": "rocrate"}


def archive_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """What would stop the archive at the end of the workflow, said before any job: a malformed
    ``SOURCE_DATE_EPOCH`` (:mod:`rl_engine.evidence.epoch`) or a package of the ``provenance`` extra that
    is not installed (looked up, not imported: every parse of the Snakefile pays for this check)."""
    import importlib.util

    from rl_engine.evidence.epoch import SourceDateEpochError, source_date_epoch

    problems = []
    try:
        source_date_epoch(environ)
    except SourceDateEpochError as exc:
        problems.append(str(exc))
    missing = []
    for module, package in ARCHIVE_PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package that is missing
            found = False
        if not found:
            missing.append(package)
    if missing:
        problems.append(f"the archive writes its provenance statement and RO-Crate with {', '.join(missing)}, not "
                        "installed here; install them: pip install -e '.[provenance]' (the test extra brings them)")
    return problems


def check_workflow_config(config: dict[str, Any], origin: Origin = Origin()) -> dict[str, Any]:
    """:func:`check_config`, then :func:`machine_problems` and :func:`archive_problems`: what
    ``workflow/Snakefile`` calls."""
    check_config(config, origin)
    problems = machine_problems(config, origin) + archive_problems()
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
