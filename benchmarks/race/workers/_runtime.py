"""What every race worker script shares: its config, the timed loop, the facts it reports.

A worker is run as `python workers/<loader>.py CONFIG_JSON RESULT_JSON` by `benchmarks.race`, in
the loader's own virtual environment, with the working directory outside the repository (so
`import zephon` finds whatever that environment installed). It imports no Zephon code itself.

Timing: `t0` is taken by `start()` once the heavy libraries are imported and before the loader
is built; time to first batch is measured from there (building the loader, planning, starting
workers, the first batch's work). Throughput is the steady state: usable tokens and images
after the first batch, divided by the time from the first batch to the last.

CPU: over the same steady window, the user + system CPU seconds of the worker's whole process
tree (its threads, its worker processes, and any it reaped), so that a loader's efficiency
against the compute bound splits into its CPU per token against the bound's and how busy it kept
the cores (`benchmarks.race._report`). Beside it, the CPU the rest of the machine spent in the
same window (every other process, and the time the hypervisor gave this machine's CPUs to
others, `steal`): a run beside other work is slower for reasons not its own, which the rate alone
cannot tell from a slower loader.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable

_T0: float | None = None


def config() -> dict:
    with open(sys.argv[1]) as f:
        return json.load(f)


def start() -> float:
    global _T0
    _T0 = time.perf_counter()
    return _T0


def versions(*names: str) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def build_facts(packages: Iterable[str]) -> dict:
    """The interpreter's build as well as its version: how it was configured (PGO, LTO, a shared
    libpython) moves pure-Python speed by several per cent, and the race's 3.11 and 3.14t differ."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return {
        "python": platform.python_version(),
        "free_threaded": not gil,
        "gil_enabled": gil,
        "executable": sys.executable,
        "build": sys.version,
        "configure": sysconfig.get_config_var("CONFIG_ARGS") or "",
        "versions": versions(*packages),
    }


def _stat_cpu_s(pid: int) -> float:
    """CPU seconds of process `pid`: its threads, live and exited, and the children it reaped."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the command name: state is field 3, so utime/stime/cutime/cstime (14-17) are 11-14 here
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> tuple[float, float]:
    """(busy, stolen) CPU seconds so far of the whole machine, every CPU added, from /proc/stat:
    busy is user + nice + system + irq + softirq (guest time is inside user), stolen is `steal`,
    the time the hypervisor ran something else on this machine's CPUs."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _children(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def tree_cpu_s(root: int | None = None) -> float:
    """User + system CPU seconds so far of process `root` (this one by default) and every
    descendant alive or not yet reaped. A descendant reaped between two readings is still counted,
    in its parent's share of reaped children; one that exits unreaped by a process outside the
    tree is not (none of the race's loaders does that)."""
    total, todo = 0.0, [os.getpid() if root is None else root]
    while todo:
        pid = todo.pop()
        try:
            total += _stat_cpu_s(pid)
        except (OSError, IndexError, ValueError):
            continue  # gone between listing and reading
        todo.extend(_children(pid))
    return total


def measure(batches: Iterable, cfg: dict, usable: Callable, images: Callable) -> dict:
    """Iterate until `cfg["target_tokens"]` usable tokens (text) or `cfg["target_images"]` images
    (VLM) have been delivered after the first batch; returns counts, times and the steady rate.

    The steady rate is taken between the moment `warmup` (a fraction of the target, default 0.25)
    had been delivered and the end: by then every loader's buffers (shuffle buffers, open rows,
    prefetch queues) are full, as they are at the end, so work done before the window and still
    buffered at its start does not inflate the rate.
    """
    assert _T0 is not None, "call start() first"
    target_tokens = cfg.get("target_tokens") or float("inf")
    target_images = cfg.get("target_images") or float("inf")
    warmup = cfg.get("warmup", 0.25)
    first = None
    tokens = imgs = n = 0
    first_tokens = first_images = 0
    mark = None  # (time, tokens, images, CPU of the tree) when the warm-up part was delivered
    for batch in batches:
        u, k = usable(batch), images(batch)
        n += 1
        if first is None:
            first = time.perf_counter()
            first_tokens, first_images = u, k
            first_cpu, first_machine = tree_cpu_s(), machine_cpu_s()
            continue
        tokens += u
        imgs += k
        if mark is None and (tokens >= warmup * target_tokens or imgs >= warmup * target_images):
            mark = (time.perf_counter(), tokens, imgs, tree_cpu_s(), machine_cpu_s())
        if tokens >= target_tokens or imgs >= target_images:
            break
    end = time.perf_counter()
    end_cpu, (end_busy, end_stolen) = tree_cpu_s(), machine_cpu_s()
    if first is None:
        raise RuntimeError("the loader produced no batch")
    mark = mark or (first, 0, 0, first_cpu, first_machine)
    steady = end - mark[0]
    steady_cpu = end_cpu - mark[3]
    others_cpu = max(0.0, end_busy - mark[4][0] - steady_cpu)  # ticks round: never below nothing
    return {
        "batches": n,
        "time_to_first_batch_s": first - _T0,
        "steady_s": steady,
        "usable_tokens": tokens,
        "images": imgs,
        "usable_tokens_per_s": (tokens - mark[1]) / steady if steady > 0 else 0.0,
        "images_per_s": (imgs - mark[2]) / steady if steady > 0 else 0.0,
        "steady_usable_tokens": tokens - mark[1],
        "steady_images": imgs - mark[2],
        "steady_cpu_s": steady_cpu,
        "cores_busy": steady_cpu / steady if steady > 0 else 0.0,
        "others_cores_busy": others_cpu / steady if steady > 0 else 0.0,
        "stolen_cores": (end_stolen - mark[4][1]) / steady if steady > 0 else 0.0,
        "end_to_end_usable_tokens_per_s": (tokens + first_tokens) / (end - _T0),
        "first_batch_usable_tokens": first_tokens,
        "first_batch_images": first_images,
        "total_s": end - _T0,
    }


def finish(result: dict) -> None:
    result["pid"] = os.getpid()
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)
    sys.stdout.flush()
    # Skip interpreter teardown cost and any hang in a loader's atexit: the result is written.
    os._exit(0)
