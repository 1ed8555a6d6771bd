"""Command A Vision's pictures: `ImageSpec.command_a_vision()` (tiles of 512 px in the arrangement
that scales the picture least, `tile_rule="least_scale"`, and the thumbnail) with
`Cohere2VisionPlaceholders` (each tile's run ended by a line break).

The oracles are transformers' own: `Cohere2VisionImageProcessor`'s `get_optimal_tiled_canvas`,
compiled from its module's source (the module imports torchvision, which the test environment
lacks, while the function needs NumPy alone), `Cohere2VisionProcessor.replace_image_token`'s text
on a stub of the processor, and a tiny randomly initialised `Cohere2VisionForConditionalGeneration`
for what the rows do in a model. The tiles are cut as InternVL's are (test_vlm_fixed_size.py).
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_aya_vision import TINY_COHERE2, tiny_siglip
from tests.unit.test_vlm_fixed_size import assert_each_packed_document_is_its_own
from tests.unit.test_vlm_llama4 import packed_processor_text
from tests.unit.test_vlm_mixed_media import TOKENIZER
from tests.unit.test_vlm_split import sized_record
from vlm import Cohere2VisionPlaceholders, ImageSpec, image_grid, image_tensors
from vlm._image import tile_arrangement
from vlm._packing import MultimodalPacker
from zephon import ConfigurationError

SMALL = ImageSpec.command_a_vision(size=(64, 64), tiles=(1, 6), draft=False)
"""Command A Vision's rule at an eighth of its tile, 1 to 6 tiles of 64 px (4x4 patches of 16 px,
4 image tokens a tile)."""

COHERE2_TOKENS = {"boi_token": "<|START_OF_IMG|>", "image_token": "<|IMG_PATCH|>",
                  "img_line_break_token": "<|IMG_LINE_BREAK|>", "eoi_token": "<|END_OF_IMG|>"}
"""Names for Command A Vision's four image tokens in the test tokenizer (no Command A Vision
tokenizer ships offline); the processor and the placeholders read them from the tokenizer alike."""


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped tokenizer with Command A Vision's image tokens added as special tokens and named
    as its tokenizer names them."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(list(COHERE2_TOKENS.values()), special_tokens=True)
    for name, token in COHERE2_TOKENS.items():
        setattr(tokenizer, name, token)
    return tokenizer


@cache
def _optimal_tiled_canvas():
    """`Cohere2VisionImageProcessor`'s module functions that choose the arrangement, compiled from
    its source."""
    import ast
    import importlib.util
    from functools import lru_cache

    path = importlib.util.find_spec("transformers.models.cohere2_vision").submodule_search_locations[0]
    source = open(f"{path}/image_processing_cohere2_vision.py", encoding="utf-8").read()
    wanted = {"get_all_supported_aspect_ratios", "get_optimal_tiled_canvas"}
    functions = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace = {"np": np, "lru_cache": lru_cache}
    exec(compile(ast.Module(functions, []), path, "exec"), namespace)  # noqa: S102 - transformers' own source
    return namespace["get_optimal_tiled_canvas"]


@pytest.mark.parametrize("tile, tiles", [(512, 12), (512, 4), (64, 6)])
def test_the_arrangement_is_command_a_vision_s_for_every_size(tile, tiles):
    """For 400 random sizes and the edges (strips one pixel thick, squares, exactly a canvas), the
    (columns, rows) equal the processor's; the grid stacks them and, past one tile, the thumbnail."""
    spec = ImageSpec.command_a_vision(size=(tile, tile), tiles=(1, tiles))
    rng = np.random.default_rng(19)
    sizes = [tuple(int(n) for n in pair) for pair in rng.integers(1, 6000, (400, 2))] + [
        (1, 1), (1, 6000), (6000, 1), (tile, tile), (tile, 2 * tile), (100, 100), (3, 4000)]
    for height, width in sizes:
        columns, rows = (int(n) for n in _optimal_tiled_canvas()((height, width), (tile, tile), 1, tiles))
        assert tile_arrangement(height, width, spec) == (columns, rows), (height, width)
        count = columns * rows
        assert image_grid(height, width, spec) == ((count + (count > 1)) * tile // 16, tile // 16)


def _processor_text(tiles: int, tile: int = 512) -> str:
    """`Cohere2VisionProcessor.replace_image_token`'s text for a picture of `tiles` tiles (its
    `num_patches`, the thumbnail among them) of `tile` px, on a stub holding what it reads."""
    from transformers import Cohere2VisionProcessor

    stub = SimpleNamespace(patch_size=tile // 32, boi_token=COHERE2_TOKENS["boi_token"],
                           eoi_token=COHERE2_TOKENS["eoi_token"], image_token=COHERE2_TOKENS["image_token"],
                           img_line_break_token=COHERE2_TOKENS["img_line_break_token"])
    return Cohere2VisionProcessor.replace_image_token(stub, {"num_patches": [tiles]}, 0)


@pytest.mark.parametrize("tiles", [1, 3, 13])
def test_the_placeholders_are_command_a_vision_processor_s_text(tokenizer, tiles):
    """One tile alone, and 2 and 12 tiles with their thumbnail: the ids are the tokenizer's
    encoding of the processor's text (256 image tokens a 512 px tile, each run's line break)."""
    placeholders = Cohere2VisionPlaceholders.from_tokenizer(tokenizer)
    want = tokenizer(_processor_text(tiles), add_special_tokens=False)["input_ids"]
    assert placeholders.tokens_for(32 * tiles, 32).tolist() == want
    assert placeholders.num_tokens(32 * tiles, 32) == len(want)


def test_rows_are_the_processor_s_text_token_for_token(tokenizer):
    """A wide picture before its caption and a small one inside a caption, packed into one row:
    each document is the tokenizer's encoding of the processor's text where the picture goes."""
    assert image_grid(90, 200, SMALL)[0] > 4 * 2  # tiles and a thumbnail
    packed_processor_text(tokenizer, Cohere2VisionPlaceholders.from_tokenizer(tokenizer), SMALL, [(90, 200), (40, 40)],
                          lambda picture: _processor_text(image_grid(*picture, SMALL)[0] // 4, 64))


def test_what_it_cannot_write_is_refused(tokenizer):
    """A tokenizer that names none of its tokens, a sizing other than tiles with their thumbnail,
    and a rule of tiles that is neither InternVL's nor Command A Vision's."""
    with pytest.raises(ConfigurationError, match="names no boi_token, image_token"):
        Cohere2VisionPlaceholders.from_tokenizer(SimpleNamespace())
    placeholders = Cohere2VisionPlaceholders.from_tokenizer(tokenizer)
    for spec in (ImageSpec(patch_size=16, merge_size=2), ImageSpec.command_a_vision(thumbnail=False)):
        with pytest.raises(ConfigurationError, match="writes fit='tiles' pictures with their thumbnail"):
            MultimodalPacker(None, max_length=64, placeholders=placeholders, spec=spec, pad_id=0)
    with pytest.raises(ConfigurationError, match="tile_rule must be None"):
        ImageSpec.command_a_vision(tile_rule="widest")
    with pytest.raises(ConfigurationError, match="tile_rule are fit='tiles''s"):
        ImageSpec(tile_rule="least_scale")


@requires_torch
def test_a_tiny_command_a_vision_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a wide picture then its caption, text alone, and text around a tall picture, given
    to a tiny randomly initialised `Cohere2VisionForConditionalGeneration` (16 px patches,
    pixel-shuffled 2x2 to 4 tokens a 64 px tile) with the tiles by `image_tensors(..., tile=4)`:
    every document's logits are the document's alone, so the model takes every tile where its run
    is (it refuses a count unlike its features)."""
    import torch
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    config = Cohere2VisionConfig(vision_config=tiny_siglip(image_size=64, patch_size=16), text_config=TINY_COHERE2,
                                 image_token_id=101, downsample_factor=2, alignment_intermediate_size=64)
    torch.manual_seed(0)
    model = Cohere2VisionForConditionalGeneration(config).eval()
    rng = np.random.default_rng(2)
    records = [sized_record(rng, SMALL, 5, (60, 200)), sized_record(rng, SMALL, 9),
               sized_record(rng, SMALL, 6, (190, 70), image_offsets=[2])]
    assert_each_packed_document_is_its_own(
        model, Cohere2VisionPlaceholders(100, 101, 102, 103), SMALL, records, 200,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                                     std=(0.5,) * 3, tile=4)})
