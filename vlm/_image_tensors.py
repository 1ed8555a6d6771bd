"""A batch's images as the (images, 3, height, width) tensor a fixed-size vision tower takes, and
its videos as the (videos, frames, 3, height, width) one LLaVA-OneVision takes.

SigLIP-style towers (Gemma 3's, PaliGemma's, LLaVA's CLIP) take whole images of one size,
normalised per channel, where Qwen's take patch rows. A batch decoded with
`ImageSpec(fit="fixed")` holds every image's uint8 patches in raster order (`pixel_values`) and
one grid for all (`image_grid`); `image_tensors` puts the patches back together on the trainer's
side (a reshape, a transpose and the normalisation, on the tensor's device), so the loader keeps
carrying uint8, a quarter of the float32 bytes, through its windows and buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._qwen_rows import _checked_patch, _grids

__all__ = ["batch_num_images", "image_rows", "image_tensors", "on_host", "pictures_per_document", "video_tensors"]


def image_tensors(pixel_values: Any, image_grid: Any, *, mean: tuple[float, float, float],
                  std: tuple[float, float, float], tile: int | None = None) -> Any:
    """(images, 3, rows·p, cols·p) float32, `(pixel / 255 - mean) / std` per channel, from a
    batch's `pixel_values` ((images·rows·cols, p·p·3) uint8 patches) and `image_grid` ((images, 2)
    rows, cols in patches), equal to what the model's image processor gives for the same resized
    pixels. A NumPy array gives one, a torch tensor one on its device. The model's processor says
    `mean` and `std` (`image_mean`, `image_std`: 0.5 each for SigLIP and Gemma 3, CLIP's for LLaVA).
    Every image must have the same grid (`fit="fixed"`): a tower taking one tensor takes one size.
    With `tile` (a tile's side in patches, for `fit="tiles"`, `"split"`, `"anyres"` and
    `"canvas"`: 32 for InternVL's 448 px tiles of 14 px patches), each image's tiles are taken
    apart, one image each, in order: (tiles, 3, ...).
    """
    grids = _grids(image_grid, 2, "image_grid")
    if tile is not None:
        grids = _tiles_of(grids, tile)
    if len(np.unique(grids, axis=0)) > 1:
        raise ValueError(f"image_tensors: the images have grids {np.unique(grids, axis=0).tolist()}; one tensor holds "
                         "images of one size: decode with ImageSpec(fit='fixed', size=...)")
    images = len(grids)
    with_steps = np.concatenate([np.ones((images, 1), np.int64), grids], axis=1)
    patch = _checked_patch(pixel_values, with_steps, 1, ("image_tensors", "pixel_values", "image_grid"))
    rows, cols = (int(side) for side in grids[0]) if images else (0, 0)
    shape = (images, rows, cols, patch, patch, 3)
    if isinstance(pixel_values, np.ndarray):
        return _normalised_numpy(pixel_values.reshape(shape), mean, std).reshape(images, 3, rows * patch, cols * patch)
    import torch

    out = pixel_values.reshape(shape).permute(0, 5, 1, 3, 2, 4).to(torch.float32)
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32, device=out.device).reshape(1, 3, 1, 1, 1, 1)
                     for v in (mean, std))
    return ((out / 255 - mean_t) / std_t).reshape(images, 3, rows * patch, cols * patch)


def video_tensors(video_pixel_values: Any, video_grid: Any, *, mean: tuple[float, float, float],
                  std: tuple[float, float, float]) -> Any:
    """(videos, frames, 3, rows·p, cols·p) float32, as `image_tensors` normalises them, from a
    batch's `video_pixel_values` and `video_grid` ((videos, 3) frames, rows, cols) in a layout of
    one frame a temporal patch (`LlavaNextPlaceholders.llava_onevision`): LLaVA-OneVision's
    `pixel_values_videos`. One tensor holds videos of one length: sample them with
    `VideoSpec(num_frames=...)`, or take each video's frames apart (its `video_grid` row) where
    they differ."""
    grids = _grids(video_grid, 3, "video_grid")
    if len(np.unique(grids[:, 0])) > 1:
        raise ValueError(f"video_tensors: the videos have {sorted(set(grids[:, 0].tolist()))} frames; one tensor "
                         "holds videos of one length: sample them with VideoSpec(num_frames=...)")
    _checked_patch(video_pixel_values, grids, 1, ("video_tensors", "video_pixel_values", "video_grid"))
    frames = np.repeat(grids[:, 1:], grids[:, 0], axis=0)
    each = image_tensors(video_pixel_values, frames, mean=mean, std=std)
    return each.reshape(len(grids), int(grids[0, 0]) if len(grids) else 0, *each.shape[1:])


def batch_num_images(batch: dict) -> Any:
    """How many pictures each document of a microbatch holds, documents in row order, those with
    none left out: LLaVA-OneVision's `batch_num_images`, by which its model tells a document's
    only picture (its canvas's tiles) from one of several (one tile each:
    `ImageSpec(several_pad=...)`). From `Batch.to_training()`'s `image_token_offset`, its
    `image_token_offset_counts` and `document_ids`; NumPy arrays give a NumPy array, torch tensors
    a tensor on their device."""
    offsets = batch["image_token_offset"]
    counts = pictures_per_document(batch, np.ones(len(offsets), dtype=bool))
    if isinstance(offsets, np.ndarray):
        return counts
    import torch

    return torch.from_numpy(counts).to(offsets.device)


def pictures_per_document(batch: dict, chosen: np.ndarray) -> np.ndarray:
    """How many of the microbatch's images marked in `chosen` each document holds, in row order
    (documents with none left out): an image is the document's at its first placeholder."""
    rows = image_rows(batch)
    documents = on_host(batch["document_ids"])[rows, on_host(batch["image_token_offset"])]
    keys = np.stack([rows, documents], axis=1)[chosen]
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[True], (keys[1:] != keys[:-1]).any(axis=1)])
    return np.diff(np.append(np.flatnonzero(starts), len(keys))).astype(np.int64)


def image_rows(batch: dict) -> np.ndarray:
    """The row of each image of the microbatch (its `image_token_offset`s, counted per row)."""
    return np.repeat(np.arange(len(batch["input_ids"])), on_host(batch["image_token_offset_counts"]))


def on_host(values) -> np.ndarray:
    """A NumPy array, or a torch tensor's values as one."""
    return values if isinstance(values, np.ndarray) else values.cpu().numpy()


def _normalised_numpy(patches: np.ndarray, mean, std) -> np.ndarray:
    """(images, rows, cols, p, p, 3) uint8 -> (images, 3, rows, p, cols, p) float32, each value
    looked up in a table of the 256 levels' `(level / 255 - mean) / std` per channel, computed in
    float32 as the elementwise form computes it (so the same values): one pass a channel, half
    the time of converting, then normalising (896x896: 6.7 against 11-13 ms on this machine)."""
    levels = np.arange(256, dtype=np.float32)
    table = (levels[None] / 255 - np.asarray(mean, np.float32)[:, None]) / np.asarray(std, np.float32)[:, None]
    images, rows, cols, patch, _, _ = patches.shape
    out = np.empty((images, 3, rows, patch, cols, patch), dtype=np.float32)
    for channel in range(3):
        np.take(table[channel], patches[..., channel].transpose(0, 1, 3, 2, 4), out=out[:, channel])
    return out


def _tiles_of(grids: np.ndarray, tile: int) -> np.ndarray:
    """Each (rows, cols) grid of stacked tiles as the grids of its tiles, (tile, cols) each."""
    if (grids[:, 0] % tile).any():
        raise ValueError(f"image_tensors: grids {grids.tolist()} are not whole tiles of {tile} patch rows")
    return np.repeat(np.stack([np.full(len(grids), tile), grids[:, 1]], axis=1), grids[:, 0] // tile, axis=0)
