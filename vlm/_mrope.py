"""Multimodal rotary positions (M-RoPE) of a packed row, for Qwen2-VL-family language models.

Such a model rotates each token by three positions (temporal, height, width) instead of one.
A text token advances all three together; the placeholder tokens of an image take its merged
patch grid's coordinates, offset by the position reached so far, and the text after the image
resumes one past the largest position before it. The model derives this itself from
`input_ids` and every image's grid (transformers' `get_rope_index`), one row at a time, on the
training side; packed here, the positions come with the row instead, from the grids the packer
already holds.

The layout is `QwenPlaceholders`': per image, one start token (positioned as text), the merged
cells row-major (the grid positions), one end token (text again, one past the largest). An image
is one temporal step (t = 0): a video decoded by `decode_video` is packed as consecutive images,
and the model positions those placeholders as images too. Positions restart at 0 for every document, as the model sees a
packed document as a sequence of its own; padding stays 0.

Checked against transformers' `get_rope_index` of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, which agree on
images; Qwen3-VL interleaves the three axes over the rotary frequencies, inside the model, from
these same positions. Other models are not known to position their tokens so.
"""

from __future__ import annotations

from functools import cache

import numpy as np

__all__ = ["fill_mrope_positions", "ramp"]


@cache
def _image_positions(rows: int, cols: int) -> tuple[np.ndarray, int]:
    """An image's placeholders relative to the position before it: (3, rows * cols + 2) int32 with
    the start token at 0, the merged cells row-major at 1 + (t, h, w), the end token one past the
    largest (read-only); and how far the image moves the position (start, grid, end)."""
    span = max(rows, cols)
    cells = np.zeros((3, rows, cols), dtype=np.int32)
    cells[1] = np.arange(rows, dtype=np.int32)[:, None]
    cells[2] = np.arange(cols, dtype=np.int32)[None, :]
    block = np.zeros((3, rows * cols + 2), dtype=np.int32)
    block[:, 1:-1] = cells.reshape(3, rows * cols) + 1
    block[:, -1] = 1 + span
    block.flags.writeable = False
    return block, span + 2


@cache
def ramp(length: int) -> np.ndarray:
    """0, 1, ..., length - 1 (read-only): positions are slices of it, no array made per text run
    here or per document in the packer's `position_ids`."""
    out = np.arange(length, dtype=np.int32)
    out.flags.writeable = False
    return out


def fill_mrope_positions(out: np.ndarray, documents, image_offsets: np.ndarray, merge_size: int) -> None:
    """Write the (3, L) positions of a row's documents into `out` (zeros on entry; padding stays 0).

    `documents` are the row's `PlacedDocument`s in order (their `grids` in patches and `length`);
    `image_offsets[k]` is the row position of the k-th image's first placeholder token. One
    slice assignment per text run and per image: no loop over tokens. A position never exceeds
    its token's index in the document (an image's tokens outnumber what it moves the position),
    so the ramp of the row's length covers every text run.
    """
    positions = ramp(out.shape[1])
    offsets = iter(image_offsets.tolist())
    start = 0
    for doc in documents:
        position, cursor = 0, start
        for rows, cols in doc.grids:
            at = next(offsets)
            if at > cursor:
                out[:, cursor:at] = positions[position : position + at - cursor]
                position += at - cursor
            block, advance = _image_positions(rows // merge_size, cols // merge_size)
            cursor = at + block.shape[1]
            np.add(block, position, out=out[:, at:cursor])
            position += advance
        end = start + doc.length
        out[:, cursor:end] = positions[position : position + end - cursor]
        start = end
