"""The loop a forked worker process runs: receive an item, apply the stage function, reply.

The function arrives by inheritance (the process is forked after `start()` has the stages), so it
may be any closure or lambda; only items and results are pickled. Every message is one pickled
tuple on a private duplex pipe (requests framed by `multiprocessing`'s `Connection`, replies by
`_frames`, which the parent reads without waiting for the rest of one):

    parent -> worker   (the item's Envelope, offsets of reply-arena blocks the parent has
                       released), or STOP (empty bytes)
    worker -> parent   (ok, Envelope, offsets of request-arena blocks this worker has released,
                       number) where ok is False when the Envelope holds what fn raised (any
                       BaseException: the worker goes on serving)

The parent may send the next item while this one runs; items are handled and answered in the
order they arrive, so a reply answers the oldest item not yet answered, and its number is that
item's among those the worker has received (1 for the first). The number tells the worker's
replies from one another process put on its pipe (a child the stage function forked, holding the
pipe, writing a reply of its own while the worker runs an item), which answered the item in the
worker's place, the worker's own reply then answering none or the next.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Any

from ._arena import Arena, withhold_all_but
from ._frames import send_reply
from ._transport import Envelope, decode, encode

__all__ = ["STOP", "serve"]

STOP = b""

# How long a worker that lost its pipe waits to be handed to another parent before concluding that
# its parent is alive after all. The kernel hands a dying process's children on at the very end of
# its exit, after tearing down its memory, which for a trainer holding tens of GiB takes seconds.
_ORPHANING_WAIT_S = 30.0


def serve(
    conn: Connection,
    fn: Callable[[Any], Any],
    stage: str,
    directory: str,
    threshold: int,
    arena: Arena | None,
    requests: Arena | None,
    inherited: Iterable[Connection],
) -> None:
    """Run items until told to stop or until the parent disappears (end of file on the pipe).

    `arena` is this worker's reply arena; `requests` the runner's request arena, which items'
    buffers may arrive in; every other arena it inherited, it gives up at once (so that a crashed
    worker's arena is not kept for the life of the workers forked after it). An item's views of
    its request block are gone once its reply is built (unless the function kept them), so the
    block goes back with that very reply.

    `inherited` are the parent's ends of every pipe that existed at fork time, this worker's own
    included: closing them here is what makes the parent's death visible as end of file.

    A worker that outlives its parent removes the runner's buffer `directory` as it leaves: the
    parent removes it in `close()`, which a parent killed with SIGKILL never reaches. Until it
    exits, the worker holds the directory's lock through the descriptor it inherited, so no other
    runner takes the directory for a dead one meanwhile (`_buffer_directory`).
    """
    withhold_all_but((arena, requests))
    _drop_inherited_signal_handlers()
    # Ctrl-C reaches the whole process group; the parent decides what happens, then closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for other in inherited:
        other.close()
    worker = os.getpid()
    received = 0
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            _remove_if_orphaned(directory)
            return
        if message == STOP:
            return
        received += 1
        try:
            envelope, replies_released = pickle.loads(message)
            if replies_released:
                arena.give_back(replies_released)
            value = fn(decode(envelope, requests))
            _end_a_child_of_fn(worker, None)
            ok, answer = True, encode(value, directory, threshold, arena)
        except BaseException as exc:  # KeyboardInterrupt or SystemExit from fn too: the caller's to handle
            _end_a_child_of_fn(worker, exc)
            ok, answer = False, Envelope(_pickled_error(exc, stage), None, ())
        requests_released = requests.released() if requests is not None else ()
        try:
            send_reply(conn.fileno(), pickle.dumps((ok, answer, requests_released, received), protocol=5))
        except OSError:  # the parent is gone
            _remove_if_orphaned(directory)
            return


def _end_a_child_of_fn(worker: int, exc: BaseException | None) -> None:
    """End this process if it is not the worker (pid `worker`) but a child the stage function
    forked that returned from it, or raised `exc`, instead of exiting (`os.fork()` without
    `os._exit`).

    Such a child carried on in its copy of this loop: it sent its copy's result on the worker's
    pipe, where the parent took it for the worker's answer to its item (or to the next one), read
    items meant for the worker, and at the pipe's end removed the runner's buffer directory, its
    parent being another than the runner's. It ends here as Python ends a process (0 for a
    return, a SystemExit's code, else 1 with the traceback on stderr), its output flushed, through
    `os._exit` as multiprocessing ends its children: the trainer's exit handlers, which the worker
    copied, are not its own."""
    if os.getpid() == worker:
        return
    if exc is None or (isinstance(exc, SystemExit) and exc.code is None):
        code = 0
    elif isinstance(exc, SystemExit) and isinstance(exc.code, int):
        code = exc.code
    else:
        traceback.print_exception(exc)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(code)


def _remove_if_orphaned(directory: str) -> None:
    """Remove the runner's buffer directory once the parent has died.

    A closed pipe alone does not prove it: the parent also closes the pipe of a worker it has just
    forked if starting it fails, and goes on using the directory. Only a dead parent's children are
    handed to another process. Every worker of the runner removes it as it leaves; each does so
    after its last write into it, so the last to leave finds every file its siblings wrote (the
    parent's files in transit included), and a sibling still writing when it is gone fails that
    write and leaves too."""
    parent = multiprocessing.parent_process().pid
    deadline = time.monotonic() + _ORPHANING_WAIT_S
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    shutil.rmtree(directory, ignore_errors=True)


def _drop_inherited_signal_handlers() -> None:
    """Give every signal the parent handled in Python its default action back.

    A worker is forked from the trainer and inherits its Python handlers: a preemption handler
    for SIGTERM (save a checkpoint, then exit) ran in the worker on its forked copy of the
    trainer's state, a SystemExit it raised reached the trainer as a stage's failure, and the
    worker outlived the SIGTERM that `close()` ends busy workers with. Signals meant for the
    trainer now act on a worker as on any process that handles none: SIGTERM ends it (the parent
    re-runs its items on a replacement while it is open)."""
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)


def _pickled_error(exc: BaseException, stage: str) -> bytes:
    """The exception, pickled, with the worker's traceback attached as a note.

    One that takes no note (its `__notes__` is not a list) goes without it: the TypeError, raised
    inside the worker's error handling, killed the worker, so the stage's own error was re-run as
    a crash.

    An exception that does not survive a pickle round trip (unpicklable attributes, a constructor
    that pickle cannot call again) is replaced by a RuntimeError carrying its type, message and
    traceback, so the parent always learns what went wrong. The round trip catches BaseException:
    an exception whose `__reduce__` (or constructor, called again by `loads`) raises
    KeyboardInterrupt or SystemExit escaped it, killed the worker, and its item was re-run as a
    crash. Nothing else can raise those here: the worker ignores SIGINT (see `serve`).
    """
    text = "".join(traceback.format_exception(exc))
    # traceback's own line for it, which survives an exception whose str() raises
    summary = "".join(traceback.format_exception_only(exc)).strip()
    try:
        exc.add_note(f"raised in stage {stage!r}, worker process {os.getpid()}:\n{text.rstrip()}")
    except Exception:  # noqa: BLE001 - `__notes__` not a list: the error itself matters more than the note
        pass
    try:
        stream = pickle.dumps(_Noted(exc), protocol=5)
        pickle.loads(stream)
    except BaseException:  # noqa: BLE001 - raised by the exception's own pickling, not by a signal
        stream = pickle.dumps(
            RuntimeError(
                f"stage {stage!r} raised {summary} "
                f"(the exception itself could not be pickled); worker traceback:\n{text}"
            ),
            protocol=5,
        )
    return stream


class _Noted:
    """Pickles an exception together with its notes.

    An exception whose `__reduce__` returns only its constructor's arguments (Zephon's named
    errors do, to keep their fields) would arrive without `__notes__`, and so without the worker's
    traceback."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self):
        return _with_notes, (self.exc, getattr(self.exc, "__notes__", None))


def _with_notes(exc: BaseException, notes: list[str] | None) -> BaseException:
    if getattr(exc, "__notes__", None) != notes:
        exc.__notes__ = notes
    return exc
