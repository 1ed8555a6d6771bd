"""Placeholder counts equal what the model family's own reference code produces for that image.

Pixtral is checked against mistral-common's `ImageEncoder` with the real Tekken tokenizer's ids;
Qwen2-VL against transformers' `Qwen2VLImageProcessor` grid and its processor's expansion rule, and
Qwen3-VL against the same processor with Qwen3-VL's 16 px patches, and `ImageSpec.qwen3_vl()` against
that processor configured as the Qwen3-VL checkpoints configure it.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_vlm_assets import encode, gradient, package_dir
from vlm import (
    ImageSpec,
    PixtralPlaceholders,
    QwenPlaceholders,
    decode_image,
    image_grid,
    lookup_token_id,
)
from zephon._errors import ConfigurationError

IMAGE_SIZES = [(16, 16), (17, 15), (333, 500), (640, 480), (1024, 1024), (1025, 31), (3000, 2000), (50, 4000)]
"""(width, height): tiny, off-grid, ordinary photos, exactly the limit, just over, huge, extreme aspect."""


def _tekken_json() -> Path:
    root = package_dir("mistral_common")
    path = None if root is None else root / "data" / "tekken_240911.json"
    assert path is not None and path.is_file(), "mistral-common==1.13.1 must be installed (the test assets)"
    return path


@pytest.fixture(scope="module")
def pixtral_tokenizer(tmp_path_factory):
    """The real Pixtral Tekken tokenizer, loaded by transformers from a directory with tekken.json."""
    import transformers

    directory = tmp_path_factory.mktemp("tekken")
    shutil.copy(_tekken_json(), directory / "tekken.json")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _mistral_tokens(monkeypatch, width: int, height: int, *, patch: int, max_side: int, merge: int, ids) -> list[int]:
    """mistral-common's own token expansion for an image of this size.

    Its pixel transform needs OpenCV, which the expansion does not use; without OpenCV it is
    replaced by a stub so that the encoder's token logic runs unchanged.
    """
    import mistral_common.tokens.tokenizers.image as image_module
    from mistral_common.protocol.instruct.chunk import ImageChunk
    from PIL import Image

    if importlib_missing("cv2"):
        monkeypatch.setattr(image_module, "transform_image", lambda image, size: np.zeros((3, size[1], size[0])))
    encoder = image_module.ImageEncoder(
        image_module.ImageConfig(image_patch_size=patch, max_image_size=max_side, spatial_merge_size=merge),
        image_module.SpecialImageIDs(img=ids[0], img_break=ids[1], img_end=ids[2]),
    )
    return list(encoder(ImageChunk(image=Image.new("RGB", (width, height)))).tokens)


def importlib_missing(name: str) -> bool:
    return importlib.util.find_spec(name) is None


def test_pixtral_ids_come_from_the_real_tekken_tokenizer(pixtral_tokenizer):
    placeholders = PixtralPlaceholders.from_tokenizer(pixtral_tokenizer)
    assert (placeholders.img_id, placeholders.break_id, placeholders.end_id) == (10, 12, 13)


def test_pixtral_ids_also_come_from_mistral_commons_own_tokenizer():
    import mistral_common.tokens.tokenizers.tekken as tekken
    tokenizer = tekken.Tekkenizer.from_file(_tekken_json())
    assert PixtralPlaceholders.from_tokenizer(tokenizer) == PixtralPlaceholders(10, 12, 13)


@pytest.mark.parametrize("width,height", IMAGE_SIZES)
def test_pixtral_expansion_equals_mistral_commons_encoder(monkeypatch, pixtral_tokenizer, width, height):
    placeholders = PixtralPlaceholders.from_tokenizer(pixtral_tokenizer)
    ids = (placeholders.img_id, placeholders.break_id, placeholders.end_id)
    reference = _mistral_tokens(monkeypatch, width, height, patch=16, max_side=1024, merge=1, ids=ids)
    rows, cols = image_grid(height, width, ImageSpec.pixtral(max_side=1024))
    ours = placeholders.tokens_for(rows, cols)
    assert ours.dtype == np.int32
    assert ours.tolist() == reference
    assert placeholders.num_tokens(rows, cols) == len(reference)


@pytest.mark.parametrize("width,height", [(333, 500), (1025, 31), (3000, 2000)])
def test_pixtral_expansion_with_two_by_two_merging_equals_mistral_common(monkeypatch, width, height):
    placeholders = PixtralPlaceholders(10, 12, 13, merge_size=2)
    reference = _mistral_tokens(monkeypatch, width, height, patch=14, max_side=1540, merge=2, ids=(10, 12, 13))
    rows, cols = image_grid(height, width, ImageSpec.pixtral(max_side=1540, patch_size=14, merge_size=2))
    assert placeholders.tokens_for(rows, cols).tolist() == reference


def test_decoded_pixels_carry_the_grid_mistral_common_expects(monkeypatch, pixtral_tokenizer):
    """The whole path: bytes -> decode_image -> grid read off the array -> placeholders."""
    placeholders = PixtralPlaceholders.from_tokenizer(pixtral_tokenizer)
    spec = ImageSpec.pixtral(max_side=256)
    for height, width in [(96, 160), (250, 60), (400, 300)]:
        pixels = decode_image(encode(gradient(height, width), "PNG"), spec)
        rows, cols = pixels.shape[0] // spec.patch_size, pixels.shape[1] // spec.patch_size
        reference = _mistral_tokens(monkeypatch, width, height, patch=16, max_side=256, merge=1, ids=(10, 12, 13))
        assert placeholders.tokens_for(rows, cols).tolist() == reference


def test_pixtral_rows_end_in_break_and_the_last_in_end():
    tokens = PixtralPlaceholders(10, 12, 13).tokens_for(2, 3)
    assert tokens.tolist() == [10, 10, 10, 12, 10, 10, 10, 13]


def test_qwen_expansion_wraps_one_pad_per_merged_cell():
    tokens = QwenPlaceholders(1, 2, 3, merge_size=2).tokens_for(4, 6)
    assert tokens.tolist() == [1] + [2] * 6 + [3]


@pytest.mark.parametrize("patch_size", [14, 16], ids=["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("width,height", IMAGE_SIZES[2:6] + [(40, 30), (5000, 4000)])
def test_qwen_grid_and_count_equal_the_transformers_processor_of_qwen2_vl_and_qwen3_vl(width, height, patch_size):
    """Qwen3-VL's image processor is Qwen2-VL's with 16 px patches (transformers maps `qwen3_vl` to
    `Qwen2VLImageProcessor`): 32 px cells, which `ImageSpec(patch_size=16, merge_size=2)` gives."""
    import transformers

    processor_class = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    cell = 2 * patch_size
    processor = processor_class(patch_size=patch_size, merge_size=2, min_pixels=2 * cell * 2 * cell,
                                max_pixels=cell * cell * 256)
    out = processor(images=np.zeros((height, width, 3), np.uint8), return_tensors="np")
    t, h, w = out["image_grid_thw"][0].tolist()
    spec = ImageSpec(patch_size=patch_size, merge_size=2, min_pixels=2 * cell * 2 * cell, max_pixels=cell * cell * 256)
    assert (t, *image_grid(height, width, spec)) == (1, h, w)
    assert out["pixel_values"].shape == (h * w, 3 * 2 * patch_size * patch_size), "the patch size was taken"
    placeholders = QwenPlaceholders(151652, 151655, 151653, merge_size=processor.merge_size)
    # Qwen2VLProcessor.replace_image_token: image_grid_thw.prod() // merge_size**2 pads.
    assert placeholders.num_tokens(h, w) - 2 == t * h * w // processor.merge_size**2


QWEN3_VL_PREPROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                         "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
"""The image settings of the Qwen/Qwen3-VL checkpoints' `preprocessor_config.json`, which transformers
loads into `Qwen2VLImageProcessor` (its own class defaults being Qwen2-VL's)."""


def test_qwen3_vl_preset_and_checkpoint_settings_have_the_sizes_of_transformers_qwen3_vl_vision_config():
    """The preset's sizes, and those of the checkpoint settings the grid test builds its processor
    from, against transformers' code."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    vision, spec = Qwen3VLVisionConfig(), ImageSpec.qwen3_vl()
    assert (spec.patch_size, spec.merge_size) == (vision.patch_size, vision.spatial_merge_size)
    checkpoint = (QWEN3_VL_PREPROCESSOR["patch_size"], QWEN3_VL_PREPROCESSOR["merge_size"],
                  QWEN3_VL_PREPROCESSOR["temporal_patch_size"])
    assert checkpoint == (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)


@pytest.mark.requires_torch  # transformers' video processors import torch
def test_qwen3_vl_checkpoint_settings_normalise_as_transformers_qwen3_vl_video_processor():
    """The settings the grid test builds its processor from, against transformers' code."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    names = ("image_mean", "image_std", "patch_size", "merge_size", "temporal_patch_size")
    assert {name: QWEN3_VL_PREPROCESSOR[name] for name in names} == {
        name: getattr(Qwen3VLVideoProcessor, name) for name in names
    }


@pytest.mark.parametrize("width,height", IMAGE_SIZES + [(40, 30), (200, 100), (4096, 4096), (5000, 4000)])
def test_qwen3_vl_preset_gives_the_grid_and_count_of_the_processor_as_qwen3_vl_configures_it(width, height):
    """Above 4096·4096 pixels the grid shrinks, below 256·256 it grows, as the processor's does."""
    import transformers

    processor_class = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    processor = processor_class(**QWEN3_VL_PREPROCESSOR)
    out = processor(images=np.zeros((height, width, 3), np.uint8), return_tensors="np")
    t, h, w = out["image_grid_thw"][0].tolist()
    spec = ImageSpec.qwen3_vl()
    assert (spec.patch_size, spec.merge_size) == (processor.patch_size, processor.merge_size)
    assert (t, *image_grid(height, width, spec)) == (1, h, w)
    assert out["pixel_values"].shape == (h * w, processor.temporal_patch_size * spec.patch_dim)
    pads = QwenPlaceholders(1, 2, 3, merge_size=spec.merge_size).num_tokens(h, w) - 2
    assert pads == h * w // processor.merge_size**2  # Qwen3VLProcessor.replace_image_token's count


def test_qwen_ids_are_looked_up_by_string_in_a_tokenizers_vocabulary():
    import tokenizers
    vocab = {"[UNK]": 0, "hello": 1, "<|vision_start|>": 7, "<|image_pad|>": 8, "<|vision_end|>": 9}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    assert QwenPlaceholders.from_tokenizer(tokenizer) == QwenPlaceholders(7, 8, 9, merge_size=2)
    with pytest.raises(ConfigurationError, match=r"\[IMG\]"):
        PixtralPlaceholders.from_tokenizer(tokenizer)


def test_placeholder_ids_are_looked_up_in_the_tokenizer_a_recipe_names_as_tokenize_does(tmp_path):
    """`tokenize` takes a tokenizer.json's path (or its directory); `from_tokenizer` given the same
    path failed with "cannot look up token ids in a str"."""
    import tokenizers
    vocab = {"[UNK]": 0, "hello": 1, "<|vision_start|>": 7, "<|image_pad|>": 8, "<|vision_end|>": 9}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    for named in (str(tmp_path / "tokenizer.json"), tmp_path / "tokenizer.json", str(tmp_path)):
        assert QwenPlaceholders.from_tokenizer(named) == QwenPlaceholders(7, 8, 9, merge_size=2)


def test_missing_special_token_is_named_for_a_transformers_tokenizer(pixtral_tokenizer):
    with pytest.raises(ConfigurationError, match="vision_start"):
        lookup_token_id(pixtral_tokenizer, "<|vision_start|>")


@pytest.mark.parametrize("grid", [(3, 4), (4, 3), (0, 2)])
def test_grid_that_is_not_whole_merged_cells_is_refused(grid):
    with pytest.raises(ValueError):
        QwenPlaceholders(1, 2, 3, merge_size=2).tokens_for(*grid)


def test_cached_expansions_are_read_only():
    tokens = PixtralPlaceholders(10, 12, 13).tokens_for(2, 2)
    with pytest.raises(ValueError):
        tokens[0] = 0


def test_placeholder_ids_may_be_numpy_integers_and_are_kept_as_ints():
    placeholders = PixtralPlaceholders(np.int64(10), np.int32(12), 13)
    assert (type(placeholders.img_id), placeholders.tokens_for(1, 1).tolist()) == (int, [10, 13])


@pytest.mark.parametrize("ids", [(-1, 12, 13), (10.0, 12, 13), (10, 2**31, 13), (True, 12, 13)])
def test_placeholder_ids_must_be_token_ids(ids):
    """A negative, fractional or too large id would be written into input_ids as it is."""
    with pytest.raises(ConfigurationError, match="token id"):
        PixtralPlaceholders(*ids)
    with pytest.raises(ConfigurationError, match="token id"):
        QwenPlaceholders(*ids)


@pytest.mark.parametrize("ids", [(10, 10, 10), (10, 10, 13), (10, 12, 10), (10, 12, 12)])
def test_placeholder_ids_that_collide_are_a_configuration_error(ids):
    """`PixtralPlaceholders(10, 10, 10)` was accepted: the model finds an image's slots by its
    image id, so a row break or an end sharing that id is taken for one more slot than there are
    patches (and a start sharing Qwen's pad id likewise); a break sharing the end's id leaves the
    model unable to tell a row's end from the image's. Nothing after the packer can tell them apart."""
    with pytest.raises(ConfigurationError, match="distinct"):
        PixtralPlaceholders(*ids)
    with pytest.raises(ConfigurationError, match="distinct"):
        QwenPlaceholders(*ids, merge_size=1)
