"""Pipeline builder methods contributed by `vlm` (registered under the `zephon.pipeline` entry
points, so the core never imports this package): `decode_images`, `decode_video`,
`pack_multimodal`, `pack_multimodal_pairs`. Each takes the pipeline first and returns a new pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zephon._dataset_scope import check_dataset_scopes, work_source_dataset_names
from zephon._loss_mask import LOSS_MASK_FIELD
from zephon._markers import OFFSETS_FIELD

from ._frame_text import FrameText
from ._image import ImageSpec
from ._packing import PackMultimodal
from ._pairs import PackMultimodalPairs
from ._placeholders import Placeholders
from ._stages import (
    DEFAULT_IMAGE_FIELDS,
    DEFAULT_VIDEO_FIELDS,
    DecodeImages,
    DecodeVideo,
)
from ._video import VideoSpec

__all__ = ["decode_images", "decode_video", "pack_multimodal", "pack_multimodal_pairs"]

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
    paths: bool = False,
):
    """Append a `DecodeImages` stage (on_error=None follows the pipeline's policy; `defer=True`
    decodes each image after packing, just before its row is taken: see `vlm._deferred`).
    `datasets` (a name or a list; None: every dataset) limits it to those datasets' records, the
    others passing unchanged: how image and video datasets are mixed in one pipeline. `paths=True`
    reads the file an image field's path names (LLaVA-style JSON lines), a relative one beside the
    record's shard, as `decode_video` does."""
    stage = DecodeImages(field, spec or ImageSpec(), output_field, processor, on_error, keep_source,
                         parallelism=parallelism, defer=defer, datasets=datasets, paths=paths)
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
    offsets_field: str = OFFSETS_FIELD,
    max_open_rows: int = 16,
    mrope: bool = False,
    mrope_tokens_per_second: float | None = None,
    frame_text: FrameText | None = None,
    loss_mask_field: str = LOSS_MASK_FIELD,
    document_values: Sequence[str] = (),
):
    """Append a `PackMultimodal` accumulator, bound to the stages before it
    (`PackMultimodal.bound_to`, which the loader calls again for a packer given to
    `Pipeline.apply`): `spec` defaults to the last decoder's (`decode_images`', or `decode_video`'s
    `VideoSpec.image`; with `Idefics3Placeholders`, the last `decode_images`'), the patch layout (dim, dtype) to what that stage produces (its processor's,
    if any), and `pixels_field` (and the grid field) to the fields that stage writes ("pixels"
    without one); a `spec` cutting other patches than that decoder's is refused.
    `image_position="after_bos"` puts a document's images after its first token, taken to be the
    BOS: refused after a `tokenize` of `field` that adds none. What comes before the packer is
    checked as it is built. A record that holds `offsets_field` has its images placed where that
    list says, whatever `image_position` (`tokenize(marker="<image>")` writes it from where the
    text's markers were). `mrope=True` (with `QwenPlaceholders`) adds `mrope_position_ids` to
    every row: the (temporal, height, width) rotary positions a Qwen2-VL-family model would
    compute itself (`vlm._mrope`). `QwenPlaceholders(video_pad=...)` lays each decoded video out
    as one Qwen2-VL video block, its frames in the rows' `video_*` fields (vlm/README.md);
    `mrope_tokens_per_second` (Qwen2.5-VL's `vision_config.tokens_per_second`) then spaces each
    video's temporal positions by the seconds its temporal patches span, as Qwen2.5-VL does.
    Where a video's frames are images (every other convention), `frame_text` (`FrameText`) writes
    the text the model's processor puts around them: InternVL's frame numbers, SmolVLM2's times.
    A record holding `loss_mask_field` (one bool per text id: `tokenize(prompt_field=...)` and
    `tokenize(segments=True)` write it) trains only on the text it marks True, as `pack_flat` does.
    `document_values` carries a record's number fields (a KTO label, a loss weight) into each row
    holding its document, one float64 a document, as `pack_flat`'s does; a record without one is
    skipped (`missing_field`), one whose value is no finite number as `bad_document_value`."""
    packer = PackMultimodal(
        max_length, placeholders, spec, pad_id, image_position, field, pixels_field,
        offsets_field=offsets_field, max_open_rows=max_open_rows, mrope=mrope,
        mrope_tokens_per_second=mrope_tokens_per_second, frame_text=frame_text, loss_mask_field=loss_mask_field,
        document_values=document_values,
    )
    # Refused now, as the pipeline is built; the loader binds it again, as it binds a packer applied.
    return pipeline.apply(packer.bound_to(pipeline.record_operators()))


def pack_multimodal_pairs(
    pipeline,
    max_length: int,
    placeholders: Placeholders,
    *,
    spec: ImageSpec | None = None,
    pad_id: int | None = None,
    image_position: str = "before_text",
    chosen_field: str = "chosen_ids",
    rejected_field: str = "rejected_ids",
    chosen_loss_mask_field: str = "chosen_loss_mask",
    rejected_loss_mask_field: str = "rejected_loss_mask",
    chosen_offsets_field: str = "chosen_image_offsets",
    rejected_offsets_field: str = "rejected_image_offsets",
    pixels_field: str | None = None,
    max_open_rows: int = 16,
    mrope: bool = False,
    document_values: Sequence[str] = (),
    overlong: str = "skip",
):
    """Append a `PackMultimodalPairs` accumulator (`vlm._pairs`): preference pairs whose prompt
    shows images (multimodal DPO). Each record's chosen and rejected documents (two `tokenize`
    stages write their ids, loss masks and, with `marker=`, image offsets to the fields named
    here), each with the record's images placed as `pack_multimodal` places them, go into one row
    as documents 2k and 2k+1, never split, the images in both; `zephon.preference.pair_log_probs`
    reads the pairs back. A pair longer than a row is skipped (`pair_too_long`), or with
    `overlong="truncate"` its images kept and the room beside them shared between its two texts,
    each keeping its first tokens (counted as `truncated`); a record missing either document is
    skipped once, for the first refused. The settings are `pack_multimodal`'s, checked alike for
    each side, and a `tokenize` writing a side's loss mask to another field than this reads it
    from is refused as `pack_pairs` refuses it."""
    packer = PackMultimodalPairs(
        max_length, placeholders, spec, pad_id, image_position, chosen_field, pixels_field,
        offsets_field=chosen_offsets_field, max_open_rows=max_open_rows, mrope=mrope,
        loss_mask_field=chosen_loss_mask_field, document_values=document_values, rejected_field=rejected_field,
        rejected_loss_mask_field=rejected_loss_mask_field, rejected_offsets_field=rejected_offsets_field,
        overlong=overlong,
    )
    return pipeline.apply(packer.bound_to(pipeline.record_operators()))
