"""Which protocols a dataset's filesystem answers to, and so whether it is local or http(s).

`is_http` and `is_local` were two copies of one reading of `fs.protocol`, one in `_http_index` and
one in `_locate`, kept apart because `_locate` imports `_http_index`; this module imports neither,
so every module that asks imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ._local import LocalFiles

__all__ = ["is_http", "is_local", "protocols_of"]


def protocols_of(fs: AbstractFileSystem | LocalFiles) -> tuple[str, ...]:
    """The protocols `fs` answers to (fsspec gives one as a str, several as a tuple)."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def is_http(fs: AbstractFileSystem | LocalFiles) -> bool:
    """Whether `fs` is fsspec's HTTPFileSystem, over aiohttp or blocking (`sync-http`, whose
    protocols are http's too)."""
    return not {"http", "https"}.isdisjoint(protocols_of(fs))


def is_local(fs: AbstractFileSystem | LocalFiles) -> bool:
    """Whether `fs` is the local disk (`LocalFiles`, or fsspec's local filesystem)."""
    return not {"file", "local"}.isdisjoint(protocols_of(fs))
