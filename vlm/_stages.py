"""Stateless chunk stages: decode each record's image or video bytes into pixels.

Each stage is a frozen dataclass that is both the operator's configuration and its function:
`stage(chunk_records) -> chunk_records`. It is pure (a new ChunkRecords and new record dicts; the
input is not modified; a chunk of a dataset outside its `datasets` is returned as it came), so it
may run on any worker, in any order, any number of times. It has
the core's record-operator shape (`kind`, `name`, `parallelism`, `build(on_error)`,
`build_for_estimate()`, `fingerprint()`, `media_fields`), so `Pipeline.apply(DecodeImages(...))`
takes it, and a `pack_flat` after it is refused (it would drop the pixels).

A record that cannot be decoded is dropped and reported in `skipped` with its reason
(missing_image / missing_video when no candidate field is present or a video field holds an
empty list, several_videos when it holds more than one, not_media_bytes when the field holds
something other than encoded bytes (or, for a video, or an image with `paths=True`, a path),
unresolvable_path when such a relative path is in a shard that is not an absolute local path,
the decode error's reason, or processor_error), or, with `on_error="raise"`, fails with
`BadRecordError` naming its address. A path whose file cannot be opened (missing_video_file,
unopenable_video_file, missing_image_file, unopenable_image_file) has its detail name the path
as the record writes it and the shard it was resolved beside.

Thread-safety: stages hold no mutable state; a user's image processor must itself be safe to
call from several threads when the thread runner runs this stage with parallelism > 1
(transformers' image processors are stateless when called).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon._dataset_scope import check_dataset_names, with_scope
from zephon._errors import BadRecordError, ConfigurationError, check_count, check_field_name
from zephon._field_names import fields_it_has
from zephon._fingerprint import stable_description
from zephon._records import ChunkRecords, RecordAddress
from zephon._sha256 import sha256

from ._errors import VIDEO_FILE_REASONS, ImageDecodeError, MediaDecodeError, VideoDecodeError
from ._deferred import DeferredImage
from ._image import (DEFAULT_SPEC, SHOWN_SIZE_FITS, ImageSpec, decode_image, decode_image_with_size, load_rgb, patchify,
                     probe_image, probe_image_with_size, sizes_field)
from ._paths import as_the_record_names_it, read_image_file, resolve_beside_shard
from ._video import (DEFAULT_VIDEO_SPEC, VideoSpec, frame_interval_field, frame_times_field, sample_video,
                     video_duration_field)

__all__ = ["DEFAULT_IMAGE_FIELDS", "DEFAULT_VIDEO_FIELDS", "DecodeImages", "DecodeVideo", "require_decoder",
           "run_processor"]

# The optional package each decoder imports, as pip names it.
_DECODER_PACKAGES = {"PIL": "Pillow (or pillow-simd)", "av": "PyAV"}


def require_decoder(module: str, user: str) -> None:
    """Refuse a decoding stage whose decoder is not installed when the pipeline is built: workers
    import it lazily, so it would otherwise fail as a worker's traceback once data flows."""
    if importlib.util.find_spec(module) is None:
        raise ConfigurationError(
            f"{user} needs {_DECODER_PACKAGES[module]}, which is not installed: pip install 'zephon[vlm]'"
        )

DEFAULT_IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
"""WebDataset member extensions tried in order when no field is given (the tar reader names every
field in lower case, so `0001.JPG` is found as `jpg`)."""

DEFAULT_VIDEO_FIELDS = ("mp4", "webm", "mkv", "mov", "avi")

ON_ERROR = ("skip", "raise")


class _Skip(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason, self.detail = reason, detail


def _fields(value: str | Any) -> tuple[str, ...]:
    if not isinstance(value, (str, list, tuple)):
        raise ConfigurationError(f"field must be a field name or a non-empty list of them, got {value!r}")
    fields = (value,) if isinstance(value, str) else tuple(value)
    if not fields or not all(isinstance(f, str) and f for f in fields):
        raise ConfigurationError(f"field must be a field name or a non-empty list of them, got {value!r}")
    return fields


def _check_common(stage, spec_type: type, flags: tuple[str, ...] = ("keep_source",),
                  names: tuple[str, ...] = ("output_field",)) -> None:
    object.__setattr__(stage, "field", _fields(stage.field))
    # As tokenize checks its own: "no" would act as True does, and an empty or None field name
    # would be written as a key nothing reads.
    for flag in flags:
        if not isinstance(getattr(stage, flag), bool):
            raise ConfigurationError(f"{stage.name}: {flag} must be True or False, got {getattr(stage, flag)!r}")
    for name in names:
        check_field_name(getattr(stage, name), f"{stage.name}: {name}")
    if stage.on_error is not None and stage.on_error not in ON_ERROR:
        raise ConfigurationError(f"{stage.name}: on_error must be one of {ON_ERROR}, got {stage.on_error!r}")
    object.__setattr__(stage, "parallelism", check_count(stage.parallelism, f"{stage.name}: parallelism"))
    object.__setattr__(stage, "datasets", check_dataset_names(stage.datasets, stage.name))
    if not isinstance(stage.spec, spec_type):
        raise ConfigurationError(f"{stage.name}: spec must be of type {spec_type.__name__}, got {stage.spec!r}")


def _first_present(record: dict, fields: tuple[str, ...], reason: str) -> tuple[str, Any]:
    for name in fields:
        value = record.get(name)
        if value is not None:
            return name, value
    raise _Absent(reason, fields, record)


class _Absent(_Skip):
    """A record without any of a stage's candidate fields. The fields it has are named only when
    the detail is read (a `BadRecordError` under `on_error="raise"`): a counted skip never reads it."""

    def __init__(self, reason: str, fields: tuple[str, ...], record: dict) -> None:
        self.reason, self.fields, self.record = reason, fields, record

    @property
    def detail(self) -> str:
        return f"none of the fields {list(self.fields)} is present; {fields_it_has(self.fields, self.record)}"


def _items(value: Any, allow_paths: bool) -> tuple[list[Any], bool]:
    """(items, single): one media value or a list of them. HF image structs {"bytes": ...} unwrap."""
    if isinstance(value, (list, tuple)):
        return [_unwrap(v, allow_paths) for v in value], False
    return [_unwrap(value, allow_paths)], True


def _unwrap(value: Any, allow_paths: bool) -> Any:
    """The media in one item: its bytes, or where paths are allowed (video, images with
    `paths=True`) its path, bare or as a Hugging Face struct holding only a path
    ({"bytes": None, "path": ...}, a local file's row): one path, read alike whichever form
    carries it."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif isinstance(value.get("path"), str):
            if not allow_paths:
                raise _Skip("not_media_bytes", f"the struct holds no bytes, only the path {value['path']!r}; "
                            + _IMAGE_PATHS_UNREAD)
            value = value["path"]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    if isinstance(value, (str, os.PathLike)):
        if allow_paths:
            return value
        raise _Skip("not_media_bytes", f"expected encoded bytes, got the {type(value).__name__} "
                    f"{os.fspath(value)!r}; " + _IMAGE_PATHS_UNREAD)
    raise _Skip("not_media_bytes", f"expected encoded bytes, got {type(value).__name__}")


# What an image field holding a path is told: LLaVA-style JSON names its images by file, which a
# user otherwise meets as `not_media_bytes` on every record with no way on.
_IMAGE_PATHS_UNREAD = (
    "decode_images reads encoded bytes unless given paths=True: decode_images(paths=True) reads the file a path "
    "names (a relative one beside the record's shard), or store each image's bytes in the data"
)


def _resolve(path: str | os.PathLike, address: RecordAddress) -> str:
    """`path` resolved beside the record's shard (`vlm._paths`), or skipped as unresolvable_path."""
    resolved = resolve_beside_shard(path, address.shard)
    if resolved is None:
        raise _Skip("unresolvable_path", f"the relative path {os.fspath(path)!r} is in the shard "
                    f"{address.shard}, not an absolute local path: no directory to resolve it from")
    return resolved


def _image_bytes(item: Any, address: RecordAddress) -> bytes | bytearray | memoryview:
    """An image item's encoded bytes: as held, or read from the file its path names, a failure to
    read it naming the path as the record writes it and the shard it was resolved beside."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return item
    try:
        return read_image_file(_resolve(item, address))
    except ImageDecodeError as exc:
        raise ImageDecodeError(exc.reason, f"{exc.detail}; {as_the_record_names_it(item, address.shard)}") from None


def _apply(stage, batch: ChunkRecords, decode_record) -> ChunkRecords:
    """Run `decode_record(record, address)` on every record, dropping and counting the ones it refuses.

    A chunk of a dataset outside the stage's `datasets` is returned as it came, neither decoded nor
    counted: its records are another decoder's, or text that the packer places alone."""
    if stage.datasets is not None and batch.chunk.dataset not in stage.datasets:
        return batch
    out = ChunkRecords(
        batch.chunk, [], [], list(batch.skipped), list(batch.filtered),
        {reason: dict(details) for reason, details in batch.skip_details.items()},
    )
    fail_fast = stage.on_error == "raise"
    for record, address in zip(batch.records, batch.addresses):
        try:
            out.records.append(decode_record(record, address))
        except (_Skip, MediaDecodeError) as exc:
            if fail_fast:
                raise BadRecordError(address, exc.reason, exc.detail) from None
            # A callable, so that an absent field's detail (the fields the record has) is made only if kept.
            out.skip_one(address, exc.reason, lambda exc=exc: exc.detail)
            continue
        out.addresses.append(address)
    return out


def _describe(obj: Any) -> Any:
    if obj is None:
        return None
    if dataclasses.is_dataclass(obj):  # a field added since (`fingerprint="when set"`) only when set: old recipes keep theirs
        return {f.name: _describe(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("fingerprint") == "when set" and getattr(obj, f.name) is None)}
    if isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, (tuple, list)):
        return [_describe(v) for v in obj]
    described = {"class": f"{type(obj).__module__}.{type(obj).__qualname__}"}
    to_json = getattr(obj, "to_json_string", None)
    if callable(to_json):
        described["config_sha256"] = sha256(to_json().encode()).hexdigest()
    else:  # a processor of the user's own: its class alone let another configuration resume
        described["settings"] = stable_description(obj)
    return described


def _processor_patch_size(processor: Any) -> int:
    size = getattr(processor, "patch_size", None)
    if isinstance(size, dict):
        size = size.get("height")
    if hasattr(size, "height"):
        size = size.height
    if not isinstance(size, int):
        raise ConfigurationError(f"cannot read a patch size from {type(processor).__name__}")
    return size


def run_processor(processor: Any, image: Any) -> tuple[np.ndarray, tuple[int, int]]:
    """Run a transformers image processor on one image: (patch rows, (rows, cols) in patches).

    Qwen2-VL-style output (`pixel_values` as patch rows plus `image_grid_thw`) is passed through.
    Pixtral-style output (a padded (1, C, H, W) image plus `image_sizes`) is cropped to the image
    and cut into raster-order patch rows of (patch_row, patch_col, channel), like our own
    `pixel_values`. Other processors are refused with a message.
    """
    out = processor(images=image, return_tensors="np")
    pixel_values = np.asarray(out["pixel_values"])
    if "image_grid_thw" in out:
        t, h, w = (int(x) for x in np.asarray(out["image_grid_thw"]).reshape(-1, 3)[0])
        if t != 1:
            raise ConfigurationError(f"processor returned {t} temporal patches for one image")
        return np.ascontiguousarray(pixel_values.reshape(h * w, -1)), (h, w)
    if "image_sizes" in out and pixel_values.ndim == 4:
        height, width = (int(x) for x in np.asarray(out["image_sizes"]).reshape(-1, 2)[0])
        patch = _processor_patch_size(processor)
        picture = np.ascontiguousarray(pixel_values[0, :, :height, :width].transpose(1, 2, 0))
        return patchify(picture, patch), (height // patch, width // patch)
    raise ConfigurationError(
        f"unsupported image processor output {sorted(out.keys())}: expected image_grid_thw (Qwen2-VL style) "
        "or image_sizes (Pixtral style)"
    )


@dataclass(frozen=True)
class DecodeImages:
    """Decode `record[field]` (the first present of several candidate fields) into pixels.

    The field holds encoded bytes, a {"bytes": ...} struct (Hugging Face image columns), or a list
    of either for several images. `record[output_field]` becomes one (H, W, 3) uint8 array on the
    spec's patch grid, or a list of them. With a transformers `processor`, the image is decoded
    at full size (same refusals and RGB conversion) and handed to it; `record[output_field]`
    then holds its patch rows and `record[grid_field]` the (num_images, 2) int32 grid
    (see `run_processor`). The source field is dropped unless `keep_source`. The images of a
    `fit="split"`, `"anyres"` or `"canvas"` spec also get the (height, width) of each picture as
    shown, (num_images, 2) int32, in `record[output_field + "_sizes"]` (`sizes_field`):
    `Idefics3Placeholders` name each tile by the arrangement it gives, and LLaVA-NeXT unpads by it.
    A record's pictures are sized by `spec.for_pictures(count)`: the spec, or for a record of
    several under `several_pad` (LLaVA-OneVision's), each padded to one tile.

    With `defer=True` (no processor) only the header is parsed and checked here: the field holds
    `DeferredImage`s, and `pack_multimodal` has each row's images decoded on the workers just
    before the loader takes the row (see `vlm._deferred`; same pixels, a fraction of the memory).

    With `paths=True` an item may also be a path, bare or as a Hugging Face struct
    {"bytes": None, "path": ...} (LLaVA-style JSON lines name their images by file): the file is
    read here, a relative path beside the record's shard as `DecodeVideo` resolves one
    (unresolvable_path in a remote shard), and its bytes are decoded as if the record held them.
    No file there is skipped as `missing_image_file`, what cannot be read as a file (a directory,
    permission denied, a FIFO) as `unopenable_image_file`. With `defer=True` too, the
    `DeferredImage` holds the bytes read, not the path: the file is read once a pass, the header
    probed and the pixels decoded are of the same bytes (a file replaced between two reads would
    give pixels the planned grid does not fit), and what crosses to the process runner's worker is
    bytes it need not find on its own; the cost is the encoded bytes waiting in buffers, the memory
    `defer` is designed around. Off by default: without it a path is skipped as `not_media_bytes`,
    and reading it instead would change which records an existing recipe keeps; on, it enters the
    fingerprint.

    `datasets` (None: every dataset) names the datasets whose records this stage decodes; the
    records of the others pass unchanged (see `_apply`), so that a `decode_video` scoped to the
    video datasets of the mixture decodes their records.
    """

    field: str | tuple[str, ...] = DEFAULT_IMAGE_FIELDS
    spec: ImageSpec = DEFAULT_SPEC
    output_field: str = "pixels"
    processor: Any = None
    on_error: str | None = None
    keep_source: bool = False
    grid_field: str = "image_grid"
    parallelism: int = 1
    defer: bool = False
    datasets: tuple[str, ...] | None = None
    paths: bool = False
    name: str = "decode_images"
    kind = "record"

    def __post_init__(self) -> None:
        require_decoder("PIL", "decode_images")
        _check_common(self, ImageSpec, flags=("keep_source", "defer", "paths"),
                      names=("output_field", "grid_field"))
        if self.defer and self.processor is not None:
            raise ConfigurationError("decode_images: defer=True decodes with the ImageSpec after packing; "
                                     "an image processor's output cannot be deferred")

    @property
    def dataset_scope(self) -> tuple[str, ...] | None:
        """`datasets`, as the operator protocol's scope that the loader checks against the work
        source (`zephon._dataset_scope`); a property, so the constructor and fingerprint stay as they were."""
        return self.datasets

    def build(self, on_error: str) -> DecodeImages:
        """This stage with the pipeline's error policy where it has none of its own."""
        return dataclasses.replace(self, on_error=self.on_error or on_error)

    def build_for_estimate(self) -> DecodeImages:
        """Skipping and counting even under a policy of its own: see `RecordOperator.build_for_estimate`."""
        return dataclasses.replace(self, on_error="skip")

    def fingerprint(self) -> dict:
        """The recipe's record of this stage; `paths` is in it only when on, so a recipe written
        before the option existed keeps its digests and its checkpoints resume."""
        fingerprint = with_scope({
            "op": self.name, "field": list(self.field), "spec": _describe(self.spec),
            "output_field": self.output_field, "processor": _describe(self.processor),
            "keep_source": self.keep_source, "grid_field": self.grid_field, "defer": self.defer,
        }, self.datasets)
        if self.paths:
            fingerprint["paths"] = True
        return fingerprint

    @property
    def media_fields(self) -> tuple[str, ...]:
        """The field of its pixels (see `zephon._record_ops.RecordOperator`): `pack_flat` is refused after it."""
        return (self.output_field,)

    def patch_layout(self) -> tuple[int, np.dtype]:
        """(patch_dim, dtype) of the rows this stage's images become in `pixel_values`."""
        if self.processor is None:
            return self.spec.patch_dim, np.dtype(np.uint8)
        from PIL import Image

        rows, _ = run_processor(self.processor, Image.new("RGB", (64, 64)))
        return int(rows.shape[1]), rows.dtype

    def __call__(self, batch: ChunkRecords) -> ChunkRecords:
        return _apply(self, batch, self._decode_record)

    def _decode_record(self, record: dict, address: RecordAddress) -> dict:
        name, value = _first_present(record, self.field, "missing_image")
        items, single = _items(value, allow_paths=self.paths)
        if self.paths:
            items = [_image_bytes(item, address) for item in items]
        out = dict(record)
        if not self.keep_source:
            del out[name]
        spec = self.spec.for_pictures(len(items))  # LLaVA-OneVision sizes several pictures otherwise
        if self.defer:
            encoded = [bytes(data) for data in items]  # bytes stay as they are; views are copied once
            if self.spec.fit in SHOWN_SIZE_FITS:
                probed = [(data, *probe_image_with_size(data, spec)) for data in encoded]
                pixels = [DeferredImage(data, grid, spec, size) for data, grid, size in probed]
            else:
                pixels = [DeferredImage(data, probe_image(data, spec), spec) for data in encoded]
            out[self.output_field] = pixels[0] if single else pixels
            return out
        if self.processor is None and self.spec.fit in SHOWN_SIZE_FITS:
            sized = [decode_image_with_size(data, spec) for data in items]
            out[self.output_field] = sized[0].pixels if single else [image.pixels for image in sized]
            out[sizes_field(self.output_field)] = np.array([image.size for image in sized], np.int32).reshape(-1, 2)
            return out
        if self.processor is None:
            pixels = [decode_image(data, spec) for data in items]
            out[self.output_field] = pixels[0] if single else pixels
            return out
        rows, grids = [], []
        for data in items:
            image = load_rgb(data, self.spec)
            try:
                patches, grid = run_processor(self.processor, image)
            except ConfigurationError:
                raise
            except Exception as exc:  # noqa: BLE001 - the user's processor refused this image
                raise _Skip("processor_error", f"{type(exc).__name__}: {exc}") from None
            rows.append(patches)
            grids.append(grid)
        out[self.output_field] = rows[0] if single else rows
        out[self.grid_field] = np.array(grids, dtype=np.int32).reshape(len(grids), 2)
        return out


@dataclass(frozen=True)
class DecodeVideo:
    """Decode `record[field]` (bytes, a {"bytes": ...} struct, a local path, bare or as a Hugging
    Face struct {"bytes": None, "path": ...}, or a list of one of them) into frames. A relative
    path names a file beside the record's shard; in a shard that is not an absolute local path
    (a remote one) it is skipped as `unresolvable_path` (`vlm._paths`), never opened from the
    worker's working directory. A path naming no file is skipped as `missing_video_file`, one
    naming what cannot be opened as a file (a directory, permission denied) as
    `unopenable_video_file`, not as corrupt media.

    `record[output_field]` becomes (T, H, W, 3) uint8 (the spec's frames on its patch grid), and
    `record[output_field + "_frame_interval_s"]` the seconds between two of them (Qwen2.5-VL's
    rotary positions space a video's temporal patches by it), and `record[output_field +
    "_frame_times_s"]` (T,) float64 the time each is shown at (Qwen3-VL writes it as text before
    each temporal patch); the multimodal packer treats the T
    frames as T images, or as one video in Qwen's video layout. The source field is dropped unless
    `keep_source`. `datasets` scopes the stage as `DecodeImages`'s does.
    """

    field: str | tuple[str, ...] = DEFAULT_VIDEO_FIELDS
    spec: VideoSpec = DEFAULT_VIDEO_SPEC
    output_field: str = "pixels"
    on_error: str | None = None
    keep_source: bool = False
    parallelism: int = 1
    datasets: tuple[str, ...] | None = None
    name: str = "decode_video"
    kind = "record"

    def __post_init__(self) -> None:
        require_decoder("av", "decode_video")
        _check_common(self, VideoSpec)

    @property
    def dataset_scope(self) -> tuple[str, ...] | None:
        """`datasets`, as the operator protocol's scope that the loader checks against the work
        source (`zephon._dataset_scope`); a property, so the constructor and fingerprint stay as they were."""
        return self.datasets

    def build(self, on_error: str) -> DecodeVideo:
        return dataclasses.replace(self, on_error=self.on_error or on_error)

    @property
    def media_fields(self) -> tuple[str, ...]:
        """The field of its frames, as `DecodeImages.media_fields`."""
        return (self.output_field,)

    def build_for_estimate(self) -> DecodeVideo:
        return dataclasses.replace(self, on_error="skip")

    def fingerprint(self) -> dict:
        return with_scope({"op": self.name, "field": list(self.field), "spec": _describe(self.spec),
                           "output_field": self.output_field, "keep_source": self.keep_source}, self.datasets)

    def __call__(self, batch: ChunkRecords) -> ChunkRecords:
        return _apply(self, batch, self._decode_record)

    def _decode_record(self, record: dict, address: RecordAddress) -> dict:
        name, value = _first_present(record, self.field, "missing_video")
        items, _ = _items(value, allow_paths=True)
        # A list (a `Sequence(Video)` column) of one video is that video; a record holds one.
        if not items:
            raise _Skip("missing_video", f"field {name!r} holds an empty list")
        if len(items) > 1:
            raise _Skip("several_videos", f"field {name!r} holds {len(items)} videos; one is supported")
        out = dict(record)
        if not self.keep_source:
            del out[name]
        video = items[0]
        if isinstance(video, (bytes, bytearray, memoryview)):
            return self._with_frames(out, sample_video(video, self.spec))
        path = _resolve(video, address)
        try:
            sampled = sample_video(path, self.spec)
        except VideoDecodeError as exc:
            if exc.reason not in VIDEO_FILE_REASONS:
                raise
            named = as_the_record_names_it(video, address.shard)
            raise VideoDecodeError(exc.reason, f"{exc.detail}; {named}") from None
        return self._with_frames(out, sampled)

    def _with_frames(self, out: dict, sampled) -> dict:
        out[self.output_field] = sampled.frames
        out[frame_interval_field(self.output_field)] = sampled.interval_s
        out[frame_times_field(self.output_field)] = sampled.times_s
        out[video_duration_field(self.output_field)] = sampled.duration_s
        return out
