"""The entry points other packages register for zephon, read once per process.

Reading them walks every installed distribution's metadata, 10-20 ms each time on 3.14t (the
thirty-third session's machine), and a VLM pipeline read them three times before its first batch:
for `decode_images`, for `pack_multimodal` (`zephon.pipeline`) and for its runner
(`zephon.runners`). A package installed after the first read is found by the next process, as a
module installed after an import is.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoints, entry_points

__all__ = ["registered"]


@cache
def _installed():
    return entry_points()


def registered(group: str) -> EntryPoints:
    """The entry points of `group`, in the order `importlib.metadata.entry_points` gives them."""
    return _installed().select(group=group)
