"""Video bytes (or a path) to (T, H, W, 3) uint8 frames sampled by timestamp, with PyAV.

Which frames are returned is decided by timestamps alone, never by how the decoder was driven:
for every target time t the frame shown at t is taken, i.e. the last frame whose presentation time
is <= t (or the stream's first frame when t precedes it). Target times come from the spec and
the video stream's own duration (where the container gives none, as Matroska and WebM do, the end
of its last packet: never the container's, which runs to the end of a longer audio track), so
the choice is a pure function of (bytes, spec). The presentation times
are the container's: AVI stores none, so for H.264 with B-frames in AVI the times the decoder
gives are not in display order and "the frame shown at t" follows them (still a pure function of
the bytes).

Only what is needed is decoded: a demux pass (packets, no decoding) finds the keyframes; the
decoder seeks to the keyframe before a target whenever that keyframe lies past the frame it has
reached (again further back where a container's seek lands past the target), and decoding stops
after the last target. Chosen frames are converted to RGB and resized by swscale in one step, on the same
patch grid rule as images (`image_grid`), then turned upright by the stream's display rotation (a
phone's portrait video is stored landscape with a quarter turn to apply), as images are by
their EXIF orientation, and under the same switch (`ImageSpec.exif_transpose`). With
`fit="crop"` a frame is resized to the scaled size the rule gives (`crop_scaled_size`) and its
middle cut out, as CLIP's processors crop (LLaVA-NeXT-Video's frames).

A frame FFmpeg marks damaged (it conceals the damage with borrowed pixels and no error) refuses
the video as corrupt_video when it is decoded on the way to the chosen frames (`_undamaged`), and
so does a packet its demuxer marks damaged when it is read on the way (`_decoded`), and a Matroska
or WebM file that ends before the segment it declares (`vlm._matroska`).

A single picture in a picture format (JPEG, PNG, WebP, a GIF of one frame), which FFmpeg opens as
a one-frame stream, is refused as `not_a_video` rather than made a clip of identical frames.

A path that names no file is refused as `missing_video_file`, and one that names something not
openable as a file (a directory, permission denied) as `unopenable_video_file`: no media was read,
so neither is `corrupt_video` (`_unopenable_file`).

Thread-safety: `decode_video` shares nothing between calls and may run on many threads at once.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import stat
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from zephon._errors import ConfigurationError, check_count, check_finite

from ._errors import VideoDecodeError
from ._image import CUT_FITS, DEFAULT_SPEC, ImageSpec, crop_scaled_size, image_grid, middle
from ._matroska import HEAD_BYTES, cut_short
from ._paths import open_media_file
from ._video_pixels import video_grid

__all__ = ["SampledVideo", "VideoSpec", "decode_video", "frame_interval_field", "frame_interval_s", "frame_times_field",
           "sample_times", "sample_video", "video_duration_field"]

_INTERPOLATION = {"nearest": "POINT", "box": "AREA", "bilinear": "BILINEAR", "hamming": "BICUBIC",
                  "bicubic": "BICUBIC", "lanczos": "LANCZOS"}


@dataclass(frozen=True)
class VideoSpec:
    """Which frames of a video to take and how to size them.

    Give at most one of `num_frames` (that many frames, 8 when neither is given, at the centres of equal slices of the
    window) or `fps` (one frame every 1/fps seconds from the window's start, at most `max_frames`).
    The window is [start_s, end_s) in seconds from the stream's start; `end_s=None` means the end
    of the stream. `image` sizes every frame as `decode_image` sizes an image, upright, resized
    once by FFmpeg (with `fit="crop"`, then its middle cut out; tiles and padding are refused):
    a display rotation of a quarter, half or three-quarter turn is applied unless
    `image.exif_transpose` is False (other angles are left as stored).

    `video_pixels` = (min, max) sizes the frames of a video together instead, as Qwen3-VL's video
    processor does (its `size`'s `shortest_edge` and `longest_edge`): the frames, counted in whole
    pairs, times their pixels lie within the bounds, so a video of more frames gets smaller ones
    (`vlm._video_pixels.video_grid`; `image` must have fit="pixels", whose cells it keeps and whose
    per-frame bounds it replaces). `max_frame_tokens` also caps each frame at that many merged
    cells, as qwen-vl-utils does (transformers' `cap_pixels_per_frame=True`, `max_video_tokens`).
    """

    num_frames: int | None = None
    fps: float | None = None
    start_s: float = 0.0
    end_s: float | None = None
    image: ImageSpec = DEFAULT_SPEC
    max_frames: int = 256
    video_pixels: tuple[int, int] | None = field(default=None, metadata={"fingerprint": "when set"})
    max_frame_tokens: int | None = field(default=None, metadata={"fingerprint": "when set"})

    def __post_init__(self) -> None:
        if self.num_frames is None and self.fps is None:
            object.__setattr__(self, "num_frames", 8)
        if self.num_frames is not None and self.fps is not None:
            raise ConfigurationError("VideoSpec: give num_frames or fps, not both")
        if self.num_frames is not None:
            object.__setattr__(self, "num_frames", check_count(self.num_frames, "VideoSpec: num_frames"))
        object.__setattr__(self, "max_frames", check_count(self.max_frames, "VideoSpec: max_frames"))
        for name in ("fps", "start_s", "end_s"):  # None: not given
            if getattr(self, name) is not None:
                check_finite(getattr(self, name), f"VideoSpec: {name}")
        if self.fps is not None and not self.fps > 0:
            raise ConfigurationError(f"VideoSpec: fps must be positive, got {self.fps}")
        if self.start_s < 0 or (self.end_s is not None and self.end_s <= self.start_s):
            raise ConfigurationError(f"VideoSpec: need 0 <= start_s < end_s, got {self.start_s} and {self.end_s}")
        if not isinstance(self.image, ImageSpec):
            raise ConfigurationError(f"VideoSpec: image must be an ImageSpec, got {self.image!r}")
        if self.image.fit in CUT_FITS:  # FFmpeg sizes a frame to its grid, whole
            raise ConfigurationError(f"VideoSpec: a frame is resized whole, not cut into tiles or padded "
                                     f"(fit={self.image.fit!r}); size frames with fit='fixed' (InternVL's video frames "
                                     f"are one tile each) or 'crop'")
        if self.image.longest_edge is not None:  # and in one step, straight to the spec's size
            raise ConfigurationError(f"VideoSpec: a frame is resized once, straight to its size; longest_edge="
                                     f"{self.image.longest_edge} (a first resize of pictures) does not apply to frames: "
                                     f"give the image spec longest_edge=None")
        self._check_video_pixels()

    def _check_video_pixels(self) -> None:
        """`video_pixels` (min, max), with min <= max and room for a pair of one-cell frames, sizes
        frames on the image's cells (fit="pixels"); `max_frame_tokens` narrows it and needs it."""
        if self.video_pixels is None:
            if self.max_frame_tokens is not None:
                raise ConfigurationError("VideoSpec: max_frame_tokens caps a frame's share of video_pixels; give "
                                         "video_pixels=(min, max) too")
            return
        if self.image.fit != "pixels":
            raise ConfigurationError(f"VideoSpec: video_pixels sizes frames on the cells of an image spec of "
                                     f"fit='pixels' (Qwen's), got fit={self.image.fit!r}")
        bounds = self.video_pixels
        if isinstance(bounds, (str, bytes)) or not hasattr(bounds, "__len__") or len(bounds) != 2:
            raise ConfigurationError(f"VideoSpec: video_pixels must be (min, max), got {bounds!r}")
        least, most = (check_count(n, "VideoSpec: video_pixels", 0) for n in bounds)
        pair = 2 * self.image.cell**2
        if not least <= most or most < pair:
            cell = self.image.cell
            raise ConfigurationError(f"VideoSpec: video_pixels must be (min, max) with min <= max and max at least "
                                     f"two frames of one {cell}x{cell} cell ({pair}), got {bounds!r}")
        object.__setattr__(self, "video_pixels", (least, most))
        if self.max_frame_tokens is not None:
            tokens = check_count(self.max_frame_tokens, "VideoSpec: max_frame_tokens")
            object.__setattr__(self, "max_frame_tokens", tokens)

    @classmethod
    def qwen3_vl(cls, **kwargs) -> VideoSpec:
        """Qwen3-VL's video sizing as transformers' `Qwen3VLVideoProcessor` states it: 2 frames a
        second, at most 768, each of `ImageSpec.qwen3_vl()`'s 32 px cells, the whole video within
        [128, 768] x 32 x 32 pixels (its `size`). A checkpoint's `video_preprocessor_config.json`
        may set other bounds: `VideoSpec.qwen3_vl(video_pixels=(shortest_edge, longest_edge))`.
        The frames are taken by Zephon's rule (`sample_times`: from the window's start, 1/fps
        apart), not the processor's (evenly over the frame indices, at least 4)."""
        return cls(**{"fps": 2.0, "max_frames": 768, "image": ImageSpec.qwen3_vl(),
                      "video_pixels": (128 * 32 * 32, 768 * 32 * 32), **kwargs})

    @classmethod
    def llava_onevision(cls, **kwargs) -> VideoSpec:
        """LLaVA-OneVision's frames as `LlavaOnevisionVideoProcessor` sizes them: each resized
        whole to 384x384, bicubically (FFmpeg's), and travelling as 24x24 patches of 16 px, as
        OneVision's pictures do; 8 frames at the centres of equal slices unless `num_frames` or
        `fps` say otherwise (the processor takes the frames it is given). Pair with
        `LlavaNextPlaceholders.llava_onevision(tokenizer)`."""
        frames = ImageSpec(patch_size=16, fit="fixed", size=(384, 384), resample="bicubic")
        return cls(**{"image": frames, **kwargs})

    @classmethod
    def gemma4(cls, max_soft_tokens: int = 70, **kwargs) -> VideoSpec:
        """Gemma 4's frames as `Gemma4VideoProcessor` sizes them: each a picture of
        `ImageSpec.gemma4(max_soft_tokens)` (70 soft tokens a frame, its default), 32 frames at
        the centres of equal slices unless `num_frames` or `fps` say otherwise (the processor
        spreads its 32 evenly over the frame indices). Pair with
        `PadPlaceholders.gemma4(tokenizer, video=True)` and `FrameText.gemma4(tokenizer)`."""
        frames = {} if "fps" in kwargs else {"num_frames": 32}
        return cls(**{**frames, "image": ImageSpec.gemma4(max_soft_tokens), **kwargs})

    @classmethod
    def llava_next_video(cls, **kwargs) -> VideoSpec:
        """LLaVA-NeXT-Video's frames as its video processor sizes them (`shortest_edge`, then
        `crop_size`), at the 336 px of the checkpoints' CLIP tower (their
        `vision_config.image_size`; the processor class's own default is 224): the shorter side to
        336, bicubically (FFmpeg's), the middle 336x336 cut out, 24x24 patches of 14 px; 8 frames
        at the centres of equal slices unless `num_frames` or `fps` say otherwise. Pair with
        `LlavaNextPlaceholders.llava_next_video(tokenizer)`."""
        frames = ImageSpec(patch_size=14, fit="crop", size=(336, 336), resample="bicubic")
        return cls(**{"image": frames, **kwargs})


def sample_times(duration_s: float, spec: VideoSpec) -> list[float]:
    """Target times in seconds from the stream's start, ascending. Raises if the window is empty."""
    span = _window_span(duration_s, spec)
    if spec.num_frames is not None:
        return [spec.start_s + (k + 0.5) * span / spec.num_frames for k in range(spec.num_frames)]
    count = min(spec.max_frames, max(1, math.ceil(span * spec.fps)))
    return [spec.start_s + k / spec.fps for k in range(count) if k / spec.fps < span] or [spec.start_s]


def frame_interval_field(frames_field: str) -> str:
    """The field `decode_video` writes a video's `frame_interval_s` to, beside its frames' field
    (`pixels` -> `pixels_frame_interval_s`), where the packer looks for it."""
    return f"{frames_field}_frame_interval_s"


def frame_times_field(frames_field: str) -> str:
    """The field `decode_video` writes a video's frame times to (`pixels` -> `pixels_frame_times_s`):
    Qwen3-VL writes each temporal patch's time as text before it."""
    return f"{frames_field}_frame_times_s"


def video_duration_field(frames_field: str) -> str:
    """The field `decode_video` writes a video's duration to (`pixels` -> `pixels_duration_s`):
    SmolVLM2 writes the length of the video its frames come from as text before them."""
    return f"{frames_field}_duration_s"


def frame_interval_s(duration_s: float, spec: VideoSpec) -> float:
    """Seconds between two of the spec's sampled frames of a video lasting `duration_s`: the
    window over `num_frames`, or 1/fps. Qwen2.5-VL spaces a video's temporal positions by it
    (its `second_per_grid_ts` is two of these), so the stage writes it beside the frames."""
    if spec.num_frames is not None:
        return _window_span(duration_s, spec) / spec.num_frames
    return 1 / spec.fps


def _window_span(duration_s: float, spec: VideoSpec) -> float:
    end = duration_s if spec.end_s is None else min(spec.end_s, duration_s)
    if not end > spec.start_s:
        raise VideoDecodeError(
            "video_too_short", f"window starts at {spec.start_s}s but the video lasts {duration_s:.3f}s"
        )
    return end - spec.start_s


_EMPTY = "{} holds 0 bytes (an empty file or member)"
"""The detail of a video that holds nothing, as bytes or as a file: no damage to look for."""


def _open(source):
    import av

    path = None if isinstance(source, (bytes, bytearray, memoryview)) else os.fsdecode(source)
    try:
        if path is None:
            return av.open(io.BytesIO(bytes(source)), mode="r")
        # FFmpeg reads a name as a URL when it starts like one (data:, pipe:N, http://, ...): a
        # path from the data could read a descriptor of the worker or the network. "file:" keeps
        # it a local file (the stage has made a relative path from the data absolute: `vlm._paths`).
        return av.open("file:" + path, mode="r")
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - FFmpeg reports bad input in many ways
        if path is None:
            detail = _EMPTY.format("the video") if not len(source) else _ffmpeg_said(exc)
            raise VideoDecodeError("corrupt_video", detail) from None
        raise _unopenable_file(path) or VideoDecodeError("corrupt_video", _ffmpeg_said(exc)) from None


def _unopenable_file(path: str) -> VideoDecodeError | None:
    """Why no media could be read at `path`, asked of the OS once FFmpeg has failed to open it:
    missing_video_file or unopenable_video_file where the OS cannot open a file there
    (`vlm._paths.open_media_file`), corrupt_video saying so where the file holds 0 bytes (FFmpeg's
    words, "Invalid data", sent the user looking for damage), None when the file opens and holds
    bytes, so that FFmpeg's failure was about them (corrupt_video).

    A missing file is no damaged media: counted as corrupt_video, it sent an operator looking for
    damage when a copy had left out a folder. Only on this failure path: a video that opens pays
    nothing for it.
    """
    try:
        descriptor, status = open_media_file(path, "video", VideoDecodeError)
    except VideoDecodeError as exc:
        return exc
    os.close(descriptor)
    if stat.S_ISREG(status.st_mode) and status.st_size == 0:
        return VideoDecodeError("corrupt_video", _EMPTY.format(f"the file at {path!r}"))
    return None


def _duration(container, stream, end: int | None) -> float:
    """Seconds from the stream's first to its last presentation: the stream's own duration, else
    (Matroska, WebM) the end of its last packet `end`, else the container's as a last resort. The
    container's runs to the end of its longest stream: taken while the video's own end was known,
    it gave a 1 s video with 3 s of sound targets past its last frame, i.e. copies of that frame."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if end is not None and stream.time_base is not None:
        return float((end - (stream.start_time or 0)) * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # AV_TIME_BASE
    raise VideoDecodeError("corrupt_video", "the container announces no duration")


def _refuse_a_cut_matroska(source) -> None:
    """Refuse a Matroska or WebM file that ends before the segment it declares (`vlm._matroska`):
    read from a record's bytes, or from the first bytes and size of the file at a path."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        head, length = bytes(source[:HEAD_BYTES]), len(source)
    else:
        with open(os.fsdecode(source), "rb") as file:
            head, length = file.read(HEAD_BYTES), os.fstat(file.fileno()).st_size
    why = cut_short(head, length)
    if why is not None:
        raise VideoDecodeError("corrupt_video", why)


DEFAULT_VIDEO_SPEC = VideoSpec()
"""8 frames over the whole video, sized like DEFAULT_SPEC images."""


class SampledVideo(NamedTuple):
    """What `sample_video` took from a video: `frames` (T, H, W, 3) uint8; `interval_s`, the
    seconds between two sampled frames (`frame_interval_s`); `times_s` (T,) float64, each frame's
    presentation time in seconds from the stream's start, 0 at the earliest (a frame shown at two
    targets, twice); `duration_s`, the whole stream's, whatever window the frames were taken from."""

    frames: np.ndarray
    interval_s: float
    times_s: np.ndarray
    duration_s: float


def decode_video(source: bytes | str | os.PathLike, spec: VideoSpec = DEFAULT_VIDEO_SPEC) -> np.ndarray:
    """Decode the spec's frames of a video to (T, H, W, 3) uint8 (`sample_video`'s frames)."""
    return sample_video(source, spec).frames


def sample_video(source: bytes | str | os.PathLike, spec: VideoSpec = DEFAULT_VIDEO_SPEC) -> SampledVideo:
    """Decode the spec's frames of a video, with the seconds between two sampled frames and the
    time each frame is shown (`SampledVideo`).

    Raises `VideoDecodeError`: corrupt_video (bytes FFmpeg cannot read, no video stream or no frame in it,
    decoder error, a frame decoded or a packet read on the way that FFmpeg marks damaged: `_undamaged`,
    `_decoded`), video_too_short (the window lies past the end), decompression_bomb (frame too large),
    not_a_video (a single picture in a picture format: a JPEG, PNG, WebP, a GIF of one frame), and
    for a path missing_video_file (no file there) or unopenable_video_file (a directory, permission
    denied...: `_unopenable_file`).
    """
    container = _open(source)
    try:
        if "matroska" in container.format.name.split(","):  # FFmpeg's "matroska,webm"
            _refuse_a_cut_matroska(source)
        return _decode(container, spec)
    except VideoDecodeError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise VideoDecodeError("corrupt_video", _ffmpeg_said(exc)) from None
    finally:
        container.close()


_IN_MEMORY = "<none>"
"""The file name PyAV gives FFmpeg's errors about bytes read from memory."""


def _ffmpeg_said(exc: Exception) -> str:
    """An error's words for the detail. PyAV names bytes read from memory '<none>', so FFmpeg's
    error on a record's bytes (a WebDataset member) read "Invalid data found when processing
    input: '<none>'", as if a file of that name were at fault: said instead to be the bytes."""
    if getattr(exc, "filename", None) == _IN_MEMORY and getattr(exc, "strerror", None):
        return f"{type(exc).__name__}: {exc.strerror} (FFmpeg reading the record's bytes)"
    return f"{type(exc).__name__}: {exc}"


def _decode(container, spec: VideoSpec) -> SampledVideo:
    from av.video.reformatter import VideoReformatter

    # A cover picture (music files, podcasts) is listed as a video stream marked as attached;
    # it is no video, and taken for one it failed to seek with a bare "Operation not permitted".
    streams = [s for s in container.streams.video if not s.disposition & _ATTACHED_PICTURE]
    if not streams:
        raise VideoDecodeError("corrupt_video", "no video stream")
    stream = streams[0]
    # FFmpeg conceals a damaged slice by borrowing pixels, and how depends on its thread count,
    # by default one per CPU this thread may run on. A frame it marks is refused (`_undamaged`),
    # but not every decoder marks what it conceals: a job's cpuset or another node would change
    # the pixels of such bytes. One thread decodes sound bytes to the same pixels as many do.
    stream.codec_context.thread_count = 1
    width, height = stream.codec_context.width, stream.codec_context.height
    if width < 1 or height < 1:
        raise VideoDecodeError("corrupt_video", f"stream announces a {width}x{height} picture")
    if width * height > spec.image.max_image_pixels:
        raise VideoDecodeError("decompression_bomb", f"{width}x{height} frames exceed "
                               f"max_image_pixels={spec.image.max_image_pixels}")
    time_base = stream.time_base
    origin = stream.start_time or 0
    keyframes, end, timed = _index(container, stream)
    if end is None:  # an empty track beside the sound: nothing to seek to, and a duration of 0 or none
        raise VideoDecodeError("corrupt_video", "the video stream holds no timed frames")
    if timed == 1 and _is_picture_format(container.format.name):
        # FFmpeg opens a JPEG, PNG, WebP... as a stream of one frame: it became `num_frames`
        # copies of the picture (a GIF of one frame, with no delay, "a video of 0.000s").
        raise VideoDecodeError("not_a_video", f"a single picture ({container.format.name}), not a video")
    duration = _duration(container, stream, end)
    targets = [origin + _last_tick_at(t, time_base) for t in sample_times(duration, spec)]
    chosen = _choose_frames(container, stream, targets, keyframes)
    turns = _quarter_turns(chosen[0], spec.image)
    upright = (width, height) if turns % 2 else (height, width)
    if spec.video_pixels is None:
        rows, cols = image_grid(*upright, spec.image)
    else:
        rows, cols = video_grid(len(chosen), *upright, spec.image, spec.video_pixels, spec.max_frame_tokens)
    cropped = spec.image.fit == "crop"  # resized whole to the scaled size, then its middle cut out
    size = crop_scaled_size(*upright, spec.image)[::-1] if cropped else \
        (cols * spec.image.patch_size, rows * spec.image.patch_size)  # (width, height) upright
    if size[0] * size[1] > spec.image.max_image_pixels:  # a thin strip scaled up: a bomb of our making
        raise VideoDecodeError("decompression_bomb", f"fit='crop' scales its {width}x{height} frames to "
                               f"{size[0]}x{size[1]} before cutting the middle, more than max_image_pixels="
                               f"{spec.image.max_image_pixels}")
    stored = size[::-1] if turns % 2 else size
    # A reformatter of this call's own, not `frame.reformat`: PyAV 19 keeps one swscale context
    # per thread for that, with FFmpeg 8's slice threads, and a forked worker inherits the forking
    # thread's context without its threads; resizing to another size there waited for ever.
    reformatter = VideoReformatter()
    converted: dict[int, np.ndarray] = {}
    frames = []
    for frame in chosen:
        key = id(frame)
        if key not in converted:
            pixels = reformatter.reformat(frame, width=stored[0], height=stored[1], format="rgb24",
                                          interpolation=_INTERPOLATION[spec.image.resample]).to_ndarray()
            pixels = np.rot90(pixels, turns)
            converted[key] = middle(pixels, spec.image.size) if cropped else pixels
        frames.append(converted[key])
    # From the stream's start; a frame stamped before it (an edit list's lead-in) is shown at 0.
    times = np.array([max(0.0, float((frame.pts - origin) * time_base)) for frame in chosen], dtype=np.float64)
    return SampledVideo(np.stack(frames), frame_interval_s(duration, spec), times, duration)


def _quarter_turns(frame, image: ImageSpec) -> int:
    """Counter-clockwise quarter turns that show `frame` upright: its display matrix's rotation
    (PyAV gives it counter-clockwise, as `np.rot90` turns), 0 when that is not a multiple of 90
    degrees or `image.exif_transpose` is off. Every frame of a stream carries the stream's matrix."""
    rotation = frame.rotation if image.exif_transpose else 0
    return (rotation // 90) % 4 if rotation % 90 == 0 else 0


_ATTACHED_PICTURE = 0x400
"""FFmpeg's AV_DISPOSITION_ATTACHED_PIC: a stream that is one picture (cover art), not a video."""

_FLOAT_SLACK_S = Fraction(1, 10**9)
"""Far above a float time's rounding error (~1e-16 relative), far below any frame interval."""


def _last_tick_at(t: float, time_base: Fraction) -> int:
    """The last tick of `time_base` at or before time `t` (seconds from the stream's start).

    `t` is the float form of an exact time (k / fps, a slice's centre), which can fall a hair
    before it: k=3 at 10 fps is 0.29999999999999998890, and flooring that picked the frame before
    the one at 0.3 s, so sampling at a video's own rate dropped some frames and doubled others.
    A nanosecond of slack lets a time that is a frame's time to float precision take that frame.
    """
    return math.floor((Fraction(t) + _FLOAT_SLACK_S) / time_base)


def _index(container, stream) -> tuple[list[int], int | None, int]:
    """From a demux pass (packets only, no decoding): the presentation times of the stream's
    keyframes, where its last packet ends (None without timed packets), and how many timed
    packets it holds."""
    keyframes, end, timed = [], None, 0
    for packet in container.demux(stream):
        if packet.pts is None:
            continue
        timed += 1
        if packet.is_keyframe:
            keyframes.append(packet.pts)
        finish = packet.pts + (packet.duration or 0)
        end = finish if end is None else max(end, finish)
    return sorted(keyframes), end, timed


_PICTURE_FORMATS = frozenset({"gif", "apng", "ico", "webp"})
"""FFmpeg demuxers of picture formats besides its image readers (`*_pipe`, `image2*`)."""


def _is_picture_format(name: str) -> bool:
    """Whether FFmpeg's demuxer `name` (one name or a comma-separated list) reads a picture
    format: one frame in it is a still picture. A video container (MP4, Matroska, AVI) holding
    one frame is a one-frame clip, which gives copies of it as documented."""
    return any(part.endswith("_pipe") or part.startswith("image2") or part in _PICTURE_FORMATS
               for part in name.split(","))


def _choose_frames(container, stream, targets: list[int], keyframes: list[int]) -> list:
    """For each target pts (ascending), the last frame with pts <= target (the first frame if none);
    `keyframes` are the stream's keyframe times (`_index`).

    The decoder seeks only when the keyframe before the next target lies past the frame it is at,
    i.e. when seeking skips decoding work; otherwise it decodes on. Either way a target gets the
    frame shown at its time, so how the decoder was driven never changes the answer.
    """
    chosen: list = []
    decoder = None
    previous = pending = None  # last frame at or before the target; a decoded frame not yet placed
    exhausted = False
    for target in targets:
        before = bisect.bisect_right(keyframes, target) - 1
        keyframe = keyframes[before] if before >= 0 else None
        here = pending if pending is not None else previous
        if decoder is None or (keyframe is not None and here is not None and keyframe > here.pts):
            decoder, pending = _seek_at_or_before(container, stream, keyframes, target)
            previous = None
            exhausted = pending is None
        while not exhausted:
            frame = pending if pending is not None else next(decoder, None)
            pending = None
            if frame is None:
                exhausted = True
            elif frame.pts is None:
                continue
            elif frame.pts > target:
                pending = frame
                break
            else:
                previous = frame
        pick = previous if previous is not None else pending
        if pick is None:
            raise VideoDecodeError("corrupt_video", "no frame could be decoded")
        chosen.append(pick)
    return chosen


def _seek_at_or_before(container, stream, keyframes: list[int], target: int):
    """Seek so that decoding starts at or before `target`; return the decoder and its first frame.

    Demuxers honour `backward=True` differently: MPEG-TS searches by decode time and AVI with
    B-frames lands a keyframe late, so the first frame decoded after a seek can lie past the target,
    or nothing decodes at all. Each offset of `_seek_offsets` is tried in turn until the first frame
    is at or before the target; from the last, the stream's start, whatever decodes first is taken
    (the stream's first frame). Every step depends on the bytes alone, so the choice does too.
    """
    for offset in _seek_offsets(keyframes, target):
        container.seek(offset, stream=stream, backward=True, any_frame=False)
        decoder = _undamaged(_decoded(container, stream))
        first = next((frame for frame in decoder if frame.pts is not None), None)
        if first is not None and first.pts <= target:
            break
    return decoder, first


def _decoded(container, stream):
    """The stream's frames from where the container is, decoded packet by packet, refusing the
    video at the first packet its demuxer marks damaged (`is_corrupt`: AV_PKT_FLAG_CORRUPT; MPEG-TS
    marks a packet that lost a transport packet or holds one a receiver flagged as in error).

    Its frame may decode unmarked (whole bytes under an error flag, or lost bytes that still read
    as valid data), so the mark is taken from the packet. The packets read are those of the frames
    decoded on the way (`_undamaged`), with the decoder's fixed lookahead at one thread: a pure
    function of the bytes and the spec. `container.decode` does the same without showing the packets.
    """
    for packet in container.demux(stream):
        if packet.is_corrupt:
            raise VideoDecodeError("corrupt_video", f"the demuxer reports the packet at pts {packet.pts} damaged "
                                   "(its frame would be decoded from what arrived)")
        yield from packet.decode()


def _undamaged(frames):
    """The decoder's frames, refusing the video at the first one FFmpeg marks as damaged.

    FFmpeg conceals a slice it cannot decode (blocks borrowed from a neighbour or the previous
    frame) and returns the frame with no error, even with `err_detect=explode`; it marks the
    frame instead (`is_corrupt`: AV_FRAME_FLAG_CORRUPT or decode_error_flags). A frame predicted
    from a concealed one carries no mark, but decoding starts at a keyframe and returns frames in
    display order, so the concealed frame comes, and is refused, before the frames predicted from
    it; only a B-frame shown before its damaged reference can come first, and is refused only if
    that reference is decoded on the way (the frame decoded past each target, when it is next).
    Frames never decoded (groups a seek passed over, those after the last target) are not looked
    at: they shape no chosen frame.
    """
    for frame in frames:
        if frame.is_corrupt:
            raise VideoDecodeError("corrupt_video", f"FFmpeg reports the frame at pts {frame.pts} damaged "
                                   "(it would conceal the damage with borrowed pixels)")
        yield frame


def _seek_offsets(keyframes: list[int], target: int) -> list[int]:
    """Seek offsets for `target`, latest first: the target itself (where the seek lands right on
    most containers), the keyframe at or before it, then keyframes 1, 2, 4, ... further back, so a
    demuxer that overshoots far costs few retries, and last the stream's start."""
    offsets = {target, min(0, keyframes[0]) if keyframes else 0}
    index, step = bisect.bisect_right(keyframes, target) - 1, 1
    while index >= 0:
        offsets.add(keyframes[index])
        index, step = index - step, step * 2
    return sorted(offsets, reverse=True)
