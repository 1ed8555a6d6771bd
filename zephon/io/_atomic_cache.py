"""fsspec's `simplecache` with copies that appear whole or not at all.

`SimpleCacheFileSystem` downloads a shard straight into its final name in the cache directory and
takes any file found there as the shard. A download that fails halfway (one transient error) left a
partial copy that the retry, and every later run, read as the whole shard: records vanished from
the plan with no error and no skip. Readers that open a shard while another is still copying it
(workers of one loader, when the cache is set through `io_options` after planning) read the part
copied so far, so batches differed by runner. Here each download goes to a temporary name beside
the final one and is renamed into place once complete (a rename within one directory is atomic),
and a failed download leaves nothing behind. Two readers may then download the same shard at once;
both copies are whole and either may win.
"""

from __future__ import annotations

import os
import tempfile

from fsspec.implementations.cached import SimpleCacheFileSystem

__all__ = ["AtomicSimpleCacheFileSystem"]


class AtomicSimpleCacheFileSystem(SimpleCacheFileSystem):
    """`simplecache` whose copies are written under a temporary name and renamed when complete."""

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
