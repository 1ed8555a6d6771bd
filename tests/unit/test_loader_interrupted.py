"""A loader interrupted inside a microbatch (Ctrl-C, a preemption handler raising, a worker that
crashed for good) neither loses nor repeats a row; one closed while an iteration is suspended says
so when that iteration goes on; one whose close is interrupted is finished by closing it again. A
close from another thread (a watchdog) while the iteration starts its runner, opens its lanes or
takes rows returns, stops everything that iteration started, and the iteration fails saying so.

The loader takes a microbatch's rows one by one, waiting for the runner between them. An exception
raised while it waits for the second row must leave the cursors where the trainer is: the first
row was never handed over, so a checkpoint taken then, or a new iteration of the same loader,
starts again with it.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future

import pytest

from runners import ProcessRunner, ThreadRunner
from tests.harness import Interrupt
from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from tests.unit.test_runners_process import child_pids, interrupt_next_join
from zephon import _lane
from zephon._errors import ConfigurationError
from zephon._records import Chunk, ChunkRecords, RecordAddress
from zephon._runner_closer import THREAD_NAME as RUNNER_CLOSER


def digests(loader, limit=None) -> list[tuple[int, int, int, str]]:
    out = []
    for batch in loader:
        out.append((batch.step, batch.lane, batch.index, batch.digest()))
        if limit is not None and len(out) == limit:
            break
    return out


@pytest.fixture
def pipeline(tmp_path):
    return text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline")


@pytest.fixture
def interrupt_at(monkeypatch):
    """Make the n-th row the loader asks a lane for raise `Interrupt` while it waits."""

    def arm(n: int) -> None:
        calls = {"n": 0}
        original = _lane.LaneStream.next

        def next_row(stream):
            calls["n"] += 1
            if calls["n"] == n:
                raise Interrupt
            return original(stream)

        monkeypatch.setattr(_lane.LaneStream, "next", next_row)

    return arm


def test_a_checkpoint_taken_after_an_interrupt_inside_a_microbatch_resumes_without_a_gap(pipeline, interrupt_at):
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
    assert len(reference) > 4
    interrupt_at(4)  # microbatch 1 (lane 1): its first row taken, the second interrupted
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        seen = []
        with pytest.raises(Interrupt):
            for batch in loader:
                seen.append((batch.step, batch.lane, batch.index, batch.digest()))
        state = loader.state_dict()
    assert seen == reference[:1]
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader.load_state_dict(state)
        assert seen + digests(loader) == reference


def test_iterating_again_after_an_interrupt_inside_a_microbatch_continues_without_a_gap(pipeline, interrupt_at):
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
    interrupt_at(4)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        seen = []
        with pytest.raises(Interrupt):
            for batch in loader:
                seen.append((batch.step, batch.lane, batch.index, batch.digest()))
        assert seen + digests(loader) == reference


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_an_iteration_resumed_after_close_fails_naming_the_closed_loader(tmp_path, runner):
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=runner)
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    batches = iter(loader)
    next(batches)
    loader.close()
    with pytest.raises(ConfigurationError, match="closed"):
        next(batches)


def _wait_at_r9(marker, release):
    """A map that, at the first record r9, says so through `marker` and waits until `release` exists."""

    def map_fn(record):
        if record["id"] == "r9" and not marker.exists():
            marker.touch()
            while not release.exists():
                time.sleep(0.01)
        return record

    return map_fn


def _iterate_while_another_thread_closes_it(loader, marker, release) -> None:
    """Iterate `loader` while another thread closes it once the map waits at `marker`, expecting
    the error that names the close."""

    def close_once_waiting() -> None:
        while not marker.exists():
            time.sleep(0.01)
        loader.close()
        release.touch()

    closer = threading.Thread(target=close_once_waiting)
    closer.start()
    try:
        with pytest.raises(ConfigurationError, match="closed while it was being iterated"):
            for _ in loader:
                pass
    finally:
        release.touch()
        closer.join()


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_loader_closed_from_another_thread_while_it_waits_fails_naming_the_closed_loader(tmp_path, runner):
    """A watchdog or a shutdown handler closes the loader while the training thread waits for
    its work: that thread got a bare CancelledError, or an AttributeError on the dropped runner."""
    marker, release = tmp_path / "waiting", tmp_path / "release"
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=runner, map_fn=_wait_at_r9(marker, release))
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))

    _iterate_while_another_thread_closes_it(loader, marker, release)


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_loader_closed_from_another_thread_while_it_replays_a_resume_fails_naming_the_closed_loader(
    tmp_path, runner
):
    """A resumed loader's first iteration replays its lanes up to the checkpoint before yielding,
    waiting for chunks as any iteration does, but outside the part of `__iter__` that names a close
    from another thread: a watchdog closing it then gave the training thread a bare CancelledError
    (or an AttributeError on the dropped runner) instead of saying the loader was closed."""
    marker, release = tmp_path / "waiting", tmp_path / "release"
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=runner, map_fn=_wait_at_r9(marker, release))
    marker.touch()  # the first run takes its checkpoint without waiting
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        batches = iter(loader)
        for _ in range(2 * pipeline.settings.num_lanes):  # two steps: every lane replays a chunk
            next(batches)
        state = loader.state_dict()
    marker.unlink()
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    loader.load_state_dict(state)

    _iterate_while_another_thread_closes_it(loader, marker, release)


def test_a_loader_close_interrupted_while_its_runner_stops_is_finished_by_closing_again(tmp_path):
    """The loader closed its runner through a finalizer, which runs once: after Ctrl-C inside the
    runner's close, closing the loader again did nothing, leaving its workers and shared memory."""
    runner = ProcessRunner()
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=runner)
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    next(iter(loader))
    directory, workers = runner.shm_directory, runner.worker_pids()
    interrupt_next_join(runner._workers[0].process)
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    loader.close()
    assert runner.shm_directory is None and not os.path.exists(directory)
    assert runner.worker_pids() == [] and not set(workers) & child_pids()


class _EachRecordARow:
    """An accumulator that emits every record as a row: a lane that hands over rows as fast as it can."""

    def push(self, item):
        return [item[1]]

    def flush(self):
        return []


def _records_done(chunk):
    future = Future()
    future.set_result(ChunkRecords(chunk, [{"n": i} for i in range(chunk.start, chunk.stop)],
                                   [RecordAddress("d", "s", i) for i in range(chunk.start, chunk.stop)]))
    return future


def _close_from_another_thread_at_random(make, take, seed: int, left_open=lambda subject: ()) -> Counter:
    """How often each outcome came in up to 300 rounds (10 s at most) of: a fresh subject from
    `make()`, a thread calling `take(subject)` (which returns what it got), and this thread closing
    the subject after a pause of up to 1 ms drawn from `seed`, then waiting 60 s at most for the
    taker. The taker's outcome counts as "closed" for a ConfigurationError naming the close, by its
    repr for any other exception; an exception of the close counts too, and so does whatever
    `left_open(subject)` names once the round is over. The switch interval is 1 us meanwhile: with
    the GIL, threads then switch inside the steps taken and closed too."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    rng, outcomes, deadline = random.Random(seed), Counter(), time.monotonic() + 10

    def take_once(subject, started: threading.Event, taken: list[str]) -> None:
        started.set()
        try:
            taken.append(take(subject))
        except ConfigurationError as error:
            taken.append("closed" if "closed" in str(error) else f"taker: {error!r}")
        except Exception as error:  # noqa: BLE001 - counted, to be named by the assertion
            taken.append(f"taker: {error!r}")

    try:
        for _ in range(300):
            if time.monotonic() > deadline:
                break
            subject, started, taken = make(), threading.Event(), []
            taker = threading.Thread(target=take_once, args=(subject, started, taken))
            taker.start()
            started.wait()
            time.sleep(rng.random() * 1e-3)
            try:
                subject.close()
            except Exception as error:  # noqa: BLE001 - counted, to be named by the assertion
                outcomes[f"close: {error!r}"] += 1
            taker.join(60)  # a hang guard: a taker returns at once after a close
            if taker.is_alive():
                outcomes["taker still waiting 60 s after the close"] += 1
                break
            outcomes.update(taken)
            outcomes.update(left_open(subject))
    finally:
        sys.setswitchinterval(interval)
    return outcomes


def test_a_lane_closed_from_another_thread_while_it_hands_over_rows_ends_its_reader_saying_so():
    """A watchdog closes the loader while the training thread is taking rows. The lane's close
    walked its deques while the training thread added to them ("deque mutated during iteration"
    raised in the watchdog, on 3.14t about one close in ten, leaving the runner unclosed), closed
    the row generator while that thread was resuming it (a generator closed from another thread
    as it runs can abort 3.14t), and could end the generator under the reader, which then took
    the lane of an endless plan for finished. Every close must return, and the reader must end
    with the ConfigurationError that names the close."""

    def endless_lane() -> _lane.LaneStream:
        chunks = (Chunk("d", 0, 4 * n, 4 * n + 4) for n in itertools.count())
        return _lane.LaneStream(0, chunks, 0, _records_done, [lambda ctx: _EachRecordARow()], prefetch=2,
                                on_chunk=lambda *a: None, on_skips=lambda *a: None)

    def take_rows(stream: _lane.LaneStream) -> str:
        while stream.next() is not None:
            pass
        return "the endless lane ended"

    outcomes = _close_from_another_thread_at_random(endless_lane, take_rows, seed=0)
    assert set(outcomes) == {"closed"}, outcomes


# A guard only: each wait below ends when its event is set. An event not set by then changes the
# order the test sets up (the close then comes before the start, or after it), so it must be far
# longer than any stall of a loaded machine.
ORDER_GUARD_S = 60


class _StartsSlowly(ThreadRunner):
    """A thread runner whose start waits (at most ORDER_GUARD_S) until `closed` is set, having set `starting`."""

    def __init__(self, starting: threading.Event, closed: threading.Event) -> None:
        super().__init__()
        self.starting, self.closed = starting, closed

    def start(self, stages) -> None:
        self.starting.set()
        self.closed.wait(ORDER_GUARD_S)
        super().start(stages)


def test_a_loader_closed_from_another_thread_while_its_runner_starts_closes_that_runner_and_hands_over_nothing(tmp_path):
    """The first iteration starts the runner (forking workers takes a while); a close from another
    thread then found no runner to close, returned, and the runner the iteration went on to start
    stayed open (its threads, or a process runner's workers and shared memory, until the loader
    was garbage), kept by the closed loader, the iteration handing over batches of a closed loader."""
    starting, closed = threading.Event(), threading.Event()
    runners = []

    def make_runner():
        runners.append(_StartsSlowly(starting, closed))
        return runners[-1]

    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=make_runner, parallelism=2)
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    threads_before = set(threading.enumerate())

    def close_once_starting() -> None:
        starting.wait(ORDER_GUARD_S)
        loader.close()
        closed.set()

    closer = threading.Thread(target=close_once_starting)
    closer.start()
    taken = []
    try:
        with pytest.raises(ConfigurationError, match="closed"):
            for batch in loader:
                taken.append(batch)
    finally:
        closed.set()
        closer.join()
    assert taken == [], "no batch is handed over after the close"
    assert runners and runners[0]._closed, "the runner started during the close was left open"
    assert all(not thread.is_alive() for pool in runners[0]._pools for thread in pool.threads)
    assert loader._runner is None
    # the runner closer thread is not the runner's: it stays, serving every loader of the process
    runners_threads = {t for t in threading.enumerate() if t.name.startswith("zephon-") and t.name != RUNNER_CLOSER}
    assert not runners_threads - threads_before


def test_a_loader_closed_from_another_thread_as_an_iteration_begins_closes_cleanly(tmp_path):
    """A close from another thread while the first iteration opens the lanes walked the loader's
    lanes as the iteration added to them ("dictionary changed size during iteration" raised in the
    closer), could read the runner before the loader kept its finalizer (AttributeError), and left
    the runner or the lanes opened after it open. Every close must return, and leave the runner
    closed and no lane open; the iteration hands over a batch or fails naming the close."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="thread", num_lanes=32, num_epochs=None,
                             records_per_chunk=1)

    def take_a_batch(loader) -> str:
        next(iter(loader))
        return "a batch"

    def left_open(loader) -> list[str]:
        left = []
        if loader._runner is not None:
            left.append("runner left open")
        if loader._streams:
            left.append("lanes left open")
        return left

    def new_loader():
        return pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))

    outcomes = _close_from_another_thread_at_random(new_loader, take_a_batch, seed=1, left_open=left_open)
    assert set(outcomes) <= {"closed", "a batch"}, outcomes


def test_an_interrupt_while_a_lane_s_last_microbatch_is_collated_leaves_the_lane_live_in_a_checkpoint(
    pipeline, monkeypatch
):
    """The lane learns its plan has ended while the rows of its last microbatch are taken (it
    looks one row ahead); an interrupt while they are stacked into arrays (`collate`) must leave
    the lane where the trainer is: live, with that microbatch still to come. It used to be saved as
    finished with the microbatch never counted, which for a rank's last lane also saves the rank
    as done, so merge_states left it out of its checks. The state equals the one saved before the
    microbatch, and a resume from it hands over exactly the rest of the uninterrupted run."""
    from zephon import _loader

    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
    last_of_a_lane = max(i for i, key in enumerate(reference) if key[1] == reference[0][1])
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert len(digests(loader, limit=last_of_a_lane)) == last_of_a_lane
        expected = loader.state_dict()
    original, calls = _loader.collate, {"n": 0}

    def collate(*args):
        calls["n"] += 1
        if calls["n"] == last_of_a_lane + 1:
            raise Interrupt
        return original(*args)

    monkeypatch.setattr(_loader, "collate", collate)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        seen = []
        with pytest.raises(Interrupt):
            for batch in loader:
                seen.append((batch.step, batch.lane, batch.index, batch.digest()))
        state = loader.state_dict()
    assert seen == reference[:last_of_a_lane]
    assert state == expected
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader.load_state_dict(state)
        assert seen + digests(loader) == reference


def test_an_interrupt_while_a_microbatch_is_counted_moves_no_cursor_and_a_checkpoint_resumes_without_a_gap(
    pipeline, monkeypatch
):
    """The microbatch is whole and collated; an interrupt while its rows are counted (between
    the first row and the second) used to leave the lane's cursor having skipped the first row
    without having moved past the microbatch: a checkpoint taken then replayed the lane past a row
    the trainer never had, and handed over the microbatch's key with other rows. The cursor now
    moves in one step, after the counting, so the checkpoint is the one saved before the
    microbatch, ledger included, and the resume hands over exactly the rest of the uninterrupted
    run."""
    from zephon import _ledger

    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert len(digests(loader, limit=1)) == 1
        expected = loader.state_dict()
    original, calls = _ledger.Ledger.count_rows, {"n": 0}

    def count_rows(ledger, *args):
        calls["n"] += 1
        if calls["n"] == 4:  # the second row of the second microbatch
            raise Interrupt
        return original(ledger, *args)

    monkeypatch.setattr(_ledger.Ledger, "count_rows", count_rows)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        seen = []
        with pytest.raises(Interrupt):
            for batch in loader:
                seen.append((batch.step, batch.lane, batch.index, batch.digest()))
        state = loader.state_dict()
    monkeypatch.setattr(_ledger.Ledger, "count_rows", original)
    assert seen == reference[:1]
    assert state == expected
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader.load_state_dict(state)
        assert seen + digests(loader) == reference


def test_an_interrupt_while_a_lane_s_last_microbatch_is_counted_leaves_the_lane_live_in_a_checkpoint(
    pipeline, monkeypatch
):
    """As while it is collated (above): the lane found its end while the rows were taken, and an
    interrupt while they are counted must not leave it saved as finished with that microbatch
    never handed over. The state saved is the one saved before the microbatch, ledger included."""
    from zephon import _ledger

    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
    last_of_a_lane = max(i for i, key in enumerate(reference) if key[1] == reference[0][1])
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert len(digests(loader, limit=last_of_a_lane)) == last_of_a_lane
        expected = loader.state_dict()
    original, calls = _ledger.Ledger.count_rows, {"n": 0}

    def count_rows(ledger, *args):
        calls["n"] += 1
        if calls["n"] == last_of_a_lane * pipeline.microbatch_size + 1:  # its first row
            raise Interrupt
        return original(ledger, *args)

    monkeypatch.setattr(_ledger.Ledger, "count_rows", count_rows)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(Interrupt):
            for _ in loader:
                pass
        state = loader.state_dict()
    monkeypatch.setattr(_ledger.Ledger, "count_rows", original)
    assert state == expected
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader.load_state_dict(state)
        assert reference[:last_of_a_lane] + digests(loader) == reference


@pytest.mark.parametrize("then", ["iterate_again", "save_and_resume"])
def test_an_interrupt_while_a_microbatch_is_counted_counts_its_rows_once_when_it_is_handed_over_again(
    pipeline, monkeypatch, then
):
    """An interrupt between the counts of a microbatch's first and second rows left the first row
    counted, with the cursor before the microbatch: when the microbatch was handed over again (by
    a new iteration, or by a resume from a checkpoint taken then) its first row was counted a
    second time, and `stats()["lanes"]` said more rows, tokens and padding than the trainer had.
    The counts are now stored with the cursor, in one step after the counting."""
    from zephon import _ledger

    original, calls = _ledger.Ledger.count_rows, {"n": 0}

    def count_rows(ledger, *args):
        calls["n"] += 1
        if calls["n"] == pipeline.microbatch_size + 2:  # the second row of the second microbatch
            raise Interrupt
        return original(ledger, *args)

    _assert_an_interrupted_epoch_ends_with_the_uninterrupted_ledger(
        pipeline, then, lambda: monkeypatch.setattr(_ledger.Ledger, "count_rows", count_rows)
    )


@pytest.mark.parametrize("then", ["iterate_again", "save_and_resume"])
def test_an_interrupt_while_a_lane_s_past_segment_is_settled_loses_none_of_its_record_counts(
    tmp_path, monkeypatch, then
):
    """Once a microbatch taking a lane into a new segment is handed over, the lane's counts of the
    segments before it are folded into its settled counts (`Ledger.settle`, at the trainer's next
    ask). The fold took a segment's counts out of the open ones, then added them dataset by
    dataset: an interrupt in between lost them for good (the segment is never read again), and
    the ledger no longer balanced against the records planned. It now stores the folded counts
    in one step, after adding them up."""
    import collections

    from zephon import _ledger

    # a flush after every chunk of 2 records: lanes move to a new segment while the epoch goes on
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", flush_every_chunks=1, records_per_chunk=2)

    original, armed = collections.Counter.update, {"on": True}

    def update(counter, *args, **kwargs):
        if armed["on"] and sys._getframe(1).f_code is _ledger.Ledger.settle.__code__:
            armed["on"] = False
            raise Interrupt
        return original(counter, *args, **kwargs)

    _assert_an_interrupted_epoch_ends_with_the_uninterrupted_ledger(
        pipeline, then, lambda: monkeypatch.setattr(collections.Counter, "update", update)
    )


def _assert_an_interrupted_epoch_ends_with_the_uninterrupted_ledger(pipeline, then: str, arm) -> None:
    """Run an epoch on one rank; `arm()` then makes the loader raise `Interrupt` after its first
    microbatch. Iterate the same loader again (`iterate_again`), or save its state and resume a new
    loader from it (`save_and_resume`), to the end: the microbatches handed over, and the ledger at
    the end (row counts and record counts, which balance), are the uninterrupted run's."""
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
        uninterrupted = loader.stats()
    arm()
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        seen = []
        with pytest.raises(Interrupt):
            for batch in loader:
                seen.append((batch.step, batch.lane, batch.index, batch.digest()))
        assert seen and seen == reference[: len(seen)]
        if then == "iterate_again":
            seen += digests(loader)
            stats = loader.stats()
        else:
            state = loader.state_dict()
    if then == "save_and_resume":
        with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
            loader.load_state_dict(state)
            seen += digests(loader)
            stats = loader.stats()
    assert seen == reference
    assert stats["lanes"] == uninterrupted["lanes"]
    assert stats["datasets"] == uninterrupted["datasets"]
    total = stats["datasets"]["d"]["total"]
    assert total["read"] == total["emitted"] + total["filtered"] + sum(total["skipped"].values()) > 0


def _interrupt_the_second_lane_taken_up(monkeypatch) -> None:
    """Make `load_state_dict` raise `Interrupt` as it takes up its second lane's ledger counts,
    once: the first lane is then taken up, the rest not."""
    from zephon import _ledger

    original, calls = _ledger.Ledger.restore, {"n": 0}

    def restore(ledger, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Interrupt
        return original(ledger, *args)

    monkeypatch.setattr(_ledger.Ledger, "restore", restore)


def _saved_after(pipeline, microbatches: int) -> dict:
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert len(digests(loader, limit=microbatches)) == microbatches
        return loader.state_dict()


def _assert_the_uninterrupted_ledger(stats: dict, uninterrupted: dict) -> None:
    assert stats["lanes"] == uninterrupted["lanes"]
    assert stats["datasets"] == uninterrupted["datasets"]
    total = stats["datasets"]["d"]["total"]
    assert total["read"] == total["emitted"] + total["filtered"] + sum(total["skipped"].values()) > 0


@pytest.mark.parametrize("then", ["the_suspended_iteration_goes_on", "a_new_iteration"])
def test_an_interrupted_load_state_dict_leaves_the_loader_at_the_state_it_had_before(pipeline, monkeypatch, then):
    """An interrupt (Ctrl-C, a preemption handler raising) while `load_state_dict` takes up its
    lanes used to leave every cursor taken up and the ledger only for the lanes before it: the
    loader then handed over the new state's batches with a ledger of both states, which no longer
    balanced. A load that raises now takes up nothing: the loader goes on from where it was, as
    after a refused checkpoint, in the iteration it had suspended or in a new one, and its ledger
    ends where the uninterrupted run's does."""
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
        uninterrupted = loader.stats()
    later = _saved_after(pipeline, 2 * pipeline.settings.num_lanes)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        batches = iter(loader)
        seen = [(b.step, b.lane, b.index, b.digest()) for b in itertools.islice(batches, 3)]
        _interrupt_the_second_lane_taken_up(monkeypatch)
        with pytest.raises(Interrupt):
            loader.load_state_dict(later)
        if then == "a_new_iteration":
            batches = iter(loader)
        seen += [(b.step, b.lane, b.index, b.digest()) for b in batches]
        assert seen == reference
        _assert_the_uninterrupted_ledger(loader.stats(), uninterrupted)


def test_load_state_dict_again_after_an_interrupted_one_resumes_as_an_uninterrupted_load(pipeline, monkeypatch):
    """After a load interrupted while it took up its lanes, loading the same state again hands
    over what a loader that took it up at once does, with the uninterrupted run's ledger."""
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
        uninterrupted = loader.stats()
    taken = 2 * pipeline.settings.num_lanes
    later = _saved_after(pipeline, taken)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert len(digests(loader, limit=3)) == 3
        _interrupt_the_second_lane_taken_up(monkeypatch)
        with pytest.raises(Interrupt):
            loader.load_state_dict(later)
        loader.load_state_dict(later)
        assert reference[:taken] + digests(loader) == reference
        _assert_the_uninterrupted_ledger(loader.stats(), uninterrupted)


def test_microbatches_taken_as_one_are_handed_back_when_the_block_raises(pipeline):
    """`take_as_one` is how an adapter (TorchTitan's local batch) takes several microbatches
    that it passes on together: an interrupt inside the function it calls hands back every
    microbatch taken in it, so a checkpoint taken then, or a new iteration, starts again with the
    first of them; with the loader's ledger as the uninterrupted run's."""
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = digests(loader)
        uninterrupted = loader.stats()
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        batches = iter(loader)
        seen = [(b.step, b.lane, b.index, b.digest()) for b in itertools.islice(batches, 1)]

        def take_two_then_interrupt():
            assert len(list(itertools.islice(batches, 2))) == 2
            raise Interrupt

        with pytest.raises(Interrupt):
            loader.take_as_one(take_two_then_interrupt)
        state = loader.state_dict()
        assert seen + digests(loader) == reference
        _assert_the_uninterrupted_ledger(loader.stats(), uninterrupted)
    assert loader.closed
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert not loader.closed
        loader.load_state_dict(state)
        assert seen + digests(loader) == reference
