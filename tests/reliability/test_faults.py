"""Faults on the real code paths (SPEC §6): worker processes killed or hung, a user function that
raises, storage that fails for a while or for good.

A killed or hung worker is replaced and its chunk re-run, so the output is bit-identical to an
undisturbed run; a user exception surfaces as `UserFunctionError` with the record address and
the original traceback; a transient read error is retried with backoff and changes nothing; a
permanent one fails with `ShardUnavailableError` naming the file's URL.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import re
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from runners import InlineRunner, ProcessRunner, ThreadRunner
from tests.reliability.harness import (
    PER_SHARD,
    SHARDS,
    address,
    assert_ledger_balances,
    clean_records,
    fill_the_shm_directory,
    global_batch,
    jsonl_dataset,
    jsonl_lines,
    run_epoch,
    text_pipeline,
)
from tests.unit.conftest_io import registered
from zephon import UserFunctionError
from zephon._packing import PackFlatOp
from zephon.io import Dataset, ShardUnavailableError
from zephon.io import _retry

VICTIM = "r9"  # the id of the record whose map call misbehaves (record 9 of each shard)


def _claim(marker: Path) -> bool:
    """True exactly once per marker, across processes (O_EXCL creation is atomic)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def kill_own_worker_once(marker: Path):
    """A map that SIGKILLs the worker process running it, once, at the first victim record."""
    parent = os.getpid()

    def misbehave(record: dict) -> dict:
        if record["id"] == VICTIM and os.getpid() != parent and _claim(marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return record

    return misbehave


def hang_once(marker: Path, seconds: float = 60.0):
    """A map that hangs the worker running it, once, at the first victim record."""
    parent = os.getpid()

    def misbehave(record: dict) -> dict:
        if record["id"] == VICTIM and os.getpid() != parent and _claim(marker):
            time.sleep(seconds)
        return record

    return misbehave


def _undisturbed(dataset: Dataset, map_fn):
    return run_epoch(text_pipeline(dataset, map_fn=map_fn), keep_batches=False)


def test_worker_killed_mid_run_is_replaced_and_the_output_is_bit_identical(tmp_path):
    dataset = jsonl_dataset(tmp_path / "data")
    marker = tmp_path / "killed"
    runner = ProcessRunner()
    run = run_epoch(
        text_pipeline(dataset, runner=runner, map_fn=kill_own_worker_once(marker), parallelism=2),
        keep_batches=False,
    )
    assert marker.exists(), "the worker really killed itself"
    stats = runner.stats()
    assert stats.workers_replaced == 1 and stats.retries == 1
    reference = _undisturbed(dataset, kill_own_worker_once(marker))
    assert run.digests == reference.digests
    assert run.totals == reference.totals
    assert_ledger_balances(run, {"d": SHARDS * PER_SHARD})


def test_a_full_shm_directory_slows_the_process_runner_and_its_batches_stay_bit_identical(tmp_path, monkeypatch,
                                                                                            caplog):
    """A container's small /dev/shm filled up: each token array that would have crossed in a buffer
    file of its own (no arenas, every array above 64 bytes) crosses in the pipe instead, and the
    epoch's batches are those of a run with shared memory to spare."""
    dataset = jsonl_dataset(tmp_path / "data")
    fill_the_shm_directory(monkeypatch)
    runner = ProcessRunner(reply_arena_bytes=0, request_arena_bytes=0, oob_threshold_bytes=64)
    with caplog.at_level(logging.WARNING, logger="runners.process"):
        run = run_epoch(text_pipeline(dataset, runner=runner, parallelism=2), keep_batches=False)
    stats = runner.stats()
    assert stats.shm_full_bytes > 0 and stats.shm_bytes == 0
    assert sum("is full" in r.getMessage() for r in caplog.records) == 1
    reference = run_epoch(text_pipeline(dataset), keep_batches=False)
    assert run.digests == reference.digests
    assert run.totals == reference.totals


def test_worker_hung_past_task_timeout_is_killed_and_the_output_is_bit_identical(tmp_path):
    dataset = jsonl_dataset(tmp_path / "data")
    marker = tmp_path / "hung"
    runner = ProcessRunner(task_timeout_s=2.0)
    run = run_epoch(text_pipeline(dataset, runner=runner, map_fn=hang_once(marker)), keep_batches=False)
    assert marker.exists()
    # Killed and replaced, not waited for (the hang is 60 s). A chunk that a loaded machine holds
    # up past the 2 s is killed and re-run as well, as it should be: at least one, not exactly one.
    stats = runner.stats()
    assert stats.workers_replaced >= 1 and stats.retries == stats.workers_replaced
    reference = _undisturbed(dataset, hang_once(marker))
    assert run.digests == reference.digests
    assert run.totals == reference.totals


def test_a_map_hung_past_task_timeout_on_the_thread_runner_fails_the_loader_naming_the_map(tmp_path):
    """A map that never returns (a hung network read, a deadlock in a C library) on the thread
    runner kept the trainer waiting for its chunk for ever, silently. With `task_timeout_s` the
    loader raises WorkerCrashedError naming the stage and the map call its thread is stuck in (or,
    if the chunk it needs first was queued behind it, RunnerFailedError with that as its cause);
    the thread cannot be stopped and is left to finish once its call returns."""
    from runners import RunnerFailedError, WorkerCrashedError

    gate = threading.Event()
    marker = tmp_path / "hung"

    def wait_at_the_gate(record: dict) -> dict:
        if record["id"] == VICTIM and _claim(marker):
            gate.wait()
        return record

    dataset = jsonl_dataset(tmp_path / "data")
    # Every chunk runs under the timeout: 5 s, not 1, so that only the hung map meets it, however
    # long a loaded machine holds up another (that one was failed first, stuck elsewhere).
    runner = functools.partial(ThreadRunner, task_timeout_s=5, close_timeout_s=0.1)
    pipeline = text_pipeline(dataset, runner=runner, map_fn=wait_at_the_gate, parallelism=2)
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    raised: list[BaseException] = []

    def train() -> None:
        try:
            for _ in loader:
                pass
        except Exception as error:  # noqa: BLE001 - what the trainer sees is the assertion
            raised.append(error)

    trainer = threading.Thread(target=train, daemon=True)  # a regression waits for ever: not this test
    trainer.start()
    trainer.join(60)
    gate.set()
    try:
        assert not trainer.is_alive(), "the loader still waits for the chunk the hung map holds"
        assert marker.exists() and len(raised) == 1, raised
        timed_out = raised[0].__cause__ if isinstance(raised[0], RunnerFailedError) else raised[0]
        assert isinstance(timed_out, WorkerCrashedError), raised
        message = str(timed_out)
        assert "stage 'read+map" in message and "task_timeout_s=5 " in message, message
        assert "in wait_at_the_gate" in message, message
    finally:
        loader.close()


def _raise_on_victim(record: dict):
    if record["id"] == VICTIM:
        raise ValueError(f"cannot handle record {record['id']}")
    return record


@pytest.mark.parametrize("operator", ["map", "filter"])
@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_user_function_error_surfaces_with_address_and_original_traceback(tmp_path, runner, operator):
    dataset = jsonl_dataset(tmp_path / "data")
    function = {f"{operator}_fn": _raise_on_victim}
    pipeline = text_pipeline(dataset, runner=runner, **function)
    with pytest.raises(UserFunctionError) as info:
        run_epoch(pipeline, keep_batches=False)
    error = info.value
    assert error.address in {address(dataset, shard, 9) for shard in range(SHARDS)}
    assert error.operator == operator
    assert "Traceback (most recent call last)" in error.original
    assert "ValueError: cannot handle record r9" in error.original
    assert 'raise ValueError(f"cannot handle record' in error.original, "the user's own source line"
    assert str(error.address) in str(error)


def _exit_on_victim_by_exception(record: dict):
    if record["id"] == VICTIM:
        raise SystemExit(f"the map exits at record {record['id']}")
    return record


@pytest.mark.parametrize("make", [InlineRunner, ThreadRunner, ProcessRunner], ids=lambda c: c.name)
def test_system_exit_from_a_user_function_stops_the_loader_as_itself_not_as_a_skip_or_a_crash(tmp_path, make):
    dataset = jsonl_dataset(tmp_path / "data")
    runner = make()
    pipeline = text_pipeline(dataset, runner=runner, map_fn=_exit_on_victim_by_exception)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(SystemExit, match="the map exits at record r9"):
            for _ in loader:
                pass
        assert loader.stats()["datasets"]["d"]["total"]["skipped"] == {}
        if isinstance(runner, ProcessRunner):
            assert (runner.stats().retries, runner.stats().workers_replaced) == (0, 0)


class _Unnotable(Exception):
    """An error that takes no note (its `__notes__` is not a list: `add_note` raises TypeError)."""

    __notes__ = ()


class _FailingSecondStage(ThreadRunner):
    """A thread runner whose second stage fails in one of two ways the loader must not hang on."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def submit(self, stage_index: int, item):
        if stage_index == 0:
            return super().submit(stage_index, item)
        if self.fault == "submit raises":  # as a runner's misuse checks or an unexpected fault do
            raise RuntimeError("the runner refuses stage 1")
        failed = Future()
        failed.set_exception(_Unnotable("stage 1 failed"))
        return failed


@pytest.mark.timeout(30)  # the failure this guards against is a loader waiting forever
@pytest.mark.parametrize("fault", ["submit raises", "the error takes no note"])
def test_a_later_stage_that_fails_in_its_done_callback_fails_the_loader_instead_of_hanging_it(tmp_path, fault):
    """Every stage after the first is submitted from the previous one's done-callback, whose
    exceptions concurrent.futures logs and drops: the chunk used to stay pending for ever."""
    dataset = jsonl_dataset(tmp_path / "data")
    pipeline = text_pipeline(dataset, runner=functools.partial(_FailingSecondStage, fault), parallelism=2)
    pipeline = pipeline.options(read_parallelism=1)  # read, then tokenize: two stages
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert len(loader.stages) == 2
        with pytest.raises((RuntimeError, _Unnotable), match="the runner refuses stage 1|stage 1 failed") as info:
            for _ in loader:
                pass
    if fault == "submit raises":
        assert re.search(r"while the loader ran Chunk\(dataset='d'", "\n".join(info.value.__notes__))


class _ExitingRowWork:
    """A packer's row work (see `zephon._accumulator.Accumulator`) whose pure part exits."""

    def order(self, row):
        return row.num_real_tokens

    @staticmethod
    def run(order):
        raise SystemExit("the row work exits")

    def apply(self, row, result):
        return row


@pytest.mark.timeout(30)  # the failure this guards against is a loader waiting forever
@pytest.mark.parametrize("make", [InlineRunner, ThreadRunner, ProcessRunner], ids=lambda c: c.name)
def test_system_exit_from_a_packers_row_work_stops_the_loader_as_itself(tmp_path, make, monkeypatch):
    """Row work reaches the loader through a done-callback; a SystemExit re-raised there used to
    escape it, ending the thread runner's pool thread or the process runner's reader thread and
    leaving the row pending for ever."""
    monkeypatch.setattr(PackFlatOp, "row_work", lambda op, on_error, record_operators: _ExitingRowWork(), raising=False)
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=make)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(SystemExit, match="the row work exits"):
            next(iter(loader))


class _PassingRowWork:
    """A packer's row work that goes through the runner and changes nothing."""

    def order(self, row):
        return row.num_real_tokens

    @staticmethod
    def run(order):
        return order

    def apply(self, row, result):
        return row


def _counting_done_callbacks(base: type, added: list[tuple[str, list[int]]]) -> type:
    """`base`, whose futures count the done-callbacks added to them, each noted in `added` with the
    kind of item it ran."""

    class CountingDoneCallbacks(base):
        def submit(self, stage_index: int, item):
            future = super().submit(stage_index, item)
            count = [0]
            add = future.add_done_callback

            def counted(fn) -> None:
                count[0] += 1
                add(fn)

            future.add_done_callback = counted
            added.append((type(item).__name__, count))
            return future

    return CountingDoneCallbacks


@pytest.mark.parametrize("make", [InlineRunner, ThreadRunner, ProcessRunner], ids=lambda c: c.name)
def test_the_loader_adds_one_done_callback_to_each_runner_future(tmp_path, make, monkeypatch):
    """A done-callback raising a BaseException skips that future's later callbacks, as in
    concurrent.futures (runners/README.md). None of them is ever the loader's: it adds one callback
    to each future a runner gives it, a chunk's stage or a row's work, and nothing else adds any."""
    monkeypatch.setattr(PackFlatOp, "row_work", lambda op, on_error, record_operators: _PassingRowWork(), raising=False)
    added: list[tuple[str, list[int]]] = []
    runner = _counting_done_callbacks(make, added)
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=runner, parallelism=2)
    with pipeline.options(read_parallelism=1).shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        assert len(loader.stages) == 2  # read, then tokenize: the second is submitted from a done-callback
        for _ in loader:
            pass
    assert {kind for kind, _ in added} == {"Chunk", "ChunkRecords", "RowWork"}, added  # each stage, and row work
    assert [count for _, [count] in added] == [1] * len(added)


class _CrashingRowWork:
    """A packer's row work whose pure part kills the worker running it (a decoder that segfaults)."""

    def order(self, row):
        return row.num_real_tokens

    @staticmethod
    def run(order):
        os._exit(3)

    def apply(self, row, result):
        return row


def test_row_work_that_always_crashes_its_worker_fails_naming_the_rows_records(tmp_path, monkeypatch):
    """A chunk that crashes its worker for good fails naming the chunk; the row work a packer has
    done on the workers (vlm decoding deferred images: a decoder that segfaults on one image)
    failed with WorkerCrashedError naming only the stage, so nothing said which records to look at."""
    from runners import WorkerCrashedError

    monkeypatch.setattr(PackFlatOp, "row_work", lambda op, on_error, record_operators: _CrashingRowWork(),
                        raising=False)
    dataset = jsonl_dataset(tmp_path / "data")
    pipeline = text_pipeline(dataset, runner=functools.partial(ProcessRunner, max_retries=0))
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(WorkerCrashedError) as info:
            next(iter(loader))
    notes = "\n".join(getattr(info.value, "__notes__", ()))
    assert "exited with code 3" in str(info.value)
    assert "row work" in notes and re.search(r"d:\S*part-0000[01]\.jsonl#\d+", notes), notes


def _text_of_victim(record: dict):
    return record["text"] if record["id"] == VICTIM else record


def test_a_map_that_returns_no_record_fails_naming_the_map_and_the_record(tmp_path):
    """A map must return a dict (or None to drop the record): anything else used to surface in the
    next stage as a bare AttributeError ('str' object has no attribute 'get') with no address."""
    dataset = jsonl_dataset(tmp_path / "data")
    with pytest.raises(UserFunctionError) as info:
        run_epoch(text_pipeline(dataset, map_fn=_text_of_victim), keep_batches=False)
    assert info.value.operator == "map"
    assert info.value.address in {address(dataset, shard, 9) for shard in range(SHARDS)}
    assert "returned a str, not a record (a dict) or None" in info.value.original


# -- storage ------------------------------------------------------------------------------------
class FlakyStore(MemoryFileSystem):
    """A real fsspec filesystem (memory-backed, protocol `flakyrel://`) whose next `failing_opens`
    opens and next `failing_reads` reads fail like a dropped connection. Each failure is appended to
    `log` (a local file, so failures in forked workers are seen too)."""

    protocol = "flakyrel"
    root_marker = ""
    store: ClassVar[dict] = {}
    pseudo_dirs: ClassVar[list] = [""]
    failing_opens = 0
    failing_reads = 0
    log: Path | None = None
    _lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path):
        prefix = f"{cls.protocol}://"
        return (path.removeprefix(prefix)).strip("/")

    @classmethod
    def arm(cls, *, opens: int = 0, reads: int = 0, log: Path) -> None:
        cls.failing_opens, cls.failing_reads, cls.log = opens, reads, log
        log.write_text("")

    @classmethod
    def _fail(cls, kind: str, path: str) -> bool:
        with cls._lock:
            left = getattr(cls, f"failing_{kind}")
            if left <= 0:
                return False
            setattr(cls, f"failing_{kind}", left - 1)
        with open(cls.log, "a") as log:
            log.write(f"{time.monotonic()} {kind} {path}\n")
        return True

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "r" not in mode:
            return f
        if FlakyStore._fail("opens", path):
            raise ConnectionResetError(f"connection reset while opening {path}")
        return _FlakyReader(f.getvalue(), path)  # an object store's reader: one per open

    @classmethod
    def failures(cls) -> list[tuple[float, str, str]]:
        rows = [line.split(" ", 2) for line in cls.log.read_text().splitlines()]
        return [(float(t), kind, path) for t, kind, path in rows]


class _FlakyReader(io.BytesIO):
    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(data)
        self.path = path

    def read(self, *args):
        if FlakyStore._fail("reads", self.path):
            raise TimeoutError(f"read timed out on {self.path}")
        return super().read(*args)


@pytest.fixture
def flaky_store():
    with registered(FlakyStore) as store:
        store.failing_opens = store.failing_reads = 0
        root = "flakyrel://corpus"
        for shard in range(SHARDS):
            with fsspec.open(f"{root}/part-{shard:05d}.jsonl", "wb") as f:
                f.write(b"".join(line + b"\n" for line in jsonl_lines(clean_records(PER_SHARD, shard))))
        try:
            yield store, root
        finally:
            store.failing_opens = store.failing_reads = 0


def test_transient_read_errors_are_retried_with_backoff_and_change_nothing(flaky_store, tmp_path, monkeypatch):
    store, root = flaky_store
    dataset = Dataset.from_path("d", root, retries=4, retry_delay=0.05)
    reference = run_epoch(text_pipeline(dataset), keep_batches=False)
    waits = []  # the pauses the retry policy asks for, in order (the sleeps still happen)
    monkeypatch.setattr(_retry, "time", SimpleNamespace(sleep=lambda seconds: waits.append(seconds) or time.sleep(seconds)))
    store.arm(opens=2, reads=1, log=tmp_path / "failures")
    run = run_epoch(text_pipeline(dataset), keep_batches=False)
    failures = store.failures()
    assert [kind for _, kind, _ in failures] == ["opens", "opens", "reads"]
    assert len({path for _, _, path in failures}) == 1, "the same chunk read failed three times, then succeeded"
    assert waits == [0.05, 0.1, 0.2], "exponential backoff between attempts"
    assert run.digests == reference.digests and run.totals == reference.totals
    assert_ledger_balances(run, {"d": SHARDS * PER_SHARD})


def test_transient_read_errors_in_worker_processes_are_retried_and_change_nothing(flaky_store, tmp_path):
    store, root = flaky_store
    dataset = Dataset.from_path("d", root, retries=3, retry_delay=0.01)
    reference = run_epoch(text_pipeline(dataset), keep_batches=False)
    store.arm(opens=1, reads=1, log=tmp_path / "failures")  # each forked worker inherits the counters
    run = run_epoch(text_pipeline(dataset, runner=ProcessRunner(), parallelism=2), keep_batches=False)
    failures = store.failures()
    assert failures and len(failures) % 2 == 0, "every worker that read failed once on open, once on read"
    assert run.digests == reference.digests and run.totals == reference.totals


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_permanent_read_error_fails_with_the_files_url(flaky_store, tmp_path, runner):
    store, root = flaky_store
    dataset = Dataset.from_path("d", root, retries=3, retry_delay=0.01)
    store.arm(opens=10**9, log=tmp_path / "failures")
    with pytest.raises(ShardUnavailableError) as info:
        run_epoch(text_pipeline(dataset, runner=runner), keep_batches=False)
    error = info.value
    assert error.url in {shard.url for shard in dataset.shards} and error.url.startswith("flakyrel://")
    assert error.url in str(error) and error.attempts == 3
    assert "ConnectionResetError" in error.cause


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_shard_regenerated_in_place_after_planning_fails_the_run_naming_it_on_every_runner(tmp_path, runner):
    """A dataset regenerated in place between planning and reading (here its lines reordered: as
    many bytes) was read at the planned offsets, and its new lines went out under the planned
    addresses, in the loader and in worker processes alike. The run now fails naming the shard."""
    dataset = jsonl_dataset(tmp_path, retry_delay=0)
    shard = Path(dataset.shards[1].url)
    planned = shard.stat()
    shard.write_bytes(b"".join(line + b"\n" for line in reversed(shard.read_bytes().splitlines())))
    os.utime(shard, ns=(planned.st_atime_ns, planned.st_mtime_ns + 10**9))  # a later write, whatever the clock's grain
    with pytest.raises(ShardUnavailableError, match="changed after planning") as info:
        run_epoch(text_pipeline(dataset, runner=runner), keep_batches=False)
    assert info.value.url == str(shard) and info.value.attempts == 1


def _exit_on_victim(record: dict) -> dict:
    if record["id"] == VICTIM:
        os._exit(3)  # a crash, not an exception: nothing names the record but the loader
    return record


def test_a_record_that_always_crashes_its_worker_fails_naming_its_chunk(tmp_path):
    from runners import WorkerCrashedError

    dataset = jsonl_dataset(tmp_path / "data")
    pipeline = text_pipeline(dataset, runner=ProcessRunner(max_retries=1), map_fn=_exit_on_victim)
    with pytest.raises(WorkerCrashedError) as info:
        run_epoch(pipeline, keep_batches=False)
    notes = "\n".join(getattr(info.value, "__notes__", ()))
    assert "exited with code 3" in str(info.value)
    found = re.search(r"Chunk\(dataset='d', shard=(\d+), start=(\d+), stop=(\d+)\) \((.*?)\)", notes)
    assert found, notes
    shard, start, stop = map(int, found.groups()[:3])
    assert start <= 9 < stop and found[4] == dataset.shards[shard].url
