"""`document_values`: a record's number fields carried into each row that holds its document, one
value a document, by `pack_flat` (every algorithm) and `pack_pairs`; the records refused for
them, and the configurations."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import refusals
from zephon import ConfigurationError, Pipeline, SegmentContext
from zephon._batch import collate
from zephon._packing import ALGORITHMS, PackFlatOp
from zephon._preference import PAIR_ALGORITHMS, PackPairsOp
from zephon._records import RecordAddress
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

VALUES = ("label", "reward", "step")


def _record(index: int, length: int) -> tuple[RecordAddress, dict]:
    """A record whose values say whose they are: a bool, a float and an integer past float32's."""
    ids = np.arange(length, dtype=np.int32) + 1000 * (index + 1)
    record = {"input_ids": ids, "chosen_ids": ids, "rejected_ids": ids + 500, "label": index % 3 == 0,
              "reward": index / 8 - 1, "step": 2**40 + index}
    return RecordAddress("kto", "s", index), record


def _op(packer: str, algorithm: str, max_length: int, **options):
    kind = PackPairsOp if packer == "pack_pairs" else PackFlatOp
    return kind(max_length, algorithm, **{"max_open_rows": 3, "overlong": "truncate", **options})


def _plans(op, records):
    packer = op.factory(2)(SegmentContext(lane=0, segment=0))
    plans = [plan for record in records for plan in packer.push(record)]
    return plans + packer.flush(), packer


PACKERS = [("pack_flat", algorithm) for algorithm in ALGORITHMS] + [("pack_pairs", a) for a in PAIR_ALGORITHMS]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=25), st.integers(4, 32), st.sampled_from(PACKERS),
       st.integers(1, 4))
def test_each_document_of_a_microbatch_holds_its_records_values(lengths, max_length, packer, microbatch):
    """Documents longer than a row included: every piece of one cut across rows holds them."""
    records = [_record(i, length) for i, length in enumerate(lengths)]
    plans, _ = _plans(_op(*packer, max_length, document_values=VALUES), records)
    for at in range(0, len(plans), microbatch):
        batch = collate(plans[at : at + microbatch], lane=0, step=0, index=0)
        arrays = batch.to_numpy()
        documents = [len(sources) for sources in batch.sources]
        assert [int(n) for n in arrays["document_ids"].max(axis=1) + 1] == documents
        for name in VALUES:
            assert arrays[name].dtype == np.float64 and arrays[f"{name}_counts"].tolist() == documents
            expected = [records[address.index][1][name] for sources in batch.sources for address in sources]
            assert arrays[name].tolist() == [float(value) for value in expected]


def test_a_row_assembled_alone_and_a_padding_row_hold_them_too():
    plans, _ = _plans(_op("pack_flat", "first_fit", 16, document_values=["reward"]), [_record(i, 5) for i in range(4)])
    row = plans[0].assemble()
    assert row.ragged["reward"].tolist() == [-1.0, -0.875, -0.75]
    padding = _op("pack_flat", "wrap", 16, document_values=["reward"]).padding_row(2)
    assert padding.ragged["reward"].shape == (0,) and padding.ragged["reward"].dtype == np.float64
    batch = collate([plans[1], padding], lane=0, step=0, index=0)
    assert batch.ragged["reward"].tolist() == [-0.625] and batch.ragged_counts["reward"].tolist() == [1, 0]
    assert PackPairsOp(16, document_values=["reward"]).padding_row(2).ragged["reward"].shape == (0,)


def test_without_document_values_rows_are_as_before():
    plans, _ = _plans(_op("pack_flat", "wrap", 16), [_record(i, 5) for i in range(4)])
    batch = collate(plans, lane=0, step=0, index=0)
    assert batch.ragged == {} and batch.ragged_counts == {} and plans[0].assemble().ragged == {}


@pytest.mark.parametrize("value", [True, np.bool_(False), 3, -2**53, np.int64(7), 0.25, np.float32(0.5), 1e300])
def test_numbers_float64_holds_as_they_are_are_taken(value):
    address, record = _record(0, 4)
    op = _op("pack_flat", "pad", 8, document_values=["label"])
    plans, packer = _plans(op, [(address, {**record, "label": value})])
    assert plans[0].assemble().ragged["label"].tolist() == [float(value)] and packer.drain_skips() == []


@pytest.mark.parametrize("value", ["1", math.nan, -math.inf, 2**53 + 1, [1.0], {"v": 1}, b"1"])
@pytest.mark.parametrize("packer", ["pack_flat", "pack_pairs"])
def test_a_value_that_is_no_finite_exact_number_is_skipped_as_bad_document_value(value, packer):
    address, record = _record(0, 4)
    op = _op(packer, "pad", 16, document_values=["reward"])
    plans, skipped = _plans(op, [(address, {**record, "reward": value})])
    assert plans == []
    [(at, reason, detail)] = refusals(skipped.drain_skips())
    assert (at, reason) == (address, "bad_document_value") and detail.startswith(f"'reward' holds {value!r}")


@pytest.mark.parametrize("packer", ["pack_flat", "pack_pairs"])
def test_a_record_without_a_value_is_skipped_as_missing_field_once(packer):
    address, record = _record(0, 40)  # longer than a row, and refused before it is cut: not counted as truncated
    del record["reward"]
    plans, skipped = _plans(_op(packer, "first_fit", 16, overlong="truncate", document_values=VALUES),
                            [(address, record)])
    assert plans == [] and skipped.drain_truncations() == []
    [(at, reason, detail)] = refusals(skipped.drain_skips())
    assert (at, reason) == (address, "missing_field")
    assert detail.startswith("document value 'reward'; fields it has: ")
    address, record = _record(1, 4)
    plans, skipped = _plans(_op(packer, "pad", 16, document_values=VALUES), [(address, {**record, "step": None})])
    assert plans == [] and refusals(skipped.drain_skips()) == [(address, "missing_field", "document value 'step'; "
                                                                "'step' is null")]


@pytest.mark.parametrize("packer", ["pack_flat", "pack_pairs"])
def test_the_token_counter_counts_nothing_of_a_record_refused_for_its_values(packer):
    count = _op(packer, "pad", 64, document_values=["reward"]).token_counter()
    address, record = _record(0, 4)
    assert count(address, record) == (4 if packer == "pack_flat" else 8)
    assert count(address, {**record, "reward": "high"}) == 0
    assert [reason for _, reason, _ in count.drain_skips()] == ["bad_document_value"]


@pytest.mark.parametrize("options, says", [
    ({"document_values": "label"}, "document_values must be a list of record fields' names, got 'label'"),
    ({"document_values": ["label", ""]}, "document_values' names must be a record field's name"),
    ({"document_values": ["label", "label"]}, "document_values names a field twice"),
    ({"document_values": ["labels"]}, "document_values cannot carry 'labels' into the rows: the rows hold their own"),
    ({"document_values": ["document_ids"]}, "document_values cannot carry 'document_ids' into the rows"),
    ({"document_values": ["label_counts"]}, "document_values cannot carry 'label_counts' into the rows: a batch"),
    ({"document_values": ["input_ids"]}, "document_values names 'input_ids', the field of a document's ids"),
    ({"document_values": ["mask"], "loss_mask_field": "mask"}, "document_values names 'mask', the field of"),
])
def test_names_that_cannot_stand_in_a_row_are_refused(options, says):
    with pytest.raises(ConfigurationError, match=f"pack_flat: {says}"):
        PackFlatOp(32, **options)


def test_pack_pairs_refuses_a_value_read_from_a_documents_field():
    with pytest.raises(ConfigurationError, match="pack_pairs: document_values names 'rejected_loss_mask'"):
        PackPairsOp(32, document_values=["rejected_loss_mask"])


def test_the_fingerprint_holds_them_only_where_given():
    assert "document_values" not in PackFlatOp(32).fingerprint(2)
    assert "document_values" not in PackPairsOp(32).fingerprint(2)
    assert PackFlatOp(32, document_values=["a", "b"]).fingerprint(2)["document_values"] == ["a", "b"]
    assert PackFlatOp(32, document_values=["a", "b"]).fingerprint(2) != PackFlatOp(
        32, document_values=["b", "a"]).fingerprint(2)
    assert PackPairsOp(32, document_values=("margin",)).fingerprint(2)["document_values"] == ["margin"]


def test_a_pipeline_hands_them_to_the_trainer_and_counts_what_it_refused(tmp_path):
    records = [{"input_ids": list(range(1, 2 + i % 5)), "label": i % 2 == 0} for i in range(30)]
    records[4]["label"] = "yes"
    del records[9]["label"]
    (tmp_path / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = StaticMixtureWorkSource([Dataset.from_path("kto", str(tmp_path / "kto.jsonl"))], seed=1,
                                     records_per_chunk=8, num_epochs=1)
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline")
                .pack_flat(8, "first_fit", document_values=["label"]).batch(2))
    seen = {}
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        for batch in loader:
            arrays = batch.to_numpy()
            labels = iter(arrays["label"].tolist())
            for row, sources in enumerate(batch.sources):
                assert arrays["label_counts"][row] == len(sources)
                seen.update((address.index, next(labels)) for address in sources)
        total = loader.stats()["datasets"]["kto"]["total"]
    assert seen == {i: float(i % 2 == 0) for i in range(30) if i not in (4, 9)}
    assert total["skipped"] == {"bad_document_value": 1, "missing_field": 1} and total["emitted"] == 28
