"""Local shards through the standard library, so that reading local files never imports fsspec.

Importing fsspec brings asyncio, ssl and sockets with it: 7 MiB more PSS (14 MiB RSS) on 3.14t in
every process that reads (the loader's, and each worker process's), for files that the built-in
`open` reads as well. A plain path (no `://`, no `::` chain) is read here; every URL with a
protocol, `file://` included, still goes through fsspec.

Listing follows fsspec's local filesystem where a user could tell the difference: paths are absolute
and POSIX, `~` is expanded, a glob's `*` stays within one directory and `**` spans any number of them,
hidden directories are searched (hidden files are dropped by the caller, for every filesystem alike).
"""

from __future__ import annotations

import glob
import os
from typing import BinaryIO

__all__ = ["LocalFiles", "is_plain_path", "list_local"]


class LocalFiles:
    """The subset of fsspec's filesystem interface a Dataset reads through. Stateless, picklable."""

    protocol = ("file", "local")

    def open(self, path: str, mode: str = "rb") -> BinaryIO:
        return open(path, mode)

    def size(self, path: str) -> int:
        return os.path.getsize(path)


def is_plain_path(url: str) -> bool:
    """A path on the local disk, as opposed to a URL with a protocol or an fsspec chain."""
    return "://" not in url and "::" not in url


def list_local(pattern: str, has_glob: bool) -> tuple[str, dict[str, int] | None] | None:
    """(absolute path, {file: size}) for a directory or a glob, (absolute path, None) for a single
    existing file, and None when the path names nothing. A path that names a directory or a file as
    written is taken literally, glob characters and all; only otherwise is it expanded as a glob."""
    path = os.path.abspath(os.path.expanduser(pattern))
    if os.path.isdir(path):
        found: dict[str, int] = {}
        for directory, _, names in os.walk(path):
            for name in names:
                file = os.path.join(directory, name)
                if os.path.isfile(file):
                    found[file] = os.path.getsize(file)
        return path, found
    if os.path.isfile(path):
        return path, None
    if has_glob:
        matches = glob.glob(path, recursive=True, include_hidden=True)
        return path, {m: os.path.getsize(m) for m in matches if os.path.isfile(m)}
    return None
