"""Which filesystem a Dataset reads through: the URL's own, or a local-disk cache in front of it.

Caching uses fsspec's `simplecache`, which copies a whole remote file to local disk on first open
and serves later opens from the copy. It keeps no metadata, which fsspec recommends for concurrent
readers. A copy is named by the version of the file it holds (`_version`: an ETag, or the size and
modification time): a Dataset's reads look for the copy of the version they planned, planning for
the one its listing gave (else the one the remote reports), so a shard rewritten remotely is
copied anew rather than read from its old copy, and a copy that is not of its version is never
kept (`_atomic_cache`); old copies stay until the directory is cleared. A cache given to `Dataset.from_path` makes its copies while
planning (which opens every shard); one set through `Pipeline.options(io_options=...)` applies after planning, so the
workers' first reads make them. Either way a copy is written under a temporary name and renamed
when whole (`_atomic_cache`): a failed download leaves nothing, and readers racing on a first
download (workers, or two runs sharing the directory) never see part of one, at worst both
download it; a download killed midway leaves a temporary file that a later download on the same
host removes once no live process holds it. Local files are never copied.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import ConfigurationError
from ._protocols import is_local
from ._url_caches import whole_file_layer

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ._local import LocalFiles
    from ._version import ShardVersion

__all__ = ["CacheOptions", "filesystem_made_here", "reading_filesystem"]


@dataclass(frozen=True)
class CacheOptions:
    """`enabled` turns the cache on; `dir` is where copies live (default: the user cache directory).

    The default is a fixed directory rather than fsspec's per-instance temporary one, so that every
    worker process of a run, and the next run, find the copies already made.
    """

    enabled: bool = False
    dir: str | None = None

    @classmethod
    def from_dict(cls, options: Mapping | None) -> CacheOptions:
        if options is not None and not isinstance(options, Mapping):
            raise ConfigurationError(f"cache options are a dict like {{'enabled': True, 'dir': ...}}, got {options!r}")
        options = dict(options or {})
        unknown = sorted(set(options) - {"enabled", "dir"})
        if unknown:
            raise ConfigurationError(f"cache options {unknown} are unknown; expected 'enabled', 'dir'")
        enabled, directory = options.get("enabled", False), options.get("dir")
        if not isinstance(enabled, bool):  # bool("false") is True: a config file's string turned it on
            raise ConfigurationError(f"cache option enabled={enabled!r} must be True or False")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise ConfigurationError(f"cache option dir={directory!r} must be a path (a str or os.PathLike)")
        return cls(enabled, directory)

    @property
    def directory(self) -> str:
        if self.dir is not None:  # `~` expanded, as in a dataset's path: not a directory named `~`
            return os.path.expanduser(os.fspath(self.dir))
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "zephon", "shards")


def reading_filesystem(
    fs: AbstractFileSystem | LocalFiles, cache: CacheOptions, planned_versions: Mapping[str, ShardVersion] | None = None
) -> AbstractFileSystem | LocalFiles:
    """`fs`, or the cache in front of it; `planned_versions` (path -> version, see `_version`) name
    the copies a Dataset's reads look for, and planning's (the listing's). A URL naming fsspec's
    `simplecache::` or `filecache::` is read through this cache in the layer's directories, or in
    the one `cache` names where it is enabled, and local files under it in place (`_url_caches`)."""
    layer = whole_file_layer(fs)
    if layer is not None:
        fs, directories = layer
        if not cache.enabled and not is_local(fs):
            return _atomic_cache_in(directories, fs, planned_versions)
    if not cache.enabled or is_local(fs):
        return fs
    return _atomic_cache_in(cache.directory, fs, planned_versions)


def _atomic_cache_in(
    directories: str | list[str], fs: AbstractFileSystem, planned_versions: Mapping[str, ShardVersion] | None
) -> AbstractFileSystem:
    from ._atomic_cache import AtomicSimpleCacheFileSystem  # imports fsspec, which a remote filesystem has already

    try:  # makes the directory if it is missing
        return AtomicSimpleCacheFileSystem(fs=fs, cache_storage=directories, planned_versions=planned_versions)
    except OSError as error:  # else a bare "File exists" or "Not a directory", from planning or a worker
        written = directories if isinstance(directories, str) else directories[-1]
        raise ConfigurationError(
            f"cache directory {written} cannot be made ({error.strerror}: {error.filename}); "
            "set io cache options {'dir': ...} to a directory that can be written"
        ) from error


def filesystem_made_here(fs: AbstractFileSystem | LocalFiles) -> AbstractFileSystem | LocalFiles:
    """`fs` as unpickling it in this process would make it, where `fs` may be of another process (a
    fork's parent). Each filesystem's own `__reduce__` says what crosses a process boundary, and
    `copy.copy` follows it without pickling the arguments. fsspec's says the constructor arguments
    (its instance cache holds none from another process after a fork): an asynchronous filesystem
    gets an event loop of this process, and a blocking one that holds connections (`sync-http`'s
    requests session, sftp's, ftp's) its own, since forked children sharing a pooled keep-alive
    connection read each other's responses. huggingface_hub's HfFileSystem says its listings and
    repository checks too: made from its arguments alone, each forked worker asked the hub again
    for them; its connections are huggingface_hub's own, which it closes in a forked child. A
    local one stays as it is, since it holds nothing of a process."""
    if is_local(fs):
        return fs
    return copy.copy(fs)
