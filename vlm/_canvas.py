"""Llama 4's sizing: a picture fitted, its aspect ratio kept, into the canvas of square tiles that
scales it least, padded at its bottom and right, cut into the tiles.

Llama 4's image processor (`Llama4ImageProcessor`) lists the canvases of 1 to `max_tiles` tiles
(every rows x columns whose product is at most that), and takes the one whose limiting side
scales the picture up the least, or, where every canvas would shrink it, down the least; between
canvases of the same scale, the smallest. It scales the picture up no further than one tile a
side (a small picture stays small on its canvas), keeps its aspect ratio, puts it at the canvas's
top left and pads the rest with zeros. Past one tile, the whole picture resized to one tile
follows the tiles (the global tile).

The processor computes a canvas's scales as float32 tensors, and so the picture's size where the
canvas limits it; the same steps are taken here in float32 there and in Python's floats
elsewhere, so every size gives the processor's canvas and fitted size (tests against its own
functions).
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["best_canvas", "canvas_fitted_size", "supported_canvases"]


@functools.cache
def supported_canvases(tile: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(height, width) of every canvas of at most `max_tiles` tiles of `tile` px, in the order the
    processor lists them (by aspect ratio, as first met counting the tiles down), which decides
    between canvases of the same scale and area."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(_factors(count)):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return tuple((rows * tile, columns * tile) for pairs in by_ratio.values() for rows, columns in pairs)


def _factors(count: int) -> set[int]:
    return {d for i in range(1, math.isqrt(count) + 1) if count % i == 0 for d in (i, count // i)}


@functools.lru_cache(maxsize=4096)
def best_canvas(height: int, width: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """(height, width) of the canvas a picture of this upright size is fitted into: of the
    canvases whose limiting side's float32 scale is the least at or above 1, or the greatest
    below 1 where none is, the smallest in area (the first listed among equals)."""
    canvases = np.array(supported_canvases(tile, max_tiles), dtype=np.int64)
    scales = np.minimum(canvases[:, 0].astype(np.float32) / np.float32(height),
                        canvases[:, 1].astype(np.float32) / np.float32(width))
    up = scales[scales >= 1]
    chosen = canvases[scales == (up.min() if len(up) else scales[scales < 1].max())]
    rows, columns = chosen[np.argmin(chosen[:, 0] * chosen[:, 1])].tolist()
    return rows, columns


def canvas_fitted_size(height: int, width: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """(height, width) a picture of this upright size is resized to on its canvas: within the
    canvas, each side scaled up to no more than one tile (or its own length, where longer), its
    aspect ratio kept by the limiting side, the other side rounded down; at least 1 px."""
    canvas = best_canvas(height, width, tile, max_tiles)
    (target_h, f32_h), (target_w, f32_w) = (_bound(side, limit, tile) for side, limit in zip((height, width), canvas))
    scale_w, scale_h = _ratio(target_w, width, f32_w), _ratio(target_h, height, f32_h)
    if scale_w < scale_h:
        new_h, new_w = min(math.floor(height * scale_w), target_h), target_w
    else:
        new_h, new_w = target_h, min(math.floor(width * scale_h), target_w)
    return max(int(new_h), 1), max(int(new_w), 1)


def _bound(side: int, limit: int, tile: int) -> tuple[int, bool]:
    """The length a side may take, the side itself or one tile if more, within the canvas's
    `limit`; and whether it is the canvas's (a float32 tensor in the processor, as Python's `min`
    hands back the second of two values only when it is smaller)."""
    wanted = max(side, tile)
    return (limit, True) if limit < wanted else (wanted, False)


def _ratio(target: int, side: int, in_float32: bool):
    """`target / side`, in float32 where the target is the canvas's (the processor's tensor)."""
    return np.float32(target) / np.float32(side) if in_float32 else target / side
