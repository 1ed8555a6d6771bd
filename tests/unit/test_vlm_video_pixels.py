"""Qwen3-VL's sizing of a video as a whole: `VideoSpec(video_pixels=(min, max), max_frame_tokens=)`.

The oracle is transformers' `Qwen3VLVideoProcessor`: its `resize` (with and without
`cap_pixels_per_frame`, qwen-vl-utils' per-frame cap) traced on shape-only arrays, so that its own
arithmetic picks every size, and a tiny Qwen3-VL for the packed rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_assets import make_video
from tests.unit.test_vlm_qwen3_video import STAMPED, _address
from vlm import DecodeVideo, ImageSpec, VideoSpec, decode_video, image_grid, sample_times
from vlm._packing import MultimodalPacker
from vlm._stages import _describe
from vlm._video_pixels import video_grid
from zephon import ConfigurationError


def _processor_sizes():
    """(frames, height, width, bounds, cap) -> the (height, width) `Qwen3VLVideoProcessor.resize`
    resizes such a video to, read where it hands the size to the base class's resize."""
    from transformers.image_utils import SizeDict
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    class Sizes(BaseVideoProcessor):
        def resize(self, image, size, **kwargs):
            return size.height, size.width

    class Traced(Qwen3VLVideoProcessor, Sizes):
        pass

    processor = Traced()

    def sizes(frames: int, height: int, width: int, bounds: tuple[int, int], cap: int | None) -> tuple[int, int]:
        videos = np.broadcast_to(np.uint8(0), (1, frames, 3, height, width))
        return processor.resize(videos, SizeDict(shortest_edge=bounds[0], longest_edge=bounds[1]), resample=None,
                                factor=32, temporal_factor=2, cap_pixels_per_frame=cap is not None,
                                max_video_tokens=cap)

    return sizes


@requires_torch  # transformers' video processors import torch
@pytest.mark.parametrize("bounds", [(128 * 32 * 32, 768 * 32 * 32), (4096, 25_165_824), (64 * 64, 256 * 256)])
@pytest.mark.parametrize("cap", [None, 768, 16])
def test_the_grid_is_qwen3_vl_s_video_processor_s_for_every_video(bounds, cap):
    """For 300 random (frames, height, width) and 10 edges (two frames, frames thinner than a cell,
    768 frames, odd counts whose rounding up to pairs passes the budget), the grid is the one
    `Qwen3VLVideoProcessor.resize` resizes to, with and without qwen-vl-utils' per-frame cap, at
    the processor's bounds, a checkpoint's wide ones and a small test's; one frame, which the
    processor refuses, is sized as the pair the tower takes it as."""
    sizes = _processor_sizes()
    spec = VideoSpec(image=ImageSpec.qwen3_vl(), video_pixels=bounds, max_frame_tokens=cap)
    rng = np.random.default_rng(10)
    cases = [(int(t), int(h), int(w)) for t, h, w in zip(rng.integers(2, 400, 300), rng.integers(8, 3000, 300),
                                                         rng.integers(8, 3000, 300))]
    cases += [(2, 720, 1280), (3, 720, 1280), (5, 480, 640), (768, 1080, 1920), (4, 10, 600), (2, 31, 31),
              (9, 2000, 11), (2, 32, 32), (3, 320, 640), (7, 160, 640)]  # the last two: an odd count's pair decides
    for frames, height, width in cases:
        want = sizes(frames, height, width, bounds, cap)
        assert video_grid(frames, height, width, spec.image, bounds, cap) == (want[0] // 16, want[1] // 16), (
            frames, height, width)
    # The processor refuses one frame; here it is sized as the pair the tower takes it as.
    assert video_grid(1, 720, 1280, spec.image, bounds, cap) == video_grid(2, 720, 1280, spec.image, bounds, cap)


def test_a_longer_video_gets_smaller_frames_within_the_budget(tmp_path):
    """Decoded at 10 frames a second with the whole-video budget, a clip of 30 frames gets frames
    of the grid the rule gives 30 frames, a window of 10 of them larger ones, and each video's
    frames (in pairs) hold no more than the budget; a spec without it sizes every frame alike."""
    clip = make_video(tmp_path / "clip.mp4", frames=30, fps=10, size=(320, 240))
    spec = VideoSpec(fps=10, image=ImageSpec.qwen3_vl(), video_pixels=(4096, 60 * 32 * 32))
    whole = decode_video(clip, spec)
    window = decode_video(clip, VideoSpec(fps=10, end_s=1.0, image=spec.image, video_pixels=spec.video_pixels))
    for frames in (whole, window):
        assert frames.shape[1:3] == tuple(16 * n for n in video_grid(len(frames), 240, 320, spec.image,
                                                                       spec.video_pixels))
        assert -(-len(frames) // 2) * 2 * frames.shape[1] * frames.shape[2] <= 60 * 32 * 32
    assert (len(whole), len(window)) == (len(sample_times(3.0, spec)), 10)
    assert whole.shape[1] * whole.shape[2] < window.shape[1] * window.shape[2]
    per_frame = decode_video(clip, VideoSpec(fps=10, image=spec.image))
    assert per_frame.shape[1:3] == tuple(16 * n for n in image_grid(240, 320, spec.image))


def test_the_packer_counts_a_budgeted_video_s_tokens_from_its_frames(tmp_path):
    """A budgeted clip through `DecodeVideo` and the stamped (Qwen3-VL) packer: one block per
    temporal patch, each of the frames' merged cells."""
    clip = make_video(tmp_path / "clip.mp4", frames=20, fps=10, size=(320, 240)).read_bytes()
    spec = VideoSpec(fps=10, image=ImageSpec(patch_size=16, merge_size=2, min_pixels=64 * 64, max_pixels=256 * 256),
                     video_pixels=(4096, 40 * 32 * 32))
    record = DecodeVideo(field="mp4", spec=spec)._decode_record({"mp4": clip}, _address())
    frames = record["pixels"]
    rows, cols = frames.shape[1] // 16, frames.shape[2] // 16
    assert (rows, cols) == video_grid(len(frames), 240, 320, spec.image, spec.video_pixels)
    packer = MultimodalPacker(None, max_length=400, placeholders=STAMPED, spec=spec.image, pad_id=0)
    assert packer.push((_address(), {**record, "input_ids": np.array([9, 10], np.int32)})) == []
    [row] = packer.flush()
    pads = int((row.tokens["input_ids"] == 6).sum())
    assert pads == -(-len(frames) // 2) * rows * cols // 4 and row.ragged["video_grid"].tolist() == [
        [-(-len(frames) // 2), rows, cols]]


def test_video_pixels_are_refused_where_they_cannot_size_frames():
    fixed = ImageSpec(fit="fixed", size=(64, 64))
    for kwargs, words in (({"image": fixed, "video_pixels": (0, 10**6)}, "fit='pixels'"),
                          ({"max_frame_tokens": 10}, "give video_pixels"),
                          ({"video_pixels": (10**6, 10)}, "min <= max"),
                          ({"video_pixels": (0, 100)}, "at least two frames of one 16x16 cell"),
                          ({"video_pixels": 10**6}, "must be \\(min, max\\)"),
                          ({"video_pixels": (0, 10**6), "max_frame_tokens": 0}, "max_frame_tokens")):
        with pytest.raises(ConfigurationError, match=words):
            VideoSpec(**kwargs)
    preset = VideoSpec.qwen3_vl()
    assert (preset.fps, preset.max_frames, preset.video_pixels, preset.image) == (
        2.0, 768, (131072, 786432), ImageSpec.qwen3_vl())


def test_the_fingerprint_holds_the_budget_only_when_set():
    plain = _describe(VideoSpec())
    assert "video_pixels" not in plain and "max_frame_tokens" not in plain
    budgeted = _describe(VideoSpec(video_pixels=(0, 10**6), max_frame_tokens=64))
    assert budgeted["video_pixels"] == [0, 10**6] and budgeted["max_frame_tokens"] == 64
    assert _describe(VideoSpec(video_pixels=(0, 2 * 10**6))) != _describe(VideoSpec(video_pixels=(0, 10**6)))
