"""Preference pairs with pictures (`pack_multimodal_pairs`) on real image+caption pairs, decoded
after packing: a question about each picture, its caption the chosen answer and another picture's
caption the rejected one. The same global-batch SHA-256s on every runner and world size; over an
epoch on two ranks of the process runner, each record's pair in one row as documents 2k and
2k+1, each document the question and its own answer after the same picture, learning the answer
alone, the picture's patches in the row twice."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import GLOBAL_BATCH, checkpoint_after, step_digests
from vlm import ImageSpec
from vlm._assets import pair_shards, tekken_tokenizer
from vlm._demo import placeholders_for
from zephon import IGNORE_INDEX, Pipeline
from zephon._tokenizer import load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

SPEC = ImageSpec.pixtral(max_side=128)
MAX_LENGTH = 512
STEPS = 3
QUESTION = "What does the picture show?\n"


def as_preference(record: dict) -> dict:
    """The caption is the chosen answer; the rejected one is its words in reverse order."""
    caption = record["txt"]
    return {**record, "prompt": QUESTION, "chosen": caption, "rejected": " ".join(reversed(caption.split()))}


@pytest.fixture(scope="module")
def assets():
    return pair_shards(4, 64), tekken_tokenizer()


def pipeline(assets, runner: str = "inline", num_epochs: int | None = None, max_length: int = MAX_LENGTH,
             overlong: str = "skip") -> Pipeline:
    pairs, tokenizer = assets
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(pairs.directory), format="webdataset")], seed=7,
                                     records_per_chunk=4, num_epochs=num_epochs)
    pipe = Pipeline(source).options(num_lanes=8, runner=runner, flush_every_chunks=2).map(as_preference)
    for side in ("chosen", "rejected"):
        pipe = pipe.tokenize(str(tokenizer), field=side, prompt_field="prompt", keep_field=side == "chosen",
                             bos="<s>", eos="</s>", output_field=f"{side}_ids", loss_mask_field=f"{side}_loss_mask",
                             parallelism=2)
    return (pipe.decode_images(field=("png", "jpg"), spec=SPEC, parallelism=2, defer=True)
            .pack_multimodal_pairs(max_length, placeholders_for(tokenizer), image_position="after_bos",
                                   overlong=overlong)
            .shuffle(buffer_size=4, seed=7).batch(2))


@pytest.fixture(scope="module")
def reference(assets) -> list[str]:
    return step_digests(pipeline(assets), 1, STEPS)


@pytest.mark.parametrize("runner, world_size", [("thread", 2), ("process", 4)])
def test_the_same_global_batches_on_every_runner_and_world_size(assets, reference, runner, world_size):
    assert step_digests(pipeline(assets, runner), world_size, STEPS) == reference


def test_a_resume_on_another_world_size_gives_the_uninterrupted_batches(assets, reference):
    state = checkpoint_after(pipeline(assets, "thread"), 2, 1)
    assert step_digests(pipeline(assets), 4, STEPS - 1, state=state, start_step=1) == reference[1:]


def test_an_epoch_on_two_process_ranks_holds_each_pair_once_in_one_row(assets):
    tokenizer = assets[1]
    placeholder_ids = list(placeholders_for(tokenizer).token_ids)
    encoder = load_tokenizer(str(tokenizer)).tokenizer
    decode = encoder.decode
    question = [encoder.token_to_id("<s>"), *encoder.encode(QUESTION, add_special_tokens=False).ids]
    pairs = set()
    for rank in range(2):
        with pipeline(assets, "process", num_epochs=1).shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            for batch in loader:
                grids = batch.ragged["image_grid"]
                patches = np.split(batch.ragged["pixel_values"], np.cumsum(grids[:, 0] * grids[:, 1])[:-1])
                images = iter(patches)
                for row, sources in enumerate(batch.sources):
                    ids, labels = batch.tokens["input_ids"][row], batch.tokens["labels"][row]
                    documents = batch.tokens["document_ids"][row]
                    for k in range(0, len(sources), 2):
                        assert sources[k] == sources[k + 1], "a pair's documents are one record's"
                        pairs.add((sources[k].shard, sources[k].index))
                        prompts = [ids[(documents == d) & ~np.isin(ids, placeholder_ids)][:len(question)]
                                   for d in (k, k + 1)]
                        assert all(prompt.tolist() == question for prompt in prompts), "each after the question"
                        # Each answer's learned labels: its ids, then EOS.
                        chosen, rejected = (decode(labels[(documents == d) & (labels != IGNORE_INDEX)][:-1].tolist())
                                            .split() for d in (k, k + 1))
                        assert chosen and rejected == chosen[::-1], "each learns its own answer"
                        first, second = next(images), next(images)
                        np.testing.assert_array_equal(first, second)
            assert loader.stats()["datasets"]["pairs"]["total"]["skipped"] == {}
    assert len(pairs) == 64, "every record's pair, once"


def test_pairs_cut_to_share_a_row_are_the_same_on_every_runner_and_counted(assets):
    """Rows of 170: two pictures of up to 72 placeholders leave the texts 26 ids or more, so some
    pairs are cut to share the row (or skipped where an answer would learn nothing)."""
    cut = step_digests(pipeline(assets, max_length=170, overlong="truncate"), 1, STEPS)
    assert step_digests(pipeline(assets, "process", max_length=170, overlong="truncate"), 4, STEPS) == cut
    with pipeline(assets, num_epochs=1, max_length=170, overlong="truncate").shard(0, 1) as loader:
        for _ in loader:
            pass
        total = loader.stats()["datasets"]["pairs"]["total"]
    assert total["truncated"] > 0 and total["read"] == total["emitted"] + sum(total["skipped"].values())
