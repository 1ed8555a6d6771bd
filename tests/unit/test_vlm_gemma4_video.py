"""Gemma 4's videos: `VideoSpec.gemma4()` (each frame a picture of 70 soft tokens),
`PadPlaceholders.gemma4(tokenizer, video=True)` (a frame's block written with `<|video|>`),
`FrameText.gemma4(tokenizer)` (each frame's time before it) and `gemma4_model_inputs(...,
video_spec=, video_token_id=)` (the frames as `pixel_values_videos`).

The oracles are transformers' own: `Gemma4Processor.replace_video_token`'s text, on a stub of the
processor holding its tokens, for the frames' times as `VideoMetadata` gives them; and a tiny
randomly initialised `Gemma4ForConditionalGeneration` for what the rows do in a model.
"""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_assets import make_video
from tests.unit.test_vlm_fixed_size import _microbatch, assert_each_packed_document_is_its_own
from tests.unit.test_vlm_gemma4 import GEMMA4_TOKENS
from tests.unit.test_vlm_mixed_media import TOKENIZER
from tests.unit.test_vlm_split import sized_record
from vlm import FrameText, ImageSpec, PadPlaceholders, VideoSpec, gemma4_model_inputs
from vlm._packing import MultimodalPacker
from vlm._stages import DecodeVideo
from zephon import ConfigurationError
from zephon._records import RecordAddress

SPEC = ImageSpec.gemma4(70)
VIDEO_SPEC = VideoSpec.gemma4(num_frames=3)


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped tokenizer with Gemma 4's image tokens and `<|video|>` added as special tokens,
    the image tokens named as its tokenizer names them."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens([*GEMMA4_TOKENS.values(), "<|video|>"], special_tokens=True)
    for name, token in GEMMA4_TOKENS.items():
        setattr(tokenizer, name, token)
    return tokenizer


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("clips", "shard-0", i)


def test_a_decoded_clip_is_token_for_token_the_processor_s_text(tmp_path, tokenizer):
    """A real clip of 120 s decoded by `VideoSpec.gemma4(num_frames=4)` then its caption: the
    row's tokens are the tokenizer's encoding of the text `Gemma4Processor.replace_video_token`
    writes for the same frames (their times as `VideoMetadata` gives them, past a minute), the
    frames' blocks of `<|video|>`, the frames counted as 4 images."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_utils import VideoMetadata

    path = make_video(tmp_path / "clip.mp4", frames=30, fps=Fraction(1, 4), size=(96, 64))  # a frame every 4 s
    record = DecodeVideo(field="mp4", spec=VideoSpec.gemma4(num_frames=4)).build("raise")._decode_record(
        {"mp4": path.read_bytes()}, _address())
    caption = " a grey clip fading in"
    record["input_ids"] = np.array(tokenizer(caption, add_special_tokens=False)["input_ids"], np.int32)
    frames, height, width, _ = record["pixels"].shape
    soft_tokens = (height // 16) * (width // 16) // 9
    packer = MultimodalPacker(None, max_length=1024, placeholders=PadPlaceholders.gemma4(tokenizer, video=True),
                              spec=SPEC, pad_id=0, frame_text=FrameText.gemma4(tokenizer), assemble=False)
    assert packer.push((_address(), record)) == []
    [plan] = packer.flush()
    row = plan.assemble()
    shown = record["pixels_frame_times_s"]
    metadata = VideoMetadata(total_num_frames=30, fps=0.25, frames_indices=[round(t / 4) for t in shown])
    stub = SimpleNamespace(**GEMMA4_TOKENS, video_token="<|video|>")
    text = Gemma4Processor.replace_video_token(stub, {"num_soft_tokens_per_video": [soft_tokens],
                                                      "video_metadata": [metadata]}, 0)
    assert "01:" in text and text.count("<|video|>") == frames * soft_tokens
    want = tokenizer(text + caption, add_special_tokens=False)["input_ids"]
    assert row.tokens["input_ids"][: len(want)].tolist() == want and row.num_real_tokens == len(want)
    assert plan.images_by_dataset == row.images_by_dataset == {"clips": 4}


@requires_torch
def test_a_batch_s_frames_go_to_the_video_arguments_and_its_pictures_to_the_image_ones(tokenizer):
    """Two clips (3 frames of 70 soft tokens' budget) and a picture (280's) packed into rows:
    `gemma4_model_inputs` gives the frames as `pixel_values_videos` padded to the clips' budget,
    each the rows it gives the same pixels as a picture, `num_frames_per_video` 3 each, and the
    picture as `pixel_values` alone; without `video_token_id` every image is a picture."""
    rng = np.random.default_rng(7)
    picture_spec = ImageSpec.gemma4(280)
    placeholders = PadPlaceholders(252, 250, 251, merge_size=3, frame_pad=253)
    clips = [{"input_ids": rng.integers(10, 90, 4).astype(np.int32),
              "pixels": rng.integers(0, 256, (3, 96, 144, 3), dtype=np.uint8)} for _ in range(2)]
    records = [clips[0], sized_record(rng, picture_spec, 5, (150, 90)), clips[1]]
    batch = _microbatch(placeholders, picture_spec, records, 1200)
    got = gemma4_model_inputs(batch, picture_spec, video_spec=VIDEO_SPEC, video_token_id=253)
    assert got["pixel_values_videos"].shape == (6, 70 * 9, 768) and got["pixel_values"].shape[:2] == (1, 280 * 9)
    assert got["num_frames_per_video"].tolist() == [3, 3]
    frames = np.concatenate([clip["pixels"] for clip in clips])
    alone = {"input_ids": np.zeros(0, np.int32), "pixels": list(frames)}  # the frames as six pictures
    as_pictures = gemma4_model_inputs(_microbatch(placeholders, VIDEO_SPEC.image, [alone], 800), VIDEO_SPEC.image)
    np.testing.assert_array_equal(got["pixel_values_videos"].numpy(), as_pictures["pixel_values"].numpy())
    np.testing.assert_array_equal(got["video_position_ids"].numpy(), as_pictures["image_position_ids"].numpy())
    assert gemma4_model_inputs(batch, picture_spec)["pixel_values"].shape[0] == 7
    with pytest.raises(ValueError, match="give video_token_id and video_spec together"):
        gemma4_model_inputs(batch, picture_spec, video_token_id=253)


def test_frame_pad_is_a_placeholder_id_and_written_only_for_frames(tokenizer):
    """`<|video|>` is one of the placeholders' ids, which the packer checks captions and the pad
    id against (a pad id equal to it is refused), distinct from the others; pictures keep
    `<|image|>`; the fingerprint holds it only when set, so recipes of pictures alone resume as
    before."""
    from vlm._packing import _describe

    placeholders = PadPlaceholders.gemma4(tokenizer, video=True)
    assert "frame_pad" not in _describe(PadPlaceholders.gemma4(tokenizer))
    assert _describe(placeholders)["frame_pad"] == tokenizer.convert_tokens_to_ids("<|video|>")
    video, image = tokenizer.convert_tokens_to_ids("<|video|>"), tokenizer.convert_tokens_to_ids("<|image|>")
    assert placeholders.frame_pad == video and video in placeholders.token_ids
    assert set(placeholders.frame_tokens_for(6, 6).tolist()) == {placeholders.start, video, placeholders.end}
    assert set(placeholders.tokens_for(6, 6).tolist()) == {placeholders.start, image, placeholders.end}
    with pytest.raises(ConfigurationError, match="placeholder ids must be distinct"):
        PadPlaceholders(252, 250, 251, merge_size=3, frame_pad=252)
    with pytest.raises(ConfigurationError, match="is an image placeholder id"):
        MultimodalPacker(None, max_length=64, placeholders=placeholders, spec=SPEC, pad_id=video)
    assert VideoSpec.gemma4(fps=1.0).num_frames is None


@requires_torch
@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "vision both ways"])
def test_a_tiny_gemma4_gives_each_packed_document_of_clips_and_pictures_what_it_gives_it_alone(bidirectional):
    """Rows of a three-frame clip after its times then its caption, text alone, a picture, and
    text around another clip, given to a tiny randomly initialised
    `Gemma4ForConditionalGeneration` through `gemma4_model_inputs`: every document's logits are
    the document's alone, so the model takes each frame's patches where its `<|video|>` are. With
    `use_bidirectional_attention="vision"` and the masks, a frame's tokens attend to each other
    both ways as the processor's `mm_token_type_ids` (2 for a frame) have them, alone."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    config = Gemma4Config(
        text_config=dict(vocab_size=8300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                         vocab_size_per_layer_input=8300, hidden_size_per_layer_input=8, sliding_window=40,
                         layer_types=["sliding_attention", "full_attention"],
                         use_bidirectional_attention="vision" if bidirectional else None),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, position_embedding_size=64),
        audio_config=None, boi_token_id=8250, eoi_token_id=8251, image_token_id=8252, video_token_id=8253,
        boa_token_id=8254, eoa_token_index=8255, audio_token_id=8256)  # past the shipped vocabulary
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    placeholders = PadPlaceholders(8252, 8250, 8251, merge_size=3, frame_pad=8253)
    frame_text = FrameText.gemma4(TOKENIZER)  # the times in the shipped tokenizer's ids
    rng = np.random.default_rng(8)

    def clip(words: int, **extra) -> dict:
        return {"input_ids": rng.integers(10, 240, words).astype(np.int32),
                "pixels": rng.integers(0, 256, (3, 96, 144, 3), dtype=np.uint8),
                "pixels_frame_times_s": np.array([0.0, 1.5, 61.0]), **extra}

    records = [clip(5), {"input_ids": rng.integers(10, 240, 9).astype(np.int32)},
               {"input_ids": rng.integers(10, 240, 4).astype(np.int32),
                "pixels": rng.integers(0, 256, (144, 96, 3), dtype=np.uint8)}, clip(6, image_offsets=[2, 2, 2])]
    masks = dict(image_token_id=8252, sliding_window=40) if bidirectional else {}

    def inputs(batch: dict) -> dict:
        given = gemma4_model_inputs(batch, SPEC, video_spec=VIDEO_SPEC, video_token_id=8253, **masks)
        return {name: value for name, value in given.items() if name not in ("input_ids", "position_ids")}

    if not bidirectional:
        assert_each_packed_document_is_its_own(model, placeholders, SPEC, records, 400, inputs, frame_text=frame_text)
        return
    batch = _microbatch(placeholders, SPEC, records, 400, frame_text=frame_text)
    with torch.no_grad():
        packed = model(**gemma4_model_inputs(batch, SPEC, video_spec=VIDEO_SPEC, video_token_id=8253, **masks),
                       use_cache=False).logits[0]
    documents = batch["document_ids"][0]
    for number, record in enumerate(records):
        alone = _microbatch(placeholders, SPEC, [record], int((documents == number).sum()), frame_text=frame_text)
        own = gemma4_model_inputs(alone, SPEC, video_spec=VIDEO_SPEC, video_token_id=8253)
        own.pop("position_ids")
        own["mm_token_type_ids"] = (alone["input_ids"] == 8252).long() + 2 * (alone["input_ids"] == 8253).long()
        with torch.no_grad():
            want = model(**own, use_cache=False).logits[0]
        torch.testing.assert_close(packed[documents == number], want, rtol=0, atol=1e-5,
                                   msg=lambda m: f"document {number}: {m}")
