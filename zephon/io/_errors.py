"""The errors of a shard that cannot be read: unavailable even after retries, or of no size told."""

from __future__ import annotations

from .._errors import ConfigurationError, ZephonError

__all__ = ["ShardUnavailableError", "UnsizedShardError"]


class ShardUnavailableError(ZephonError):
    """A shard could not be read after every retry: it vanished, or the storage kept failing.

    The message names the shard URL and the last underlying error, so that a training log points at
    the file to check without a debugger.
    """

    def __init__(self, url: str, attempts: int, cause: str) -> None:
        self.url = url
        self.attempts = attempts
        self.cause = cause
        super().__init__(f"shard {url} unavailable after {attempts} attempt(s): {cause}")

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (type(self), (self.url, self.attempts, self.cause))


class UnsizedShardError(ConfigurationError):
    """A shard whose storage tells no size: an HTTP server that sends it, to HEAD and to GET,
    without a Content-Length (in chunks, as a page made on request is sent) or with a
    Content-Encoding (compressed on the fly, or an object stored with `Content-Encoding: gzip`),
    whose Content-Length is the encoding's, not the file's (fsspec takes it for no size).

    Raised at planning, not retried: the server answers the same way next time. Such a shard is not
    read either way: a chunk read seeks to its first record (line shards by their seek index,
    Parquet and tar by design), which fsspec's HTTP file of unknown size cannot do (it streams
    from the first byte only), and a file made on request is not promised to be the same bytes at
    every read, which batches identical on every rank and at every resume need.
    """

    def __init__(self, url: str, dataset_url: str) -> None:
        self.url = url
        self.dataset_url = dataset_url
        of = "" if url == dataset_url else f", a shard of {dataset_url},"
        super().__init__(
            f"{url}{of} tells no size: its server sent it without a Content-Length (in chunks, as a page "
            "made on request is sent), or with a Content-Encoding (compressed on the fly, or stored with "
            "Content-Encoding metadata), whose length is not the file's. Zephon plans and reads a shard by its "
            "size and byte ranges, from a file that stays the same: serve the shards as static files with a "
            "Content-Length and no Content-Encoding (a .gz shard as it is stored, not marked gzip-encoded; "
            "and an ETag or Last-Modified), or put them behind a server or CDN that does"
        )

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (type(self), (self.url, self.dataset_url))
