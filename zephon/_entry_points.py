"""The entry points other packages register for zephon, read once per process.

Reading them walks every installed distribution's metadata, 10-20 ms each time on 3.14t (the
thirty-third session's machine), and a VLM pipeline read them three times before its first batch:
for `decode_images`, for `pack_multimodal` (`zephon.pipeline`) and for its runner
(`zephon.runners`). A name not found in that read is looked for in a new one
(`registered(group, reread=True)`): a package installed since the first read (`pip install` in a
running notebook) is found, as when every lookup read them, and only a miss pays for the read.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoints, entry_points

__all__ = ["registered"]


@cache
def _installed() -> EntryPoints:
    return entry_points()


def registered(group: str, *, reread: bool = False) -> EntryPoints:
    """The entry points of `group`, in the order `importlib.metadata.entry_points` gives them;
    with `reread`, from the packages installed now rather than at this process's first read."""
    if reread:
        _installed.cache_clear()
    return _installed().select(group=group)
