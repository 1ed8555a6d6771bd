"""The default runner: threads where the interpreter runs without the GIL or where no process can
start (a daemonic process: a torch DataLoader worker), processes elsewhere."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .process import ProcessRunner
    from .thread import ThreadRunner

__all__ = ["auto_runner", "choose_runner", "gil_enabled"]

_log = logging.getLogger(__name__)


def gil_enabled() -> bool:
    """Whether this interpreter currently runs with the GIL (always True before Python 3.13)."""
    probe = getattr(sys, "_is_gil_enabled", None)
    return True if probe is None else bool(probe())


def _in_daemonic_process() -> bool:
    """Whether this is a daemonic multiprocessing process (a torch DataLoader worker), which
    multiprocessing allows no children. Read without importing multiprocessing: a process it
    started has it imported already."""
    process = sys.modules.get("multiprocessing.process")
    return process is not None and bool(process.current_process().daemon)


def choose_runner(gil: bool, daemonic: bool = False) -> tuple[str, str]:
    """The runner name `auto` picks for a GIL state (and whether this is a daemonic process), and
    the reason, as shown to the user.

    Without the GIL, threads run Python in parallel and share arrays for free; with it, only
    processes give Python-heavy stages (tokenising, packing) real parallelism. A daemonic process
    can start no processes (the process runner refuses to start there), so it gets threads.
    """
    if daemonic:
        return "thread", "auto: in a daemonic process (a torch DataLoader worker), which can start no processes → thread"
    if gil:
        return "process", "auto: GIL enabled (sys._is_gil_enabled() is True or absent) → process"
    return "thread", "auto: GIL disabled (sys._is_gil_enabled() is False) → thread"


def auto_runner() -> ThreadRunner | ProcessRunner:
    """A ThreadRunner or ProcessRunner with default options for this interpreter; its `reason` says why.

    The choice is logged at DEBUG only: a loader starting it says which runner and why at INFO, on
    the job's rank 0 (every rank of a job chooses alike), and this line, at INFO, doubled that on
    every rank. Only the chosen runner's module is imported (the process runner's brings
    `multiprocessing`)."""
    name, reason = choose_runner(gil_enabled(), _in_daemonic_process())
    if name == "thread":
        from .thread import ThreadRunner

        runner = ThreadRunner()
    else:
        from .process import ProcessRunner

        runner = ProcessRunner()
    runner.reason = reason
    _log.debug("zephon runner: %s", reason)
    return runner
