"""The parsed footers of the Parquet shards a process read last, so that a chunk read does not
parse its shard's footer again.

A chunk read needs the footer to find its row groups, and parsing it costs about 0.5 µs per row
group and column: one shard of 1,000,000 rows in row groups of 1,000, two columns (a 491 KB
footer), took 0.96 ms to parse of a chunk read's 1.53 ms. The footer of a planned version of a
file never changes, so it is kept by the shard's URL and that version, and only where the read
opens the file checked against that version (`ShardFile.planned_version`): a read through a cache
layer, or of a shard whose storage tells no version, parses its footer each time. Kept up to
`FOOTERS_KEPT_BYTES` of serialized footers, the least recently read dropped first: a dataset of
a few large shards keeps all of theirs; one of many shards read in random order keeps few, and
their footers are small beside their row groups. Parsed, a footer takes about 7 times its size
in memory (a 250 KB one held 1.7 MB on 3.11), in each process that reads: 4 MiB of footers
cost a process about 28 MiB.

Thread-safe (a lock held for the dictionary's updates only; a forked child makes its own). The
footers are pyarrow's `FileMetaData`, which readers on several threads share: no read changes it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _fork

if TYPE_CHECKING:
    import pyarrow.parquet as pq

    from ._version import ShardVersion

__all__ = ["FOOTERS_KEPT_BYTES", "footer"]

FOOTERS_KEPT_BYTES = 4 << 20


class _Footers:
    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, ShardVersion], pq.FileMetaData] = OrderedDict()
        self._bytes = 0
        self._new_lock()
        _fork.renew_in_child(self, _Footers._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

    def get(self, key: tuple[str, ShardVersion], parse: Callable[[], pq.FileMetaData]) -> pq.FileMetaData:
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
        parsed = parse()  # outside the lock: other threads read other shards meanwhile
        size = parsed.serialized_size
        with self._lock:
            if key not in self._kept and size <= FOOTERS_KEPT_BYTES:
                self._kept[key] = parsed
                self._bytes += size
                while self._bytes > FOOTERS_KEPT_BYTES:
                    self._bytes -= self._kept.popitem(last=False)[1].serialized_size
        return parsed


_footers = _Footers()


def footer(url: str, version: ShardVersion | None, parse: Callable[[], pq.FileMetaData]) -> pq.FileMetaData:
    """The footer of `version` of the shard at `url`: kept from an earlier read, else `parse()`d
    and kept. None for `version` (no version the read checks) parses it every time."""
    if version is None:
        return parse()
    return _footers.get((url, version), parse)
