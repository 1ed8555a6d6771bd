"""The protocol every runner implements, and how the core finds runners without importing them.

The core only knows this protocol. Concrete runners live in the `runners` package and are found
through the `zephon.runners` entry-point group, so `runners/` can depend on the core but never the
other way round.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ._errors import ConfigurationError

__all__ = ["Stage", "Runner", "runner_factory", "make_runner", "available_runners"]


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

    Thread-safety: `submit` may be called from any thread (including a runner's own completion
    callbacks); `start` and `close` are called by the owning loader only. `close` is idempotent.
    """

    name: str
    reason: str

    def start(self, stages: Sequence[Stage]) -> None: ...

    def submit(self, stage_index: int, item: Any) -> Future: ...

    def close(self) -> None: ...


def available_runners() -> dict[str, Any]:
    """Runner factories registered under the `zephon.runners` entry-point group, by name."""
    return {ep.name: ep for ep in entry_points(group="zephon.runners")}


def runner_factory(spec: str | Runner) -> Callable[[], Runner]:
    """What makes the runner `spec` names, checked without starting anything: a loader refuses a
    bad runner setting before it reads any data (its token estimate reads chunks), and looks the
    entry points up once although it starts its runner only at the first batch."""
    found = _resolve(spec)
    return found.load() if isinstance(spec, str) else lambda: found


def make_runner(spec: str | Runner) -> Runner:
    """A runner from a registered name (`inline`, `thread`, `process`, `auto`) or an instance."""
    return runner_factory(spec)()


def _resolve(spec: str | Runner) -> Any:
    """The entry point registered under the name `spec`, or `spec` itself when it is a runner."""
    if not isinstance(spec, str):
        if not all(callable(getattr(spec, method, None)) for method in ("start", "submit", "close")):
            raise ConfigurationError(
                f"runner={spec!r} is neither a runner's name nor a runner (an object with start, submit and close)"
            )
        if isinstance(spec, type):  # its methods are there, unbound: start(stages) would fail at the first batch
            raise ConfigurationError(
                f"runner={spec.__name__} is a runner class: pass an instance ({spec.__name__}()) or a name"
            )
        return spec
    registered = available_runners()
    if spec not in registered:
        known = ", ".join(sorted(registered)) or "none (is the package installed?)"
        raise ConfigurationError(f"unknown runner {spec!r}; registered runners: {known}")
    return registered[spec]
