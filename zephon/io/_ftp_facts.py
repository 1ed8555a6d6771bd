"""One FTP file's facts by MLST (RFC 3659), the command that describes a single file.

fsspec's FTP filesystem describes a file from its listing of the file's directory (MLSD), which it
keeps for the life of the filesystem. A chunk read asks whether its shard is still the version
planned; listing the shard's directory again for that took 16 ms per chunk read in a directory of
1,000 shards (1.7 ms in one of 10; pyftpdlib on localhost). MLST answers for the file alone, in
one command on the control connection, with the same facts MLSD lists (`modify` among them). A
server without MLST refuses it, and the caller lists the directory instead.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_ftp", "is_ftp_file", "mlst_facts"]


def is_ftp(store: Any) -> bool:
    """Whether `store` is fsspec's FTP filesystem (looked up, never imported)."""
    ftp = sys.modules.get("fsspec.implementations.ftp")
    return ftp is not None and isinstance(store, ftp.FTPFileSystem)


def is_ftp_file(handle: Any) -> bool:
    """Whether `handle` is a file fsspec's FTP filesystem opened (looked up, never imported)."""
    ftp = sys.modules.get("fsspec.implementations.ftp")
    return ftp is not None and isinstance(handle, ftp.FTPFile)


def mlst_facts(store: Any, path: str) -> dict[str, Any] | None:
    """The facts the FTP server behind `store` gives of `path` (names lower-cased, `size` an
    int, as fsspec lists them), or None where it refuses MLST. The caller holds the store's lock
    (`_shared_handles.store_calls`): the command goes over the one control connection."""
    from ftplib import error_perm

    try:
        reply = store.ftp.sendcmd(f"MLST {path}")
    except error_perm:
        return None
    # "250-Listing /data/s0.jsonl", then " type=file;size=48379;modify=20261205063012; /data/s0.jsonl", then "250 End"
    entry = next((line for line in reply.splitlines()[1:] if line.startswith(" ")), None)
    if entry is None:
        return None
    facts = {}
    for fact in entry.strip().split(" ", 1)[0].split(";"):
        name, equals, value = fact.partition("=")
        if equals:
            facts[name.lower()] = value
    if "size" in facts:
        facts["size"] = int(facts["size"])
    return facts
