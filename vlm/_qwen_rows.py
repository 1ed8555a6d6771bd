"""Qwen2-VL's vision-tower rows from the ImageSpec's uint8 patches, on the trainer's side.

A row decoded with an `ImageSpec` carries `pixel_values` as raster-order uint8 patches of
(patch_row, patch_col, channel). Qwen2-VL, Qwen2.5-VL and Qwen3-VL's vision towers take their
image processor's rows instead: normalised floats, the patches of each merged cell together,
each patch channels first and repeated over `temporal_patch_size` frames. `decode_images(processor=...)`
yields those rows in the loader, but a video decoder has no processor, so a recipe mixing Qwen
images and clips was refused for its two patch layouts, and the processor's rows cannot be
deferred (`defer=True`) and are 8x the bytes of the uint8 patches (float32, twice over in time)
in every prefetch window and shuffle buffer. `qwen_pixel_values` turns a batch's uint8 patches
into the processor's rows where the model runs (a gather and a reshape, on the GPU if the tensor
is there), the same values the processor gives for the same resized pixels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "qwen_pixel_values"]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
"""Qwen2-VL's and Qwen2.5-VL's image mean (their processors' `image_mean`); Qwen3-VL's checkpoints use 0.5."""
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""Qwen2-VL's and Qwen2.5-VL's image std (their processors' `image_std`); Qwen3-VL's checkpoints use 0.5."""


def qwen_pixel_values(pixel_values: Any, image_grid: Any, *, merge_size: int = 2, temporal_patch_size: int = 2,
                      mean: tuple[float, float, float] = OPENAI_CLIP_MEAN,
                      std: tuple[float, float, float] = OPENAI_CLIP_STD) -> Any:
    """(patches, 3·temporal_patch_size·p·p) float32 rows in Qwen's image processor's order, from
    a batch's `pixel_values` ((patches, p·p·3) uint8, images in row order, each raster-order over
    its grid) and `image_grid` ((images, 2) rows, cols in patches), as `to_training()` or the
    batch's ragged arrays give them: a torch tensor stays on its device, a NumPy array stays one.

    Each image is rescaled to [0, 1], normalised per channel by `mean` and `std`, and repeated
    `temporal_patch_size` times, as the processor does for a single image. The defaults are
    Qwen2-VL's (and Qwen2.5-VL's); for Qwen3-VL give `mean=(0.5,) * 3, std=(0.5,) * 3`.
    """
    grids = np.asarray(image_grid.cpu() if hasattr(image_grid, "cpu") else image_grid, dtype=np.int64).reshape(-1, 2)
    count, dim = pixel_values.shape
    patch = round((dim / 3) ** 0.5)
    if 3 * patch * patch != dim:
        raise ValueError(f"qwen_pixel_values: rows of {dim} values are not RGB patches (p·p·3): "
                         "give the uint8 pixel_values of an ImageSpec decode, not a processor's rows")
    if count != int((grids[:, 0] * grids[:, 1]).sum()):
        raise ValueError(f"qwen_pixel_values: {count} patches but the grids {grids.tolist()} hold "
                         f"{int((grids[:, 0] * grids[:, 1]).sum())}: give the same batch's pixel_values and image_grid")
    order = _merged_cell_order(grids, merge_size)
    if isinstance(pixel_values, np.ndarray):
        rows = pixel_values[order].reshape(count, patch, patch, 3).transpose(0, 3, 1, 2).astype(np.float32)
        mean_a, std_a = (np.asarray(v, np.float32).reshape(1, 3, 1, 1) for v in (mean, std))
        rows = ((rows / 255 - mean_a) / std_a)[:, :, None]
        rows = np.broadcast_to(rows, (count, 3, temporal_patch_size, patch, patch))
        return np.ascontiguousarray(rows).reshape(count, -1)
    import torch

    rows = pixel_values[torch.as_tensor(order, device=pixel_values.device)]
    rows = rows.reshape(count, patch, patch, 3).permute(0, 3, 1, 2).to(torch.float32)
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32, device=rows.device).reshape(1, 3, 1, 1) for v in (mean, std))
    rows = ((rows / 255 - mean_t) / std_t)[:, :, None]
    return rows.expand(count, 3, temporal_patch_size, patch, patch).reshape(count, -1)


def _merged_cell_order(grids: np.ndarray, merge_size: int) -> np.ndarray:
    """The raster-order patch index of each processor row: per image, its merged cells in raster
    order and the merge_size x merge_size patches of each cell in raster order."""
    m = merge_size
    parts, start = [], 0
    for rows, cols in grids.tolist():
        if rows % m or cols % m:
            raise ValueError(f"qwen_pixel_values: a {rows}x{cols} patch grid is not whole {m}x{m} merged cells")
        index = np.arange(rows * cols, dtype=np.int64).reshape(rows // m, m, cols // m, m).transpose(0, 2, 1, 3)
        parts.append(start + index.reshape(-1))
        start += rows * cols
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
