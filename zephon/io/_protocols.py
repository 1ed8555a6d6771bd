"""Which protocols a dataset's filesystem names: its own, and those of the store under its caches.

fsspec chains a cache in front of a store in one URL (`simplecache::https://host/data/`,
`filecache::…`, `blockcache::…`): the filesystem made is the cache, whose `protocol` is its own
("simplecache"), while the paths it takes, its listing and its `info()` are the store's, handed on.
Whether a URL is http(s) is a question about the store: asked of the cache, such a URL got none of
http's handling (a directory read from its index page, the status under fsspec's
FileNotFoundError, a signed URL's format from its path). Only fsspec's caching filesystems are
seen through, since they hand a path on as it is; other chains (`zip::`, `tar::`, `dir::`) name
paths of their own, which are no URLs of the store.

`is_http` and `is_local` were two copies of one reading of `fs.protocol`, one in `_http_index` and
one in `_locate`, kept apart because `_locate` imports `_http_index`; this module imports neither,
so every module that asks imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ._local import LocalFiles

__all__ = ["caching_layers", "is_http", "is_local", "protocols_of", "store_of"]


def protocols_of(fs: AbstractFileSystem | LocalFiles) -> tuple[str, ...]:
    """The protocols `fs` answers to (fsspec gives one as a str, several as a tuple)."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def caching_layers(fs: AbstractFileSystem | LocalFiles) -> Iterator[AbstractFileSystem]:
    """`fs`'s caching layers, outermost first (none where `fs` is no cache). fsspec's caching
    module is looked up, never imported: a cache of it in hand means it is imported, and a local
    path is listed without importing fsspec at all (`_local`)."""
    cached = sys.modules.get("fsspec.implementations.cached")
    while cached is not None and isinstance(fs, cached.CachingFileSystem):
        yield fs
        fs = fs.fs


def store_of(fs: AbstractFileSystem | LocalFiles) -> AbstractFileSystem | LocalFiles:
    """The filesystem under `fs`'s caching layers, `fs` itself where it is none."""
    for layer in caching_layers(fs):
        fs = layer.fs
    return fs


def is_http(fs: AbstractFileSystem | LocalFiles) -> bool:
    """Whether `fs` reads an http(s) store, through caches or not: fsspec's HTTPFileSystem, over
    aiohttp or blocking (`sync-http`, whose protocols are http's too)."""
    return not {"http", "https"}.isdisjoint(protocols_of(store_of(fs)))


def is_local(fs: AbstractFileSystem | LocalFiles) -> bool:
    """Whether `fs` itself is the local disk. A cache in front of local files is not: it is read
    through fsspec, as the URL says."""
    return not {"file", "local"}.isdisjoint(protocols_of(fs))
