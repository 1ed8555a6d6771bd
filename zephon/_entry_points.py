"""The entry points other packages register for zephon, read once per process.

Reading them walks every installed distribution's metadata, 10-20 ms each time on 3.14t (the
thirty-third session's machine), and a VLM pipeline read them three times before its first batch:
for `decode_images`, for `pack_multimodal` (`zephon.pipeline`) and for its runner
(`zephon.runners`). A name not found in that read is looked for in a new one (`find`) when a
package may have been installed since: a package installed since the first read (`pip install`
in a running notebook) is found, as when every lookup read them. Whether one may have been is
told by `sys.path` and its entries' modification times (`_where_packages_are`): installing adds a
metadata directory to one of them, or an entry to `sys.path`. Without that check every miss read
them again, and a miss is common: `hasattr(pipeline, "keys")`, as libraries probe objects, took
about 10 ms each time.
"""

from __future__ import annotations

import os
import sys
from functools import cache
from importlib.metadata import EntryPoints, entry_points

__all__ = ["find", "registered"]

_read_where: tuple[tuple[str, int | None], ...] | None = None  # `_where_packages_are` at the last read


def _where_packages_are() -> tuple[tuple[str, int | None], ...]:
    """Each `sys.path` entry with its modification time (None where it cannot be looked at)."""
    where = []
    for entry in sys.path:
        try:
            where.append((entry, os.stat(entry or ".").st_mtime_ns))
        except (OSError, TypeError, ValueError):  # a missing path; a non-str entry put there by hand
            where.append((entry, None))
    return tuple(where)


@cache
def _installed() -> EntryPoints:
    global _read_where
    _read_where = _where_packages_are()
    return entry_points()


def registered(group: str) -> EntryPoints:
    """The entry points of `group` as this process last read them, in the order
    `importlib.metadata.entry_points` gives them."""
    return _installed().select(group=group)


def find(group: str, name: str) -> EntryPoints:
    """The entry points of `group` named `name` (more than one where several packages register
    it), looked for again among the packages installed now when the last read has none and a
    package may have been installed since."""
    found = _installed().select(group=group, name=name)
    if not found and _where_packages_are() != _read_where:
        _installed.cache_clear()
        found = _installed().select(group=group, name=name)
    return found
