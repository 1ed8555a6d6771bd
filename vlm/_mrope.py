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
rule), or, given Qwen2.5-VL's `tokens_per_second`, at each patch's index times that and the
seconds a patch spans, rounded down (t = 0, 2, 4, ... at 2 tokens a second and 1 s a patch),
each over the frame's merged grid, and the end token and the text after take one past the
largest position of the block on any axis. That is the rule of Qwen's own training code and
of transformers up to 5.2; transformers' `get_rope_index` from 5.3 resumes the text one past
the spatial grid alone, lower than the block's last temporal positions where a video's last
temporal position passes its merged rows and columns (transformers issue 45381). Where the
placeholders stamp a video's temporal patches with their times as text (Qwen3-VL,
`video_timestamps`), each patch is an image of its own after its stamp's text, at t = 0, as
Qwen3-VL's model splits a video. Positions
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
def _vision_positions(temporal: int, rows: int, cols: int, step: float = 1.0) -> tuple[np.ndarray, int]:
    """An image's (temporal=1) or a video's placeholders relative to the position before it:
    (3, temporal * rows * cols + 2) int32 with the start token at 0, the merged cells of each
    temporal patch row-major at 1 + (t, h, w), t the patch's index times `step` rounded down, the
    end token one past the largest position on any axis (read-only); and how far the block moves
    the position (start, grid, end)."""
    times = _temporal_positions(temporal, step)
    span = max(rows, cols, int(times[-1]) + 1)
    cells = np.zeros((3, temporal, rows, cols), dtype=np.int32)
    cells[0] = times[:, None, None]
    cells[1] = np.arange(rows, dtype=np.int32)[None, :, None]
    cells[2] = np.arange(cols, dtype=np.int32)[None, None, :]
    count = temporal * rows * cols
    block = np.zeros((3, count + 2), dtype=np.int32)
    block[:, 1:-1] = cells.reshape(3, count) + 1
    block[:, -1] = 1 + span
    block.flags.writeable = False
    return block, span + 2


def _temporal_positions(temporal: int, step: float) -> np.ndarray:
    """t of each temporal patch: its index times `step`, rounded down, in float32 as the models
    compute it (transformers' `get_vision_position_ids`: a float32 interval times the index)."""
    return (np.arange(temporal, dtype=np.float32) * np.float32(step)).astype(np.int32)


@cache
def ramp(length: int) -> np.ndarray:
    """0, 1, ..., length - 1 (read-only): positions are slices of it, no array made per text run
    here or per document in the packer's `position_ids`."""
    out = np.arange(length, dtype=np.int32)
    out.flags.writeable = False
    return out


def fill_mrope_positions(out: np.ndarray, documents, item_offsets: list[int], placeholders,
                         tokens_per_second: float | None = None) -> None:
    """Write the (3, L) positions of a row's documents into `out` (zeros on entry; padding stays 0).

    `documents` are the row's `PlacedDocument`s in order (their `grids` in patches, `video_frames`
    and `length`); `item_offsets[k]` is the row position of the k-th image's or video's first
    placeholder token; `placeholders` the row's `QwenPlaceholders`. A video whose temporal patches
    are stamped (Qwen3-VL, `video_timestamps`) is positioned as the model splits it: each patch's
    stamp as text, then the patch as an image (t = 0). One slice assignment per text run and per
    image or video: no loop over tokens. A video's temporal patches step by 1 (Qwen2-VL), or with
    `tokens_per_second` by that times the seconds a patch spans (Qwen2.5-VL: `doc.video_seconds`,
    its `second_per_grid_ts`). Without that scale a text position never exceeds its token's index in the document (a block's
    tokens outnumber what it moves the position), so the ramp of the row's length covers every
    text run; with it, a video may move the position past the row's length, and the text after
    it is given a ramp of its own (`_text_run`).
    """
    positions = ramp(out.shape[1])
    merge_size = placeholders.merge_size
    offsets = iter(item_offsets)
    start = 0
    for doc in documents:
        position, cursor = 0, start
        for k, (rows, cols) in enumerate(doc.grids):
            at = next(offsets)
            if at > cursor:
                out[:, cursor:at] = _text_run(positions, position, at - cursor)
                position += at - cursor
            grid = (rows // merge_size, cols // merge_size)
            stamped = doc.stamp_times(k)
            if stamped:
                cursor, position = _stamped_video(out, positions, at, position, grid, stamped,
                                                  placeholders.video_timestamps)
                continue
            temporal, step = 1, 1.0
            if doc.is_video(k):
                temporal = temporal_patches(doc.video_frames[k])
                if tokens_per_second is not None:  # as the model: float32 product of the two
                    step = float(np.float32(tokens_per_second) * np.float32(doc.video_seconds[k]))
            block, advance = _vision_positions(temporal, *grid, step)
            cursor = at + block.shape[1]
            np.add(block, position, out=out[:, at:cursor])
            position += advance
        end = start + doc.length
        out[:, cursor:end] = _text_run(positions, position, end - cursor)
        start = end


def _stamped_video(out: np.ndarray, positions: np.ndarray, at: int, position: int, grid: tuple[int, int],
                   times: tuple[float, ...], stamps) -> tuple[int, int]:
    """Write a stamped video's positions from row position `at`, the document's position being
    `position`: per temporal patch, its stamp's tokens as text, then an image's block. Returns
    the row position and the document's position after it."""
    block, advance = _vision_positions(1, *grid)
    for t in times:
        n = len(stamps.ids(t))
        out[:, at : at + n] = _text_run(positions, position, n)
        at, position = at + n, position + n
        np.add(block, position, out=out[:, at : at + block.shape[1]])
        at, position = at + block.shape[1], position + advance
    return at, position


def _text_run(positions: np.ndarray, position: int, count: int) -> np.ndarray:
    """position, position + 1, ... (count of them): a slice of the row's ramp where it reaches."""
    if position + count <= len(positions):
        return positions[position : position + count]
    return np.arange(position, position + count, dtype=np.int32)
