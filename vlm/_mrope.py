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
is one temporal step (t = 0). A video decoded by `decode_video` is packed as consecutive images,
and positioned as images too, unless the placeholders lay videos out as Qwen videos
(`video_pad`): then its temporal patches follow one another at t = 0, 1, 2, ... (Qwen2-VL's
rule), each over the frame's merged grid, and the end token and the text after take one past
the largest position of the block on any axis. That is the rule of Qwen's own training code
and of transformers up to 5.2; transformers' `get_rope_index` from 5.3 resumes the text one
past the spatial grid alone, lower than the block's last temporal positions where a video has
more temporal patches than merged rows and columns (transformers issue 45381). Positions
restart at 0 for every document, as the model sees a packed document as a sequence of its own;
padding stays 0.

Checked against transformers' `get_rope_index` of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, which agree on
images; Qwen3-VL interleaves the three axes over the rotary frequencies, inside the model, from
these same positions. Other models are not known to position their tokens so.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ._placeholders import temporal_patches

__all__ = ["fill_mrope_positions", "ramp"]


@cache
def _vision_positions(temporal: int, rows: int, cols: int) -> tuple[np.ndarray, int]:
    """An image's (temporal=1) or a video's placeholders relative to the position before it:
    (3, temporal * rows * cols + 2) int32 with the start token at 0, the merged cells of each
    temporal patch row-major at 1 + (t, h, w), the end token one past the largest position on any
    axis (read-only); and how far the block moves the position (start, grid, end)."""
    span = max(rows, cols, temporal)
    cells = np.zeros((3, temporal, rows, cols), dtype=np.int32)
    cells[0] = np.arange(temporal, dtype=np.int32)[:, None, None]
    cells[1] = np.arange(rows, dtype=np.int32)[None, :, None]
    cells[2] = np.arange(cols, dtype=np.int32)[None, None, :]
    count = temporal * rows * cols
    block = np.zeros((3, count + 2), dtype=np.int32)
    block[:, 1:-1] = cells.reshape(3, count) + 1
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


def fill_mrope_positions(out: np.ndarray, documents, item_offsets: list[int], merge_size: int) -> None:
    """Write the (3, L) positions of a row's documents into `out` (zeros on entry; padding stays 0).

    `documents` are the row's `PlacedDocument`s in order (their `grids` in patches, `video_frames`
    and `length`); `item_offsets[k]` is the row position of the k-th image's or video's first
    placeholder token. One slice assignment per text run and per image or video: no loop over
    tokens. A position never exceeds its token's index in the document (a block's tokens
    outnumber what it moves the position), so the ramp of the row's length covers every text run.
    """
    positions = ramp(out.shape[1])
    offsets = iter(item_offsets)
    start = 0
    for doc in documents:
        position, cursor = 0, start
        for k, (rows, cols) in enumerate(doc.grids):
            at = next(offsets)
            if at > cursor:
                out[:, cursor:at] = positions[position : position + at - cursor]
                position += at - cursor
            temporal = temporal_patches(doc.video_frames[k]) if doc.is_video(k) else 1
            block, advance = _vision_positions(temporal, rows // merge_size, cols // merge_size)
            cursor = at + block.shape[1]
            np.add(block, position, out=out[:, at:cursor])
            position += advance
        end = start + doc.length
        out[:, cursor:end] = positions[position : position + end - cursor]
        start = end
