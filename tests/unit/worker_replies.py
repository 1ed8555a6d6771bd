"""Replies as a process-runner worker writes them to its pipe, for the tests that read them or
stand in for a worker sending part of one (imported explicitly, not a conftest)."""

from __future__ import annotations

import tempfile

from runners._frames import send_reply


def framed(*payloads: bytes) -> bytes:
    """The bytes a worker writes to its pipe for `payloads` (written to a file, which never blocks)."""
    with tempfile.TemporaryFile() as file:
        for payload in payloads:
            send_reply(file.fileno(), payload)
        file.seek(0)
        return file.read()


def half_of_a_reply() -> bytes:
    """The first half of what a worker writes to its pipe for a reply of 8 KiB."""
    whole = framed(bytes(8 * 1024))
    return whole[: len(whole) // 2]
