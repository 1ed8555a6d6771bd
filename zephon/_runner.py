"""The protocol every runner implements, and how the core finds runners without importing them.

The core only knows this protocol. Concrete runners live in the `runners` package and are found
through the `zephon.runners` entry-point group, so `runners/` can depend on the core but never the
other way round.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ._entry_points import find, registered
from ._errors import ConfigurationError

__all__ = ["Stage", "Runner", "runner_factory", "make_runner", "available_runners", "describe_runner"]


@dataclass(frozen=True)
class Stage:
    """A stateless function and how many workers run it.

    `fn` must be a pure function of its argument: it may run on any worker, in any order, any
    number of times (a crashed worker's item is re-run), and its result must not depend on which.
    """

    name: str
    fn: Callable[[Any], Any]
    parallelism: int = 1


@runtime_checkable
class Runner(Protocol):
    """Executes the stateless stages of one loader.

    Every future `submit` returns ends as a `concurrent.futures` executor's does, however the
    runner ends it (a result, an exception, a crash, a timeout, cancellation at `close`): its
    done-callbacks run once, and `concurrent.futures.wait()` and `as_completed()` count it done,
    so a cancelled one is also notified (`set_running_or_notify_cancel()`), not only cancelled.
    The loader waits through done-callbacks and `result()`; a user's tooling may use either.

    Thread-safety: `submit` may be called from any thread (including a runner's own completion
    callbacks); `start` and `close` are called by the owning loader only, `close` from whichever
    thread closes the loader (a watchdog's, the `zephon-runner-closer` thread for a loader dropped
    unclosed), possibly two at once. `close` is idempotent.
    `name` and `reason` say which runner it is and why it was chosen (`RankLoader.runner_info`);
    a runner without them is described by its class (`describe_runner`).
    """

    name: str
    reason: str

    def start(self, stages: Sequence[Stage]) -> None: ...

    def submit(self, stage_index: int, item: Any) -> Future: ...

    def close(self) -> None: ...


def available_runners() -> dict[str, Any]:
    """Runner factories registered under the `zephon.runners` entry-point group, by name, as this
    process last read them (`zephon._entry_points`)."""
    return {ep.name: ep for ep in registered("zephon.runners")}


def runner_factory(spec: str | Runner | Callable[[], Runner]) -> Callable[[], Runner]:
    """What makes a loader's runner from its `runner` setting, checked without starting anything:
    a loader refuses a bad setting before it reads any data (its token estimate reads chunks), and
    looks the entry points up once although it starts its runner only at the first batch.

    `spec` is a registered name (`inline`, `thread`, `process`, `auto`); a runner class or any
    callable returning a runner, which makes a new one for every loader (runner options that
    survive a resume in the same process: `functools.partial(ProcessRunner, task_timeout_s=30)`);
    or a runner instance, which serves the one loader that starts it.
    """
    if isinstance(spec, str):
        return _registered(spec).load()
    if _is_runner(spec) and not isinstance(spec, type):
        return lambda: spec
    if callable(spec):
        return functools.partial(_make_checked, spec)
    raise ConfigurationError(
        f"runner={spec!r} is neither a runner's name nor a runner (an object with start, submit and close) "
        "nor a callable that makes one"
    )


def make_runner(spec: str | Runner | Callable[[], Runner]) -> Runner:
    """A runner from a registered name, a factory, or an instance (see `runner_factory`)."""
    return runner_factory(spec)()


def describe_runner(runner: Runner) -> dict[str, str]:
    """{"name", "reason"} of a runner, as a loader logs and reports it (`runner_info`).

    What makes a runner is start, submit and close (`_is_runner`, and the refusals say so); a
    runner of the user's without the protocol's `name` and `reason` is named by its class and
    taken as requested explicitly, instead of failing its loader's first batch with an
    AttributeError."""
    return {
        "name": getattr(runner, "name", type(runner).__name__),
        "reason": getattr(runner, "reason", "requested explicitly"),
    }


def _is_runner(candidate: object) -> bool:
    return all(callable(getattr(candidate, method, None)) for method in ("start", "submit", "close"))


def _make_checked(factory: Callable[[], Runner]) -> Runner:
    """`factory()`, refused by name unless it is a runner: a stray callable (`runner=print`) is known
    for what it is only once called."""
    runner = factory()
    if isinstance(runner, type) or not _is_runner(runner):
        raise ConfigurationError(f"runner={factory!r} made {runner!r}, which is not a runner (start, submit, close)")
    return runner


def _registered(name: str) -> Any:
    """The entry point registered under `name`, looked for again among the packages installed now
    when this process's read lacks it (`zephon._entry_points.find`)."""
    found = find("zephon.runners", name)
    if not found:
        known = ", ".join(sorted(available_runners())) or "none (is the package installed?)"
        raise ConfigurationError(f"unknown runner {name!r}; registered runners: {known}")
    return tuple(found)[-1]  # the last, where several packages register the name, as `available_runners` keeps it
