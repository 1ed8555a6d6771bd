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

__all__ = ["gemma4_model_inputs"]


def gemma4_model_inputs(batch: dict, spec: ImageSpec, *, image_token_id: int | None = None,
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

    For a checkpoint whose text config sets `use_bidirectional_attention="vision"`, give its
    `image_token_id` and `text_config.sliding_window` (and `attn_implementation`, "sdpa" or
    "eager"): `attention_mask` is then the model's two masks ready-made (`vlm._gemma_masks`), a
    picture's tokens attending to each other both ways in the sliding-window layers, which its
    processor's `mm_token_type_ids` say and packed rows cannot (torch tensors only)."""
    out = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if (image_token_id is None) != (sliding_window is None):
        raise ValueError("gemma4_model_inputs: give image_token_id and sliding_window together (the masks of a "
                         "checkpoint whose pictures attend both ways), or neither")
    if image_token_id is not None:
        out["attention_mask"] = document_masks(batch["input_ids"], batch["document_ids"], image_token_id=image_token_id,
                                               sliding_window=sliding_window, images_in_full_layers=False,
                                               attn_implementation=attn_implementation, caller="gemma4_model_inputs")
    grids = batch["image_grid"]
    if not len(grids):
        return out
    grids = np.asarray(grids.tolist(), dtype=np.int64).reshape(-1, 2)
    patches = batch["pixel_values"]
    budget = spec.max_pixels // spec.patch_size**2
    pixel_values = np.zeros((len(grids), budget, patches.shape[-1]), dtype=np.float32)
    positions = np.full((len(grids), budget, 2), -1, dtype=np.int64)
    ends = np.cumsum(grids.prod(axis=1))
    levels = np.arange(256, dtype=np.float32) / 255  # as the processor scales: float32 level / 255
    host = patches if isinstance(patches, np.ndarray) else patches.cpu().numpy()
    for k, ((rows, cols), end) in enumerate(zip(grids.tolist(), ends.tolist())):
        count = rows * cols
        pixel_values[k, :count] = levels[host[end - count : end]]
        positions[k, :count, 0] = np.tile(np.arange(cols), rows)  # x: the patch's column
        positions[k, :count, 1] = np.repeat(np.arange(rows), cols)  # y: its row
    if isinstance(patches, np.ndarray):
        out.update(pixel_values=pixel_values, image_position_ids=positions)
    else:
        import torch

        out.update(pixel_values=torch.from_numpy(pixel_values).to(patches.device),
                   image_position_ids=torch.from_numpy(positions).to(patches.device))
    return out
