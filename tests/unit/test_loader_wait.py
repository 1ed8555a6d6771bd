"""`stats()["wait"]`: how long the trainer's thread waited inside the loader for its batches.

Most tests put a clock of their own in place of the loader's `perf_counter`, moved only by the
pipeline's map (one tick a record; the inline runner maps on the trainer's thread, inside
`next()`): each wait is then an exact count of the records mapped for it, whatever the machine's
load. The test reads the same clock around each `next()` to know what the loader should report.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tests.harness import Interrupt
from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from tests.unit.test_loader_runner_start import SaysWhenWaitedFor
from zephon import _lane, _loader

NO_WAIT = {"batches": 0, "total_s": 0.0, "first_s": None, "last_s": None, "longest_s": 0.0}


class MapClock:
    """Seconds that pass only as records are mapped (`tick` is the map). Its state is private, so
    the map's fingerprint, and with it the recipe a state is checked against, is the same at any
    time and rate."""

    def __init__(self) -> None:
        self._now, self._per_record = 0.0, 1.0

    def __call__(self) -> float:
        return self._now

    def tick(self, record: dict) -> dict:
        self._now += self._per_record
        return record

    def slow_down(self, factor: float) -> None:
        self._per_record *= factor

    def pass_time(self, seconds: float) -> None:
        self._now += seconds


@pytest.fixture
def clocked(tmp_path, monkeypatch):
    clock = MapClock()
    monkeypatch.setattr(_loader, "perf_counter", clock)
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", map_fn=clock.tick, num_epochs=None)
    return pipeline, clock


def timed(clock: MapClock, iterator, n: int) -> list[tuple[float, str]]:
    """The next `n` batches' (time `next()` took on `clock`, digest)."""
    out = []
    for _ in range(n):
        called = clock()
        batch = next(iterator)
        out.append((clock() - called, batch.digest()))
    return out


def expected_wait(waits: list[float]) -> dict:
    return {"batches": len(waits), "total_s": sum(waits), "first_s": waits[0], "last_s": waits[-1],
            "longest_s": max(waits)}


def test_each_batch_waits_the_time_its_next_took_and_the_first_includes_opening_the_lanes(clocked):
    pipeline, clock = clocked
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert loader.stats()["wait"] == NO_WAIT
        waits = [waited for waited, _ in timed(clock, iter(loader), 12)]
        assert loader.stats()["wait"] == expected_wait(waits)
    assert waits[0] > 0 and len(set(waits)) > 1, "the first next() maps the lanes' first chunks, later ones less"


def test_wait_counts_carry_on_over_a_second_iter_and_a_load_state_dict_and_start_at_zero_on_a_new_loader(clocked):
    pipeline, clock = clocked
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        waits = [waited for waited, _ in timed(clock, iter(loader), 3)]
        state = loader.state_dict()
        waits += [waited for waited, _ in timed(clock, iter(loader), 2)]
        loader.load_state_dict(state)
        assert loader.stats()["wait"] == expected_wait(waits), "a load restores and resets nothing of it"
        waits += [waited for waited, _ in timed(clock, iter(loader), 2)]
        assert loader.stats()["wait"] == expected_wait(waits)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as resumed:
        assert resumed.stats()["wait"] == NO_WAIT
        resumed.load_state_dict(state)
        assert resumed.stats()["wait"] == NO_WAIT, "a resume does not take up the saved loader's waits"
        [(first, _)] = timed(clock, iter(resumed), 1)
        assert resumed.stats()["wait"] == expected_wait([first])


def test_wait_times_stay_out_of_the_saved_state(clocked):
    """Two loaders hand over the same batches with their records mapped three times slower in the
    second: their waits differ, their states and their ledgers do not."""
    pipeline, clock = clocked
    runs = []
    for factor in (1.0, 3.0):
        clock.slow_down(factor)
        with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
            batches = timed(clock, iter(loader), 5)
            stats = loader.stats()
            runs.append(([digest for _, digest in batches], loader.state_dict(), stats.pop("wait"), stats))
    (digests, state, wait, ledger), (slow_digests, slow_state, slow_wait, slow_ledger) = runs
    assert slow_digests == digests and slow_wait["total_s"] == 3 * wait["total_s"] > 0
    assert slow_state == state and slow_ledger == ledger


GUARD_S = 30  # a hang guard only: the events below are set long before
SAVE_S = 100.0  # what the clock moves while a save on another thread holds the trainer's next() back


@pytest.mark.parametrize("which", ["first_next", "later_next"])
def test_a_next_held_back_by_a_save_on_another_thread_counts_it_as_checkpoint_wait_not_as_data_wait(
        clocked, monkeypatch, which):
    """An asynchronous checkpointer's `state_dict()` holds the loader while the trainer asks for a
    batch: the time the trainer waits for the save is no wait for data (`stats()["wait"]`), which
    is what tells a slow input pipeline; it is reported apart, as `checkpoint_wait_s`. The clock
    moves by SAVE_S while the save holds the trainer back, and otherwise only as records are
    mapped, so both numbers are exact."""
    pipeline, clock = clocked
    saving, go_on, waited_for = threading.Event(), threading.Event(), threading.Event()
    make_state = _loader.make_state

    def held_save(*args):
        saving.set()
        assert go_on.wait(GUARD_S)
        return make_state(*args)

    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader._moving = SaysWhenWaitedFor(waited_for, threading.RLock())  # reentrant, as `_moving`
        iterator = iter(loader)
        waits = [waited for waited, _ in timed(clock, iterator, 1 if which == "later_next" else 0)]
        monkeypatch.setattr(_loader, "make_state", held_save)
        saver = threading.Thread(target=loader.state_dict)
        taken: list[tuple[float, str]] = []
        trainer = threading.Thread(target=lambda: taken.extend(timed(clock, iterator, 1)))
        try:
            saver.start()
            assert saving.wait(GUARD_S)
            trainer.start()
            assert waited_for.wait(GUARD_S), "the trainer's next() waits for the save"
            clock.pass_time(SAVE_S)
        finally:
            go_on.set()
            saver.join(GUARD_S)
            trainer.join(GUARD_S)
        [(took, _)] = taken
        stats = loader.stats()
    assert took > SAVE_S
    assert stats["wait"] == expected_wait(waits + [took - SAVE_S])
    assert stats["checkpoint_wait_s"] == SAVE_S


def test_a_next_that_raises_hands_over_nothing_and_counts_no_wait(clocked, monkeypatch):
    """A microbatch interrupted while its rows are taken is not counted, nor is the time its
    `next()` spent: the next batch's wait starts at its own `next()`."""
    pipeline, clock = clocked
    original, calls = _lane.LaneStream.next, {"n": 0}

    def next_row(stream):
        calls["n"] += 1
        if calls["n"] == 2 * pipeline.microbatch_size + 2:  # the second row of the third microbatch
            raise Interrupt
        return original(stream)

    monkeypatch.setattr(_lane.LaneStream, "next", next_row)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        iterator = iter(loader)
        waits = [waited for waited, _ in timed(clock, iterator, 2)]
        with pytest.raises(Interrupt):
            next(iterator)
        assert loader.stats()["wait"] == expected_wait(waits)
        waits += [waited for waited, _ in timed(clock, iter(loader), 2)]
        assert loader.stats()["wait"] == expected_wait(waits)


SLEEP_S = 0.002


class SleepyMap:
    """A map that sleeps SLEEP_S a record and counts the records it mapped (privately: see MapClock)."""

    def __init__(self) -> None:
        self._mapped = 0

    def __call__(self, record: dict) -> dict:
        time.sleep(SLEEP_S)
        self._mapped += 1
        return record

    @property
    def mapped(self) -> int:
        return self._mapped


def test_a_loader_whose_map_sleeps_reports_at_least_those_sleeps_as_waited(tmp_path):
    """On the inline runner every record is mapped on the trainer's thread inside a `next()`."""
    sleepy = SleepyMap()
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", map_fn=sleepy, num_epochs=None)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        iterator = iter(loader)
        for _ in range(6):
            next(iterator)
        wait = loader.stats()["wait"]
    assert sleepy.mapped > 0 and wait["batches"] == 6
    assert wait["total_s"] >= sleepy.mapped * SLEEP_S and wait["first_s"] >= SLEEP_S


def test_the_first_batch_waits_at_least_for_a_record_to_be_mapped_on_worker_threads(tmp_path):
    """The thread runner's workers start with the first `next()`, and its batch needs a record mapped."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="thread", parallelism=2, map_fn=SleepyMap())
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        next(iter(loader))
        wait = loader.stats()["wait"]
    assert wait["batches"] == 1 and wait["first_s"] == wait["last_s"] == wait["total_s"] >= SLEEP_S


def test_stats_read_on_another_thread_while_the_trainer_iterates_never_fails(tmp_path):
    """A monitoring thread reads stats() while the training thread takes batches. The ledger's
    snapshot walked the open counts that the loader's thread adds to as its lanes take chunks
    ("dictionary changed size during iteration" in the reader). The switch interval is 1 us
    meanwhile: with the GIL, the threads then switch inside the snapshot too."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", num_epochs=None)
    failures, done = [], threading.Event()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:

            def monitor() -> None:
                while not done.is_set() and not failures:
                    try:
                        loader.stats()
                    except Exception as error:  # noqa: BLE001 - named by the assertion
                        failures.append(repr(error))

            reader = threading.Thread(target=monitor)
            reader.start()
            batches = iter(loader)
            for _ in range(3000):
                next(batches)
                if failures:
                    break
            done.set()
            reader.join()
            assert failures == []
            assert loader.stats()["wait"]["batches"] == 3000
    finally:
        sys.setswitchinterval(interval)
