"""A finite mixture of three datasets that run out apart, on lane counts no power of two divides
evenly into every world size: every global batch is the same on every layout and across chained
resumes (SPEC §3.2, §3.3, §5).

The other determinism tests mix two datasets on 8 lanes, so every world size they try is a power
of two, and their fuzzing of the ragged end reads one dataset. Here 12 lanes run on 1, 2, 3, 4
and 6 ranks; three datasets of very different sizes (one of them shards of one record each) are
mixed by measured token shares for two epochs, so they run out at different slots of each lane; a
map changes every record's length (the token estimate and the packer see the changed text); a
filter drops most records, so lanes end steps apart and some lane gives no row at all; and the
shuffle buffer holds more rows than a lane's segment ever gives.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from itertools import islice

import pytest

from tests.reliability.harness import (
    assert_ledger_balances,
    global_batch,
    run_epoch,
    sharded_datasets,
    text_pipeline,
)
from zephon import global_batch_digest, merge_states
from zephon.io import Dataset

NUM_LANES = 12
SHARD_SIZES = {"big": [40, 37], "mid": [13, 11, 5], "tiny": [1] * 14}
MIXTURE = {"big": 0.6, "mid": 0.3, "tiny": 0.1}
EPOCHS = 2


class Reshape:
    """Doubles or triples one record's text and halves another's, by its length: the records the
    token estimate samples and the packer packs are not the stored ones."""

    def __call__(self, record: dict) -> dict:
        text = record["text"]
        times = len(text) % 3
        return {**record, "text": " ".join([text] * (times + 1)) if times else text[: len(text) // 2 + 1]}


class DropMost:
    """Keeps about 2 records in 10, picked by a hash of the text: the same ones on every layout."""

    def __call__(self, record: dict) -> bool:
        return int(hashlib.sha256(record["text"].encode()).hexdigest()[:8], 16) % 10 >= 8


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> list[Dataset]:
    return sharded_datasets(tmp_path_factory, SHARD_SIZES)


@pytest.fixture(scope="module")
def make(datasets):
    def make(runner: str = "inline", parallelism: int = 1):
        return text_pipeline(
            datasets, runner=runner, parallelism=parallelism, mixture=MIXTURE, estimate_tokens=True,
            num_epochs=EPOCHS, num_lanes=NUM_LANES, map_fn=Reshape(), filter_fn=DropMost(), records_per_chunk=2,
            flush_every_chunks=2, shuffle_buffer=64, max_length=32,
        )

    return make


@pytest.fixture(scope="module")
def reference(make):
    return run_epoch(make(), 1)


def _global_digests(run) -> dict[int, str]:
    """{step: the SHA-256 of its global batch}, from every rank's microbatches of the run."""
    by_step: dict[int, list] = {}
    for batch in run.batches:
        by_step.setdefault(batch.step, []).append(batch)
    return {step: global_batch_digest(batches) for step, batches in by_step.items()}


def test_the_recipe_mixes_three_datasets_that_end_apart_in_a_ragged_epoch(reference, datasets):
    """What the layout tests below rest on: every dataset is read to the end of both epochs, each
    lands in the batches, the lanes end at different steps, and some lane gives no row at all."""
    assert_ledger_balances(reference, {ds.name: EPOCHS * ds.num_records for ds in datasets})
    used = Counter(address.dataset for batch in reference.batches for row in batch.sources for address in row)
    assert set(used) == set(SHARD_SIZES)
    last_step = {}
    for step, lane, _ in reference.digests:
        last_step[lane] = max(step, last_step.get(lane, step))
    assert len(set(last_step.values())) > 2, last_step
    assert set(range(NUM_LANES)) - set(last_step), "no lane without a row: the filter keeps too much"


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
@pytest.mark.parametrize("runner, parallelism", [("inline", 1), ("thread", 3), ("process", 2)])
def test_a_finite_three_dataset_mixture_gives_the_same_global_batches_on_every_layout(
    make, reference, runner, parallelism, world_size
):
    run = run_epoch(make(runner, parallelism), world_size)
    assert _global_digests(run) == _global_digests(reference)
    assert run.digests == reference.digests
    assert run.totals == reference.totals


def _take_whole_steps(pipeline, world_size: int, reference, steps: range, state=None) -> tuple[dict, dict]:
    """A trainer taking each of `steps` whole on `world_size` ranks (every rank its lanes' part of
    the uninterrupted run's step), then saving: the microbatches taken and the merged state. Each
    rank saves twice without taking anything between: the two saves must be the same."""
    taken, states = {}, []
    per_rank = NUM_LANES // world_size
    for rank in range(world_size):
        lanes = range(rank * per_rank, (rank + 1) * per_rank)
        wanted = sum(1 for step, lane, _ in reference.digests if step in steps and lane in lanes)
        with pipeline.shard(rank, world_size, global_batch_size=global_batch(pipeline)) as loader:
            if state is not None:
                loader.load_state_dict(state)
            for batch in islice(loader, wanted):
                assert batch.step in steps, (batch.step, steps)
                taken[(batch.step, batch.lane, batch.index)] = batch.digest()
            states.append(loader.state_dict())
            assert loader.state_dict() == states[-1], "a second save without a step between changed the state"
    return taken, json.loads(json.dumps(merge_states(states)))


def _take_microbatches(pipeline, world_size: int, per_rank: int, state) -> tuple[dict, dict]:
    """A trainer taking `per_rank` microbatches from every rank (TorchTitan's local batches), then
    saving: the microbatches taken and the merged state."""
    taken, states = {}, []
    for rank in range(world_size):
        with pipeline.shard(rank, world_size, global_batch_size=global_batch(pipeline)) as loader:
            loader.load_state_dict(state)
            for batch in islice(loader, per_rank):
                taken[(batch.step, batch.lane, batch.index)] = batch.digest()
            states.append(loader.state_dict())
    return taken, json.loads(json.dumps(merge_states(states)))


@pytest.mark.parametrize("worlds", [(3, 4, 6), (6, 2, 3), (4, 3, 1)])
def test_a_chained_resume_of_a_finite_mixture_hands_over_the_rest_of_the_uninterrupted_run(make, reference, worlds):
    """Two steps taken whole on R ranks and saved; resumed on R' and saved at once (the state must
    not change), two more steps taken whole there, then 3 microbatches from every rank (partway
    through a step, in the ragged end); resumed on R'' to the end of the plan. Every microbatch
    comes once, with the uninterrupted run's digest at its (step, lane, index), and the ledger
    ends where the uninterrupted run's does."""
    first, second, last = worlds
    delivered, state = _take_whole_steps(make(), first, reference, range(0, 2))
    unchanged, resaved = _take_whole_steps(make("thread", 2), second, reference, range(2, 2), state)
    assert not unchanged and resaved == state, "a resume saved before any step changed the state"
    taken, state = _take_whole_steps(make("thread", 2), second, reference, range(2, 4), state)
    assert not set(taken) & set(delivered)
    delivered.update(taken)
    taken, state = _take_microbatches(make(), second, 3, state)
    assert not set(taken) & set(delivered)
    delivered.update(taken)
    rest = run_epoch(make("process", 2), last, state=state, keep_batches=False)
    assert not set(rest.digests) & set(delivered)
    delivered.update(rest.digests)
    assert delivered == reference.digests
    assert rest.totals == reference.totals


def test_a_save_partway_through_a_step_resumes_on_more_ranks_once_a_lane_gives_no_row(make, reference):
    """Lanes 1 and 6 give no row at all, so the run is in the ragged end from its first step, where
    a state saved partway through a step resumes on any world size. Saved on 1 rank after 1
    microbatch (of 2 per lane per step), the state cannot know it yet: the rank has not turned to
    lane 1. It was refused on more ranks as if every lane had a row ("the step's rest would fall
    unevenly"), though the uninterrupted run on those ranks is ragged the same way."""
    assert {1, 6}.isdisjoint(lane for _, lane, _ in reference.digests)
    global_batch_size = NUM_LANES * 2 * 2  # microbatches of 2 rows, 2 microbatches per lane per step
    with make().shard(0, 1, global_batch_size=global_batch_size) as loader:
        first = next(iter(loader))
        state = json.loads(json.dumps(loader.state_dict()))
    assert not state["finished"], "the save knows a lane without rows: this test no longer shows the case"
    with make().shard(0, 1, global_batch_size=global_batch_size) as loader:
        uninterrupted = {(b.step, b.lane, b.index): b.digest() for b in loader}
    assert uninterrupted.pop((0, 0, 0)) == first.digest()
    for world_size in (2, 4, 12):
        resumed = {}
        for rank in range(world_size):
            with make("thread", 2).shard(rank, world_size, global_batch_size=global_batch_size) as loader:
                loader.load_state_dict(state)
                resumed.update({(b.step, b.lane, b.index): b.digest() for b in loader})
        assert resumed == uninterrupted, world_size
