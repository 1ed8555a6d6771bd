"""What an http(s) store said, where fsspec's whole-file cache in front of it kept only "not found".

`simplecache::https://…` and `filecache::https://…` ask the store whether a file exists before
copying it (`exists`, a GET), and keep yes or no: a 429 or 503 whose Retry-After says when to come
back, a 403, a 5xx, all read as a FileNotFoundError with no status under it, so a rate-limited read
was retried after the doubling backoff alone, sooner than the server asked. Where opening a file
through such a cache finds nothing, the store is asked once what it says of the file (`info()`, a
HEAD), and its error, which carries the status and headers (`_http_status`, `_retry_after`), is
raised in place of the cache's; where the store describes the file (it answers again), the cache's
error stands and the retry reads the file. Nothing is asked on a read that succeeds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._protocols import is_http, store_of

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ._local import LocalFiles

__all__ = ["raise_what_the_store_said"]


def raise_what_the_store_said(fs: AbstractFileSystem | LocalFiles, path: str) -> None:
    """Where `fs` is a cache in front of an http(s) store and opening `path` through it found no
    file, raise the store's own error for `path` (module docstring); return where there is none."""
    store = store_of(fs)
    if store is fs or not is_http(store):
        return
    try:
        store.info(path)
    except FileNotFoundError as said:  # HTTP's info() raises it for every failure, from the client's error
        if said.__cause__ is not None:
            raise said
