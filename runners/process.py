"""Forked worker processes per stage, with large buffers crossing in shared memory.

Large buffers go to a worker through the runner's request arena and come back through the
worker's reply arena (`_arena`); each side sends the offsets of the blocks it has released back
with its next message, and a message that does not fit in its arena goes through a file.

The parent keeps, per stage, a queue of tasks and the stage's workers. `submit` encodes the item
(see `_transport`) in the caller's thread, then hands it to the least busy worker or queues it. A
worker holds up to two items: the one it runs and the next, already in its pipe, so it never waits
for the parent between items. One reader thread waits on every worker's pipe and exit (`_exits`)
at once, never for the rest of a reply (`_frames`) nor for a worker's exit; it decodes replies,
resolves futures, replaces dead or timed-out workers, those whose pipe ended while they ran and
those whose pipe carried a length no reply can have (re-running their items), reaps the ones it
gave up on as they exit, and feeds queued tasks to the workers it frees. Futures are always
resolved outside the runner's lock, so a done-callback may submit to any stage, or close the
runner, without deadlocking.

Closing the runner, and killing and reaping its workers, are `_process_close`'s: the runner's own
methods there (`ProcessRunnerClose`, a base of `ProcessRunner`), with the exit hook.
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import pickle
import selectors
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Self

from zephon._errors import ConfigurationError, check_count
from zephon._job_log import RankLog
from zephon._runner import Stage

from ._arena import Arena
from ._errors import RunnerFailedError, WorkerCrashedError
from ._exits import ExitWatch, reap_the_left
from ._frames import Replies
from ._lifecycle import (
    cancel_and_notify,
    cancelled_future,
    check_close_timeout,
    check_owner,
    check_startable,
    check_task_timeout,
    end_on_runner_thread,
    stage_at,
    validate_stages,
)
from ._buffer_directory import make_buffer_directory
from ._process_close import (
    LONGEST_WAIT_S,
    REAP_WAIT_S,
    WORKER_PROCESSES,
    CloseClock,
    Dying,
    ProcessRunnerClose,
    close_at_exit,
)
from ._transport import Envelope, decode, discard, encode, shm_full_warning
from ._worker import serve

__all__ = ["ProcessRunner", "TransportStats"]

_log = RankLog(logging.getLogger(__name__))  # its lines are this rank's own events

# (future, ok, value): a resolution decided under the lock and applied after releasing it (a
# future its caller cancelled ends cancelled, whatever the rest says).
_Resolution = tuple[Future, bool, Any]

# Items a worker holds at once. With one, a worker idles from its reply until the parent's reader
# thread has handled it and sent the next item; under the GIL that thread waits for the loader
# thread's switch interval (5 ms) against items of a few ms (text race recipe on 3.11, p=2: each
# worker busy 0.85 of the time). The second item waits in the worker's pipe instead.
_ITEMS_PER_WORKER = 2

# A second item goes to a busy worker only if its message fits in the pipe's buffer with room to
# spare (a Unix socket pair: ~208 KiB per direction on Linux); a larger one would block the sender until the worker
# finishes its current item. Large buffers travel through the arenas (or files when they do not fit),
# so messages are rarely bigger.
_PIPELINED_MESSAGE_MAX = 32 * 1024

# The number `_decode_reply` gives a reply it lacked the memory to unpickle, whose own number it
# could not read: taken for the worker's answer to the item it is due. A MemoryError comes of a
# reply too large for the parent's memory now, which only the worker writes (the message is
# already read whole); another writer's bytes fail to unpickle long before.
_DUE = object()

# How long a worker whose pipe has ended is given to exit before it is taken for one still running
# (a stage function that closed its pipe) and killed. A dying process releases its pipe just before
# its exit is told: of 2,000 children exiting on two loaded cores, 528 showed the end of their pipe
# first, by at most 4 ms; without this time their crash was reported as a closed pipe. The reader
# reads the other workers meanwhile (`_await_exit`): it waited here instead, 1 s per such worker,
# so 16 at once held every other reply and a close for 16 s.
_EXIT_AFTER_PIPE_END_S = 1.0

# How often the reader asks waitpid whether a busy worker watched by its sentinel alone (no pidfd:
# a kernel before 5.3, a seccomp profile refusing pidfd_open) has exited. A child its stage
# function forked holds that sentinel open, and the worker's pipe too: a worker that died there,
# partway through a reply or before writing any, left its item waiting until `task_timeout_s`,
# for ever without one.
_EXIT_POLL_S = 0.1


@dataclass(frozen=True)
class TransportStats:
    """Bytes moved and faults handled by one ProcessRunner, counted in the parent (both directions).

    `pipe_bytes` is the payload of every pipe message (pickle streams plus buffer layouts, without
    the length prefixes that frame them); `shm_bytes` is what went through shared memory: buffer
    files and arenas.
    A healthy array pipeline shows the arrays' size under `shm_bytes` and only a few hundred bytes
    per item under `pipe_bytes`. `items_sent` counts dispatches, re-runs included.
    `shm_full_bytes` counts the buffers that crossed in the pipe because the buffer directory's
    filesystem had no room for their file (a container's small /dev/shm), which a WARNING names
    once per runner; they are in `pipe_bytes` too.
    """

    items_sent: int
    pipe_bytes: int
    shm_bytes: int
    retries: int
    workers_replaced: int
    shm_full_bytes: int = 0


@dataclass(eq=False)
class _Task:
    future: Future
    item: Any  # kept so that a crashed worker's item can be encoded again
    envelope: Envelope | None  # None when it must be encoded again (its buffer file or block may be gone)
    attempts: int = 0


@dataclass(eq=False)
class _Worker:
    stage: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    replies: Replies  # what has arrived on conn, read without waiting for the rest of a reply
    exit: ExitWatch
    arena: Arena | None  # where its replies' large buffers wait; None when disabled
    # Offsets of the request-arena blocks of items sent to it that it has not released yet.
    request_blocks: set[int] = field(default_factory=set)
    # Sent and not answered, oldest first; replies come in the same order. tasks[0] is running.
    tasks: deque[_Task] = field(default_factory=deque)
    answered: int = 0  # items it has answered: its next reply must carry this and 1 (`_worker`)
    deadline: float | None = None  # for tasks[0]; once its pipe ended, for its exit
    broken: bool = False  # a send failed, or its pipe ended: no item goes to it; the reader retires it
    pipe_ended: bool = False  # before its exit was seen: retired at `deadline` unless it exits first
    abandoned: bool = False  # killed by us after an interrupted send; its items are not to blame
    grace_s: float = REAP_WAIT_S  # once the reader killed it: how long its reaping may take


class ProcessRunner(ProcessRunnerClose):
    """Runs each stage on `parallelism` worker processes forked eagerly in `start()`.

    Options (keyword-only, all optional):

    - `task_timeout_s`: a worker running one item for longer is killed and handled like a crash,
      at once: its exit is not waited for (one in uninterruptible sleep outlives SIGKILL), and one
      not reaped 2 s after the kill (and 1 s more per GiB it held) is reported, as `close()` does
      (`_process_close._give_up_on`), and reaped by the reader once it exits.
    - `max_retries`: how many times an item is re-run after its worker died or timed out; an item is
      attempted at most `1 + max_retries` times before its future fails with `WorkerCrashedError`.
    - `oob_threshold_bytes`: buffers at least this large go through shared memory, smaller ones
      inside the pickle stream. 16 KiB lets encoded images (`vlm` decoding after packing: 10-60 KB
      each, sent to the parent and back to a worker) skip the pipe: race VLM recipe, p=2, at 64 KiB
      the parent spent 0.14 ms of CPU per image and held them in its heap (PSS 160 MiB), at 16 KiB
      0.11 ms and 102 MiB. Text chunks' token arrays stay below it (text throughput unchanged).
    - `reply_arena_bytes`: the size of each worker's reply arena (`_arena`), the shared region its
      replies' large buffers are written into while the parent holds them; a reply that does not
      fit goes through a buffer file of its own. Costs up to this much shared memory per worker;
      0 sends every reply through files.
    - `request_arena_bytes`: the size of the request arena all workers share, the region the
      parent writes items' large buffers into until the worker that ran the item releases them;
      an item that does not fit goes through a buffer file. Costs up to this much shared memory;
      0 sends every item through files.
    - `shm_root`: where the per-runner buffer directory is created (default /dev/shm, else the
      temporary directory). Making it removes the directories there of runners whose processes
      all died (`_buffer_directory`).
    - `close_timeout_s`: how long `close()` waits for the reader thread, a submit in progress and
      the workers to end before killing the workers.

    Stage functions are inherited through fork and never pickled, so they may be closures or
    lambdas; items and results must be picklable. Large arrays arrive, in the worker and back in
    the parent, as views of shared memory: writable, and no other process reads or reuses that
    memory until the receiver has let go of them. An exception raised by the function, a
    `KeyboardInterrupt` or `SystemExit` too, is delivered as itself (with the worker's traceback as
    a note, where its `__notes__` can take one), or as a RuntimeError carrying it when it cannot be
    pickled; only a dying worker counts as a crash. So does a worker whose pipe ends while it
    still runs (its stage function closed the pipe's descriptor, or shut its socket down): not
    exited 1 s later, it is killed, as one past `task_timeout_s` is, and never waited for.

    `close()` cancels every future not yet resolved: queued items are dropped, idle workers are told
    to stop, busy ones are terminated (their results would be discarded anyway), stragglers are
    killed after `close_timeout_s` (a busy one with a warning naming its stage), and the
    shared-memory directory is removed. Every wait is bounded: close returns within
    `close_timeout_s` and 2 s (and 1 s per GiB the largest worker holds), reporting a worker that
    outlives SIGKILL. A runner never
    closed is closed at interpreter exit, and so is the rest of a close that was interrupted
    (Ctrl-C while it waits), unless a second `close()` finishes it first.

    Forking happens from a multi-threaded parent once the reader thread runs (to replace a worker),
    and possibly in `start()` if the caller has threads. This is safe here because the child never
    touches state guarded by the parent's other threads: it closes inherited pipe ends and runs
    `serve` only. The DeprecationWarning CPython 3.12+ emits for it is silenced around our own fork
    with one narrow rule; where `warnings.catch_warnings` is process-global (GIL builds), a filter
    another thread installs during that instant would be undone — forks are rare and brief.

    Thread-safety: `submit` may be called from any thread, including done-callbacks (which run on
    the reader thread); `start` belongs to the owner; `close` may be called from any thread,
    including a done-callback, and is idempotent.
    """

    name = "process"

    def __init__(
        self,
        *,
        task_timeout_s: float | None = None,
        max_retries: int = 3,
        oob_threshold_bytes: int = 16 * 1024,
        reply_arena_bytes: int = 64 * 1024 * 1024,
        request_arena_bytes: int = 64 * 1024 * 1024,
        shm_root: str | None = None,
        close_timeout_s: float = 2.0,
    ) -> None:
        # Types are checked too, not only ranges: a float size (64e6) passed and failed start() with
        # a bare TypeError from mmap, None or a string failed here with an unnamed one.
        task_timeout_s = check_task_timeout(task_timeout_s)
        max_retries = check_count(max_retries, "max_retries", 0)
        oob_threshold_bytes = check_count(oob_threshold_bytes, "oob_threshold_bytes", 1)
        reply_arena_bytes = check_count(reply_arena_bytes, "reply_arena_bytes", 0)
        request_arena_bytes = check_count(request_arena_bytes, "request_arena_bytes", 0)
        close_timeout_s = check_close_timeout(close_timeout_s)
        self.reason = "requested explicitly"
        self._task_timeout_s = task_timeout_s
        self._max_retries = max_retries
        self._threshold = oob_threshold_bytes
        self._arena_bytes = reply_arena_bytes
        self._request_arena_bytes = request_arena_bytes
        self._shm_root = shm_root
        self._close_timeout_s = close_timeout_s
        try:
            self._context = multiprocessing.get_context("fork")
        except ValueError as exc:
            raise ConfigurationError("the process runner needs the fork start method (POSIX)") from exc

        self._lock = threading.Lock()
        self._close_lock = threading.Lock()  # held by the one thread running close's steps
        self._stages: tuple[Stage, ...] | None = None
        self._closing = False
        self._failure: BaseException | None = None  # set if the reader thread itself broke
        self._directory: str | None = None
        self._directory_lock: int | None = None  # held until the directory is removed (`_buffer_directory`)
        self._requests: Arena | None = None  # the request arena, mapped in start() before any fork
        self._wake_r = self._wake_w = -1
        self._reader: threading.Thread | None = None
        self._at_exit: functools.partial | None = None  # registered with atexit while started
        self._close_clock: CloseClock | None = None  # the latest close's, read by the exit hook
        self._watch = _Watch()  # the reader thread's own
        self._workers: list[_Worker] = []
        self._dying: list[Dying] = []  # the reader's own, then close's once the reader has stopped
        # Killed workers reported at their `reap_by`, whose exit the reader watches without a
        # deadline; the reader's own, handed to `leave_unreaped` by close.
        self._given_up: list[Dying] = []
        self._queued: list[deque[_Task]] = []
        # Every future submitted and not yet resolved, wherever its task is (queued, sent, or its
        # reply in the reader's hands): what `_fail_everything` fails and `close` cancels, so that
        # no failure of the reader thread, wherever it strikes, leaves a future unresolved. Added
        # under the lock; whoever ends a future takes it out first (`_claim`, atomic), so exactly
        # one of the threads that may end it at once (the reader, a submitter, a closer) does.
        self._held: set[Future] = set()
        self._items_sent = self._pipe_bytes = self._shm_bytes = self._retries = self._replaced = 0
        self._shm_full_bytes = 0

    # -- public surface ---------------------------------------------------------------------------

    @property
    def shm_directory(self) -> str | None:
        """The directory holding buffer files in transit; None before `start()` and after `close()`."""
        return self._directory

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers, for monitoring and tests."""
        with self._lock:
            return [worker.process.pid for worker in self._workers]

    def stats(self) -> TransportStats:
        with self._lock:
            return TransportStats(
                self._items_sent, self._pipe_bytes, self._shm_bytes, self._retries, self._replaced,
                self._shm_full_bytes,
            )

    def start(self, stages: Sequence[Stage]) -> None:
        check_startable(self, self._stages is not None, self._closing)
        if multiprocessing.current_process().daemon:
            # multiprocessing refuses children to a daemonic process with a bare AssertionError from
            # deep inside it (and under `python -O` would fork them anyway): say where, and what to use.
            raise ConfigurationError(
                f"the process runner cannot start worker processes inside the daemonic process "
                f"{multiprocessing.current_process().name!r} (a torch DataLoader worker, say), where "
                "multiprocessing allows no children: use runner='thread' or runner='inline' there"
            )
        self._stages = validate_stages(stages)
        reap_the_left()
        self._pid = os.getpid()  # the process that started it, the only one its workers answer
        self._queued = [deque() for _ in self._stages]
        # A runner never closed is closed at interpreter exit, before multiprocessing's own exit
        # hook (registered earlier, so run later) terminates the workers under the reader thread.
        # The hook holds the runner until a close has finished: one whose close was interrupted,
        # or whose reader thread failed, may be dropped by its owner with its directory still there.
        self._at_exit = functools.partial(close_at_exit, self, os.getpid())
        atexit.register(self._at_exit)
        try:
            with self._lock:
                self._directory, self._directory_lock = make_buffer_directory(self._shm_root)
                if self._request_arena_bytes:
                    self._requests = Arena(self._request_arena_bytes)
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                os.set_blocking(self._wake_w, False)
                for index, stage in enumerate(self._stages):
                    for _ in range(stage.parallelism):
                        self._add_worker_locked(index)
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read_loop, name="zephon-process-reader", daemon=True)
        self._reader.start()

    def submit(self, stage_index: int, item: Any) -> Future:
        stage_at(self._stages, stage_index)
        check_owner(self._pid)
        if self._closing:
            return cancelled_future()
        future: Future = Future()
        try:
            envelope = encode(item, self._directory, self._threshold, self._requests)
        except Exception as exc:
            if self._closing:  # the directory went away under us
                return cancelled_future()
            future.set_exception(exc)
            return future
        resolutions: list[_Resolution] = []
        queued = False
        try:
            with self._lock:
                if self._closing:
                    return cancelled_future()
                if self._failure is not None:
                    error = RunnerFailedError("its reader thread stopped earlier on an unexpected error")
                    error.__cause__ = self._failure
                    self._held.add(future)
                    resolutions.append((future, False, error))
                else:
                    self._held.add(future)
                    self._queued[stage_index].append(_Task(future, item, envelope))
                    queued = True
                    self._dispatch_locked(stage_index, resolutions)
        finally:  # even when interrupted (Ctrl-C while waiting for the lock)
            if not queued:  # no worker will ever receive the envelope: its block or file goes back now
                self._discard(envelope)
            # What dispatching decided concerns other callers' items too.
            self._resolve(resolutions)
        return future

    def close(self) -> None:
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- workers ----------------------------------------------------------------------------------

    def _add_worker_locked(self, stage_index: int) -> None:
        stage = self._stages[stage_index]
        arena = Arena(self._arena_bytes) if self._arena_bytes else None
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        inherited = [worker.conn for worker in self._workers] + [parent_conn]
        process = self._context.Process(
            target=serve,
            args=(child_conn, stage.fn, stage.name, self._directory, self._threshold, arena, self._requests, inherited),
            name=f"zephon-{stage.name}",
            daemon=True,
        )
        try:
            with _fork_warning_silenced():
                process.start()
        except OSError as error:  # the fork itself refused: a bare "Resource temporarily unavailable" said no more
            parent_conn.close()
            raise type(error)(error.errno, _fork_refused(stage.name, error)) from error
        except BaseException:
            parent_conn.close()
            raise
        finally:
            child_conn.close()
        WORKER_PROCESSES.add(process)
        self._workers.append(
            _Worker(stage_index, process, parent_conn, Replies(parent_conn.fileno()), ExitWatch(process), arena)
        )

    def _retire_locked(self, worker: _Worker, cause: str, resolutions: list[_Resolution]) -> None:
        """Reap a dead worker (one the reader killed just now, `_kill_to_retire`, is reaped later,
        by `_reap_dying`), re-queue or fail its items, and fork its replacement.

        Only the item it was running counts an attempt (none does for a worker abandoned after an
        interrupted send); the one waiting in its pipe goes back to the queue as it was. The
        request blocks it had not released are free again: nothing holds them now, and its items
        are encoded again if they are re-run.

        Every death is logged, naming the stage, the pid and how it ended: with its item re-run or
        given up on, or, for a worker holding no item, as that. One that died between items (the
        OOM killer, `kill -9`) was replaced without a word, unseen by whoever watched the job.
        """
        self._workers.remove(worker)
        worker.conn.close()
        stage = self._stages[worker.stage]
        if not worker.exit.exited():  # killed by the reader just now: reaped later
            self._dying.append(
                Dying(worker.exit, stage.name, worker.grace_s, time.monotonic() + worker.grace_s,
                       set(worker.request_blocks))
            )
        else:
            worker.exit.close()
            if worker.request_blocks:
                self._requests.give_back(worker.request_blocks)
        worker.request_blocks.clear()
        running = 0 if worker.abandoned else 1  # how many of its tasks count an attempt
        if worker.abandoned:
            _log.warning("stage %r: worker %s after a send to it was interrupted; re-running its items",
                         stage.name, cause)
        for waiting in reversed(list(worker.tasks)[running:]):
            self._forget_envelope(waiting)
            waiting.attempts -= 1
            self._queued[worker.stage].appendleft(waiting)
        if not (worker.tasks or worker.abandoned):  # else told above, or below with its item
            _log.warning("stage %r: worker %s; it held no item, replacing it", stage.name, cause)
        if worker.tasks and running:
            task = worker.tasks[0]
            self._forget_envelope(task)
            if task.attempts > self._max_retries:
                _log.error("stage %r: worker %s; giving up after %d attempts", stage.name, cause, task.attempts)
                resolutions.append((task.future, False, WorkerCrashedError(stage.name, task.attempts, cause)))
            else:
                _log.warning("stage %r: worker %s; re-running its item (attempt %d)", stage.name, cause, task.attempts + 1)
                self._retries += 1
                self._queued[worker.stage].appendleft(task)
        if self._closing:
            return
        try:
            self._add_worker_locked(worker.stage)
        except OSError as exc:
            _log.error("stage %r: could not fork a replacement worker: %s", stage.name, exc)
        else:
            self._replaced += 1

    @staticmethod
    def _forget_envelope(task: _Task) -> None:
        """The item went to a worker that is gone, which may have consumed its buffer file: encode
        it again if it is re-run. (A request block it was sent in is given back with the worker's.)"""
        if task.envelope is not None:
            discard(task.envelope)
            task.envelope = None

    def _discard(self, envelope: Envelope | None) -> None:
        """Free what holds the buffers of an envelope that no worker will ever receive. The request
        arena is read once: a close ending on another thread drops it, a submit's item included."""
        requests = self._requests
        if envelope is not None and envelope.block is not None and requests is not None:
            requests.give_back((envelope.block[0],))
        discard(envelope)

    def _dispatch_locked(self, stage_index: int, resolutions: list[_Resolution]) -> None:
        """Give queued tasks of a stage to its least busy workers; fail them if the stage has no workers."""
        queue = self._queued[stage_index]
        workers = [worker for worker in self._workers if worker.stage == stage_index]
        if not workers:
            name = self._stages[stage_index].name
            while queue:
                task = queue.popleft()
                resolutions.append(
                    (task.future, False, WorkerCrashedError(name, task.attempts, "could not be replaced (fork failed)"))
                )
            return
        while queue:
            worker = min((w for w in workers if not w.broken), key=lambda w: len(w.tasks), default=None)
            if worker is None or len(worker.tasks) >= _ITEMS_PER_WORKER:
                return
            task = queue[0]  # it leaves the queue only when recorded as sent, failed or dropped
            if task.future.cancelled():  # by its caller: its waiters are told outside the lock
                queue.popleft()
                resolutions.append((task.future, False, None))
                self._discard(task.envelope)
                continue
            if task.envelope is None:
                try:
                    task.envelope = encode(task.item, self._directory, self._threshold, self._requests)
                except Exception as exc:  # it encoded once; a second failure is environmental
                    queue.popleft()
                    resolutions.append((task.future, False, exc))
                    continue
            try:
                if not self._send_locked(worker, queue, task):
                    return
            except BaseException:
                # Interrupted (Ctrl-C in the thread that submits) between taking the worker's
                # released reply blocks and the end of the send: the pipe may hold none, part or
                # all of the message, so this worker's replies can no longer be paired with its
                # tasks. It is killed; the reader re-runs its tasks on a replacement.
                self._abandon_locked(worker)
                raise

    def _send_locked(self, worker: _Worker, queue: deque[_Task], task: _Task) -> bool:
        """Send queue[0] to the worker; False if the message must wait for an idle worker.

        The task is recorded as the worker's before the first byte goes out: a reply answers the
        oldest recorded task, so the recorded tasks must be exactly the messages the worker got, and
        a send that does not complete abandons the worker (see `_dispatch_locked`). An `OSError`
        means the worker is gone: the task goes back to the queue for another one.
        """
        released = worker.arena.released() if worker.arena is not None else ()
        message = pickle.dumps((task.envelope, released), protocol=5)
        if worker.tasks and len(message) > _PIPELINED_MESSAGE_MAX:
            if released:
                worker.arena.requeue(released)  # they go with the next item sent to it
            return False  # no worker is idle; wait for one
        worker.tasks.append(queue.popleft())
        task.attempts += 1
        if task.envelope.block is not None:  # the worker's from now on (given back if it dies)
            worker.request_blocks.add(task.envelope.block[0])
        try:
            worker.conn.send_bytes(message)
        except OSError:
            worker.broken = True
            queue.appendleft(worker.tasks.pop())
            task.attempts -= 1
            self._forget_envelope(task)
            return True
        self._items_sent += 1
        self._pipe_bytes += len(message)
        self._shm_bytes += task.envelope.shm_bytes
        self._count_shm_full_locked(task.envelope.shm_full_bytes)
        if len(worker.tasks) == 1 and self._task_timeout_s is not None:
            worker.deadline = time.monotonic() + self._task_timeout_s
        # The reader watches its deadline, or polls its exit (no pidfd), from now on: woken for it
        # unless this is the reader, which looks again before it next waits (it woke itself for
        # nearly one item in two, a write and a turn of its loop for nothing).
        watched = self._task_timeout_s is not None or worker.exit.sentinel_only
        if len(worker.tasks) == 1 and watched and threading.current_thread() is not self._reader:
            self._wake()
        return True

    def _abandon_locked(self, worker: _Worker) -> None:
        """Kill a worker whose pipe is in an unknown state; the reader retires it as usual, re-running
        every task recorded as its own without counting an attempt (the items did nothing wrong)."""
        worker.broken = worker.abandoned = True
        worker.process.kill()

    # -- the reader thread ------------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while not self._closing:
                self._read_once()
        except BaseException as exc:
            _log.exception("process runner reader thread failed; failing every pending item")
            self._fail_everything(exc)
        finally:
            self._watch.close()

    def _read_once(self) -> None:
        if self._dying:
            self._reap_dying(until=time.monotonic())
        with self._lock:
            workers = list(self._workers)
            deadlines = [worker.deadline for worker in workers if worker.deadline is not None]
            polled = [worker for worker in workers if worker.exit.sentinel_only and worker.tasks]
        if polled:
            deadlines.append(time.monotonic() + _EXIT_POLL_S)
        if self._dying:
            deadlines += [dying.reap_by for dying in self._dying]
        timeout = min(LONGEST_WAIT_S, max(0.0, min(deadlines) - time.monotonic())) if deadlines else None
        by_conn = {worker.conn: worker for worker in workers}
        ready = self._watch.wait(workers, self._given_up, self._wake_r, timeout)
        if self._closing:
            return
        if self._wake_r in ready:
            _drain(self._wake_r)
        if self._given_up:
            self._reap_given_up(ready)

        replies: dict[_Worker, list[bytes]] = {}
        dead: dict[_Worker, str] = {}  # worker -> what happened to it
        for conn, worker in by_conn.items():
            # Its exit retires it, whoever else still holds its pipe (or its sentinel: `polled`).
            if worker.exit.fd in ready or (worker in polled and worker.exit.exited()):
                if messages := worker.replies.read_left():  # what it wrote before it died
                    replies[worker] = messages
                worker.process.join()
                dead[worker] = _describe_exit(worker.process)
                if (partial := worker.replies.partial()) is not None:
                    dead[worker] += f" while sending a reply, {partial}"
                continue
            if conn not in ready:
                continue
            try:
                messages = worker.replies.read()
            except (EOFError, OSError):
                self._await_exit(worker)
                continue
            if messages:
                replies[worker] = messages
            if worker.replies.overlong is not None:
                dead[worker] = self._kill_for_an_overlong_length(worker)
        now = time.monotonic()
        for worker in workers:
            expired = worker.deadline is not None and worker.deadline <= now
            if expired and worker not in replies and worker not in dead:
                pid = self._kill_to_retire(worker)
                if worker.pipe_ended:  # its stage function closed the pipe, say
                    dead[worker] = f"(pid {pid}) was killed: its pipe closed while it was still running"
                else:
                    dead[worker] = f"(pid {pid}) exceeded task_timeout_s={self._task_timeout_s} and was killed"

        decoded = [
            (worker, *self._decode_reply(worker, message)) for worker, messages in replies.items() for message in messages
        ]
        resolutions: list[_Resolution] = []
        untrusted: set[_Worker] = set()  # whose pipe brought a reply not of their making
        with self._lock:
            for worker, number, ok, value, released, pipe_bytes, shm_bytes, shm_full_bytes in decoded:
                self._pipe_bytes += pipe_bytes
                self._shm_bytes += shm_bytes
                self._count_shm_full_locked(shm_full_bytes)
                if worker in untrusted:
                    continue
                if not worker.tasks:
                    if worker not in dead:
                        dead[worker] = self._kill_for_a_reply_not_its_own(worker, "a reply to no item it holds")
                    continue
                if number != worker.answered + 1:
                    if number is not _DUE:
                        untrusted.add(worker)
                        if worker not in dead:
                            dead[worker] = self._kill_for_a_reply_not_its_own(
                                worker, "a reply that is not the answer its item is due"
                            )
                        continue
                    number = worker.answered + 1
                worker.answered = number
                if released:
                    worker.request_blocks.difference_update(released)
                    self._requests.give_back(released)
                resolutions.append((worker.tasks.popleft().future, ok, value))
                running = worker.tasks and self._task_timeout_s is not None
                worker.deadline = now + self._task_timeout_s if running else None
            for worker, cause in dead.items():
                self._retire_locked(worker, cause, resolutions)
            for index in range(len(self._stages)):
                self._dispatch_locked(index, resolutions)
        self._resolve(resolutions)

    def _await_exit(self, worker: _Worker) -> None:
        """Give a worker whose pipe ended before its exit was seen `_EXIT_AFTER_PIPE_END_S` to
        exit, without waiting for it here: one dying has its exit told just after, and that exit
        gives the cause; one still running then is killed at its `deadline`. No item goes to it,
        and its pipe is no longer watched: its end of file would wake the reader at once, for ever."""
        with self._lock:  # `_send_locked` sets deadlines too
            worker.broken = worker.pipe_ended = True
            worker.deadline = time.monotonic() + _EXIT_AFTER_PIPE_END_S
        self._watch.close()

    def _kill_for_a_reply_not_its_own(self, worker: _Worker, what: str) -> str:
        """Kill a worker whose pipe brought `what`: a reply to no item it holds, or, while it held
        items, one that is not the answer its oldest item is due (not numbered as that item, or no
        reply at all); in either case a process its stage function forked writing to its pipe, say.
        Return the cause to retire it with. Its pipe can no longer be trusted to pair replies with
        items: a stray reply failed the reader thread, and with it every item of the runner; a
        misnumbered one answered the item in the worker's place, and the worker's own answered the
        next item or none. Neither that reply nor any after it is taken, and its items are re-run.
        The blocks such a reply says were released stay taken until the worker is reaped: it may
        not be the one that held them. Retiring it logs the cause, once, as for any worker that
        dies: logged here too, a busy one's death was told twice in the same words."""
        pid = self._kill_to_retire(worker)
        return f"(pid {pid}) sent {what} (a process its stage function forked writing to its pipe?) and was killed"

    def _kill_for_an_overlong_length(self, worker: _Worker) -> str:
        """Kill a worker whose pipe carried a length no reply can have (`Replies.overlong`), and
        the cause to retire it with: its stage function wrote to the reply descriptor, so nothing
        after that point of the pipe can be told apart into replies. The reader waited for that
        many bytes, the worker's every later reply behind them, until `task_timeout_s`. Retiring
        it logs the cause, as for any worker that dies, busy or holding no item (a thread of its
        stage function writing after the item was answered)."""
        pid = self._kill_to_retire(worker)
        return (f"(pid {pid}) was killed: its reply pipe carried a length of {worker.replies.overlong} bytes, "
                "more than a reply can be: something in the worker wrote to its descriptor")

    def _decode_reply(
        self, worker: _Worker, message: bytes
    ) -> tuple[int | object | None, bool, Any, tuple[int, ...], int, int, int]:
        """(number, ok, value, request blocks the worker released, pipe bytes, shm bytes, bytes
        that crossed in the pipe for a full shm directory) of one reply; a reply whose value cannot
        be decoded fails its item. The number is None for a
        message that is no reply at all (the worker's loop pickles every one it writes): another
        process wrote it, which the reader retires the worker for, as for a wrong number. It is
        `_DUE` for one the parent lacked the memory to unpickle (a large reply pickled in-band,
        under an address-space limit): that fails the item it is due, as it did before replies
        were numbered; taken for no reply, it had the healthy worker killed and the item re-run."""
        try:
            ok, envelope, released, number = pickle.loads(message)
        except MemoryError as exc:
            return _DUE, False, self._undecodable(worker, exc), (), len(message), 0, 0
        except Exception:  # noqa: BLE001 - whatever it was, the worker did not write it
            return None, False, None, (), len(message), 0, 0
        try:
            sizes = len(message), envelope.shm_bytes, envelope.shm_full_bytes
            return number, ok, decode(envelope, worker.arena), released, *sizes
        except Exception as exc:
            return number, False, self._undecodable(worker, exc), released, len(message), 0, 0

    def _count_shm_full_locked(self, nbytes: int) -> None:
        """Count `nbytes` that crossed in the pipe because the buffer directory's filesystem was
        full (`_transport`), warning the first time: every such item still runs, slower, and the
        operator can give the job the shared memory it lacks."""
        if not nbytes:
            return
        if not self._shm_full_bytes:
            _log.warning(shm_full_warning(self._directory))
        self._shm_full_bytes += nbytes

    def _undecodable(self, worker: _Worker, exc: Exception) -> RuntimeError:
        """The error a reply of `worker` that could not be unpickled fails its item with."""
        stage = self._stages[worker.stage].name
        error = RuntimeError(f"stage {stage!r}: could not unpickle the worker's reply: {exc!r}")
        error.__cause__ = exc
        return error

    def _fail_everything(self, exc: BaseException) -> None:
        """The reader thread stopped on `exc`: fail every held future and every later submission.

        The held set, not the queues, says what to fail: the reader may have stopped with tasks
        taken off a queue or a worker and not yet resolved."""
        with self._lock:
            self._failure = exc
            held = list(self._held)
            for queue in self._queued:
                queue.clear()
            for worker in self._workers:
                worker.tasks.clear()
        resolutions: list[_Resolution] = []
        for future in held:
            error = RunnerFailedError()
            error.__cause__ = exc
            resolutions.append((future, False, error))
        self._resolve(resolutions)

    def _resolve(self, resolutions: list[_Resolution]) -> None:
        """End each future as decided, outside the lock (its done-callbacks may submit or close).
        On the reader thread a done-callback raising a BaseException is logged and the rest are
        still ended (`end_on_runner_thread`): it ended the reader, and every later reply went unread."""
        on_reader = threading.current_thread() is self._reader
        for future, ok, value in resolutions:
            if not self._claim(future):
                continue  # ended already: cancelled by a close, or failed with the reader thread
            if on_reader:
                end_on_runner_thread(_log, self._end, future, ok, value)
            else:
                self._end(future, ok, value)

    def _end(self, future: Future, ok: bool, value: Any) -> None:
        """End a claimed future as decided; cancelled instead once closing, or if its caller
        cancelled it, its waiters told."""
        if self._closing or future.cancelled():
            cancel_and_notify(future)
            return
        try:
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        except InvalidStateError:  # its caller cancelled it just now
            cancel_and_notify(future)

    def _claim(self, future: Future) -> bool:
        """Take `future` out of the held set: True for the one caller that did, which alone may
        end it (`cancel_and_notify` must not tell its waiters twice)."""
        try:
            self._held.remove(future)
        except KeyError:
            return False
        return True

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # already full of wake-ups, or closing
            pass


class _Watch:
    """Waits on every worker's pipe and exit (`ExitWatch.fd`), the exits of the workers given up
    on (`_given_up`) and the wake-up pipe at once.

    One selector keeps its registrations while the worker set stays the same, instead of
    `multiprocessing.connection.wait` building and filling a new one on every call: the reader
    wakes once or twice per item. Parent CPU per item in `benchmarks/test_transport_bench.py`
    (3.11, medians of 6 alternating runs): 131 µs with `wait`, 113 with this (90 with the array
    pickling of `_transport` as well). A changed worker set (a worker replaced, one given up on
    reaped) gets a fresh selector, so a closed pipe's or pidfd's descriptor number, reused by a
    replacement, is never registered twice. So does a worker whose pipe has ended (`close()` once
    it has), which is watched by its exit only.
    """

    def __init__(self) -> None:
        self._selector: selectors.BaseSelector | None = None
        self._workers: tuple[_Worker, ...] = ()
        self._given_up: tuple[Dying, ...] = ()

    def wait(self, workers: list[_Worker], given_up: list[Dying], wake_fd: int, timeout: float | None) -> set[Any]:
        """The ready objects among the workers' connections (but those whose pipe has ended) and
        exit descriptors, the exit descriptors of the workers given up on, and `wake_fd`."""
        if self._selector is None or tuple(workers) != self._workers or tuple(given_up) != self._given_up:
            self.close()
            self._selector = selectors.DefaultSelector()
            self._workers, self._given_up = tuple(workers), tuple(given_up)
            exits = (*(w.exit.fd for w in workers), *(d.exit.fd for d in given_up))
            pipes = (w.conn for w in workers if not w.pipe_ended)
            for watched in (wake_fd, *pipes, *exits):
                self._selector.register(watched, selectors.EVENT_READ, watched)
        return {key.data for key, _ in self._selector.select(timeout)}

    def close(self) -> None:
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        self._workers = self._given_up = ()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _fork_refused(stage: str, error: OSError) -> str:
    """What the system's refusal of a worker process (EAGAIN at a process limit, ENOMEM) means and
    what to do, in place of its bare strerror."""
    return (
        f"stage {stage!r}: the system refused a worker process ({error.strerror}): at a limit of processes "
        "(a container's pids.max or ulimit -u, where every thread of the trainer counts too) or of memory; raise "
        "the limit, give the stage fewer workers (parallelism), or run it on runner='thread'"
    )


def _describe_exit(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"(pid {process.pid}) was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"(pid {process.pid}) was killed by signal {-code}"
    return f"(pid {process.pid}) exited with code {code}"


@contextmanager
def _fork_warning_silenced() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks",
            category=DeprecationWarning,
        )
        yield
