"""Fixed-size vision towers: `ImageSpec(fit="fixed")` and `fit="tiles"`, `PadPlaceholders` and
`image_tensors`, for Gemma 3, SigLIP-style, LLaVA-style and InternVL models.

The oracles are transformers' own processors: `Gemma3Processor` (its PIL image processor and its
text, `\\n\\n<start_of_image>` + 256 pads + `<end_of_image>\\n\\n`, encoded by the same tokenizer),
`SiglipImageProcessorPil` for the pixels, `LlavaProcessor` for LLaVA's `<image>` run, and
InternVL's `GotOcr2ImageProcessorPil(crop_to_patches=True)` and `InternVLProcessor` for its tiles.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.conftest import requires_torch
from tests.unit.test_vlm_mixed_media import TOKENIZER, _epoch, mixed_source, write_mixed_corpus
from vlm import ImageSpec, PadPlaceholders, VideoSpec, decode_image, image_grid, image_tensors, patchify
from vlm._image import tile_arrangement
from vlm._packing import MultimodalPacker, PackMultimodal
from zephon import ConfigurationError, Pipeline
from zephon._records import RecordAddress
from zephon._sequence import IGNORE_INDEX

GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
SMALL_GEMMA3 = ImageSpec.gemma3(size=(224, 224), draft=False)
"""Gemma 3's sizing at 224 px (16x16 patches, 4x4 pooled cells): its processor's rule at a size the
tests resize quickly; `draft=False` resizes from the full decode, as the processor does."""


def _png(pixels: np.ndarray, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels, mode).save(out, "PNG")
    return out.getvalue()


def _images() -> list[bytes]:
    """A wide and a tall picture, a small one to grow, and a JPEG."""
    rng = np.random.default_rng(4)
    jpeg = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (180, 240, 3), dtype=np.uint8)).save(jpeg, "JPEG", quality=90)
    return [_png(rng.integers(0, 256, (300, 451, 3), dtype=np.uint8)),
            _png(rng.integers(0, 256, (500, 120, 3), dtype=np.uint8)),
            _png(rng.integers(0, 256, (17, 29, 3), dtype=np.uint8)),
            jpeg.getvalue()]


TRANSPARENT = _png(np.random.default_rng(5).integers(0, 256, (90, 70, 4), dtype=np.uint8), "RGBA")
"""A picture whose every pixel has its own transparency: the worst case for compositing order."""


@pytest.fixture(scope="module")
def gemma3_tokenizer():
    """The shipped tokenizer with Gemma 3's image tokens added as special tokens and named as
    Gemma's tokenizer names them (no Gemma tokenizer ships offline)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(list(GEMMA3_TOKENS), special_tokens=True)
    for name, token in zip(("boi", "image", "eoi"), GEMMA3_TOKENS):
        setattr(tokenizer, f"{name}_token", token)
        setattr(tokenizer, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
    return tokenizer


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("photos", "shard-0", i)


# -- sizing --------------------------------------------------------------------------------------

def test_a_crop_fit_scales_the_shorter_side_and_cuts_the_middle_as_clip_does():
    """`crop_scaled_size` is transformers' `get_resize_output_image_size` with CLIP's
    `shortest_edge` for images of every shape, and each picture's crop is `LlavaImageProcessorPil`'s
    (CLIP's resize and center crop), value for value, a wide, a tall, a tiny one and a JPEG."""
    from transformers.image_transforms import get_resize_output_image_size
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from vlm._image import crop_scaled_size

    spec = ImageSpec(patch_size=14, fit="crop", size=(224, 224), draft=False, resample="bicubic")
    rng = np.random.default_rng(8)
    for height, width in [*rng.integers(1, 3000, (200, 2)).tolist(), (224, 224), (100, 300), (301, 100)]:
        want = get_resize_output_image_size(np.zeros((height, width, 3), np.uint8), 224, default_to_square=False)
        assert crop_scaled_size(height, width, spec) == tuple(want), (height, width)
    assert image_grid(17, 3000, spec) == (16, 16)
    from vlm import ImageDecodeError

    strip = _png(np.zeros((1, 4000, 3), np.uint8))  # scaled to 224 x 896,000 before the cut
    with pytest.raises(ImageDecodeError, match="scales its 4000x1 pixels to 896000x224") as refused:
        decode_image(strip, spec)
    assert refused.value.reason == "decompression_bomb"
    processor = LlavaImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                       image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    for data in _images():
        ours = image_tensors(patchify(decode_image(data, spec), 14), np.array([[16, 16]]), mean=(0.5,) * 3,
                             std=(0.5,) * 3)
        np.testing.assert_array_equal(ours, processor(images=[Image.open(io.BytesIO(data))],
                                                      return_tensors="np")["pixel_values"])


def test_a_pad_fit_is_llava_s_padded_square_value_for_value():
    """`fit="pad"` (LLaVA-1.5's training code) equals `LlavaImageProcessorPil(do_pad=True)`: the
    picture padded to a square with the mean colour, then resized; transparency included, which
    both composite on white first. A strip too thin to pad within max_image_pixels is refused."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from vlm import ImageDecodeError

    clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    spec = ImageSpec(patch_size=14, fit="pad", size=(224, 224), pad_color=tuple(int(c * 255) for c in clip_mean),
                     draft=False, resample="bicubic")
    processor = LlavaImageProcessorPil(do_pad=True, size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                       image_mean=clip_mean, image_std=clip_std)  # it pads with its mean
    for data in [*_images(), TRANSPARENT]:
        ours = image_tensors(patchify(decode_image(data, spec), 14), np.array([[16, 16]]), mean=clip_mean, std=clip_std)
        np.testing.assert_array_equal(ours, processor(images=[Image.open(io.BytesIO(data))],
                                                      return_tensors="np")["pixel_values"])
    with pytest.raises(ImageDecodeError, match="pads its 10x20000 pixels to 20000x20000") as refused:
        decode_image(_png(np.zeros((20000, 10, 3), np.uint8)), spec)
    assert refused.value.reason == "decompression_bomb"
    for pad_color, words in ((None, "only then"), ((1, 2), "three ints"), ((0, 0, 256), "three ints")):
        with pytest.raises(ConfigurationError, match=words):
            ImageSpec(patch_size=14, fit="pad", size=(224, 224), pad_color=pad_color)


def test_a_fixed_fit_gives_every_image_its_grid_whatever_its_size_or_aspect():
    spec = ImageSpec(patch_size=14, merge_size=4, fit="fixed", size=(224, 112))
    for height, width in ((1, 1), (224, 112), (3000, 20), (20, 3000), (113, 57)):
        assert image_grid(height, width, spec) == (16, 8)
    assert decode_image(_png(np.zeros((40, 300, 3), np.uint8)), spec).shape == (224, 112, 3)
    assert ImageSpec.gemma3().size == (896, 896) and image_grid(10, 10, ImageSpec.gemma3()) == (64, 64)
    for kwargs, words in (({"fit": "fixed"}, "only then"), ({"size": (224, 224)}, "only then"),
                          ({"fit": "fixed", "size": (224, 200)}, "not whole 56x56"),
                          ({"fit": "fixed", "size": (224,)}, "height, width"),
                          ({"fit": "fixed", "size": "224"}, "height, width"),
                          ({"fit": "fixed", "size": (0, 224)}, "size")):
        with pytest.raises(ConfigurationError, match=words):
            ImageSpec(**{"patch_size": 14, "merge_size": 4, **kwargs})


def test_a_fixed_size_is_in_the_fingerprint_and_the_other_fits_keep_theirs():
    from vlm._stages import DecodeImages

    plain = DecodeImages(spec=ImageSpec.qwen2_vl()).fingerprint()["spec"]
    assert "size" not in plain
    assert DecodeImages(spec=ImageSpec.gemma3()).fingerprint()["spec"]["size"] == [896, 896]
    packer = PackMultimodal(512, PadPlaceholders(7, merge_size=4), ImageSpec.gemma3()).fingerprint(0)
    assert packer["spec"]["size"] == [896, 896]


# -- pixels --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "processor"), [
    (SMALL_GEMMA3, "gemma3"),
    (ImageSpec.gemma3(draft=False), "gemma3-896"),
    (ImageSpec(patch_size=14, fit="fixed", size=(224, 224), resample="bicubic", draft=False), "siglip"),
])
def test_image_tensors_equal_the_model_s_image_processor_s_for_the_same_images(spec, processor):
    """Decoded with the spec and put back together by `image_tensors` (mean = std = 0.5), every
    image equals, value for value, what the model's own image processor gives for it: Gemma 3's
    (bilinear, at 224 and at its 896) and SigLIP's (bicubic), from transformers' PIL backends.
    NumPy and torch give the same."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    size = {"height": spec.size[0], "width": spec.size[1]}
    model_processor = (SiglipImageProcessorPil if processor == "siglip" else Gemma3ImageProcessorPil)(size=size)
    encoded = _images() if processor != "gemma3-896" else _images()[:1]
    patches = np.concatenate([patchify(decode_image(data, spec), spec.patch_size) for data in encoded])
    grids = np.array([image_grid(1, 1, spec)] * len(encoded))
    ours = image_tensors(patches, grids, mean=(0.5,) * 3, std=(0.5,) * 3)
    want = model_processor(images=[Image.open(io.BytesIO(data)) for data in encoded], return_tensors="np")
    np.testing.assert_array_equal(ours, want["pixel_values"])
    try:
        import torch
    except ImportError:
        return
    np.testing.assert_array_equal(
        image_tensors(torch.from_numpy(patches), torch.from_numpy(grids), mean=(0.5,) * 3, std=(0.5,) * 3).numpy(), ours)


def test_a_transparent_image_differs_from_the_processor_s_by_a_few_levels_at_most():
    """The decode composites transparency on white after resizing (Pillow resizes premultiplied
    alpha), the processors before: with every pixel's alpha its own, values part by at most
    3/255 of the pixel range (2 x 3/255 once normalised to [-1, 1])."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    ours = image_tensors(patchify(decode_image(TRANSPARENT, SMALL_GEMMA3), 14), np.array([[16, 16]]),
                         mean=(0.5,) * 3, std=(0.5,) * 3)
    want = Gemma3ImageProcessorPil(size={"height": 224, "width": 224})(
        images=[Image.open(io.BytesIO(TRANSPARENT))], return_tensors="np")["pixel_values"]
    difference = np.abs(ours - want).max()
    assert 0 < difference <= 2 * 3 / 255 + 1e-6


def test_image_tensors_refuse_images_of_several_sizes_and_another_batch_s_grids():
    patches = np.zeros((4 + 8, 14 * 14 * 3), np.uint8)
    with pytest.raises(ValueError, match="one tensor holds images of one size"):
        image_tensors(patches, np.array([[2, 2], [2, 4]]), mean=(0.5,) * 3, std=(0.5,) * 3)
    with pytest.raises(ValueError, match="12 patches but the grids"):
        image_tensors(patches, np.array([[2, 2]]), mean=(0.5,) * 3, std=(0.5,) * 3)
    assert image_tensors(patches[:0], np.zeros((0, 2), np.int64), mean=(0.5,) * 3, std=(0.5,) * 3).shape[0] == 0


# -- InternVL's tiles ---------------------------------------------------------------------------

SMALL_INTERNVL = ImageSpec.internvl(size=(112, 112), tiles=(1, 6), draft=False)
"""InternVL's tiling with 112 px tiles (8x8 patches) and at most 6 of them, quick to resize."""
INTERNVL_MEAN, INTERNVL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
"""InternVL's checkpoints' normalisation (ImageNet's)."""


def _internvl_processor(spec: ImageSpec):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(crop_to_patches=True, min_patches=spec.tiles[0], max_patches=spec.tiles[1],
                                    size={"height": spec.size[0], "width": spec.size[1]},
                                    image_mean=INTERNVL_MEAN, image_std=INTERNVL_STD)


@pytest.mark.parametrize("tiles", [(1, 12), (1, 6), (2, 4), (1, 1)])
def test_tiles_are_arranged_as_internvl_arranges_them(tiles):
    """The tile arrangement equals transformers' `get_optimal_tiled_canvas` for images of every
    aspect ratio, ties between equally near arrangements included (1:1, 2:1, 3:2 images), and
    the grid stacks the arrangement's tiles and, past one tile, a thumbnail."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    spec = ImageSpec.internvl(tiles=tiles)
    rng = np.random.default_rng(6)
    sizes = [(h, w) for h, w in rng.integers(1, 4000, (300, 2))] + [
        (448, 448), (100, 100), (2000, 2000), (448, 896), (100, 200), (3000, 6000), (300, 200), (896, 448)]
    for height, width in sizes:
        height, width = int(height), int(width)
        columns, rows = get_optimal_tiled_canvas((height, width), (448, 448), *tiles)
        assert tile_arrangement(height, width, spec) == (columns, rows), (height, width)
        count = columns * rows + (columns * rows > 1)
        assert image_grid(height, width, spec) == (32 * count, 32)
    assert image_grid(300, 900, ImageSpec.internvl(thumbnail=False, tiles=tiles)) == (
        32 * int(np.prod(get_optimal_tiled_canvas((300, 900), (448, 448), *tiles))), 32)


def test_tiles_equal_internvl_s_image_processor_s_tile_for_tile():
    """Decoded with `fit="tiles"` (draft off) and cut apart by `image_tensors(..., tile=8)`, each
    image's tiles and thumbnail equal `GotOcr2ImageProcessorPil(crop_to_patches=True)`'s
    `pixel_values` value for value, and as many as its `num_patches`."""
    processor = _internvl_processor(SMALL_INTERNVL)
    rng = np.random.default_rng(7)
    pictures = [_png(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                for h, w in ((300, 451), (500, 120), (17, 29), (100, 100), (90, 400))] + _images()[3:]
    patches = [patchify(decode_image(data, SMALL_INTERNVL), 14) for data in pictures]
    grids = np.array([image_grid(*Image.open(io.BytesIO(data)).size[::-1], SMALL_INTERNVL) for data in pictures])
    ours = image_tensors(np.concatenate(patches), grids, mean=INTERNVL_MEAN, std=INTERNVL_STD, tile=8)
    want = processor(images=[Image.open(io.BytesIO(data)) for data in pictures], return_tensors="np")
    assert (grids[:, 0] // 8).tolist() == list(want["num_patches"])
    assert sorted(set(want["num_patches"])) == [1, 5, 7]  # one tile alone, and thumbnails after 4 and 6
    np.testing.assert_array_equal(ours, want["pixel_values"])


def test_internvl_rows_are_its_processor_s_text_token_for_token():
    """A tiled picture before its caption: the row's document is the tokenizer's encoding of the
    text `InternVLProcessor` writes for it (`<img>`, 16 `<IMG_CONTEXT>` per tile at 112 px,
    `</img>`) and the caption."""
    from types import SimpleNamespace

    from transformers import PreTrainedTokenizerFast
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(["<img>", "</img>", "<IMG_CONTEXT>"], special_tokens=True)
    placeholders = PadPlaceholders.from_tokenizer(tokenizer, pad="<IMG_CONTEXT>", start="<img>", end="</img>",
                                                  merge_size=2)
    data = _images()[0]
    tiles = _internvl_processor(SMALL_INTERNVL)(images=[Image.open(io.BytesIO(data))])["num_patches"]
    stub = SimpleNamespace(start_image_token="<img>", end_image_token="</img>", image_token="<IMG_CONTEXT>",
                           image_seq_length=16)
    caption = "tiles of a picture"
    text = InternVLProcessor.replace_image_token(stub, {"num_patches": tiles}, 0) + caption
    ids = np.array(tokenizer(caption, add_special_tokens=False)["input_ids"], np.int32)
    packer = MultimodalPacker(None, max_length=160, placeholders=placeholders, spec=SMALL_INTERNVL, pad_id=2)
    assert packer.push((_address(), {"input_ids": ids, "pixels": decode_image(data, SMALL_INTERNVL)})) == []
    [row] = packer.flush()
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiles[0] == 7 and len(want) == 2 + 16 * 7 + len(ids)
    assert row.tokens["input_ids"][: len(want)].tolist() == want


@pytest.mark.parametrize("orientation", range(2, 9))
@pytest.mark.parametrize("fit", ["tiles", "crop", "pad"])
def test_a_picture_stored_turned_is_tiled_and_cut_as_shown(orientation, fit):
    """A 150x60 picture stored turned or flipped, with the EXIF orientation that shows it upright
    (a lossless PNG): its tiles, or its crop, are those of the upright picture, pixel for pixel,
    and its header alone gives the same grid (deferred decoding)."""
    from tests.unit.test_vlm_assets import gradient
    from vlm._image import probe_image

    spec = (ImageSpec.internvl(size=(56, 56), tiles=(1, 6), draft=False) if fit == "tiles"
            else ImageSpec(patch_size=14, fit=fit, size=(56, 56), draft=False,
                           pad_color=(9, 99, 199) if fit == "pad" else None))
    upright = Image.fromarray(gradient(60, 150))
    inverse = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_90",
               7: "TRANSVERSE", 8: "ROTATE_270"}[orientation]
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = io.BytesIO()
    upright.transpose(Image.Transpose[inverse]).save(stored, "PNG", exif=exif.tobytes())
    want = decode_image(_png(np.asarray(upright)), spec)
    assert want.shape[0] > want.shape[1] or fit != "tiles"  # several tiles: the arrangement depends on the turn
    np.testing.assert_array_equal(decode_image(stored.getvalue(), spec), want)
    assert probe_image(stored.getvalue(), spec) == (want.shape[0] // 14, want.shape[1] // 14)


def test_tiles_are_refused_where_they_cannot_be_cut():
    for kwargs, words in (({"tiles": (1, 4)}, "fit='tiles''s"), ({"thumbnail": True}, "fit='tiles''s"),
                          ({"fit": "tiles", "size": (448, 448), "tiles": (3, 2)}, "min <= max"),
                          ({"fit": "tiles", "size": (448, 448), "tiles": (0, 2)}, "tiles"),
                          ({"fit": "tiles", "size": (448, 448), "thumbnail": "yes"}, "True or False")):
        with pytest.raises(ConfigurationError, match=words):
            ImageSpec(**{"patch_size": 14, "merge_size": 2, **kwargs})
    for spec in (ImageSpec.internvl(), ImageSpec(patch_size=14, fit="pad", size=(336, 336), pad_color=(0, 0, 0))):
        with pytest.raises(ConfigurationError, match="resized whole, not cut"):
            VideoSpec(image=spec)  # a cropped frame is its middle: test_vlm_next_video.py
    with pytest.raises(ValueError, match="not whole tiles of 8"):
        image_tensors(np.zeros((12 * 8, 14 * 14 * 3), np.uint8), np.array([[12, 8]]), mean=(0.5,) * 3, std=(0.5,) * 3,
                      tile=8)


# -- tokens --------------------------------------------------------------------------------------

def test_gemma3_rows_are_its_processor_s_input_ids_token_for_token(gemma3_tokenizer):
    """A caption with its picture, packed after BOS: the row's document is `Gemma3Processor`'s
    `input_ids` for `<bos><start_of_image>caption` (its `\\n\\n`, 16 pads at 224 px, `\\n\\n`)
    and its pixels are the processor's `pixel_values`. The whole block learns nothing but its
    last token, which predicts the caption; the pads are the processor's `token_type_ids`."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 224, "width": 224}),
                                tokenizer=gemma3_tokenizer, image_seq_length=16)
    placeholders = PadPlaceholders.gemma3(gemma3_tokenizer)
    assert set(placeholders.token_ids) == set(gemma3_tokenizer.convert_tokens_to_ids(list(GEMMA3_TOKENS)))
    packer = MultimodalPacker(None, max_length=96, placeholders=placeholders, spec=SMALL_GEMMA3, pad_id=2,
                              image_position="after_bos")
    caption = "a photo of something grey"
    bos = gemma3_tokenizer.convert_tokens_to_ids("<|bos|>")
    text = np.array([bos, *gemma3_tokenizer(caption, add_special_tokens=False)["input_ids"]], np.int32)
    data = _images()[0]
    pixels = decode_image(data, SMALL_GEMMA3)
    assert packer.push((_address(), {"input_ids": text, "pixels": pixels})) == []
    [row] = packer.flush()
    want = processor(text=["<|bos|><start_of_image>" + caption], images=[[Image.open(io.BytesIO(data))]],
                     return_tensors="np", add_special_tokens=False)
    length = int((row.tokens["document_ids"] == 0).sum())
    assert row.tokens["input_ids"][:length].tolist() == want["input_ids"][0].tolist()
    np.testing.assert_array_equal(row.tokens["input_ids"][:length] == placeholders.pad, want["token_type_ids"][0] == 1)
    np.testing.assert_array_equal(image_tensors(row.ragged["pixel_values"], row.ragged["image_grid"],
                                                mean=(0.5,) * 3, std=(0.5,) * 3), want["pixel_values"])
    labels = row.tokens["labels"]
    block_end = length - (len(text) - 1)  # BOS, the block, then the caption
    assert labels[0] == IGNORE_INDEX and (labels[1 : block_end - 1] == IGNORE_INDEX).all()
    assert labels[block_end - 1 : length - 1].tolist() == text[1:].tolist()


LLAVA_1_5_SIZES = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
"""llava-hf/llava-1.5's preprocessor_config.json sizes (CLIP's class defaults are 224)."""


def test_llava_rows_hold_its_processor_s_image_run_and_pixels():
    """LLaVA-1.5 at 336 px in 14 px patches: `<image>` once per patch feature, 576 of them, as
    `LlavaProcessor` (its default feature strategy, which drops CLIP's class token) expands it;
    with `fit="crop"` (the shorter side scaled to 336, the middle square cut out) the pixels are
    its image processor's, value for value."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava.processing_llava import LlavaProcessor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.image_token, tokenizer.image_token_id = "<image>", tokenizer.convert_tokens_to_ids("<image>")
    processor = LlavaProcessor(image_processor=LlavaImageProcessorPil(**LLAVA_1_5_SIZES), tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    spec = ImageSpec(patch_size=14, fit="crop", size=(336, 336), draft=False)
    packer = MultimodalPacker(None, max_length=640, placeholders=PadPlaceholders.from_tokenizer(tokenizer, pad="<image>"),
                              spec=spec, pad_id=2)
    caption = "what is in it?"
    text = np.array(tokenizer(caption, add_special_tokens=False)["input_ids"], np.int32)
    data = _images()[1]
    assert packer.push((_address(), {"input_ids": text, "pixels": decode_image(data, spec)})) == []
    [row] = packer.flush()
    processed = processor(text=["<image>" + caption], images=[Image.open(io.BytesIO(data))], return_tensors="np",
                          add_special_tokens=False)
    want = processed["input_ids"][0]
    assert len(want) == 576 + len(text)
    assert row.tokens["input_ids"][: len(want)].tolist() == want.tolist()
    clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    np.testing.assert_array_equal(image_tensors(row.ragged["pixel_values"], row.ragged["image_grid"], mean=clip_mean,
                                                std=clip_std), processed["pixel_values"])


def test_pad_placeholders_refuse_ids_that_would_confuse_the_model():
    with pytest.raises(ConfigurationError, match="distinct"):
        PadPlaceholders(7, start=7)
    with pytest.raises(ConfigurationError, match="holds a placeholder id"):
        PadPlaceholders(7, start=8, text_before=(100, 8))
    with pytest.raises(ConfigurationError, match="sequence of token ids"):
        PadPlaceholders(7, text_after="\n\n")
    with pytest.raises(ConfigurationError, match="2x2"):
        MultimodalPacker(None, max_length=64, placeholders=PadPlaceholders(7, merge_size=2), spec=SMALL_GEMMA3, pad_id=0)
    plain = PadPlaceholders(7, start=8, end=9, merge_size=4, text_before=(100,), text_after=(101, 102))
    assert plain.token_ids == (7, 8, 9)
    assert plain.tokens_for(8, 4).tolist() == [100, 8, 7, 7, 9, 101, 102] and plain.num_tokens(8, 4) == 7


# -- through the pipeline ------------------------------------------------------------------------

def _photos_pipeline(root, runner: str, size: tuple[int, int] = (112, 168), *, defer: bool = False) -> Pipeline:
    spec = ImageSpec(patch_size=14, merge_size=4, fit="fixed", size=size)
    return (
        Pipeline(mixed_source(root)).options(num_lanes=4, runner=runner, flush_every_chunks=2)
        .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>", parallelism=2)
        .decode_images(field="jpg", spec=spec, datasets="photos", parallelism=2, defer=defer)
        .decode_video(field="mp4", spec=VideoSpec(num_frames=2, image=spec), datasets="clips")
        .pack_multimodal(160, PadPlaceholders(3, start=4, end=5, merge_size=4), image_position="after_bos")
        .shuffle(buffer_size=3, seed=2)
        .batch(2)
    )


def test_fixed_size_photos_and_clips_are_the_same_bytes_on_every_runner(tmp_path):
    """Photos and clips at one fixed size, in Gemma 3's kind of layout: every image is an 8x12
    patch grid (6 pads between a start and an end), and the batches' SHA-256s are the same from
    separately built pipelines on the inline, thread and process runners, and with the photos
    decoded after packing (sized from their headers) on the process runner."""
    root = write_mixed_corpus(tmp_path)
    runs = {runner: _epoch(_photos_pipeline(root, runner)) for runner in ("inline", "thread", "process")}
    runs["process, deferred"] = _epoch(_photos_pipeline(root, "process", defer=True))
    batches, stats = runs["inline"]
    images = 0
    for batch in batches:
        grids = batch.ragged["image_grid"]
        assert (grids == [8, 12]).all()
        assert int((batch.tokens["input_ids"] == 3).sum()) == 6 * len(grids)
        images += len(grids)
    assert images > 0 and stats["mixture"]["photos"]["images"] + stats["mixture"]["clips"]["images"] == images
    digests = [batch.digest() for batch in batches]
    for runner, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, runner


def _tiled_pipeline(root, runner: str, *, defer: bool = False) -> Pipeline:
    spec = ImageSpec.internvl(size=(56, 56), tiles=(1, 4))
    return (
        Pipeline(mixed_source(root)).options(num_lanes=4, runner=runner, flush_every_chunks=2)
        .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>", parallelism=2)
        .decode_images(field="jpg", spec=spec, datasets="photos", parallelism=2, defer=defer)
        .pack_multimodal(160, PadPlaceholders(3, start=4, end=5, merge_size=2))
        .shuffle(buffer_size=3, seed=2)
        .batch(2)
    )


def test_tiled_photos_are_the_same_bytes_on_every_runner(tmp_path):
    """Photos cut into InternVL's tiles (56 px, at most 4 and a thumbnail): every image's grid is
    whole 4x4-patch tiles stacked, 4 pads a tile, and the batches' SHA-256s are the same from
    separately built pipelines on the inline, thread and process runners, and deferred (sized
    from the headers) on the thread runner."""
    root = write_mixed_corpus(tmp_path)
    runs = {runner: _epoch(_tiled_pipeline(root, runner)) for runner in ("inline", "thread", "process")}
    runs["thread, deferred"] = _epoch(_tiled_pipeline(root, "thread", defer=True))
    batches, _ = runs["inline"]
    tiles = set()
    for batch in batches:
        grids = batch.ragged["image_grid"]
        assert (grids[:, 1] == 4).all() and not (grids[:, 0] % 4).any()
        assert int((batch.tokens["input_ids"] == 3).sum()) == 4 * int(grids[:, 0].sum() // 4)
        tiles |= set((grids[:, 0] // 4).tolist())
    assert len(tiles) > 1, tiles  # the photos' shapes give more than one arrangement
    digests = [batch.digest() for batch in batches]
    for runner, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, runner


def test_the_memory_budget_holds_each_decoded_image_at_its_fixed_size(tmp_path):
    """Every image decodes to `size` whatever its source: the budget's decoded images are that
    many RGB bytes each, twice as many for twice the area."""
    from zephon._memory import memory_budget

    root = write_mixed_corpus(tmp_path)

    def images_budget(size: tuple[int, int]) -> int:
        with _photos_pipeline(root, "inline", size).shard(0, 1) as loader:
            return memory_budget(loader).images

    small, large = images_budget((112, 168)), images_budget((224, 168))
    assert small > 0 and large == 2 * small
    assert small % (3 * 112 * 168) == 0
    with _tiled_pipeline(root, "inline").shard(0, 1) as loader:  # at most 4 tiles and a thumbnail of 56x56
        assert memory_budget(loader).images == small // (112 * 168) * 5 * 56 * 56


# -- into the model ------------------------------------------------------------------------------

def _microbatch(placeholders, spec: ImageSpec, documents: list[dict], length: int, **packing) -> dict:
    """`documents` packed into one row of `length` tokens (`packing`: the packer's other settings),
    as a microbatch of one row of torch tensors (token fields int64, as `to_training()` gives them;
    ragged fields as they are, each beside its `<name>_counts`)."""
    import torch

    packer = MultimodalPacker(None, max_length=length, placeholders=placeholders, spec=spec, pad_id=0, **packing)
    rows = [row for i, record in enumerate(documents) for row in packer.push((_address(i), record))]
    [row] = rows + packer.flush()
    counts = {f"{name}_counts": torch.tensor([len(array)]) for name, array in row.ragged.items()}
    return {**{name: torch.from_numpy(np.ascontiguousarray(array))[None].long() if name in row.tokens
               else torch.from_numpy(array) for name, array in {**row.tokens, **row.ragged}.items()}, **counts}


@requires_torch
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_tiny_gemma3_gives_each_packed_document_what_it_gives_the_document_alone(attention):
    """Rows of documents laid out unlike each other (a picture then its caption; text alone; a
    caption, then a picture, then more text), through `gemma3_model_inputs` into a tiny randomly
    initialised `Gemma3ForConditionalGeneration`: every document's logits are those the model
    gives it alone, as its processor would give it (`token_type_ids`, no packing), image tokens
    attending to each other both ways and the sliding window as the model's. Padding stays finite."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from vlm import gemma3_model_inputs

    config = Gemma3Config(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=100, eoi_token_index=101, image_token_index=102,
        attn_implementation=attention)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    spec = ImageSpec(patch_size=14, merge_size=2, fit="fixed", size=(56, 56))
    placeholders = PadPlaceholders(102, start=100, end=101, merge_size=2, text_before=(7,), text_after=(7,))
    rng = np.random.default_rng(1)

    def text(n: int) -> np.ndarray:
        return rng.integers(10, 90, n).astype(np.int32)

    def picture() -> np.ndarray:
        return rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)

    records = [{"input_ids": text(5), "pixels": picture()}, {"input_ids": text(9)},
               {"input_ids": text(8), "pixels": picture(), "image_offsets": [3]}]

    def microbatch(documents: list[dict], length: int) -> dict:
        return _microbatch(placeholders, spec, documents, length)

    def logits(**inputs) -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, use_cache=False).logits[0]

    batch = microbatch(records, 64)
    packed = logits(**gemma3_model_inputs(batch, image_token_id=102, sliding_window=6, attn_implementation=attention))
    assert torch.isfinite(packed).all()
    documents = batch["document_ids"][0]
    for number, record in enumerate(records):
        alone = microbatch([record], int((documents == number).sum()))
        inputs = {"input_ids": alone["input_ids"], "token_type_ids": (alone["input_ids"] == 102).long()}
        if "pixels" in record:
            inputs["pixel_values"] = torch.from_numpy(image_tensors(alone["pixel_values"].numpy(),
                                                                    alone["image_grid"].numpy(),
                                                                    mean=(0.5,) * 3, std=(0.5,) * 3))
        torch.testing.assert_close(packed[documents == number], logits(**inputs), rtol=0, atol=1e-5,
                                   msg=lambda m: f"document {number}: {m}")


@requires_torch
def test_a_tiny_internvl_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a picture of 4 tiles and a thumbnail then its caption, text alone, and text around
    a one-tile picture, given to a tiny randomly initialised `InternVLForConditionalGeneration` as
    vlm/README.md shows (`input_ids`, the rows' `position_ids`, no attention mask, the tiles by
    `image_tensors(..., tile=)`): every document's logits are the document's alone. Its text
    model masks each document from the one before it where the positions restart."""
    import torch
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    config = InternVLConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=[56, 56], patch_size=[14, 14]),
        text_config=dict(model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
        image_token_id=102, downsample_ratio=0.5)
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config).eval()
    spec = ImageSpec.internvl(size=(56, 56), tiles=(1, 4))
    placeholders = PadPlaceholders(102, start=100, end=101, merge_size=2)
    rng = np.random.default_rng(2)
    records = [{"input_ids": rng.integers(10, 90, 5).astype(np.int32),
                "pixels": decode_image(_png(rng.integers(0, 256, (60, 250, 3), dtype=np.uint8)), spec)},
               {"input_ids": rng.integers(10, 90, 9).astype(np.int32)},
               {"input_ids": rng.integers(10, 90, 6).astype(np.int32), "image_offsets": [2],
                "pixels": decode_image(_png(rng.integers(0, 256, (50, 50, 3), dtype=np.uint8)), spec)}]
    assert [len(record.get("pixels", ())) // 56 for record in records] == [5, 0, 1]

    assert_each_packed_document_is_its_own(
        model, placeholders, spec, records, 80,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=INTERNVL_MEAN,
                                                     std=INTERNVL_STD, tile=4)})


def assert_each_packed_document_is_its_own(model, placeholders, spec: ImageSpec, records: list[dict], length: int,
                                           image_inputs, **packing) -> None:
    """`records` packed into one row of `length` tokens (`packing`: the packer's other settings),
    given to `model` with the row's `position_ids` and no attention mask: every document's logits
    are those of the document packed alone (positions from 0, nothing before it).
    `image_inputs(microbatch)` is the forward's image arguments (`pixel_values`, ...) of a
    microbatch that has images or videos."""
    import torch

    def logits(batch: dict, positions: bool) -> torch.Tensor:
        inputs = {"input_ids": batch["input_ids"]}
        if positions:
            inputs["position_ids"] = batch["position_ids"]
        if len(batch["image_grid"]) or len(batch.get("video_grid", ())):
            inputs.update(image_inputs(batch))
        with torch.no_grad():
            return model(**inputs, use_cache=False).logits[0]

    batch = _microbatch(placeholders, spec, records, length, **packing)
    packed = logits(batch, positions=True)
    documents = batch["document_ids"][0]
    for number, record in enumerate(records):
        alone = _microbatch(placeholders, spec, [record], int((documents == number).sum()), **packing)
        torch.testing.assert_close(packed[documents == number], logits(alone, positions=False), rtol=0, atol=1e-5,
                                   msg=lambda m: f"document {number}: {m}")
