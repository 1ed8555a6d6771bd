"""A finite mixture with passes of its own for each dataset (`num_epochs={"big": 1, ...}`): each
record is read whole as many times as its dataset's count (a fraction of a pass reads part of the
records, none of them twice), and the global batches are the same on every layout and after a
resume on another world size (SPEC §3.2, §3.3, §5)."""

from __future__ import annotations

import json

import pytest

from tests.reliability.harness import (
    assert_ledger_balances,
    checkpoint_after,
    global_batch,
    run_epoch,
    sharded_datasets,
    text_pipeline,
    tokens_by_record,
)
from zephon import ConfigurationError, RecipeMismatchError
from zephon.io import Dataset
from zephon.work import ScheduledMixtureWorkSource, StaticMixtureWorkSource
from zephon.work._plan import MixturePlan

NUM_LANES = 6
SHARD_SIZES = {"big": [30, 26], "mid": [12, 9], "tiny": [2] * 6}
EPOCHS = {"big": 1, "mid": 3, "tiny": 2}
FRACTIONS = {"big": 0.5, "mid": 1.5, "tiny": 1}
MIXTURE = {"big": 0.6, "mid": 0.3, "tiny": 0.1}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> list[Dataset]:
    return sharded_datasets(tmp_path_factory, SHARD_SIZES)


def make(datasets, num_epochs=EPOCHS, runner: str = "inline", parallelism: int = 1):
    return text_pipeline(datasets, runner=runner, parallelism=parallelism, mixture=MIXTURE, num_epochs=num_epochs,
                         num_lanes=NUM_LANES, records_per_chunk=3, shuffle_buffer=16, max_length=32)


@pytest.fixture(scope="module")
def reference(datasets):
    return run_epoch(make(datasets), 1)


def test_each_record_is_read_whole_as_many_times_as_its_dataset_s_count(datasets, reference):
    """Against the same mixture read once: every record gives its count times the tokens it gave
    there (each pass reads it whole), and the ledger reads each dataset's records that many times."""
    assert_ledger_balances(reference, {ds.name: EPOCHS[ds.name] * ds.num_records for ds in datasets})
    once = tokens_by_record(run_epoch(make(datasets, num_epochs=1), 1).batches)
    assert set(once) == {address for address in tokens_by_record(reference.batches)}
    assert tokens_by_record(reference.batches) == {
        address: EPOCHS[address.dataset] * tokens for address, tokens in once.items()
    }


def test_a_fraction_of_a_pass_reads_part_of_the_records_none_more_often_than_its_passes_allow(datasets):
    """Half a pass over big reads some of its records once and the rest not at all; a pass and a
    half over mid reads each record once or twice; the ledger counts what the batches hold."""
    run = run_epoch(make(datasets, num_epochs=FRACTIONS), 1)
    assert_ledger_balances(run)
    once = tokens_by_record(run_epoch(make(datasets, num_epochs=1), 1).batches)
    passes = {address: tokens // once[address] for address, tokens in tokens_by_record(run.batches).items()}
    assert all(tokens % once[address] == 0 for address, tokens in tokens_by_record(run.batches).items())
    for name, allowed in {"big": {1}, "mid": {1, 2}, "tiny": {1}}.items():
        read = {address: n for address, n in passes.items() if address.dataset == name}
        assert set(read.values()) == allowed, name
        assert run.totals[name]["read"] == sum(read.values()), name
    records = {ds.name: ds.num_records for ds in datasets}
    assert 0 < run.totals["big"]["read"] < records["big"]
    assert records["mid"] < run.totals["mid"]["read"] < 2 * records["mid"]
    assert run.totals["tiny"]["read"] == records["tiny"]


@pytest.mark.parametrize("num_epochs", [EPOCHS, FRACTIONS], ids=["passes", "fractions"])
@pytest.mark.parametrize("runner, parallelism, world_size", [("inline", 1, 2), ("thread", 2, 3), ("process", 2, 6)])
def test_the_same_global_batches_on_every_layout(datasets, reference, runner, parallelism, world_size, num_epochs):
    expected = reference if num_epochs is EPOCHS else run_epoch(make(datasets, num_epochs=num_epochs), 1)
    run = run_epoch(make(datasets, num_epochs=num_epochs, runner=runner, parallelism=parallelism), world_size)
    assert run.digests == expected.digests
    assert run.totals == expected.totals


@pytest.mark.parametrize("saved_on, resumed_on", [(2, 3), (6, 1)])
def test_a_resume_on_another_world_size_hands_over_the_rest_of_the_uninterrupted_run(
    datasets, reference, saved_on, resumed_on
):
    taken_per_rank = 3
    state = json.loads(json.dumps(checkpoint_after(make(datasets), saved_on, taken_per_rank)))
    rest = run_epoch(make(datasets, runner="thread", parallelism=2), resumed_on, state=state, keep_batches=False)
    assert set(rest.digests) < set(reference.digests)
    assert rest.digests == {key: reference.digests[key] for key in rest.digests}
    assert len(reference.digests) - len(rest.digests) == saved_on * taken_per_rank
    assert rest.totals == reference.totals


def _plan_fingerprint(datasets, num_epochs) -> dict:
    source = StaticMixtureWorkSource(datasets, mixture=MIXTURE, records_per_chunk=3, num_epochs=num_epochs)
    return MixturePlan(source, {}, NUM_LANES).fingerprint()


def test_counts_all_alike_are_the_one_count_and_a_changed_count_is_refused_on_resume(datasets):
    """{every dataset: 2} (or 2.0) plans what num_epochs=2 plans, so it has its fingerprint and
    resumes its checkpoints; changing one dataset's count changes the plan, and a resume says so."""
    assert _plan_fingerprint(datasets, dict.fromkeys(SHARD_SIZES, 2)) == _plan_fingerprint(datasets, 2)
    assert _plan_fingerprint(datasets, 2.0) == _plan_fingerprint(datasets, 2), "2.0 passes are 2"
    assert _plan_fingerprint(datasets, EPOCHS)["num_epochs"] == EPOCHS
    state = checkpoint_after(make(datasets, num_epochs=2), 1, 2)
    alike = make(datasets, num_epochs=dict.fromkeys(SHARD_SIZES, 2))
    with alike.shard(0, 1, global_batch_size=global_batch(alike)) as loader:
        loader.load_state_dict(state)
    changed = make(datasets)
    with changed.shard(0, 1, global_batch_size=global_batch(changed)) as loader:
        with pytest.raises(RecipeMismatchError, match=r"plan\.num_epochs"):
            loader.load_state_dict(state)


@pytest.mark.parametrize("num_epochs, refusal", [
    ({"big": 1, "mid": 3}, r"num_epochs names \['big', 'mid'\] do not match dataset names \['big', 'mid', 'tiny'\]: "
                           r"\['tiny'\] have no count"),
    ({"big": 1, "mid": 3, "tiny": 2, "huge": 1}, r"\['huge'\] name no dataset"),
    ({"big": 1, "mid": 0, "tiny": 2}, r"num_epochs\['mid'\] must be a positive number of passes .*, got 0$"),
    ({"big": 1, "mid": -0.5, "tiny": 2}, r"num_epochs\['mid'\] must be a positive number of passes .*, got -0.5"),
    ({"big": 1, "mid": float("inf"), "tiny": 2}, r"num_epochs\['mid'\] must be .*, got inf"),
    ({"big": True, "mid": 2, "tiny": 2}, r"num_epochs\['big'\] must be a positive number of passes .*, got True"),
    ({"big": 1, "mid": "2", "tiny": 2}, r"num_epochs\['mid'\] must be a positive number of passes .*, got '2'"),
])
def test_counts_that_do_not_give_every_dataset_a_whole_number_of_passes_are_refused(datasets, num_epochs, refusal):
    for source in (StaticMixtureWorkSource, lambda datasets, num_epochs: ScheduledMixtureWorkSource(
            datasets, schedule=[(0, MIXTURE)], num_epochs=num_epochs)):
        with pytest.raises(ConfigurationError, match=refusal):
            source(datasets, num_epochs=num_epochs)
