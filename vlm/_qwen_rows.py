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
is there), the same values the processor gives for the same resized pixels. `qwen_video_pixel_values`
does the same for the rows' videos in Qwen's layout (`QwenPlaceholders(video_pad=...)`): each
row there holds two consecutive frames of a patch instead of one frame twice, as the video
processor's `pixel_values_videos` do. `qwen_model_inputs` gathers a whole microbatch's arguments
for the model's forward, so that a trainer does not pair fields and layouts by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._placeholders import QWEN_TEMPORAL_PATCH

__all__ = ["OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "qwen_model_inputs", "qwen_pixel_values", "qwen_video_pixel_values"]

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
    grids = _grids(image_grid, 2, "image_grid")
    grids = np.concatenate([np.ones((len(grids), 1), np.int64), grids], axis=1)
    patch = _checked_patch(pixel_values, grids, 1, ("qwen_pixel_values", "pixel_values", "image_grid"))
    order = _merged_cell_order(grids, merge_size, 1, "qwen_pixel_values")
    # An image is its one frame, twice over in time: normalised once, then repeated.
    return _rows(pixel_values, order, patch, mean, std, repeat=temporal_patch_size)


def qwen_video_pixel_values(video_pixel_values: Any, video_grid: Any, *, merge_size: int = 2,
                            mean: tuple[float, float, float] = OPENAI_CLIP_MEAN,
                            std: tuple[float, float, float] = OPENAI_CLIP_STD) -> Any:
    """(patches, 3·2·p·p) float32 rows in Qwen's video processor's order (its
    `pixel_values_videos`), from a batch's `video_pixel_values` ((frames·patches, p·p·3) uint8,
    videos in row order, each video's frames in turn, each frame raster-order over its grid) and
    `video_grid` ((videos, 3): temporal patches, rows, cols, which is Qwen's `video_grid_thw`).
    Each row holds one patch of the two frames of a temporal patch; normalised as
    `qwen_pixel_values` normalises. A torch tensor stays on its device.
    """
    grids = _grids(video_grid, 3, "video_grid")
    names = ("qwen_video_pixel_values", "video_pixel_values", "video_grid")
    patch = _checked_patch(video_pixel_values, grids, QWEN_TEMPORAL_PATCH, names)
    order = _merged_cell_order(grids, merge_size, QWEN_TEMPORAL_PATCH, names[0])
    return _rows(video_pixel_values, order, patch, mean, std)


def qwen_model_inputs(batch: dict, *, merge_size: int = 2, mean: tuple[float, float, float] = OPENAI_CLIP_MEAN,
                      std: tuple[float, float, float] = OPENAI_CLIP_STD) -> dict:
    """The keyword arguments of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL `...ForConditionalGeneration`
    forward for one microbatch (`Batch.to_training()`'s torch tensors):

    - `input_ids`; `position_ids` as the (4, B, L) the text model reads, the 1-D positions (the
      document boundaries it masks attention by) on top of `mrope_position_ids`;
    - where the microbatch holds images, `pixel_values` (uint8 patches turned into the vision
      tower's rows by `qwen_pixel_values`; an image processor's rows as they are) and
      `image_grid_thw`; where it holds videos in Qwen's layout, `pixel_values_videos`,
      `video_grid_thw` and `second_per_grid_ts`. Each is given exactly where present: a model
      given empty image arguments fails (transformers 5.25: `torch.cat(): expected a non-empty
      list of Tensors`), and one not given them where the row holds placeholders embeds those as
      text, unsaid.

    Labels are not among them: the rows' `labels` are already shifted (vlm/README.md). Rows
    packed without `mrope=True` are refused (ValueError): given (B, L) positions these models
    place images as text and mask no document from the one before it in the row (a tiny
    Qwen2.5-VL's logits of a row's second document then differ from the document's alone), and
    left to compute them they position the row as one document."""
    import torch

    if "mrope_position_ids" not in batch:
        raise ValueError("qwen_model_inputs: the rows carry no mrope_position_ids; pack them with "
                         "pack_multimodal(..., mrope=True): a Qwen-VL model given 1-D positions lets a packed "
                         "document attend to the one before it and positions its images as text")
    out = {"input_ids": batch["input_ids"],
           "position_ids": torch.cat([batch["position_ids"][None], batch["mrope_position_ids"].transpose(0, 1)])}
    grid = batch["image_grid"].long()
    if len(grid):
        pixels = batch["pixel_values"]
        if pixels.dtype == torch.uint8:
            pixels = qwen_pixel_values(pixels, grid, merge_size=merge_size, mean=mean, std=std)
        out["pixel_values"] = pixels
        out["image_grid_thw"] = torch.cat([torch.ones_like(grid[:, :1]), grid], dim=1)
    if len(batch.get("video_grid", ())):
        videos = batch["video_grid"].long()
        out["pixel_values_videos"] = qwen_video_pixel_values(batch["video_pixel_values"], videos,
                                                             merge_size=merge_size, mean=mean, std=std)
        out["video_grid_thw"] = videos
        out["second_per_grid_ts"] = batch["video_second_per_grid"]
    return out


def _grids(grid: Any, width: int, field: str) -> np.ndarray:
    grids = np.asarray(grid.cpu() if hasattr(grid, "cpu") else grid, dtype=np.int64)
    if grids.size and (grids.ndim != 2 or grids.shape[1] != width):
        raise ValueError(f"{field} must be of shape (n, {width}), got {grids.shape}")
    return grids.reshape(-1, width)


def _checked_patch(pixel_values: Any, grids: np.ndarray, frames_per_step: int, names: tuple[str, str, str]) -> int:
    """The patch side of (patches, p·p·3) uint8 patches, refusing a processor's rows or patches
    that are not the grids' (another batch's)."""
    name, values, grid = names
    count, dim = pixel_values.shape
    patch = round((dim / 3) ** 0.5)
    if 3 * patch * patch != dim:
        raise ValueError(f"{name}: rows of {dim} values are not RGB patches (p·p·3): "
                         "give the uint8 pixel_values of an ImageSpec decode, not a processor's rows")
    held = int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum()) * frames_per_step
    if count != held:
        raise ValueError(f"{name}: {count} patches but the grids {grids.tolist()} hold {held}: "
                         f"give the same batch's {values} and {grid}")
    return patch


def _rows(pixel_values: Any, order: np.ndarray, patch: int, mean, std, repeat: int = 1) -> Any:
    """Gather `order` ((rows, frames) patch indices) from the uint8 patches, as normalised
    (rows, 3·frames·repeat·p·p) float32 rows laid out (channel, frame, patch_row, patch_col),
    each frame `repeat` times over. An image's one frame is normalised once and then repeated:
    normalising both copies took twice as long (18 images of 8-24 patches a side, NumPy on this
    2-core machine: 40 ms against 15-19 ms, as before video rows shared this code)."""
    rows, frames = order.shape
    shape = (rows, 3, frames * repeat, patch, patch)
    if isinstance(pixel_values, np.ndarray):
        out = pixel_values[order].reshape(rows, frames, patch, patch, 3).transpose(0, 4, 1, 2, 3).astype(np.float32)
        mean_a, std_a = (np.asarray(v, np.float32).reshape(1, 3, 1, 1, 1) for v in (mean, std))
        out = (out / 255 - mean_a) / std_a
        return np.ascontiguousarray(np.broadcast_to(out, shape) if repeat > 1 else out).reshape(rows, -1)
    import torch

    out = pixel_values[torch.as_tensor(order, device=pixel_values.device)]
    out = out.reshape(rows, frames, patch, patch, 3).permute(0, 4, 1, 2, 3).to(torch.float32)
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32, device=out.device).reshape(1, 3, 1, 1, 1)
                     for v in (mean, std))
    out = (out / 255 - mean_t) / std_t
    return (out.expand(shape) if repeat > 1 else out).reshape(rows, -1)


def _merged_cell_order(grids: np.ndarray, merge_size: int, frames_per_step: int, name: str) -> np.ndarray:
    """(rows, frames_per_step) raster-order patch indices of each processor row: per image or
    video (grids of temporal steps, rows, cols; frames_per_step frames a step), its temporal
    steps in turn, each step's merged cells in raster order, the merge_size x merge_size patches
    of each cell in raster order, one index per frame of the step."""
    m = merge_size
    parts, start = [], 0
    for steps, rows, cols in grids.tolist():
        if rows % m or cols % m or steps < 1:
            raise ValueError(f"{name}: a {rows}x{cols} patch grid is not whole {m}x{m} merged cells")
        index = np.arange(steps * frames_per_step * rows * cols, dtype=np.int64)
        index = index.reshape(steps, frames_per_step, rows // m, m, cols // m, m).transpose(0, 2, 4, 3, 5, 1)
        parts.append(start + index.reshape(-1, frames_per_step))
        start += steps * frames_per_step * rows * cols
    return np.concatenate(parts) if parts else np.zeros((0, frames_per_step), np.int64)
