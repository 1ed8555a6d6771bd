"""LLaVA-OneVision's pictures: `ImageSpec.llava_onevision()` (anyres on 384 px tiles, SigLIP's 27
features a side that are no whole number of the pixels' patches, and the "anyres_max_9" cap) with
`LlavaNextPlaceholders`.

The oracles are transformers' own: `LlavaOnevisionProcessor`'s feature count and text,
`LlavaOnevisionImageProcessorPil`'s pixels, and a tiny randomly initialised
`LlavaOnevisionForConditionalGeneration` for what the rows do in a model.
"""

from __future__ import annotations

import io
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tests.conftest import requires_torch
from tests.unit.test_vlm_anyres import llava_tokenizer  # noqa: F401 - the tokenizer fixture
from tests.unit.test_vlm_fixed_size import assert_each_packed_document_is_its_own
from tests.unit.test_vlm_split import _address, _pictures, sized_record
from vlm import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageSpec, LlavaNextPlaceholders, batch_num_images,
                 decode_image_with_size, image_grid, image_tensors, patchify)
from vlm._anyres import LLAVA_ONEVISION_PINPOINTS
from vlm._image import anyres_features
from vlm._packing import MultimodalPacker
from zephon import ConfigurationError

SMALL_PINPOINTS = tuple((64 * rows, 64 * columns) for rows in range(1, 4) for columns in range(1, 4))
SMALL_ONEVISION = ImageSpec.llava_onevision(size=(64, 64), pinpoints=SMALL_PINPOINTS, tile_features=4, anyres_max=2,
                                            draft=False)
"""OneVision's rule at 64 px tiles, 1x1 to 3x3 of them: a tower of 14 px patches makes 4x4 features
of a tile (the pixels travel as 4x4 patches of 16 px), the kept features capped at 2 tiles'
worth, so that a 3x3 canvas is shrunk; `draft=False` resizes from the full decode, as the
processor does."""


def _processor_stub(spec: ImageSpec) -> SimpleNamespace:
    """`LlavaOnevisionProcessor`'s state for the spec's canvases, a tile's features and its cap, as
    the checkpoints set it ("full" features: SigLIP has no class token), its methods bound to it
    (the processor itself will not build without torchvision, for its video processor)."""
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    stub = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=[list(c) for c in spec.pinpoints]),
                           num_image_tokens=spec.tile_features**2, vision_aspect_ratio=f"anyres_max_{spec.anyres_max}",
                           vision_feature_select_strategy="full", image_token="<image>")
    for name in ("_get_unpadded_features", "_get_number_of_features", "replace_image_token"):
        setattr(stub, name, partial(getattr(LlavaOnevisionProcessor, name), stub))
    return stub


def _feature_count(spec: ImageSpec):
    """`LlavaOnevisionProcessor._get_number_of_features`: (height, width) as shown -> `<image>` of
    a document's only picture."""
    stub = _processor_stub(spec)
    return lambda height, width: stub._get_number_of_features(height, width, *spec.size)


def _image_processor(spec: ImageSpec):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    return LlavaOnevisionImageProcessorPil(size={"height": spec.size[0], "width": spec.size[1]},
                                           image_grid_pinpoints=[list(canvas) for canvas in spec.pinpoints])


# -- sizing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [ImageSpec.llava_onevision(), SMALL_ONEVISION], ids=["onevision", "small"])
def test_the_count_of_a_picture_s_features_is_llava_onevision_s_for_every_size(spec):
    """For 400 random sizes and the edges (strips one pixel thick, squares, canvases exactly), the
    placeholder count (the base image's features, the kept ones shrunk to the cap, a newline a
    row) equals `LlavaOnevisionProcessor`'s; the grid stacks the base image and the canvas's tiles
    as 16 px patches. Many sizes are shrunk and many are not."""
    count = _feature_count(spec)
    placeholders = LlavaNextPlaceholders(3)
    tile = spec.size[0]
    rng = np.random.default_rng(12)
    sizes = [tuple(int(n) for n in pair) for pair in rng.integers(1, 6000, (400, 2))] + [
        (1, 1), (1, 6000), (6000, 1), (tile, tile), (tile, 2 * tile), (6 * tile, 6 * tile), (10 * tile, tile + 1)]
    shrunk = 0
    for height, width in sizes:
        rows, cols = image_grid(height, width, spec)
        kept = anyres_features(height, width, spec)
        assert (rows, cols) == ((1 + kept[0]) * tile // 16, tile // 16)
        assert placeholders.num_tokens(rows, cols, kept) == count(height, width), (height, width)
        unshrunk = anyres_features(height, width, ImageSpec(**{**_settings(spec), "anyres_max": None}))
        shrunk += kept != unshrunk
    assert 50 < shrunk < len(sizes) - 50


def _settings(spec: ImageSpec) -> dict:
    from dataclasses import fields

    return {f.name: getattr(spec, f.name) for f in fields(spec)}


def test_anyres_pixels_equal_llava_onevision_s_tile_for_tile():
    """Decoded with `llava_onevision`'s rule (draft off) and cut apart by `image_tensors(..., tile=4)`,
    each picture's base image and tiles equal `LlavaOnevisionImageProcessorPil`'s `pixel_values`
    value for value (CLIP's mean and std, the padding black before them), as many, and the sizes
    decoding reports its `image_sizes`."""
    pictures = _pictures()
    decoded = [decode_image_with_size(data, SMALL_ONEVISION) for data in pictures]
    grids = np.array([(len(image.pixels) // 16, 4) for image in decoded])
    ours = image_tensors(np.concatenate([patchify(image.pixels, 16) for image in decoded]), grids,
                         mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, tile=4)
    want = _image_processor(SMALL_ONEVISION)(images=[Image.open(io.BytesIO(data)) for data in pictures],
                                             do_pad=False, return_tensors=None)
    np.testing.assert_array_equal(ours, np.concatenate([np.asarray(each) for each in want["pixel_values"]]))
    assert [image.size for image in decoded] == [tuple(int(n) for n in size) for size in want["image_sizes"]]
    assert len({len(image.pixels) for image in decoded}) >= 3


def test_onevision_settings_are_anyres_s_and_in_the_fingerprint():
    from vlm._stages import _describe

    spec = ImageSpec.llava_onevision()
    assert spec.pinpoints == LLAVA_ONEVISION_PINPOINTS and len(spec.pinpoints) == 36
    assert (_describe(spec)["tile_features"], _describe(spec)["anyres_max"]) == (27, 9)
    assert _describe(spec)["several_pad"] == [127, 127, 127]
    assert "tile_features" not in _describe(ImageSpec.llava_next())  # recipes made before keep their fingerprint
    assert "several_pad" not in _describe(ImageSpec.llava_next())
    for kwargs, words in (({"fit": "fixed", "size": (64, 64), "tile_features": 4}, "tile_features are fit='anyres''s"),
                          ({"fit": "fixed", "size": (64, 64), "several_pad": (0, 0, 0)},
                           "several_pad is fit='anyres''s"),
                          ({"fit": "anyres", "size": (336, 336), "several_pad": (0, 0, 256)}, "three ints in 0..255"),
                          ({"fit": "pixels", "anyres_max": 9}, "anyres_max are fit='anyres''s"),
                          ({"fit": "anyres", "size": (64, 64), "tile_features": 0}, "tile_features")):
        with pytest.raises(ConfigurationError, match=words):
            ImageSpec(**{"patch_size": 16, **kwargs})


# -- tokens --------------------------------------------------------------------------------------

def test_rows_are_llava_onevision_processor_s_input_ids_token_for_token(llava_tokenizer):  # noqa: F811
    """Two records of one picture each, one before its caption, one inside it (`image_offsets`),
    packed into one row: each document is the tokenizer's encoding of the text
    `LlavaOnevisionProcessor.replace_image_token` writes for the same text with `<image>` where
    its picture goes (a wide one shrunk to the cap, a small one not), the rows' `image_sizes`
    `LlavaOnevisionImageProcessorPil`'s, and the row's pixels its `pixel_values` in order."""
    spec = SMALL_ONEVISION
    tokenizer = llava_tokenizer
    stub = _processor_stub(spec)
    image_processor = _image_processor(spec)
    pictures = [_pictures()[0], _pictures()[2]]  # 300x451: 2x3 tiles, shrunk; 17x29: one tile

    def ids(text: str) -> np.ndarray:
        return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)

    pieces = [["", "a photo of a cat"], ["left", " then right"]]
    records = []
    for piece, data in zip(pieces, pictures):
        image = decode_image_with_size(data, spec)
        encoded = [ids(text) for text in piece]
        records.append({"input_ids": np.concatenate(encoded), "pixels": image.pixels,
                        "pixels_sizes": np.array([image.size], np.int32), "image_offsets": [len(encoded[0])]})
    packer = MultimodalPacker(None, max_length=600, placeholders=LlavaNextPlaceholders.from_tokenizer(tokenizer),
                              spec=spec, pad_id=0)
    assert [row for i, record in enumerate(records) for row in packer.push((_address(i), record))] == []
    [row] = packer.flush()
    documents = row.tokens["document_ids"]
    want_sizes = []
    pixel_values = []
    for number, (piece, data) in enumerate(zip(pieces, pictures)):
        want = image_processor(images=[Image.open(io.BytesIO(data))], do_pad=False, return_tensors=None)
        image_inputs = {"batch_num_images": [1], "image_sizes": want["image_sizes"], "pixel_values": want["pixel_values"]}
        text = stub.replace_image_token(image_inputs, 0).join(piece)
        assert row.tokens["input_ids"][documents == number].tolist() == ids(text).tolist(), number
        want_sizes += [[int(n) for n in size] for size in want["image_sizes"]]
        pixel_values.append(np.asarray(want["pixel_values"][0]))
    assert row.ragged["image_sizes"].tolist() == want_sizes
    grids = row.ragged["image_grid"]
    assert grids[:, 0].tolist() == [(1 + 6) * 4, (1 + 1) * 4]
    assert anyres_features(300, 451, spec)[2:] == (4, 6)  # of 8x12 kept features: shrunk to the cap
    pixels = image_tensors(row.ragged["pixel_values"], grids, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, tile=4)
    np.testing.assert_array_equal(pixels, np.concatenate(pixel_values))


def _several(pictures: list[bytes], *, defer: bool = False, **fields) -> dict:
    """A record of `pictures` as `decode_images` with `SMALL_ONEVISION` writes it (each picture
    sized by `for_pictures`, its size as shown beside it; left encoded with `defer`)."""
    from vlm._stages import DecodeImages

    stage = DecodeImages(field="jpg", spec=SMALL_ONEVISION, defer=defer).build("raise")
    return {**stage._decode_record({"jpg": pictures}, _address()), **fields}


def test_several_pictures_of_a_record_are_padded_to_one_tile_as_the_processor_pads_them():
    """A record of three pictures decoded by `decode_images` with OneVision's rule: each is padded
    to a square of the mean colour and resized to one tile, equal value for value to
    `LlavaOnevisionImageProcessorPil`'s `pixel_values` for a document of three pictures (its
    `batch_num_images`, the checkpoints' mean of 0.5), their sizes as shown beside them as its
    `image_sizes`, and decoded after packing alike; a record of one picture keeps its canvas of
    tiles."""
    from vlm._image import ONEVISION_SEVERAL_PAD

    pictures = [_pictures()[k] for k in (0, 1, 5)]  # wide, tall and a JPEG
    record = _several(pictures)
    grids = np.array([(len(pixels) // 16, 4) for pixels in record["pixels"]])
    assert grids.tolist() == [[4, 4]] * 3 and ONEVISION_SEVERAL_PAD == (127,) * 3
    ours = image_tensors(np.concatenate([patchify(pixels, 16) for pixels in record["pixels"]]), grids,
                         mean=(0.5,) * 3, std=(0.5,) * 3, tile=4)
    processor = _image_processor(SMALL_ONEVISION)
    processor.image_mean = processor.image_std = [0.5] * 3
    want = processor(images=[[Image.open(io.BytesIO(data)) for data in pictures]], do_pad=False, return_tensors=None)
    assert list(want["batch_num_images"]) == [3]
    np.testing.assert_array_equal(ours, np.concatenate([np.asarray(each) for each in want["pixel_values"]]))
    assert record["pixels_sizes"].tolist() == [[int(n) for n in size] for size in want["image_sizes"]]
    assert len(_several(pictures[:1])["pixels"][0]) == (1 + 6) * 64  # alone: the base image and 2x3 tiles
    later = _several(pictures, defer=True)["pixels"]  # decoded after packing: the same pictures and sizes
    assert [image.size for image in later] == [tuple(size) for size in record["pixels_sizes"].tolist()]
    for image, pixels in zip(later, record["pixels"]):
        np.testing.assert_array_equal(image.decode(), pixels)


def test_a_picture_among_several_takes_the_processor_s_count(llava_tokenizer):  # noqa: F811
    """Packed, each of a record's three pictures is as many `<image>` as
    `LlavaOnevisionProcessor.replace_image_token` writes for a picture of a document of three:
    its tile's features and a newline; a record of one is counted from its canvas as before."""
    stub = _processor_stub(SMALL_ONEVISION)
    inputs = {"batch_num_images": [3], "image_sizes": [[300, 451]] * 3, "pixel_values": [np.zeros((1, 3, 64, 64))]}
    count = stub.replace_image_token(inputs, 1).count("<image>")
    record = _several([_pictures()[k] for k in (0, 1, 5)], input_ids=np.array([9, 9], np.int32))
    packer = MultimodalPacker(None, max_length=200, placeholders=LlavaNextPlaceholders(3), spec=SMALL_ONEVISION,
                              pad_id=0)
    assert packer.push((_address(), record)) == []
    [row] = packer.flush()
    assert count == 4 * 4 + 1 and row.num_real_tokens == 3 * count + 2
    assert row.ragged["image_sizes"].tolist() == record["pixels_sizes"].tolist()


# -- into the model ------------------------------------------------------------------------------

@requires_torch
def test_a_tiny_llava_onevision_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a wide picture then its caption (its features shrunk to the cap), text alone, and
    text around a tall picture, given to a tiny randomly initialised
    `LlavaOnevisionForConditionalGeneration` (SigLIP's 14 px patches, 4x4 features of a 64 px
    tile) with the tiles by `image_tensors(..., tile=4)` and the rows' `image_sizes`: every
    document's logits are the document's alone, so the model's own count of each picture's kept
    features is the packer's (it refuses a mismatch)."""
    import torch
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    spec = SMALL_ONEVISION
    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=14),
        text_config=dict(model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
        image_token_index=102, image_grid_pinpoints=[list(c) for c in spec.pinpoints],
        vision_feature_select_strategy="full", vision_feature_layer=-1, vision_aspect_ratio="anyres_max_2")
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    rng = np.random.default_rng(2)
    records = [sized_record(rng, spec, 5, (60, 200)), sized_record(rng, spec, 9),
               sized_record(rng, spec, 6, (190, 70), image_offsets=[2])]
    wide = anyres_features(60, 200, spec)
    assert wide != anyres_features(60, 200, ImageSpec(**{**_settings(spec), "anyres_max": None}))  # shrunk
    assert_each_packed_document_is_its_own(
        model, LlavaNextPlaceholders(102), spec, records, 200,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                                     std=(0.5,) * 3, tile=4), "image_sizes": batch["image_sizes"]})
    # A document of two pictures, each one padded tile, between documents of one: the model told
    # which document holds several (`batch_num_images`) gives each its logits alone.
    several = _several([_pictures()[0], _pictures()[3]], input_ids=rng.integers(10, 90, 7).astype(np.int32),
                       image_offsets=[0, 4])
    assert_each_packed_document_is_its_own(
        model, LlavaNextPlaceholders(102), spec, [records[0], several, records[2]], 240,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                                     std=(0.5,) * 3, tile=4), "image_sizes": batch["image_sizes"],
                       "batch_num_images": batch_num_images(batch)})
