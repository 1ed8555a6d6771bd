"""A mixture is a *token* ratio: over a long run (4M tokens) each dataset's share is within 1 % of target."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest

from zephon import Pipeline
from zephon.demo._recipe import demo_pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation


def realised_shares(pipeline, min_tokens: int) -> dict[str, float]:
    tokens: Counter = Counter()
    with pipeline.shard(0, 1, global_batch_size=8) as loader:
        for batch in loader:
            doc_ids = batch.tokens["document_ids"]
            for row, sources in enumerate(batch.sources):
                for piece, address in enumerate(sources):
                    tokens[address.dataset] += int(np.count_nonzero(doc_ids[row] == piece))
            if sum(tokens.values()) >= min_tokens:
                break
    total = sum(tokens.values())
    return {name: n / total for name, n in tokens.items()}


@pytest.mark.parametrize("kjv_share,seed", [(0.7, 1), (0.3, 2)])
def test_realised_token_shares_are_within_one_percent_over_four_million_tokens(kjv_share, seed):
    # The shipped datasets differ ~5x in tokens per record, so a record-ratio plan would miss badly.
    # A lane's prefix is within about a chunk per dataset of its shares, and a chunk of 16 kjv
    # chapters is a tenth of a lane's tokens at 1M: over seeds 1-8 the kjv share missed by up to
    # 2.3 points at 1M tokens, 1.0 at 2M and 0.8 at 4M (the SPEC's "long run").
    mixture = {"kjv": kjv_share, "jargon": 1 - kjv_share}
    pipeline = demo_pipeline(
        runner="thread", parallelism=2, max_length=2048, microbatch_size=1, seed=seed, mixture=mixture
    )
    shares = realised_shares(pipeline, 4_000_000)
    assert abs(shares["kjv"] - kjv_share) < 0.01, shares
    assert abs(shares["jargon"] - (1 - kjv_share)) < 0.01, shares


def _write_shards(root, make_text) -> str:
    root.mkdir()
    for shard in range(2):
        lines = [json.dumps({"text": make_text()}) + "\n" for _ in range(200)]
        (root / f"part-{shard}.jsonl").write_text("".join(lines), encoding="utf-8")
    return str(root)


@pytest.mark.parametrize("words_share", [0.5, 0.2])
def test_the_plan_corrects_for_datasets_that_differ_in_tokens_per_byte(tmp_path, demo_tokenizer_path, words_share):
    """The shipped datasets hold almost the same tokens per byte (kjv 0.238, jargon 0.244): a plan
    by raw bytes, the measurement ignored, also lands within 1 % above. Here words take ~0.29
    tokens per byte and random letters and digits ~0.87, so only the measured correction meets
    the token shares (by bytes, words would get ~0.25 of the tokens at 0.5; by records ~0.23)."""
    rng = random.Random("tokens-per-byte")
    vocabulary = "the of and a to in lane shard chunk token pack shuffle batch".split()
    characters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    words = _write_shards(tmp_path / "words", lambda: " ".join(rng.choice(vocabulary) for _ in range(rng.randint(20, 80))))
    codes = _write_shards(tmp_path / "codes", lambda: "".join(rng.choice(characters) for _ in range(rng.randint(100, 400))))
    source = StaticMixtureWorkSource(
        [Dataset.from_path("words", words), Dataset.from_path("codes", codes)],
        mixture={"words": words_share, "codes": 1 - words_share}, token_estimation=TokenEstimation(sample_records=64),
        seed=1, records_per_chunk=4,
    )
    pipeline = Pipeline(source).options(num_lanes=2, runner="inline").tokenize(
        str(demo_tokenizer_path), eos="<|eos|>").pack_flat(256).batch(2)
    with pipeline.shard(0, 1) as loader:
        measured = loader.plan.fingerprint()["tokens_per_byte"]
    assert measured["codes"] > 2.5 * measured["words"], measured
    shares = realised_shares(pipeline, 200_000)
    assert abs(shares["words"] - words_share) < 0.01, shares
