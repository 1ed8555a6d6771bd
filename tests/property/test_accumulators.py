"""Property tests for the accumulators: push/flush never lose, duplicate or reorder what they must keep."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import assert_plans_collate_like_their_rows, refusals
from zephon import IGNORE_INDEX, PADDING_DOCUMENT, ConfigurationError, SegmentContext
from zephon._first_fit import FirstFitRows
from zephon._packing import ALGORITHMS, FirstFitPacker, FlatRowPlan, PackFlatOp, WrapPacker
from zephon._records import RecordAddress
from zephon._shuffle import ShuffleBuffer

documents = st.lists(st.integers(min_value=1, max_value=80), min_size=0, max_size=40)


def _docs(lengths):
    """Documents whose tokens encode (document, position) so every token is traceable."""
    return [
        (RecordAddress("d", "s", i), {"input_ids": (np.arange(n, dtype=np.int32) + 1000 * (i + 1))})
        for i, n in enumerate(lengths)
    ]


def _plans(packer, docs):
    plans = []
    for doc in docs:
        plans.extend(packer.push(doc))
    plans.extend(packer.flush())
    assert packer.flush() == [], "a flush must leave the accumulator empty"
    return plans


def _run(packer, docs):
    """The packed rows, each assembled on its own."""
    return [plan.assemble() for plan in _plans(packer, docs)]


def _packer(algorithm: str, max_length: int, pad_id: int = 0, max_open_rows: int = 4, overlong: str = "split"):
    """The packer `pack_flat` makes for one lane segment."""
    op = PackFlatOp(max_length, algorithm, max_open_rows=max_open_rows, overlong=overlong)
    return op.factory(pad_id)(SegmentContext(lane=0, segment=0))


def _real_tokens(rows):
    return np.concatenate(
        [r.tokens["input_ids"][r.tokens["document_ids"] != PADDING_DOCUMENT] for r in rows] or [np.zeros(0, np.int32)]
    )


@settings(max_examples=200, deadline=None)
@given(documents, st.integers(min_value=1, max_value=64))
def test_wrap_packing_keeps_every_token_once_in_order(lengths, max_length):
    docs = _docs(lengths)
    rows = _run(WrapPacker(max_length, pad_id=0, field="input_ids"), docs)
    expected = np.concatenate([d["input_ids"] for _, d in docs] or [np.zeros(0, np.int32)])
    np.testing.assert_array_equal(_real_tokens(rows), expected)
    assert all(r.length == max_length for r in rows)
    assert all(r.num_real_tokens == max_length for r in rows[:-1]), "only the last row may hold padding"


@settings(max_examples=200, deadline=None)
@given(documents, st.integers(min_value=1, max_value=64), st.integers(min_value=1, max_value=6))
def test_first_fit_keeps_every_token_once_and_never_splits_a_fitting_document(lengths, max_length, open_rows):
    docs = _docs(lengths)
    rows = _run(FirstFitPacker(max_length, pad_id=0, field="input_ids", max_open_rows=open_rows), docs)
    got = sorted(_real_tokens(rows).tolist())
    expected = sorted(np.concatenate([d["input_ids"] for _, d in docs] or [np.zeros(0, np.int32)]).tolist())
    assert got == expected
    for row in rows:
        ids, doc_ids = row.tokens["input_ids"], row.tokens["document_ids"]
        for doc in set(doc_ids[doc_ids >= 0].tolist()):
            piece = ids[doc_ids == doc]
            owner = int(piece[0]) // 1000 - 1
            if lengths[owner] <= max_length:
                assert len(piece) == lengths[owner], "a document that fits in a row was split"


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=12), st.integers(min_value=1, max_value=4), st.data())
def test_first_fit_closes_a_row_early_only_for_an_item_that_must_stay_open(capacity, max_open, data):
    """An item filling a row alone (a piece of a document longer than the row, a document exactly
    as long) gets its own full row; closing an open row for it would only add padding."""
    rows = FirstFitRows(capacity, max_open)
    lengths = data.draw(st.lists(st.integers(min_value=1, max_value=capacity), max_size=60))
    emitted = []
    for i, length in enumerate(lengths):
        open_before = [list(r) for r in rows._rows]
        closed = rows.place(i, length)
        if length == capacity:
            assert closed == [[i]] and rows._rows == open_before
        for row in closed:
            if sum(lengths[j] for j in row) < capacity:
                assert len(open_before) == max_open and length < capacity, "a row closed early for nothing"
        emitted += closed
    emitted += rows.drain()
    assert sorted(j for row in emitted for j in row) == list(range(len(lengths)))


@settings(max_examples=100, deadline=None)
@given(documents, st.integers(min_value=2, max_value=64))
def test_labels_are_the_next_token_of_the_same_document(lengths, max_length):
    rows = _run(WrapPacker(max_length, pad_id=0, field="input_ids"), _docs(lengths))
    for row in rows:
        ids, labels, docs = (row.tokens[k] for k in ("input_ids", "labels", "document_ids"))
        positions = row.tokens["position_ids"]
        for i in range(len(ids)):
            owner, position = divmod(int(ids[i]), 1000)
            if docs[i] == PADDING_DOCUMENT:
                assert labels[i] == IGNORE_INDEX
            elif position == lengths[owner - 1] - 1:
                assert labels[i] == IGNORE_INDEX, "a document's last token has nothing to predict"
            else:
                assert labels[i] == ids[i] + 1, "label must be the following token of the same document"
            if i and docs[i] == docs[i - 1] and docs[i] != PADDING_DOCUMENT:
                assert positions[i] == positions[i - 1] + 1
            elif docs[i] != PADDING_DOCUMENT:
                assert positions[i] == 0, "positions restart at each document piece"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(), max_size=200), st.integers(min_value=1, max_value=50), st.integers(0, 3))
def test_shuffle_emits_each_item_exactly_once(items, buffer_size, segment):
    buffer = ShuffleBuffer(buffer_size, SegmentContext(lane=1, segment=segment).rng(7, "shuffle"))
    out = []
    for item in items:
        out.extend(buffer.push(item))
    assert len(out) == max(0, len(items) - buffer_size)
    out.extend(buffer.flush())
    assert sorted(out) == sorted(items)
    assert buffer.flush() == []


def test_segment_rng_depends_only_on_seed_lane_and_segment():
    def draw(lane, seg, seed=1):
        stream = SegmentContext(lane, seg).rng(seed, "shuffle")
        return [stream.next_u64() for _ in range(4)]

    assert draw(0, 0) == draw(0, 0)
    assert draw(0, 0) != draw(1, 0)
    assert draw(0, 0) != draw(0, 1)
    assert draw(0, 0) != draw(0, 0, seed=2)


@settings(max_examples=200, deadline=None)
@given(documents, st.integers(min_value=1, max_value=64))
def test_pad_places_each_document_in_rows_of_its_own_in_order(lengths, max_length):
    """No packing: every row holds one document, or one `max_length` piece of a longer one, in the
    order pushed, the rest padding; a flush has nothing left to give."""
    packer = _packer("pad", max_length, pad_id=7)
    rows = []
    for doc in _docs(lengths):
        pushed = packer.push(doc)
        assert len(pushed) == -(-len(doc[1]["input_ids"]) // max_length), "each piece its row, at once"
        rows += [plan.assemble() for plan in pushed]
    assert packer.flush() == []
    np.testing.assert_array_equal(_real_tokens(rows), np.concatenate([r["input_ids"] for _, r in _docs(lengths)]
                                                                      or [np.zeros(0, np.int32)]))
    for row in rows:
        real = row.tokens["document_ids"] != PADDING_DOCUMENT
        assert set(row.tokens["document_ids"][real].tolist()) == {0} and len(row.sources) == 1
        assert (row.tokens["input_ids"][~real] == 7).all() and real[: real.sum()].all(), "the document first"


@settings(max_examples=100, deadline=None)
@given(documents, st.integers(min_value=1, max_value=64), st.integers(min_value=1, max_value=5),
       st.sampled_from(ALGORITHMS))
def test_a_microbatch_of_flat_plans_equals_its_rows_assembled_one_by_one(lengths, max_length, microbatch, algorithm):
    packer = _packer(algorithm, max_length, pad_id=7, max_open_rows=3)
    plans = _plans(packer, _docs(lengths))
    assert all(isinstance(plan, FlatRowPlan) for plan in plans)
    assert_plans_collate_like_their_rows(plans, microbatch)


def test_flat_packers_refuse_a_record_without_ids_to_pack_and_report_it_by_reason():
    """What the lane driver hands the ledger through `drain_skips()`; the other records pack as
    usual. An int32 array is what tokenize writes; lists come from data stored pre-tokenized."""
    records = [
        {"input_ids": np.arange(1, 6, dtype=np.int32)},
        {},
        {"input_ids": "text"},
        {"input_ids": np.zeros(0, dtype=np.int32)},
        {"input_ids": [1, 2**31]},
        {"input_ids": [3, 4, 5]},
    ]
    items = [(RecordAddress("d", "s", i), r) for i, r in enumerate(records)]
    for packer in (WrapPacker(4, 0, "input_ids"), FirstFitPacker(4, 0, "input_ids", 2)):
        rows = _run(packer, items)
        np.testing.assert_array_equal(np.sort(_real_tokens(rows)), [1, 2, 3, 3, 4, 4, 5, 5])
        assert all(r.tokens["input_ids"].dtype == np.int32 for r in rows)
        assert refusals(packer.drain_skips()) == [
            (RecordAddress("d", "s", 1), "missing_field", "it lacks 'input_ids': it has no fields"),
            (RecordAddress("d", "s", 2), "not_tokens", "'input_ids' holds a string of 4 characters (token ids are "
             "what `tokenize` writes), not a flat list of token ids in [0, 2**31)"),
            (RecordAddress("d", "s", 3), "empty_document", "'input_ids' holds no token ids"),
            (RecordAddress("d", "s", 4), "not_tokens", "'input_ids' holds ids from 1 to 2147483648, not a flat list "
             "of token ids in [0, 2**31)"),
        ]
        assert packer.drain_skips() == []
    count = PackFlatOp(4).token_counter()  # token estimation counts what the packers place
    assert [count(address, record) for address, record in items] == [5, 0, 0, 0, 0, 3]


@settings(max_examples=200, deadline=None)
@given(documents, st.integers(min_value=1, max_value=64), st.sampled_from(ALGORITHMS),
       st.sampled_from(["truncate", "keep_end", "skip"]))
def test_a_document_longer_than_a_row_is_cut_to_its_first_ids_or_refused_and_reported(lengths, max_length, algorithm,
                                                                                     overlong):
    """`overlong`: every row holds the documents that fit whole and, truncated, only the first
    `max_length` ids of a longer one, its last learning nothing (the last ones, "keep_end", its
    first learning nothing); each long one is reported once, as (address, ids dropped) or (address,
    "document_too_long", detail). Token estimation counts what is placed."""
    docs = _docs(lengths)
    packer = _packer(algorithm, max_length, overlong=overlong)
    rows = _run(packer, docs)
    cut = overlong in ("truncate", "keep_end")
    kept = [(i, n) for i, n in enumerate(lengths) if n <= max_length or cut]
    ids = [np.arange(n, dtype=np.int32)[-max_length:] if overlong == "keep_end" else np.arange(min(n, max_length),
           dtype=np.int32) for _, n in kept]
    expected = np.concatenate([part + 1000 * (i + 1) for (i, _), part in zip(kept, ids)] or [np.zeros(0)])
    np.testing.assert_array_equal(np.sort(_real_tokens(rows)), np.sort(expected))
    learned = sum(int((row.tokens["labels"] != IGNORE_INDEX).sum()) for row in rows)
    assert learned == sum(len(part) - 1 for part in ids), "each document learns every id kept but its first"
    long = [(RecordAddress("d", "s", i), n) for i, n in enumerate(lengths) if n > max_length]
    if cut:
        assert packer.drain_truncations() == [(address, n - max_length) for address, n in long]
        assert packer.drain_skips() == []
    else:
        detail = "{} tokens, more than a row's max_length={} (pack_flat overlong='skip')"
        assert refusals(packer.drain_skips()) == [
            (address, "document_too_long", detail.format(n, max_length)) for address, n in long]
        assert packer.drain_truncations() == []
    count = PackFlatOp(max_length, algorithm, overlong=overlong).token_counter()
    assert sum(count(address, record) for address, record in docs) == sum(map(len, ids))


def test_overlong_enters_the_recipe_only_where_it_is_not_the_default_split():
    """The recipes made before it keep the digests their checkpoints hold; another value is refused by name."""
    assert PackFlatOp(64).fingerprint(0) == PackFlatOp(64, overlong="split").fingerprint(0)
    assert "overlong" not in PackFlatOp(64).fingerprint(0)
    assert PackFlatOp(64, overlong="truncate").fingerprint(0) == {**PackFlatOp(64).fingerprint(0),
                                                                  "overlong": "truncate"}
    with pytest.raises(ConfigurationError,
                       match=r"pack_flat: overlong must be one of \('split', 'truncate', 'keep_end', 'skip'\)"):
        PackFlatOp(64, overlong="drop")


@pytest.mark.parametrize("value, held", [
    (7, "a single int"), (2.5, "a single float"), (True, "a single bool"), ({"ids": [1, 2]}, "a single dict"),
])
def test_a_packers_refusal_of_one_value_that_is_no_list_says_what_the_value_is(value, held):
    """A number or a mapping where the ids belong (a JSON `"input_ids": 7`, a nested struct) is
    what NumPy reads as a 0-D array, and the detail said "holds a 0-D array of shape ()", which no
    record holds: it says the value's type."""
    packer = WrapPacker(4, 0, "input_ids")
    packer.push((RecordAddress("d", "s", 0), {"input_ids": value}))
    assert refusals(packer.drain_skips()) == [(RecordAddress("d", "s", 0), "not_tokens",
                                               f"'input_ids' holds {held}, not a flat list of token ids in [0, 2**31)")]


def test_shuffle_reorders_what_passes_through_it_and_what_a_flush_releases():
    """Emitting every item exactly once is not enough: a buffer that, once full, passed each new
    item straight through, or that released its contents at a flush in arrival order, keeps the
    test above green while shuffling nothing."""
    def run(n, buffer_size):
        buffer = ShuffleBuffer(buffer_size, SegmentContext(lane=0, segment=0).rng(7, "shuffle"))
        passed = [out for item in range(n) for out in buffer.push(item)]
        return passed, buffer.flush()

    passed, _ = run(200, 8)
    assert passed != sorted(passed), "once full, the buffer passes items through in arrival order"
    _, flushed = run(8, 16)
    assert sorted(flushed) == list(range(8)) and flushed != list(range(8)), "a flush releases items in arrival order"


def test_the_recipe_fingerprint_holds_max_open_rows_only_where_the_packer_uses_it():
    """Wrap keeps one row open and ignores max_open_rows; in its fingerprint, changing it refused
    a resume for nothing. First-fit's rows do depend on it."""
    def fingerprint(algorithm: str, max_open_rows: int) -> dict:
        return PackFlatOp(64, algorithm, max_open_rows=max_open_rows).fingerprint(0)

    assert fingerprint("wrap", 4) == fingerprint("wrap", 16)
    assert fingerprint("first_fit", 4) != fingerprint("first_fit", 16)


@settings(max_examples=200, deadline=None)
@given(documents, st.integers(min_value=1, max_value=64), st.integers(min_value=1, max_value=3),
       st.sampled_from(ALGORITHMS))
def test_a_rows_sources_name_each_document_by_its_document_id_even_when_a_record_repeats(lengths, max_length,
                                                                                      records, algorithm):
    """`sources[d]` is the record of the tokens where `document_ids == d`, the way a trainer
    attributes tokens to records; a record read again (the next epoch) may fill a row twice."""
    occurrences = _docs(lengths)  # token values say which occurrence they came from
    docs = [(RecordAddress("d", "s", i % records), record) for i, (_, record) in enumerate(occurrences)]
    packer = _packer(algorithm, max_length)
    for row in _run(packer, docs):
        document_ids = row.tokens["document_ids"]
        assert len(row.sources) == len(np.unique(document_ids[document_ids != PADDING_DOCUMENT]))
        for d, address in enumerate(row.sources):
            occurrence = row.tokens["input_ids"][document_ids == d] // 1000 - 1
            assert {int(i) % records for i in occurrence} == {address.index}
