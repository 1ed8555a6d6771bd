"""Local shards through the standard library, so that reading local files never imports fsspec.

Importing fsspec brings asyncio, ssl and sockets with it: 7 MiB more PSS (14 MiB RSS) on 3.14t in
every process that reads (the loader's, and each worker process's), for files that the built-in
`open` reads as well. A plain path (no `://`, no `::` chain) is read here; every URL with a
protocol, `file://` included, still goes through fsspec.

Listing follows fsspec's local filesystem where a user could tell the difference: paths are absolute
and POSIX, `~` is expanded, a glob's `*` stays within one directory and `**` spans any number of them,
hidden directories are searched (hidden files, and the files of hidden directories below the URL, are
dropped by the caller, for every filesystem alike).
Links, to files and to directories, are followed, as the standard library's glob follows them; a
`file://` URL is listed here too, because fsspec's local listing types a link by itself ("other")
and so passes over linked directories: a directory, a glob and a `file://` URL of one dataset list
the same shards. A link back to a directory that holds it would list the same shards without end
(a glob's `**` went round such a loop 40 times, and forever with two such links in one directory):
it is a ConfigurationError naming the link. So is a directory in the dataset that cannot be listed
or searched (permission denied): `os.walk` and `glob` pass over it as if it were empty, and its
shards would be missing from the plan without a word. A link whose target is gone (a Hugging Face
cache snapshot whose blob was deleted) is listed with no size, for the caller to refuse once it
knows whether the dataset's format takes the link's name for a shard.

What the path names is asked once (`os.stat`), and only "no such file" (or a file where a directory
was meant) is taken for nothing there. `os.path.isdir` and `isfile` say False for every error, so a
disk out of reach (an NFS or FUSE mount of a bucket answering EIO) read as a path naming nothing;
that error now reaches the caller's retry, and a path that may not be looked at (permission
denied) raises PermissionError for the caller to name.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO, NoReturn

from .._errors import ConfigurationError
from ._listing import Listing

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


def list_local(pattern: str, has_glob: bool) -> Listing | None:
    """The Listing of a directory, a glob or a single existing file, and None when the path names
    nothing. A path that names a directory or a file as written is taken literally, glob characters
    and all; only otherwise is it expanded as a glob. A dangling link is listed with size None:
    whether it is a missing shard or a stray link (to a README, say) depends on the format, which
    the caller decides."""
    path = os.path.abspath(os.path.expanduser(pattern))
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = 0
    if stat.S_ISDIR(mode):
        found: dict[str, int | None] = {}
        for directory, names in _walk(path):
            for name in names:
                file = os.path.join(directory, name)
                if (size := _file_size(file)) != _NOT_A_FILE:
                    found[file] = size
        return Listing(path, "directory", found)
    if stat.S_ISREG(mode):
        return Listing(path, "file")
    if has_glob:
        _check_glob_can_search(path)
        matches = glob.glob(path, recursive=True, include_hidden=True)
        return Listing(path, "glob", {m: size for m in matches if (size := _file_size(m)) != _NOT_A_FILE})
    return None


_NOT_A_FILE = -1


def _file_size(path: str) -> int | None:
    """The size of `path` if it is a file (links followed), None if it is a dangling link,
    `_NOT_A_FILE` if it is something else (a directory, a socket); ConfigurationError if it cannot
    be looked at (its directory is not searchable), where `os.path.isfile` would say False and drop
    a shard."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None if os.path.islink(path) else _NOT_A_FILE  # a file deleted since it was listed
    except OSError as error:
        _unreadable(error)
    return status.st_size if stat.S_ISREG(status.st_mode) else _NOT_A_FILE


def _unreadable(error: OSError) -> NoReturn:
    raise ConfigurationError(
        f"{error.filename} cannot be read while listing the dataset ({error.strerror}): "
        "shards there would be missing from it"
    ) from error


def _walk(top: str) -> Iterator[tuple[str, list[str]]]:
    """(directory, names of what in it is no directory) for `top` and every directory below it,
    links to directories followed; ConfigurationError at a link that would go round a loop and at
    a directory that cannot be listed.

    A link loops when its target holds (or is) a directory the walk came through to reach it: the
    target is then an ancestor of a real path on the way down. Only links need the check: a plain
    subdirectory is new on its way.
    """
    ways = {top: (os.path.realpath(top),)}  # directory -> real paths of the directories down to it
    for directory, subdirectories, names in os.walk(top, onerror=_unreadable, followlinks=True):
        way = ways.pop(directory)
        for name in subdirectories:
            sub = os.path.join(directory, name)
            if not os.path.islink(sub):
                ways[sub] = (*way, os.path.join(way[-1], name))
                continue
            target = os.path.realpath(sub)
            if any(os.path.commonpath((target, passed)) == target for passed in way):
                raise ConfigurationError(
                    f"{sub} links to {target}, a directory that holds it: "
                    "its shards would be listed without end (a loop of symbolic links)"
                )
            ways[sub] = (*way, target)
        yield directory, names


def _check_glob_can_search(pattern: str) -> None:
    """Raise where `glob` would quietly match less than is there: it takes a directory it cannot
    list, or a name it cannot look up, for one that holds nothing, and its `**` follows links to
    directories with no end when they loop. So, part by part below the glob's fixed part, the
    directories it will list are opened, the names it will look up are looked up, and what a `**`
    will search is walked (which is everything below it)."""
    parts = pattern.split(os.sep)
    first = next(depth for depth, part in enumerate(parts) if glob.has_magic(part))
    for depth in range(first, len(parts)):
        above = glob.glob(os.sep.join(parts[:depth]) or os.sep, recursive=True, include_hidden=True)
        for directory in filter(os.path.isdir, above):
            try:
                if parts[depth] == "**":
                    for _ in _walk(directory):
                        pass
                elif glob.has_magic(parts[depth]):
                    os.scandir(directory).close()
                else:
                    os.lstat(os.path.join(directory, parts[depth]))
            except FileNotFoundError:
                pass
            except OSError as error:
                _unreadable(error)
        if parts[depth] == "**":
            return
