"""How Zephon's stateless stages execute: inline, on threads, on processes, or chosen automatically.

Every runner implements `zephon._runner.Runner`; the core finds them through the `zephon.runners`
entry-point group and never imports this package. See README.md for the lifecycle of an item.

The names below are imported on first use, so a loader that runs on threads never loads
`multiprocessing` and its sockets, subprocess and temporary-file machinery (on 3.14t: +1.7 MiB of
PSS and ~20 ms of start-up for nothing).
"""

from __future__ import annotations

import importlib

_HOMES = {
    "InlineRunner": ".inline",
    "ProcessRunner": ".process",
    "RunnerFailedError": "._errors",
    "RunnerReusedError": "._errors",
    "ThreadRunner": ".thread",
    "TransportStats": ".process",
    "WorkerCrashedError": "._errors",
    "auto_runner": ".auto",
    "choose_runner": ".auto",
    "gil_enabled": ".auto",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
