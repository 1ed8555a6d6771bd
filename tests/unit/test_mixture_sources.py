"""Mixture work sources refuse, with a named error, what their plan could not honour, and their
plans honour the rest: every record once per epoch, token shares as asked."""

from __future__ import annotations

import gc
import re
import weakref
from collections import Counter
from pathlib import Path

import pytest

from zephon import ConfigurationError, Pipeline
from zephon.io import Dataset
from zephon.work import ScheduledMixtureWorkSource, StaticMixtureWorkSource, TokenEstimation
from zephon.work._plan import MEASURED_RECIPES_KEPT

DATA = Path(__file__).resolve().parents[2] / "zephon" / "data"


def shipped() -> list[Dataset]:
    return [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))]


def planned_chunks(source, num_lanes: int) -> Counter:
    """Every chunk a finite plan hands out, over all lanes, with its count."""
    plan = source.bind(None, num_lanes)
    return Counter(plan.slot(lane, s) for lane in range(num_lanes) for s in range(plan.num_slots(lane)))


@pytest.mark.parametrize("num_epochs", [None, 1])
def test_a_subnormal_mixture_weight_is_refused_at_construction(num_epochs):
    with pytest.raises(ConfigurationError, match="below 2\\*\\*-52"):
        StaticMixtureWorkSource(shipped(), mixture={"kjv": 1.0, "jargon": 5e-324}, num_epochs=num_epochs)
    with pytest.raises(ConfigurationError, match="below 2\\*\\*-52"):
        ScheduledMixtureWorkSource(shipped(), [(0, {"kjv": 1.0, "jargon": 1.0}), (10**6, {"kjv": 1.0, "jargon": 1e-20})])


def test_huge_mixture_weights_keep_their_shares():
    source = StaticMixtureWorkSource(shipped(), mixture={"kjv": 1e308, "jargon": 1e308}, num_epochs=1)
    assert source.mixture == {"kjv": 0.5, "jargon": 0.5}


def test_changing_the_mixture_a_source_returned_changes_neither_its_plans_nor_their_fingerprint():
    """`mixture` returned the source's own weights: a caller changing them changed every later
    plan and the recipe fingerprint that checkpoints are checked against."""
    source = StaticMixtureWorkSource(shipped(), mixture={"kjv": 3.0, "jargon": 1.0}, records_per_chunk=16)
    plan = source.bind(None, num_lanes=2)
    fingerprint, slots, weights = plan.fingerprint(), [plan.slot(0, s) for s in range(50)], dict(source.mixture)
    source.mixture["kjv"] = 0.0
    assert source.mixture == weights
    again = source.bind(None, num_lanes=2)
    assert again.fingerprint() == fingerprint and [again.slot(0, s) for s in range(50)] == slots


@pytest.mark.parametrize("sample_records,sample_chunks,sampled", [(100, 16, 96), (64, 16, 64), (5, 16, 5)])
def test_the_estimation_sample_holds_whole_windows_of_sample_records_over_windows_records(
    sample_records, sample_chunks, sampled
):
    """What TokenEstimation's docstring says: min(sample_chunks, sample_records) windows of
    sample_records // windows records, 96 of 100 in 16 windows (not the 100 it once claimed;
    the count stays, since another sample would change every token-planned batch)."""
    kjv = shipped()[0]
    assert kjv.num_records > sample_records, "a dataset this small would be measured whole"
    estimation = TokenEstimation(sample_records=sample_records, sample_chunks=sample_chunks)
    assert estimation.measure(kjv, lambda batch: len(batch.records)).sampled_records == sampled


def test_a_tiny_share_still_plans_every_chunk_once_per_epoch():
    source = StaticMixtureWorkSource(
        shipped(), mixture={"kjv": 1.0, "jargon": 2.0**-50}, records_per_chunk=16, num_epochs=2
    )
    expected = Counter({c: 2 for ds in source.datasets for c in ds.chunks(16)})
    assert planned_chunks(source, num_lanes=2) == expected


def tokens_unless(silent: str):
    """A token counter that finds no token in the records of dataset `silent` (every sampled
    record dropped by a filter, say) and one per record elsewhere."""

    def count(batch) -> int:
        return 0 if batch.chunk.dataset == silent else len(batch.records)

    return count


@pytest.mark.parametrize("num_epochs", [None, 1])
def test_a_dataset_whose_estimation_sample_yields_no_token_is_refused_naming_it(num_epochs):
    """Weighting it by records while the others are weighted by tokens read it hundreds of times
    more often than its share; no weighting can give a dataset without tokens a token share."""
    source = StaticMixtureWorkSource(
        shipped(), mixture={"kjv": 0.5, "jargon": 0.5}, token_estimation=TokenEstimation(sample_records=64),
        records_per_chunk=16, num_epochs=num_epochs,
    )
    with pytest.raises(ConfigurationError, match="'jargon'.*sample of 64 records.*yielded no token"):
        source.bind(tokens_unless("jargon"), num_lanes=2)


def test_a_dataset_without_tokens_but_without_weight_is_not_measured():
    source = StaticMixtureWorkSource(
        shipped(), mixture={"kjv": 1.0, "jargon": 0.0}, token_estimation=TokenEstimation(sample_records=64),
        records_per_chunk=16, num_epochs=1,
    )
    assert set(planned_chunks_counted(source, tokens_unless("jargon"))) == {"kjv"}


def longer_than(characters: int):
    """A filter whose threshold only its closure holds: the recipe fingerprint cannot see it."""

    def keep(record: dict) -> bool:
        return len(record["text"]) > characters

    return keep


def filtered_pipeline(source, characters: int) -> Pipeline:
    return (
        Pipeline(source).options(num_lanes=2, runner="inline").filter(longer_than(characters))
        .tokenize(str(DATA / "tokenizer.json")).pack_flat(64).batch(2)
    )


def measured(pipeline: Pipeline) -> dict:
    with pipeline.shard(0, 1) as loader:
        return loader.plan.fingerprint()["tokens_per_byte"]


def test_pipelines_sharing_a_source_each_get_their_own_token_measurement():
    """The measurement was cached by the operators' fingerprints, which do not see a closure's
    values: a pipeline filtering out short records took the measurement of one built before it
    on the same source keeping them all, so its mixture (and batches) depended on what else the
    process had built. Rank loaders of one pipeline still share one measurement."""
    source = StaticMixtureWorkSource(shipped(), token_estimation=TokenEstimation(sample_records=64), seed=1)
    fresh = measured(filtered_pipeline(StaticMixtureWorkSource(
        shipped(), token_estimation=TokenEstimation(sample_records=64), seed=1), 200))
    assert measured(filtered_pipeline(source, 0)) != fresh, "the filter should change the measurement"
    long_only = filtered_pipeline(source, 200)
    assert measured(long_only) == fresh
    reads = []
    read_chunk = Dataset.read_chunk
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Dataset, "read_chunk", lambda self, *a, **k: reads.append(a) or read_chunk(self, *a, **k))
        assert measured(long_only.options(runner="thread")) == fresh
    assert reads == [], "another loader of the same pipeline measured it again"


def test_a_source_lets_go_of_the_operators_of_pipelines_built_on_it_long_ago():
    """A source kept the measurement of every pipeline built on it, and with it that pipeline's
    operators and whatever a map's or filter's closure held: a job building a pipeline per epoch,
    per resume or per ablation on one source grew by each (soak: 29 objects a pipeline, for ever).
    It keeps the last MEASURED_RECIPES_KEPT; an older pipeline built again is measured again."""
    source = StaticMixtureWorkSource(shipped(), token_estimation=TokenEstimation(sample_records=16), seed=1)
    first = longer_than(0)
    alive = weakref.ref(first)
    pipeline = Pipeline(source).options(num_lanes=2, runner="inline").filter(first).tokenize(
        str(DATA / "tokenizer.json")).pack_flat(64).batch(2)
    measured(pipeline)
    del pipeline, first
    for characters in range(1, MEASURED_RECIPES_KEPT + 1):
        measured(filtered_pipeline(source, characters))
    gc.collect()
    assert alive() is None, "the first pipeline's filter is still held by the source"


def planned_chunks_counted(source, count_tokens, num_lanes: int = 2) -> Counter:
    plan = source.bind(count_tokens, num_lanes)
    return Counter(plan.slot(lane, s).dataset for lane in range(num_lanes) for s in range(plan.num_slots(lane)))


@pytest.mark.parametrize("start", [0.5, 100.7, 10**400, float("inf")], ids=["half", "fraction", "huge", "inf"])
def test_a_phase_start_that_is_no_whole_token_count_is_refused(start):
    """0.5 used to be truncated to 0, turning a schedule without a phase at token 0 into one,
    and 100.7 to 100; 10**400 failed with a bare OverflowError."""
    phases = [(0, {"kjv": 1.0}), (start, {"jargon": 1.0})] if start != 0.5 else [(start, {"kjv": 1.0})]
    with pytest.raises(ConfigurationError, match="starts at a token count, a whole number"):
        ScheduledMixtureWorkSource(shipped(), phases)


def test_whole_phase_starts_written_as_floats_are_taken_as_ints():
    source = ScheduledMixtureWorkSource(shipped(), [(0.0, {"kjv": 1.0}), (1e9, {"jargon": 1.0})])
    assert [start for start, _ in source.schedule] == [0, 10**9]
    assert all(type(start) is int for start, _ in source.schedule)


def small_dataset(root: Path, lines: list[str]) -> Dataset:
    (root / "part.jsonl").write_text("".join(line + "\n" for line in lines))
    return Dataset.from_path("small", str(root))


def test_a_finite_plan_of_thousands_of_epochs_hands_out_each_chunk_once_an_epoch_and_ends(tmp_path):
    """A small dataset read for a long job: epoch counts, each epoch's permutation and the plan's
    end stay exact far past the first epochs (soak: 1,500 epochs through a loader, every record
    read 1,500 times)."""
    dataset = small_dataset(tmp_path, [f'{{"text": "record {i}"}}' for i in range(8)])
    counts = planned_chunks(StaticMixtureWorkSource([dataset], records_per_chunk=2, num_epochs=3000), 2)
    assert len(counts) == 4 and set(counts.values()) == {3000}


@pytest.mark.parametrize("num_lanes", [1, 2])
def test_a_mixed_dataset_without_records_is_refused_as_such(tmp_path, num_lanes):
    """The error used to advise lowering records_per_chunk, which cannot help."""
    source = StaticMixtureWorkSource([*shipped(), small_dataset(tmp_path, [])], records_per_chunk=16)
    with pytest.raises(ConfigurationError, match="'small' has no records to mix: give it weight 0"):
        source.bind(None, num_lanes)


def test_a_mixed_dataset_with_fewer_records_than_lanes_is_refused_naming_both(tmp_path):
    source = StaticMixtureWorkSource([*shipped(), small_dataset(tmp_path, ['{"text": "one"}'])], records_per_chunk=16)
    with pytest.raises(ConfigurationError, match="'small' has 1 records, fewer than num_lanes=2: .* fewer lanes"):
        source.bind(None, num_lanes=2)
    assert source.bind(None, num_lanes=1).slot(0, 0) is not None


def test_too_few_chunks_for_the_lanes_names_the_records_the_shards_and_a_records_per_chunk_that_fits(tmp_path):
    """Two shards of 16 and 17 records make 2 chunks at the default 128: the refusal said "2 chunks
    of 128 records" (there are 33 records) and "lower records_per_chunk" without saying where it is
    set or to what (a user's first small video set, 4 lanes, met this)."""
    for k, count in enumerate((16, 17)):
        (tmp_path / f"part-{k}.jsonl").write_text("".join(f'{{"text": "r{i}"}}\n' for i in range(count)))
    source = StaticMixtureWorkSource([Dataset.from_path("small", str(tmp_path))])
    with pytest.raises(ConfigurationError) as refused:
        source.bind(None, num_lanes=4)
    message = str(refused.value)
    assert "33 records in 2 shards" in message and "at most 128 records" in message
    assert "StaticMixtureWorkSource(records_per_chunk=8)" in message  # 2 + 2 full chunks
    fixed = StaticMixtureWorkSource([Dataset.from_path("small", str(tmp_path))], records_per_chunk=8)
    assert fixed.bind(None, num_lanes=4).slot(3, 0) is not None


@pytest.mark.parametrize("counts, num_lanes, named", [((51,), 2, 25), ((16, 17), 4, 8), ((3, 3, 1), 4, 1)])
def test_the_records_per_chunk_a_refusal_names_deals_every_lane_a_full_chunk(tmp_path, counts, num_lanes, named):
    """The size named was the largest that cut the dataset into num_lanes chunks, tails counted:
    51 records on 2 lanes were told 50, which dealt one lane a single record, and that lane
    repeated it for half its tokens (807 times in 800 rows), silently. The size named now leaves
    no lane with less than a full chunk of the dataset."""
    for k, count in enumerate(counts):
        (tmp_path / f"part-{k}.jsonl").write_text("".join(f'{{"text": "r{i}"}}\n' for i in range(count)))
    with pytest.raises(ConfigurationError, match=rf"StaticMixtureWorkSource\(records_per_chunk={named}\) or less"):
        StaticMixtureWorkSource([Dataset.from_path("small", str(tmp_path))], num_epochs=1).bind(None, num_lanes)
    source = StaticMixtureWorkSource([Dataset.from_path("small", str(tmp_path))], records_per_chunk=named, num_epochs=1)
    plan = source.bind(None, num_lanes)
    held = Counter()
    for lane in range(num_lanes):
        for s in range(plan.num_slots(lane)):
            chunk = plan.slot(lane, s)
            held[lane] += chunk.num_records if chunk is not None else 0
    assert min(held[lane] for lane in range(num_lanes)) >= named, held


def test_an_endless_plan_warns_of_a_lane_dealt_far_fewer_of_a_dataset_s_tokens_naming_a_chunk_size(tmp_path):
    """51 records in chunks of 50 on 2 lanes: one lane holds a single record, which it repeated in
    807 of 800 rows to fill the dataset's share of them, unsaid. A finite plan reads each record
    once per epoch, and an even deal says nothing. The loader logs the plan's warnings on the job's
    rank 0 (test_torchtitan's rank-3 test checks that the other ranks do not)."""
    (tmp_path / "part.jsonl").write_text("".join(f'{{"text": "record {i}"}}\n' for i in range(51)))

    def warnings(records_per_chunk: int, num_epochs: int | None) -> list[str]:
        source = StaticMixtureWorkSource([Dataset.from_path("small", str(tmp_path))], seed=1, num_epochs=num_epochs,
                                         records_per_chunk=records_per_chunk)
        return source.bind(None, num_lanes=2).configuration_warnings

    (said,) = warnings(50, None)
    assert re.fullmatch(r"dataset 'small': its chunks of up to 50 records leave lane \d 2% of the expected tokens "
                        r"lane \d holds, so lane \d reads each of its records about 50x as often as lane \d does; "
                        r"records_per_chunk=25 or less deals them more evenly", said), said
    assert warnings(50, 1) == [] and warnings(25, None) == []


def test_a_dataset_without_records_is_fine_with_weight_0(tmp_path):
    (tmp_path / "part.jsonl").write_text("")
    source = StaticMixtureWorkSource(
        [*shipped(), Dataset.from_path("empty", str(tmp_path))], mixture={"kjv": 1, "jargon": 1, "empty": 0},
        records_per_chunk=16, num_epochs=1,
    )
    assert planned_chunks(source, num_lanes=2) == Counter({c: 1 for ds in shipped() for c in ds.chunks(16)})


@pytest.mark.parametrize("seed", range(8))
def test_every_lane_holds_a_like_share_of_every_dataset(seed):
    """Chunks are dealt by size, not count: dealt by count, a lane could get only a dataset's tail
    chunks (kjv/jargon, 8 lanes, seed 7: 2 records of jargon against 256-384 on the others), and it
    repeated them endlessly to fill that dataset's share of its tokens."""
    source = StaticMixtureWorkSource(shipped(), mixture={"kjv": 0.5, "jargon": 0.5}, seed=seed, num_epochs=1)
    plan = source.bind(None, 8)  # no token counter: chunks weigh their records
    held = {name: Counter() for name in ("kjv", "jargon")}
    for lane in range(8):
        for s in range(plan.num_slots(lane)):
            chunk = plan.slot(lane, s)
            if chunk is not None:
                held[chunk.dataset][lane] += chunk.num_records
    for name, records in held.items():
        largest = max(c.num_records for c in plan.datasets[name].chunks(source.records_per_chunk))
        per_lane = [records[lane] for lane in range(8)]
        assert max(per_lane) - min(per_lane) <= largest, (name, per_lane)


def test_a_dataset_unpickled_without_its_record_offsets_is_refused_for_token_planning():
    """A pickle of a Dataset leaves out the per-record byte offsets of its line shards (they serve
    planning only), and a token-estimated plan weighs chunks by exact raw bytes: an unpickled copy
    (broadcast to ranks, cached on disk) prorated shard bytes instead and planned other lanes than
    the Dataset it was pickled from, silently, rank against rank. It is now refused by name; a plan
    by records needs no offsets and is unchanged."""
    import pickle

    copies = pickle.loads(pickle.dumps(shipped()))
    counter = lambda batch: sum(len(r["text"]) for r in batch.records)
    estimated = StaticMixtureWorkSource(copies, token_estimation=TokenEstimation(sample_records=64), records_per_chunk=16)
    with pytest.raises(ConfigurationError, match="'kjv'.*unpickled.*Dataset.from_path"):
        estimated.bind(counter, num_lanes=2)
    by_records = lambda datasets: StaticMixtureWorkSource(datasets, records_per_chunk=16, num_epochs=1)
    assert planned_chunks(by_records(copies), 2) == planned_chunks(by_records(shipped()), 2)


def test_a_dataset_named_after_an_undecodable_directory_name_is_planned(tmp_path):
    """Python decodes a file name that is not UTF-8 with lone surrogates (os.fsdecode), so a
    dataset named after its directory can hold one; the plan's random streams are keyed by text
    holding the dataset name, and encoding that key failed with a bare UnicodeEncodeError. Keys
    are now encoded with "surrogatepass", the same bytes as before for every other name."""
    import os

    name = os.fsdecode(b"caf\xe9")
    datasets = [Dataset.from_path(name, str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))]
    source = StaticMixtureWorkSource(datasets, records_per_chunk=16, num_epochs=1)
    expected = Counter({c: 1 for ds in datasets for c in ds.chunks(16)})
    assert planned_chunks(source, num_lanes=2) == expected
