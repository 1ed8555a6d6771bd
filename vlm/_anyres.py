"""LLaVA-NeXT's and LLaVA-OneVision's "anyres" sizing: a picture fitted into the best of a few
canvases of tiles.

LLaVA-NeXT's image processor picks, of its `image_grid_pinpoints` (canvas sizes, whole tiles),
the one that keeps most of the picture's resolution and wastes least of the canvas; resizes the
picture to fit it with its aspect ratio kept (the other side rounded up), pads it to the canvas,
centred, with black, and cuts the canvas into tiles; the whole picture stretched to one tile (the
"base" image) goes first. The model takes every tile's features, drops the rows or columns that
only the padding filled ("unpadding"), adds a learned newline feature after each remaining row
and puts the base image's features first; the processor writes as many `<image>` as that gives.
LLaVA-OneVision ("anyres_max_9") then shrinks the kept features, with their aspect ratio, to
about nine tiles' worth where they are more (`capped_features`). This module is that arithmetic,
in the processors' floating-point steps (`select_best_resolution`, `get_patch_output_size`,
`_get_unpadded_features`), so that the count matches theirs for every size.
"""

from __future__ import annotations

import math

__all__ = ["LLAVA_NEXT_PINPOINTS", "LLAVA_ONEVISION_PINPOINTS", "best_resolution", "capped_features", "fitted_size",
           "unpadded_features"]

LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
"""LLaVA-NeXT's (LLaVA-1.6's) canvases, (height, width): transformers' `LlavaNextImageProcessor` default."""

LLAVA_ONEVISION_PINPOINTS = tuple((384 * rows, 384 * columns) for rows in range(1, 7) for columns in range(1, 7))
"""LLaVA-OneVision's canvases, 1x1 to 6x6 tiles of 384 px, rows first: `LlavaOnevisionImageProcessor`'s default."""


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The (height, width) canvas of `pinpoints` that keeps the most of a height x width picture's
    pixels once fitted into it, and of those the one that wastes the least; the first on a tie."""
    best, kept, wasted = pinpoints[0], 0, math.inf
    for canvas_h, canvas_w in pinpoints:
        scale = min(canvas_w / width, canvas_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = canvas_w * canvas_h - effective
        if effective > kept or (effective == kept and waste < wasted):
            best, kept, wasted = (canvas_h, canvas_w), effective, waste
    return best


def fitted_size(height: int, width: int, canvas: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the picture resized into `canvas` with its aspect ratio kept: the side
    that limits takes the canvas's, the other is rounded up, at most the canvas's."""
    canvas_h, canvas_w = canvas
    scale_w, scale_h = canvas_w / width, canvas_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), canvas_h), canvas_w
    return canvas_h, min(math.ceil(width * scale_h), canvas_w)


def unpadded_features(height: int, width: int, canvas: tuple[int, int], tile: int,
                      tile_features: int) -> tuple[int, int]:
    """(rows, columns) of the features the model keeps of a picture's tiles: the canvas's tiles
    of `tile_features` x `tile_features` features each, less the rows (or columns) that only
    padding filled, as many off each side."""
    rows, columns = canvas[0] // tile * tile_features, canvas[1] // tile * tile_features
    if width / height > columns / rows:
        kept = int(round(height * (columns / width), 7))
        rows -= (rows - kept) // 2 * 2
    else:
        kept = int(round(width * (rows / height), 7))
        columns -= (columns - kept) // 2 * 2
    return rows, columns


def capped_features(rows: int, columns: int, tile_features: int, most_tiles: int) -> tuple[int, int]:
    """(rows, columns) of kept features once LLaVA-OneVision's "anyres_max_`most_tiles`" has
    shrunk them: the ratio is the square root of their count over `most_tiles` tiles' worth
    (`tile_features`² each); past 1.1, both sides are divided by it and rounded down, as its
    model interpolates them and its processor counts them."""
    ratio = math.sqrt(rows * columns / (most_tiles * tile_features**2))
    if ratio > 1.1:
        return int(rows // ratio), int(columns // ratio)
    return rows, columns
