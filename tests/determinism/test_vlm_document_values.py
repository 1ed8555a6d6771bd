"""`pack_multimodal(document_values=...)` on real image+caption pairs, decoded after packing: the
same global-batch SHA-256s on every runner and world size with a number carried per document, and
over an epoch on two ranks of the process runner each document holds its own record's number.

The number is one the batch can check by itself: a `map` writes each record's count of caption
ids, and the row's count of that document's text positions (those that are no image placeholder)
must be it.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import GLOBAL_BATCH, step_digests
from vlm import ImageSpec
from vlm._assets import pair_shards, tekken_tokenizer
from vlm._demo import placeholders_for
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

SPEC = ImageSpec.pixtral(max_side=128)
MAX_LENGTH = 512  # every caption whole beside its image: its count of ids is what the row holds
STEPS = 3


def with_caption_length(record: dict) -> dict:
    record["caption_ids"] = len(record["input_ids"])
    return record


@pytest.fixture(scope="module")
def assets():
    return pair_shards(4, 64), tekken_tokenizer()


def pipeline(assets, runner: str = "inline", num_epochs: int | None = None) -> Pipeline:
    pairs, tokenizer = assets
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(pairs.directory), format="webdataset")], seed=5,
                                     records_per_chunk=4, num_epochs=num_epochs)
    return (Pipeline(source).options(num_lanes=8, runner=runner, flush_every_chunks=2)
            .tokenize(str(tokenizer), field="txt", bos="<s>", eos="</s>", parallelism=2)
            .map(with_caption_length)
            .decode_images(field=("png", "jpg"), spec=SPEC, parallelism=2, defer=True)
            .pack_multimodal(MAX_LENGTH, placeholders_for(tokenizer), image_position="after_bos",
                             document_values=["caption_ids"])
            .shuffle(buffer_size=4, seed=5).batch(2))


@pytest.fixture(scope="module")
def reference(assets) -> list[str]:
    return step_digests(pipeline(assets), 1, STEPS)


@pytest.mark.parametrize("runner, world_size", [("thread", 2), ("process", 4)])
def test_the_same_global_batches_on_every_runner_and_world_size(assets, reference, runner, world_size):
    assert step_digests(pipeline(assets, runner), world_size, STEPS) == reference


def test_an_epoch_on_two_process_ranks_gives_each_document_its_records_number(assets):
    placeholder_ids = list(placeholders_for(assets[1]).token_ids)
    documents = set()
    for rank in range(2):
        with pipeline(assets, "process", num_epochs=1).shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            for batch in loader:
                values = iter(batch.ragged["caption_ids"].tolist())
                assert batch.ragged_counts["caption_ids"].tolist() == [len(s) for s in batch.sources]
                for row, sources in enumerate(batch.sources):
                    text = ~np.isin(batch.tokens["input_ids"][row], placeholder_ids)
                    for d, address in enumerate(sources):
                        assert next(values) == np.count_nonzero(text & (batch.tokens["document_ids"][row] == d))
                        documents.add((address.shard, address.index))
            assert loader.stats()["datasets"]["pairs"]["total"].get("truncated", 0) == 0
    assert len(documents) == 64, "every pair, once"
