"""Timing the compute bound's passes so that the bound averages time the way a loader's rate does.

A loader's rate is the work it delivered divided by the time it took, over a run of seconds: an
average over whatever speed the machine had meanwhile. On a shared machine whose speed moves by
tens of per cent from one second to the next (benchmarks/README.md, "The bound: mean pass, not
fastest"), the fastest of a few passes measures the machine's fastest moments instead of the
average that a run of several seconds sees. So a part's cost is
its mean CPU time per pass (total CPU over all passes ÷ passes: the same kind of average as a run's
rate), and the parts take turns (a pass is one epoch of every part, in order) so that each part is
timed over the same stretch of time as the others. A first, untimed pass warms up (first-time
allocations, the tokenizer's cache), as a loader's rate is taken after its warm-up. The fastest
pass is kept beside the mean.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Step = tuple[str, Callable[[dict], object]]


@dataclass
class Passes:
    """CPU and wall seconds of every pass of every part, and each part's output (from the last pass)."""

    cpu: dict[str, list[float]] = field(default_factory=dict)
    wall: dict[str, list[float]] = field(default_factory=dict)
    outputs: dict[str, object] = field(default_factory=dict)

    def mean(self, part: str) -> float:
        return statistics.fmean(self.cpu[part])

    def fastest(self, part: str) -> float:
        return min(self.cpu[part])

    def means(self) -> dict[str, float]:
        return {part: self.mean(part) for part in self.cpu}

    def fastests(self) -> dict[str, float]:
        return {part: self.fastest(part) for part in self.cpu}


def time_passes(steps: Sequence[Step], repeats: int, warmup: int = 1,
                clock: Callable[[], float] = time.thread_time, wall: Callable[[], float] = time.perf_counter) -> Passes:
    """Run `warmup` untimed passes, then `repeats` timed passes of `steps` in order; each step is
    `(name, fn)`, `fn(outputs)` may read the outputs of the steps before it. CPU time is the calling
    thread's own: on one pinned core that is the work's cost, and other processes on the machine do
    not add to it."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    passes = Passes()
    for number in range(warmup + repeats):
        for name, fn in steps:
            passes.outputs.pop(name, None)  # the last pass's output is freed first, its memory reused
            w, c = wall(), clock()
            passes.outputs[name] = fn(passes.outputs)
            cpu, elapsed = clock() - c, wall() - w
            if number >= warmup:
                passes.cpu.setdefault(name, []).append(cpu)
                passes.wall.setdefault(name, []).append(elapsed)
    return passes
