"""Checkpoint cost (SPEC §3.3, §8): state size against the number of lanes, and time to the first
batch after a resume at an early and a late step against a fresh start.

    python -m pytest benchmarks/test_checkpoint_bench.py --benchmark-only

Size: the merged JSON state (what a checkpoint stores) after every lane has passed at least one
flush, so per-lane ledgers are populated; `extra_info` holds `bytes` and `bytes_per_lane`. The
timed part is what a checkpoint call costs: the rank's `state_dict()`, `merge_states` and
`json.dumps`; nothing is asserted about timing.

Resume, two scopes: `restart` (end to end, as a restarted job pays it: build the rank's loader,
load the state, take the first microbatch) and `replay` (load the state into a built loader and
take the first microbatch: the part that could grow with depth). `extra_info` holds the step, the
rows each lane replays (the state's `skip`, bounded by one flush segment whatever the depth) and
`ratio_to_fresh`, the median over a fresh start's in the same scope.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from zephon import merge_states
from zephon.demo._recipe import demo_pipeline

RECORDS_PER_CHUNK = 4  # 256 lanes need at least 256 chunks of every shipped dataset
FLUSH_EVERY_CHUNKS = 2  # a segment is about 30 rows of 256 tokens per lane: flushes come early
MAX_LENGTH = 256
RUNNER, PARALLELISM = "thread", 2  # recorded in every row, as the other suites' rows record theirs


def pipeline(num_lanes: int, microbatch_size: int):
    return demo_pipeline(
        runner=RUNNER, parallelism=PARALLELISM, num_lanes=num_lanes, max_length=MAX_LENGTH,
        microbatch_size=microbatch_size, records_per_chunk=RECORDS_PER_CHUNK,
    ).options(flush_every_chunks=FLUSH_EVERY_CHUNKS)


# -- size -------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_lanes", [8, 32, 128, 256])
def test_checkpoint_bytes_against_num_lanes(benchmark, record_build, num_lanes):
    global_batch = num_lanes  # one row per lane per step
    with pipeline(num_lanes, 1).shard(0, 1, global_batch_size=global_batch) as loader:
        it = iter(loader)
        steps = 0
        while True:  # until every lane has flushed at least once
            for _ in range(global_batch):
                next(it)
            steps += 1
            if all(cursor[0] > 0 for cursor in loader.state_dict()["lanes"].values()):
                break
        text = benchmark(lambda: json.dumps(merge_states([loader.state_dict()])))
    size = len(text.encode())
    record_build.update(
        runner=RUNNER, parallelism=PARALLELISM, num_lanes=num_lanes, steps=steps, bytes=size, bytes_per_lane=round(size / num_lanes, 1),
        kib=round(size / 1024, 2),
    )
    assert json.loads(text)["num_lanes"] == num_lanes


# -- time to first batch ----------------------------------------------------------------------
NUM_LANES, MICROBATCH, GLOBAL_BATCH = 8, 2, 32
RESUME_STEPS = {"fresh": None, "early": 2, "late": 160}
_medians: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def resume_states() -> dict:
    """The merged state after `step` global steps, for each resume point."""
    states = {}
    with pipeline(NUM_LANES, MICROBATCH).shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        per_step = GLOBAL_BATCH // MICROBATCH
        it = iter(loader)
        done = 0
        for name, step in sorted(((n, s) for n, s in RESUME_STEPS.items() if s is not None), key=lambda kv: kv[1]):
            for _ in range((step - done) * per_step):
                next(it)
            done = step
            states[name] = merge_states([loader.state_dict()])
    return states


def _restart(state, opened: list):
    """A restarted job: build the rank's loader, load the state, take the first microbatch."""
    loader = pipeline(NUM_LANES, MICROBATCH).shard(0, 1, global_batch_size=GLOBAL_BATCH)
    opened.append(loader)
    if state is not None:
        loader.load_state_dict(state)
    return next(iter(loader))


def _replay(loader, state):
    """Only what depends on the state: load it into a built loader and take the first microbatch."""
    loader.load_state_dict(state)
    return next(iter(loader))


def _measure(scope: str, state, rounds: int) -> float:
    """Median seconds without pytest-benchmark, for a ratio whose baseline did not run."""
    times: list[float] = []
    opened: list = []
    try:
        if scope == "restart":
            for _ in range(rounds):
                t0 = time.perf_counter()
                _restart(state, opened)
                times.append(time.perf_counter() - t0)
        else:
            with pipeline(NUM_LANES, MICROBATCH).shard(0, 1, global_batch_size=GLOBAL_BATCH) as built:
                target = state if state is not None else built.state_dict()
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    _replay(built, target)
                    times.append(time.perf_counter() - t0)
    finally:
        for loader in opened:
            loader.close()
    return statistics.median(times)


@pytest.mark.parametrize("scope", ["restart", "replay"])
@pytest.mark.parametrize("point", list(RESUME_STEPS))
def test_time_to_first_batch_after_resume(benchmark, record_build, resume_states, point, scope):
    """`restart`: end to end, as a restarted job pays it (the plan's token estimation included,
    the same at every step). `replay`: the part that could grow with depth."""
    state = resume_states.get(point)
    if scope == "restart":
        opened: list = []
        try:
            batch = benchmark.pedantic(_restart, args=(state, opened), rounds=3, iterations=1)
        finally:
            for loader in opened:
                loader.close()
    else:
        with pipeline(NUM_LANES, MICROBATCH).shard(0, 1, global_batch_size=GLOBAL_BATCH) as built:
            target = state if state is not None else built.state_dict()  # fresh: the initial cursors
            batch = benchmark.pedantic(_replay, args=(built, target), rounds=7, iterations=1, warmup_rounds=1)
    step = RESUME_STEPS[point] or 0
    assert batch.step == step
    skips = [cursor[1] for cursor in state["lanes"].values()] if state else [0]
    segments = [cursor[0] for cursor in state["lanes"].values()] if state else [0]
    record_build.update(
        runner=RUNNER, parallelism=PARALLELISM, scope=scope, point=point, step=step, num_lanes=NUM_LANES, global_batch_size=GLOBAL_BATCH,
        replayed_rows_per_lane_max=max(skips), replayed_rows_per_lane_mean=round(statistics.mean(skips), 1),
        flush_segments_passed_min=min(segments),
    )
    if benchmark.disabled:  # --benchmark-disable: each case ran once as a test, nothing was timed
        return
    median = benchmark.stats.stats.median
    _medians[scope, point] = median
    fresh = _medians.get((scope, "fresh")) or _measure(scope, None, 3)
    record_build.update(median_s=round(median, 4), ratio_to_fresh=round(median / fresh, 3))
