"""ProcessRunner specifics: shared-memory transport, fault handling, and a close() that leaks nothing.

Everything here uses real forked processes, real signals and the real /dev/shm directory."""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from runners import InlineRunner, ProcessRunner, WorkerCrashedError, _buffer_directory, process
from runners._frames import send_reply
from runners._transport import Envelope
from tests.reliability.harness import fill_the_shm_directory
from tests.unit.worker_replies import framed, half_of_a_reply, worker_pipe
from zephon._errors import BadRecordError, ConfigurationError, ZephonError
from zephon.io import ShardUnavailableError
from zephon._runner import Stage

MIB = 1 << 20


def _run_script(script: str, *args: str, timeout: int, **popen: Any) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter that imports this checkout (its exit is what is tested)."""
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
        env=_THIS_CHECKOUT, **popen,
    )


_THIS_CHECKOUT = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def mapping_of(array: np.ndarray) -> tuple[str, str | None]:
    """(permissions, file) of the mapping holding the array's data, per /proc/self/maps.

    Independent of how the runner maps memory: a buffer file's view shows the (deleted) file; a
    private copy shows the heap or a private anonymous mapping (no file)."""
    address = array.__array_interface__["data"][0]
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= address < high:
            return fields[1], fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    raise AssertionError("address not mapped")


def mapped_file(array: np.ndarray) -> str | None:
    return mapping_of(array)[1]


def backed_by_shm_file(array: np.ndarray) -> bool:
    """True when the array is a view of a buffer file that the receiver has already unlinked."""
    path = mapped_file(array)
    return path is not None and "/zephon-" in path and path.endswith("(deleted)")


def in_arena(array: np.ndarray) -> bool:
    """True when the array is a view of anonymous shared memory (a worker's reply arena, or the
    request arena): the kernel shows such a mapping as shared ('s') and backed by a deleted /dev/zero."""
    permissions, path = mapping_of(array)
    return permissions.endswith("s") and path == "/dev/zero (deleted)"


def in_shared_memory(array: np.ndarray) -> bool:
    return backed_by_shm_file(array) or in_arena(array)


def child_pids() -> set[int]:
    """Every process whose parent is this one, zombies included: a leak check independent of
    multiprocessing's own bookkeeping."""
    me, children = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                children.add(int(entry))
    return children


# A polling helper's budget by default: a hang guard, far beyond what any awaited step takes on a
# loaded machine (a worker noticing its parent died, cleaning up and exiting), since a budget
# that ran out failed a correct runner; the helpers return as soon as the condition holds.
POLL_GUARD_S = 60.0


def wait_for_text(path: Path, timeout: float = POLL_GUARD_S) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and (text := path.read_text()):
            return text
        time.sleep(0.01)
    raise AssertionError(f"{path} never appeared")


def stall_first_attempt(marker: Path, x: int) -> None:
    """On the first attempt at item 3 only: write this worker's pid to `marker` and hang."""
    if x != 3:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(60)


def cube(x: int) -> np.ndarray:
    return np.arange(x, x + 100_000, dtype=np.int64) ** 3


def test_large_arrays_cross_in_shared_memory_and_never_through_the_pipe():
    items = [np.full(MIB, i, dtype=np.float64) for i in range(4)]  # 8 MiB each

    def double(x: np.ndarray) -> tuple[bool, np.ndarray]:
        return in_arena(x), x * 2

    with ProcessRunner() as runner:
        runner.start([Stage("double", double, 2)])
        results = [runner.submit(0, item).result(10) for item in items]
        stats = runner.stats()
    for i, (input_was_shared, doubled) in enumerate(results):
        assert input_was_shared
        assert in_arena(doubled) and not doubled.flags.owndata
        np.testing.assert_array_equal(doubled, items[i] * 2)
    assert stats.items_sent == len(items)
    assert stats.shm_bytes == 2 * sum(item.nbytes for item in items)
    assert stats.pipe_bytes < 2048 * len(items)  # metadata only: 64 MiB of arrays moved elsewhere


def test_small_arrays_stay_in_the_pickle_stream():
    with ProcessRunner() as runner:
        runner.start([Stage("negate", lambda x: -x)])
        result = runner.submit(0, np.arange(100)).result(10)
        assert runner.stats().shm_bytes == 0
    assert not in_shared_memory(result)
    np.testing.assert_array_equal(result, -np.arange(100))


def test_arrays_of_every_plain_kind_come_back_equal_with_their_dtype_and_writability():
    """One-dimensional numeric arrays take a shorter pickling path; everything else NumPy's own.
    Both directions, small (in the stream) and large (shared memory), must give the same arrays."""
    read_only = np.arange(10, dtype=np.int16)
    read_only.flags.writeable = False
    sent = [
        np.array([True, False, True]),
        np.arange(7, dtype=">i4"),  # big-endian stays big-endian
        np.arange(5, dtype=np.uint64) * 3,
        np.linspace(0, 1, 9, dtype=np.float32),
        np.array([1 + 2j, 3 - 4j]),
        np.zeros(0, dtype=np.int32),
        read_only,
        np.arange(20, dtype=np.int64)[::2],  # not contiguous
        np.arange(12, dtype=np.int32).reshape(3, 4),  # two dimensions
        np.array(["a", "bc"]),  # not a number
        np.array([np.datetime64("2026-11-30")] * 2),  # exports no buffer
        np.arange(MIB, dtype=np.int32),  # 4 MiB: through shared memory both ways
    ]
    with ProcessRunner() as runner:
        runner.start([Stage("echo", lambda arrays: (arrays, [a.flags.writeable for a in arrays]))])
        received, writable_in_worker = runner.submit(0, sent).result(10)
    for original, echoed, worker_writable in zip(sent, received, writable_in_worker, strict=True):
        assert echoed.dtype == original.dtype and echoed.shape == original.shape
        np.testing.assert_array_equal(echoed, original)
        assert worker_writable == original.flags.writeable
        assert echoed.flags.writeable == original.flags.writeable
    assert in_arena(received[-1])


def test_buffer_files_are_unlinked_on_receipt_and_results_stay_writable():
    with ProcessRunner() as runner:
        runner.start([Stage("ones", lambda n: np.ones(n, dtype=np.uint8), 2)])
        results = [runner.submit(0, 4 * MIB).result(10) for _ in range(3)]
        assert os.listdir(runner.shm_directory) == [_buffer_directory.LOCK]
    results[0][:] = 7  # the worker does not reuse the block until this array is let go
    assert results[0].sum() == 7 * 4 * MIB and results[1].sum() == 4 * MIB


def test_received_arrays_hold_no_file_descriptor_and_buffer_files_unmap_when_released():
    with ProcessRunner(reply_arena_bytes=0) as runner:
        runner.start([Stage("ones", lambda n: np.ones(n, dtype=np.uint8))])
        runner.submit(0, MIB).result(10)  # warm-up: lazily opened descriptors are not leaks
        fds_before = len(os.listdir("/proc/self/fd"))
        held = [runner.submit(0, MIB).result(10) for _ in range(50)]
        assert len(os.listdir("/proc/self/fd")) == fds_before  # a shuffle buffer may hold thousands
        path = mapped_file(held[0])
        assert backed_by_shm_file(held[0])
        del held
        # Free-threaded CPython frees an object made on another thread when that thread next runs
        # (biased reference counting): wake the reader thread with one more item.
        runner.submit(0, 1).result(10)
        assert path not in Path("/proc/self/maps").read_text()


_READ_AT_EXIT = """
import atexit, sys, numpy as np
from runners import ProcessRunner
from zephon._runner import Stage
held = {}
atexit.register(lambda: print(int(held["ones"].sum())))  # registered first, so it runs last
with ProcessRunner(reply_arena_bytes=0, shm_root=sys.argv[1]) as runner:
    runner.start([Stage("ones", lambda n: np.ones(n, dtype=np.int64))])
    held["ones"] = runner.submit(0, 1 << 20).result(10)
"""


def test_a_received_array_stays_readable_at_interpreter_exit(tmp_path):
    """The unmapping of a buffer file (before 3.13, a `weakref.finalize`) also ran at interpreter
    exit while the array was still alive: an exit hook or a daemon thread that read a batch then
    crashed the process with SIGSEGV."""
    done = _run_script(_READ_AT_EXIT, str(tmp_path), timeout=60)
    assert (done.returncode, done.stdout.split()) == (0, [str(1 << 20)]), done.stderr


def test_the_stage_function_is_inherited_not_pickled():
    lock = threading.Lock()  # unpicklable, captured by the closure

    def guarded(x: int) -> int:
        with lock:
            return x + 1

    with ProcessRunner() as runner:
        runner.start([Stage("guarded", guarded)])
        assert runner.submit(0, 1).result(10) == 2


def test_an_unpicklable_exception_arrives_as_runtime_error_with_the_original_traceback():
    def fail(x: int) -> None:
        class LocalError(Exception):
            pass

        raise LocalError(f"local trouble with {x}")

    with ProcessRunner() as runner:
        runner.start([Stage("fail", fail)])
        error = runner.submit(0, 5).exception(10)
    assert isinstance(error, RuntimeError)
    assert "local trouble with 5" in str(error) and "Traceback" in str(error) and "'fail'" in str(error)


def test_an_unpicklable_exception_whose_str_fails_still_arrives_named_instead_of_killing_the_worker():
    def fail(x: int) -> None:
        class Opaque(Exception):
            def __str__(self) -> str:
                raise ValueError("no text")

        raise Opaque(x)

    with ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("fail", fail)])
        error = runner.submit(0, 5).exception(10)
    assert isinstance(error, RuntimeError), error
    assert "Opaque" in str(error) and "Traceback" in str(error) and "'fail'" in str(error)


def test_a_picklable_exception_keeps_its_type_and_gains_the_worker_traceback_as_a_note():
    def fail(x: int) -> None:
        raise KeyError(x)

    with ProcessRunner() as runner:
        runner.start([Stage("lookup", fail)])
        error = runner.submit(0, 5).exception(10)
    assert type(error) is KeyError and error.args == (5,)
    assert any("Traceback" in note and "'lookup'" in note for note in error.__notes__)


class NotesNotAList(Exception):
    """An exception whose `__notes__` someone set to a tuple: `add_note` refuses it."""


def test_an_exception_that_takes_no_note_arrives_as_itself_instead_of_killing_the_worker():
    """Adding the traceback note raised TypeError inside the worker's error handling, so the worker
    died: the stage's own error was counted as a crash, re-run `1 + max_retries` times, and reached
    the caller as WorkerCrashedError."""

    def fail(x: int) -> None:
        error = NotesNotAList(f"trouble with {x}")
        error.__notes__ = ("a note kept in a tuple",)
        raise error

    with ProcessRunner(max_retries=1) as runner:
        runner.start([Stage("fail", fail)])
        pids = runner.worker_pids()
        error = runner.submit(0, 5).exception(10)
        assert runner.worker_pids() == pids and runner.stats().retries == 0
    assert type(error) is NotesNotAList and error.args == ("trouble with 5",)
    assert error.__notes__ == ("a note kept in a tuple",)


class ReducesToExit(Exception):
    """Pickling it raises SystemExit (a `__reduce__` that calls sys.exit, or a library's guard)."""

    def __reduce__(self):
        raise SystemExit(3)


class ReducesToInterrupt(Exception):
    def __reduce__(self):
        raise KeyboardInterrupt


class RebuildsToExit(Exception):
    """Pickles, but unpickling it calls sys.exit."""

    def __reduce__(self):
        return sys.exit, (3,)


@pytest.mark.parametrize("error_type", [ReducesToExit, ReducesToInterrupt, RebuildsToExit])
def test_an_exception_whose_pickling_raises_exit_or_interrupt_arrives_named_instead_of_killing_the_worker(error_type):
    """The pickle round trip caught only Exception: SystemExit or KeyboardInterrupt from an
    exception's `__reduce__` killed the worker inside its error handling, so the stage's own error
    was re-run `1 + max_retries` times and reached the caller as WorkerCrashedError."""

    def fail(x: int) -> None:
        raise error_type(f"trouble with {x}")

    with ProcessRunner(max_retries=1) as runner:
        runner.start([Stage("fail", fail)])
        pids = runner.worker_pids()
        error = runner.submit(0, 5).exception(10)
        assert runner.worker_pids() == pids and runner.stats().retries == 0
    assert isinstance(error, RuntimeError), error
    assert error_type.__name__ in str(error) and "trouble with 5" in str(error) and "'fail'" in str(error)


def test_an_error_that_pickles_its_own_fields_keeps_them_and_still_gains_the_worker_traceback():
    """Zephon's named errors pickle only their fields (`__reduce__`); the note must cross too."""

    def fail(x: int) -> None:
        if x == 0:
            raise ShardUnavailableError("mem://shard-7", 3, "gone")
        error = BadRecordError(("d", "shard-7", x), "too_long", "field 'text'")
        error.add_note("a note of the stage's own")
        raise error

    with ProcessRunner() as runner:
        runner.start([Stage("read", fail)])
        shard, record = (runner.submit(0, x).exception(10) for x in (0, 5))
    assert type(shard) is ShardUnavailableError and (shard.url, shard.attempts) == ("mem://shard-7", 3)
    assert type(record) is BadRecordError and record.address == ("d", "shard-7", 5)
    assert record.__notes__[0] == "a note of the stage's own"
    for error in (shard, record):
        assert any("Traceback" in note and "'read'" in note for note in error.__notes__)


def test_unpicklable_items_and_results_fail_their_future_not_the_runner():
    with ProcessRunner() as runner:
        runner.start([Stage("identity", lambda x: x), Stage("make_lambda", lambda x: lambda: x)])
        assert runner.submit(0, lambda: 1).exception(10) is not None
        assert "pickle" in str(runner.submit(1, 1).exception(10)).lower()
        assert runner.submit(0, 3).result(10) == 3


def test_a_sigkilled_worker_is_replaced_and_its_item_rerun_with_the_same_result(tmp_path, recwarn):
    marker = tmp_path / "pid"

    def stage(x: int) -> np.ndarray:
        stall_first_attempt(marker, x)
        return cube(x)

    with ProcessRunner() as runner:
        runner.start([Stage("cube", stage, 2)])
        futures = [runner.submit(0, x) for x in range(8)]
        victim = int(wait_for_text(marker))
        os.kill(victim, signal.SIGKILL)
        results = [future.result(10) for future in futures]
        stats = runner.stats()
        assert victim not in runner.worker_pids() and len(runner.worker_pids()) == 2
    for x, result in enumerate(results):
        np.testing.assert_array_equal(result, cube(x))
    assert (stats.retries, stats.workers_replaced) == (1, 1)
    # The replacement was forked by the reader thread; CPython >= 3.12 warns about that unless silenced.
    assert not [w for w in recwarn if "fork" in str(w.message)]


def test_a_worker_over_the_task_timeout_is_killed_and_its_item_rerun(tmp_path):
    marker = tmp_path / "pid"

    def stage(x: int) -> np.ndarray:
        stall_first_attempt(marker, x)
        return cube(x)

    with ProcessRunner(task_timeout_s=0.5) as runner:
        runner.start([Stage("cube", stage, 2)])
        results = [runner.submit(0, x).result(60) for x in range(6)]  # the stall is 60 s: only a kill meets these
        stats = runner.stats()
        assert int(marker.read_text()) not in runner.worker_pids()
    # One kill and one re-run for the stall; a loaded machine that holds up any other item past
    # 0.5 s has it killed and re-run too, as it should: each kill re-runs the one item it cut off.
    assert stats.retries == stats.workers_replaced >= 1
    for x, result in enumerate(results):
        np.testing.assert_array_equal(result, cube(x))


def test_an_item_that_always_kills_its_worker_fails_after_max_retries(tmp_path):
    attempts = tmp_path / "attempts"

    def crash_on_seven(x: int) -> int:
        if x == 7:
            with open(attempts, "a") as log:
                log.write("attempt\n")
            os._exit(3)
        return x

    with ProcessRunner(max_retries=2) as runner:
        runner.start([Stage("fragile", crash_on_seven, 2)])
        error = runner.submit(0, 7).exception(10)
        assert runner.submit(0, 8).result(10) == 8  # the stage still works
    assert isinstance(error, WorkerCrashedError) and isinstance(error, ZephonError)
    assert error.stage == "fragile" and error.attempts == 3
    assert "'fragile'" in str(error) and "exited with code 3" in str(error)
    assert attempts.read_text().count("attempt") == 3


def _fork_a_sleeping_child_then_exit(pid_file: Path, x: int) -> int:
    """A stage function that forks a helper (a library's daemon, a subprocess) which inherits every
    descriptor of the worker, its pipe and its multiprocessing sentinel included, and outlives it;
    then the worker dies."""
    helper = os.fork()
    if helper == 0:
        time.sleep(3600)
        os._exit(0)
    pid_file.write_text(str(helper))
    os._exit(3)


def test_a_worker_that_dies_leaving_a_forked_child_holding_its_pipes_is_seen_dead_at_once(tmp_path):
    """The parent watched a worker through its sentinel and its pipe, both held open by a child the
    stage function forked: the worker's death went unseen until `task_timeout_s`, for ever without
    one, and its item waited all that time. It is watched through a pidfd, which says when that
    very process exits, whatever its children hold."""
    pid_file = tmp_path / "helper"
    try:
        with ProcessRunner(task_timeout_s=600, max_retries=0) as runner:
            runner.start([Stage("forking", functools.partial(_fork_a_sleeping_child_then_exit, pid_file))])
            error = runner.submit(0, 1).exception(60)
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert isinstance(error, WorkerCrashedError) and "exited with code 3" in str(error), error


def _die_partway_through_a_reply_leaving_a_forked_child(helper_pid: Path, half: bytes, go: Path, x: int) -> int:
    """A stage function that, on item -1, forks a helper which inherits the worker's pipe and
    outlives it (a subprocess started without closing descriptors), writes `half` of a reply to
    the pipe, and dies once `go` exists (the OOM killer, a crash in a C extension). Other items
    come back as they are."""
    if x != -1:
        return x
    helper = os.fork()
    if helper == 0:
        time.sleep(600)
        os._exit(0)
    conn = worker_pipe()
    os.write(conn.fileno(), half)
    helper_pid.write_text(str(helper))
    while not go.exists():
        time.sleep(0.01)
    os._exit(3)


@contextmanager
def _a_worker_dying_partway_through_a_reply(tmp_path: Path, half: bytes):
    """The stage function `_die_partway_through_a_reply_leaving_a_forked_child` (as `.stage`), with
    `.forked()` to wait until its worker has forked the helper and written `half`, and `.die()` to
    let the worker die; the helper, which would outlive the test, is killed on the way out."""
    helper_pid, go = tmp_path / "helper", tmp_path / "go"
    dying = SimpleNamespace(
        stage=functools.partial(_die_partway_through_a_reply_leaving_a_forked_child, helper_pid, half, go),
        forked=lambda: wait_for_text(helper_pid),
        die=go.touch,
    )
    try:
        yield dying
    finally:
        if helper_pid.exists():
            os.kill(int(helper_pid.read_text()), signal.SIGKILL)


def test_a_worker_dying_partway_through_a_reply_while_its_forked_child_holds_the_pipe_holds_up_no_other_reply(
    tmp_path,
):
    """The reader read a reply with a blocking `recv_bytes`, which returns only once the whole
    message has come: half a reply left it waiting for the rest, every other worker's replies
    unread; and when the worker died there, the child it had forked still held the pipe, so no end
    of file ever came: the reader, `task_timeout_s` and every item waited for ever. The reader now
    keeps half a reply until the rest comes, reads the others meanwhile, and retires a worker
    that died with half a reply sent, naming what came of it."""
    with _a_worker_dying_partway_through_a_reply(tmp_path, half_of_a_reply()) as dying:
        with ProcessRunner(max_retries=0) as runner:
            runner.start([Stage("forking", dying.stage, 2)])
            cut_short = runner.submit(0, -1)
            dying.forked()
            assert [runner.submit(0, x).result(60) for x in range(4)] == list(range(4))
            dying.die()
            error = cut_short.exception(60)
            assert [runner.submit(0, x).result(60) for x in range(4)] == list(range(4))
    assert isinstance(error, WorkerCrashedError), error
    assert re.search(r"exited with code 3 while sending a reply, \d+ of 8192 bytes received", str(error)), error


def _write_then_exit(written: bytes, x: int) -> int:
    """A stage function that, on item -1, writes `written` to the worker's reply pipe and exits
    with code 3 (the OOM killer partway through a reply, or bytes a stage function wrote there, a
    length a reply can have among them); other items come back as they are."""
    if x == -1:
        os.write(worker_pipe().fileno(), written)
        os._exit(3)
    return x


@pytest.mark.parametrize(
    ("written", "came"),
    [
        (framed(bytes(8192))[:4100], "4092 of 8192 bytes received"),
        (framed(bytes(8192))[:8], "0 of 8192 bytes received"),
        ((1 << 20).to_bytes(8, "big") + b"abc", "3 of 1048576 bytes received"),
        (b"\0\0\0", "3 of its 8-byte length received"),
    ],
    ids=["part of a reply", "its length alone", "a length a reply can have, then text", "part of a length"],
)
def test_a_worker_that_exits_with_a_reply_unfinished_is_retired_at_once_without_task_timeout_s(written, came):
    """Part of a reply, or a length a reply can have with less after it, is waited for only while
    its worker lives: once it has exited and its pipe holds nothing more, the rest can never come.
    Without `task_timeout_s`, a wait for it would last for ever; the worker is retired at once,
    its item failed (no retries here) with a cause naming what came, and its replacement serves
    the stage."""
    with ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("cut", functools.partial(_write_then_exit, written), 1)])
        error = runner.submit(0, -1).exception(30)
        assert [runner.submit(0, x).result(60) for x in range(3)] == list(range(3))
    assert isinstance(error, WorkerCrashedError), error
    assert f"exited with code 3 while sending a reply, {came}" in str(error), error


@pytest.mark.parametrize("sent_by", ["the caller", "the reader"])
@pytest.mark.parametrize("written", ["half a reply", "nothing"])
def test_a_worker_watched_by_its_sentinel_alone_dying_while_its_forked_child_holds_it_is_seen_dead(
    written, sent_by, tmp_path, monkeypatch
):
    """Where the system offers no pidfd (a kernel before 5.3, a seccomp profile refusing
    pidfd_open), a worker is watched through its sentinel, which a child its stage function forked
    holds open, with the worker's pipe: a worker that died there, with half a reply written or
    none, was never seen dead, and its item waited until `task_timeout_s` (for ever without one).
    The reader asks waitpid whether such a worker has exited while it holds items, and retires it
    as any worker that exits, naming what came of its reply, whichever thread sent it the item
    (the reader sends those its done-callbacks submit)."""
    monkeypatch.setattr(os, "pidfd_open", _no_pidfd)
    half = half_of_a_reply() if written == "half a reply" else b""
    with _a_worker_dying_partway_through_a_reply(tmp_path, half) as dying:
        with ProcessRunner(max_retries=0) as runner:
            runner.start([Stage("forking", dying.stage, 1)])
            cut_short = runner.submit(0, -1) if sent_by == "the caller" else _submit_from_a_done_callback(runner, -1)
            dying.forked()
            dying.die()
            error = cut_short.exception(20)
            assert [runner.submit(0, x).result(60) for x in range(3)] == list(range(3))
    assert isinstance(error, WorkerCrashedError) and "exited with code 3" in str(error), error
    assert ("while sending a reply, 4092 of 8192 bytes received" in str(error)) == bool(half), error


def _submit_from_a_done_callback(runner: ProcessRunner, item: int) -> Any:
    """Submit `item` from a done-callback of a first item, that is from the reader thread, to a
    worker idle by then; the future of `item`."""
    submitted: list[Any] = []
    runner.submit(0, 0).add_done_callback(lambda _: submitted.append(runner.submit(0, item)))
    wait_until(lambda: bool(submitted))
    return submitted[0]


@pytest.mark.parametrize("task_timeout_s", [None, 600])
def test_the_reader_never_wakes_itself_for_an_item_it_sends_to_an_idle_worker(task_timeout_s, monkeypatch):
    """A worker that becomes busy must be polled (no pidfd) or have its deadline watched
    (`task_timeout_s`) from then on, and the reader, waiting without either, is woken for it. The
    reader woke itself too, for the items its own dispatch sent (replies freeing a worker, items
    submitted from done-callbacks): a write and one more turn of its loop for nothing, as it looks
    again before it next waits; with one worker and items pipelined, almost one per two items.
    A wake-up from another thread is still sent, and the item sent from the reader still has its
    worker's exit polled (below)."""
    monkeypatch.setattr(os, "pidfd_open", _no_pidfd)
    woken_by_the_reader = []
    wake = ProcessRunner._wake

    def counted_wake(self: ProcessRunner) -> None:
        if threading.current_thread() is self._reader:
            woken_by_the_reader.append(1)
        wake(self)

    monkeypatch.setattr(ProcessRunner, "_wake", counted_wake)
    with ProcessRunner(task_timeout_s=task_timeout_s) as runner:
        runner.start([Stage("echo", lambda x: x, 1)])
        assert [_submit_from_a_done_callback(runner, x).result(60) for x in range(1, 11)] == list(range(1, 11))
    assert woken_by_the_reader == []


def _unread_bytes(fd: int) -> int:
    """What the process at the other end of a pipe has not read yet of what was written to it."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, bytes(4)))[0]


def _die_mid_reply_leaving_a_child_writing_on(pids: Path, hold: Path, go: Path, x: int) -> int:
    """A stage function that, on item -1, forks a child holding the worker's pipe and, once `go`
    exists, writes 128 KiB of a 1 MiB reply answering 99 (in pieces of 4 KiB), writes
    "<worker pid> <child pid> <bytes written>" to `pids`, and exits with code 3. The child, once
    the worker has exited and the parent has begun reading what it left, writes the rest of that
    reply and then replies of its own answering 98 (a process the worker forked, writing to a
    descriptor it inherited), then sleeps. On item 0, it waits for `hold`; other items come back
    as they are."""
    if x == 0:
        wait_for_text(hold)
    if x != -1:
        return x
    fd, worker = worker_pipe().fileno(), os.getpid()
    answer = pickle.dumps((True, Envelope(pickle.dumps(99), None, ()), ()), protocol=5)
    whole = framed(answer.ljust(1 << 20, b"\0"))  # pickle reads no further than its own end
    sent = 128 * 1024
    helper = os.fork()
    if helper == 0:
        while os.getppid() == worker:
            time.sleep(0.001)
        rest = whole[sent:]
        stray = framed(pickle.dumps((True, Envelope(pickle.dumps(98), None, ()), ()), protocol=5))
        left, deadline = _unread_bytes(fd), time.monotonic() + 60
        while _unread_bytes(fd) >= left and time.monotonic() < deadline:
            pass  # until the parent reads
        with suppress(OSError):  # the parent closed its end
            os.write(fd, rest)
            for _ in range(4096):
                os.write(fd, stray)
        time.sleep(600)
        os._exit(0)
    (pids.parent / "helper").write_text(str(helper))
    wait_for_text(go)
    for start in range(0, sent, 4096):
        os.write(fd, whole[start : start + 4096])
    pids.write_text(f"{worker} {helper} {sent}")
    os._exit(3)


def test_a_worker_that_dies_mid_reply_is_retired_by_its_exit_whatever_a_child_holding_its_pipe_writes_after(
    tmp_path,
):
    """Once a worker's exit was seen, the reader read its pipe for as long as it held anything: what
    a child the worker forked, still holding the pipe, wrote on was read as the worker's whenever
    it came before the pipe ran dry (here it would finish the worker's reply, answering its item
    with 99, and add replies of its own: a race the child lost on this machine), and a child
    keeping the pipe from running dry held the reader there. The exit retires the worker: the
    reader takes only what the pipe held when it saw the exit, hands on the whole replies in it,
    names what came of one cut short, closes the pipe, and reads nothing more from it."""
    pids, hold, go = tmp_path / "pids", tmp_path / "hold", tmp_path / "go"
    stage = functools.partial(_die_mid_reply_leaving_a_child_writing_on, pids, hold, go)
    reader_held, release = threading.Event(), threading.Event()

    def hold_the_reader(_):  # so that the worker's bytes wait in its pipe when it exits
        reader_held.set()
        release.wait(60)

    try:
        with ProcessRunner(task_timeout_s=20, max_retries=0) as runner:
            runner.start([Stage("forking", stage, 2)])
            cut_short, holding = runner.submit(0, -1), runner.submit(0, 0)
            holding.add_done_callback(hold_the_reader)
            hold.write_text("hold")
            assert reader_held.wait(60)
            go.write_text("go")
            worker, _, sent = map(int, wait_for_text(pids).split())
            wait_until(lambda: has_exited(worker))
            release.set()
            error = cut_short.exception(60)
            assert [runner.submit(0, x).result(60) for x in range(1, 5)] == list(range(1, 5))
    finally:
        release.set()
        if (helper := tmp_path / "helper").exists():
            os.kill(int(helper.read_text()), signal.SIGKILL)
    assert isinstance(error, WorkerCrashedError), error
    assert f"exited with code 3 while sending a reply, {sent - 8} of {1 << 20} bytes received" in str(error), error


def _answer_then_die_on_minus_one(x: int) -> bytes:
    """A stage function that exits with code 3 on item -1 and answers any other with x bytes
    (pickled in the reply itself: more than one read of the pipe takes)."""
    if x == -1:
        os._exit(3)
    return bytes(x)


def test_the_whole_replies_a_worker_wrote_before_it_died_answer_their_items_though_none_was_read_before_its_exit():
    """The reader, held up elsewhere (here by a done-callback), had read none of a worker's
    replies when the worker died: its exit retires it after what its pipe held then, and the
    reply it wrote before dying answers its item; only the item it died on fails."""
    reader_held, release = threading.Event(), threading.Event()

    def hold_the_reader(_):
        reader_held.set()
        release.wait(60)

    try:
        with ProcessRunner(task_timeout_s=30, max_retries=0) as runner:
            runner.start([Stage("holder", lambda x: x, 1), Stage("dying", _answer_then_die_on_minus_one, 1)])
            [_, dying] = runner.worker_pids()
            runner.submit(0, 0).add_done_callback(hold_the_reader)
            assert reader_held.wait(60)
            answered, died_on = runner.submit(1, 100_000), runner.submit(1, -1)
            wait_until(lambda: has_exited(dying))
            release.set()
            assert answered.result(60) == bytes(100_000)
            error = died_on.exception(60)
            assert runner.submit(1, 3).result(60) == bytes(3)
    finally:
        release.set()
    assert isinstance(error, WorkerCrashedError), error
    assert f"(pid {dying}) exited with code 3" in str(error) and "while sending" not in str(error), error


def _a_forked_child_answers_after_the_worker(go: Path, x: int) -> int:
    """A stage function that, on item -1, forks a child which, once `go` exists, writes a reply of
    its own to the worker's pipe, which it holds, after the worker has answered. Items come back
    as they are."""
    if x == -1 and os.fork() == 0:
        conn = worker_pipe()
        while not go.exists():
            time.sleep(0.01)
        send_reply(conn.fileno(), pickle.dumps((True, Envelope(pickle.dumps(99), None, ()), ()), protocol=5))
        os._exit(0)
    return x


def test_a_worker_whose_pipe_brings_a_reply_to_no_item_is_replaced_and_the_runner_runs_on(tmp_path, caplog):
    """A reply beyond the items a worker holds was paired with none: `popleft` on its empty task
    queue raised in the reader thread, which failed every item of every stage with
    RunnerFailedError and served none again. The worker, whose pipe can no longer be trusted, is
    killed and replaced instead, with a warning naming it."""
    go = tmp_path / "go"
    stage = functools.partial(_a_forked_child_answers_after_the_worker, go)
    with ProcessRunner() as runner:
        runner.start([Stage("forking", stage, 1)])
        [worker] = runner._workers
        pid = worker.process.pid
        assert runner.submit(0, -1).result(60) == -1
        with caplog.at_level(logging.WARNING, logger="runners.process"):
            go.touch()
            deadline = time.monotonic() + 60
            while runner._workers == [worker] and runner._failure is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [runner.submit(0, x).result(60) for x in range(4)] == list(range(4))
            assert runner.stats().workers_replaced == 1
    assert f"worker (pid {pid}) sent a reply to no item it holds" in caplog.text, caplog.text


def _a_forked_child_answers_before_the_worker(forked: Path, go: Path, x: int) -> int:
    """A stage function that, on the first attempt at item -1, forks a child which writes a reply
    answering 99 to the worker's pipe at once, while the worker waits for `go` before returning
    the item. Items come back as they are."""
    if x == -1 and not forked.exists():
        forked.write_text("forked")
        if os.fork() == 0:
            answer = pickle.dumps((True, Envelope(pickle.dumps(99), None, ()), ()), protocol=5)
            send_reply(worker_pipe().fileno(), answer)
            os._exit(0)
        wait_for_text(go)
    return x


def test_a_reply_the_worker_did_not_write_is_never_taken_for_its_answer(tmp_path, caplog):
    """A reply a process the stage function forked wrote to the worker's pipe while the worker ran
    an item answered that item (here with 99), and the worker's own reply then answered none. A
    worker numbers its replies by the items it has received, and one that is not the answer its
    item is due is not taken for it: the worker is killed and replaced, with a warning naming it,
    and its item re-run. One death, one warning: the fault was logged where the reader found it
    and again, in the same words, as its item was re-run."""
    forked, go = tmp_path / "forked", tmp_path / "go"
    stage = functools.partial(_a_forked_child_answers_before_the_worker, forked, go)
    with caplog.at_level(logging.WARNING, logger="runners.process"), ProcessRunner(task_timeout_s=30) as runner:
        runner.start([Stage("forking", stage, 1)])
        [worker] = runner._workers
        pid = worker.process.pid
        answer = runner.submit(0, -1)
        wait_until(lambda: answer.done() or runner.stats().workers_replaced)
        go.write_text("go")
        assert answer.result(60) == -1
        assert [runner.submit(0, x).result(60) for x in range(4)] == list(range(4))
        assert runner.stats().workers_replaced == 1
    told = [record.getMessage() for record in caplog.records if f"(pid {pid})" in record.getMessage()]
    assert len(told) == 1, told
    assert f"worker (pid {pid}) sent a reply that is not the answer its item is due" in told[0], told
    assert "forked writing to its pipe?" in told[0] and "re-running its item (attempt 2)" in told[0], told


def test_a_reply_too_large_to_unpickle_in_the_parent_fails_its_item_and_not_its_worker(monkeypatch):
    """A worker's own reply that the parent cannot unpickle for want of memory (a large reply
    pickled in-band, under an address-space limit) failed its item with the error, as any reply
    that cannot be decoded does. Once replies were numbered, the MemoryError was taken for a
    message no worker wrote: the healthy worker was killed and replaced as if a process it forked
    had written to its pipe, and the item re-run, or failed as a crash (here, with no retries)."""
    loads = pickle.loads
    failed: list[int] = []

    def loads_short_of_memory_once(message, *args, **kwargs):
        if not failed and len(message) > 100_000:
            failed.append(len(message))
            raise MemoryError
        return loads(message, *args, **kwargs)

    with ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("large", bytes, 1)])
        monkeypatch.setattr(process, "pickle", SimpleNamespace(loads=loads_short_of_memory_once, dumps=pickle.dumps))
        error = runner.submit(0, 200_000).exception(60)
        assert [runner.submit(0, x).result(60) for x in (3, 200_000)] == [bytes(3), bytes(200_000)]
        assert runner.stats().workers_replaced == 0
    assert failed, "the reply was never unpickled"
    assert isinstance(error, RuntimeError) and isinstance(error.__cause__, MemoryError), error
    assert "could not unpickle the worker's reply" in str(error), error


def _lose_the_pipe_on_the_first_attempt(lose: str, marker: Path, x: int) -> int:
    """A stage function that, on the first attempt at item -1 only, loses the worker's pipe while
    the worker lives on (`lose`: its descriptor closed, another one dup2'd over it, or the socket
    shut down), then writes the worker's pid to `marker` and sleeps. Items come back as they are."""
    if x != -1:
        return x
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return x
    pipe = worker_pipe().fileno()
    if lose == "closed":
        os.close(pipe)
    elif lose == "dup2 over it":
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, pipe)
        os.close(devnull)
    else:
        with socket.socket(fileno=os.dup(pipe)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(600)
    return x


@pytest.mark.parametrize("lose", ["closed", "dup2 over it", "shut down"])
def test_a_worker_whose_pipe_ends_while_it_runs_is_killed_and_replaced_holding_up_no_other_reply(
    lose, tmp_path, caplog
):
    """At the end of a worker's pipe the reader took the worker for dead and joined its process
    without a bound: a stage function that closed its pipe's descriptor (or dup2'd another over it,
    or shut its socket down) and went on running held the reader, every other worker's replies,
    the exit watch and `task_timeout_s` until it returned, and then the worker's own wait for its
    parent's death. A worker whose pipe ends before its exit is seen is killed instead, as one
    past `task_timeout_s` is, and its item re-run, the cause named."""
    marker = tmp_path / "pid"
    stage = functools.partial(_lose_the_pipe_on_the_first_attempt, lose, marker)
    with caplog.at_level(logging.WARNING, logger="runners.process"), ProcessRunner() as runner:
        runner.start([Stage("careless", stage, 2)])
        lost = runner.submit(0, -1)
        victim = int(wait_for_text(marker))
        assert [runner.submit(0, x).result(60) for x in range(4)] == list(range(4))
        assert lost.result(60) == -1
        stats = runner.stats()
        wait_until(lambda: has_exited(victim))
    assert (stats.retries, stats.workers_replaced) == (1, 1)
    assert f"worker (pid {victim}) was killed: its pipe closed while it was still running" in caplog.text, caplog.text


def _lose_the_pipe_then_exit_on_go(marker: Path, go: Path, x: int) -> int:
    """A stage function that, on item -1, closes the worker's pipe, writes the worker's pid to
    `marker`, and exits with code 3 once `go` exists: a worker dying some time after its pipe
    ended. Other items come back as they are."""
    if x != -1:
        return x
    os.close(worker_pipe().fileno())
    marker.write_text(str(os.getpid()))
    while not go.exists():
        time.sleep(0.01)
    os._exit(3)


def test_other_replies_are_read_while_a_worker_whose_pipe_ended_is_given_time_to_exit_with_its_own_cause(
    tmp_path, monkeypatch, caplog
):
    """The reader gave a worker whose pipe ended `_EXIT_AFTER_PIPE_END_S` to exit by waiting for
    it, reading nothing else meanwhile: 1 s per such worker, so 16 at once held every other reply,
    the exit watch and `task_timeout_s` for 16 s, and a close for as long. It now goes on reading
    the other workers while that time runs (made an hour here), and an exit within it still gives
    the worker's own cause."""
    monkeypatch.setattr(process, "_EXIT_AFTER_PIPE_END_S", 3600.0)
    marker, go = tmp_path / "pid", tmp_path / "go"
    stage = functools.partial(_lose_the_pipe_then_exit_on_go, marker, go)
    with caplog.at_level(logging.WARNING, logger="runners.process"), ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("careless", stage, 2)])
        lost = runner.submit(0, -1)
        victim = int(wait_for_text(marker))
        assert [runner.submit(0, x).result(60) for x in range(4)] == list(range(4))
        assert not has_exited(victim)
        go.touch()
        with pytest.raises(WorkerCrashedError):
            lost.result(60)
    assert f"worker (pid {victim}) exited with code 3" in caplog.text, caplog.text


def _print_to_the_reply_descriptor(x: int) -> int:
    """A stage function that, on item -1, writes a line of text to the worker's reply descriptor (a
    progress line meant for a log, a library handed the wrong descriptor), then returns the item as
    the others."""
    if x == -1:
        os.write(worker_pipe().fileno(), b"progress: 50%\n")
    return x


def test_a_stage_function_writing_to_its_reply_descriptor_has_its_worker_retired_at_once_naming_the_length():
    """Eight bytes of text written to the worker's reply descriptor were read as the length of a
    reply (here 0x70726f6772657373, some 7 EiB) and the reader waited for that many bytes: every
    later reply of the worker was held with them, its items waiting until `task_timeout_s` (for
    ever without one) and then failing as timed out. A length more than a reply can be retires the
    worker at once, the cause naming it, and its replacement serves the stage."""
    with ProcessRunner(task_timeout_s=10, max_retries=0) as runner:
        runner.start([Stage("chatty", _print_to_the_reply_descriptor, 1)])
        error = runner.submit(0, -1).exception(60)
        assert [runner.submit(0, x).result(60) for x in range(4)] == list(range(4))
        assert runner.stats().workers_replaced == 1
    length = int.from_bytes(b"progress", "big")
    assert isinstance(error, WorkerCrashedError), error
    assert f"its reply pipe carried a length of {length} bytes, more than a reply can be" in str(error), error


def _report_progress_to_the_reply_descriptor_later(go: Path, x: int) -> int:
    """A stage function that, on item -1, starts a thread which, once `go` exists (the worker idle
    by then), writes a progress line to the worker's reply descriptor; items come back as they are."""
    if x == -1:
        fd = worker_pipe().fileno()

        def report() -> None:
            wait_for_text(go)
            os.write(fd, b"progress: 100%\n")

        threading.Thread(target=report, daemon=True).start()
    return x


def test_an_idle_worker_retired_for_text_on_its_reply_descriptor_is_reported(tmp_path, caplog):
    """Text a thread of the stage function wrote to the reply descriptor of a worker holding no
    item retired it (killed and replaced) without a word: no item was there to fail or re-run with
    the cause, so nothing told of the stage function's fault. It is reported with a warning naming
    the worker and the length, as a reply to no item is."""
    go = tmp_path / "go"
    stage = functools.partial(_report_progress_to_the_reply_descriptor_later, go)
    with caplog.at_level(logging.WARNING, logger="runners.process"), ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("chatty", stage, 1)])
        [pid] = runner.worker_pids()
        assert runner.submit(0, -1).result(60) == -1
        go.write_text("go")
        wait_until(lambda: runner.stats().workers_replaced == 1)
        assert [runner.submit(0, x).result(60) for x in range(3)] == list(range(3))
    length = int.from_bytes(b"progress", "big")
    assert f"worker (pid {pid}) was killed: its reply pipe carried a length of {length} bytes" in caplog.text, caplog.text


def _forking_with_a_child_that_leaves_it(leave: Any, x: int) -> tuple[int, int | None]:
    """A stage function that, on item -1, forks a child which returns from it (`leave` None) or
    raises `leave`, instead of exiting (`os.fork()` without `os._exit`), and waits for that
    child; what comes back is the item and the child's exit code."""
    if x != -1:
        return x, None
    child = os.fork()
    if child == 0:  # back into the worker's loop
        if leave is None:
            return x, None
        raise leave
    return x, os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


@pytest.mark.parametrize(
    ("leave", "code"), [(None, 0), (SystemExit(3), 3), (ValueError("in the child"), 1)], ids=["returns", "exit", "raises"]
)
def test_a_child_the_stage_function_forks_that_leaves_it_exits_and_never_answers_for_the_worker(leave, code, tmp_path):
    """A child forked by the stage function that returned from it or raised carried on in its
    copy of the worker's loop: it sent a reply of its own on the worker's pipe, answering the
    worker's item (or the next one) with its copy's result, then read items meant for the worker
    and, at the pipe's end, removed the runner's buffer directory. Such a child now exits there, as
    Python ends a process, having written nothing."""
    stage = functools.partial(_forking_with_a_child_that_leaves_it, leave)
    with ProcessRunner(shm_root=str(tmp_path)) as runner:
        runner.start([Stage("forking", stage, 1)])
        assert runner.submit(0, -1).result(30) == (-1, code)
        assert [runner.submit(0, x).result(30) for x in range(4)] == [(x, None) for x in range(4)]
        assert runner.stats().workers_replaced == 0
        assert os.path.isdir(runner._directory)


def _no_pidfd(pid: int) -> int:
    raise OSError(38, "Function not implemented")  # ENOSYS: a kernel older than 5.3


@pytest.mark.parametrize("pidfd_open", ["offered", "missing", "refused"])
def test_a_killed_worker_is_replaced_leaving_no_descriptor_open_whether_or_not_the_system_offers_pidfds(
    monkeypatch, pidfd_open
):
    """Workers are watched through pidfds where the system offers them and through their sentinels
    where it does not (Python < 3.9, a kernel older than 5.3); either way a dead worker is replaced,
    and what watched it is closed with it."""
    if pidfd_open == "missing":
        monkeypatch.delattr(os, "pidfd_open")
    elif pidfd_open == "refused":
        monkeypatch.setattr(os, "pidfd_open", _no_pidfd)
    fds_before = len(os.listdir("/proc/self/fd"))
    with ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("fragile", lambda x: os.kill(os.getpid(), signal.SIGKILL) if x else x, 1)])
        error = runner.submit(0, 1).exception(60)
        assert runner.submit(0, 0).result(60) == 0
    assert isinstance(error, WorkerCrashedError) and "killed by SIGKILL" in str(error), error
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_a_worker_crash_on_one_rank_of_a_job_is_logged_naming_that_rank(tmp_path, monkeypatch, caplog):
    """A crash is that process's own event, kept on every rank; but "worker exited with code 3"
    from one of a thousand ranks did not say which one, nor so which node to look at."""
    monkeypatch.setenv("RANK", "517")

    def crash(x: int) -> int:
        os._exit(3)

    with caplog.at_level(logging.WARNING, logger="runners.process"), ProcessRunner(max_retries=1) as runner:
        runner.start([Stage("fragile", crash, 1)])
        assert isinstance(runner.submit(0, 0).exception(10), WorkerCrashedError)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2, logged
    for message in logged:
        assert message.startswith("rank 517: stage 'fragile': worker (pid") and "exited with code 3" in message, logged


def _end_the_worker_with_code_7_once_go_exists(go: Path, x: int) -> int:
    """A stage function that, on item -1, starts a thread which ends the worker with exit code 7
    once `go` exists (the worker holding no item by then); items come back as they are."""
    if x == -1:

        def end() -> None:
            wait_for_text(go)
            os._exit(7)

        threading.Thread(target=end, daemon=True).start()
    return x


@pytest.mark.parametrize(("end", "said"), [("kill -9", "was killed by SIGKILL"), ("exit", "exited with code 7")])
def test_a_worker_that_dies_holding_no_item_is_reported_counted_and_replaced(end, said, tmp_path, caplog):
    """A worker that died between items (the OOM killer, `kill -9`, a thread of its stage function
    ending the process) was replaced without a word, where one that died running an item is
    logged: whoever watched the job never saw it. Its death is logged at WARNING, naming the stage,
    the pid and how it ended, and counted as a replacement, not a retry; the next items run."""
    go = tmp_path / "go"
    stage = functools.partial(_end_the_worker_with_code_7_once_go_exists, go)
    with caplog.at_level(logging.WARNING, logger="runners.process"), ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("idle", stage, 1)])
        [pid] = runner.worker_pids()
        assert runner.submit(0, -1).result(60) == -1
        if end == "kill -9":
            os.kill(pid, signal.SIGKILL)
        else:
            go.write_text("go")
        wait_until(lambda: runner.stats().workers_replaced == 1)
        assert [runner.submit(0, x).result(60) for x in range(3)] == list(range(3))
        stats = runner.stats()
    told = [record for record in caplog.records if f"(pid {pid})" in record.getMessage()]
    expected = f"stage 'idle': worker (pid {pid}) {said}; it held no item, replacing it"
    assert [(r.levelno, r.getMessage().endswith(expected)) for r in told] == [(logging.WARNING, True)], caplog.text
    assert (stats.retries, stats.workers_replaced) == (0, 1)


def wait_until(condition, timeout: float = POLL_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_a_busy_worker_already_holds_its_next_item_unless_the_message_is_large(tmp_path):
    release = tmp_path / "release"

    def wait_for_release(x):
        if x == 0:
            wait_for_text(release, timeout=30)
        return len(x) if isinstance(x, str) else x

    with ProcessRunner() as runner:
        runner.start([Stage("one", wait_for_release, 1)])
        first, second = runner.submit(0, 0), runner.submit(0, 1)
        wait_until(lambda: runner.stats().items_sent == 2)  # item 1 sent while item 0 still runs
        large = runner.submit(0, "x" * 100_000)  # pickled in the stream: waits for an idle worker
        time.sleep(0.2)
        assert not first.done() and runner.stats().items_sent == 2
        release.write_text("go")
        assert [first.result(10), second.result(10), large.result(10)] == [0, 1, 100_000]
        assert runner.stats().items_sent == 3


def test_when_a_worker_dies_only_the_item_it_was_running_counts_an_attempt(tmp_path):
    sent = tmp_path / "item 1 sent"

    def crash_on_zero(x: int) -> int:
        if x == 0:
            wait_for_text(sent)  # dies only once item 1 is in this worker's pipe
            os._exit(3)
        return x

    with ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("fragile", crash_on_zero, 1)])
        crashed, waiting = runner.submit(0, 0), runner.submit(0, 1)
        wait_until(lambda: runner.stats().items_sent == 2)
        sent.write_text("sent")
        error = crashed.exception(60)
        assert waiting.result(10) == 1  # re-sent to the replacement, not failed with the crash
        stats = runner.stats()
    assert isinstance(error, WorkerCrashedError) and error.attempts == 1
    assert (stats.items_sent, stats.retries, stats.workers_replaced) == (3, 0, 1)


def test_an_item_that_always_hangs_fails_with_the_timeout_named():
    with ProcessRunner(task_timeout_s=0.2, max_retries=1) as runner:
        runner.start([Stage("sleepy", lambda x: time.sleep(60))])
        error = runner.submit(0, 1).exception(10)
    assert isinstance(error, WorkerCrashedError) and error.attempts == 2
    assert "task_timeout_s=0.2" in str(error)


def test_close_leaks_no_process_thread_or_shared_memory_file_even_with_work_in_flight(monkeypatch):
    terminated = []
    terminate = multiprocessing.process.BaseProcess.terminate
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "terminate",
                        lambda process: terminated.append(process.pid) or terminate(process))
    threads_before, children_before = set(threading.enumerate()), child_pids()
    fds_before = len(os.listdir("/proc/self/fd"))
    runner = ProcessRunner()
    runner.start([Stage("big", lambda n: np.ones(n)), Stage("slow", lambda x: time.sleep(60), 2)])
    directory, workers = runner.shm_directory, set(runner.worker_pids())
    assert workers <= child_pids() and len(workers) == 3
    kept = runner.submit(0, MIB).result(60)
    busy = {worker.process.pid for worker in runner._workers if worker.stage == 1}
    in_flight = [runner.submit(1, i) for i in range(3)]  # two running, one waiting in a worker's pipe
    runner.submit(0, 2 * MIB)  # may be in flight or finished when close() starts

    runner.close()
    runner.close()
    # The two busy workers are terminated, not waited for; the first stage's too if its item was
    # still in flight, which depends on how fast this machine ran it.
    assert len(busy) == 2 and busy <= set(terminated) <= workers
    assert all(future.cancelled() for future in in_flight)
    assert child_pids() == children_before and multiprocessing.active_children() == []
    assert set(threading.enumerate()) == threads_before
    assert not os.path.exists(directory) and runner.shm_directory is None
    assert len(os.listdir("/proc/self/fd")) == fds_before  # pipes, sentinels and wake-up pipe closed
    assert kept.sum() == MIB  # a result received before close outlives the directory


def test_a_signal_handler_of_the_trainer_never_runs_in_a_worker_and_close_terminates_busy_ones_at_once(tmp_path, caplog):
    """Workers are forked from the trainer and inherited its Python signal handlers: a preemption
    handler for SIGTERM (Lightning's, a job's own checkpoint-and-exit) ran inside every worker that
    got the signal, on its forked copy of the trainer's state, and the worker went on. So close(),
    which terminates busy workers, waited for each through close_timeout_s before killing it, and
    a SIGTERM sent to the whole job ran the trainer's handler once per worker."""
    ran_in = tmp_path / "handled"

    def on_sigterm(signum, frame) -> None:  # what a trainer's preemption handler might record
        with open(ran_in, "a") as record:
            record.write(f"{os.getpid()}\n")

    def running_for_a_minute(x: int) -> None:
        (tmp_path / f"running {x}").write_text("running")  # past the worker's start: its handlers are its own
        time.sleep(60)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        runner = ProcessRunner(close_timeout_s=20)
        runner.start([Stage("slow", running_for_a_minute, 2)])
        workers = runner.worker_pids()
        busy = [runner.submit(0, i) for i in range(2)]
        for i in range(2):
            wait_for_text(tmp_path / f"running {i}")
        with caplog.at_level(logging.WARNING, logger="runners.process"):
            runner.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert all(future.cancelled() for future in busy)
    assert not ran_in.exists(), f"the trainer's handler ran in workers {ran_in.read_text().split()} of {workers}"
    outlived = [r.getMessage() for r in caplog.records if "after SIGTERM" in r.getMessage()]
    assert outlived == [], f"the busy workers outlived SIGTERM: {outlived}"


def _ignore_sigterm_and_hang(marker: str):
    """A stage function stuck where SIGTERM does not reach it (a C library that blocks the signal)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(marker).touch()
    while True:
        time.sleep(60)


def test_a_worker_that_outlives_close_timeout_s_is_killed_and_reported_naming_its_stage(tmp_path, caplog):
    """close() terminates a busy worker and kills it (SIGKILL) if it has not exited after
    `close_timeout_s`; that kill said nothing, so a stage function that hung past SIGTERM went
    unreported, where the thread runner names the stage it leaves running."""
    marker = tmp_path / "running"
    runner = ProcessRunner(close_timeout_s=0.2, shm_root=str(tmp_path))
    runner.start([Stage("stuck", lambda _: _ignore_sigterm_and_hang(str(marker)), 1)])
    [worker] = runner.worker_pids()
    stuck = runner.submit(0, 0)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), "the check below must have something to see"
    with caplog.at_level(logging.WARNING, logger="runners.process"):
        runner.close()
    assert stuck.cancelled() and worker not in child_pids()
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 1, warned
    assert f"stage 'stuck': busy worker (pid {worker})" in warned[0] and "SIGKILL" in warned[0], warned


_EXIT_WITHOUT_CLOSE = """
import os, sys, numpy as np
from runners import ProcessRunner
from zephon._runner import Stage
runner = ProcessRunner(shm_root=sys.argv[1], reply_arena_bytes=0)
runner.start([Stage("double", lambda x: 2 * x, 2)])
assert runner.submit(0, np.ones(1 << 20)).result(10).sum() == 2 << 20
assert os.listdir(sys.argv[1]) == [os.path.basename(runner.shm_directory)]
print(*runner.worker_pids())
# exits without runner.close()
"""


def exit_and_list_workers_left(script: str, tmp_path) -> list[int]:
    """Run `script` (given a shm root, printing its runner's worker pids) in a fresh interpreter;
    check that it exited cleanly leaving no buffer directory and no worker, and return the pids."""
    root = tmp_path / "shm"
    root.mkdir()
    done = _run_script(script, str(root), timeout=60)
    assert done.returncode == 0, done.stderr
    assert list(root.iterdir()) == []  # its buffer directory removed by the exit hook
    assert "Traceback" not in done.stderr
    pids = list(map(int, done.stdout.split()))
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()
    return pids


def test_a_runner_never_closed_is_closed_at_interpreter_exit(tmp_path):
    exit_and_list_workers_left(_EXIT_WITHOUT_CLOSE, tmp_path)


_TAKE_A_BATCH_THEN_SIGKILL = """
import functools, os, signal, sys
from pathlib import Path
from runners import ProcessRunner
from tests.reliability.harness import jsonl_dataset, text_pipeline
pipeline = text_pipeline(jsonl_dataset(Path(sys.argv[2])), parallelism=2,
                         runner=functools.partial(ProcessRunner, shm_root=sys.argv[1]))
loader = pipeline.shard(0, 1)
next(iter(loader))
assert os.listdir(sys.argv[1]) == [os.path.basename(loader._runner.shm_directory)]
print(*loader._runner.worker_pids(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def has_exited(pid: int) -> bool:
    """Gone, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_parent_killed_with_sigkill_leaves_no_buffer_directory_once_its_workers_exit(tmp_path):
    """The runner's buffer directory (/dev/shm/zephon-<pid>-*) was removed by close() alone, so a
    trainer killed with SIGKILL (the OOM killer, a scheduler) left it behind for good: the workers
    noticed the closed pipe and exited, the directory stayed. The workers now remove it."""
    root = tmp_path / "shm"
    root.mkdir()
    done = _run_script(_TAKE_A_BATCH_THEN_SIGKILL, str(root), str(tmp_path / "data"), timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    workers = list(map(int, done.stdout.split()))
    assert len(workers) == 2
    deadline = time.monotonic() + 60
    while not all(has_exited(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(has_exited(pid) for pid in workers), "the workers noticed their parent's death"
    assert list(root.iterdir()) == []


def dead_runners_directory(root: Path, name: str = "zephon-4343-deadbeef") -> Path:
    """A buffer directory as a runner killed whole leaves it: its lock file held by no process,
    a buffer file in transit."""
    directory = root / name
    directory.mkdir()
    (directory / "owner.lock").write_bytes(Path("/proc/sys/kernel/random/boot_id").read_bytes().strip())
    (directory / ("0" * 32)).write_bytes(b"x" * 4096)
    return directory


def start_a_runner_beside(root: Path) -> None:
    with ProcessRunner(shm_root=str(root)) as runner:
        runner.start([Stage("double", lambda x: 2 * x, 1)])
        assert runner.submit(0, 2).result(10) == 4


_KILLED_WHOLE = """
import os, signal, sys, time, numpy as np
from runners import ProcessRunner
from zephon._runner import Stage
runner = ProcessRunner(shm_root=sys.argv[1], reply_arena_bytes=0, request_arena_bytes=0)
runner.start([Stage("slow", lambda x: time.sleep(60), 1)])
in_transit = [runner.submit(0, np.ones(1 << 20)) for _ in range(4)]  # the worker holds two, two wait
print(runner.shm_directory, *runner.worker_pids(), flush=True)
os.killpg(0, signal.SIGKILL)  # the trainer and its workers at once, as scancel or the OOM killer
"""


def test_a_job_killed_whole_leaves_its_buffer_directory_to_the_next_runner_made_under_the_same_root(tmp_path, caplog):
    """Killed whole (SIGKILL to the trainer and its workers at once: Slurm's scancel after its grace
    period, the OOM killer taking the job's cgroup), a job left nobody to remove its buffer
    directory: it stayed in /dev/shm with the buffer files in transit for good, and a node running
    job after job filled its /dev/shm. The next process runner made under that root removes it."""
    root = tmp_path / "shm"
    root.mkdir()
    done = _run_script(_KILLED_WHOLE, str(root), timeout=60, start_new_session=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    directory, *workers = done.stdout.split()
    wait_until(lambda: all(has_exited(int(pid)) for pid in workers))
    assert len(os.listdir(directory)) >= 2, "the directory and the buffer files in transit were left"

    with caplog.at_level(logging.INFO, logger="runners.process"):
        start_a_runner_beside(root)
    assert not os.path.exists(directory) and list(root.iterdir()) == []
    assert f"removed {directory}, the buffer directory of a process runner none of whose processes is alive" in caplog.text


_OPEN_UNTIL_TOLD = """
import os, signal, sys, time, numpy as np
from runners import ProcessRunner
from zephon._runner import Stage
runner = ProcessRunner(shm_root=sys.argv[1], reply_arena_bytes=0, request_arena_bytes=0)
if sys.argv[2] == "its parent":
    runner.start([Stage("double", lambda x: 2 * x, 1)])
    print(runner.shm_directory, flush=True)
    sys.stdin.readline()
    print(int(runner.submit(0, np.ones(1 << 20)).result(10).sum()), flush=True)
    runner.close()
else:
    runner.start([Stage("slow", lambda x: time.sleep(60), 1)])
    runner.submit(0, 1)
    print(runner.shm_directory, *runner.worker_pids(), flush=True)
    sys.stdin.readline()
    os.kill(os.getpid(), signal.SIGKILL)  # the parent alone, its worker busy
"""


@pytest.mark.parametrize("alive", ["its parent", "only its busy worker, its parent killed alone"])
def test_a_buffer_directory_is_never_removed_while_a_process_of_its_runner_lives(tmp_path, alive):
    """A runner made beside a live one leaves its directory alone, whatever the pid in its name
    says; so does one made while a runner's parent is dead but a worker, which removes the
    directory once its item is done, still runs. The one made after that worker dies removes it."""
    script = subprocess.Popen(
        [sys.executable, "-c", _OPEN_UNTIL_TOLD, str(tmp_path), alive],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_THIS_CHECKOUT,
    )
    try:
        directory, *workers = script.stdout.readline().split()
        if alive == "its parent":
            start_a_runner_beside(tmp_path)
            out, _ = script.communicate("go\n", timeout=60)
            assert (script.returncode, out.split()) == (0, [str(2 << 20)]), "it kept its directory"
            return
        script.stdin.write("die\n")
        script.stdin.close()
        assert script.wait(60) == -signal.SIGKILL
        start_a_runner_beside(tmp_path)
        assert os.path.isdir(directory) and not has_exited(int(workers[0]))
    finally:
        script.kill()
        script.wait()
    os.kill(int(workers[0]), signal.SIGKILL)
    wait_until(lambda: has_exited(int(workers[0])))
    start_a_runner_beside(tmp_path)
    assert not os.path.exists(directory)


@pytest.mark.parametrize(
    "left",
    [
        "a directory a runner is making",
        "a runner's directory another node locked",
        "a directory not named as a runner's",
        "a file named as a runner's directory",
    ],
)
def test_what_may_not_be_a_dead_runners_buffer_directory_is_left_alone(tmp_path, left):
    """A runner's directory exists a moment before its lock is taken; another node's lock, on a
    filesystem shared between nodes, may not be seen here; and nothing not named as a runner's
    buffer directory is a runner's to remove. A dead runner's beside them is removed."""
    dead = dead_runners_directory(tmp_path)
    if left == "a runner's directory another node locked":
        kept = dead_runners_directory(tmp_path, "zephon-4242-abcdefgh")
        (kept / "owner.lock").write_bytes(b"00000000-0000-0000-0000-000000000000")
    elif left == "a directory a runner is making":
        kept = tmp_path / "zephon-4242-abcdefgh"
        kept.mkdir()
        (kept / "owner.lock.new").touch()  # created, not yet locked and named
    elif left == "a directory not named as a runner's":
        kept = dead_runners_directory(tmp_path, "zephon-cache")
    else:
        kept = tmp_path / "zephon-4242-abcdefgh"
        kept.write_bytes(b"not ours")
    before = sorted(kept.iterdir()) if kept.is_dir() else kept.read_bytes()
    start_a_runner_beside(tmp_path)
    assert (sorted(kept.iterdir()) if kept.is_dir() else kept.read_bytes()) == before
    assert not dead.exists()


def test_a_second_runner_in_one_process_keeps_the_first_s_directory_where_locks_are_posix_record_locks(
    tmp_path, monkeypatch
):
    """On NFS, Linux emulates `flock` with POSIX record locks, which a process's own opens never
    conflict with and which closing any descriptor of the file drops. A second runner made in the
    process of a live one (a validation loader's beside the training loader's) on such an
    `shm_root` took the first runner's lock and removed its live directory. Emulated here with
    `lockf`, which takes the same record locks on a local disk."""
    monkeypatch.setattr(fcntl, "flock", fcntl.lockf)
    with ProcessRunner(shm_root=str(tmp_path), reply_arena_bytes=0, request_arena_bytes=0) as first:
        first.start([Stage("sum", lambda a: int(a.sum()), 1)])
        start_a_runner_beside(tmp_path)
        assert os.path.isdir(first.shm_directory)
        assert first.submit(0, np.ones(1 << 20, dtype=np.uint8)).result(10) == 1 << 20  # through a buffer file


def test_a_dead_runners_directory_that_cannot_be_removed_is_logged_and_the_new_runner_starts(tmp_path, monkeypatch, caplog):
    dead = dead_runners_directory(tmp_path)
    remove = shutil.rmtree

    def refuse(path, *args, **kwargs):
        if str(path) == str(dead):
            raise PermissionError(13, "Permission denied", str(path))
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with caplog.at_level(logging.WARNING, logger="runners.process"):
        start_a_runner_beside(tmp_path)
    assert dead.is_dir()
    assert f"could not remove {dead}, the buffer directory of a dead process runner: [Errno 13] Permission denied" in caplog.text


_FORK_A_CHILD_THAT_EXITS = """
import os, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from runners import ProcessRunner
from zephon._runner import Stage
runner = ProcessRunner()
runner.start([Stage("double", lambda x: 2 * x, 2)])
assert runner.submit(0, 3).result(10) == 6
workers = runner.worker_pids()
child = os.fork()
if child == 0:
    sys.exit(0)  # a plain forked child (a fork-based helper) ending through normal interpreter exit
assert os.waitpid(child, 0)[1] == 0
assert runner.submit(0, 4).result(10) == 8
print(runner.stats().workers_replaced, runner.worker_pids() == workers)
runner.close()
"""


def test_a_plain_forked_child_exiting_normally_leaves_the_parents_workers_alone():
    """A child forked with os.fork inherits multiprocessing's list of the parent's children, and
    multiprocessing's exit hook terminates the daemonic ones there: a forked child ending through
    normal interpreter exit sent SIGTERM to the parent's workers (replaced, their items re-run,
    a crash counted against each) and printed an AssertionError from that hook."""
    done = _run_script(_FORK_A_CHILD_THAT_EXITS, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True"], "no worker of the parent was replaced"
    assert "Traceback" not in done.stderr, done.stderr

@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_forked_child_closing_its_copy_leaves_the_parents_workers_and_directory_alone():
    """A child forked inside `with ProcessRunner() as runner:` that leaves the block closes its copy
    of the runner: that close sent the stop message to the parent's idle workers and SIGTERM to its
    busy ones (all replaced by the parent, their items re-run as after a crash), then failed in the
    child with multiprocessing's bare `AssertionError: can only join a child process`."""
    with ProcessRunner() as runner:
        runner.start([Stage("double", lambda x: 2 * x, 2)])
        assert runner.submit(0, 1).result(10) == 2
        workers, directory = runner.worker_pids(), runner.shm_directory
        child = os.fork()
        if child == 0:
            code = 1
            try:
                runner.close()
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(child, 0)[1] == 0, "the child's close returned"
        assert [runner.submit(0, x).result(10) for x in (3, 4)] == [6, 8]
        assert runner.worker_pids() == workers and runner.stats().workers_replaced == 0
        assert os.path.isdir(directory)



def interrupt_next_join(waitable) -> None:
    """Make the next `join()` of this thread or process raise KeyboardInterrupt, as Ctrl-C does
    while close() waits there; joins after it are left alone."""

    def interrupted(*args, **kwargs):
        del waitable.join
        raise KeyboardInterrupt

    waitable.join = interrupted


@pytest.mark.parametrize("where", ["reader thread", "workers"])
def test_a_close_interrupted_by_ctrl_c_is_finished_by_the_next_close(where):
    """Close used to drop its exit hook and its list of workers first: once interrupted, a second
    close returned at once, and the workers and the shared-memory directory were left behind."""
    children_before = child_pids()
    fds_before = len(os.listdir("/proc/self/fd"))
    runner = ProcessRunner()
    runner.start([Stage("slow", lambda x: time.sleep(60), 2)])
    directory, workers = runner.shm_directory, set(runner.worker_pids())
    in_flight = runner.submit(0, 1)
    interrupt_next_join(runner._reader if where == "reader thread" else runner._workers[0].process)

    with pytest.raises(KeyboardInterrupt):
        runner.close()
    assert runner.submit(0, 2).cancelled(), "it is closing all the same"
    runner.close()

    assert in_flight.cancelled()
    assert child_pids() == children_before and not workers & child_pids()
    assert not os.path.exists(directory) and runner.shm_directory is None
    assert len(os.listdir("/proc/self/fd")) == fds_before


_EXIT_AFTER_AN_INTERRUPTED_CLOSE = """
import sys
from runners import ProcessRunner
from zephon._runner import Stage
runner = ProcessRunner(shm_root=sys.argv[1])
runner.start([Stage("double", lambda x: 2 * x, 2)])
assert runner.submit(0, 1).result(10) == 2
worker = runner._workers[0].process
def interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # Ctrl-C while close() waits for the workers
worker.join = interrupted
try:
    runner.close()
except KeyboardInterrupt:
    del worker.join
print(*runner.worker_pids())
del runner, worker  # its owner lets go of it and exits with that close unfinished
"""


def test_a_close_interrupted_by_ctrl_c_is_finished_at_interpreter_exit(tmp_path):
    pids = exit_and_list_workers_left(_EXIT_AFTER_AN_INTERRUPTED_CLOSE, tmp_path)
    assert len(pids) == 2, "the interrupted close left both workers to the exit hook"


def test_close_from_a_done_callback_on_the_reader_thread(tmp_path):
    children_before = set(child_pids())
    seen: dict[str, str] = {}
    runner = ProcessRunner()
    runner.start([Stage("slow", lambda x: time.sleep(0.3) or x, 2)])

    def close_from_callback(_future) -> None:
        seen["thread"] = threading.current_thread().name
        runner.close()

    runner.submit(0, 1).add_done_callback(close_from_callback)
    deadline = time.monotonic() + 10
    while any(t.name == "zephon-process-reader" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert seen["thread"] == "zephon-process-reader"
    assert child_pids() == children_before


def test_buffer_files_live_under_shm_root_when_given(tmp_path):
    with ProcessRunner(shm_root=str(tmp_path), reply_arena_bytes=0, request_arena_bytes=0) as runner:
        runner.start([Stage("echo", lambda x: (mapped_file(x), x))])
        directory = runner.shm_directory
        assert Path(directory).parent == tmp_path
        seen_by_worker, echoed = runner.submit(0, np.ones(MIB)).result(10)
    assert seen_by_worker.startswith(directory + "/") and mapped_file(echoed).startswith(directory + "/")
    assert list(tmp_path.iterdir()) == []


def test_a_relative_shm_root_still_holds_the_buffers_after_the_working_directory_changes(tmp_path, monkeypatch):
    """A relative `shm_root` was kept relative: once the job changed its working directory (Hydra
    gives each run its own), every buffer went to a path that did not exist (FileNotFoundError for
    each item that crossed through a file) and close() left the directory behind."""
    (tmp_path / "shm").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    with ProcessRunner(shm_root="shm", reply_arena_bytes=0, request_arena_bytes=0) as runner:
        runner.start([Stage("double", lambda x: 2 * x)])
        monkeypatch.chdir(tmp_path / "elsewhere")
        assert runner.submit(0, np.ones(MIB)).result(10).sum() == 2 * MIB
    assert list((tmp_path / "shm").iterdir()) == []


def test_invalid_options_are_refused_at_construction():
    with pytest.raises(ConfigurationError, match="task_timeout_s"):
        ProcessRunner(task_timeout_s=0)
    with pytest.raises(ConfigurationError, match="max_retries"):
        ProcessRunner(max_retries=-1)


def _start_a_process_runner_and_report(shm_root: str, conn) -> None:
    """In a daemonic child: what starting a ProcessRunner raises, and what it left behind."""
    runner = ProcessRunner(shm_root=shm_root)
    try:
        runner.start([Stage("echo", lambda x: x)])
        conn.send(("started", "", runner.worker_pids()))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send((type(exc).__name__, str(exc), runner.worker_pids()))
    finally:
        runner.close()
        conn.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_starting_in_a_daemonic_process_is_refused_naming_it_instead_of_a_bare_assertion(tmp_path):
    """A torch DataLoader worker is a daemonic process, where multiprocessing refuses to start
    children: a loader iterated there (its default runner on a GIL build is this one) failed with
    `AssertionError: daemonic processes are not allowed to have children` from inside
    multiprocessing, saying nothing of the runner option that avoids it."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_start_a_process_runner_and_report, args=(str(tmp_path), send), daemon=True)
    child.start()
    send.close()
    assert receive.poll(30), "the daemonic child reported"
    kind, message, workers = receive.recv()
    child.join(30)
    assert kind == "ConfigurationError", (kind, message)
    assert "daemonic" in message and "runner='thread'" in message
    assert workers == [] and list(tmp_path.iterdir()) == [], "nothing was started or left behind"


@pytest.mark.parametrize(
    "option",
    [
        {"reply_arena_bytes": 64e6},
        {"request_arena_bytes": 1.5},
        {"reply_arena_bytes": None},
        {"oob_threshold_bytes": 16e3},
        {"oob_threshold_bytes": None},
        {"max_retries": 1.5},
        {"max_retries": True},
        {"task_timeout_s": "30"},
        {"task_timeout_s": True},
    ],
)
def test_an_option_of_the_wrong_type_is_refused_at_construction_naming_it(tmp_path, option):
    """A float size (64e6 is how many write 64 MB) passed construction and failed start() with a
    bare TypeError from mmap; None or a string failed with an unnamed comparison TypeError; a
    fractional or bool max_retries was taken as a number of attempts."""
    (name,) = option
    with pytest.raises(ConfigurationError, match=name):
        ProcessRunner(shm_root=str(tmp_path), **option)


@pytest.mark.parametrize("task_timeout_s", [30 * 24 * 3600.0, 1e300, float("inf")])
def test_a_task_timeout_longer_than_the_reader_can_wait_in_one_call_still_runs_items(tmp_path, task_timeout_s):
    """A month (or inf, "never") passed the construction check, but the reader thread handed it to
    the selector, whose wait is capped near 24.8 days: it died on an OverflowError at the first
    item, and every item failed with RunnerFailedError."""
    with ProcessRunner(task_timeout_s=task_timeout_s, shm_root=str(tmp_path)) as runner:
        runner.start([Stage("double", lambda x: 2 * x, 1)])
        assert [runner.submit(0, x).result(timeout=10) for x in range(3)] == [0, 2, 4]


def test_a_close_timeout_longer_than_one_wait_can_last_still_closes_everything(tmp_path):
    """A close_timeout_s of about 25 days or more passed the construction check, but close() gave
    it to a process join, whose wait is capped there: close() raised OverflowError after it had
    begun, leaving the workers running and the buffer directory behind, at exit too."""
    children_before = child_pids()
    runner = ProcessRunner(close_timeout_s=1e7, shm_root=str(tmp_path))
    runner.start([Stage("double", lambda x: 2 * x, 2)])
    assert runner.submit(0, 21).result(10) == 42
    workers = runner.worker_pids()
    runner.close()
    assert runner.shm_directory is None and list(tmp_path.iterdir()) == []
    assert set(workers).isdisjoint(child_pids()) and child_pids() <= children_before


@pytest.mark.parametrize("close_timeout_s", [None, -1.0, float("nan")])
def test_a_close_timeout_that_close_could_not_wait_by_is_refused_at_construction(tmp_path, close_timeout_s):
    """Accepted, None (taken for "wait forever") made close() raise a TypeError once it had begun,
    so the workers were never stopped and the buffer directory stayed behind in /dev/shm."""
    with pytest.raises(ConfigurationError, match="close_timeout_s"):
        ProcessRunner(close_timeout_s=close_timeout_s, shm_root=str(tmp_path))


def test_arrays_received_from_one_stage_can_be_sent_to_the_next():
    items = list(range(10))
    stages = [Stage("cube", cube, 2), Stage("sum", lambda a: int(a.sum()), 2)]
    with InlineRunner() as inline, ProcessRunner() as process:
        inline.start(stages)
        process.start(stages)
        expected = [inline.submit(1, inline.submit(0, x).result()).result() for x in items]
        got = [process.submit(1, process.submit(0, x).result(10)).result(10) for x in items]
    assert got == expected


def address_of(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_held_reply_is_never_overwritten_and_released_blocks_are_reused():
    """Replies wait in the worker's arena; the worker reuses a block only after the parent let go."""
    with ProcessRunner(reply_arena_bytes=8 * MIB) as runner:
        runner.start([Stage("fill", lambda i: np.full(MIB, i % 251, dtype=np.uint8))])
        held = [runner.submit(0, i).result(10) for i in range(3)]
        low = min(address_of(a) for a in held)
        touched = set()
        for i in range(3, 40):  # each one released before the next is asked for
            reply = runner.submit(0, i).result(10)
            assert in_arena(reply) and reply[0] == reply[-1] == i % 251
            touched.add(address_of(reply))
            del reply
        for i, array in enumerate(held):
            assert in_arena(array)
            assert (array == i).all()  # 37 replies later, still what the worker wrote
        # 37 MiB of replies went through an 8 MiB arena: its blocks were reused, and first fit
        # kept them at its low end (a release travels with the next item, so two or three blocks
        # take turns; free-threaded CPython may release a little later).
        assert all(low <= address < low + 8 * MIB for address in touched)
        assert len(touched) <= 4


def test_a_full_arena_sends_replies_through_files_and_loses_nothing():
    with ProcessRunner(reply_arena_bytes=2 * MIB + 1024) as runner:
        runner.start([Stage("fill", lambda i: np.full(MIB, i, dtype=np.uint8))])
        held = [runner.submit(0, i).result(10) for i in range(5)]
        assert [in_arena(a) for a in held] == [True, True, False, False, False]
        assert all(backed_by_shm_file(a) for a in held[2:])
        assert [int(a[0]) for a in held] == list(range(5)) and all((a == a[0]).all() for a in held)
        assert runner.stats().shm_bytes == 5 * MIB  # arena and files alike
        del held
        runner.submit(0, 9).result(10)  # carries the releases (and wakes the reader thread on 3.14t)
        assert in_arena(runner.submit(0, 10).result(10))


@pytest.mark.parametrize("refusal", [errno.EAGAIN, errno.ENOMEM])
def test_a_worker_process_the_system_refuses_is_an_error_naming_the_stage_and_what_to_do(monkeypatch, refusal):
    """A fork refused at a process limit (a container's pids.max, where every thread of the trainer
    counts) or for memory raised a bare "Resource temporarily unavailable" from inside
    multiprocessing: now the same error type and errno, saying which stage and what to do; the
    runner is closed, its directory removed."""
    children = child_pids()

    def refused() -> int:
        raise OSError(refusal, os.strerror(refusal))

    runner = ProcessRunner()
    monkeypatch.setattr(os, "fork", refused)
    with pytest.raises(OSError) as raised:
        runner.start([Stage("tokenize", lambda x: x, 2)])
    monkeypatch.undo()
    assert raised.value.errno == refusal and isinstance(raised.value, type(OSError(refusal, "")))
    assert "stage 'tokenize': the system refused a worker process" in str(raised.value)
    assert "pids.max" in str(raised.value) and "runner='thread'" in str(raised.value)
    assert runner.shm_directory is None and child_pids() == children


def test_the_arenas_can_be_turned_off_and_their_sizes_must_not_be_negative():
    with ProcessRunner(reply_arena_bytes=0, request_arena_bytes=0) as runner:
        runner.start([Stage("echo", lambda x: (backed_by_shm_file(x), x))])
        input_in_file, echoed = runner.submit(0, np.ones(MIB, dtype=np.uint8)).result(10)
        assert input_in_file and backed_by_shm_file(echoed)
    with pytest.raises(ConfigurationError, match="reply_arena_bytes"):
        ProcessRunner(reply_arena_bytes=-1)
    with pytest.raises(ConfigurationError, match="request_arena_bytes"):
        ProcessRunner(request_arena_bytes=-1)


def doubled_where_it_arrived(x: np.ndarray) -> tuple[bool, np.ndarray]:
    return in_shared_memory(x), x * 2


def test_items_and_replies_that_find_the_shm_directory_full_cross_in_the_pipe_whole_counted_and_warned_once(
        monkeypatch, caplog):
    """A buffer file's ENOSPC failed its item, and with it the loader of a job in a container whose
    /dev/shm was small: the arrays now cross in the pipe instead, both ways, whole, counted in
    `shm_full_bytes`, with one WARNING naming the directory and what to do; no part of a file
    stays behind."""
    fill_the_shm_directory(monkeypatch)
    items = [np.full(MIB, i, dtype=np.uint8) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="runners.process"), \
            ProcessRunner(reply_arena_bytes=0, request_arena_bytes=0) as runner:
        runner.start([Stage("double", doubled_where_it_arrived, 2)])
        results = [future.result(30) for future in [runner.submit(0, item) for item in items]]
        assert os.listdir(runner.shm_directory) == [_buffer_directory.LOCK]
        stats, directory = runner.stats(), runner.shm_directory
    for item, (arrived_shared, doubled) in zip(items, results, strict=True):
        assert not arrived_shared and not in_shared_memory(doubled)
        assert doubled.flags.writeable
        np.testing.assert_array_equal(doubled, item * 2)
    assert stats.shm_full_bytes == 2 * sum(item.nbytes for item in items)  # items and replies
    assert stats.shm_bytes == 0 and stats.pipe_bytes > stats.shm_full_bytes
    warnings = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"buffer directory {directory} is full" in warnings[0] and "--shm-size" in warnings[0]


def test_a_buffer_file_that_fails_for_another_reason_still_fails_its_item(monkeypatch):
    """Only a full filesystem sends arrays through the pipe: any other write error is the item's,
    as before, and the runner serves on."""
    fill_the_shm_directory(monkeypatch, errno.EIO)
    with ProcessRunner(reply_arena_bytes=0, request_arena_bytes=0) as runner:
        runner.start([Stage("double", doubled_where_it_arrived, 1)])
        with pytest.raises(OSError) as failed:
            runner.submit(0, np.ones(MIB, dtype=np.uint8)).result(30)
        assert failed.value.errno == errno.EIO
        assert runner.submit(0, np.arange(3)).result(30)[1].tolist() == [0, 2, 4]
        assert runner.stats().shm_full_bytes == 0


def summary(x: np.ndarray) -> tuple[bool, int, int]:
    """Where an item arrived, and its first and last byte: read in the worker."""
    return in_arena(x), int(x[0]), int(x[-1])


def test_items_cross_in_the_request_arena_and_each_block_is_reused_once_its_worker_let_go():
    """40 MiB of items through a 4 MiB request arena, four at a time across two workers: every
    one arrives in the arena, intact, so blocks came back with the replies and were reused."""
    with ProcessRunner(request_arena_bytes=4 * MIB + 4096) as runner:
        runner.start([Stage("summary", summary, 2)])
        seen = []
        for start in range(0, 40, 4):
            futures = [runner.submit(0, np.full(MIB, i % 251, dtype=np.uint8)) for i in range(start, start + 4)]
            seen += [future.result(10) for future in futures]
        assert os.listdir(runner.shm_directory) == [_buffer_directory.LOCK]
    assert seen == [(True, i % 251, i % 251) for i in range(40)]


def gated_summary(gates: Path):
    """`summary`, once the file `gates / str(x[0] // 10)` exists: items of a round (0-9, 10-19,
    ...) wait in the runner, encoded, until the test opens their gate."""

    def stage(x: np.ndarray) -> tuple[bool, int, int]:
        wait_for_text(gates / str(int(x[0]) // 10), timeout=30)
        return summary(x)

    return stage


def submit_round(runner, first: int, count: int) -> list:
    return [runner.submit(0, np.full(MIB, first + i, dtype=np.uint8)) for i in range(count)]


def test_a_full_request_arena_sends_items_through_files_and_loses_nothing(tmp_path):
    with ProcessRunner(request_arena_bytes=2 * MIB + 1024) as runner:
        runner.start([Stage("summary", gated_summary(tmp_path), 1)])
        # Encoded as they are submitted, while the worker waits: two fit, three go to files.
        futures = submit_round(runner, 0, 5)
        (tmp_path / "0").write_text("go")
        assert [future.result(10) for future in futures] == [(i < 2, i, i) for i in range(5)]
        assert runner.stats().shm_bytes >= 5 * MIB  # arena and files alike
        (tmp_path / "1").write_text("go")
        assert runner.submit(0, np.full(MIB, 10, dtype=np.uint8)).result(10) == (True, 10, 10)


def test_a_dead_workers_request_blocks_are_freed_and_its_items_rerun_intact(tmp_path):
    """A worker killed while holding two items' blocks: both items run again elsewhere with the
    right bytes, and the arena gets every block back (six more items at once still fit)."""
    marker = tmp_path / "pid"
    gated = gated_summary(tmp_path)

    def stall_on_three(x: np.ndarray) -> tuple[bool, int, int]:
        stall_first_attempt(marker, int(x[0]))
        return gated(x)

    with ProcessRunner(request_arena_bytes=6 * MIB + 4096) as runner:
        runner.start([Stage("summary", stall_on_three, 2)])
        (tmp_path / "0").write_text("go")
        futures = submit_round(runner, 0, 6)
        os.kill(int(wait_for_text(marker)), signal.SIGKILL)
        assert [future.result(10) for future in futures] == [(True, i, i) for i in range(6)]
        assert runner.stats().workers_replaced == 1
        again = submit_round(runner, 10, 6)
        (tmp_path / "1").write_text("go")
        assert [future.result(10) for future in again] == [(True, 10 + i, 10 + i) for i in range(6)]


def test_an_item_interrupted_before_it_was_queued_gives_its_request_block_back(monkeypatch, tmp_path):
    """Ctrl-C while submit waits for the runner's lock, after the item was written into the
    request arena: its block comes back at once, so the next two items, both held in the arena
    while the worker waits, still fit."""
    with ProcessRunner(request_arena_bytes=2 * MIB + 1024) as runner:
        runner.start([Stage("summary", gated_summary(tmp_path), 1)])
        lock, caller = runner._lock, threading.current_thread()

        class InterruptedOnce:
            def __enter__(self):
                if threading.current_thread() is caller:
                    monkeypatch.setattr(runner, "_lock", lock)
                    raise KeyboardInterrupt
                return lock.__enter__()

            def __exit__(self, *exc):
                return lock.__exit__(*exc)

        monkeypatch.setattr(runner, "_lock", InterruptedOnce())
        with pytest.raises(KeyboardInterrupt):
            runner.submit(0, np.full(MIB, 7, dtype=np.uint8))
        futures = submit_round(runner, 0, 2)
        (tmp_path / "0").write_text("go")
        assert [future.result(10) for future in futures] == [(True, 0, 0), (True, 1, 1)]


def test_cancelled_items_give_their_request_blocks_back(tmp_path):
    with ProcessRunner(request_arena_bytes=4 * MIB + 4096) as runner:
        runner.start([Stage("summary", gated_summary(tmp_path), 1)])
        running = submit_round(runner, 0, 2)  # the worker holds two items
        queued = submit_round(runner, 2, 2)
        assert all(future.cancel() for future in queued)
        (tmp_path / "0").write_text("go")
        assert [future.result(10) for future in running] == [(True, 0, 0), (True, 1, 1)]
        again = submit_round(runner, 10, 4)
        (tmp_path / "1").write_text("go")
        assert [future.result(10) for future in again] == [(True, 10 + i, 10 + i) for i in range(4)]


def gated_tenfold(gate: Path, crash: bool):
    """Item 0 waits for `gate`, then returns (or, with `crash`, kills its worker); the rest at once."""

    def stage(x: int) -> int:
        if x == 0:
            wait_for_text(gate, timeout=30)
            if crash:
                os._exit(3)
        return x * 10

    return stage


class Injected(KeyError):
    """The fault injected into the reader thread."""


@pytest.mark.parametrize("fault", ["replacement fork fails", "arena raises in dispatch"])
def test_a_failure_inside_the_reader_thread_fails_every_outstanding_item_with_a_named_error(tmp_path, monkeypatch, fault):
    from runners import RunnerFailedError
    from runners._arena import Arena

    gate = tmp_path / "go"
    with ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("tenfold", gated_tenfold(gate, crash=fault == "replacement fork fails"), 1)])
        if fault == "replacement fork fails":

            def fork_fails(stage: int) -> None:
                raise Injected("fork")  # not an OSError; item 0, given up on, is in the reader's hands

            monkeypatch.setattr(runner, "_add_worker_locked", fork_fails)
        else:
            released = Arena.released

            def released_unless_reader(arena):
                if threading.current_thread().name == "zephon-process-reader":
                    raise Injected("arena")  # after item 0's reply was taken off its worker
                return released(arena)

            monkeypatch.setattr(Arena, "released", released_unless_reader)
        futures = [runner.submit(0, x) for x in range(3)]  # 0 running, 1 in its pipe, 2 queued
        wait_until(lambda: runner.stats().items_sent == 2)
        gate.write_text("go")
        errors = [future.exception(10) for future in futures]  # TimeoutError here is the hang
        later = runner.submit(0, 5).exception(10)
    for error in [*errors, later]:
        assert isinstance(error, RunnerFailedError) and isinstance(error, ZephonError)
        assert isinstance(error.__cause__, Injected)
        assert "reader thread" in str(error)


def test_the_runners_errors_read_the_same_after_crossing_a_process_boundary():
    """A loader run in a multiprocessing pool hands its error back pickled; RunnerFailedError,
    rebuilt from its message, said "the process runner failed: the process runner failed: ..."."""
    import pickle

    from runners import RunnerFailedError

    errors = (RunnerFailedError(), RunnerFailedError("a detail"), RunnerFailedError("a thread is stuck", runner="thread"),
              WorkerCrashedError("tokenize", 4, "was killed"))
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)


@pytest.mark.parametrize("where", ["after the message", "after its length prefix"])
def test_a_submit_interrupted_while_sending_never_pairs_a_later_reply_with_the_wrong_item(monkeypatch, where):
    from multiprocessing.connection import Connection

    # Connection.send_bytes writes a message over 16 KiB as two writes: its length, then itself.
    method = "send_bytes" if where == "after the message" else "_send"
    send = getattr(Connection, method)

    def send_then_interrupt(conn, *args):
        send(conn, *args)
        monkeypatch.setattr(Connection, method, send)
        raise KeyboardInterrupt  # Ctrl-C lands in submit, with the pipe in that state

    def measure(x):
        return len(x) if isinstance(x, str) else x * 10

    with ProcessRunner(max_retries=0) as runner:
        runner.start([Stage("measure", measure, 1)])
        monkeypatch.setattr(Connection, method, send_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            runner.submit(0, "x" * 100_000)  # pickled in the message: 100 KB
        assert [runner.submit(0, x).result(10) for x in (2, 3, "yy")] == [20, 30, 2]
        stats = runner.stats()
    # The worker whose pipe was left in an unknown state was replaced; nothing counted as a crash.
    assert (stats.retries, stats.workers_replaced) == (0, 1)


def shared_memory_of(array: np.ndarray) -> str:
    """The kernel's name for the shared memory holding the array's data: its mapping's device and
    inode in /proc/self/maps, the same in every process that maps those pages."""
    address = array.__array_interface__["data"][0]
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= address < high:
            assert fields[1].endswith("s"), "a shared mapping"
            return f"{fields[3]} {fields[4]}"
    raise AssertionError("address not mapped")


def processes_mapping(memory: str, pids: list[int]) -> list[int]:
    """Those of `pids` that map the shared memory named by `shared_memory_of`."""
    return [
        pid for pid in pids
        if any(" ".join(line.split()[3:5]) == memory for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    ]


def crash(x: int) -> np.ndarray:
    if x < 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return np.full(8 * MIB, x, dtype=np.uint8)


def run_one_item_on_each_worker(runner) -> None:
    """Once this returns, every worker has begun serving (a replacement is forked before the
    crashed item's future fails, and may not have started yet): items go to the least busy."""
    futures = [runner.submit(0, 2) for _ in runner.worker_pids()]
    assert [int(future.result(30)[0]) for future in futures] == [2] * len(futures)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_crashed_workers_reply_arena_is_mapped_by_no_process_once_its_arrays_are_released(tmp_path):
    """A worker forked after a reply arena inherited its mapping without ever touching it, so the
    arena of a worker that crashed lived, pages and all (up to reply_arena_bytes, 64 MiB), as long
    as any worker forked after it: its siblings and its own replacement, to the end of the runner,
    one more arena with every crash. Now a worker maps only the arenas it uses, and the parent
    only while it holds arrays received through them: once released, no process maps the dead
    arena, so the kernel has freed its pages."""
    with ProcessRunner(max_retries=0, shm_root=str(tmp_path)) as runner:
        runner.start([Stage("fill", crash, 2)])
        held = runner.submit(0, 1).result(30)
        assert in_arena(held)
        arena = shared_memory_of(held)
        run_one_item_on_each_worker(runner)
        first_workers = runner.worker_pids()
        assert len(processes_mapping(arena, first_workers)) == 1, "its own worker maps it"
        for _ in range(2):  # idle workers take items in order: both first workers crash
            with pytest.raises(WorkerCrashedError):
                runner.submit(0, -1).result(30)
        assert set(first_workers).isdisjoint(runner.worker_pids())
        run_one_item_on_each_worker(runner)
        assert processes_mapping(arena, runner.worker_pids()) == [], "no worker maps a dead worker's arena"
        assert int(held.min()) == int(held.max()) == 1, "an array the parent holds stays intact"
        assert processes_mapping(arena, [os.getpid()]) == [os.getpid()]
        del held
        deadline = time.monotonic() + 30
        while processes_mapping(arena, [os.getpid()]) and time.monotonic() < deadline:
            # On free-threaded CPython the reader thread, which made the view, frees it when it next runs.
            run_one_item_on_each_worker(runner)
            time.sleep(0.01)
        assert processes_mapping(arena, [os.getpid()] + runner.worker_pids()) == []


_EXIT_WHILE_THE_CLOSER_CLOSES = """
import signal, sys, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from runners import ProcessRunner
from zephon import _runner_closer
from zephon._runner import Stage

def outlives_sigterm(x):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0 if x == 1 else 2.0)
    return x

runner = ProcessRunner(shm_root=sys.argv[1], close_timeout_s=1.0)
runner.start([Stage("slow", outlives_sigterm, 1)])
assert runner.submit(0, 1).result(30) == 1
runner.submit(0, 2)  # busy when the closer closes the runner
time.sleep(0.2)
_runner_closer.start()
_runner_closer.close_later(runner.close)  # what a dropped loader's finalizer hands over
del runner
time.sleep(0.2)  # the closer is waiting for the busy worker; the script ends meanwhile
"""


def test_interpreter_exit_while_the_closer_thread_closes_a_runner_still_removes_its_buffer_directory(tmp_path):
    """A loader dropped just before the trainer exits has its runner closed by the closer thread;
    the runner's exit hook found that close under way and returned at once, and the interpreter
    ended the closer mid-close: the /dev/shm directory stayed behind for good."""
    root = tmp_path / "shm"
    root.mkdir()
    done = _run_script(_EXIT_WHILE_THE_CLOSER_CLOSES, str(root), timeout=120)
    assert done.returncode == 0, done.stderr
    assert list(root.iterdir()) == []


_EXIT_AS_THE_CLOSER_BEGINS_ITS_CLOSE = """
import faulthandler, os, signal, sys, threading, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from runners import ProcessRunner, _process_close
from zephon import _runner_closer
from zephon._runner import Stage

faulthandler.dump_traceback_later(60, exit=True)

def outlives_sigterm(x):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0 if x == 1 else 2.0)
    return x

class TakenByTheCloserJustAfterTheExitHookLooked:
    \"\"\"The runner's close lock: the closer thread's close takes it in the instant after the exit
    hook found it free, before the hook's own close tries it (what a thread switch there, or free
    threading, does by chance).\"\"\"

    def __init__(self, lock):
        self._lock, self._closer_may_take, self._closer_took = lock, threading.Event(), threading.Event()

    def locked(self):
        return self._lock.locked()

    def acquire(self, blocking=True):
        if threading.current_thread().name == _runner_closer.THREAD_NAME:
            self._closer_may_take.wait(30)
            taken = self._lock.acquire(blocking)
            self._closer_took.set()
            return taken
        self._closer_may_take.set()
        self._closer_took.wait(30)
        return self._lock.acquire(blocking)

    def release(self):
        self._lock.release()

runner = ProcessRunner(shm_root=sys.argv[1], close_timeout_s=1.0)
runner.start([Stage("slow", outlives_sigterm, 1)])
assert runner.submit(0, 1).result(30) == 1
runner.submit(0, 2)  # busy when the closer closes the runner
time.sleep(0.2)
runner._close_lock = TakenByTheCloserJustAfterTheExitHookLooked(runner._close_lock)
_runner_closer.start()
_runner_closer.close_later(runner.close)  # what a dropped loader's finalizer hands over
_process_close.close_at_exit(runner, os.getpid())  # what interpreter exit runs for it
print("closed" if runner.shm_directory is None and not os.listdir(sys.argv[1]) else "still-closing", flush=True)
"""


def test_the_exit_hook_of_a_runner_the_closer_thread_begins_closing_as_it_looks_returns_once_the_close_is_done(
        tmp_path):
    """The exit hook waited for a close under way on the closer thread only if it found the close
    lock held when it looked. A close the closer began in the instant after (a loader dropped just
    before exit) made the hook's own close() return at once, the runner still closing: interpreter
    exit could then cut that close short and leave the /dev/shm directory behind."""
    root = tmp_path / "shm"
    root.mkdir()
    done = _run_script(_EXIT_AS_THE_CLOSER_BEGINS_ITS_CLOSE, str(root), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["closed"], done.stdout + done.stderr
    assert list(root.iterdir()) == []
