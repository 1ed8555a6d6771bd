"""Peak memory of a whole process tree (the loader's process and every worker it starts).

Sampled from /proc every `interval` seconds: the sum of RSS over the tree (what `ps` would add up;
forked workers' shared pages are counted once per process), and the sum of PSS (proportional set
size: each shared page split between the processes that map it, so a forked tree is not counted
twice) whenever that RSS reaches a new high (by `pss_margin`), and at least every `pss_interval` seconds. The race
reports PSS as the memory a loader really costs and keeps RSS beside it.

Beside them, the growth of the machine's shared memory (`Shmem` in /proc/meminfo, /dev/shm among
it) since the start: loaders that move data between processes through shared-memory files
(Zephon's process runner, torch's DataLoader, grain's multiprocessing) hold pages there that no
PSS counts while no process has touched them (a file mapped but not yet read, or no longer
mapped). It is machine-wide, so it is only meaningful on a machine doing nothing else.

PSS is not read at every sample because reading it is not free for the process observed: the
kernel walks every page table of the process under its memory-map lock, which stalls the process's
own mmap/munmap calls meanwhile. Read 10 times a second it cost the VLM race recipe (Zephon thread
runner, 3.14t, p=2) 5-8 % of its images/s (949-993 vs 1018-1071 unobserved); once a second it is
within noise but could step over a short peak. Memory peaks when RSS does, so reading PSS at every
new RSS high keeps the peaks at little cost once a loader's memory has levelled off. RSS comes
from /proc/<pid>/statm, a counter read that walks nothing.
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


def _kib_field(path: str, key: str) -> int:
    """Bytes of the `key:  N kB` line of a /proc file; 0 if the file is gone (a process that ended)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pss(pid: int) -> int:
    return _kib_field(f"/proc/{pid}/smaps_rollup", "Pss:")


def _shmem() -> int:
    return _kib_field("/proc/meminfo", "Shmem:")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE")


class TreeMemory:
    """Samples the tree under `root` on a background thread until `stop()`.

    PSS is read at least every `pss_interval` seconds, and at a new RSS high that is at least
    `pss_margin` (a fraction) above the RSS of the last PSS read. Without the margin, RSS that
    creeps up a few pages at a time (as every loader's does for its whole run) is a new high at
    most samples: PSS was read 2.5-5 times a second instead of about once (Zephon thread runner,
    VLM p=2: 60 reads in 112 samples, spread over the whole run; DataLoader and grain `mp` about 1
    sample in 3), and each read stalls the process observed (see above), by how much depending on
    how each loader's RSS happens to creep. A peak missed by the margin is at most that fraction
    above the reported one, and only if it lasted less than `pss_interval`.
    """

    def __init__(self, root: int, interval: float = 0.1, pss_interval: float = 1.0, pss_margin: float = 0.01,
                 start: bool = True) -> None:
        self.root, self.interval, self.pss_margin = root, interval, pss_margin
        self.pss_every = max(1, round(pss_interval / interval))
        self.peak_rss = self.peak_pss = self.peak_shm = 0
        self.peak_processes = self.pss_reads = 0
        self._rss_at_pss = 0
        self._sample = 0
        self._shm_at_start = _shmem()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="race-memory", daemon=True)
        if start:
            self._thread.start()

    def sample(self) -> None:
        """One sample of the tree (the background thread takes one every `interval`)."""
        pids = tree(self.root)
        rss = sum(_rss(pid) for pid in pids)
        high = rss > self.peak_rss and rss >= self._rss_at_pss * (1 + self.pss_margin)
        if high or self._sample % self.pss_every == 0:
            self.peak_pss = max(self.peak_pss, sum(_pss(pid) for pid in pids))
            self._rss_at_pss = rss
            self.pss_reads += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_shm = max(self.peak_shm, _shmem() - self._shm_at_start)
        self.peak_processes = max(self.peak_processes, len(pids))
        self._sample += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return {"peak_rss_bytes": self.peak_rss, "peak_pss_bytes": self.peak_pss, "peak_shm_bytes": self.peak_shm,
                "peak_processes": self.peak_processes, "pss_reads": self.pss_reads, "memory_samples": self._sample}
