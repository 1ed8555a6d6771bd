"""The driver of one lane: ordered dispatch of its chunks, in-order accumulation of the results.

Chunks are submitted to the runner ahead of need (numbered by their position in the lane), and
their results are consumed strictly in that order, whatever order workers finish in. Every
stateful decision happens here, on the loader's thread, which is what makes parallelism a pure
performance knob. When the packer has stateless work left to do on its rows (decoding images it
packed encoded), that work too is put on the runner a few rows ahead of the loader.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any, Callable, Iterator

from ._accumulator import AccumulatorFactory, SegmentContext
from ._barren import barren_error
from ._errors import ConfigurationError
from ._records import Chunk, ChunkRecords
from ._sequence import PackedSequence
from .work import Flush

__all__ = ["LaneStream"]


class LaneStream:
    """Yields (segment, row) for one lane, starting at the beginning of `start_segment`.

    Thread-unsafe: owned and driven by one rank loader; only `close` may come from another thread
    (a watchdog closing the loader), and the owner's next call then raises ConfigurationError.
    """

    def __init__(
        self,
        lane: int,
        items: Iterator[Chunk | Flush],
        start_segment: int,
        submit: Callable[[Chunk], Future],
        factories: list[AccumulatorFactory],
        prefetch: int,
        on_chunk: Callable[[int, int, ChunkRecords], None],
        on_skips: Callable[[int, int, list], None],
        on_truncations: Callable[[int, int, list], None] | None = None,
        row_work: Callable[[Any], Future] | None = None,
        rows_ahead: int = 1,
        barren_records: int | None = None,
        finite: bool = False,
    ) -> None:
        self.lane = lane
        self._items = items
        self._segment = start_segment
        self._submit = submit
        self._factories = factories
        self._prefetch = prefetch
        self._on_chunk = on_chunk
        self._on_skips = on_skips
        self._on_truncations = on_truncations
        self._row_work = row_work
        self._rows_ahead = rows_ahead
        # An endless plan whose every record is dropped would be read forever without a row:
        # after `barren_records` records in a row with none handed over, the lane says so instead.
        self._barren_records = barren_records
        self._read_without_rows = 0
        self._drops_without_rows: Counter[str] = Counter()
        # A finite plan's lane looks one row ahead, so that it knows it is finished with its last
        # row (see `next`); an endless plan's lane never finishes and waits for nothing early.
        self._finite = finite
        self._pending: deque[Future | Flush] = deque()
        self._in_flight = 0
        self._flushes_queued = 0
        self._plan_done = False
        self._rows = self._generate()
        # Rows pulled from the accumulators and not yet taken, oldest first: one look-ahead row,
        # or with row work up to `rows_ahead` rows whose work (a Future) is already on the runner.
        self._ahead: deque[tuple[int, Any]] = deque()
        self._rows_done = False
        self._closed = False
        # Held by the owner's thread while it is inside the stream (`has_more`, `next`, `skip`).
        # A close from another thread cannot wait for it (the owner may be waiting for work that
        # only the runner's close ends), so it closes the generator and empties the deques only
        # when it can take it (see `close`). Re-entrant: `next` calls `has_more`.
        self._owner = threading.RLock()

    @property
    def finite(self) -> bool:
        """Whether the lane's plan ends (it then looks one row ahead and can be `exhausted`)."""
        return self._finite

    @property
    def exhausted(self) -> bool:
        """True once a finite plan is used up and every row was taken; known as soon as the last
        row is taken (see `next`)."""
        return self._rows_done and not self._ahead

    def has_more(self) -> bool:
        with self._owner:
            return self._has_more()

    def _has_more(self) -> bool:
        if not self._ahead:
            self._pull(with_work=True)
        return bool(self._ahead)

    def next(self) -> tuple[int, PackedSequence] | None:
        """The next row and its segment, or None once a finite plan is used up. With row work, the
        work of the rows after it is started before this row's is waited for.

        In a finite plan the row after it is looked for at once, so the lane is known to be
        exhausted the moment its last row is taken, not when the loader next turns to it. A
        checkpoint then says the lane is finished whichever layout took it and whenever its
        trainer saved (a trainer taking each step whole saves before the loader turns to the lanes
        whose data ended with the step, and a rank with nothing left never turns to them). Looking
        only once every chunk was read (which waits for nothing) missed a lane whose last chunks
        give no row (every record dropped): its last row comes from an earlier flush, with those
        chunks still to read, and its rank's save stayed a step behind the others'. The row looked
        for is the one the loader would read next anyway: the rows and their order are unchanged.

        The row leaves `_ahead` only once its work is done: an exception while waiting for it
        (Ctrl-C, a close from another thread, a worker that crashed for good) then leaves the lane
        holding it, not `exhausted` with its last row never handed over, which a checkpoint taken
        then would save as a finished lane (and, for a rank's last lane, as a rank that is done)."""
        with self._owner:
            return self._next()

    def _next(self) -> tuple[int, PackedSequence] | None:
        if not self._has_more():
            return None
        if self._row_work is not None:
            while len(self._ahead) <= self._rows_ahead and self._pull(with_work=True):
                pass
        if len(self._ahead) == 1 and self._finite:
            self._pull(with_work=True)
        segment, row = self._ahead[0]
        if isinstance(row, Future):
            row = row.result()
        self._ahead.popleft()
        return segment, row

    def give_back(self, rows: list[tuple[int, Any]]) -> None:
        """Put rows taken with `next` back in front, oldest first: the loader failed (Ctrl-C while
        it collated them) before it handed them over. A lane whose last row was among them is then
        not `exhausted`, so a checkpoint taken then does not save it as finished with its last
        microbatch never counted."""
        self._ahead.extendleft(reversed(rows))

    def forget_end(self) -> None:
        """Be not `exhausted` until asked again: the loader found that this lane gives no more rows
        while it took another lane's microbatch (`RankLoader._look_past`), then failed to hand that
        microbatch over (Ctrl-C while it collated it), so a checkpoint taken then must not save the
        lane as finished before the trainer could know it. The plan's end is found again, reading
        nothing, when the lane is next asked."""
        self._rows_done = False

    def skip(self) -> bool:
        """Drop the next row without doing its row work (a resume replaying past rows the trainer
        already had); False once a finite plan is used up."""
        with self._owner:
            return self._skip()

    def _skip(self) -> bool:
        if not self._ahead and not self._pull(with_work=False):
            return False
        _, row = self._ahead.popleft()
        if isinstance(row, Future):
            row.cancel()
        return True

    def _pull(self, with_work: bool) -> bool:
        if self._rows_done:
            return False
        if self._closed:  # a close from another thread: the rows it ended must not read as the plan's end
            raise self._closed_while_iterated()
        got = next(self._rows, None)
        if got is None:
            if self._closed:  # a close on this thread, from inside the generator (a user's map, inline)
                raise self._closed_while_iterated()
            self._rows_done = True
            return False
        segment, row = got
        self._ahead.append((segment, self._row_work(row) if with_work and self._row_work else row))
        return True

    def _closed_while_iterated(self) -> ConfigurationError:
        return ConfigurationError(
            f"lane {self.lane}'s stream was closed while it was being iterated (its loader closed)"
        )

    def _fill(self) -> None:
        """Queue the plan's items until `prefetch` chunks are in flight, or `prefetch + 2` flushes
        are queued: a run of empty slots in a plan yields flushes and no chunk, which queued
        without bound took memory without limit (and an endless plan's lane given only empty
        slots never left this loop). Without empty slots every flush but a finite plan's last
        follows a chunk, so while fewer than `prefetch` chunks are in flight at most `prefetch + 1`
        flushes are queued: the flush bound never holds a chunk back nor delays seeing the plan's end."""
        while not self._plan_done and self._in_flight < self._prefetch and self._flushes_queued <= self._prefetch + 1:
            item = next(self._items, None)
            if item is None:
                self._plan_done = True
            elif isinstance(item, Flush):
                self._pending.append(item)
                self._flushes_queued += 1
            else:
                self._pending.append(self._submit(item))
                self._in_flight += 1

    def _generate(self) -> Iterator[tuple[int, PackedSequence]]:
        accumulators = [make(SegmentContext(self.lane, self._segment)) for make in self._factories]
        while True:
            self._fill()
            if not self._pending:
                return
            entry = self._pending.popleft()
            if isinstance(entry, Flush):
                self._flushes_queued -= 1
                rows = _flush_chain(accumulators)
                self._collect_skips(accumulators)
                if rows and self._read_without_rows:
                    self._rows_handed_over()
                yield from _handed_over(self._segment, rows)
                self._segment = entry.segment
                accumulators = [make(SegmentContext(self.lane, self._segment)) for make in self._factories]
                continue
            self._in_flight -= 1
            self._fill()
            batch: ChunkRecords = entry.result()
            self._on_chunk(self.lane, self._segment, batch)
            self._count_read(batch)
            for address, record in zip(batch.addresses, batch.records):
                rows = _push_chain(accumulators, (address, record))
                if rows and self._read_without_rows:  # per record: no call unless it changes something
                    self._rows_handed_over()
                yield from _handed_over(self._segment, rows)
            self._collect_skips(accumulators)
            self._check_barren()

    def _count_read(self, batch: ChunkRecords) -> None:
        if self._barren_records is not None:
            self._read_without_rows += batch.chunk.num_records
            self._drops_without_rows.update(reason for _, reason in batch.skipped)
            if batch.filtered:
                self._drops_without_rows["filtered"] += len(batch.filtered)

    def _check_barren(self) -> None:
        if self._barren_records is None or self._read_without_rows <= self._barren_records:
            return
        raise barren_error(
            f"lane {self.lane} read {self._read_without_rows} records in a row",
            self._drops_without_rows,
            "every record of its datasets seems to be dropped, and an endless plan would read them forever",
        )

    def _rows_handed_over(self) -> None:
        self._read_without_rows = 0
        self._drops_without_rows.clear()

    def _collect_skips(self, accumulators) -> None:
        """Accumulators may refuse items (a sample whose images cannot fit) or cut them to fit (a
        caption too long beside its images); they report them through optional `drain_skips()` and
        `drain_truncations()` so the ledger loses nothing."""
        for accumulator in accumulators:
            drain = getattr(accumulator, "drain_skips", None)
            if drain is not None:
                skips = drain()
                if skips:
                    self._on_skips(self.lane, self._segment, skips)
                    if self._barren_records is not None:
                        self._drops_without_rows.update(skip[1] for skip in skips)
            drain = getattr(accumulator, "drain_truncations", None)
            if drain is not None:
                cuts = drain()
                if cuts and self._on_truncations is not None:
                    self._on_truncations(self.lane, self._segment, cuts)

    def close(self, cancel_work: bool = True) -> None:
        """Cancel the work in flight and end the row generator.

        The generator's frame holds this stream (and through `submit` the loader): a stream left
        with it open is a reference cycle, and its accumulators' rows (a shuffle buffer, open
        rows, the token arrays or images they reference) stayed alive until the cyclic collector
        happened to run. Closing it frees them by reference counting.

        From another thread (a watchdog), while the owner's thread is inside the stream, only the
        work in flight is cancelled (from copies of the deques, taken atomically: walking them
        while the owner adds to them raised "deque mutated during iteration" here); the generator
        is left to the owner, whose next call raises ConfigurationError. Closing a generator that
        another thread is resuming can abort free-threaded CPython 3.14, and emptying the deques
        under it ended the generator, which read as the end of the lane's plan.

        `cancel_work=False` drops the work's futures without touching them: in a process forked
        from the one whose runner runs that work they are copies of the parent's, and a parent
        thread resolving one at the fork (holding its lock for that instant) left the lock held
        in the child for good, so cancelling it there waited forever."""
        self._closed = True
        for entry in [*self._pending.copy(), *(row for _, row in self._ahead.copy())] if cancel_work else ():
            if isinstance(entry, Future):
                entry.cancel()
        if not self._owner.acquire(blocking=False):
            return
        try:
            self._pending.clear()
            self._ahead.clear()
            try:
                self._rows.close()
            except ValueError:  # "generator already executing": closed from inside it, on the owner's thread
                pass
        finally:
            self._owner.release()


def _handed_over(segment: int, rows: list) -> Iterator[tuple[int, PackedSequence]]:
    """Yields (segment, row) for `rows` in order, removing each row from the list (and holding it
    in no local) as it goes. The rows a flush (or one long record) releases at once are taken by
    the loader one by one; a row it took must not stay referenced by the lane, or every VLM row
    keeps its decoded images alive until the next flush (race VLM recipe: ~400 images, 50 MiB)."""
    rows.reverse()
    while rows:
        yield segment, rows.pop()


def _push_chain(accumulators, item) -> list:
    items = [item]
    for accumulator in accumulators:
        ready = []
        for it in items:
            ready.extend(accumulator.push(it))
        items = ready
        if not items:
            break
    return items


def _flush_chain(accumulators) -> list:
    items: list = []
    for accumulator in accumulators:
        ready = []
        for it in items:
            ready.extend(accumulator.push(it))
        ready.extend(accumulator.flush())
        items = ready
    return items
