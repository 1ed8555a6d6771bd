"""Training on part of a document: `tokenize(prompt_field=...)` writes one loss-mask flag per id and
the packers write IGNORE_INDEX as the label before every token the mask leaves out
(zephon/_loss_mask.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.harness import assert_plans_collate_like_their_rows
from zephon import BadRecordError, ConfigurationError, IGNORE_INDEX, Pipeline
from zephon._packing import FirstFitPacker, PackFlatOp, WrapPacker
from zephon._record_ops import TokenizeOp
from zephon._records import Chunk, ChunkRecords, RecordAddress
from zephon._tokenizer import load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

BOS, EOS = 0, 1  # the demo tokenizer's <|bos|> and <|eos|>


def tokenize(tokenizer_path, records: list[dict], on_error: str = "skip", **options) -> ChunkRecords:
    chunk = ChunkRecords(Chunk("d", 0, 0, len(records)), [dict(r) for r in records],
                         [RecordAddress("d", "s", i) for i in range(len(records))])
    return TokenizeOp(str(tokenizer_path), bos="<|bos|>", eos="<|eos|>", **options).build(on_error)(chunk)


def encode(tokenizer_path, text: str) -> list[int]:
    return load_tokenizer(str(tokenizer_path)).tokenizer.encode(text, add_special_tokens=False).ids


def test_the_prompt_goes_between_bos_and_the_text_and_only_the_text_and_eos_are_marked(demo_tokenizer_path):
    records = [{"prompt": "Question: what is a lane?\n", "text": "A lane is a stream of records."},
               {"prompt": "Translate: seed\n", "text": "graine"}]
    out = tokenize(demo_tokenizer_path, records, prompt_field="prompt")
    for record, given in zip(out.records, records):
        prompt, text = encode(demo_tokenizer_path, given["prompt"]), encode(demo_tokenizer_path, given["text"])
        assert record["input_ids"].tolist() == [BOS, *prompt, *text, EOS]
        assert record["loss_mask"].dtype == np.bool_
        assert record["loss_mask"].tolist() == [False] * (1 + len(prompt)) + [True] * (len(text) + 1)
        assert set(record) == {"input_ids", "loss_mask"}, "the prompt and the text are dropped with the text"
    kept = tokenize(demo_tokenizer_path, records, prompt_field="prompt", keep_field=True).records
    assert [(r["prompt"], r["text"]) for r in kept] == [(r["prompt"], r["text"]) for r in records]
    plain = tokenize(demo_tokenizer_path, records).records
    assert all("loss_mask" not in r for r in plain), "without a prompt nothing is written"


def test_an_empty_prompt_masks_only_the_bos(demo_tokenizer_path):
    [record] = tokenize(demo_tokenizer_path, [{"prompt": "", "text": "a caption"}], prompt_field="prompt").records
    [plain] = tokenize(demo_tokenizer_path, [{"text": "a caption"}]).records
    assert record["input_ids"].tolist() == plain["input_ids"].tolist()
    assert record["loss_mask"].tolist() == [False] + [True] * (len(plain["input_ids"]) - 1)


def test_markers_in_the_prompt_and_the_text_count_the_prompt_s_ids(demo_tokenizer_path):
    prompt, text = "<image>\nWhat is it?\n", "It is <image> a dog"
    [record] = tokenize(demo_tokenizer_path, [{"prompt": prompt, "text": text}], prompt_field="prompt",
                        marker="<image>").records
    question, first, second = (encode(demo_tokenizer_path, t) for t in ("\nWhat is it?\n", "It is ", " a dog"))
    assert record["input_ids"].tolist() == [BOS, *question, *first, *second, EOS]
    assert record["image_offsets"] == (1, 1 + len(question) + len(first))
    assert record["loss_mask"].tolist() == [False] * (1 + len(question)) + [True] * (len(first) + len(second) + 1)


def test_a_record_whose_prompt_cannot_be_tokenized_is_skipped_naming_the_prompt(demo_tokenizer_path):
    records = [{"text": "no prompt"}, {"prompt": 3, "text": "a number"}, {"prompt": "\ud800", "text": "surrogate"},
               {"prompt": "fine\n"}, {"prompt": "fine\n", "text": "kept"}]
    out = tokenize(demo_tokenizer_path, records, prompt_field="prompt")
    kept = [BOS, *encode(demo_tokenizer_path, "fine\n"), *encode(demo_tokenizer_path, "kept"), EOS]
    assert [r["input_ids"].tolist() for r in out.records] == [kept]
    assert [reason for _, reason in out.skipped] == ["missing_field", "not_text", "invalid_utf8", "missing_field"]
    details = {reason: list(found.values()) for reason, found in out.skip_details.items()}
    assert details["missing_field"] == ["field 'prompt'; fields it has: 'text'", "field 'text'; fields it has: 'prompt'"]
    assert details["not_text"] == ["field 'prompt' holds an int, not a string"]
    assert details["invalid_utf8"][0].startswith("field 'prompt' holds a lone surrogate")
    with pytest.raises(BadRecordError, match="field 'prompt' holds an int"):
        tokenize(demo_tokenizer_path, records[1:2], on_error="raise", prompt_field="prompt")


@pytest.mark.parametrize("options, message", [
    ({"loss_mask_field": "mask"}, "loss_mask_field='mask' is written only with a prompt"),
    ({"prompt_field": "text"}, "prompt_field='text' is also another field"),
    ({"prompt_field": "prompt", "loss_mask_field": "input_ids"}, "loss_mask_field='input_ids' is also another field"),
    ({"prompt_field": "prompt", "loss_mask_field": "prompt"}, "loss_mask_field='prompt' is also another field"),
    ({"prompt_field": ""}, "prompt_field must be a record field's name"),
    ({"prompt_field": "prompt", "segments": True}, "prompt_field and segments=True both say what is learned"),
    ({"segments": "yes"}, "segments must be True or False"),
    ({"segments": True, "loss_mask_field": "text"}, "loss_mask_field='text' is also another field"),
], ids=["mask_without_prompt", "prompt_is_text", "mask_is_ids", "mask_is_prompt", "empty_prompt_name",
        "prompt_and_segments", "segments_not_bool", "segments_mask_is_text"])
def test_tokenize_refuses_prompt_fields_it_would_not_write_or_would_overwrite(demo_data_dir, demo_tokenizer_path,
                                                                            options, message):
    pipeline = Pipeline(StaticMixtureWorkSource([Dataset.from_path("jargon", str(demo_data_dir / "jargon"))]))
    with pytest.raises(ConfigurationError, match=message):
        pipeline.tokenize(str(demo_tokenizer_path), **options)


# Cut inside words (`sha` + `rd`, `chu` + `nk`), where the document encoded whole has one token
# across the cut (`ard`, `nk` after `Ġchu`... as its merges fall).
CHAT = [["USER: <image>\nWhat is on the lane? ASSISTANT:", False], [" A sha", True], ["rd.", True],
        [" USER: And then? ASSISTANT: A chu", False], ["nk, then a batch.", True]]


@pytest.mark.parametrize("marker", [None, "<image>"], ids=["no_marker", "marker"])
def test_segments_are_the_document_encoded_whole_each_id_learned_where_a_character_it_covers_is(
    demo_tokenizer_path, marker
):
    """A chat's turns: the ids of its text encoded whole (with a marker, its pieces between
    markers), between BOS and EOS; an id is learned where any character of its span is, so one
    straddling a cut into the answer is learned; the EOS as the last segment."""
    [record] = tokenize(demo_tokenizer_path, [{"text": CHAT}], segments=True, marker=marker).records
    text = "".join(segment for segment, _ in CHAT)
    learned_at = [learned for segment, learned in CHAT for _ in segment]
    tokenizer = load_tokenizer(str(demo_tokenizer_path)).tokenizer
    ids, mask, offsets, at = [BOS], [False], [], 0
    for k, piece in enumerate(text.split("<image>") if marker else [text]):
        if k:
            offsets.append(len(ids))
            at += len("<image>")
        encoding = tokenizer.encode(piece, add_special_tokens=False)
        ids += encoding.ids
        mask += [any(learned_at[at + start : at + max(end, start + 1)]) for start, end in encoding.offsets]
        at += len(piece)
    assert record["input_ids"].tolist() == ids + [EOS]
    assert record["loss_mask"].tolist() == mask + [True]
    apart = [i for segment, _ in CHAT for piece in segment.split("<image>") for i in encode(demo_tokenizer_path, piece)]
    assert record["input_ids"].tolist() != [BOS, *apart, EOS], "the cuts are no seams"
    straddling = tokenizer.token_to_id("ard")
    assert straddling in ids and mask[ids.index(straddling)], "`ard` of `sha` + `rd` is learned"
    if marker:
        assert record["image_offsets"] == tuple(offsets) and len(offsets) == 1
    else:
        assert "image_offsets" not in record
    assert set(record) == {"input_ids", "loss_mask"} | ({"image_offsets"} if marker else set())


def test_a_prompt_is_encoded_apart_from_its_text_and_segments_are_not(demo_tokenizer_path):
    """`prompt_field` encodes a prefix and its suffix apart, as a processor does; the same two as
    segments are one text: alike where the cut falls between words, not inside one."""
    for prompt, text, alike in [("Q: a lane?\n", "A stream.", True), ("Q: a lane? A sha", "rd.", False)]:
        prompted = tokenize(demo_tokenizer_path, [{"prompt": prompt, "text": text}], prompt_field="prompt").records[0]
        segmented = tokenize(demo_tokenizer_path, [{"text": [[prompt, False], [text, True]]}], segments=True).records[0]
        assert prompted["input_ids"].tolist() == [BOS, *encode(demo_tokenizer_path, prompt),
                                                  *encode(demo_tokenizer_path, text), EOS]
        assert segmented["input_ids"].tolist() == [BOS, *encode(demo_tokenizer_path, prompt + text), EOS]
        assert (prompted["input_ids"].tolist() == segmented["input_ids"].tolist()) == alike


def test_an_unlearned_last_segment_leaves_the_eos_out_too(demo_tokenizer_path):
    [record] = tokenize(demo_tokenizer_path, [{"text": [["learned", True], [" read", False]]}], segments=True).records
    assert record["loss_mask"].tolist() == [False] + [True] * len(encode(demo_tokenizer_path, "learned")) + \
        [False] * (len(encode(demo_tokenizer_path, " read")) + 1)


def test_records_that_are_no_list_of_segments_are_skipped_by_name(demo_tokenizer_path):
    records = [{"text": "a plain text"}, {"text": [["a", 1]]}, {"text": [["a", True, "x"]]}, {"text": [["  ", True]]},
               {"text": []}, {"body": []}, {"text": [["\ud800", True]]}, {"text": [["kept", True]]}]
    out = tokenize(demo_tokenizer_path, records, segments=True)
    assert [r["input_ids"].tolist() for r in out.records] == [[BOS, *encode(demo_tokenizer_path, "kept"), EOS]]
    assert [reason for _, reason in out.skipped] == ["not_segments"] * 3 + ["empty_document"] * 2 + \
        ["missing_field", "invalid_utf8"]
    details = {reason: list(found.values()) for reason, found in out.skip_details.items()}
    lists = "not a list of [text, learned] pairs (a str and true or false) or [text, learned, template] triples"
    assert details["not_segments"] == [f"field 'text' holds 'a plain text', {lists}",
                                       f"field 'text' holds ['a', 1], {lists}",
                                       f"field 'text' holds ['a', True, 'x'], {lists}"]
    assert details["empty_document"] == ["field 'text' holds 1 segment(s), every text blank",
                                         "field 'text' holds no segment"]
    assert details["missing_field"] == ["field 'text'; fields it has: 'body'"]
    assert details["invalid_utf8"][0].startswith("field 'text' holds a text with a lone surrogate")


def expected_labels(ids: np.ndarray, mask: np.ndarray | None) -> list[int]:
    """A document's labels by position, written from the definition: the next token where the
    mask keeps it, else IGNORE_INDEX, and IGNORE_INDEX at the document's last token."""
    out = []
    for k in range(len(ids)):
        learned = k + 1 < len(ids) and (mask is None or bool(mask[k + 1]))
        out.append(int(ids[k + 1]) if learned else IGNORE_INDEX)
    return out


def documents(seed: int, count: int) -> list[dict]:
    """Documents of 1-40 ids, a third unmasked, a third masked by a bool array, a third by a list of
    0/1 (a mask stored in the data)."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        ids = np.array([rng.randrange(3, 500) for _ in range(rng.randint(1, 40))], dtype=np.int32)
        record = {"input_ids": ids}
        if k % 3:
            mask = [rng.random() < 0.6 for _ in ids]
            record["loss_mask"] = np.array(mask) if k % 3 == 1 else [int(m) for m in mask]
        out.append(record)
    return out


@pytest.mark.parametrize("algorithm", ["wrap", "first_fit"])
@pytest.mark.parametrize("max_length", [1, 7, 16, 64])
def test_every_row_s_labels_are_its_documents_next_tokens_where_their_masks_keep_them(algorithm, max_length):
    docs = documents(seed=max_length, count=60)
    packer = WrapPacker(max_length, 2, "input_ids") if algorithm == "wrap" else \
        FirstFitPacker(max_length, 2, "input_ids", max_open_rows=3)
    plans = []
    for index, record in enumerate(docs):
        plans += packer.push((RecordAddress("d", "s", index), record))
    plans += packer.flush()
    got: dict[int, list[int]] = {}
    for plan in plans:
        row = plan.assemble()
        labels, document_ids = row.tokens["labels"].tolist(), row.tokens["document_ids"].tolist()
        for position, (label, document) in enumerate(zip(labels, document_ids)):
            if document >= 0:
                got.setdefault(row.sources[document].index, []).append(label)
            else:
                assert label == IGNORE_INDEX
    assert packer.drain_skips() == []
    learned = 0
    for index, record in enumerate(docs):
        mask = record.get("loss_mask")
        labels = expected_labels(record["input_ids"], None if mask is None else np.asarray(mask, bool))
        assert got[index] == labels, index
        learned += sum(label != IGNORE_INDEX for label in labels)
    assert sum(plan.learned_by_dataset.get("d", 0) for plan in plans) == learned, "what the ledger counts"
    assert_plans_collate_like_their_rows(plans, microbatch=3)
    assert any(label == IGNORE_INDEX for index in got for label in got[index][:-1]), "some mask left a token out"


@pytest.mark.parametrize("mask, detail", [
    (np.ones(3, dtype=bool), "'loss_mask' holds 3 flags for the 4 ids of 'input_ids'"),
    ([0, 1, 2, 1], "'loss_mask' holds list [0, 1, 2, 1], not one bool (or 0/1) per id of 'input_ids'"),
    ("1111", "'loss_mask' holds str '1111', not one bool (or 0/1) per id of 'input_ids'"),
    (np.ones((2, 2), dtype=bool), "'loss_mask' holds ndarray"),
    ([0.0, 1.0, 1.0, 1.0], "'loss_mask' holds list [0.0, 1.0, 1.0, 1.0], not one bool"),
], ids=["short", "a_two", "a_string", "two_d", "floats"])
def test_a_mask_that_is_not_one_flag_per_id_is_skipped_by_name(mask, detail):
    for packer in (WrapPacker(8, 2, "input_ids"), FirstFitPacker(8, 2, "input_ids", 2)):
        address = RecordAddress("d", "s", 0)
        assert packer.push((address, {"input_ids": np.arange(3, 7, dtype=np.int32), "loss_mask": mask})) == []
        assert packer.flush() == []
        [(skipped, reason, describe)] = packer.drain_skips()
        assert (skipped, reason) == (address, "bad_loss_mask") and describe().startswith(detail)
    count = PackFlatOp(8).token_counter()
    assert count(address, {"input_ids": np.arange(3, 7, dtype=np.int32), "loss_mask": mask}) == 0
    assert [reason for _, reason, _ in count.drain_skips()] == ["bad_loss_mask"]


def test_the_mask_field_is_fingerprinted_only_where_it_changes_what_is_read(demo_tokenizer_path):
    """Recipes that never set it keep the digests their checkpoints hold."""
    assert "loss_mask_field" not in PackFlatOp(64).fingerprint(0)
    assert PackFlatOp(64, loss_mask_field="mask").fingerprint(0)["loss_mask_field"] == "mask"
    plain = TokenizeOp(str(demo_tokenizer_path)).fingerprint()
    assert not {"prompt_field", "loss_mask_field"} & set(plain)
    prompted = TokenizeOp(str(demo_tokenizer_path), prompt_field="prompt").fingerprint()
    assert {k: v for k, v in prompted.items() if k not in plain} == {"prompt_field": "prompt", "loss_mask_field": "loss_mask"}
    segmented = TokenizeOp(str(demo_tokenizer_path), segments=True).fingerprint()
    assert {k: v for k, v in segmented.items() if k not in plain} == {"segments": "joined",
                                                                      "loss_mask_field": "loss_mask"}
    with pytest.raises(ConfigurationError, match="loss_mask_field and field are both 'input_ids'"):
        PackFlatOp(64, loss_mask_field="input_ids")


def test_the_memory_budget_holds_the_mask_in_flight_and_the_targets_held(demo_data_dir, demo_tokenizer_path):
    """A prompted recipe carries a bool per id in flight and int32 targets beside the document a
    packer holds: the budget's `records` term grows by 1 and 4 bytes a token of those."""
    from zephon._memory import _largest_chunk_raw_bytes, memory_budget

    def loader(**options):
        source = StaticMixtureWorkSource([Dataset.from_path("jargon", str(demo_data_dir / "jargon"))], seed=1,
                                         records_per_chunk=16)
        pipeline = (Pipeline(source).options(num_lanes=2).tokenize(str(demo_tokenizer_path), **options)
                    .pack_flat(64).batch(2))
        return pipeline.shard(0, 1)

    with loader() as plain, loader(prompt_field="prompt") as prompted, loader(segments=True) as segmented:
        tokens = int(_largest_chunk_raw_bytes(plain.plan)) + 1  # no token estimation: a token a byte at most
        lanes, prefetch = len(plain.lanes), plain.prefetch
        assert prompted.prefetch == segmented.prefetch == prefetch
        grown = [memory_budget(masked).records - memory_budget(plain).records for masked in (prompted, segmented)]
    assert grown == [lanes * prefetch * tokens + lanes * 4 * tokens] * 2
