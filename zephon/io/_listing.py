"""What listing a dataset's URL found, whichever lister found it.

A local path is listed with the standard library (`_local`) and a URL through fsspec (`_locate`);
both hand `_locate` a Listing, so that what follows (choosing shards by format, refusing what
cannot be read, saying what a directory with no shard holds) is one code for every filesystem.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Listing"]


@dataclass(frozen=True)
class Listing:
    """What a URL names: one `file`, a `directory` or a `glob`'s matches, at absolute `path`.

    `sizes` maps each file listed (none for a `file`) to its size, None for a dangling link;
    `details` maps a file to what the filesystem told of it (fsspec's details; empty for a local
    listing). The kind is kept so that a directory holding no shard is told apart from a glob
    matching none."""

    path: str
    kind: Literal["file", "directory", "glob"]
    sizes: Mapping[str, int | None] = field(default_factory=dict)
    details: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
