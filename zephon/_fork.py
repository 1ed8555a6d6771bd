"""What a child forked from this process renews before `os.fork()` returns there: one
`os.register_at_fork` handler for all of Zephon, and the two registries it walks.

A fork copies the process as it stands on one thread: a lock another thread of the parent held
(a save on an asynchronous checkpointer's thread, a token estimate measured by a loader built on
another thread) is held in the child by a thread the child does not have, and the child's first
use of it waits for ever; a thread or a queue the parent served (the runner closer) is copied
without the thread that served it. A torch DataLoader forking its workers and a trainer starting a
`multiprocessing.Process` fork at any moment, so each such lock or state is renewed in the child:

- `renew_in_child(owner, renew)`: `renew(owner)` in each child forked while `owner` lives, for
  an object's own locks. `owner` is held weakly (a dropped loader is still collected and its
  runner closed) and by identity (equal objects each have their own locks);
- `call_in_child(hook)`: `hook()` in each child forked from now on, for a module's state, held for
  the life of the process.

One handler, never one per object: a handler can never be removed and holds what it calls (one
per retry log kept every log ever made alive, renewed in every child). The owners' renewals run
first, then the hooks, each in the order registered. One that raises does not stop the others
(each may be a lock the child would otherwise wait on for ever); the failures are raised together
at the end, which Python reports as an unraisable error in the child.

Thread-safety: `renew_in_child` and `call_in_child` from any thread, as objects and modules are
made; nothing here takes a lock, so a weakref callback (an owner collected) may run anywhere.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["call_in_child", "renew_in_child"]

T = TypeVar("T")

_renewals: dict[int, tuple[weakref.ref[Any], list[Callable[[Any], None]]]] = {}
"""Each live owner's renewals, by `id(owner)`; an entry leaves as its owner is collected."""

_hooks: list[Callable[[], None]] = []


def renew_in_child(owner: T, renew: Callable[[T], None]) -> None:
    """Call `renew(owner)` in every child forked from this process while `owner` lives, before
    anything else the child runs: give `owner` new locks there, taking none.

    `renew` is held for as long as `owner` lives, so it must not hold `owner` itself: a bound
    method of `owner` would keep it alive for ever (pass the class's function instead)."""
    if getattr(renew, "__self__", None) is owner:
        raise TypeError(f"renew_in_child: pass {type(owner).__name__}'s function, not a method bound to the owner it would keep alive")
    key = id(owner)
    entry = _renewals.get(key)
    if entry is None:
        entry = _renewals[key] = (weakref.ref(owner, lambda _, key=key, renewals=_renewals: renewals.pop(key, None)), [])
    entry[1].append(renew)


def call_in_child(hook: Callable[[], None]) -> None:
    """Call `hook()` in every child forked from this process from now on, after the owners'
    renewals: a module forgetting what was the parent's (its threads, its queues, its children)."""
    _hooks.append(hook)


def _renew_in_the_child() -> None:
    failures: list[Exception] = []
    for ref, renews in list(_renewals.values()):
        owner = ref()
        if owner is None:
            continue
        for renew in renews:
            try:
                renew(owner)
            except Exception as failure:
                failures.append(failure)
    for hook in list(_hooks):
        try:
            hook()
        except Exception as failure:
            failures.append(failure)
    if failures:
        raise ExceptionGroup("zephon: renewing the parent's locks and state in a forked child failed", failures)


os.register_at_fork(after_in_child=_renew_in_the_child)
