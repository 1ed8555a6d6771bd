"""`pack_pairs`: each record's chosen and rejected documents in one row, as documents 2k and 2k+1,
never split; the pairs it refuses or cuts, once each; the configurations it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import refusals
from zephon import IGNORE_INDEX, PADDING_DOCUMENT, ConfigurationError, Pipeline, SegmentContext
from zephon._preference import PAIR_ALGORITHMS, PackPairsOp, row_shares
from zephon._records import RecordAddress
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource


def _pair(index: int, chosen: int, rejected: int, prompt: int = 0) -> tuple[RecordAddress, dict]:
    """A record whose ids say whose they are: 1000·(index+1) + position for the chosen, 500 more
    for the rejected; the first `prompt` ids of each are not learned."""
    record = {"chosen_ids": np.arange(chosen, dtype=np.int32) + 1000 * (index + 1),
              "rejected_ids": np.arange(rejected, dtype=np.int32) + 1000 * (index + 1) + 500}
    if prompt:
        record["chosen_loss_mask"] = np.arange(chosen) >= prompt
        record["rejected_loss_mask"] = np.arange(rejected) >= prompt
    return RecordAddress("prefs", "s", index), record


def _packer(max_length: int, algorithm: str = "first_fit", overlong: str = "skip", max_open_rows: int = 3):
    op = PackPairsOp(max_length, algorithm, max_open_rows=max_open_rows, overlong=overlong)
    return op.factory(2)(SegmentContext(lane=0, segment=0))


def _plans(packer, records):
    plans = [plan for record in records for plan in packer.push(record)]
    plans.extend(packer.flush())
    assert packer.flush() == []
    return plans


pairs = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), max_size=30)


@settings(max_examples=150, deadline=None)
@given(pairs, st.integers(4, 64), st.sampled_from(PAIR_ALGORITHMS))
def test_every_pair_that_fits_is_placed_once_in_one_row_chosen_then_rejected(lengths, max_length, algorithm):
    records = [_pair(i, chosen, rejected) for i, (chosen, rejected) in enumerate(lengths)]
    packer = _packer(max_length, algorithm)
    plans = _plans(packer, records)
    placed = []
    for plan in plans:
        row = plan.assemble()
        documents, ids = row.tokens["document_ids"], row.tokens["input_ids"]
        assert len(row.sources) % 2 == 0
        for k in range(0, len(row.sources), 2):
            address = row.sources[k]
            assert row.sources[k + 1] == address, "a pair's two documents come from one record"
            _, record = records[address.index]
            np.testing.assert_array_equal(ids[documents == k], record["chosen_ids"])
            np.testing.assert_array_equal(ids[documents == k + 1], record["rejected_ids"])
            placed.append(address.index)
        assert np.all(ids[documents == PADDING_DOCUMENT] == 2)
        if algorithm == "pad":
            assert len(row.sources) == 2
    fits = [i for i, (chosen, rejected) in enumerate(lengths) if chosen + rejected <= max_length]
    assert sorted(placed) == fits
    assert [address.index for address, _, _ in refusals(packer.drain_skips())] == [
        i for i in range(len(lengths)) if i not in fits]


def test_the_prompt_learns_nothing_and_each_document_ends_unlearned():
    """The labels of a pair with a 3-id prompt: each document's ids after its prompt, shifted;
    IGNORE_INDEX over the prompt and at each document's last id."""
    (row,) = _plans(_packer(16), [_pair(0, 6, 5, prompt=3)])
    _, record = _pair(0, 6, 5)
    labels = row.assemble().tokens["labels"]
    chosen, rejected = record["chosen_ids"], record["rejected_ids"]
    expected = [IGNORE_INDEX] * 2 + list(chosen[3:]) + [IGNORE_INDEX] * 3 + list(rejected[3:]) + [IGNORE_INDEX] * 6
    assert labels.tolist() == expected


@pytest.mark.parametrize("chosen, rejected, max_length, kept", [
    (30, 5, 16, (11, 5)), (5, 30, 16, (5, 11)), (20, 20, 16, (8, 8)), (20, 20, 15, (8, 7)), (8, 9, 16, (8, 8)),
])
def test_a_row_is_shared_keeping_the_shorter_whole_where_it_takes_at_most_half(chosen, rejected, max_length, kept):
    assert row_shares(chosen, rejected, max_length) == kept


def test_truncate_keeps_each_documents_first_ids_and_counts_the_pair_once():
    packer = _packer(16, overlong="truncate")
    (plan,) = _plans(packer, [_pair(0, 30, 5)])
    row = plan.assemble()
    _, record = _pair(0, 30, 5)
    np.testing.assert_array_equal(row.tokens["input_ids"][row.tokens["document_ids"] == 0], record["chosen_ids"][:11])
    np.testing.assert_array_equal(row.tokens["input_ids"][row.tokens["document_ids"] == 1], record["rejected_ids"])
    assert packer.drain_truncations() == [(RecordAddress("prefs", "s", 0), 19)]
    assert packer.drain_skips() == []


def test_keep_end_keeps_each_documents_last_ids_so_a_long_prompt_loses_its_start_not_the_answer():
    """A 10-id prompt in a 16-id row: cut from the start, each keeps its 8 last ids, answers whole."""
    packer = _packer(16, overlong="keep_end")
    (plan,) = _plans(packer, [_pair(0, 14, 12, prompt=10)])
    row = plan.assemble()
    _, record = _pair(0, 14, 12)
    for document, side in enumerate(("chosen_ids", "rejected_ids")):
        at = row.tokens["document_ids"] == document
        np.testing.assert_array_equal(row.tokens["input_ids"][at], record[side][-8:])
        learned = row.tokens["labels"][at]
        np.testing.assert_array_equal(learned[learned != IGNORE_INDEX], record[side][10:])
    assert packer.drain_truncations() == [(RecordAddress("prefs", "s", 0), 10)]


def test_a_pair_cut_so_that_one_learns_nothing_is_skipped_rather_than_trained_on_its_prompt():
    """A 10-id prompt in a 16-id row: each cut to 8 ids holds no answer."""
    packer = _packer(16, overlong="truncate")
    assert _plans(packer, [_pair(0, 14, 12, prompt=10)]) == []
    ((address, reason, detail),) = packer.drain_skips()
    assert (address.index, reason) == (0, "pair_too_long")
    assert "would learn nothing" in detail
    assert packer.drain_truncations() == []


def test_a_record_missing_either_document_is_skipped_once_naming_the_first_missing():
    packer = _packer(32)
    _, whole = _pair(0, 3, 3)
    records = [(RecordAddress("prefs", "s", 0), {"chosen_ids": whole["chosen_ids"]}),
               (RecordAddress("prefs", "s", 1), {}),
               (RecordAddress("prefs", "s", 2), {**whole, "rejected_loss_mask": [True]})]
    assert _plans(packer, records) == []
    skipped = [(address.index, reason, detail() if callable(detail) else detail)
               for address, reason, detail in packer.drain_skips()]
    assert [(index, reason) for index, reason, _ in skipped] == [
        (0, "missing_field"), (1, "missing_field"), (2, "bad_loss_mask")]
    assert "'rejected_ids'" in skipped[0][2] and "'chosen_ids'" in skipped[1][2]


def test_the_token_counter_counts_what_the_packer_places_and_learns():
    count = PackPairsOp(16, overlong="truncate").token_counter()
    address, record = _pair(0, 30, 5, prompt=2)
    assert count(address, record) == 16
    # Every id after the 2-id prompt is the label of the one before it: 11 - 2 kept of the chosen, 5 - 2.
    assert count.learned(address, record) == (11 - 2) + (5 - 2)
    assert count(*_pair(1, 10, 10)) == 20 - 4
    assert PackPairsOp(16).token_counter()(*_pair(1, 10, 10)) == 0


@pytest.mark.parametrize("kwargs, says", [
    ({"algorithm": "wrap"}, "algorithm must be one of"),
    ({"overlong": "split"}, "overlong must be one of"),
    ({"rejected_field": "chosen_ids"}, "must be four fields"),
    ({"chosen_loss_mask_field": "rejected_loss_mask"}, "must be four fields"),
    ({"max_length": 3}, "at least 4"),
])
def test_a_configuration_that_cannot_pack_pairs_is_refused(kwargs, says):
    with pytest.raises(ConfigurationError, match=says):
        PackPairsOp(**{"max_length": 32, **kwargs})


def test_the_fingerprint_names_what_decides_the_rows():
    prints = [PackPairsOp(32).fingerprint(2), PackPairsOp(32, overlong="truncate").fingerprint(2),
              PackPairsOp(32, chosen_field="good").fingerprint(2), PackPairsOp(32, max_open_rows=4).fingerprint(2),
              PackPairsOp(32, "pad").fingerprint(2)]
    assert len({repr(p) for p in prints}) == len(prints)
    assert PackPairsOp(32, "pad").fingerprint(2) == PackPairsOp(32, "pad", max_open_rows=4).fingerprint(2)


def _pipeline(tmp_path, tokenizer, chosen_mask: str = "chosen_loss_mask", rejected_output: str = "rejected_ids"):
    (tmp_path / "p.jsonl").write_text('{"prompt": "Q?", "chosen": "a", "rejected": "b"}\n'
                                      '{"prompt": "Why?", "chosen": "c d", "rejected": "e"}\n')
    source = StaticMixtureWorkSource([Dataset.from_path("prefs", str(tmp_path / "p.jsonl"))], mixture={"prefs": 1.0},
                                     seed=0)
    return (Pipeline(source).options(num_lanes=1)
            .tokenize(str(tokenizer), field="chosen", prompt_field="prompt", output_field="chosen_ids",
                      loss_mask_field=chosen_mask, keep_field=True)
            .tokenize(str(tokenizer), field="rejected", prompt_field="prompt", output_field=rejected_output,
                      loss_mask_field="rejected_loss_mask")
            .pack_pairs(32).batch(1))


def test_a_tokenize_writing_a_loss_mask_the_packer_does_not_read_is_refused(tmp_path, demo_tokenizer_path):
    """Its mask left at tokenize's default field, the chosen document would train on its prompt."""
    with pytest.raises(ConfigurationError, match="reads the chosen document's loss mask from 'chosen_loss_mask'.*"
                                                 "writes it to 'loss_mask'"):
        _pipeline(tmp_path, demo_tokenizer_path, chosen_mask="loss_mask").shard(0, 1, global_batch_size=1)


def test_a_document_no_tokenizer_writes_is_refused(tmp_path, demo_tokenizer_path):
    with pytest.raises(ConfigurationError, match="rejected_field='rejected_ids'.* no operator writes"):
        _pipeline(tmp_path, demo_tokenizer_path, rejected_output="rejected").shard(0, 1, global_batch_size=1)


def test_a_pipeline_of_pairs_hands_over_its_pair(tmp_path, demo_tokenizer_path):
    """The two records, read again and again (an endless plan), fill the row with their pairs."""
    with _pipeline(tmp_path, demo_tokenizer_path).shard(0, 1, global_batch_size=1) as loader:
        (sources,) = next(iter(loader)).sources
    assert len(sources) % 2 == 0 and len(set(sources)) == 2
    assert all(sources[k] == sources[k + 1] for k in range(0, len(sources), 2))


def test_every_tokenize_writing_a_document_is_checked_not_only_the_last(tmp_path, demo_tokenizer_path):
    """Two datasets' tokenizers write the chosen document (texts and chats, each scoped): the
    first's loss mask going elsewhere is refused though the last's is right."""
    tokenizer = str(demo_tokenizer_path)
    pipeline = _pipeline(tmp_path, demo_tokenizer_path)
    first, *rest = [op for op in pipeline.operators if op.kind == "record"]
    astray = Pipeline(pipeline.source).tokenize(tokenizer, field="chosen", prompt_field="prompt",
                                                 output_field="chosen_ids", datasets="prefs").operators[0]
    assert PackPairsOp(32).bound_to([first, *rest]).chosen_field == "chosen_ids"
    with pytest.raises(ConfigurationError, match="writes it to 'loss_mask'"):
        PackPairsOp(32).bound_to([astray, first, *rest])
