"""Peak memory of a whole process tree (the loader's process and every worker it starts).

Sampled from /proc every `interval` seconds: the sum of RSS over the tree (what `ps` would add up;
forked workers' shared pages are counted once per process) and the sum of PSS (proportional set
size: each shared page split between the processes that map it, so a forked tree is not counted
twice). The race reports PSS as the memory a loader really costs and keeps RSS beside it.
"""

from __future__ import annotations

import os
import threading


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: split after the last ')'
        fields = stat[stat.rindex(b")") + 2:].split()
        out.setdefault(int(fields[1]), []).append(int(name))
    return out


def tree(root: int) -> list[int]:
    children = _children_map()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _rollup(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


class TreeMemory:
    """Samples the tree under `root` on a background thread until `stop()`."""

    def __init__(self, root: int, interval: float = 0.1) -> None:
        self.root, self.interval = root, interval
        self.peak_rss = self.peak_pss = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="race-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = tree(self.root)
            rss = pss = 0
            for pid in pids:
                r, p = _rollup(pid)
                rss += r
                pss += p
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self.peak_processes = max(self.peak_processes, len(pids))
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_bytes": self.peak_rss, "peak_pss_bytes": self.peak_pss, "peak_processes": self.peak_processes}
