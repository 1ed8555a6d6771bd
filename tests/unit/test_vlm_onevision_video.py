"""LLaVA-OneVision's videos: `VideoSpec.llava_onevision()` (every frame 384x384) with
`LlavaNextPlaceholders.llava_onevision(tokenizer)` (one block of `<video>` a clip: each frame's
pooled features, then one newline feature), the frames in the rows' `video_*` fields, one frame a
temporal patch.

The oracles are transformers' own: `LlavaOnevisionProcessor.replace_video_token`'s count and
text, on a stub of the processor holding its tokens and `num_image_tokens`, and a tiny randomly
initialised `LlavaOnevisionForConditionalGeneration` for what the rows do in a model.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_assets import make_video
from tests.unit.test_vlm_fixed_size import assert_each_packed_document_is_its_own
from tests.unit.test_vlm_mixed_media import TOKENIZER, _epoch, photos_and_clips
from tests.unit.test_vlm_onevision import SMALL_ONEVISION
from tests.unit.test_vlm_qwen_video import corpus  # noqa: F401 - the photos-and-clips corpus fixture
from tests.unit.test_vlm_split import sized_record
from vlm import (FrameText, ImageSpec, LlavaNextPlaceholders, PackMultimodal, VideoSpec, image_tensors, patchify,
                 video_tensors)
from vlm._packing import MultimodalPacker
from vlm._stages import DecodeVideo
from zephon import ConfigurationError, Pipeline
from zephon._records import RecordAddress

SMALL_FRAMES = ImageSpec(patch_size=16, fit="fixed", size=(64, 64), resample="bicubic")
"""OneVision's frames at a sixth of their side: 4x4 patches of 16 px, which a tower of 14 px
patches sees as 4x4 features, pooled to 2x2: 4 `<video>` a frame (`SMALL_ONEVISION`'s tiles)."""

SMALL_VIDEO_PLACEHOLDERS = dict(video_frame=(4, 4), video_frame_tokens=4, video_newline=True)


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped tokenizer with `<image>` and `<video>` added as special tokens (no LLaVA
    tokenizer ships offline)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(["<image>", "<video>"], special_tokens=True)
    return tokenizer


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("clips", "shard-0", i)


def _one_row(packer: MultimodalPacker, *records: dict):
    for i, record in enumerate(records):
        assert packer.push((_address(i), record)) == []
    [row] = packer.flush()
    return row


def _processor_text(frames: int, num_image_tokens: int) -> str:
    """`LlavaOnevisionProcessor.replace_video_token`'s text for a video of `frames` frames, on a
    stub holding what the method reads (the processor's constructor needs torchvision, which the
    test environment lacks)."""
    from transformers import LlavaOnevisionProcessor

    stub = SimpleNamespace(num_image_tokens=num_image_tokens, video_token="<video>")
    clip = {"pixel_values_videos": [np.zeros((frames, 3, 8, 8), np.float32)]}
    return LlavaOnevisionProcessor.replace_video_token(stub, clip, 0)


# -- the count and the text ----------------------------------------------------------------------

@pytest.mark.parametrize("frames", [1, 8, 32, 64])
@pytest.mark.parametrize("features", [27, 4])
def test_a_video_s_count_is_llava_onevision_processor_s(tokenizer, frames, features):
    """For SigLIP's 27x27 features of a 384 px frame (the checkpoints') and 4x4 (the tiny model's),
    a video of 1 to 64 frames takes as many `<video>` as the processor writes."""
    placeholders = LlavaNextPlaceholders.llava_onevision(tokenizer, frame_features=features)
    assert placeholders.video_num_tokens(frames, 24, 24) == _processor_text(frames, features**2).count("<video>")
    assert LlavaNextPlaceholders.llava_onevision(tokenizer).video_num_tokens(frames, 24, 24) == 196 * frames + 1


def test_a_decoded_clip_is_token_for_token_the_processor_s_text(tmp_path, tokenizer):
    """A real clip decoded by `VideoSpec.llava_onevision(num_frames=4)` then its caption: the
    row's tokens are the processor's text encoded by the tokenizer, the frames 384x384 in the
    row's `video_*` fields (4 frames of 24x24 patches, one a temporal patch, no seconds), the
    clip counted as its 4 frames by its plan and by its assembled row alike."""
    spec = VideoSpec.llava_onevision(num_frames=4)
    path = make_video(tmp_path / "clip.mp4", frames=20, size=(160, 90))
    record = DecodeVideo(field="mp4", spec=spec).build("raise")._decode_record({"mp4": path.read_bytes()}, _address())
    assert record["pixels"].shape == (4, 384, 384, 3)
    caption = " a grey clip fading in"
    record["input_ids"] = np.array(tokenizer(caption, add_special_tokens=False)["input_ids"], np.int32)
    placeholders = LlavaNextPlaceholders.llava_onevision(tokenizer)
    packer = MultimodalPacker(None, max_length=1024, placeholders=placeholders, spec=ImageSpec.llava_onevision(),
                              pad_id=0, assemble=False)
    plan = _one_row(packer, record)
    row = plan.assemble()
    want = tokenizer(_processor_text(4, 27**2) + caption, add_special_tokens=False)["input_ids"]
    assert row.tokens["input_ids"][: len(want)].tolist() == want
    assert row.num_real_tokens == len(want) == 4 * 196 + 1 + len(record["input_ids"])
    assert row.ragged["video_grid"].tolist() == [[4, 24, 24]] and row.ragged["video_token_offset"].tolist() == [0]
    assert "video_second_per_grid" not in row.ragged and len(row.ragged["image_grid"]) == 0
    frames = np.concatenate([patchify(frame, 16) for frame in record["pixels"]])
    np.testing.assert_array_equal(row.ragged["video_pixel_values"], frames)
    assert plan.images_by_dataset == row.images_by_dataset == {"clips": 4}


def test_a_video_tensor_is_the_frames_normalised_in_order():
    """`video_tensors` gives each video's frames back as (videos, frames, 3, H, W), as
    `image_tensors` gives each frame; videos of different lengths are refused."""
    rng = np.random.default_rng(0)
    clips = rng.integers(0, 256, (2, 3, 32, 48, 3), dtype=np.uint8)
    patches = np.concatenate([patchify(frame, 16) for clip in clips for frame in clip])
    got = video_tensors(patches, np.array([[3, 2, 3], [3, 2, 3]]), mean=(0.5,) * 3, std=(0.5,) * 3)
    each = image_tensors(patches, np.array([[2, 3]] * 6), mean=(0.5,) * 3, std=(0.5,) * 3)
    assert got.shape == (2, 3, 3, 32, 48)
    np.testing.assert_array_equal(got.reshape(6, 3, 32, 48), each)
    np.testing.assert_allclose(got[1, 2], clips[1, 2].transpose(2, 0, 1) / 255 * 2 - 1, atol=1e-6)
    with pytest.raises(ValueError, match=r"the videos have \[2, 3\] frames"):
        video_tensors(patches, np.array([[3, 2, 3], [2, 2, 3]]), mean=(0.5,) * 3, std=(0.5,) * 3)


# -- refusals ------------------------------------------------------------------------------------

def test_what_the_video_layout_cannot_count_is_refused_by_name(tokenizer):
    """A frame of another size than the model pools, a picture beside a video in one record, a
    video layout's settings without its token, and text around frames that are no images."""
    placeholders = LlavaNextPlaceholders(3, video_pad=4, **SMALL_VIDEO_PLACEHOLDERS)
    rng = np.random.default_rng(1)
    packer = MultimodalPacker(None, max_length=256, placeholders=placeholders, spec=SMALL_ONEVISION, pad_id=0)
    wrong = {"input_ids": np.array([9], np.int32), "pixels": rng.integers(0, 256, (2, 80, 64, 3), dtype=np.uint8)}
    with pytest.raises(ConfigurationError, match=r"frames of 5x4 patches; the model pools frames of 4x4 \(size them "
                                                  r"with VideoSpec.llava_onevision\(\)"):
        packer.push((_address(), wrong))
    picture = sized_record(rng, SMALL_ONEVISION, 3, (60, 100))
    both = {**picture, "pixels": [picture["pixels"], rng.integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)]}
    with pytest.raises(ConfigurationError, match="a record holding a video holds no picture beside it"):
        packer.push((_address(), both))
    with pytest.raises(ConfigurationError, match="give video_pad"):
        LlavaNextPlaceholders(3, video_frame_tokens=4)
    with pytest.raises(ConfigurationError, match="video_frame must be a frame's"):
        LlavaNextPlaceholders(3, video_pad=4, video_frame=24, video_frame_tokens=4)
    with pytest.raises(ConfigurationError, match=r"LlavaNextPlaceholders\(video_pad=...\) lays a video out as one"):
        MultimodalPacker(None, max_length=256, placeholders=placeholders, spec=SMALL_ONEVISION, pad_id=0,
                         frame_text=FrameText.internvl(TOKENIZER))


def test_pictures_keep_their_fingerprint_and_a_video_layout_has_its_own(tokenizer):
    """`LlavaNextPlaceholders` for pictures alone are described as before the video layout came
    (so their recipes resume); with it, the video settings are in the description."""
    from vlm._packing import _describe

    assert _describe(LlavaNextPlaceholders(3)) == {"class": "vlm._placeholders.LlavaNextPlaceholders", "image": 3,
                                                   "merge_size": 1}
    described = _describe(LlavaNextPlaceholders.llava_onevision(tokenizer))
    assert {name: described[name] for name in ("video_pad", "video_frame", "video_frame_tokens", "video_newline")} == {
        "video_pad": tokenizer.convert_tokens_to_ids("<video>"), "video_frame": (24, 24), "video_frame_tokens": 196,
        "video_newline": True}


def test_the_memory_budget_counts_the_pixels_a_pooled_video_token_stands_for():
    """A `<video>` stands for 576 / 196 patches of a 384 px frame, more than a picture's token
    (one 16 px patch): a row's pixel bytes per token say so."""
    onevision = LlavaNextPlaceholders(3, video_pad=4, video_frame=(24, 24), video_frame_tokens=196, video_newline=True)
    spec = ImageSpec.llava_onevision()
    assert PackMultimodal(512, LlavaNextPlaceholders(3), spec=spec).pixel_bytes_per_token == 16 * 16 * 3
    assert PackMultimodal(512, onevision, spec=spec).pixel_bytes_per_token == -(-16 * 16 * 3 * 576 // 196)


# -- through the pipeline ------------------------------------------------------------------------

def _onevision_pipeline(root, runner: str, *, video_last: bool = True, defer: bool = False) -> Pipeline:
    """`test_vlm_mixed_media`'s photos sized as OneVision sizes pictures (at 64 px tiles) and its
    clips as 3 frames of 64 px, in rows of 512; the video decoded after the photos unless told
    otherwise, the photos after packing with `defer`."""
    pipeline = photos_and_clips(root, runner, SMALL_ONEVISION, VideoSpec(num_frames=3, image=SMALL_FRAMES),
                                video_last=video_last, defer=defer)
    return (pipeline.pack_multimodal(512, LlavaNextPlaceholders(3, video_pad=4, **SMALL_VIDEO_PLACEHOLDERS))
            .shuffle(buffer_size=3, seed=2)
            .batch(2))


def test_photos_and_clips_in_onevision_s_layout_are_the_same_bytes_on_every_runner(corpus):  # noqa: F811
    """Photos on OneVision's canvases and 3-frame clips each one block of `<video>`: the clips
    are counted by their frames, each `<video>` run is its frames' pooled features and the
    newline, and the batches' SHA-256s are the same from separately built pipelines on the
    inline, thread and process runners, with the video decoded before the photos (the packer
    counts pictures by the photos' spec wherever the video's decoder stands), and with the photos
    decoded after packing (counted from their headers' sizes)."""
    runs = {runner: _epoch(_onevision_pipeline(corpus, runner)) for runner in ("inline", "thread", "process")}
    runs["inline, video first"] = _epoch(_onevision_pipeline(corpus, "inline", video_last=False))
    runs["process, photos deferred"] = _epoch(_onevision_pipeline(corpus, "process", defer=True))
    batches, stats = runs["inline"]
    videos = sum(len(batch.ragged["video_grid"]) for batch in batches)
    assert videos > 0 and stats["mixture"]["clips"]["images"] == 3 * videos
    assert sum(len(batch.ragged["image_sizes"]) for batch in batches) == stats["mixture"]["photos"]["images"] > 0
    for batch in batches:
        assert (batch.ragged["video_grid"] == [3, 4, 4]).all() and "video_second_per_grid" not in batch.ragged
        assert int((batch.tokens["input_ids"] == 4).sum()) == len(batch.ragged["video_grid"]) * (3 * 4 + 1)
    digests = [batch.digest() for batch in batches]
    for runner, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, runner


def test_photos_and_clips_saved_on_two_ranks_resume_on_four_with_the_same_global_batches(corpus):  # noqa: F811
    """Saved after two microbatches on each of 2 ranks (thread runner), resumed on 4 (process
    runner): every later global batch is the uninterrupted single-rank run's, by SHA-256."""
    import json

    from tests.determinism.test_vlm_mixed_media_elastic import global_digests
    from tests.reliability.harness import checkpoint_after, run_epoch

    reference = global_digests(run_epoch(_onevision_pipeline(corpus, "inline"), 1, keep_batches=False).digests)
    state = json.loads(json.dumps(checkpoint_after(_onevision_pipeline(corpus, "thread"), 2, 2)))
    resumed = global_digests(run_epoch(_onevision_pipeline(corpus, "process"), 4, state=state,
                                       keep_batches=False).digests)
    assert resumed and sorted(resumed) == sorted(set(reference) - {0})
    assert resumed == {step: reference[step] for step in resumed}


# -- into the model ------------------------------------------------------------------------------

def random_clip(rng: np.random.Generator, words: int, side: int, **extra) -> dict:
    """A record of `words` random text tokens and a clip of three random `side` px frames."""
    return {"input_ids": rng.integers(10, 90, words).astype(np.int32),
            "pixels": rng.integers(0, 256, (3, side, side, 3), dtype=np.uint8), **extra}


def llava_model_inputs(batch: dict, *, tile: int) -> dict:
    """The forward's image and video arguments of a LLaVA-OneVision or LLaVA-NeXT-Video
    microbatch, as vlm/README.md shows them: each only where the microbatch holds some (SigLIP's
    and the tiny CLIP's normalisation, 0.5 a channel)."""
    given = {}
    if len(batch["video_grid"]):
        given["pixel_values_videos"] = video_tensors(batch["video_pixel_values"], batch["video_grid"],
                                                     mean=(0.5,) * 3, std=(0.5,) * 3)
    if len(batch["image_grid"]):
        given["pixel_values"] = image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                              std=(0.5,) * 3, tile=tile)
        given["image_sizes"] = batch["image_sizes"]
    return given


@requires_torch
def test_a_tiny_llava_onevision_gives_each_packed_document_of_clips_and_pictures_what_it_gives_it_alone():
    """Rows of a three-frame clip then its caption, text alone, a picture on OneVision's canvas
    and text around another clip, given to a tiny randomly initialised
    `LlavaOnevisionForConditionalGeneration` with the clips by `video_tensors` and the pictures
    by `image_tensors`: every document's logits are the document's alone, so the model's own
    count of a clip's pooled features and newline is the packer's (it refuses a mismatch)."""
    import torch
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=14),
        text_config=dict(model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
        image_token_index=102, video_token_index=103, image_grid_pinpoints=[list(c) for c in SMALL_ONEVISION.pinpoints],
        vision_feature_select_strategy="full", vision_feature_layer=-1, vision_aspect_ratio="anyres_max_2")
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    rng = np.random.default_rng(3)

    records = [random_clip(rng, 5, 64), {"input_ids": rng.integers(10, 90, 7).astype(np.int32)},
               sized_record(rng, SMALL_ONEVISION, 6, (60, 200)), random_clip(rng, 6, 64, image_offsets=[2])]
    assert_each_packed_document_is_its_own(
        model, LlavaNextPlaceholders(102, video_pad=103, **SMALL_VIDEO_PLACEHOLDERS), SMALL_ONEVISION, records, 200,
        partial(llava_model_inputs, tile=4))
