"""`tokenize(marker="<image>")`: a LLaVA-style text says where its image goes; the marker is
dropped and its place written as a token offset, counted as `pack_multimodal` counts
`image_offsets` (image k right before text token k's offset, a BOS counted as a text token)."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest

from zephon import ConfigurationError, Pipeline
from zephon._checkpoint import canonical_json
from zephon._markers import MarkerOffsets
from zephon._record_ops import TokenizeOp
from zephon._records import Chunk, ChunkRecords, RecordAddress
from zephon._tokenizer import load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

MARKER = "<image>"

# Each text with the pieces between its markers: the ids must be the pieces' ids joined, each
# marker's offset the count of ids before it.
CASES = {
    "at_start": ("<image>\nA photo of a dog on a beach.", ["", "\nA photo of a dog on a beach."]),
    "in_the_middle": ("A photo<image> of a dog", ["A photo", " of a dog"]),
    "at_the_end": ("A photo of a dog<image>", ["A photo of a dog", ""]),
    "two_adjacent": ("Compare <image><image> these two.", ["Compare ", "", " these two."]),
    "two_apart": ("<image>\nfirst, then <image>\nsecond", ["", "\nfirst, then ", "\nsecond"]),
    "none": ("A photo of a dog", ["A photo of a dog"]),
    "only_a_marker": ("<image>", ["", ""]),
}


def tokenize(tokenizer_path, texts: list[str], **options) -> list[dict]:
    op = TokenizeOp(str(tokenizer_path), **options)
    chunk = ChunkRecords(Chunk("d", 0, 0, len(texts)), [{"text": t} for t in texts],
                         [RecordAddress("d", "s", i) for i in range(len(texts))])
    return op.build("skip")(chunk).records


def encode(tokenizer_path, text: str) -> list[int]:
    return load_tokenizer(str(tokenizer_path)).tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("bos", [None, "<|bos|>"], ids=["no_bos", "bos"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_each_marker_becomes_the_offset_of_the_next_text_token_and_leaves_the_ids(demo_tokenizer_path, case, bos):
    text, pieces = CASES[case]
    [record] = tokenize(demo_tokenizer_path, [text], marker=MARKER, bos=bos, eos="<|eos|>")
    prefix = [0] if bos else []  # <|bos|> is 0, <|eos|> 1 in the demo tokenizer
    expected, offsets = list(prefix), []
    for k, piece in enumerate(pieces):
        if k:
            offsets.append(len(expected))
        expected += encode(demo_tokenizer_path, piece)
    assert record["input_ids"].tolist() == expected + [1]
    assert record["input_ids"].dtype == np.int32
    assert record["image_offsets"] == tuple(offsets) and isinstance(record["image_offsets"], MarkerOffsets)
    assert record["image_offsets"].marker == MARKER
    assert "text" not in record


def test_the_newline_after_a_marker_is_kept_as_text(demo_tokenizer_path):
    """LLaVA writes `<image>\\n` before the question: the newline is the text's, not the marker's."""
    [record] = tokenize(demo_tokenizer_path, ["<image>\nA dog"], marker=MARKER)
    assert record["input_ids"].tolist() == encode(demo_tokenizer_path, "\nA dog")
    assert record["input_ids"].tolist() != encode(demo_tokenizer_path, "A dog")


def test_texts_without_a_marker_tokenize_as_without_the_option_in_the_same_chunk(demo_tokenizer_path):
    texts = ["plain words here", "<image>\na caption", "another plain one <|eos|>"]
    marked = tokenize(demo_tokenizer_path, texts, marker=MARKER, bos="<|bos|>")
    plain = tokenize(demo_tokenizer_path, texts, bos="<|bos|>")
    for k in (0, 2):
        assert marked[k]["input_ids"].tolist() == plain[k]["input_ids"].tolist()
        assert marked[k]["image_offsets"] == ()
    assert "image_offsets" not in plain[0], "without a marker nothing is written"
    assert marked[1]["image_offsets"] == (1,)


def test_records_without_text_are_skipped_as_before_and_the_rest_keep_their_offsets(demo_tokenizer_path):
    op = TokenizeOp(str(demo_tokenizer_path), marker=MARKER, offsets_field="where")
    records = [{"text": "a <image> b"}, {"other": 1}, {"text": "   "}, {"text": "<image> c"}]
    chunk = ChunkRecords(Chunk("d", 0, 0, 4), records, [RecordAddress("d", "s", i) for i in range(4)])
    out = op.build("skip")(chunk)
    assert [r["where"] for r in out.records] == [(len(encode(demo_tokenizer_path, "a ")),), (0,)]
    assert [reason for _, reason in out.skipped] == ["missing_field", "empty_document"]


def test_marker_offsets_cross_a_process_with_their_marker():
    offsets = pickle.loads(pickle.dumps(MarkerOffsets([1, 5], "<image>")))
    assert offsets == (1, 5) and isinstance(offsets, MarkerOffsets) and offsets.marker == "<image>"


# The recipe part of `tokenize(tokenizer.json, bos=, eos=)` computed before the option existed: the
# checkpoints of every recipe without a marker must still be resumed by it.
DIGEST_BEFORE_MARKERS = "02c302ce3e58268dce90e356279b5397318362e509ec9276b8d8a81b4a534dc3"


def test_the_marker_enters_the_recipe_only_when_set(demo_tokenizer_path):
    default = TokenizeOp(str(demo_tokenizer_path), bos="<|bos|>", eos="<|eos|>").fingerprint()
    assert hashlib.sha256(canonical_json(default).encode()).hexdigest() == DIGEST_BEFORE_MARKERS
    marked = TokenizeOp(str(demo_tokenizer_path), bos="<|bos|>", eos="<|eos|>", marker=MARKER).fingerprint()
    assert marked == {**default, "marker": MARKER, "offsets_field": "image_offsets"}
    elsewhere = TokenizeOp(str(demo_tokenizer_path), marker=MARKER, offsets_field="where").fingerprint()
    assert elsewhere["offsets_field"] == "where"


@pytest.mark.parametrize("options,message", [
    ({"marker": ""}, "tokenize: marker must be a non-empty str"),
    ({"marker": 7}, "tokenize: marker must be a non-empty str"),
    ({"offsets_field": "where"}, "tokenize: offsets_field='where' is written only with a marker"),
    ({"marker": MARKER, "offsets_field": "text"}, "tokenize: offsets_field='text' is also the text or ids field"),
    ({"marker": MARKER, "offsets_field": "input_ids"}, "is also the text or ids field"),
    ({"marker": MARKER, "offsets_field": ""}, "tokenize: offsets_field must be a record field's name"),
], ids=["empty_marker", "not_a_str", "offsets_without_marker", "offsets_in_the_text", "offsets_in_the_ids",
        "empty_offsets_field"])
def test_a_marker_option_that_cannot_work_is_refused_as_the_pipeline_is_built(demo_data_dir, demo_tokenizer_path,
                                                                              options, message):
    pipeline = Pipeline(StaticMixtureWorkSource([Dataset.from_path("jargon", str(demo_data_dir / "jargon"))]))
    with pytest.raises(ConfigurationError, match=message):
        pipeline.tokenize(str(demo_tokenizer_path), **options)
