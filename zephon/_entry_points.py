"""The entry points other packages register for zephon, read once per process.

Reading them walks every installed distribution's metadata, 10-20 ms each time on 3.14t (the
thirty-third session's machine), and a VLM pipeline read them three times before its first batch:
for `decode_images`, for `pack_multimodal` (`zephon.pipeline`) and for its runner
(`zephon.runners`). A name not found in that read is looked for in a new one
(`find`): a package installed since the first read (`pip install` in a running notebook) is
found, as when every lookup read them, and only a miss pays for the read.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoints, entry_points

__all__ = ["find", "registered"]


@cache
def _installed() -> EntryPoints:
    return entry_points()


def registered(group: str) -> EntryPoints:
    """The entry points of `group` as this process last read them, in the order
    `importlib.metadata.entry_points` gives them."""
    return _installed().select(group=group)


def find(group: str, name: str) -> EntryPoints:
    """The entry points of `group` named `name` (more than one where several packages register
    it), looked for again among the packages installed now when the last read has none."""
    found = _installed().select(group=group, name=name)
    if not found:
        _installed.cache_clear()
        found = _installed().select(group=group, name=name)
    return found
