"""fsspec's cache layers named in a dataset's URL (`simplecache::`, `filecache::`, `blockcache::`).

fsspec's whole-file caches are not safe for a loader's readers. `filecache::` keeps one record of
the copies it holds, which each download loads, merges and writes back whole: two threads opening
shards at once (planning counts several shards at a time, a thread runner reads chunks on several
threads) lost each other's entries, and the open raised `TypeError: cannot unpack non-iterable
bool object` from inside fsspec (fsspec issue #249). Both it and `simplecache::` download into the
copy's final name, where a reader in another process (a process-runner worker) read the part
copied so far as the whole shard, and name a copy by its URL alone, so a shard rewritten at its
URL was read from the old copy. A URL with either layer is therefore read through Zephon's own
cache (`_atomic_cache`: a copy appears whole or not at all, one per version of the file) in the
layer's directories, the one `cache={"dir": ...}` names where that is given too: the layer's
intent, whole local copies in its directory, without its races. A layer that decompresses
(`compression=`) is kept as it is: the copies it makes are another file than the shard.

`blockcache::` is refused. It marks a block as held before fetching it, into a sparse local copy
shared by every reader of the file: a fetch that failed left its blocks marked, so the retry read
zeros where the records were (and its record of blocks held, saved when the file closed, kept
them for the next run), and a reader on another thread that asked for the same block meanwhile
read zeros too. Nothing Zephon can do around it makes those reads true.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .._errors import ConfigurationError
from ._protocols import caching_layers

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ._local import LocalFiles

__all__ = ["refuse_block_cache", "whole_file_layer"]


def refuse_block_cache(fs: AbstractFileSystem | LocalFiles, url: str) -> None:
    """Raise ConfigurationError where `fs`, or a layer under it, is fsspec's `blockcache`."""
    for layer in caching_layers(fs):  # a layer in hand: fsspec's caching module is imported
        if not isinstance(layer, sys.modules["fsspec.implementations.cached"].WholeFileCacheFileSystem):
            raise ConfigurationError(
                f"{url} is read through fsspec's blockcache, which marks a block as held before fetching "
                "it: a read that failed and was retried, or a read of the same block on another thread, "
                "reads zeros where the records are. Name the URL with simplecache:: instead (whole copies, "
                "kept by Zephon whole and per version), or without a cache and give cache={'enabled': True}"
            )


def whole_file_layer(fs: AbstractFileSystem | LocalFiles) -> tuple[AbstractFileSystem, list[str]] | None:
    """(the store under it, its cache directories) where `fs` is fsspec's `simplecache` or
    `filecache` (module docstring), else None. Zephon's own cache, a subclass, is no layer."""
    cached = sys.modules.get("fsspec.implementations.cached")
    if cached is None or not isinstance(fs, cached.WholeFileCacheFileSystem) or fs.compression:
        return None
    from ._atomic_cache import AtomicSimpleCacheFileSystem

    if isinstance(fs, AtomicSimpleCacheFileSystem):
        return None
    return fs.fs, list(fs.storage)
