"""The workflow's configuration: schema and campaign checks at parse time, and run naming.

``check_config`` is what ``workflow/Snakefile`` calls before any rule exists, so
``snakemake -n`` already refuses a campaign that cannot run. Every error names the key, the
value and the fix.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rl_engine import schemas
from rl_engine.distributed.bounds import BoundsError, check_cp_split, even_vocab_shards, tile_width
from rl_engine.logprob.registry import AUTO, backend_ids

SOURCE_PACKAGES = ("rl_engine",)
MAX_TP = 8
MAX_CP = 4


class WorkflowConfigError(ValueError):
    """A config.yaml that cannot drive a campaign; names the key, the value and the fix."""


@dataclass(frozen=True)
class Topology:
    tp: int
    cp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.cp

    @property
    def stem(self) -> str:
        return f"tp{self.tp}-cp{self.cp}"


def _key(path: Any) -> str:
    parts = [str(p) for p in path]
    return ".".join(parts) if parts else "<top level>"


def _schema_message(error: Any) -> str:
    key = _key(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        where = f" under {key!r}" if error.absolute_path else ""
        return (
            f"unknown config key(s) {extra}{where}; remove or rename them (allowed keys: "
            f"{allowed})"
        )
    if error.validator == "required":
        return f"config key {key!r}: {error.message}; add it (see the default config.yaml)"
    return (
        f"config key {key!r} has value {error.instance!r}: {error.message}; fix the value in "
        "config.yaml (see schemas/config.schema.json)"
    )


def _non_finite(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[str, float]]:
    """Key paths of NaN/infinite numbers (YAML ``.nan``/``.inf``; the schema's bounds pass NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [(_key(path), value)]
    found: list[tuple[str, float]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _non_finite(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _non_finite(item, path + (index,))
    return found


def parse_topologies(items: list[str]) -> list[Topology]:
    topologies = []
    for item in items:
        tp_text, cp_text = item.split("x")
        topologies.append(Topology(int(tp_text), int(cp_text)))
    return topologies


def check_config(config: dict[str, Any]) -> dict[str, Any]:
    """Validate ``config`` against its schema and the campaign rules; return it unchanged."""
    validator = schemas.validator("config")
    found = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if found:
        raise WorkflowConfigError(_schema_message(found[0]))
    bad_numbers = _non_finite(config)
    if bad_numbers:
        raise WorkflowConfigError("; ".join(
            f"config key {key!r} has value {value!r}: not a finite number; use a finite value" for key, value in bad_numbers
        ))
    problems: list[str] = []
    known = backend_ids()
    if config["backend"] == AUTO or config["backend"] not in known:
        problems.append(
            f"config key 'backend' has value {config['backend']!r}: use an explicit registered "
            f"backend, one of {known} ('auto' is refused: evidence must name what it tested)"
        )
    real, padded, tiles = config["real_vocab"], config["padded_vocab"], config["num_vocab_tiles"]
    if real > padded:
        problems.append(
            f"config key 'real_vocab' has value {real}, above padded_vocab={padded}; set "
            "padded_vocab >= real_vocab"
        )
    if config["prompt_tokens"] >= config["seq"]:
        problems.append(
            f"config key 'prompt_tokens' has value {config['prompt_tokens']}, not below "
            f"seq={config['seq']}; every sequence needs at least one active (response) token"
        )
    if config["dtype"] not in config["tolerances"]:
        problems.append(
            f"config key 'tolerances' has no entry for dtype {config['dtype']!r}; add "
            f"tolerances.{config['dtype']}: {{atol: ..., rtol: ...}}"
        )
    try:
        tile_width(padded, tiles)
    except BoundsError as exc:
        problems.append(f"config key 'num_vocab_tiles' has value {tiles}: {exc}")
    else:
        for index, topo in enumerate(parse_topologies(config["topologies"])):
            key = f"topologies[{index}]"
            text = config["topologies"][index]
            if topo.tp > MAX_TP or topo.cp > MAX_CP:
                problems.append(
                    f"config key '{key}' has value {text!r}: TP up to {MAX_TP} and CP up to "
                    f"{MAX_CP} are supported; remove it"
                )
                continue
            if topo.world_size > tiles:
                problems.append(
                    f"config key '{key}' has value {text!r}: TP*CP={topo.world_size} exceeds "
                    f"num_vocab_tiles={tiles}; use fewer ranks or more tiles"
                )
            try:
                even_vocab_shards(padded, tiles, topo.tp)
                check_cp_split(config["seq"], topo.cp, config["cp_layout"])
            except BoundsError as exc:
                problems.append(f"config key '{key}' has value {text!r}: {exc}")
    if problems:
        raise WorkflowConfigError("; ".join(problems))
    return config


def load_config(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict):
        raise WorkflowConfigError(f"{path}: the top level must be a mapping of config keys")
    return check_config(data)


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_name(config: dict[str, Any], repo: str | Path) -> str:
    """``<campaign>-<short commit>[-dirty]``; ``-nogit`` outside a git checkout.

    Stable across reruns of the same tree, so a rerun completes the same run directory.
    """
    repo = Path(repo)
    short = _git(repo, "rev-parse", "--short=7", "HEAD")
    if short is None:
        return f"{config['campaign']}-nogit"
    status = _git(repo, "status", "--porcelain")
    dirty = "-dirty" if status else ""
    return f"{config['campaign']}-{short}{dirty}"


def engine_sources(repo: str | Path) -> list[str]:
    """The package's Python sources, relative to ``repo``: edits to them rerun dependent rules."""
    repo = Path(repo)
    found: list[str] = []
    for package in SOURCE_PACKAGES:
        found += [str(p.relative_to(repo)) for p in sorted((repo / package).rglob("*.py"))]
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine check-config")
    parser.add_argument("config", nargs="?", default="config.yaml")
    args = parser.parse_args(argv)
    try:
        load_config(args.config)
    except WorkflowConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    print(f"{args.config}: valid")
    return 0
