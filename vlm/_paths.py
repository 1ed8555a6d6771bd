"""Where a video path read from the data points: beside its shard, never the worker's working directory.

A record that names its video by a relative path (a JSON line's "clips/a.mp4", a Hugging Face
Video column's {"bytes": None, "path": "clips/a.mp4"}) means a file kept with the dataset, as
the `file_name` of a Hugging Face folder dataset's metadata file is relative to that file. Opened
from the working directory, the same recipe read other files, or none, when started or resumed
from another directory or on another node, and nothing in the recipe told. So a relative path is
joined to the directory of the shard that holds the record when that shard is a local file: its
address then holds the shard's absolute path (`zephon.io` keeps local shards as plain absolute
paths, `file://` ones too). A remote shard (s3://, hf://, ...), or an address whose shard is not
an absolute local path, gives no directory a worker could open the file from: such a path is not
resolved at all, rather than guessed. An absolute path is taken as it is.
"""

from __future__ import annotations

import os

__all__ = ["as_the_record_names_it", "resolve_beside_shard"]


def resolve_beside_shard(path: str | os.PathLike, shard: str) -> str | None:
    """`path` if absolute, else joined to the directory of the local shard `shard`; None when
    `path` is relative and `shard` is not an absolute local path."""
    path = os.fspath(path)
    if os.path.isabs(path):
        return path
    if "://" in shard or "::" in shard or not os.path.isabs(shard):
        return None
    return os.path.join(os.path.dirname(shard), path)


def as_the_record_names_it(path: str | os.PathLike, shard: str) -> str:
    """The path as the record writes it and, when relative, the shard it was resolved beside: what
    an operator needs besides the file looked for to tell a wrong root or a folder a copy left out."""
    path = os.fspath(path)
    if os.path.isabs(path):
        return f"the record names the absolute path {path!r}"
    return f"the record names {path!r}, resolved beside its shard {shard}"
