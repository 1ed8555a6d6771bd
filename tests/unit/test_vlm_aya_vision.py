"""Aya Vision's pictures: `ImageSpec.aya_vision()` (InternVL's tiles, 364 px, with their thumbnail)
with `AyaVisionPlaceholders` (`TILE_k` before each tile's run, `TILE_GLOBAL` before the
thumbnail's).

The oracles are transformers' own: `AyaVisionProcessor.replace_image_token`'s text, on a stub of
the processor holding its tokens and sizes, and a tiny randomly initialised
`AyaVisionForConditionalGeneration` for what the rows do in a model. The tiles themselves are
InternVL's (`GotOcr2ImageProcessorPil(crop_to_patches=True)`'s, checked in test_vlm_fixed_size.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_fixed_size import assert_each_packed_document_is_its_own
from tests.unit.test_vlm_mixed_media import TOKENIZER
from tests.unit.test_vlm_llama4 import packed_processor_text
from vlm import AyaVisionPlaceholders, ImageSpec, image_grid, image_tensors
from vlm._packing import MultimodalPacker
from zephon import ConfigurationError

SMALL = ImageSpec.aya_vision(size=(56, 56), tiles=(1, 6), draft=False)
"""Aya Vision's tiling at 56 px tiles (4x4 patches of 14 px, 4 `<|IMG_PATCH|>` a tile), 1 to 6
of them."""


TINY_COHERE2 = dict(model_type="cohere2", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=64,
                    layer_types=["sliding_attention", "full_attention"], eos_token_id=None)
"""A tiny Cohere2 text model's config (Aya Vision's and Command A Vision's language models)."""


def tiny_siglip(**sizes) -> dict:
    """A tiny SigLIP vision tower's config of the given `image_size` and `patch_size`."""
    return dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, **sizes)


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped tokenizer with Aya Vision's image tokens added as special tokens and its tile
    names as plain added tokens (no Aya Vision tokenizer ships offline)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>"], special_tokens=True)
    tokenizer.add_tokens(["TILE", "TILE_GLOBAL"])
    return tokenizer


def _processor_text(tiles: int, tile: int = 364) -> str:
    """`AyaVisionProcessor.replace_image_token`'s text for a picture of `tiles` tiles (its
    `num_patches`, the thumbnail among them) of `tile` px, on a stub holding what it reads (its
    constructor's defaults: 28 px merged patches)."""
    from transformers import AyaVisionProcessor

    stub = SimpleNamespace(img_size=tile, patch_size=28, start_of_img_token="<|START_OF_IMG|>",
                           end_of_img_token="<|END_OF_IMG|>", img_patch_token="<|IMG_PATCH|>", tile_token="TILE",
                           tile_global_token="TILE_GLOBAL")
    return AyaVisionProcessor.replace_image_token(stub, {"num_patches": [tiles]}, 0)


@pytest.mark.parametrize("tiles", [1, 2, 5, 13])
def test_the_placeholders_are_aya_vision_processor_s_text(tokenizer, tiles):
    """One tile alone, and 1, 4 and 12 tiles with their thumbnail: the ids are the tokenizer's
    encoding of the processor's text (169 `<|IMG_PATCH|>` a 364 px tile, the tiles' names)."""
    placeholders = AyaVisionPlaceholders.from_tokenizer(tokenizer)
    want = tokenizer(_processor_text(tiles), add_special_tokens=False)["input_ids"]
    assert placeholders.tokens_for(26 * tiles, 26).tolist() == want
    assert placeholders.num_tokens(26 * tiles, 26) == len(want)


def test_rows_are_the_processor_s_text_token_for_token(tokenizer):
    """A wide picture before its caption and a small one inside a caption, packed into one row:
    each document is the tokenizer's encoding of the processor's text where the picture goes,
    its tiles counted from the grid as the processor counts `num_patches`."""
    assert image_grid(90, 200, SMALL)[0] > 4 * 2  # tiles and a thumbnail
    packed_processor_text(tokenizer, AyaVisionPlaceholders.from_tokenizer(tokenizer), SMALL, [(90, 200), (40, 40)],
                          lambda picture: _processor_text(image_grid(*picture, SMALL)[0] // 4, 56))


def test_pictures_it_cannot_write_are_refused(tokenizer):
    """A sizing other than InternVL's tiles with their thumbnail, or more tiles than it names,
    is refused as the packer is made; a stack of more tiles than it names, as it is written."""
    placeholders = AyaVisionPlaceholders.from_tokenizer(tokenizer, max_tiles=4)
    for spec in (ImageSpec(patch_size=14, merge_size=2), ImageSpec.aya_vision(thumbnail=False), ImageSpec.aya_vision()):
        with pytest.raises(ConfigurationError, match="writes fit='tiles' pictures with their thumbnail, of at most 4"):
            MultimodalPacker(None, max_length=64, placeholders=placeholders, spec=spec, pad_id=0)
    with pytest.raises(ValueError, match="6 tiles"):
        placeholders.num_tokens(26 * 6, 26)
    with pytest.raises(ConfigurationError, match="holds a placeholder id"):
        AyaVisionPlaceholders(1, 2, 3, ((7,), (2,)), (8,))


@requires_torch
def test_a_tiny_aya_vision_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a wide picture then its caption, text alone, and text around a tall picture, given
    to a tiny randomly initialised `AyaVisionForConditionalGeneration` (SigLIP's 14 px patches,
    pixel-shuffled 2x2 to 4 tokens a 56 px tile) with the tiles by `image_tensors(..., tile=4)`:
    every document's logits are the document's alone, so the model takes every tile where its
    run is (it refuses a count unlike its features)."""
    import torch
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration

    from tests.unit.test_vlm_split import sized_record

    config = AyaVisionConfig(vision_config=tiny_siglip(image_size=56, patch_size=14), text_config=TINY_COHERE2,
                             image_token_index=103, downsample_factor=2, vision_feature_layer=-1)
    torch.manual_seed(0)
    model = AyaVisionForConditionalGeneration(config).eval()
    rng = np.random.default_rng(2)
    records = [sized_record(rng, SMALL, 5, (60, 200)), sized_record(rng, SMALL, 9),
               sized_record(rng, SMALL, 6, (190, 70), image_offsets=[2])]
    placeholders = AyaVisionPlaceholders(100, 103, 101, tuple((110 + k,) for k in range(6)), (120,))
    assert_each_packed_document_is_its_own(
        model, placeholders, SMALL, records, 200,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                                     std=(0.5,) * 3, tile=4)})
