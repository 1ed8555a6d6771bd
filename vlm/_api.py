"""Pipeline builder methods contributed by `vlm` (registered under the `zephon.pipeline` entry
points, so the core never imports this package): `decode_images`, `decode_video`,
`pack_multimodal`. Each takes the pipeline first and returns a new pipeline.
"""

from __future__ import annotations

from typing import Any

from zephon._dataset_scope import check_dataset_scopes, work_source_dataset_names
from zephon._errors import ConfigurationError
from zephon._record_ops import TokenizeOp

from ._decoder_checks import check_decoders_writing
from ._image import ImageSpec
from ._packing import PackMultimodal
from ._placeholders import Placeholders
from ._stages import (
    DEFAULT_IMAGE_FIELDS,
    DEFAULT_VIDEO_FIELDS,
    DecodeImages,
    DecodeVideo,
)
from ._video import VideoSpec

__all__ = ["decode_images", "decode_video", "pack_multimodal"]

# Operators that write no field but their own `output_field` (a filter writes none): a pipeline of
# only these holds no pixels but a decoder's and no token ids but a tokenize's. A map or a plugin's
# operator may write any field.
_WRITE_ONLY_THEIR_OUTPUT = frozenset({"decode_images", "decode_video", "tokenize", "filter"})


def decode_images(
    pipeline,
    field: str | tuple[str, ...] = DEFAULT_IMAGE_FIELDS,
    *,
    spec: ImageSpec | None = None,
    output_field: str = "pixels",
    processor: Any = None,
    keep_source: bool = False,
    parallelism: int = 1,
    on_error: str | None = None,
    defer: bool = False,
    datasets: str | list[str] | None = None,
):
    """Append a `DecodeImages` stage (on_error=None follows the pipeline's policy; `defer=True`
    decodes each image after packing, just before its row is taken: see `vlm._deferred`).
    `datasets` (a name or a list; None: every dataset) limits it to those datasets' records, the
    others passing unchanged: how image and video datasets are mixed in one pipeline."""
    stage = DecodeImages(field, spec or ImageSpec(), output_field, processor, on_error, keep_source,
                         parallelism=parallelism, defer=defer, datasets=datasets)
    return _append_scoped(pipeline, stage)


def decode_video(
    pipeline,
    field: str | tuple[str, ...] = DEFAULT_VIDEO_FIELDS,
    *,
    spec: VideoSpec | None = None,
    output_field: str = "pixels",
    keep_source: bool = False,
    parallelism: int = 1,
    on_error: str | None = None,
    datasets: str | list[str] | None = None,
):
    """Append a `DecodeVideo` stage (on_error=None follows the pipeline's policy; `datasets` as
    `decode_images`')."""
    return _append_scoped(pipeline, DecodeVideo(field, spec or VideoSpec(), output_field, on_error, keep_source,
                                                parallelism=parallelism, datasets=datasets))


def _append_scoped(pipeline, stage):
    """Append `stage`, refusing now a `datasets` that names no dataset of the work source (the
    loader checks again when it binds, for a stage given to `Pipeline.apply` directly)."""
    names = work_source_dataset_names(pipeline.source)
    if names is not None:
        check_dataset_scopes([stage], names)
    return pipeline.apply(stage)


def pack_multimodal(
    pipeline,
    max_length: int,
    placeholders: Placeholders,
    *,
    spec: ImageSpec | None = None,
    pad_id: int | None = None,
    image_position: str = "before_text",
    field: str = "input_ids",
    pixels_field: str | None = None,
    offsets_field: str = "image_offsets",
    max_open_rows: int = 16,
    mrope: bool = False,
):
    """Append a `PackMultimodal` accumulator. `spec` defaults to the last `decode_images` stage's,
    the patch layout (dim, dtype) to what that stage produces (its processor's, if any), and
    `pixels_field` (and the grid field) to the fields that stage writes ("pixels" without one).
    `image_position="after_bos"` puts a document's images after its first token, taken to be the
    BOS: refused after a `tokenize` of `field` that adds none (see `_check_bos`). A record that holds
    `offsets_field` has its images placed where that list says, whatever `image_position`.
    `mrope=True` (with `QwenPlaceholders`) adds `mrope_position_ids` to every row: the (temporal,
    height, width) rotary positions a Qwen2-VL-family model would compute itself (`vlm._mrope`)."""
    if image_position == "after_bos":
        _check_bos(pipeline, field)
    decoder = next((op for op in reversed(pipeline.operators) if isinstance(op, (DecodeImages, DecodeVideo))), None)
    if pixels_field is None:
        pixels_field = decoder.output_field if decoder is not None else "pixels"
    elif decoder is not None and all(getattr(op, "name", None) in _WRITE_ONLY_THEIR_OUTPUT
                                     for op in pipeline.operators):
        # No record would hold a field no decoder writes, so every document would be packed as its
        # text alone, unsaid. A map (or a plugin's operator) may write it: only decided without one.
        written = {op.output_field: op.name for op in pipeline.operators
                   if isinstance(op, (DecodeImages, DecodeVideo))}
        if pixels_field not in written:
            raise ConfigurationError(
                f"pack_multimodal(pixels_field={pixels_field!r}) reads a field no operator writes: "
                + ", ".join(f"{name} writes {field!r}" for field, name in written.items())
            )
    check_decoders_writing(pixels_field, pipeline.operators)  # the loader checks again, for a packer applied
    grid_field = decoder.grid_field if isinstance(decoder, DecodeImages) else "image_grid"
    if spec is None:
        spec = decoder.spec if isinstance(decoder, DecodeImages) else (
            decoder.spec.image if isinstance(decoder, DecodeVideo) else ImageSpec())
    patch_dim = patch_dtype = None
    if isinstance(decoder, DecodeImages) and decoder.processor is not None:
        # Qwen2-VL's processor merges patches per token side; a non-convention is refused below.
        merge = getattr(decoder.processor, "merge_size", None)
        if isinstance(merge, int) and merge != getattr(placeholders, "merge_size", merge):
            # The grids are the processor's, so the token count must follow its merge, not the spec's.
            raise ConfigurationError(
                f"pack_multimodal: the image processor merges {merge}x{merge} patches per token but the "
                f"placeholders merge {placeholders.merge_size}x{placeholders.merge_size}"
            )
        dim, dtype = decoder.patch_layout()
        patch_dim, patch_dtype = dim, dtype.str
    deferred, deferred_on_error = _deferred_policy(pipeline)
    return pipeline.apply(PackMultimodal(
        max_length, placeholders, spec, pad_id, image_position, field, pixels_field, grid_field,
        offsets_field=offsets_field, max_open_rows=max_open_rows, patch_dim=patch_dim, patch_dtype=patch_dtype,
        deferred_images=deferred, deferred_on_error=deferred_on_error, mrope=mrope,
    ))


def _deferred_policy(pipeline) -> tuple[bool, str | None]:
    """(whether the pipeline has `decode_images(defer=True)` stages, their error policy; None:
    the pipeline's own).

    Any such stage, not only the last decoder, gives the packer its row work: a `decode_video`
    after it left its images to be decoded while the loader assembled batches, on its own thread
    and failing fast whatever the policy. The row work has one policy, so stages that set
    different ones are refused rather than one of them silently followed."""
    policies = {op.on_error for op in pipeline.operators if isinstance(op, DecodeImages) and op.defer}
    if len(policies) > 1:
        raise ConfigurationError(
            "pack_multimodal: the decode_images(defer=True) stages set different on_error policies "
            f"{sorted(policies, key=str)}; their images are decoded after packing under one: give them the same"
        )
    return bool(policies), next(iter(policies), None)


def _check_bos(pipeline, field: str) -> None:
    """Refuse `image_position="after_bos"` where the `tokenize` that writes `field` adds no BOS.

    The packer puts the images after a document's first token. `tokenize` encodes without the
    tokenizer's own special tokens, so it starts a document with a BOS only when given `bos=`;
    without one the images split every caption after its first word, unsaid. Ids read from the
    data, or a `map` after the tokenize (it may add a BOS), are not decided here: their first
    token is taken as the BOS, whatever it is."""
    for op in reversed(pipeline.operators):
        if isinstance(op, TokenizeOp) and op.output_field == field:
            if op.bos is None:
                raise ConfigurationError(
                    f"pack_multimodal(image_position='after_bos') puts each document's images after its first "
                    f"token, but the tokenize that writes {field!r} adds no BOS (bos=None): the images would "
                    "split every caption after its first word; give tokenize(bos=...) or another image_position"
                )
            return
        if getattr(op, "name", None) not in _WRITE_ONLY_THEIR_OUTPUT:  # it may write the ids
            return
