"""Shards on an http(s) server that does not answer range requests, read from their start.

A chunk is read from where it begins in its shard (the seek point planning found), which fsspec's
http(s) files fetch with range requests. A server that answers them with the whole file instead
(`python -m http.server`, whose directories Zephon plans as datasets) made fsspec refuse every
read but the first chunk's: "The HTTP server doesn't appear to support range requests", a
ValueError that failed the loader. Such a shard is read here through fsspec's streaming file
(`block_size=0`, one GET from the start), which a seek forward skips through by reading, and a
seek back opens again: every chunk then costs the bytes before it too, which the warning says,
with the ways to avoid it (a server that answers ranges, or Zephon's cache: one copy per shard).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["RangesRefused", "ranges_refused"]

_REFUSAL = "doesn't appear to support range requests"  # fsspec's http and sync-http say so
_SKIP_BYTES = 1 << 20


def ranges_refused(error: BaseException) -> bool:
    """Whether `error` is fsspec's refusal to read an http(s) file whose server ignored a range."""
    return isinstance(error, ValueError) and _REFUSAL in str(error)


class RangesRefused(io.RawIOBase):
    """A shard read from its start through `open_stream()`, seekable by reading forward or opening
    again; `size` (the planned size, None where unknown) places a seek from the end."""

    def __init__(self, open_stream: Callable[[], BinaryIO], size: int | None) -> None:
        self._open_stream, self._size = open_stream, size
        self._stream, self._position = open_stream(), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._stream.read(len(buffer))
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            if self._size is None:
                raise io.UnsupportedOperation("the end of a shard of unknown size, read from its start")
            target = self._size + offset
        else:
            target = offset if whence == io.SEEK_SET else self._position + offset
        if target < 0:
            raise ValueError(f"negative seek position {target}")
        if target < self._position:
            self._stream.close()
            self._stream, self._position = self._open_stream(), 0
        while self._position < target:
            skipped = len(self._stream.read(min(_SKIP_BYTES, target - self._position)))
            if not skipped:  # past the end: reads there give nothing, as on any file
                self._position = target
                break
            self._position += skipped
        return self._position

    def tell(self) -> int:
        return self._position

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()
