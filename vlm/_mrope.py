"""Multimodal rotary positions (M-RoPE) of a packed row, for Qwen2-VL-family language models.

Such a model rotates each token by three positions (temporal, height, width) instead of one.
A text token advances all three together; the placeholder tokens of an image take its merged
patch grid's coordinates, offset by the position reached so far, and the text after the image
resumes one past the largest position before it. The model derives this itself from
`input_ids` and every image's grid (transformers' `get_rope_index`), one row at a time, on the
training side; packed here, the positions come with the row instead, from the grids the packer
already holds.

The layout is `QwenPlaceholders`': per image, one start token (text), the merged cells row-major
(the grid positions), one end token (text). An image is one temporal step (t = 0): a video
decoded by `decode_video` is packed as consecutive images, and the model positions those
placeholders as images too. Positions restart at 0 for every document, as the model sees a
packed document as a sequence of its own; padding stays 0.
"""

from __future__ import annotations

from functools import cache

import numpy as np

__all__ = ["fill_mrope_positions"]

_LEADING = 1
"""Placeholder tokens before an image's grid tokens: `QwenPlaceholders`' `<|vision_start|>`."""


@cache
def _grid_positions(rows: int, cols: int) -> tuple[np.ndarray, int]:
    """((3, rows * cols) int32 (t, h, w) of a merged grid's cells row-major, read-only; how far the
    grid moves the running position: one past its largest coordinate)."""
    spread = np.zeros((3, rows, cols), dtype=np.int32)
    spread[1] = np.arange(rows, dtype=np.int32)[:, None]
    spread[2] = np.arange(cols, dtype=np.int32)[None, :]
    spread = spread.reshape(3, rows * cols)
    spread.flags.writeable = False
    return spread, max(rows, cols)


def fill_mrope_positions(out: np.ndarray, documents, image_offsets: np.ndarray, merge_size: int) -> None:
    """Write the (3, L) positions of a row's documents into `out` (zeros on entry; padding stays 0).

    `documents` are the row's `PlacedDocument`s in order (their `grids` in patches and `length`);
    `image_offsets[k]` is the row position of the k-th image's first placeholder token. One
    slice assignment per text run and per image: no loop over tokens.
    """
    offsets = iter(image_offsets.tolist())
    start = 0
    for doc in documents:
        position, cursor = 0, start
        for rows, cols in doc.grids:
            first = next(offsets) + _LEADING
            out[:, cursor:first] = np.arange(position, position + first - cursor, dtype=np.int32)
            position += first - cursor
            spread, span = _grid_positions(rows // merge_size, cols // merge_size)
            cursor = first + spread.shape[1]
            np.add(spread, position, out=out[:, first:cursor])
            position += span
        end = start + doc.length
        out[:, cursor:end] = np.arange(position, position + end - cursor, dtype=np.int32)
        start = end
