"""A microbatch of packed rows as Gemma 4's image arguments.

Gemma 4's vision tower takes each picture as its patch rows, not as an image tensor: the 16 px
patches in raster order, scaled to [0, 1] (its processor normalises no further), padded with
zeros to the budget's patches, and beside them each patch's (x, y) column and row, (-1, -1) for
the padding (`image_position_ids`). The rows already carry the uint8 patches in that order
(`patchify`'s (patch row, patch column, channel), the processor's own); this puts them into
that shape on the trainer's side, on the tensors' device.
"""

from __future__ import annotations

from ._image import ImageSpec

__all__ = ["gemma4_model_inputs"]


def gemma4_model_inputs(batch: dict, spec: ImageSpec) -> dict:
    """The keyword arguments of a `Gemma4ForConditionalGeneration` forward for one microbatch
    (`Batch.to_training()`'s torch tensors, rows packed with `ImageSpec.gemma4()` and
    `PadPlaceholders.gemma4`): `input_ids`, `position_ids` (restarting per document, from which
    the model keeps each packed document to itself) and, where the microbatch holds images,
    `pixel_values` (images, budget's patches, 768) float32 and `image_position_ids` (images,
    budget's patches, 2), as Gemma 4's processor gives them for the same pixels. `spec` is the
    packer's: its `max_pixels` is the budget the processor pads every picture to. Labels are not
    among them: the rows' are already shifted (vlm/README.md)."""
    import torch

    out = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    grids = batch["image_grid"]
    if not len(grids):
        return out
    patches = batch["pixel_values"]
    budget = spec.max_pixels // spec.patch_size**2
    pixel_values = torch.zeros((len(grids), budget, patches.shape[-1]), dtype=torch.float32, device=patches.device)
    positions = torch.full((len(grids), budget, 2), -1, dtype=torch.int64, device=patches.device)
    start = 0
    for k, (rows, cols) in enumerate(grids.tolist()):
        count = rows * cols
        pixel_values[k, :count] = patches[start : start + count].to(torch.float32) / 255
        row, col = torch.meshgrid(torch.arange(rows, device=patches.device), torch.arange(cols, device=patches.device),
                                  indexing="ij")
        positions[k, :count] = torch.stack([col.reshape(-1), row.reshape(-1)], dim=-1)
        start += count
    out.update(pixel_values=pixel_values, image_position_ids=positions)
    return out
