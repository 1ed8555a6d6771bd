"""LLaVA-NeXT-Video's videos: `VideoSpec.llava_next_video()` (every frame's shorter side scaled
to 336 and the middle 336x336 cut out, `fit="crop"`) with
`LlavaNextPlaceholders.llava_next_video(tokenizer)` (one block of `<video>` a clip, each frame's
features average-pooled 2x2, no newline).

The oracles are transformers' own: `LlavaNextVideoProcessor.replace_video_token`'s count and
text, on a stub of the processor holding its tokens and patch size; `get_resize_output_image_size`
and `center_crop` for the frames' sizing; and a tiny randomly initialised
`LlavaNextVideoForConditionalGeneration` for what the rows do in a model.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_anyres import SMALL_ANYRES
from tests.unit.test_vlm_assets import make_video
from tests.unit.test_vlm_fixed_size import assert_each_packed_document_is_its_own
from tests.unit.test_vlm_onevision_video import llava_model_inputs, random_clip
from tests.unit.test_vlm_onevision_video import tokenizer  # noqa: F401 - the tokenizer fixture
from tests.unit.test_vlm_split import sized_record
from vlm import ImageSpec, LlavaNextPlaceholders, VideoSpec
from vlm._packing import MultimodalPacker
from vlm._stages import DecodeVideo
from zephon._records import RecordAddress


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("clips", "shard-0", i)


def _processor_text(frames: int, side: int) -> str:
    """`LlavaNextVideoProcessor.replace_video_token`'s text for a video of `frames` frames of
    `side` px, on a stub holding what the method reads (the processor's constructor needs
    torchvision, which the test environment lacks)."""
    from transformers import LlavaNextVideoProcessor

    stub = SimpleNamespace(patch_size=14, video_token="<video>")
    clip = {"pixel_values_videos": [np.zeros((frames, 3, side, side), np.float32)]}
    return LlavaNextVideoProcessor.replace_video_token(stub, clip, 0)


def _decoded(path, spec: VideoSpec) -> dict:
    return DecodeVideo(field="mp4", spec=spec).build("raise")._decode_record({"mp4": path.read_bytes()}, _address())


@pytest.mark.parametrize("frames", [1, 8, 32, 64])
@pytest.mark.parametrize("side", [336, 56])
def test_a_video_s_count_is_llava_next_video_processor_s(tokenizer, frames, side):
    """For the checkpoints' 336 px frames and the tiny model's 56 px, a video of 1 to 64 frames
    takes as many `<video>` as the processor writes."""
    placeholders = LlavaNextPlaceholders.llava_next_video(tokenizer, frame_patches=side // 14)
    patches = side // 14
    assert placeholders.video_num_tokens(frames, patches, patches) == _processor_text(frames, side).count("<video>")


@pytest.mark.parametrize("size", [(160, 90), (90, 160), (336, 336), (50, 400)])
def test_cropped_frames_are_the_middle_of_the_frames_scaled_as_the_processor_scales_them(tmp_path, size):
    """A frame decoded with `fit="crop"` is transformers' `center_crop` of the same frame resized
    whole (the same FFmpeg resize) to the size `get_resize_output_image_size` gives for the
    processor's `shortest_edge` 336: landscape, portrait, square and a thin strip."""
    from transformers.image_transforms import center_crop, get_resize_output_image_size

    path = make_video(tmp_path / "clip.mp4", frames=12, size=size)
    cropped = _decoded(path, VideoSpec.llava_next_video(num_frames=3))["pixels"]
    width, height = size
    scaled = get_resize_output_image_size(np.zeros((height, width, 3)), 336, default_to_square=False,
                                          input_data_format="channels_last")
    whole = _decoded(path, VideoSpec(num_frames=3, image=ImageSpec(patch_size=1, fit="fixed", size=scaled,
                                                                 resample="bicubic")))["pixels"]
    assert cropped.shape == (3, 336, 336, 3) and whole.shape == (3, *scaled, 3)
    want = np.stack([center_crop(frame, (336, 336), input_data_format="channels_last") for frame in whole])
    np.testing.assert_array_equal(cropped, want)


def test_a_thin_clip_scaled_up_past_the_pixel_cap_is_refused_as_a_bomb(tmp_path):
    """A 16x1024 clip's frames, their shorter side scaled to 336 before the middle is cut, would
    be 21504x336: past a cap of 4 million pixels, it is skipped as `decompression_bomb` before
    any frame is resized, as a picture scaled so is."""
    from vlm import VideoDecodeError
    from vlm._video import decode_video

    path = make_video(tmp_path / "thin.mp4", frames=4, size=(1024, 16))
    spec = VideoSpec.llava_next_video(num_frames=2, image=ImageSpec(patch_size=14, fit="crop", size=(336, 336),
                                                                    max_image_pixels=4_000_000))
    with pytest.raises(VideoDecodeError, match="1024x16 frames to 21504x336") as refused:
        decode_video(path.read_bytes(), spec)
    assert refused.value.reason == "decompression_bomb"


def test_a_decoded_clip_is_token_for_token_the_processor_s_text(tmp_path, tokenizer):
    """A real clip decoded by `VideoSpec.llava_next_video(num_frames=4)` then its caption: the
    row's tokens are the processor's text encoded by the tokenizer, the frames (4, 24, 24) in
    the rows' `video_grid`, counted as 4 images."""
    path = make_video(tmp_path / "clip.mp4", frames=20, size=(160, 90))
    record = _decoded(path, VideoSpec.llava_next_video(num_frames=4))
    caption = " a grey clip fading in"
    record["input_ids"] = np.array(tokenizer(caption, add_special_tokens=False)["input_ids"], np.int32)
    packer = MultimodalPacker(None, max_length=1024, placeholders=LlavaNextPlaceholders.llava_next_video(tokenizer),
                              spec=ImageSpec.llava_next(), pad_id=0, assemble=False)
    assert packer.push((_address(), record)) == []
    [plan] = packer.flush()
    row = plan.assemble()
    want = tokenizer(_processor_text(4, 336) + caption, add_special_tokens=False)["input_ids"]
    assert row.tokens["input_ids"][: len(want)].tolist() == want
    assert row.num_real_tokens == len(want) == 4 * 144 + len(record["input_ids"])
    assert row.ragged["video_grid"].tolist() == [[4, 24, 24]]
    assert plan.images_by_dataset == row.images_by_dataset == {"clips": 4}


@requires_torch
def test_a_tiny_llava_next_video_gives_each_packed_document_of_clips_and_pictures_what_it_gives_it_alone():
    """Rows of a three-frame clip then its caption, text alone, a picture on LLaVA-NeXT's canvas
    and text around another clip, given to a tiny randomly initialised
    `LlavaNextVideoForConditionalGeneration` (CLIP's 14 px patches, 4x4 features of a 56 px
    frame pooled to 2x2) with the clips by `video_tensors`: every document's logits are the
    document's alone, so the model's own count of a clip's pooled features is the packer's."""
    import torch
    from transformers import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    config = LlavaNextVideoConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
        image_token_index=102, video_token_index=103,
        image_grid_pinpoints=[list(c) for c in SMALL_ANYRES.pinpoints],
        vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    model = LlavaNextVideoForConditionalGeneration(config).eval()
    rng = np.random.default_rng(5)

    placeholders = LlavaNextPlaceholders(102, video_pad=103, video_frame=(4, 4), video_frame_tokens=4,
                                         video_newline=False)
    records = [random_clip(rng, 5, 56), {"input_ids": rng.integers(10, 90, 7).astype(np.int32)},
               sized_record(rng, SMALL_ANYRES, 6, (60, 130)), random_clip(rng, 6, 56, image_offsets=[2])]
    assert_each_packed_document_is_its_own(model, placeholders, SMALL_ANYRES, records, 200,
                                           partial(llava_model_inputs, tile=4))
