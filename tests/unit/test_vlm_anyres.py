"""LLaVA-NeXT's anyres pictures: `ImageSpec(fit="anyres")`, `LlavaNextPlaceholders` and the
`image_sizes` its rows carry.

The oracles are transformers' own: `select_best_resolution`, `get_patch_output_size` and
`LlavaNextProcessor`'s feature count for the sizes, `LlavaNextImageProcessorPil` for the pixels,
`LlavaNextProcessor` for the text, and a tiny randomly initialised
`LlavaNextForConditionalGeneration` for what the rows do in a model.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.conftest import requires_torch
from tests.unit.test_vlm_fixed_size import assert_each_packed_document_is_its_own
from tests.unit.test_vlm_mixed_media import TOKENIZER, _epoch, mixed_source, write_mixed_corpus
from tests.unit.test_vlm_split import _pictures, sized_record, turned_and_upright
from vlm import (DecodeImages, ImageSpec, LlavaNextPlaceholders, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD,
                 decode_image_with_size, image_grid, image_tensors, patchify)
from vlm._anyres import LLAVA_NEXT_PINPOINTS, best_resolution, fitted_size
from vlm._image import anyres_features, probe_image_with_size
from vlm._packing import MultimodalPacker
from vlm._stages import _describe
from zephon import ConfigurationError, Pipeline
from zephon._records import RecordAddress

SMALL_PINPOINTS = ((56, 112), (112, 56), (112, 112), (168, 56), (56, 168))
"""LLaVA-NeXT's five canvases at a sixth of the size: tiles of 56 px (4x4 patches of 14)."""
SMALL_ANYRES = ImageSpec(patch_size=14, fit="anyres", size=(56, 56), pinpoints=SMALL_PINPOINTS, draft=False)


def _processor(spec: ImageSpec):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tile = spec.size[0]
    return LlavaNextImageProcessorPil(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                      image_grid_pinpoints=[list(canvas) for canvas in spec.pinpoints])


def _text_processor(spec: ImageSpec, tokenizer):
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    return LlavaNextProcessor(_processor(spec), tokenizer, patch_size=spec.patch_size,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)


@pytest.fixture(scope="module")
def llava_tokenizer():
    """The shipped tokenizer with `<image>` added as a special token (no LLaVA tokenizer ships offline)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    return tokenizer


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("photos", "shard-0", i)


# -- sizing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("pinpoints, tile, patch", [
    (LLAVA_NEXT_PINPOINTS, 336, 14), (SMALL_PINPOINTS, 56, 14),
    (((384, 384), (384, 768), (768, 384), (768, 768), (1152, 384)), 384, 16)])
def test_the_canvas_the_fit_and_the_kept_features_are_llava_next_s_for_every_size(pinpoints, tile, patch,
                                                                                  llava_tokenizer):
    """For 400 random sizes and the edges (strips one pixel thick, squares, canvases exactly),
    the canvas equals `select_best_resolution`'s, the fitted size `get_patch_output_size`'s, and
    the placeholder count (base image, kept features, a newline a row) `LlavaNextProcessor`'s
    `_get_number_of_features` less the class token; the grid stacks the base image and the
    canvas's tiles."""
    from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
    from transformers.image_utils import ChannelDimension

    spec = ImageSpec(patch_size=patch, fit="anyres", size=(tile, tile), pinpoints=pinpoints)
    processor = _text_processor(spec, llava_tokenizer)
    placeholders = LlavaNextPlaceholders(3)
    rng = np.random.default_rng(11)
    sizes = [tuple(int(n) for n in pair) for pair in rng.integers(1, 4000, (400, 2))] + [
        (1, 1), (1, 4000), (4000, 1), (tile, tile), (tile, 2 * tile), (2 * tile, tile), (10 * tile, tile + 1)]
    for height, width in sizes:
        canvas = tuple(select_best_resolution((height, width), [list(c) for c in pinpoints]))
        assert best_resolution(height, width, pinpoints) == canvas, (height, width)
        shape = np.broadcast_to(np.uint8(0), (3, height, width))
        assert fitted_size(height, width, canvas) == tuple(get_patch_output_size(shape, canvas, ChannelDimension.FIRST))
        rows, cols = image_grid(height, width, spec)
        tiles = canvas[0] // tile * (canvas[1] // tile)
        assert (rows, cols) == ((1 + tiles) * tile // patch, tile // patch)
        want = processor._get_number_of_features(height, width, tile, tile) - 1  # "default": no class token
        assert placeholders.num_tokens(rows, cols, anyres_features(height, width, spec)) == want, (height, width)


def test_anyres_pixels_equal_the_processor_s_tile_for_tile():
    """Decoded with `fit="anyres"` (draft off) and cut apart by `image_tensors(..., tile=4)`, each
    picture's base image and tiles equal `LlavaNextImageProcessorPil`'s `pixel_values` value for
    value (CLIP's mean and std, the padding black before them), as many, and the sizes decoding
    reports its `image_sizes`."""
    pictures = _pictures()
    processor = _processor(SMALL_ANYRES)
    decoded = [decode_image_with_size(data, SMALL_ANYRES) for data in pictures]
    grids = np.array([(len(image.pixels) // 14, 4) for image in decoded])
    ours = image_tensors(np.concatenate([patchify(image.pixels, 14) for image in decoded]), grids,
                         mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, tile=4)
    want = processor(images=[Image.open(io.BytesIO(data)) for data in pictures], do_pad=False, return_tensors=None)
    np.testing.assert_array_equal(ours, np.concatenate([np.asarray(each) for each in want["pixel_values"]]))
    assert [image.size for image in decoded] == [tuple(int(n) for n in size) for size in want["image_sizes"]]
    assert sorted({len(image.pixels) // 56 for image in decoded}) == [3, 4, 5]  # canvases of 2, 3 and 4 tiles


@pytest.mark.parametrize("orientation", [5, 6, 8])
def test_a_picture_stored_turned_is_fitted_as_shown(orientation):
    """A 150x60 picture stored turned, with the EXIF orientation that shows it upright: its size
    as shown, its canvas (3 tiles tall) and its grid are the upright picture's, from its header too
    (deferred decoding); its pixels are within one level of the upright picture's (resized as
    stored and turned after, as every fit does)."""
    stored, upright = turned_and_upright(orientation)
    want = decode_image_with_size(upright, SMALL_ANYRES)
    got = decode_image_with_size(stored, SMALL_ANYRES)
    assert want.size == got.size == (150, 60) and best_resolution(150, 60, SMALL_PINPOINTS) == (168, 56)
    assert got.pixels.shape == want.pixels.shape == (4 * 56, 56, 3)
    assert np.abs(got.pixels.astype(int) - want.pixels).max() <= 1
    assert probe_image_with_size(stored, SMALL_ANYRES) == ((16, 4), (150, 60))


def test_anyres_specs_are_refused_where_they_cannot_be_cut():
    for kwargs, words in (({"size": (56, 112)}, "square tiles"),
                          ({"size": (56, 56), "pinpoints": ((56, 100),)}, "not whole 56 px tiles"),
                          ({"size": (56, 56), "pinpoints": ()}, "at least one canvas"),
                          ({"size": (56, 56), "pinpoints": (56, 112)}, "\\(height, width\\) canvases"),
                          ({"fit": "fixed", "size": (56, 56), "pinpoints": SMALL_PINPOINTS}, "fit='anyres''s")):
        with pytest.raises(ConfigurationError, match=words):
            ImageSpec(**{"patch_size": 14, "fit": "anyres", **kwargs})
    assert ImageSpec.llava_next().pinpoints == LLAVA_NEXT_PINPOINTS
    assert ImageSpec.llava_next().max_decoded_pixels == 336 * 336 + 672 * 672  # the base and the largest canvas
    assert _describe(ImageSpec.llava_next())["pinpoints"] == [list(c) for c in LLAVA_NEXT_PINPOINTS]
    assert "pinpoints" not in _describe(ImageSpec.internvl())


# -- tokens --------------------------------------------------------------------------------------

def test_rows_are_llava_next_processor_s_input_ids_and_image_sizes(llava_tokenizer):
    """Two records, a picture before its caption and a caption with two pictures inside it,
    packed into one row: each document is `LlavaNextProcessor`'s `input_ids` for the same text
    with `<image>` where its pictures go, the row's `image_sizes` its `image_sizes` and its pixels
    its `pixel_values`, in order."""
    tokenizer = llava_tokenizer
    processor = _text_processor(SMALL_ANYRES, tokenizer)
    placeholders = LlavaNextPlaceholders.from_tokenizer(tokenizer)
    pictures = _pictures()

    def ids(text: str) -> np.ndarray:
        return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)

    def record(pieces: list[str], images: list[bytes]) -> dict:
        decoded = [decode_image_with_size(data, SMALL_ANYRES) for data in images]
        encoded = [ids(piece) for piece in pieces]
        return {"input_ids": np.concatenate(encoded), "pixels": [image.pixels for image in decoded],
                "pixels_sizes": [list(image.size) for image in decoded],
                "image_offsets": np.cumsum([len(each) for each in encoded[:-1]]).tolist()}

    pieces = [["", "a photo of a cat"], ["left then", " right,", " below"]]
    records = [record(pieces[0], pictures[:1]), record(pieces[1], pictures[1:3])]
    packer = MultimodalPacker(None, max_length=600, placeholders=placeholders, spec=SMALL_ANYRES, pad_id=0)
    assert [row for i, each in enumerate(records) for row in packer.push((_address(i), each))] == []
    [row] = packer.flush()
    images = [[Image.open(io.BytesIO(pictures[0]))], [Image.open(io.BytesIO(data)) for data in pictures[1:3]]]
    want = processor(text=["<image>".join(each) for each in pieces], images=images, add_special_tokens=False,
                     return_tensors=None, images_kwargs={"do_pad": False})
    documents = row.tokens["document_ids"]
    for number, expected in enumerate(want["input_ids"]):
        assert row.tokens["input_ids"][documents == number].tolist() == expected, number
    assert row.ragged["image_sizes"].tolist() == [list(map(int, size)) for size in want["image_sizes"]]
    pixels = image_tensors(row.ragged["pixel_values"], row.ragged["image_grid"], mean=OPENAI_CLIP_MEAN,
                           std=OPENAI_CLIP_STD, tile=4)
    np.testing.assert_array_equal(pixels, np.concatenate([np.asarray(each) for each in want["pixel_values"]]))


def test_the_packer_refuses_an_anyres_picture_without_its_size_or_the_wrong_spec():
    placeholders = LlavaNextPlaceholders(3)
    image = decode_image_with_size(_pictures()[0], SMALL_ANYRES)
    packer = MultimodalPacker(None, max_length=300, placeholders=placeholders, spec=SMALL_ANYRES, pad_id=0)
    text = np.array([20, 21], np.int32)
    for sizes, words in ((None, "need theirs in 'pixels_sizes'"),
                         ([[1000, 10]], "a 20x4 patch stack is not a base image and 3 tiles")):
        record = {"input_ids": text, "pixels": image.pixels}
        if sizes is not None:
            record["pixels_sizes"] = sizes
        with pytest.raises(ConfigurationError, match=words):
            packer.push((_address(), record))
    with pytest.raises(ConfigurationError, match="counts the tokens of fit='anyres' images \\(ImageSpec.llava_next"):
        MultimodalPacker(None, max_length=300, placeholders=placeholders, spec=ImageSpec.internvl(), pad_id=0)
    empty = packer.empty_row()
    assert empty.ragged["image_sizes"].shape == (0, 2)  # padding rows batch with the others


# -- through the pipeline ------------------------------------------------------------------------

def _anyres_pipeline(root, runner: str, *, defer: bool = False) -> Pipeline:
    return (
        Pipeline(mixed_source(root)).options(num_lanes=4, runner=runner, flush_every_chunks=2)
        .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>", parallelism=2)
        .decode_images(field="jpg", spec=ImageSpec(patch_size=14, fit="anyres", size=(56, 56),
                                                   pinpoints=SMALL_PINPOINTS), datasets="photos", parallelism=2,
                       defer=defer)
        .pack_multimodal(400, LlavaNextPlaceholders(3))
        .shuffle(buffer_size=3, seed=2)
        .batch(2)
    )


def test_anyres_photos_are_the_same_bytes_on_every_runner_and_deferred(tmp_path):
    """Photos fitted as LLaVA-NeXT fits them: every batch carries each image's size as shown in
    `image_sizes`, its `<image>` as many as the features that size keeps, and the batches'
    SHA-256s are the same from separately built pipelines on the inline, thread and process
    runners, and deferred (the sizes read from the headers) on the thread and process runners."""
    root = write_mixed_corpus(tmp_path)
    runs = {runner: _epoch(_anyres_pipeline(root, runner)) for runner in ("inline", "thread", "process")}
    for runner in ("thread", "process"):
        runs[f"{runner}, deferred"] = _epoch(_anyres_pipeline(root, runner, defer=True))
    batches, stats = runs["inline"]
    spec = ImageSpec(patch_size=14, fit="anyres", size=(56, 56), pinpoints=SMALL_PINPOINTS)
    canvases = set()
    for batch in batches:
        grids, sizes = batch.ragged["image_grid"], batch.ragged["image_sizes"]
        counts = batch.ragged_counts
        assert len(grids) == len(sizes) and (counts["image_sizes"] == counts["image_grid"]).all()
        placed = sum(LlavaNextPlaceholders(3).num_tokens(*grid, anyres_features(*size, spec))
                     for grid, size in zip(grids.tolist(), sizes.tolist()))
        assert int((batch.tokens["input_ids"] == 3).sum()) == placed
        canvases |= {best_resolution(*size, SMALL_PINPOINTS) for size in sizes.tolist()}
    assert len(canvases) > 1 and stats["mixture"]["photos"]["images"] > 0, canvases
    digests = [batch.digest() for batch in batches]
    for runner, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, runner


def test_decode_images_writes_each_anyres_picture_s_size_beside_it():
    pictures = _pictures()
    address = RecordAddress("p", "s", 0)
    record = DecodeImages(field="jpg", spec=SMALL_ANYRES)._decode_record({"jpg": pictures[:2]}, address)
    assert record["pixels_sizes"].tolist() == [[300, 451], [500, 120]]
    deferred = DecodeImages(field="jpg", spec=SMALL_ANYRES, defer=True)._decode_record({"jpg": pictures[1]}, address)
    assert deferred["pixels"].size == (500, 120)
    np.testing.assert_array_equal(deferred["pixels"].decode(), record["pixels"][1])


# -- into the model ------------------------------------------------------------------------------

@requires_torch
def test_a_tiny_llava_next_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a wide picture then its caption, text alone, and text around a tall picture, given
    to a tiny randomly initialised `LlavaNextForConditionalGeneration` as vlm/README.md shows
    (`input_ids`, the rows' `position_ids`, the tiles by `image_tensors(..., tile=)` and the rows'
    `image_sizes`): every document's logits are the document's alone, so the model's own count of
    each picture's kept features is the packer's (it refuses a mismatch)."""
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    pinpoints = ((28, 56), (56, 28), (56, 56))
    config = LlavaNextConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
        image_token_index=102, image_grid_pinpoints=[list(c) for c in pinpoints],
        vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    spec = ImageSpec(patch_size=14, fit="anyres", size=(28, 28), pinpoints=pinpoints)
    rng = np.random.default_rng(2)
    records = [sized_record(rng, spec, 5, (30, 70)), sized_record(rng, spec, 9),
               sized_record(rng, spec, 6, (90, 33), image_offsets=[2])]
    assert_each_packed_document_is_its_own(
        model, LlavaNextPlaceholders(102), spec, records, 120,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                                     std=(0.5,) * 3, tile=2), "image_sizes": batch["image_sizes"]})
