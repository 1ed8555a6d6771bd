"""Gemma 4's pictures: `ImageSpec.gemma4()` (`fit="area"`: scaled to a budget of 48 px cells, the
aspect ratio kept), `PadPlaceholders.gemma4` and `gemma4_model_inputs`.

The oracles are transformers' own: `get_aspect_ratio_preserving_size` for the sizes,
`Gemma4ImageProcessorPil` for the patches and their positions, `Gemma4Processor`'s
`replace_image_token` for the text, and a tiny randomly initialised `Gemma4ForConditionalGeneration`
for what the rows do in a model.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from tests.conftest import requires_torch
from tests.unit.test_vlm_fixed_size import _microbatch, assert_each_packed_document_is_its_own
from tests.unit.test_vlm_mixed_media import TOKENIZER
from tests.unit.test_vlm_split import _address, _pictures, sized_record
from vlm import ImageSpec, PadPlaceholders, decode_image, gemma4_model_inputs, image_grid, patchify
from vlm._image import GEMMA4_SOFT_TOKENS
from vlm._packing import MultimodalPacker
from zephon import ConfigurationError

GEMMA4_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image_start|>", "eoi_token": "<|image_end|>"}
"""Names for Gemma 4's three image tokens in the test tokenizer (no Gemma 4 tokenizer ships
offline); the processor and the placeholders read them from the tokenizer alike."""


@pytest.fixture(scope="module")
def gemma4_tokenizer():
    """The shipped tokenizer with Gemma 4's image tokens added as special tokens and named as its
    tokenizer names them (`image_token`, `boi_token`, `eoi_token`)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(list(GEMMA4_TOKENS.values()), special_tokens=True)
    for name, token in GEMMA4_TOKENS.items():
        setattr(tokenizer, name, token)
    return tokenizer


def _image_processor(max_soft_tokens: int):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens)


# -- sizing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_soft_tokens", GEMMA4_SOFT_TOKENS)
def test_the_size_is_gemma4_s_for_every_size(max_soft_tokens):
    """For 400 random sizes and the edges (strips one pixel thick, which round a side to nothing;
    squares; pictures far smaller and far larger than the budget), the grid is
    `get_aspect_ratio_preserving_size`'s in patches, and never more than the budget's cells."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    spec = ImageSpec.gemma4(max_soft_tokens)
    rng = np.random.default_rng(13)
    sizes = [tuple(int(n) for n in pair) for pair in rng.integers(1, 8000, (400, 2))] + [
        (1, 1), (1, 8000), (8000, 1), (3, 4000), (48, 48), (2000, 2000), (30, 45)]
    for height, width in sizes:
        want = get_aspect_ratio_preserving_size(height, width, patch_size=16, max_patches=max_soft_tokens * 9,
                                                pooling_kernel_size=3)
        rows, cols = image_grid(height, width, spec)
        assert (rows * 16, cols * 16) == want, (height, width)
        assert rows * cols // 9 <= max_soft_tokens


def test_gemma4_patches_and_positions_equal_the_processor_s():
    """Decoded with `ImageSpec.gemma4(70)` (draft off), patched and put into shape by
    `gemma4_model_inputs`, each picture's patches equal `Gemma4ImageProcessorPil`'s
    `pixel_values` value for value, padding included, and so do `image_position_ids`; its soft
    tokens are `num_soft_tokens_per_image`."""
    spec = ImageSpec.gemma4(70, draft=False)
    pictures = _pictures()
    decoded = [decode_image(data, spec) for data in pictures]
    grids = np.array([(pixels.shape[0] // 16, pixels.shape[1] // 16) for pixels in decoded])
    patches = np.concatenate([patchify(pixels, 16) for pixels in decoded])
    ours = gemma4_model_inputs({"input_ids": None, "position_ids": None, "image_grid": grids,
                                "pixel_values": patches}, spec)
    want = _image_processor(70)(images=[Image.open(io.BytesIO(data)) for data in pictures], return_tensors="np")
    np.testing.assert_array_equal(ours["pixel_values"], want["pixel_values"])
    np.testing.assert_array_equal(ours["image_position_ids"], want["image_position_ids"])
    assert (grids.prod(axis=1) // 9).tolist() == want["num_soft_tokens_per_image"].tolist()
    assert len({tuple(grid) for grid in grids.tolist()}) >= 4  # wide, tall, tiny and square pictures alike


def test_gemma4_settings_are_refused_where_the_processor_refuses_them(gemma4_tokenizer):
    with pytest.raises(ConfigurationError, match=r"max_soft_tokens must be one of \(70, 140, 280, 560, 1120\)"):
        ImageSpec.gemma4(100)
    with pytest.raises(ConfigurationError, match="below one grid cell"):
        ImageSpec(patch_size=16, merge_size=3, fit="area", max_pixels=47 * 47)
    with pytest.raises(ConfigurationError, match="names no image_token, boi_token, eoi_token"):
        PadPlaceholders.gemma4(TOKENIZER)
    placeholders = PadPlaceholders.gemma4(gemma4_tokenizer)
    assert placeholders.merge_size == 3 and placeholders.num_tokens(18, 27) == 54 + 2
    with pytest.raises(ValueError, match="give image_token_id and sliding_window together"):
        gemma4_model_inputs({"input_ids": None, "position_ids": None}, ImageSpec.gemma4(), image_token_id=252)


# -- tokens --------------------------------------------------------------------------------------

def test_rows_are_gemma4_processor_s_text_token_for_token(gemma4_tokenizer):
    """Two records, a picture before its caption and a caption with a picture inside it
    (`image_offsets`), packed into one row: each document is the tokenizer's encoding of the text
    `Gemma4Processor.replace_image_token` writes for the same text with the picture where it
    goes (`boi`, one image token per soft token, `eoi`)."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    tokenizer = gemma4_tokenizer
    spec = ImageSpec.gemma4(70, draft=False)
    stub = SimpleNamespace(**GEMMA4_TOKENS)

    def ids(text: str) -> np.ndarray:
        return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)

    pieces = [["", "a photo of a cat"], ["left", " then right"]]
    pictures = [_pictures()[0], _pictures()[1]]
    records = []
    for piece, data in zip(pieces, pictures):
        encoded = [ids(text) for text in piece]
        records.append({"input_ids": np.concatenate(encoded), "pixels": decode_image(data, spec),
                        "image_offsets": [len(encoded[0])]})
    packer = MultimodalPacker(None, max_length=300, placeholders=PadPlaceholders.gemma4(tokenizer), spec=spec, pad_id=0)
    assert [row for i, record in enumerate(records) for row in packer.push((_address(i), record))] == []
    [row] = packer.flush()
    documents = row.tokens["document_ids"]
    counts = _image_processor(70)(images=[Image.open(io.BytesIO(data)) for data in pictures],
                                  return_tensors="np")["num_soft_tokens_per_image"]
    for number, piece in enumerate(pieces):
        block = Gemma4Processor.replace_image_token(stub, {"num_soft_tokens_per_image": counts}, number)
        assert row.tokens["input_ids"][documents == number].tolist() == ids(block.join(piece)).tolist(), number


# -- into the model ------------------------------------------------------------------------------

@requires_torch
def test_a_tiny_gemma4_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a wide picture then its caption, text alone, and text around a tall picture, given
    to a tiny randomly initialised `Gemma4ForConditionalGeneration` (causal text attention, a
    sliding window shorter than a row) through `gemma4_model_inputs`: every document's logits are
    the document's alone, so the model takes each picture's patches where its soft tokens are."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    config = Gemma4Config(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                         vocab_size_per_layer_input=300, hidden_size_per_layer_input=8, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, position_embedding_size=64),
        audio_config=None, boi_token_id=250, eoi_token_id=251, image_token_id=252, video_token_id=253,
        boa_token_id=254, eoa_token_index=255, audio_token_id=256)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    spec = ImageSpec.gemma4(70)
    rng = np.random.default_rng(5)

    records = [sized_record(rng, spec, 5, (60, 200)), sized_record(rng, spec, 9),
               sized_record(rng, spec, 6, (190, 70), image_offsets=[2])]
    as_numpy = {"input_ids": None, "position_ids": None, "image_grid": np.array([[12, 42], [42, 15]]),
                "pixel_values": rng.integers(0, 256, (12 * 42 + 42 * 15, 768), dtype=np.uint8)}
    as_torch = {name: value if value is None else torch.from_numpy(value) for name, value in as_numpy.items()}
    for name in ("pixel_values", "image_position_ids"):  # the tensors the forward takes: the arrays' values
        np.testing.assert_array_equal(gemma4_model_inputs(as_torch, spec)[name].numpy(),
                                      gemma4_model_inputs(as_numpy, spec)[name])
    assert_each_packed_document_is_its_own(
        model, PadPlaceholders(252, 250, 251, merge_size=3), spec, records, 160,
        lambda batch: {name: value for name, value in gemma4_model_inputs(batch, spec).items()
                       if name in ("pixel_values", "image_position_ids")})


@requires_torch
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_tiny_gemma4_whose_pictures_attend_both_ways_gives_each_packed_document_its_own_logits(attention):
    """A tiny `Gemma4ForConditionalGeneration` whose text config sets
    `use_bidirectional_attention="vision"`, given rows of documents laid out unlike each other
    through `gemma4_model_inputs(..., image_token_id=, sliding_window=)`: every document's logits
    are those the model gives it alone as its processor would give it (`mm_token_type_ids`, no
    packing), a picture's tokens attending to each other both ways in the sliding layers, not in
    the full ones. Without the masks the packed rows' pictures attend causally and the logits
    differ."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    config = Gemma4Config(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                         vocab_size_per_layer_input=300, hidden_size_per_layer_input=8, sliding_window=40,
                         layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention="vision"),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, position_embedding_size=64),
        audio_config=None, boi_token_id=250, eoi_token_id=251, image_token_id=252, video_token_id=253,
        boa_token_id=254, eoa_token_index=255, audio_token_id=256, attn_implementation=attention)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    spec = ImageSpec.gemma4(70)
    placeholders = PadPlaceholders(252, 250, 251, merge_size=3)
    rng = np.random.default_rng(6)

    def text(n: int) -> np.ndarray:
        return rng.integers(10, 240, n).astype(np.int32)

    def picture(height: int, width: int) -> np.ndarray:
        return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)

    records = [{"input_ids": text(5), "pixels": picture(96, 144)}, {"input_ids": text(9)},
               {"input_ids": text(8), "pixels": picture(144, 96), "image_offsets": [3]}]

    def logits(**inputs) -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, use_cache=False).logits[0]

    batch = _microbatch(placeholders, spec, records, 200)
    inputs = gemma4_model_inputs(batch, spec, image_token_id=252, sliding_window=40, attn_implementation=attention)
    packed = logits(**inputs)
    causal = logits(**{name: value for name, value in inputs.items() if name != "attention_mask"})
    documents = batch["document_ids"][0]
    assert torch.isfinite(packed).all()
    for number, record in enumerate(records):
        alone = _microbatch(placeholders, spec, [record], int((documents == number).sum()))
        own = gemma4_model_inputs(alone, spec)
        own.pop("position_ids")
        own["mm_token_type_ids"] = (alone["input_ids"] == 252).long()
        torch.testing.assert_close(packed[documents == number], logits(**own), rtol=0, atol=1e-5,
                                   msg=lambda m: f"document {number}: {m}")
    assert not torch.allclose(causal[documents == 0], packed[documents == 0], rtol=0, atol=1e-4)
