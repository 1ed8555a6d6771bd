"""How Zephon's stateless stages execute: inline, on threads, on processes, or chosen automatically.

Every runner implements `zephon._runner.Runner`; the core finds them through the `zephon.runners`
entry-point group and never imports this package. See README.md for the lifecycle of an item.
"""

from __future__ import annotations

from ._errors import WorkerCrashedError
from .auto import auto_runner, choose_runner, gil_enabled
from .inline import InlineRunner
from .process import ProcessRunner, TransportStats
from .thread import ThreadRunner

__all__ = [
    "InlineRunner",
    "ProcessRunner",
    "ThreadRunner",
    "TransportStats",
    "WorkerCrashedError",
    "auto_runner",
    "choose_runner",
    "gil_enabled",
]
