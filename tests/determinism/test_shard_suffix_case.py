"""Shards named with upper- or mixed-case suffixes give the batches their lower-case names give."""

from __future__ import annotations

import gzip
import json

import zstandard

from tests.harness import step_digests, text_pipeline

STEPS = 4


def _write_corpora(root, corpus, cased: bool):
    """The four shards of the JSON Lines corpus `corpus` (plain twice, gzip, zstd) and a text
    corpus of the texts of its first two (plain, zstd), under lower-case names or names in upper
    and mixed case (as Windows tools and some exporters write them) that sort in the same order."""
    zstd = zstandard.ZstdCompressor().compress
    shards = sorted(corpus.glob("*.jsonl"))
    assert len(shards) == 4
    texts = ["".join(json.loads(line)["text"] + "\n" for line in shard.read_text().splitlines()).encode()
             for shard in shards[:2]]
    written = {
        ("jsonl", "part-0.jsonl", "part-0.jsonl"): shards[0].read_bytes(),
        ("jsonl", "part-1.jsonl", "part-1.JSONL"): shards[1].read_bytes(),
        ("jsonl", "part-2.jsonl.gz", "part-2.Jsonl.GZ"): gzip.compress(shards[2].read_bytes()),
        ("jsonl", "part-3.json.zst", "part-3.JSON.ZST"): zstd(shards[3].read_bytes()),
        ("text", "part-0.txt", "part-0.TXT"): texts[0],
        ("text", "part-1.txt.zstd", "part-1.Txt.Zstd"): zstd(texts[1]),
    }
    for (directory, lower, upper), data in written.items():
        (root / directory).mkdir(parents=True, exist_ok=True)
        (root / directory / (upper if cased else lower)).write_bytes(data)
    return root / "jsonl", root / "text"


def test_batches_from_shards_with_upper_or_mixed_case_suffixes_equal_those_from_lower_case_names(
    make_jsonl_corpus, demo_tokenizer_path, tmp_path
):
    """`part-1.JSONL`, `part-2.Jsonl.GZ`, `part-0.TXT` were passed over like a README, so the recipe
    read other records, or none; read as shards of their format and decompressed by their suffix,
    they give the same batches."""
    corpus = make_jsonl_corpus(4, 30, 7)
    lower_case = step_digests(text_pipeline(*_write_corpora(tmp_path / "lower", corpus, False), demo_tokenizer_path),
                              world_size=1, steps=STEPS)
    cased = step_digests(text_pipeline(*_write_corpora(tmp_path / "cased", corpus, True), demo_tokenizer_path),
                         world_size=1, steps=STEPS)
    assert len(set(lower_case)) == STEPS
    assert cased == lower_case
