"""How a chunk travels a runner's stages, and a row's work with it.

The loader's stateless operators run as stages of its runner: adjacent ones of the same
parallelism fused into one (`fuse_stages`), the first stage reading its chunk from the dataset
(`ChunkReader`). Each chunk is chained through the stages by done-callbacks (`submit_chain`,
whose result is the last stage's), and a packer's row work (images decoded after packing) goes to
the workers of one stage beside its chunks (`AlsoRowWork`, `RowWork`, `apply_row_work`). Nothing
here holds the loader, its locks or its state: a chain ends its future, and the loader waits for it.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future, InvalidStateError

from ._job_log import RankLog
from ._records import Chunk, ChunkRecords
from ._runner import Runner

__all__ = [
    "AlsoRowWork", "ChunkReader", "FusedStage", "RowWork", "apply_row_work", "compose", "fuse_stages", "submit_chain",
]

_events = RankLog(logging.getLogger("zephon"))  # a note that could not be added is this rank's event


class FusedStage:
    """One stage of the runner: the stateless operators fused into it (`fns`, run in order), named
    after them, and how many workers run it."""

    def __init__(self, name: str, parallelism: int) -> None:
        self.name, self.parallelism, self.fns = name, parallelism, []


def fuse_stages(record_fns, read_parallelism: int | None) -> list[FusedStage]:
    """Adjacent stateless operators with the same parallelism run as one stage: composing pure
    functions changes nothing in the output and saves a hand-off per chunk."""
    first = record_fns[0][0].parallelism if record_fns else 1
    stages = [FusedStage("read", read_parallelism or first)]
    for op, fn in record_fns:
        if op.parallelism != stages[-1].parallelism:
            stages.append(FusedStage(op.name, op.parallelism))
        else:
            stages[-1].name += f"+{op.name}"
        stages[-1].fns.append(fn)
    return stages


def compose(read, fns):
    """A stage's function: the chunk's read (`read`, the first stage's; else None), then each fused
    operator's function in turn."""

    def run(item):
        if read is not None:
            item = read(item)
        for fn in fns:
            item = fn(item)
        return item

    return run


class RowWork:
    """A row work order sent to the stage that also runs the packer's row work (`AlsoRowWork`)."""

    __slots__ = ("order",)

    def __init__(self, order) -> None:
        self.order = order


class ChunkReader:
    """The first stage's read: a chunk's records from its dataset, under the pipeline's policy."""

    __slots__ = ("datasets", "on_error")

    def __init__(self, datasets: dict, on_error: str) -> None:
        self.datasets, self.on_error = datasets, on_error

    def __call__(self, chunk: Chunk) -> ChunkRecords:
        return self.datasets[chunk.dataset].read_chunk(chunk, on_error=self.on_error)

    def describe(self, chunk: Chunk) -> str:
        """Where a chunk's records are, for an error that does not say (a worker that crashed)."""
        shards = getattr(self.datasets[chunk.dataset], "shards", None)
        url = f" ({shards[chunk.shard].url})" if shards is not None else ""
        return f"while the loader ran {chunk}{url} through its stateless stages"


class AlsoRowWork:
    """A stage function that also runs the packer's row work on `RowWork` items."""

    __slots__ = ("stage_fn", "run")

    def __init__(self, stage_fn, run) -> None:
        self.stage_fn, self.run = stage_fn, run

    def __call__(self, item):
        return self.run(item.order) if isinstance(item, RowWork) else self.stage_fn(item)


def apply_row_work(work, row, done: Future, future: Future) -> None:
    """Settles `done` with the row and its row work's result (on the thread that finished it).

    What the work raised is taken with `exception()`, not re-raised by `result()`: a SystemExit or
    KeyboardInterrupt from it (delivered as itself by the thread and process runners) would escape
    this done-callback, which concurrent.futures lets through, ending the pool thread or the
    process runner's reader thread and leaving `done` pending, the loader waiting for it forever."""
    if future.cancelled():
        done.cancel()
        return
    if (error := future.exception()) is not None:
        # What failed on the runner (a worker that crashed for good: a decoder segfaulting on one
        # image) knows only its stage: the row's records are named, as a chunk's shard is.
        try:
            error.add_note(
                "while the loader ran the row work of a row of the records "
                + ", ".join(map(str, getattr(row, "sources", ())))
            )
        except Exception:  # noqa: BLE001 - the row's own error matters more than the note
            _events.exception("could not note which row %r failed", error)
        _settle(done.set_exception, error)
        return
    try:
        finished = work.apply(row, future.result())
    except Exception as exc:  # noqa: BLE001 - the work or its apply failed: the loader raises it at take
        _settle(done.set_exception, exc)
    else:
        _settle(done.set_result, finished)


def submit_chain(runner: Runner, num_stages: int, item, describe) -> Future:
    """Run an item through every stage in turn; the returned future resolves with the last result.
    An exception from any stage, or from submitting to one, fails it with the note `describe(item)`,
    naming the item where the error itself may not (a WorkerCrashedError knows only the stage).

    Cancelling the returned future (a loader closing with work in flight) stops the chain at the
    next hand-off.
    """
    chain = _Chain(runner, num_stages, item, describe)
    chain.advance(0, item)
    return chain.done


class _Chain:
    """One item's way through the stages.

    A class, not nested closures: a closure that calls itself is a reference cycle, and a cycle
    that reaches `done` keeps the chunk's records (token arrays, decoded pixels) alive until the
    cyclic garbage collector happens to run. On 3.14t that let ~450 finished chunks pile up
    (text race recipe: 7,201 records, 25 MB of live objects, RSS 76 -> 128 MiB over 16 M tokens).
    Here the runner's future holds the callback, the callback the chain, the chain `done`; once the
    loader drops `done`, plain reference counting frees it all.

    Every stage after the first is submitted from the previous stage's done-callback, on whichever
    thread ended that future, which must then hold no lock `submit` (or a `close()` the callback
    may cause) takes. The runners keep that: the inline runner takes no lock and ends its future
    inside `submit`, before a callback is added (one added then runs at once, on the adding
    thread); the thread runner's `submit` takes none of its own (its queue's is internal to
    `SimpleQueue`), and its stage threads, its `task_timeout_s` watch and `close()` end futures
    holding no lock. The process runner's `submit` takes its `_lock` (and the request arena's
    lock, briefly, never around a callback); whoever decides under `_lock` how a future ends (the
    reader thread with a reply, a worker given up on or its own failure; a submitting thread
    dispatching) ends it only after releasing `_lock`. Its `close()` ends the held futures under
    `_close_lock` only, which `submit` never takes and a `close()` from a callback only tries.
    The loader's own locks are never taken here nor in `apply_row_work`. Pinned, for each way each
    runner ends a future, by `tests/unit/test_runner_futures.py::test_whichever_way_a_*`.
    """

    __slots__ = ("runner", "num_stages", "item", "describe", "done")

    def __init__(self, runner: Runner, num_stages: int, item, describe) -> None:
        self.runner = runner
        self.num_stages = num_stages
        self.item, self.describe = item, describe  # the first stage's item (a Chunk: small)
        self.done: Future = Future()

    def advance(self, stage: int, value) -> None:
        if stage == self.num_stages:
            _settle(self.done.set_result, value)
            return
        if self.done.cancelled():
            return
        # Every stage after the first is submitted from a done-callback, where concurrent.futures
        # logs an exception and drops it: a submit that raises (a runner's misuse check, an
        # unexpected fault in its dispatch, MemoryError) would leave `done` pending and the loader
        # waiting for it forever. The item fails with it instead, like a stage that raised.
        try:
            future = self.runner.submit(stage, value)
        except Exception as exc:  # noqa: BLE001 - raised at take, with the item named
            self._fail(exc)
            return
        future.add_done_callback(functools.partial(self._on_stage_done, stage))

    def _on_stage_done(self, stage: int, future: Future) -> None:
        if future.cancelled():
            self.done.cancel()
        elif (error := future.exception()) is not None:
            self._fail(error)
        else:
            self.advance(stage + 1, future.result())

    def _fail(self, error: BaseException) -> None:
        """Fail `done` with `error`, noted with the item; even if the note cannot be added (an
        exception whose `__notes__` is not a list), since this too runs in a done-callback."""
        try:
            error.add_note(self.describe(self.item))
        except Exception:  # noqa: BLE001 - the item's own error matters more than the note
            _events.exception("could not note which item %r failed", error)
        _settle(self.done.set_exception, error)


def _settle(setter, value) -> None:
    """Resolve a future the loader may have cancelled meanwhile (then the value is dropped)."""
    try:
        setter(value)
    except InvalidStateError:
        pass
