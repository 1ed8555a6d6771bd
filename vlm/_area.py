"""Gemma 4's sizing: a picture scaled, its aspect ratio kept, to a budget of pixels.

Gemma 4's image processor scales every picture, up or down, by the square root of its pixel
budget over the picture's pixels, then rounds each side down to whole cells (a 16 px patch pooled
3x3 by the tower: 48 px). A side that rounds to nothing becomes one cell and the other side the
picture's aspect ratio in whole cells, at most the budget's cells in a row. This module is that
arithmetic, in the processor's floating-point steps (`get_aspect_ratio_preserving_size`), so the
grid, and with it the count of soft tokens, matches it for every size.
"""

from __future__ import annotations

import math

__all__ = ["area_size"]


def area_size(height: int, width: int, cell: int, budget: int) -> tuple[int, int]:
    """(height, width) in pixels, whole `cell`s, of a height x width picture scaled to at most
    `budget` pixels with its aspect ratio kept."""
    factor = math.sqrt(budget / (height * width))
    target_h = int(math.floor(factor * height / cell)) * cell
    target_w = int(math.floor(factor * width / cell)) * cell
    longest = budget // cell**2 * cell
    if target_h == 0:
        return cell, min(int(math.floor(width / height)) * cell, longest)
    if target_w == 0:
        return min(int(math.floor(height / width)) * cell, longest), cell
    return target_h, target_w
