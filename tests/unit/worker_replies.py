"""Replies as a process-runner worker writes them to its pipe, and that pipe as a stage function
finds it, for the tests that read replies or stand in for a worker (or a process it forked)
writing to or closing its pipe (imported explicitly, not a conftest)."""

from __future__ import annotations

import gc
import tempfile
from multiprocessing.connection import Connection

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


def worker_pipe() -> Connection:
    """The pipe of the worker process a stage function runs in: the one `Connection` it has open
    (a worker closes every other end it inherited as it starts)."""
    [conn] = [o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed]
    return conn
