"""``python -m snakemake`` with the Slurm executor's status checks at most ``CAP_S`` apart (tests only).

Not a test module. The executor waits ``--slurm-init-seconds-before-status-checks`` before its first
``squeue`` and then 10 s more after each check that saw no job end (2, 12, 22, 32 s ... apart): on the
test cluster a job that ends 17 s after its submission is seen at 36 s, and the Slurm campaign of
tests/test_slurm.py spent about 30 of its 85 s waiting so. Here each check is followed by the
executor's own next interval or ``CAP_S``, whichever is shorter; what a check does and what the
workflow submits are the executor's, unchanged. Refuses to run, saying why, when the installed
executor no longer has the method or the attribute this relies on.
"""

from __future__ import annotations

import inspect
import sys

CAP_S = 3


def _cap_status_checks() -> None:
    import snakemake_executor_plugin_slurm as slurm

    check = getattr(slurm.Executor, "check_active_jobs", None)
    if check is None or not inspect.isasyncgenfunction(check):
        sys.exit("tests/_slurm_snakemake.py: snakemake_executor_plugin_slurm.Executor.check_active_jobs is not "
                 "an async generator in this version of the executor; update the wrapper")
    if "next_seconds_between_status_checks" not in inspect.getsource(check):
        sys.exit("tests/_slurm_snakemake.py: the executor's check_active_jobs no longer sets "
                 "next_seconds_between_status_checks; update the wrapper")

    async def check_active_jobs(self, active_jobs):  # type: ignore[no-untyped-def]
        async for job in check(self, active_jobs):
            yield job
        if self.next_seconds_between_status_checks > CAP_S:
            self.next_seconds_between_status_checks = CAP_S

    slurm.Executor.check_active_jobs = check_active_jobs


if __name__ == "__main__":
    _cap_status_checks()
    from snakemake.cli import main

    main()
