"""Environment capture: the guide's "record the environment before testing", made structured.

``python -m rl_engine env --output-dir RUN [--repo DIR] [--timeout-s S]`` writes

* ``RUN/environment.json`` (``schemas/environment.schema.json``, validated before it is
  written): git commit, branch and dirty flag (:mod:`rl_engine.record.gitstate`: dirty when
  a tracked file changed or an untracked source file is not ignored; the number of untracked
  files is recorded, and the untracked data files, which leave the tree clean, are listed), Python,
  torch and its CUDA build, CUDA availability, GPU count and names,
  NCCL and gloo availability, CPU model and count, hostname, platform, the versions of
  snakemake, jsonschema, rich, numpy, pyyaml and rl_engine, and ``nvidia``: the NVIDIA driver's
  version, each GPU's index, name, UUID, PCI bus, VBIOS and memory (``nvidia-smi --query-gpu``),
  and the CUDA toolkit's ``nvcc`` (its path and release line);
* ``RUN/environment.txt``: the raw output of the guide's commands (``git rev-parse HEAD``,
  ``git log -1 --oneline``, ``git branch --show-current``, ``python --version``, the torch
  one-liner, ``nvidia-smi``, ``nvcc --version``), each run with a short timeout. A missing
  tool (no ``nvidia-smi`` on a CPU machine) is recorded as absent, not a failure; so is a
  repository that is not a git checkout (``git.available`` false).

With ``--reuse-dir`` the record is made first (:func:`probe`) and its hash is the cache key
(:func:`rl_engine.record.reuse.environment_key`): when an earlier capture has the same record,
``environment.json`` is this probe's record with ``reused`` (the earlier run, when, its commit) and
``environment.txt`` is copied from that capture, so only the raw commands' output is not taken
again (``nvidia-smi``'s utilisation and temperature are the earlier ones).

Exit 0 when both files are written; 1 when ``environment.json`` would not match its schema
(then nothing is written); 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from rl_engine import jsonio, schemas
from rl_engine.record import reuse
from rl_engine.record.gitstate import GitStateError, read_git_state
from rl_engine.rundir import ENVIRONMENT, ENVIRONMENT_TEXT
from rl_engine.tables import SCHEMA_VERSION

MAX_LISTED = 200  # untracked data files listed in environment.json (all are counted)


def printable_path(path: str) -> str:
    """A path git printed, as a schema-``printable`` string: control and format characters (a
    newline included) as visible escapes (``\\n``, ``\\x1b``, ``\\u202e``), at most 1000 characters."""
    def shown(ch: str) -> str:
        code = ord(ch)
        if ch == "\n":
            return "\\n"
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"

    return "".join(shown(ch) if unicodedata.category(ch) in ("Cc", "Cf") else ch for ch in path[:1000])


PACKAGES = ("snakemake", "jsonschema", "rich", "numpy", "pyyaml", "torch", "rl_engine")
TORCH_ONE_LINER = (
    "import torch; import torch.distributed as dist; print('torch:', torch.__version__); "
    "print('torch_cuda:', torch.version.cuda); print('cuda_available:', torch.cuda.is_available()); "
    "print('gpu_count:', torch.cuda.device_count()); print('nccl_available:', dist.is_nccl_available())"
)


@dataclass(frozen=True)
class CommandResult:
    """One raw command: its output, or why there is none."""

    display: str
    present: bool
    exit_code: int | None
    output: str
    note: str = ""

    def text(self) -> str:
        lines = [f"$ {self.display}"]
        if not self.present:
            lines.append(f"[absent: {self.note}]")
        else:
            lines.append(self.output.rstrip("\n"))
            lines.append(f"[exit code: {self.exit_code}]" + (f" [{self.note}]" if self.note else ""))
        return "\n".join(lines) + "\n"


def run_command(argv: list[str], cwd: Path, timeout_s: float, display: str | None = None) -> CommandResult:
    """Run a tool with a timeout; a missing tool or a timeout is recorded, never raised."""
    shown = display or " ".join(argv)
    if shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
        return CommandResult(shown, False, None, "", f"{argv[0]} not found on PATH")
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return CommandResult(shown, True, None, out, f"timed out after {timeout_s} s")
    except OSError as exc:
        return CommandResult(shown, False, None, "", f"{argv[0]} could not run: {exc}")
    return CommandResult(shown, True, proc.returncode, proc.stdout + proc.stderr)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what platform knows (environment and bench)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _git(repo: Path, timeout_s: float) -> dict[str, Any]:
    """environment.json's ``git`` record from :func:`rl_engine.record.gitstate.read_git_state`."""
    try:
        state = read_git_state(repo, timeout_s)
    except GitStateError as exc:
        return {"available": False, "commit": None, "short_commit": None, "branch": None, "dirty": None,
                "untracked_files": None, "untracked_data_files": None, "reason": str(exc)}
    return {
        "available": True,
        "commit": state.commit,
        "short_commit": state.short_commit,
        "branch": state.branch,
        "dirty": state.dirty,
        "untracked_files": len(state.untracked_files),
        # data files do not make the tree dirty; listed (escaped, the first MAX_LISTED) so a reviewer sees them
        "untracked_data_files": [printable_path(path) for path in state.untracked_data_files[:MAX_LISTED]],
        "reason": None,
    }


def _torch() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(count)]
    capability = [".".join(map(str, torch.cuda.get_device_capability(i))) for i in range(count)]
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpu_count": count,
        "gpus": gpus,
        "compute_capability": capability,
        "distributed_available": dist.is_available(),
        "nccl_available": bool(dist.is_available() and dist.is_nccl_available()),
        "gloo_available": bool(dist.is_available() and dist.is_gloo_available()),
    }


NVIDIA_GPU_QUERY = "index,name,uuid,pci.bus_id,vbios_version,memory.total"
MAX_TOOL_LINES = 64  # GPUs listed, nvcc lines kept


def _lines(result: CommandResult) -> list[str] | None:
    """The non-empty output lines of a tool that ran and exited 0 (escaped, at most MAX_TOOL_LINES); else None."""
    if not result.present or result.exit_code != 0:
        return None
    return [printable_path(line.strip()) for line in result.output.splitlines() if line.strip()][:MAX_TOOL_LINES]


def _nvidia(repo: Path, timeout_s: float) -> dict[str, Any]:
    """environment.json's ``nvidia`` record: the driver's version, its GPUs (index, name, UUID, PCI bus,
    VBIOS, memory) and the CUDA toolkit's compiler (``nvcc`` on PATH: where, and its release line).

    Stable fields only (``nvidia-smi``'s utilisation and temperature are in environment.txt alone), so
    the record, and the reuse keys made from it, change when the driver, a GPU or the toolkit does."""
    driver = _lines(run_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                repo, timeout_s))
    gpus = _lines(run_command(["nvidia-smi", f"--query-gpu={NVIDIA_GPU_QUERY}", "--format=csv,noheader"],
                              repo, timeout_s))
    nvcc_path = shutil.which("nvcc")
    nvcc = _lines(run_command(["nvcc", "--version"], repo, timeout_s))
    release = [line for line in nvcc or [] if line.startswith(("Cuda compilation tools", "Build "))] or nvcc
    return {
        "driver_version": ", ".join(sorted(set(driver))) if driver else None,
        "gpus": gpus or [],
        "nvcc_path": printable_path(nvcc_path) if nvcc_path else None,
        "nvcc_version": "; ".join(release) if release else None,
    }


def probe(repo: Path, timeout_s: float) -> dict[str, Any]:
    """``environment.json``'s content: everything the capture records, no raw tool output.

    The reuse keys are made from this record (:func:`rl_engine.record.reuse.environment_key`), so
    every field it gains is in them without a second list to keep in step."""
    nvidia = _nvidia(repo, timeout_s)
    return {
        "schema_version": SCHEMA_VERSION,
        "git": _git(repo, timeout_s),
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "torch": _torch(),
        "cpu": {"model": cpu_model(), "count": os.cpu_count() or 1},
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "tools": {"nvidia_smi": nvidia["driver_version"] is not None, "nvcc": nvidia["nvcc_version"] is not None},
        "nvidia": nvidia,
    }


def raw_text(repo: Path, timeout_s: float) -> str:
    """``environment.txt``: the guide's commands and their raw output."""
    py = sys.executable
    commands = [
        run_command(["git", "rev-parse", "HEAD"], repo, timeout_s),
        run_command(["git", "log", "-1", "--oneline"], repo, timeout_s),
        run_command(["git", "branch", "--show-current"], repo, timeout_s),
        run_command([py, "--version"], repo, timeout_s, "python --version"),
        run_command([py, "-c", TORCH_ONE_LINER], repo, max(timeout_s, 60.0), "python -c '<torch one-liner>'"),
        run_command(["nvidia-smi"], repo, timeout_s),
        run_command(["nvcc", "--version"], repo, timeout_s),
    ]
    return "\n".join(c.text() for c in commands)


def capture(repo: Path, timeout_s: float) -> tuple[dict[str, Any], str]:
    """``environment.json``'s content and ``environment.txt``'s text."""
    return probe(repo, timeout_s), raw_text(repo, timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, type=Path, help="run directory to write into")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="git checkout to describe (default: cwd)")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="per-command time limit in seconds (default 20)")
    parser.add_argument("--reuse-dir", type=Path, default=None,
                        help="cache of earlier captures (rl_engine.record.reuse): when this environment's record "
                             "(everything environment.json holds: commit, git status, Python, torch, packages, host, "
                             "CPU, GPUs, driver, nvcc) is a cached capture's, copy its environment.txt, else capture "
                             "and store")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    if not args.repo.is_dir():
        parser.error(f"--repo {args.repo} is not a directory")
    repo = args.repo.resolve()
    # an output directory that cannot be made is refused before the probes (git, pip, nvidia-smi: seconds)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    env = probe(repo, args.timeout_s)
    key = reuse.environment_key(env) if args.reuse_dir is not None else ""
    origin = reuse.lookup(args.reuse_dir, "environment", key, [ENVIRONMENT, ENVIRONMENT_TEXT])
    cached = reuse.entry(args.reuse_dir, "environment", key) if origin is not None else None
    if cached is not None and reuse.without_reused(jsonio.load(cached / ENVIRONMENT)) != env:
        cached = None  # an entry whose record is not this probe's (edited by hand): capture again
    if cached is not None:
        assert origin is not None
        env = {**env, reuse.REUSED: reuse.reused_record(origin)}
        text = (cached / ENVIRONMENT_TEXT).read_text(encoding="utf-8")
        print(f"environment: reused the capture of run {origin['run']} ({origin['captured_utc']}): the same record "
              f"(commit, git status, Python, torch, packages, host, CPU, GPUs, driver, nvcc: key {key[:16]}); "
              f"environment.txt copied from {cached}")
    else:
        text = raw_text(repo, args.timeout_s)
    try:
        schemas.write_validated(args.output_dir / ENVIRONMENT, env, "environment")
    except schemas.ArtifactSchemaError as exc:
        print(f"env: {exc}", file=sys.stderr)
        return 1
    jsonio.atomic_write_text(args.output_dir / ENVIRONMENT_TEXT, text)
    if cached is None:
        reuse.store(args.reuse_dir, "environment", key, {ENVIRONMENT: args.output_dir / ENVIRONMENT,
                                                          ENVIRONMENT_TEXT: args.output_dir / ENVIRONMENT_TEXT},
                    args.output_dir.name, env["git"]["commit"])
    git = env["git"]
    print(f"environment: commit {git['commit']} ({'dirty' if git['dirty'] else 'clean'}), "
          f"python {env['python']['version']}, torch {env['torch']['version']}, "
          f"{env['torch']['gpu_count']} GPU(s), {env['cpu']['count']} CPU(s)")
    return 0
