"""Finished work is freed by reference counting, not left for the cyclic garbage collector.

A reference cycle through a chunk's future keeps the chunk's records (token arrays, decoded
pixels) alive until a collection happens to run; on free-threaded 3.14 that let hundreds of
chunks pile up. With the collector off, only what the loader really holds may be alive.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest

from zephon import ChunkRecords, Pipeline
from zephon._packing import FlatRowPlan
from zephon._runner_closer import THREAD_NAME as RUNNER_CLOSER
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

NUM_LANES = 4
PREFETCH = 2


def live(kind: type) -> int:
    return sum(1 for obj in gc.get_objects() if type(obj) is kind)


def most_alive(pipeline, kind: type, steps: int, every: int = 1) -> int:
    """The most objects of `kind` alive at once over `steps` microbatches, with the collector off,
    beyond those alive before the loader started (an earlier test's thread still winding down
    holds a few: counted, they failed this test in a full 3.14t run and never alone)."""
    gc.collect()
    gc.disable()
    before = live(kind)
    try:
        most = 0
        with pipeline.shard(0, 1) as loader:
            for step, _ in enumerate(loader):
                if step % every == every - 1:
                    most = max(most, live(kind))
                if step == steps:
                    break
    finally:
        gc.enable()
    return most - before


@pytest.mark.parametrize("runner", ["inline", "thread"])
def test_only_the_prefetch_window_of_chunks_stays_alive(demo_data_dir, demo_tokenizer_path, runner):
    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0,
                                     records_per_chunk=4)
    pipeline = (
        Pipeline(source)
        .options(num_lanes=NUM_LANES, runner=runner, prefetch=PREFETCH)
        .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text", parallelism=2)
        .pack_flat(max_length=512, algorithm="wrap")
        .shuffle(buffer_size=4, seed=0)
        .batch(microbatch_size=4)
    )
    most = most_alive(pipeline, ChunkRecords, steps=200, every=10)
    # each lane: its prefetch window, plus the chunk it is packing and one being handed over
    assert most <= NUM_LANES * (PREFETCH + 2), f"{most} chunks alive"


SHUFFLE = 8
MAX_LENGTH = 4096  # longer than any KJV record (3,419 tokens at most): a record closes at most one row


def test_rows_a_flush_emitted_are_freed_once_the_loader_took_them(demo_data_dir, demo_tokenizer_path):
    """At a segment's flush every open row and the shuffle buffer come out at once (for VLM rows,
    each holds its decoded images). Once the loader took such a row, the lane must not keep it:
    kept until the next flush, the rows of the last flush doubled what a lane holds."""
    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0,
                                     records_per_chunk=8)
    pipeline = (
        Pipeline(source)
        .options(num_lanes=NUM_LANES, runner="inline", prefetch=1, flush_every_chunks=8)
        .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text")
        .pack_flat(max_length=MAX_LENGTH, algorithm="wrap")
        .shuffle(buffer_size=SHUFFLE, seed=0)
        .batch(microbatch_size=2)
    )
    most = most_alive(pipeline, FlatRowPlan, steps=300)  # pack_flat hands over plans, not PackedSequences
    assert most >= NUM_LANES * SHUFFLE // 2, f"{most} rows alive: the check below must have something to see"
    # each lane: a full shuffle buffer and the packer's open row, or what a flush emitted (the
    # same rows), plus the lane's look-ahead row and the microbatch being collated
    assert most <= NUM_LANES * (SHUFFLE + 2) + 2, f"{most} rows alive"


@pytest.mark.parametrize("runner", ["thread", "process"])
def test_a_loader_dropped_unclosed_mid_iteration_frees_its_runner(demo_data_dir, demo_tokenizer_path, runner):
    """A process runner's reader thread holds the runner, and its stage functions held the loader:
    every loader a job dropped without close() kept its workers, threads, descriptors and shared
    memory until the interpreter exited. Now the loader is collected and closes its runner."""
    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0)
    pipeline = (Pipeline(source).options(num_lanes=NUM_LANES, runner=runner)
                .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text", parallelism=2)
                .pack_flat(max_length=256).batch(microbatch_size=2))
    threads_before = set(threading.enumerate())
    loader = pipeline.shard(0, 1)
    batches = iter(loader)
    next(batches)
    threads_before |= {t for t in threading.enumerate() if t.name == RUNNER_CLOSER}  # it serves every loader
    workers = loader._runner.worker_pids() if runner == "process" else []
    shm = loader._runner.shm_directory if runner == "process" else None
    assert runner == "thread" or (workers and shm and os.path.isdir(shm)), "the check below must have something to see"
    dropped = weakref.ref(loader)
    del loader, batches
    gc.collect()
    assert dropped() is None, "nothing may keep a dropped loader alive"
    deadline = time.monotonic() + 30
    # The closer thread removes the directory after the workers exit and the reader thread ends.
    while time.monotonic() < deadline and (set(threading.enumerate()) - threads_before or any(_alive(p) for p in workers)
                                           or (shm is not None and os.path.exists(shm))):
        time.sleep(0.05)
    assert not set(threading.enumerate()) - threads_before, "the runner's threads ended"
    assert not any(_alive(pid) for pid in workers), "the workers exited"
    assert shm is None or not os.path.exists(shm), "the shared-memory directory is gone"


def _alive(pid: int) -> bool:
    """Running, not exited (a zombie waiting to be reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_forked_child_dropping_its_copy_of_a_loader_leaves_the_parents_runner_alone(demo_data_dir,
                                                                                       demo_tokenizer_path):
    """A child forked while a loader is open (a torch DataLoader worker, say) holds a copy of it;
    collecting that copy there must not close the runner: that would stop the parent's workers."""
    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0)
    pipeline = (Pipeline(source).options(num_lanes=NUM_LANES, runner="process")
                .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text", parallelism=2)
                .pack_flat(max_length=256).batch(microbatch_size=2))
    loader = pipeline.shard(0, 1)  # no `with`: its exit would hold the loader in the child too
    batches = iter(loader)
    next(batches)
    workers = loader._runner.worker_pids()
    child = os.fork()
    if child == 0:
        dropped = weakref.ref(loader)
        del loader, batches
        gc.collect()
        os._exit(0 if dropped() is None else 3)
    try:
        assert os.waitpid(child, 0)[1] == 0, "the child collected its copy of the loader"
        assert all(_alive(pid) for pid in workers) and loader._runner.worker_pids() == workers
        for _ in range(20):
            next(batches)
    finally:
        loader.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("runner", ["thread", "process"])
def test_a_forked_child_iterating_its_copy_of_a_loader_gets_the_same_batches_and_leaves_the_parent_alone(
        tmp_path, runner):
    """A child forked after the loader's runner started (a torch DataLoader worker iterating its
    copy) cannot use that runner: a thread pool's threads did not survive the fork, and a process
    runner's workers answer the parent's reader thread, which paired the child's replies with the
    parent's items (or stopped on them). The child must get a runner of its own."""
    from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline

    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=runner, parallelism=2)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = [batch.digest() for batch in loader]
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    batches = iter(loader)
    assert [next(batches).digest() for _ in range(2)] == reference[:2]
    out = tmp_path / "child"
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.alarm(60)  # a child stuck waiting for replies dies instead of hanging the test
            out.write_text("\n".join(batch.digest() for batch in loader))
            loader.close()
            code = 0
        finally:
            os._exit(code)
    try:
        assert os.waitpid(child, 0)[1] == 0, "the child iterated its copy to the end"
        assert out.read_text().split("\n") == reference[2:]
        assert [batch.digest() for batch in batches] == reference[2:]
    finally:
        loader.close()


def test_a_closed_loaders_lane_plans_are_freed_with_it(demo_data_dir, demo_tokenizer_path):
    """The plans' epoch permutations were cached in one cache shared by every plan, which kept up to
    32 plans (every lane's chunk lists) of loaders long closed alive."""
    from zephon.work._plan import TokenInterleave

    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0)
    pipeline = (Pipeline(source).options(num_lanes=NUM_LANES, runner="inline")
                .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text")
                .pack_flat(max_length=256).batch(microbatch_size=2))
    gc.collect()
    before = live(TokenInterleave)
    with pipeline.shard(0, 1) as loader:
        next(iter(loader))
        assert live(TokenInterleave) == before + NUM_LANES, "the check below must have something to see"
    del loader
    gc.collect()
    assert live(TokenInterleave) == before


@pytest.mark.parametrize("take_over", ["close", "new_iteration", "load_state_dict"])
def test_lane_streams_a_loader_is_done_with_are_freed_without_the_cyclic_collector(
    demo_data_dir, demo_tokenizer_path, take_over
):
    """A lane stream's row generator holds the stream, so a stream the loader dropped (at close, at
    a new iteration, at load_state_dict) kept its shuffle buffer, its open rows and the token arrays
    (for VLM, the images) they reference until a cyclic collection happened to run."""
    from zephon._lane import LaneStream

    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0,
                                     records_per_chunk=4)
    pipeline = (Pipeline(source).options(num_lanes=NUM_LANES, runner="inline", prefetch=PREFETCH)
                .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text")
                .pack_flat(max_length=256).shuffle(buffer_size=4, seed=0).batch(microbatch_size=2))
    gc.collect()
    gc.disable()
    try:
        loader = pipeline.shard(0, 1)
        state = loader.state_dict()
        batches = iter(loader)
        for _ in range(NUM_LANES + 1):
            next(batches)
        assert live(LaneStream) == NUM_LANES, "the check below must have something to see"
        if take_over == "close":
            loader.close()
            expected = 0
        elif take_over == "new_iteration":
            next(iter(loader))
            expected = NUM_LANES
        else:
            loader.load_state_dict(state)
            expected = 0
        del batches
        assert live(LaneStream) == expected, "only the streams the loader holds may be alive"
        loader.close()
    finally:
        gc.enable()


@pytest.mark.parametrize("iterated", [False, True], ids=["fresh", "iterated"])
def test_a_closed_loader_refuses_to_be_iterated_again_instead_of_starting_over(
    demo_data_dir, demo_tokenizer_path, iterated
):
    """close() ends a loader for good: iterated again, it started a new runner (that nothing would
    close) and handed over batches from its cursors as if it had never been closed."""
    from zephon import ConfigurationError

    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0)
    pipeline = (Pipeline(source).options(num_lanes=NUM_LANES, runner="thread")
                .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text")
                .pack_flat(max_length=256).batch(microbatch_size=2))
    with pipeline.shard(0, 1) as loader:
        if iterated:
            next(iter(loader))
    with pytest.raises(ConfigurationError, match="this loader is closed"):
        next(iter(loader))
    with pytest.raises(ConfigurationError, match="this loader is closed"):
        loader.runner_info
    assert loader._runner is None, "no runner was started again"


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("runner", ["thread", "process"])
def test_a_child_forked_while_a_parent_thread_resolves_a_chunk_iterates_its_copy_without_hanging(tmp_path, runner):
    """The parent's pool threads (or its process runner's reader thread) resolve the lanes' chunk
    futures all the time, each holding the future's lock for an instant; a fork at that instant
    (a torch DataLoader starting its workers) leaves that lock held in the child for good. The
    child, dropping the streams it copied to start its own, cancelled their futures, so it waited
    for that lock forever at its first batch. The fork's instant is made certain here by holding
    one future's lock in a parent thread while forking."""
    from concurrent.futures import Future

    from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline

    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner=runner, parallelism=2, num_epochs=None)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        reference = [batch.digest() for batch, _ in zip(loader, range(12))]
    loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
    batches = iter(loader)
    assert next(batches).digest() == reference[0]
    futures = [entry for stream in loader._streams.values() for entry in stream._pending if isinstance(entry, Future)]
    assert futures, "the check below must have something to see"
    held, release = threading.Event(), threading.Event()

    def resolve() -> None:  # what a pool thread does inside Future.set_result
        with futures[0]._condition:
            held.set()
            release.wait()

    resolver = threading.Thread(target=resolve)
    resolver.start()
    held.wait()
    out = tmp_path / "child"
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.alarm(15)  # a child stuck on the lock dies instead of hanging the test
            out.write_text("\n".join(batch.digest() for batch, _ in zip(loader, range(11))))
            loader.close()
            code = 0
        finally:
            os._exit(code)
    try:
        release.set()
        resolver.join()
        assert os.waitpid(child, 0)[1] == 0, "the child iterated its copy (it hung, killed by its alarm)"
        assert out.read_text().split("\n") == reference[1:]
    finally:
        loader.close()


_ITERATE_ONE_BATCH_AND_EXIT = """
import os, sys, threading, time
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

data, tokenizer = sys.argv[1], sys.argv[2]

def slow(record):  # slow enough that no item is taken and finished between "exit" and the exit hook
    os.write(1, b"start\\n")
    time.sleep(0.5)
    os.write(1, b"record\\n")
    return record

source = StaticMixtureWorkSource([Dataset.from_path("kjv", data + "/kjv")], records_per_chunk=1)
pipeline = (Pipeline(source).options(num_lanes=4, runner="thread").map(slow, parallelism=2)
            .tokenize(tokenizer, field="text").pack_flat(64).batch(2))
batches = iter(pipeline.shard(0, 1))  # held: the exit hook, not the closer thread, stops its runner
next(batches)
# Threading's exit hooks run last registered first: this one says "hook" in the instant before
# the thread runners' own (registered as `runners.thread` was imported) stops them.
threading._register_atexit(lambda: os.write(1, b"hook\\n"))
os.write(1, b"exit\\n")
"""


def test_an_unclosed_thread_runner_loader_cancels_its_queued_chunks_at_interpreter_exit(demo_data_dir,
                                                                                        demo_tokenizer_path):
    """A loader left unclosed is stopped by the thread runner's exit hook: queued items are
    cancelled, and those running finish rather than being cut off where interpreter finalization
    finds their daemon threads. (With `concurrent.futures` pools, which join their threads at exit
    after draining the queue, every prefetched chunk ran first: 15 here.) A map thread may take
    one more item in the moment between "exit" and the hook, if the one it runs ends then: a CI
    run saw that with items of 0.2 s."""
    done = subprocess.run(
        [sys.executable, "-c", _ITERATE_ONE_BATCH_AND_EXIT, str(demo_data_dir), str(demo_tokenizer_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    # Counted from the instant before the hook, not from "exit": a machine that held the main
    # thread up for an item's 0.5 s between the two let a map thread take two more items, rightly.
    after_hook = lines[lines.index("hook") + 1:]
    map_threads = 2
    assert after_hook.count("start") <= map_threads, (after_hook, done.stderr)
    assert lines.count("record") == lines.count("start"), (lines, done.stderr)


_HANG_AFTER_ONE_BATCH = """
import os, sys, threading
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

data, tokenizer, close = sys.argv[1], sys.argv[2], sys.argv[3] == "close"
taken, hanging, never = threading.Event(), threading.Event(), threading.Event()

def hang_once_a_batch_is_taken(record):  # a hung network read, a deadlock in a C library
    if taken.is_set():
        hanging.set()
        never.wait()
    return record

source = StaticMixtureWorkSource([Dataset.from_path("kjv", data + "/kjv")], records_per_chunk=1)
pipeline = (Pipeline(source).options(num_lanes=4, runner="thread").map(hang_once_a_batch_is_taken, parallelism=2)
            .tokenize(tokenizer, field="text").pack_flat(64).batch(2))
loader = pipeline.shard(0, 1)
batches = iter(loader)
next(batches)
taken.set()

def train_on():  # the trainer's loop goes on until it needs a chunk the hung map holds
    try:
        for _ in batches:
            pass
    except Exception:  # the close below ends it
        pass

threading.Thread(target=train_on, daemon=True).start()
if hanging.wait(60):
    os.write(1, b"hanging\\n")
if close:
    loader.close()
    os.write(1, b"closed\\n")
os.write(1, b"exit\\n")
"""


@pytest.mark.parametrize("close", ["close", "exit unclosed"])
def test_a_thread_runner_loader_whose_map_never_returns_lets_the_process_exit_and_names_the_hung_stage(
        demo_data_dir, demo_tokenizer_path, close):
    """A map that never returns (a hung read, a deadlock in a C library) kept its pool thread
    running for good, and `close()` and interpreter exit both waited for it without a timeout:
    the training job never ended. Now both wait `close_timeout_s`, then leave the thread behind (a
    daemon thread, which exit does not wait for) with a warning naming the stage and the function
    it is stuck in."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _HANG_AFTER_ONE_BATCH, str(demo_data_dir), str(demo_tokenizer_path), close],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the process did not exit in 60 s: {hung.stdout!r} {hung.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["hanging"] + (["closed"] if close == "close" else []) + ["exit"], done.stderr
    assert "stage 'read+map'" in done.stderr and "hang_once_a_batch_is_taken" in done.stderr, done.stderr


_EXIT_WHILE_READING_PARQUET = """
import sys
import time
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

data, ending = sys.argv[1], sys.argv[2]
source = StaticMixtureWorkSource([Dataset.from_path("p", data)], seed=0, records_per_chunk=2000)
loader = Pipeline(source).options(num_lanes=2, runner="thread").pack_flat(256).batch(2).shard(0, 1)

# Whether a thread inside the Parquet reader's read() has pyarrow's code innermost: it is calling
# into pyarrow's C++ (caught anywhere in read(), mostly in a Python part of it, none of 75 runs
# aborted with the exit hook removed; caught so, 5 of 75 did).
# Every thread is looked at: one read thread elsewhere in read() does not hide another in pyarrow.
def a_read_thread_in_pyarrow() -> bool:
    for frame in sys._current_frames().values():
        innermost = frame
        while frame is not None:
            if frame.f_code.co_name == "read" and frame.f_code.co_filename.endswith("_parquet.py"):
                if "pyarrow" in innermost.f_code.co_filename:
                    return True
                break
            frame = frame.f_back
    return False

# Batches are taken until a read thread is caught so: the read threads rest once the prefetch windows
# are full, so the loop drains them (on 3.14t they filled before a first check after one batch).
# The data is endless: a machine too loaded to catch one in `looking_s` says "idle" and exits all the
# same, rather than looking until the test's timeout takes it for an exit that hung.
looking_s = float(sys.argv[3])
give_up = time.monotonic() + looking_s
caught = False
for batch in loader:
    if (caught := a_read_thread_in_pyarrow()) or time.monotonic() > give_up:
        break
print("reading" if caught else "idle", flush=True)
if ending == "exception":
    raise RuntimeError("the training loop failed")  # escapes the script, the loader unclosed
sys.exit()
"""


def _parquet_shards(directory, shards: int, rows: int) -> None:
    """`shards` Parquet files of `rows` rows of 64 token ids, 100 rows a row group: a chunk of 2,000
    rows reads 20 row groups, and the prefetch windows keep the read threads busy for a while."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokens = pa.ListArray.from_arrays(
        pa.array(np.arange(0, 64 * rows + 1, 64, dtype=np.int32)), pa.array(np.arange(64 * rows) % 1000)
    )
    for shard in range(shards):
        pq.write_table(pa.table({"input_ids": tokens}), directory / f"s{shard}.parquet", row_group_size=100)


def test_a_loader_left_unclosed_while_its_threads_read_parquet_exits_without_aborting(tmp_path):
    """A training script often ends without closing its loader (`sys.exit()` after the loop, an
    exception escaping it). On 3.11 a daemon thread still inside pyarrow when finalization begins
    is ended by unwinding through C++ frames, which aborts the process (`terminate called
    without an active exception`, or a `PyGILState_Release` fatal error); on 3.14 it is hung for good
    instead (the process still exits: none of 50 runs failed there, with the hook or without). The
    thread runner's exit hook, which runs before finalization, stops the read threads at their
    next chunk and waits for them (`close_timeout_s`), so none is in pyarrow then. With the hook
    removed, 13 of 150 runs of this script aborted on 3.11 (2 busy cores); with it, none of 150.
    Each run ends as a read thread calls into pyarrow, and says it did, so that 60 runs test the exit
    they mean to; one that found no such moment says so, is checked all the same, and is run again."""
    from concurrent.futures import ThreadPoolExecutor

    _parquet_shards(tmp_path, shards=2, rows=20_000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(ending: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([sys.executable, "-c", _EXIT_WHILE_READING_PARQUET, str(tmp_path), ending, "20"],
                                  capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired as hung:
            pytest.fail(f"a run ending by {ending} did not exit in 120 s: {hung.stdout!r} {hung.stderr!r}")

    # 30 exits of each ending caught reading; a run that said "idle" (a loaded machine, no read thread
    # caught in pyarrow in its 20 s) is checked like the others and run again, up to 10 runs more.
    wanted = ["exit", "exception"] * 30
    done: list[tuple[str, subprocess.CompletedProcess]] = []
    with ThreadPoolExecutor(2) as pairs:  # two at a time: 60 runs in well under a minute
        while wanted and len(done) + len(wanted) <= 70:
            ran = list(zip(wanted, pairs.map(run, wanted)))
            done += ran
            wanted = [ending for ending, ended in ran if ended.stdout.split() == ["idle"]]
    assert not wanted, f"{len(done)} runs, {len(wanted)} of the last of them caught no read thread in pyarrow"
    for ending, ended in done:
        assert "terminate called" not in ended.stderr and "Fatal Python error" not in ended.stderr, ended.stderr
        assert ended.returncode == (0 if ending == "exit" else 1), (ending, ended.returncode, ended.stderr)
        assert ended.stdout.split() in (["reading"], ["idle"]), (ending, ended.stdout, ended.stderr)
        if ending == "exception":
            assert ended.stderr.rstrip().endswith("RuntimeError: the training loop failed"), ended.stderr
