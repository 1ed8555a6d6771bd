"""A lane's row work (e.g. decoding images packed encoded) runs a bounded window ahead of the
loader, in row order, and never for rows a resume replays past; its plan is read a bounded window
ahead too, runs of empty segments included."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tests.harness import Interrupt
from zephon._lane import LaneStream
from zephon._records import Chunk, ChunkRecords, RecordAddress
from zephon.work import Flush

ROWS_PER_CHUNK = 4
AHEAD = 3


class EachRecordARow:
    """An accumulator that emits every record as a row, and nothing at flush."""

    def push(self, item):
        return [item[1]["row"]]

    def flush(self):
        return []


def _chunk_result(chunk: Chunk) -> Future:
    records = [{"row": f"row-{chunk.start + i}"} for i in range(ROWS_PER_CHUNK)]
    addresses = [RecordAddress("d", "s", chunk.start + i) for i in range(ROWS_PER_CHUNK)]
    future = Future()
    future.set_result(ChunkRecords(chunk, records, addresses))
    return future


def _stream(worked: list, chunks: int = 6) -> LaneStream:
    items = []
    for n in range(chunks):
        items.append(Chunk("d", 0, n * ROWS_PER_CHUNK, (n + 1) * ROWS_PER_CHUNK))
        if n % 2 == 1:
            items.append(Flush(segment=n // 2 + 1))

    def row_work(row) -> Future:
        worked.append(row)
        future = Future()
        future.set_result(row.upper())
        return future

    return LaneStream(0, iter(items), 0, _chunk_result, [lambda ctx: EachRecordARow()], prefetch=2,
                      on_chunk=lambda *a: None, on_skips=lambda *a: None, row_work=row_work, rows_ahead=AHEAD)


def test_rows_come_out_with_their_work_done_in_order_and_the_work_runs_a_window_ahead():
    worked: list = []
    stream = _stream(worked)
    taken = []
    while (got := stream.next()) is not None:
        taken.append(got)
        assert len(worked) <= len(taken) + AHEAD, "row work ran more than its window ahead"
    assert [row for _, row in taken] == [f"ROW-{i}" for i in range(6 * ROWS_PER_CHUNK)]
    assert [segment for segment, _ in taken] == [i // (2 * ROWS_PER_CHUNK) for i in range(6 * ROWS_PER_CHUNK)]
    assert worked == [f"row-{i}" for i in range(6 * ROWS_PER_CHUNK)], "every row's work ran once"
    assert stream.exhausted


def test_replayed_rows_are_skipped_without_their_work():
    worked: list = []
    stream = _stream(worked)
    for _ in range(10):
        assert stream.skip()
    assert worked == []
    assert stream.next() == (1, "ROW-10")
    assert worked[0] == "row-10" and len(worked) <= 1 + AHEAD


def test_skipping_past_the_end_reports_it():
    stream = _stream([], chunks=1)
    assert all(stream.skip() for _ in range(ROWS_PER_CHUNK))
    assert not stream.skip() and stream.exhausted and stream.next() is None


def test_a_lane_interrupted_while_waiting_for_its_last_rows_work_is_not_exhausted():
    """The last row was never handed over: a checkpoint taken now must not call the lane finished.
    Its work is waited for after the lane already knows no row follows it (every chunk is read)."""
    last = f"row-{ROWS_PER_CHUNK - 1}"

    def row_work(row) -> Future:
        future = Future()
        if row == last:
            future.set_exception(Interrupt())
        else:
            future.set_result(row.upper())
        return future

    items = iter([Chunk("d", 0, 0, ROWS_PER_CHUNK)])
    stream = LaneStream(0, items, 0, _chunk_result, [lambda ctx: EachRecordARow()], prefetch=2,
                        on_chunk=lambda *a: None, on_skips=lambda *a: None, row_work=row_work, rows_ahead=AHEAD)
    assert [stream.next()[1] for _ in range(ROWS_PER_CHUNK - 1)] == [f"ROW-{i}" for i in range(ROWS_PER_CHUNK - 1)]
    with pytest.raises(Interrupt):
        stream.next()
    assert not stream.exhausted


def test_a_run_of_empty_segments_is_read_a_bounded_window_ahead_not_to_its_end():
    """Empty slots in a plan make flushes and no chunk: they did not count against the prefetch
    window, so a lane queued a whole run of them at once (and a lane an endless plan gave only
    empty slots, for ever). At most `prefetch + 2` flushes are queued now."""
    prefetch = 2
    items = [Chunk("d", 0, 0, ROWS_PER_CHUNK), *(Flush(segment) for segment in range(1, 1_001)),
             Chunk("d", 0, ROWS_PER_CHUNK, 2 * ROWS_PER_CHUNK)]
    pulled = []

    def plan():
        for item in items:
            pulled.append(item)
            yield item

    stream = LaneStream(0, plan(), 0, _chunk_result, [lambda ctx: EachRecordARow()], prefetch=prefetch,
                        on_chunk=lambda *a: None, on_skips=lambda *a: None)
    taken = [stream.next()]
    assert len(pulled) <= 1 + prefetch + 2, f"{len(pulled)} items of the plan read to hand over the first row"
    while (got := stream.next()) is not None:
        taken.append(got)
    assert taken == [(0, f"row-{i}") for i in range(ROWS_PER_CHUNK)] + [
        (1_000, f"row-{i}") for i in range(ROWS_PER_CHUNK, 2 * ROWS_PER_CHUNK)
    ]
    assert stream.exhausted
