"""Idefics3's image splitting (Idefics3, SmolVLM, SmolVLM2): the sizes a picture passes through.

Idefics3's image processor resizes a picture twice before it cuts it: first its longer side to
`longest_edge`, up or down, the shorter in proportion (rounded down, then up to an even number),
both within 4096; then each side up to whole tiles. A canvas larger than one tile is cut into its
tiles, in raster order, and the whole canvas resized to one tile follows them (the "global" image);
a canvas of one tile is the global image alone. The model's text names each tile by its row and
column, so the arrangement has to be the processor's for every size: this module is its arithmetic,
in the same floating-point steps (`int(width / aspect)`), and the tests check it against
transformers' `Idefics3ImageProcessorPil` for hundreds of sizes.
"""

from __future__ import annotations

import math

__all__ = ["IDEFICS3_MAX_SIDE", "split_arrangement", "split_canvas", "split_first_size"]

IDEFICS3_MAX_SIDE = 4096
"""The longest side Idefics3's processor resizes a picture to, whatever its `longest_edge`."""


def split_first_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """(height, width) of the first resize: the longer side `longest_edge` (the width where the
    sides are equal), the shorter in proportion, rounded down and then up to an even number, at
    least 1, both scaled to at most `IDEFICS3_MAX_SIDE`."""
    aspect = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > IDEFICS3_MAX_SIDE:
        width = IDEFICS3_MAX_SIDE
        height = int(width / aspect)
    elif height > width and height > IDEFICS3_MAX_SIDE:
        height = IDEFICS3_MAX_SIDE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def split_canvas(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) of the second resize, of a picture of the first size: the longer side up to
    whole tiles, the shorter from it in proportion (rounded down), then up to whole tiles."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def split_arrangement(height: int, width: int, longest_edge: int, tile: int) -> tuple[int, int]:
    """(rows, columns) of tiles a picture of this upright size is cut into; (1, 1) for one that
    is not cut (its canvas is one tile: the global image alone)."""
    canvas_h, canvas_w = split_canvas(*split_first_size(height, width, longest_edge), tile)
    return canvas_h // tile, canvas_w // tile
