"""fsspec's `simplecache` with copies that appear whole or not at all, one per version of a file.

`SimpleCacheFileSystem` downloads a shard straight into its final name in the cache directory and
takes any file found there as the shard. A download that fails halfway (one transient error) left a
partial copy that the retry, and every later run, read as the whole shard: records vanished from
the plan with no error and no skip. Readers that open a shard while another is still copying it
(workers of one loader, when the cache is set through `io_options` after planning) read the part
copied so far, so batches differed by runner. Here each download goes to a temporary name beside
the final one and is renamed into place once complete (a rename within one directory is atomic),
and a failed download leaves nothing behind. Two readers may then download the same shard at once;
both copies are whole and either may win.

`simplecache` also names a copy by the shard's path alone and never looks at the remote file again,
so a shard rewritten at its path (a dataset regenerated in place) was read from the old copy by
every later run: its plan took the new size from the listing and the old records from the copy,
and records added or changed were missing without a word. Here a copy is named by the path and the
version the filesystem reports for it (`ukey`: the ETag on S3 and GCS, else a hash of the file's
listing entry: size, modification time and the like; fsspec takes an http(s) file as never
changing), asked on every open; a new version is copied anew, and copies of old versions stay on
disk until the directory is cleared.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

from fsspec.implementations.cache_mapper import AbstractCacheMapper
from fsspec.implementations.cached import SimpleCacheFileSystem

__all__ = ["AtomicSimpleCacheFileSystem"]


class AtomicSimpleCacheFileSystem(SimpleCacheFileSystem):
    """`simplecache` whose copies are written under a temporary name and renamed when complete, and
    named by the version of the file they copy."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._mapper = _VersionedNames(self.fs)

    def _get_cached_file_before_open(self, path, **kwargs):
        if self.compression:  # Zephon never asks the cache to decompress; fsspec's own path then
            return super()._get_cached_file_before_open(path, **kwargs)
        self._mkcache()
        self._cache_size = None
        final = os.path.join(self.storage[-1], self._mapper(path))
        handle, partial = tempfile.mkstemp(dir=self.storage[-1], prefix=os.path.basename(final) + ".", suffix=".part")
        os.close(handle)
        try:
            self.fs.get_file(path, partial)
            os.replace(partial, final)
        except BaseException:
            os.unlink(partial)
            raise


class _VersionedNames(AbstractCacheMapper):
    """The name of a copy: a hash of the remote path and of the version `fs` reports for it now."""

    def __init__(self, fs) -> None:
        self.fs = fs

    def __call__(self, path: str) -> str:
        return hashlib.sha256(f"{path}\n{self.fs.ukey(path)}".encode()).hexdigest()
