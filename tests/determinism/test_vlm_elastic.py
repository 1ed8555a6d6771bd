"""The VLM pipeline on real image+caption pairs is as elastic as text (SPEC §3, §7).

Real Debian tuxpaint stamps (or, where apt cannot fetch them, the scikit-image/scikit-learn wheel
photographs; the source is printed) as WebDataset shards → the real Pixtral Tekken tokenizer on the
caption → decode_images → pack_multimodal with Pixtral's [IMG]/[IMG_BREAK]/[IMG_END] → shuffle →
batch. Every global digest covers the pixel data (`pixel_values` is a ragged field of the batch),
so "same digest" means the same tokens *and* the same pixels. The shared text harness
(tests/harness.py: 8 lanes, microbatches of 2, 32 rows per global step) runs it unchanged.
"""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from functools import cache

import numpy as np
import pytest
from PIL import Image

from tests.harness import (
    GLOBAL_BATCH,
    checkpoint_after,
    consumed_keys,
    microbatch_digests,
    step_digests,
)
from vlm import ImageSpec, image_grid
from vlm._assets import pair_shards, tekken_tokenizer
from vlm._demo import placeholders_for, vlm_pipeline

SPEC = ImageSpec.pixtral(max_side=128)  # stamps become up to 8x8 patches: 72 placeholder tokens
MAX_LENGTH = 256
STEPS = 3  # ~130 images a step
RESUME_STEPS = 5
IGNORE_INDEX = -100


@pytest.fixture(scope="module")
def assets():
    pairs = pair_shards(4, 64)
    print(f"\nVLM determinism data: {pairs.describe()}")
    return pairs, tekken_tokenizer()


@pytest.fixture(scope="module")
def make(assets):
    pairs, tokenizer = assets

    def make(runner: str = "inline", parallelism: int = 1, defer: bool = False):
        return vlm_pipeline(pairs.directory, tokenizer, runner=runner, parallelism=parallelism, spec=SPEC,
                            num_lanes=8, max_length=MAX_LENGTH, microbatch_size=2, records_per_chunk=4,
                            flush_every_chunks=2, shuffle_buffer=4, seed=5, defer=defer)

    return make


@pytest.fixture(scope="module")
def reference(make):
    return step_digests(make(), world_size=1, steps=STEPS)


@pytest.fixture(scope="module")
def reference_microbatches(make):
    return microbatch_digests(make(), 1, RESUME_STEPS)


def test_reference_batches_carry_pixels_and_differ_step_to_step(make, reference):
    assert len(set(reference)) == STEPS
    with make().shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        batch = next(iter(loader))
    grids = batch.ragged["image_grid"]
    assert len(grids) >= 2, "every microbatch holds several images"
    assert batch.ragged["pixel_values"].shape == (int((grids[:, 0] * grids[:, 1]).sum()), SPEC.patch_dim)
    assert batch.ragged["pixel_values"].dtype == np.uint8 and batch.ragged["pixel_values"].any()


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
@pytest.mark.parametrize("parallelism", [1, 2, 4])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_vlm_global_digests_match_across_ranks_parallelism_and_runners(make, reference, runner, parallelism,
                                                                      world_size):
    assert step_digests(make(runner, parallelism), world_size, STEPS) == reference


# A state saved partway through a step resumes on fewer ranks; on more, the step's rest would fall
# unevenly to them and it is refused (test_elastic_resume.py).
@pytest.mark.parametrize(
    "target_world,runner,steps,extra",
    [(4, "thread", 2, 0), (1, "process", 2, 0), (1, "thread", 3, 1)],
    ids=["after_two_steps-4-thread", "after_two_steps-1-process", "mid_step-1-thread"],
)
def test_vlm_resume_on_another_world_size_matches_uninterrupted_run(make, reference_microbatches, target_world,
                                                                    runner, steps, extra):
    """Checkpoint on 2 ranks (the state crosses a JSON round trip), resume on 4 and on 1 with another
    runner and parallelism: every later microbatch, pixels included, is the uninterrupted run's."""
    state = json.loads(json.dumps(checkpoint_after(make("thread", 2), 2, steps, extra)))
    assert len(json.dumps(state)) < 64 * 1024, "a checkpoint holds cursors, never pixels"
    resumed = microbatch_digests(make(runner, 2), target_world, RESUME_STEPS, state=state)
    consumed = consumed_keys(make(), 2, steps, extra)
    assert set(resumed) == set(reference_microbatches) - consumed
    assert resumed == {key: reference_microbatches[key] for key in resumed}


@pytest.mark.parametrize("runner,parallelism,world_size", [("inline", 1, 1), ("thread", 2, 2), ("process", 2, 4),
                                                           ("thread", 4, 1)])
def test_decoding_after_packing_gives_the_same_global_batches(make, reference, runner, parallelism, world_size):
    """decode_images(defer=True) packs from the headers and decodes each row on the workers just
    before it is taken: the same tokens and the same pixels, on every runner and world size."""
    assert step_digests(make(runner, parallelism, defer=True), world_size, STEPS) == reference


@pytest.mark.parametrize("target_world,runner,extra", [(4, "process", 0), (1, "thread", 1)])
def test_decoding_after_packing_resumes_on_another_world_size(make, reference_microbatches, target_world, runner, extra):
    """Checkpointed on 2 ranks after 3 steps (and 1 microbatch of the next, for 1 rank), resumed
    on 4 and on 1: the replayed rows are skipped without being decoded, and every later microbatch
    is the uninterrupted (eager) run's."""
    state = json.loads(json.dumps(checkpoint_after(make("thread", 2, defer=True), 2, 3, extra)))
    resumed = microbatch_digests(make(runner, 2, defer=True), target_world, RESUME_STEPS, state=state)
    consumed = consumed_keys(make(), 2, 3, extra)
    assert set(resumed) == set(reference_microbatches) - consumed
    assert resumed == {key: reference_microbatches[key] for key in resumed}


# -- the placeholder count is the model's ---------------------------------------------------

@cache
def _tar_records(path: str) -> list[dict[str, bytes]]:
    """A WebDataset shard's records in order, as {extension: payload}."""
    records, last = [], None
    with tarfile.open(path) as tar:
        for member in tar:
            key, _, extension = member.name.partition(".")
            if key != last:
                records.append({})
                last = key
            records[-1][extension] = tar.extractfile(member).read()
    return records


def _mistral_common_tokens(monkeypatch, image_bytes: bytes) -> list[int]:
    """mistral-common's own Pixtral expansion of this image (its pixel transform needs OpenCV,
    which the token expansion does not use, so it is stubbed when OpenCV is absent)."""
    from mistral_common.protocol.instruct.chunk import ImageChunk
    from mistral_common.tokens.tokenizers import image as encoder_module

    if importlib.util.find_spec("cv2") is None:
        monkeypatch.setattr(encoder_module, "transform_image", lambda image, size: np.zeros((3, size[1], size[0])))
    encoder = encoder_module.ImageEncoder(
        encoder_module.ImageConfig(image_patch_size=SPEC.patch_size, max_image_size=SPEC.max_side,
                                   spatial_merge_size=SPEC.merge_size),
        encoder_module.SpecialImageIDs(img=10, img_break=12, img_end=13),
    )
    with Image.open(io.BytesIO(image_bytes)) as image:
        return list(encoder(ImageChunk(image=image)).tokens)


def test_image_placeholder_tokens_are_pixtrals_for_each_images_grid(monkeypatch, make, assets):
    """In packed rows, each image's placeholders are exactly PixtralPlaceholders' tokens for its
    grid, that grid is the one the original image's size gives, and mistral-common's own encoder
    expands the original image to the same tokens; image positions carry no loss."""
    _, tokenizer = assets
    placeholders = placeholders_for(tokenizer)
    assert (placeholders.img_id, placeholders.break_id, placeholders.end_id) == (10, 12, 13)
    checked = 0
    with make().shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        iterator = iter(loader)
        batches = [next(iterator) for _ in range(4)]
    for batch in batches:
        counts = batch.ragged_counts["image_grid"]
        rows_of_images = np.repeat(np.arange(len(counts)), counts)
        for k, (row, (rows, cols), at) in enumerate(zip(rows_of_images, batch.ragged["image_grid"],
                                                         batch.ragged["image_token_offset"])):
            rows, cols = int(rows), int(cols)
            expected = placeholders.tokens_for(rows, cols)
            ids = batch.tokens["input_ids"][row]
            assert ids[at : at + len(expected)].tolist() == expected.tolist()
            assert int(np.count_nonzero(ids == placeholders.img_id)) >= rows * cols
            assert (batch.tokens["labels"][row, at - 1 : at + len(expected) - 1] == IGNORE_INDEX).all()
            # one image per document here: the k-th image of the row is its k-th source record's
            first_in_row = int(counts[:row].sum())
            address = batch.sources[row][k - first_in_row]
            original = _tar_records(address.shard)[address.index]["png"]
            with Image.open(io.BytesIO(original)) as image:
                width, height = image.size
            assert (rows, cols) == image_grid(height, width, SPEC)
            assert _mistral_common_tokens(monkeypatch, original) == expected.tolist()
            checked += 1
    assert checked >= 20


def test_image_token_totals_match_pixel_rows(make):
    """Over whole batches: [IMG] tokens == patches in pixel_values, one [IMG_END] per image."""
    img, img_end = 10, 13
    with make().shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        iterator = iter(loader)
        batches = [next(iterator) for _ in range(4)]
    for batch in batches:
        ids = batch.tokens["input_ids"]
        assert np.count_nonzero(ids == img) == len(batch.ragged["pixel_values"])
        assert np.count_nonzero(ids == img_end) == len(batch.ragged["image_grid"])


# -- the tokenizer is the real one ----------------------------------------------------------

def test_converted_tekken_tokenizer_encodes_like_mistral_common(assets):
    """The tokenizer.json built from tekken_240911.json gives mistral-common's ids, on every
    caption and on multilingual text, so the tests above run on the real Pixtral tokenizer."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from tokenizers import Tokenizer

    from vlm._assets import _package_dir

    _, tokenizer_dir = assets
    ours = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    reference = Tekkenizer.from_file(str(_package_dir("mistral_common") / "data" / "tekken_240911.json"))
    texts = [record["txt"].decode() for shard in pair_shards(8).shards for record in _tar_records(str(shard))]
    texts += ["Ça va? Grüße aus Köln, 東京タワー, Привет мир, नमस्ते 😀🎉", "  two  spaces\tand\ttabs\n\n\r\nnew lines",
              "3.14159, 1,000,000 and 0x1F", "text that spells [IMG] or <s> stays text", "don't I'll we're"]
    assert len(texts) > 50
    encodings = ours.encode_batch(texts, add_special_tokens=False)
    mismatched = [t for t, e in zip(texts, encodings) if e.ids != reference.encode(t, bos=False, eos=False)]
    assert not mismatched
    for token, token_id in (("<s>", 1), ("</s>", 2), ("[IMG]", 10), ("<pad>", 11), ("[IMG_BREAK]", 12),
                            ("[IMG_END]", 13)):
        assert ours.token_to_id(token) == token_id
    assert ours.get_vocab_size() == reference.n_words == 131072
