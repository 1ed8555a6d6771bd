"""GLM-4.1V's and GLM-4.5V's pictures: `ImageSpec.glm4v()` (Qwen2-VL's cells, a thin picture scaled
up first, bounds counted over two temporal frames) with `QwenPlaceholders.glm4v` and M-RoPE.

The oracles are transformers' own: `smart_resize` of `Glm4vImageProcessorPil` for the sizes, that
processor for the pixel rows, `Glm4vProcessor.replace_image_token` for the text, and a tiny
randomly initialised `Glm4vForConditionalGeneration`, which computes its own rotary positions
for a document alone, for what the rows (their M-RoPE included) do in a model.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tests.conftest import requires_torch
from tests.unit.test_vlm_fixed_size import _microbatch
from tests.unit.test_vlm_mixed_media import TOKENIZER
from tests.unit.test_vlm_split import _address, _pictures, sized_record
from vlm import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageSpec, QwenPlaceholders, decode_image, image_grid, patchify
from vlm import qwen_model_inputs, qwen_pixel_values
from vlm._packing import MultimodalPacker
from zephon import ConfigurationError

GLM_TOKENS = ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>"]


def _smart_resize(height: int, width: int, spec_bounds: tuple[int, int]) -> tuple[int, int] | None:
    """`Glm4vImageProcessorPil`'s size for a picture (a single image: two temporal frames), or
    None where it refuses the picture (an aspect ratio past 200)."""
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    try:
        return smart_resize(2, height, width, factor=28, min_pixels=spec_bounds[0], max_pixels=spec_bounds[1])
    except ValueError:
        return None


@pytest.mark.parametrize("bounds", [(112 * 112, 28 * 28 * 15000), (56 * 56 * 2, 28 * 28 * 64)],
                         ids=["default", "small"])
def test_the_grid_is_glm4v_s_for_every_size(bounds):
    """For 400 random sizes and the edges (pictures thinner than a cell, which the processor scales
    up first; squares; pictures far smaller and far larger than the bounds), the grid is
    `smart_resize`'s in patches. Pictures it refuses (an aspect ratio past 200), and strips it
    sizes past its own bound (a side floored to no cell is one, the other kept), get a grid within
    the bounds: the long side narrowed, as `fit="pixels"` narrows it."""
    spec = ImageSpec.glm4v(shortest_edge=bounds[0], longest_edge=bounds[1])
    rng = np.random.default_rng(14)
    sizes = [tuple(int(n) for n in pair) for pair in rng.integers(1, 8000, (400, 2))] + [
        (1, 1), (27, 27), (28, 28), (10, 1900), (1900, 10), (5, 900), (20, 100), (27, 5000), (1, 8000)]
    compared = 0
    for height, width in sizes:
        rows, cols = image_grid(height, width, spec)
        want = _smart_resize(height, width, bounds)
        if want is None or 2 * want[0] * want[1] > bounds[1]:
            assert rows * cols * 196 <= spec.max_pixels
            continue
        assert (rows * 14, cols * 14) == want, (height, width)
        compared += 1
    assert compared > 350


def test_glm4v_pixel_rows_equal_the_processor_s():
    """Decoded with `ImageSpec.glm4v()` (draft off) and turned into rows by `qwen_pixel_values`
    (CLIP's mean and std), the pictures, a thin one among them, equal `Glm4vImageProcessorPil`'s
    `pixel_values` and `image_grid_thw`."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    spec = ImageSpec.glm4v(draft=False)
    pictures = _pictures()
    decoded = [decode_image(data, spec) for data in pictures]
    grids = np.array([(pixels.shape[0] // 14, pixels.shape[1] // 14) for pixels in decoded])
    ours = qwen_pixel_values(np.concatenate([patchify(pixels, 14) for pixels in decoded]), grids,
                             mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)
    want = Glm4vImageProcessorPil()(images=[Image.open(io.BytesIO(data)) for data in pictures], return_tensors="np")
    np.testing.assert_allclose(ours, want["pixel_values"], rtol=0, atol=1e-6)
    assert want["image_grid_thw"].tolist() == [[1, *grid] for grid in grids.tolist()]
    assert min(min(Image.open(io.BytesIO(data)).size) for data in pictures) < 28  # a thin one, scaled up first


def test_min_side_is_fit_pixels_s():
    with pytest.raises(ConfigurationError, match="min_side is fit='pixels''s"):
        ImageSpec(patch_size=14, fit="fixed", size=(56, 56), min_side=28)
    assert ImageSpec.qwen2_vl().min_side is None  # Qwen's rule unchanged: its fingerprint too


@pytest.fixture(scope="module")
def glm_tokenizer():
    """The shipped tokenizer with GLM-4V's image tokens added as special tokens (no GLM
    tokenizer ships offline)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(GLM_TOKENS, special_tokens=True)
    return tokenizer


def test_rows_are_glm4v_s_text_token_for_token(glm_tokenizer):
    """A picture before its caption and a caption with a picture inside it, packed into one row:
    each document is the tokenizer's encoding of the text the chat template writes
    (`<|begin_of_image|><|image|><|end_of_image|>`) once `Glm4vProcessor.replace_image_token` has
    put one `<|image|>` per merged cell in."""
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

    tokenizer = glm_tokenizer
    spec = ImageSpec.glm4v(draft=False)
    stub = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2), image_token="<|image|>")

    def ids(text: str) -> np.ndarray:
        return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)

    pieces = [["", "a photo of a cat"], ["left", " then right"]]
    pictures = [decode_image(data, spec) for data in _pictures()[:2]]
    records = []
    for piece, pixels in zip(pieces, pictures):
        encoded = [ids(text) for text in piece]
        records.append({"input_ids": np.concatenate(encoded), "pixels": pixels, "image_offsets": [len(encoded[0])]})
    packer = MultimodalPacker(None, max_length=1200, placeholders=QwenPlaceholders.glm4v(tokenizer), spec=spec,
                              pad_id=0, mrope=True)
    assert [row for i, record in enumerate(records) for row in packer.push((_address(i), record))] == []
    [row] = packer.flush()
    documents = row.tokens["document_ids"]
    for number, (piece, pixels) in enumerate(zip(pieces, pictures)):
        grid = np.array([[1, pixels.shape[0] // 14, pixels.shape[1] // 14]])
        block = "<|begin_of_image|>" + Glm4vProcessor.replace_image_token(stub, {"image_grid_thw": grid}, 0) + \
            "<|end_of_image|>"
        assert row.tokens["input_ids"][documents == number].tolist() == ids(block.join(piece)).tolist(), number


@requires_torch
def test_a_tiny_glm4v_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a wide picture then its caption, text alone, and text around a tall picture, given
    to a tiny randomly initialised `Glm4vForConditionalGeneration` through `qwen_model_inputs`
    (the rows' M-RoPE positions): every document's logits are those the model gives it alone,
    computing its rotary positions itself (`get_rope_index`, from `mm_token_type_ids`). So the
    rows' positions are the model's, and each document keeps to itself."""
    import torch
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    config = Glm4vConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=56),
        image_token_id=4, video_token_id=6, image_start_token_id=3, image_end_token_id=5,
        video_start_token_id=7, video_end_token_id=8)
    torch.manual_seed(0)
    model = Glm4vForConditionalGeneration(config).eval()
    spec = ImageSpec.glm4v(longest_edge=28 * 28 * 32)
    placeholders = QwenPlaceholders(3, 4, 5)
    rng = np.random.default_rng(7)

    records = [sized_record(rng, spec, 5, (60, 200)), sized_record(rng, spec, 9),
               sized_record(rng, spec, 6, (190, 70), image_offsets=[2])]

    def logits(**inputs) -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, use_cache=False).logits[0]

    batch = _microbatch(placeholders, spec, records, 200, mrope=True)
    packed = logits(**qwen_model_inputs(batch))
    documents = batch["document_ids"][0]
    for number, one in enumerate(records):
        alone = _microbatch(placeholders, spec, [one], int((documents == number).sum()), mrope=True)
        own = {"input_ids": alone["input_ids"], "mm_token_type_ids": (alone["input_ids"] == 4).long()}
        if "pixels" in one:
            inputs = qwen_model_inputs(alone)
            own.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
        torch.testing.assert_close(packed[documents == number], logits(**own), rtol=0, atol=1e-5,
                                   msg=lambda m: f"document {number}: {m}")
