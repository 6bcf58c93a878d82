"""The errors a run stops with that the user must act on, and their CLI exit codes.

No JAX here: the CLI imports `RunError` without paying for JAX.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A run that stopped for a reason the user must act on; the message says what happened and what
    was kept. `exit_code` is the CLI's exit status (1; 143 = 128 + SIGTERM for a preempted run)."""

    exit_code = 1


class Preempted(RunError):
    """SIGTERM (or SIGINT) arrived; the run saved a checkpoint and stopped. Running it again resumes."""

    exit_code = 143
