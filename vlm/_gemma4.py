"""A microbatch of packed rows as Gemma 4's image arguments.

Gemma 4's vision tower takes each picture as its patch rows, not as an image tensor: the 16 px
patches in raster order, scaled to [0, 1] (its processor normalises no further), padded with
zeros to the budget's patches, and beside them each patch's (x, y) column and row, (-1, -1) for
the padding (`image_position_ids`). The rows already carry the uint8 patches in that order
(`patchify`'s (patch row, patch column, channel), the processor's own); this puts them into
that shape on the trainer's side (on the host: a picture's patches are a few hundred rows, and
the float copy is made once; torch tensors come back on the batch's device).
"""

from __future__ import annotations

import numpy as np

from ._gemma_masks import document_masks
from ._image import ImageSpec
from ._image_tensors import image_rows, on_host, pictures_per_document
from ._video import VideoSpec

__all__ = ["gemma4_model_inputs"]


def gemma4_model_inputs(batch: dict, spec: ImageSpec, *, video_spec: VideoSpec | None = None,
                        video_token_id: int | None = None, image_token_id: int | None = None,
                        sliding_window: int | None = None, attn_implementation: str = "sdpa") -> dict:
    """The keyword arguments of a `Gemma4ForConditionalGeneration` forward for one microbatch
    (`Batch.to_training()`'s torch tensors, rows packed with `ImageSpec.gemma4()` and
    `PadPlaceholders.gemma4`): `input_ids`, `position_ids` (restarting per document, from which
    the model keeps each packed document to itself) and, where the microbatch holds images,
    `pixel_values` (images, budget's patches, 768) float32 and `image_position_ids` (images,
    budget's patches, 2), as Gemma 4's processor gives them for the same pixels. `spec` is the
    packer's: its `max_pixels` is the budget the processor pads every picture to. NumPy arrays
    give NumPy arrays, torch tensors tensors on their device. Labels are not among them: the
    rows' are already shifted (vlm/README.md).

    Rows whose videos' frames are written with `<|video|>` (`PadPlaceholders.gemma4(tokenizer,
    video=True)`): give its `video_token_id` and the clips' `video_spec`, whose budget the frames
    are padded to; those frames go to `pixel_values_videos`, `video_position_ids` and
    `num_frames_per_video` (each document's frames one video), the pictures as before.

    For a checkpoint whose text config sets `use_bidirectional_attention="vision"`, give its
    `image_token_id` and `text_config.sliding_window` (and `attn_implementation`, "sdpa" or
    "eager"): `attention_mask` is then the model's two masks ready-made (`vlm._gemma_masks`), a
    picture's or a frame's tokens attending to each other both ways in the sliding-window layers,
    which its processor's `mm_token_type_ids` say and packed rows cannot (torch tensors only)."""
    out = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if (image_token_id is None) != (sliding_window is None):
        raise ValueError("gemma4_model_inputs: give image_token_id and sliding_window together (the masks of a "
                         "checkpoint whose pictures attend both ways), or neither")
    if (video_token_id is None) != (video_spec is None):
        raise ValueError("gemma4_model_inputs: give video_token_id and video_spec together (the frames of clips "
                         "written with <|video|>, and the budget they are padded to), or neither")
    if image_token_id is not None:
        vision = (image_token_id,) if video_token_id is None else (image_token_id, video_token_id)
        out["attention_mask"] = document_masks(batch["input_ids"], batch["document_ids"], vision_token_ids=vision,
                                               sliding_window=sliding_window, images_in_full_layers=False,
                                               attn_implementation=attn_implementation, caller="gemma4_model_inputs")
    grids = np.asarray(batch["image_grid"].tolist(), dtype=np.int64).reshape(-1, 2)
    if not len(grids):
        return out
    patches = batch["pixel_values"]
    host = on_host(patches)
    ends = np.cumsum(grids.prod(axis=1))
    frames = _frames(batch, video_token_id)
    pictures = np.flatnonzero(~frames)
    if len(pictures):
        pixel_values, positions = _patch_rows(host, grids, ends, pictures, spec.max_pixels // spec.patch_size**2)
        out.update(pixel_values=pixel_values, image_position_ids=positions)
    if frames.any():
        budget = video_spec.image.max_pixels // video_spec.image.patch_size**2
        pixel_values, positions = _patch_rows(host, grids, ends, np.flatnonzero(frames), budget)
        out.update(pixel_values_videos=pixel_values, video_position_ids=positions,
                   num_frames_per_video=pictures_per_document(batch, frames))
    if not isinstance(patches, np.ndarray):
        import torch

        out.update({name: torch.from_numpy(out[name]).to(patches.device) for name in _ARRAYS if name in out})
    return out


_ARRAYS = ("pixel_values", "image_position_ids", "pixel_values_videos", "video_position_ids", "num_frames_per_video")
"""The arguments made here on the host, handed back on the batch's device."""


def _patch_rows(host: np.ndarray, grids: np.ndarray, ends: np.ndarray, chosen: np.ndarray,
                budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The `chosen` images' patches as (images, `budget`, 768) float32 rows scaled to [0, 1],
    zero-padded, and their (x, y) patch positions, (-1, -1) on the padding."""
    pixel_values = np.zeros((len(chosen), budget, host.shape[-1]), dtype=np.float32)
    positions = np.full((len(chosen), budget, 2), -1, dtype=np.int64)
    levels = np.arange(256, dtype=np.float32) / 255  # as the processor scales: float32 level / 255
    for k, image in enumerate(chosen.tolist()):
        (rows, cols), end = grids[image].tolist(), int(ends[image])
        count = rows * cols
        if count > budget:
            raise ValueError(f"gemma4_model_inputs: an image of {rows}x{cols} patches is past the budget of {budget} "
                             f"it is padded to: give the spec (or video_spec) it was decoded with")
        pixel_values[k, :count] = levels[host[end - count : end]]
        positions[k, :count, 0] = np.tile(np.arange(cols), rows)  # x: the patch's column
        positions[k, :count, 1] = np.repeat(np.arange(rows), cols)  # y: its row
    return pixel_values, positions


def _frames(batch: dict, video_token_id: int | None) -> np.ndarray:
    """Per image of the microbatch, whether it is a video's frame: its block's first pad (after
    `boi`) is `video_token_id`."""
    if video_token_id is None:
        return np.zeros(len(batch["image_grid"]), dtype=bool)
    return on_host(batch["input_ids"])[image_rows(batch), on_host(batch["image_token_offset"]) + 1] == video_token_id
