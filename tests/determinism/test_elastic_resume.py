"""Checkpoint on R ranks, resume on R′: every later microbatch and global batch is bit-identical
to the uninterrupted run (SPEC §3.3, §5)."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from tests.harness import (
    GLOBAL_BATCH,
    checkpoint_after,
    consumed_keys,
    microbatch_digests,
    microbatches_per_rank_step,
    step_digests,
    text_pipeline,
)
from zephon import CheckpointError, merge_states

TOTAL_STEPS = 14


@pytest.fixture(scope="module")
def make(corpora, demo_tokenizer_path):
    return lambda **kw: text_pipeline(*corpora, demo_tokenizer_path, **kw)


@pytest.fixture(scope="module")
def reference(make):
    return microbatch_digests(make(), 1, TOTAL_STEPS)


@pytest.fixture(scope="module")
def flush_step(make):
    """The first step after which lane 0 has moved to its second segment."""
    with make().shard(0, 1, global_batch_size=32) as loader:
        it = iter(loader)
        for step in range(TOTAL_STEPS):
            for _ in range(16):
                next(it)
            if loader.state_dict()["lanes"]["0"][0] > 0:
                return step + 1
    pytest.fail("no flush within the run; lower flush_every_chunks in the harness")


def resume_points(flush_step):
    return {
        "start": (0, 0),
        "mid_run": (6, 0),
        "before_flush": (flush_step - 1, 0),
        "after_flush": (flush_step, 0),
        "mid_step_microbatch_boundary": (4, 1),
    }


POINTS = ["start", "mid_run", "before_flush", "after_flush", "mid_step_microbatch_boundary"]
# A state saved partway through a step resumes on fewer ranks, each taking over whole ranks of it;
# more ranks would split the step's rest unevenly and refuse it (see the refusal test below).
LAYOUTS = [
    (source, target, point)
    for source, target in [(1, 4), (2, 1), (4, 8), (8, 2)]
    for point in POINTS
    if not (point == "mid_step_microbatch_boundary" and target > source)
]


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
@pytest.mark.parametrize("source_world,target_world,point", LAYOUTS)
def test_resume_on_another_world_size_matches_uninterrupted_run(
    make, reference, flush_step, runner, source_world, target_world, point
):
    steps, extra = resume_points(flush_step)[point]
    pipeline = make(runner=runner, parallelism=2)
    state = json.loads(json.dumps(checkpoint_after(pipeline, source_world, steps, extra)))
    resumed = microbatch_digests(make(runner=runner, parallelism=2), target_world, TOTAL_STEPS, state=state)
    consumed = consumed_keys(make(), source_world, steps, extra)
    assert set(resumed) == set(reference) - consumed
    assert {k: reference[k] for k in resumed} == resumed


def test_state_is_the_same_whatever_the_world_size_that_produced_it(make):
    states = [checkpoint_after(make(), world, 5) for world in (1, 2, 4, 8)]
    assert all(s == states[0] for s in states)


def test_state_is_small_plain_json(make):
    state = checkpoint_after(make(), 2, 5)
    text = json.dumps(state)
    assert json.loads(text) == state
    assert len(text) / 8 < 1024, "well under 1 KB per lane"


def test_resumed_global_digests_match_from_the_checkpoint_step(make):
    reference = step_digests(make(), 1, 12)
    state = checkpoint_after(make(), 4, 5)
    assert step_digests(make(runner="thread"), 2, 7, state=state, start_step=5) == reference[5:]


def _digests(iterator, n: int) -> list[str]:
    return [next(iterator).digest() for _ in range(n)]


def test_an_iterator_a_newer_one_took_over_stops_without_taking_its_rows(make):
    with make().shard(0, 1, global_batch_size=32) as loader:
        reference = _digests(iter(loader), 40)
    with make().shard(0, 1, global_batch_size=32) as loader:
        old = iter(loader)
        got = _digests(old, 3)
        new = iter(loader)
        got += _digests(new, 1)  # the newer iteration carries on from the loader's cursors
        with pytest.raises(StopIteration):
            next(old)
        got += _digests(new, 20)
        state = loader.state_dict()
    assert got == reference[:24]
    with make().shard(0, 1, global_batch_size=32) as loader:  # its cursors name the next microbatch
        loader.load_state_dict(state)
        assert _digests(iter(loader), 16) == reference[24:40]


def test_an_iterator_from_before_load_state_dict_stops_and_leaves_the_resumed_run_alone(make):
    state = json.loads(json.dumps(checkpoint_after(make(), 1, 1)))
    with make().shard(0, 1, global_batch_size=32) as loader:
        reference = _digests(iter(loader), 48)[16:]
    with make().shard(0, 1, global_batch_size=32) as loader:
        old = iter(loader)
        next(old)
        loader.load_state_dict(state)
        with pytest.raises(StopIteration):  # before any new iteration: stops, no KeyError
            next(old)
        old = iter(loader)
        next(old)
        loader.load_state_dict(state)
        new = iter(loader)
        got = _digests(new, 1)
        with pytest.raises(StopIteration):
            next(old)
        got += _digests(new, 31)
    assert got == reference


@pytest.mark.parametrize("source_world,target_world", [(1, 4), (2, 4), (4, 8)])
def test_a_state_saved_partway_through_a_step_is_refused_where_ranks_would_get_unequal_parts_of_it(
    make, source_world, target_world
):
    """Every rank took 1 microbatch of step 4: on more ranks, some would hold 1 microbatch of the
    step's rest where others hold 2. Ranks taking as many each would mix steps 4 and 5 unevenly
    for the rest of the run, and their next states would disagree on the step; refused at once."""
    state = checkpoint_after(make(), source_world, 4, 1)
    with make().shard(0, target_world, global_batch_size=GLOBAL_BATCH) as loader:
        with pytest.raises(CheckpointError, match="saved partway through step 4, whose remaining microbatches"):
            loader.load_state_dict(state)


def test_a_state_saved_partway_through_a_step_resumes_on_fewer_ranks_in_step_and_merges_again(make, reference):
    """Saved on 4 ranks after 1 of each rank's 4 microbatches of step 4, resumed on 2 ranks taking
    as many microbatches each, saved partway through a later step, merged and resumed on 1 rank:
    the ranks stay in step, and every microbatch is the uninterrupted run's."""
    state = checkpoint_after(make(), 4, 4, 1)
    loaders = [make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) for rank in range(2)]
    try:
        for loader in loaders:
            loader.load_state_dict(state)
        taken = [list(islice(iter(loader), 6 + microbatches_per_rank_step(loader) + 3)) for loader in loaders]
        states = [loader.state_dict() for loader in loaders]
    finally:
        for loader in loaders:
            loader.close()
    assert [[batch.step for batch in batches] for batches in taken] == [[4] * 6 + [5] * 8 + [6] * 3] * 2
    assert all(batch.digest() == reference[(batch.step, batch.lane, batch.index)] for batches in taken for batch in batches)
    merged = json.loads(json.dumps(merge_states(states)))
    resumed = microbatch_digests(make(), 1, TOTAL_STEPS, state=merged)
    delivered = consumed_keys(make(), 4, 4, 1) | {(b.step, b.lane, b.index) for batches in taken for b in batches}
    assert set(resumed) == set(reference) - delivered
    assert {key: reference[key] for key in resumed} == resumed
