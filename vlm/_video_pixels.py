"""Qwen3-VL's sizing of a video as a whole: a budget of pixels for all its frames together.

Qwen2-VL's video processor sizes each frame as an image, within per-frame bounds. Qwen3-VL's
(`Qwen3VLVideoProcessor`) bounds the whole video instead: its frames, counted in whole temporal
pairs, times their height and width must lie within (min, max) pixels, so a video of many frames
gets smaller frames and a short one larger ones, and the token cost of a video stays bounded
whatever its length. qwen-vl-utils, the reference implementation, also caps each frame at
`max_frame_tokens` merged cells (transformers' `cap_pixels_per_frame=True`, `max_video_tokens`).

`video_grid` is that rule, in the processor's floating-point steps, so the same video gets the
same grid, hence the same placeholder count, as there (tests against its `smart_resize`).
"""

from __future__ import annotations

import math

from ._image import ImageSpec, thin_scaled_up

__all__ = ["video_grid"]

TEMPORAL_PAIR = 2
"""Frames per temporal patch, by which the processor counts a video's frames for its budget."""


def video_grid(frames: int, height: int, width: int, image: ImageSpec, video_pixels: tuple[int, int],
               max_frame_tokens: int | None = None) -> tuple[int, int]:
    """(rows, cols) of patches each of a video's `frames` frames of this upright size is resized
    to, so that the frames (in whole pairs) hold (min, max) = `video_pixels` pixels between them
    as nearly as whole cells of `image.cell` allow; with `max_frame_tokens`, the budget is first
    narrowed to that many cells a frame, and to no less than 1.05 times the minimum a frame, as
    qwen-vl-utils narrows it. A frame thinner than a cell is first scaled up to one. A single
    frame is sized as a pair (the processor refuses fewer than 2; the tower takes it twice)."""
    frames = max(frames, TEMPORAL_PAIR)
    cell = image.cell
    least, most = video_pixels
    if max_frame_tokens is not None:
        per_frame = max(min(max_frame_tokens * cell * cell, most // frames), int(least * 1.05))
        most = per_frame * frames
    height, width = thin_scaled_up(height, width, cell)
    rows, cols = round(height / cell) * cell, round(width / cell) * cell
    paired = round(frames / TEMPORAL_PAIR) * TEMPORAL_PAIR
    if paired * rows * cols > most:
        beta = math.sqrt((frames * height * width) / most)
        rows = max(cell, math.floor(height / beta / cell) * cell)
        cols = max(cell, math.floor(width / beta / cell) * cell)
    elif paired * rows * cols < least:
        beta = math.sqrt(least / (frames * height * width))
        rows = math.ceil(height * beta / cell) * cell
        cols = math.ceil(width * beta / cell) * cell
    return rows // image.patch_size, cols // image.patch_size
