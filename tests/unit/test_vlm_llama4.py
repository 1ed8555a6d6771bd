"""Llama 4's pictures: `ImageSpec.llama4()` (`fit="canvas"`: fitted, its aspect ratio kept, into
the canvas of 336 px tiles that scales it least, padded at its bottom and right, the tiles and the
global tile) with `Llama4Placeholders`.

The oracles are transformers' own: `Llama4ImageProcessor`'s sizing functions and the lines of its
`_preprocess` that use them, compiled from its source (the module imports torchvision, which the
test environment lacks, while these need torch alone); `split_to_tiles` for the tiles' order;
`Llama4Processor`'s text; and a tiny randomly initialised `Llama4ForConditionalGeneration` for
what the rows do in a model.
"""

from __future__ import annotations

from functools import cache, partial
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tests.conftest import requires_torch
from tests.unit.test_vlm_fixed_size import assert_each_packed_document_is_its_own
from tests.unit.test_vlm_mixed_media import TOKENIZER, _epoch, mixed_source
from tests.unit.test_vlm_qwen_video import corpus  # noqa: F401 - the photos-and-clips corpus fixture
from tests.unit.test_vlm_split import _address, _png, sized_record
from vlm import ImageSpec, Llama4Placeholders, decode_image_with_size, image_grid, image_tensors
from vlm._image import canvas_arrangement
from vlm._packing import MultimodalPacker
from zephon import ConfigurationError, Pipeline

SMALL = ImageSpec.llama4(size=(56, 56), tiles=(1, 6), draft=False)
"""Llama 4's rule at a sixth of its tile, 1 to 6 tiles of 56 px (4x4 patches of 14 px, 4
`<|patch|>` a tile); `draft=False` resizes from the full decode."""

LLAMA4_TOKENS = ("<|image_start|>", "<|image|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>",
                 "<|tile_y_separator|>")


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped tokenizer with Llama 4's image tokens added as special tokens (no Llama 4
    tokenizer ships offline)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(list(LLAMA4_TOKENS), special_tokens=True)
    return tokenizer


@cache
def _processor_sizing():
    """(namespace, code): `Llama4ImageProcessor`'s module functions that choose the canvas and
    the fitted size, and the lines of its `_preprocess` from `get_best_fit` to
    `get_max_res_without_distortion`, compiled from the module's source."""
    import ast
    import importlib.util
    import math
    import textwrap
    from collections import defaultdict
    from functools import lru_cache

    import torch

    path = importlib.util.find_spec("transformers.models.llama4").submodule_search_locations[0]
    source = open(f"{path}/image_processing_llama4.py", encoding="utf-8").read()
    wanted = {"get_factors", "get_max_res_without_distortion", "find_supported_resolutions", "get_best_fit"}
    functions = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace = {"torch": torch, "math": math, "defaultdict": defaultdict, "lru_cache": lru_cache, "SizeDict": object}
    exec(compile(ast.Module(functions, []), path, "exec"), namespace)  # noqa: S102 - transformers' own source
    lines = source.splitlines()
    first = next(i for i, line in enumerate(lines) if "target_size = get_best_fit(image_size" in line)
    last = next(i for i, line in enumerate(lines) if "= get_max_res_without_distortion(image_size" in line)
    return namespace, compile(textwrap.dedent("\n".join(lines[first : last + 1])), path, "exec")


def _processor_canvas(height: int, width: int, tile: int, max_tiles: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the canvas, the fitted size) the processor takes for a picture of this size."""
    import torch

    namespace, code = _processor_sizing()
    size = SimpleNamespace(height=tile, width=tile)
    resolutions = torch.tensor(namespace["find_supported_resolutions"].__wrapped__(max_tiles, size))
    local = {**namespace, "image_size": (height, width), "possible_resolutions": resolutions,
             "resize_to_max_canvas": False, "size": size}
    exec(code, local)  # noqa: S102 - transformers' own source
    canvas, fitted = local["target_size"], local["new_size_without_distortion"]
    return (int(canvas[0]), int(canvas[1])), (max(int(fitted[0]), 1), max(int(fitted[1]), 1))


# -- sizing --------------------------------------------------------------------------------------

@requires_torch
@pytest.mark.parametrize("tile, max_tiles", [(336, 16), (336, 4), (56, 6)])
def test_the_canvas_and_the_fitted_size_are_llama4_s_for_every_size(tile, max_tiles):
    """For 400 random sizes and the edges (strips one pixel thick, squares, a picture of exactly a
    tile and one a pixel off), the canvas and the size the picture is resized to equal the
    processor's, float32 steps and all; the grid stacks the canvas's tiles and, past one, the
    global tile."""
    from vlm._canvas import best_canvas, canvas_fitted_size

    spec = ImageSpec.llama4(size=(tile, tile), tiles=(1, max_tiles))
    rng = np.random.default_rng(17)
    sizes = [tuple(int(n) for n in pair) for pair in rng.integers(1, 6000, (400, 2))] + [
        (1, 1), (1, 6000), (6000, 1), (tile, tile), (tile + 1, tile - 1), (2 * tile, tile), (100, 100), (3, 4000)]
    for height, width in sizes:
        canvas, fitted = _processor_canvas(height, width, tile, max_tiles)
        assert (best_canvas(height, width, tile, max_tiles), canvas_fitted_size(height, width, tile, max_tiles)) == (
            canvas, fitted), (height, width)
        tiles = canvas[0] // tile * (canvas[1] // tile)
        assert image_grid(height, width, spec) == ((tiles + (tiles > 1)) * tile // 14, tile // 14)


@requires_torch
@pytest.mark.parametrize("picture", [(90, 160), (160, 90), (30, 40), (56, 56), (200, 60)])
def test_the_pixels_are_the_fitted_picture_on_its_canvas_cut_as_the_processor_cuts_it(picture):
    """A picture decoded with `fit="canvas"` is, tile for tile, `split_to_tiles` of its canvas:
    the picture resized to the processor's fitted size at the top left, black elsewhere; then,
    past one tile, the picture resized to one tile. The size as shown comes back beside it."""
    import torch
    from transformers.image_transforms import split_to_tiles

    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (*picture, 3), dtype=np.uint8)
    decoded = decode_image_with_size(_png(pixels), SMALL)
    canvas_size, (height, width) = _processor_canvas(*picture, 56, 6)
    resized = np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.BILINEAR))
    canvas = np.zeros((*canvas_size, 3), np.uint8)
    canvas[:height, :width] = resized
    rows, columns = canvas_size[0] // 56, canvas_size[1] // 56
    tiles = split_to_tiles(torch.from_numpy(canvas).permute(2, 0, 1)[None], rows, columns)[0]
    want = [tile.permute(1, 2, 0).numpy() for tile in tiles]
    if rows * columns > 1:
        want.append(np.asarray(Image.fromarray(pixels).resize((56, 56), Image.Resampling.BILINEAR)))
    np.testing.assert_array_equal(decoded.pixels, np.concatenate(want))
    assert decoded.size == picture and canvas_arrangement(*picture, SMALL) == (rows, columns)


# -- tokens --------------------------------------------------------------------------------------

def _processor_text(arrangement: tuple[int, int], tile: int) -> str:
    """`Llama4Processor.replace_image_token`'s text for a picture of `arrangement` tiles of `tile`
    px, on a stub holding what it reads (its 14 px patches, pixel-shuffled 2x2)."""
    from transformers import Llama4Processor

    stub = SimpleNamespace(patch_size=14, downsample_ratio=4)
    stub._prompt_split_image = partial(Llama4Processor._prompt_split_image, stub)
    inputs = {"pixel_values": np.zeros((1, 3, tile, tile), np.float32), "aspect_ratios": [arrangement]}
    return Llama4Processor.replace_image_token(stub, inputs, 0)


@pytest.mark.parametrize("arrangement", [(1, 1), (1, 2), (2, 1), (2, 3), (4, 4), (1, 16)])
def test_the_placeholders_are_llama4_processor_s_text(tokenizer, arrangement):
    """For one tile and canvases of several rows and columns, the ids are the tokenizer's encoding
    of the processor's text (144 `<|patch|>` a 336 px tile, the separators, the global tile)."""
    placeholders = Llama4Placeholders.from_tokenizer(tokenizer)
    count = arrangement[0] * arrangement[1]
    rows = 24 * (count + (count > 1))
    want = tokenizer(_processor_text(arrangement, 336), add_special_tokens=False)["input_ids"]
    assert placeholders.tokens_for(rows, 24, arrangement).tolist() == want
    assert placeholders.num_tokens(rows, 24, arrangement) == len(want)


def packed_processor_text(tokenizer, placeholders, spec: ImageSpec, pictures, block_text):
    """A picture of `pictures[0]` (height, width) before its caption and one of `pictures[1]`
    inside a caption, decoded with `spec` and packed into one row: asserts each document is the
    tokenizer's encoding of the processor's text, `block_text(picture)` where the picture goes;
    returns the row."""
    rng = np.random.default_rng(4)

    def ids(text: str) -> np.ndarray:
        return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)

    pieces = [("", " a wide photo"), ("left", " then right")]
    records = []
    for (before, after), picture in zip(pieces, pictures):
        decoded = decode_image_with_size(_png(rng.integers(0, 256, (*picture, 3), dtype=np.uint8)), spec)
        records.append({"input_ids": np.concatenate([ids(before), ids(after)]), "pixels": decoded.pixels,
                        "pixels_sizes": np.array([decoded.size]), "image_offsets": [len(ids(before))]})
    packer = MultimodalPacker(None, max_length=200, placeholders=placeholders, spec=spec, pad_id=0)
    assert [row for i, record in enumerate(records) for row in packer.push((_address(i), record))] == []
    [row] = packer.flush()
    documents = row.tokens["document_ids"]
    for number, ((before, after), picture) in enumerate(zip(pieces, pictures)):
        text = before + block_text(picture) + after
        assert row.tokens["input_ids"][documents == number].tolist() == ids(text).tolist(), number
    return row


def test_rows_are_the_processor_s_text_and_carry_no_size(tokenizer):
    """A picture cut 2x3 before its caption and text around a picture of one tile, packed into
    one row: each document is the tokenizer's encoding of the processor's text where the picture
    goes, and the row carries no size field (the model reads the tiles alone)."""
    assert canvas_arrangement(90, 160, SMALL) == (2, 3) and canvas_arrangement(40, 40, SMALL) == (1, 1)
    row = packed_processor_text(tokenizer, Llama4Placeholders.from_tokenizer(tokenizer), SMALL, [(90, 160), (40, 40)],
                                lambda picture: _processor_text(canvas_arrangement(*picture, SMALL), 56))
    assert "image_sizes" not in row.ragged


def test_the_memory_budget_holds_the_largest_canvas_and_the_global_tile():
    """An image decodes to at most 16 tiles of 336 px and the global tile: the budget's bound, and
    the pixels of a picture whose canvas is 16 tiles."""
    spec = ImageSpec.llama4()
    assert spec.max_decoded_pixels == 17 * 336 * 336
    rows, cols = image_grid(336 * 4, 336 * 4, spec)
    assert rows * cols * 14 * 14 == spec.max_decoded_pixels


def test_what_cannot_be_written_as_llama4_s_is_refused():
    """A canvas from more than one tile or without its global tile, a non-square tile, and a
    stack that is not the tiles its arrangement says."""
    for kwargs, words in (({"tiles": (2, 16)}, "from one tile"), ({"thumbnail": False}, "from one tile"),
                          ({"size": (336, 672)}, "square tiles")):
        with pytest.raises(ConfigurationError, match=words):
            ImageSpec.llama4(**kwargs)
    placeholders = Llama4Placeholders(1, 2, 3, 4, 5, 6)
    with pytest.raises(ValueError, match="not 2x3 square tiles of 24x24 patches and their global tile"):
        placeholders.num_tokens(24 * 6, 24, (2, 3))
    with pytest.raises(ConfigurationError, match=r"counts the tokens of fit='canvas' images \(ImageSpec.llama4\(\)\)"):
        MultimodalPacker(None, max_length=64, placeholders=placeholders, spec=ImageSpec.llava_next(), pad_id=0)


# -- through the pipeline ------------------------------------------------------------------------

def _llama4_pipeline(root, runner: str, *, defer: bool) -> Pipeline:
    """`test_vlm_mixed_media`'s photos on Llama 4's canvases (at 56 px tiles), its clips' and
    notes' captions as text, in rows of 256."""
    return (Pipeline(mixed_source(root)).options(num_lanes=4, runner=runner, flush_every_chunks=2)
            .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>", parallelism=2)
            .decode_images(field="jpg", spec=SMALL, datasets="photos", defer=defer, parallelism=2)
            .pack_multimodal(256, Llama4Placeholders(3, 4, 5, 6, 7, 8))
            .shuffle(buffer_size=3, seed=2)
            .batch(2))


def test_photos_on_llama4_s_canvases_are_the_same_bytes_on_every_runner_decoded_early_or_late(corpus):  # noqa: F811
    """The batches' SHA-256s are the same from separately built pipelines on the inline, thread
    and process runners, and with the photos decoded after packing (`defer=True`: the packer
    counts each picture's tiles from its header's size)."""
    runs = {(runner, defer): _epoch(_llama4_pipeline(corpus, runner, defer=defer))
            for runner in ("inline", "thread", "process") for defer in (False, True)}
    batches, stats = runs[("inline", False)]
    assert stats["mixture"]["photos"]["images"] > 0
    assert any((batch.tokens["input_ids"] == 7).any() for batch in batches)  # canvases of several tiles
    digests = [batch.digest() for batch in batches]
    for settings, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, settings


# -- into the model ------------------------------------------------------------------------------

@requires_torch
def test_a_tiny_llama4_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a wide picture then its caption, text alone, and text around a tall picture, given
    to a tiny randomly initialised `Llama4ForConditionalGeneration` (56 px tiles of 14 px patches,
    pixel-shuffled to 4 tokens a tile) with the tiles by `image_tensors(..., tile=4)`: every
    document's logits are the document's alone, so the model takes every tile where its
    `<|patch|>` run is (it refuses a count unlike its features)."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    config = Llama4Config(
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=32,
                           projector_output_dim=32, vision_output_dim=32),
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_local_experts=2, num_experts_per_tok=1),
        image_token_index=104)
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(config).eval()
    rng = np.random.default_rng(2)
    records = [sized_record(rng, SMALL, 5, (60, 200)), sized_record(rng, SMALL, 9),
               sized_record(rng, SMALL, 6, (190, 70), image_offsets=[2])]
    assert canvas_arrangement(60, 200, SMALL)[1] > 1 and canvas_arrangement(190, 70, SMALL)[0] > 1
    assert_each_packed_document_is_its_own(
        model, Llama4Placeholders(100, 101, 102, 104, 105, 106), SMALL, records, 200,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                                     std=(0.5,) * 3, tile=4)})
