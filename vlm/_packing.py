"""Multimodal packing: documents of text tokens and images into fixed-length rows.

A *document* is one record: its text tokens (`input_ids`, already tokenized with BOS/EOS as the
pipeline configured) and zero or more images, each expanded to its placeholder tokens. Where the
images go is `image_position` ("before_text", "after_bos", "after_text"), or, per record, an
explicit `image_offsets` list (image k goes right before text token `image_offsets[k]`), which
gives interleaved documents. "after_bos" puts the images after the text's first token, whatever
it is: the packer does not know the BOS id, so the BOS must be there (`tokenize(bos=...)`;
`pack_multimodal` refuses "after_bos" after a tokenize without one, since the images would split
each caption after its first word).

Decisions (the accumulator, one per lane segment): documents are placed first-fit into up to
`max_open_rows` open rows; a document is never split and an image never crosses a row. A row is
emitted when it is exactly full, when one more row must open and `max_open_rows` are open (the
oldest goes), and on flush. A document whose images alone need more than `max_length` tokens is
skipped ("images_exceed_length"); one whose images fit but whose text does not is cut on the text
side (the tail of its text goes; counted as a truncation). A document whose text holds a
placeholder id is skipped ("placeholder_in_text"): the model finds an image's slots by those ids,
so the text token would be taken for a slot of an image that is not there. A record without its
text field is skipped ("missing_text"), one whose ids from the data are no flat list of token ids
("not_tokens"), and one with neither text nor images ("empty_document"); images alone are a
document. One whose text's `<image>` markers (`tokenize(marker=...)`) are not as many as its
images is skipped ("marker_count_mismatch"), one whose loss mask is not one flag per text id
("bad_loss_mask").

Assembly (`assemble_row`, stateless): a few numpy copies per row. A row carries
- tokens: `input_ids`; `labels` — at position i the token to predict next: the next token of the
  same document if that token is text, IGNORE_INDEX if it is an image placeholder, a text token
  the record's loss mask leaves out (`tokenize(prompt_field=...)`), at a document's last token
  and on padding (the shifted form of "labels = -100 on image tokens");
  `position_ids` restarting at 0 for each document; `document_ids` 0, 1, … per document,
  PADDING_DOCUMENT on padding;
- ragged: `pixel_values` (num_patches, patch_dim) — every image's patches concatenated in image
  order, each image's patches in raster order (row-major over its patch grid), a patch flattened
  as (patch_row, patch_col, channel) uint8 when the pipeline decoded images itself, or the image
  processor's own rows when one was given; `image_grid` (num_images, 2) int32 (rows, cols) in
  patches; `image_token_offset` (num_images,) int32, the position in the row of each image's first
  placeholder token; with `LlavaNextPlaceholders`, `image_sizes` (num_images, 2) int32, each
  picture's (height, width) as shown, by which LLaVA-NeXT unpads its features; with
  `QwenPlaceholders(video_pad=...)` or `LlavaNextPlaceholders(video_pad=...)`, a video is one
  block of its own (with `video_timestamps`, one block per temporal patch, each after its time
  stamp's text) and its frames go to `video_pixel_values`, `video_grid` (temporal patches, rows,
  cols) and `video_token_offset` instead (`_allocate_videos`);
- with `mrope=True` (Qwen2-VL-family models, `QwenPlaceholders` only), also `mrope_position_ids`
  (3, max_length) int32: each token's (temporal, height, width) rotary positions, restarting per
  document, 0 on padding (`vlm._mrope`).

Nothing here uses randomness: the output is a pure function of the segment's input.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np

from zephon._accumulator import SegmentContext
from zephon._document_values import ROW_FIELDS as TEXT_ROW_FIELDS
from zephon._document_values import check_value_names, read_values, value_arrays
from zephon._errors import ConfigurationError, check_count, check_field_name, check_token_id
from zephon._first_fit import FirstFitRows
from zephon._memory import ROW_FIELD_BYTES
from zephon._fingerprint import stable_description
from zephon._loss_mask import LOSS_MASK_FIELD, loss_mask_detail, targets_of
from zephon._markers import OFFSETS_FIELD, MarkerOffsets
from zephon._packing import RefusedRecords, no_tokens_detail, token_ids
from zephon._records import RecordAddress
from zephon._sequence import IGNORE_INDEX, PADDING_DOCUMENT, PackedSequence

from ._deferred import DecodeDeferred, DeferredImage, decode_row
from ._frame_text import FrameText
from ._image import (DEFAULT_SPEC, ImageSpec, anyres_features, canvas_arrangement, several_features, sizes_field,
                     split_arrangement)
from ._mrope import fill_mrope_positions, ramp
from ._operator_checks import check_operators_before, deferred_policy, followed_settings
from ._placeholders import Placeholders, QwenPlaceholders, patch_times, temporal_patches, video_layout
from ._video import frame_interval_field, frame_times_field, video_duration_field

__all__ = ["IMAGE_POSITIONS", "MultimodalPacker", "PackMultimodal", "PlacedDocument", "RowPlan", "assemble_row"]

IMAGE_POSITIONS = ("before_text", "after_bos", "after_text")

_DETAILS = {"tiles": split_arrangement, "unpadded": anyres_features, "canvas": canvas_arrangement}
"""What each `image_detail` of the placeholders is, from a picture's (height, width) as shown and the
packer's spec, and the fits whose pictures it is of (`_DETAIL_FITS`): the first counts from the
size as shown; Idefics3's pictures of fit="fixed" (not split) are each one tile, `tokens_for`'s
default, and carry no size. Llama 4's: the (rows, columns) of tiles of the picture's canvas."""
_DETAIL_FITS = {"tiles": ("split", "fixed"), "unpadded": ("anyres",), "canvas": ("canvas",)}

def _details(detail: str | None, sizes: tuple[tuple[int, int], ...], spec: ImageSpec) -> tuple:
    """Per picture of a record, what the placeholders count it from besides its grid (`_DETAILS`
    of its size as shown); where the spec sizes a record's several pictures otherwise
    (`ImageSpec.for_pictures`: LLaVA-OneVision's, each padded to one tile), those pictures'."""
    if detail == "unpadded" and len(sizes) > 1 and spec.several_pad is not None:
        return (several_features(spec),) * len(sizes)
    return tuple(_DETAILS[detail](height, width, spec) for height, width in sizes)


_SHORT_TEXT = 128
"""Texts up to this many tokens are searched for placeholder ids as a list (see
`MultimodalPacker._holds_a_placeholder`): with 3 ids the two ways cost the same at 200-250
tokens, on 3.11 and 3.14t alike (6 and 9-12 µs at 128)."""

_UNSET_UNTIL_BOUND = ("spec", "pixels_field", "grid_field")
"""The settings of a `PackMultimodal` that None leaves to its decoder and that have no value until
it is bound (`patch_dim` and `patch_dtype` left None follow it too, but None is a layout of their
own: the spec's uint8 patches)."""

ROW_FIELDS = (*TEXT_ROW_FIELDS, "mrope_position_ids", "pixel_values", "image_grid", "image_token_offset", "image_sizes",
              "video_pixel_values", "video_grid", "video_token_offset", "video_second_per_grid")
"""Every field a row of this packer may hold, which no `document_values` may be named as."""

_NO_TEXT = np.empty(0, dtype=np.int32)
"""The text of a document that is images alone (read-only: shared by every such document)."""
_NO_TEXT.flags.writeable = False


class DocumentFields(NamedTuple):
    """The fields a document's text, loss mask and image offsets are read from."""

    text: str
    loss_mask: str
    offsets: str


@dataclass(frozen=True)
class PlacedDocument:
    """One document as the packer decided it: its (possibly cut) text and its images in order.

    `images[k]` is (H, W, 3) uint8 on the patch grid, or (rows * cols, patch_dim) rows from an
    image processor, or a (T, H, W, 3) video in a video layout (Qwen's, LLaVA-OneVision's);
    `grids[k]` its (rows, cols) in patches (a video's frame's); it goes before text token
    `offsets[k]`. `length` counts text and placeholder tokens. `video_frames[k]` is T for such a
    video and 0 for an image (empty when the document has no video in such a layout), and in
    Qwen's `video_seconds[k]` the seconds its temporal patches span (its `second_per_grid_ts`; 0
    for an image; empty in LLaVA-OneVision's, whose model takes no time). `video_times[k]` holds
    the time of each of a video's temporal patches where the placeholders stamp them
    (`video_timestamps`, Qwen3-VL), () for an image; it is empty without stamps.
    """

    address: RecordAddress
    text: np.ndarray
    images: tuple[np.ndarray, ...]
    grids: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...]
    length: int
    video_frames: tuple[int, ...] = ()
    video_seconds: tuple[float, ...] = ()
    video_times: tuple[tuple[float, ...], ...] = ()
    sizes: tuple[tuple[int, int], ...] = ()
    """Per image, the (height, width) of the picture as shown where the placeholders count from
    it (they have an `image_detail`), else empty."""
    details: tuple[tuple[int, ...], ...] = ()
    """Per image, what the placeholders count its tokens from besides its grid, worked out from
    its size (`_DETAILS`: the (rows, columns) of tiles `Idefics3Placeholders` name, the features
    `LlavaNextPlaceholders` keep), else empty."""
    framing: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    """Per image, the ids of the text before and after its block where it is a video's frame and
    the packer writes text around frames (`FrameText`), else empty."""
    frames_as_images: bool = False
    """Whether its images are a video's frames, each taken as an image (no video layout): the
    placeholders may write them with a pad of their own (`PadPlaceholders.frame_pad`)."""
    targets: np.ndarray | None = None
    """The ids its text's positions learn, `text` with IGNORE_INDEX where the record's loss mask
    leaves a token out (`zephon._loss_mask`); None: the text itself."""
    values: tuple[float, ...] = ()
    """Its record's `document_values` (`zephon._document_values`), in the packer's order of names."""

    def is_video(self, k: int) -> bool:
        return bool(self.video_frames) and self.video_frames[k] > 0

    @property
    def learned(self) -> int:
        """The labels `_fill_row` writes for it that a loss counts: each text token its targets
        keep, but for the document's first token where text opens it (no position before it)."""
        targets = self.text if self.targets is None else self.targets
        kept = len(targets) if self.targets is None else int(np.count_nonzero(targets != IGNORE_INDEX))
        opens_with_text = len(targets) > 0 and (not self.offsets or self.offsets[0] > 0)
        return kept - int(opens_with_text and targets[0] != IGNORE_INDEX)

    def stamp_times(self, k: int) -> tuple[float, ...]:
        """Item k's temporal patches' times where the placeholders stamp them, else ()."""
        return self.video_times[k] if self.video_times else ()


@dataclass(frozen=True)
class RowPlan:
    """Everything `assemble_row` needs to build one row; holds references, never copies, but for
    the text of a document cut to fit the row, a copy of the part it holds (a view kept the whole
    text alive as long as the row waited).

    The pipeline's packer emits plans, and the loader assembles them only when it takes them into
    a microbatch (`assemble_batch`, straight into the microbatch's arrays): rows waiting in shuffle
    buffers, or emitted all at once when a segment flushes, hold the decoded images they already
    referenced instead of ~1 MB copies each (race VLM recipe: up to 144 assembled rows, 117 MB,
    were alive at once), and no row is built only to be copied again into its batch.
    """

    documents: tuple[PlacedDocument, ...]
    max_length: int
    pad_id: int
    placeholders: Placeholders
    patch_size: int
    patch_dim: int
    patch_dtype: np.dtype
    masked: tuple[tuple[int, str, str], ...] = ()
    """(document index, reason, detail) of documents whose deferred image failed to decode: they
    keep their place but train nothing (see `vlm._deferred`)."""
    mrope: bool = False
    """Whether the row carries `mrope_position_ids` (see `vlm._mrope`)."""
    mrope_tokens_per_second: float | None = None
    """Qwen2.5-VL's temporal scale of a video's positions (`vlm._mrope`); None: Qwen2-VL's."""
    value_names: tuple[str, ...] = ()
    """The packer's `document_values`: each a ragged field of one value a document (a masked one's too)."""

    def assemble(self) -> PackedSequence:
        return assemble_row(self)

    @property
    def masked_documents(self) -> tuple[tuple[RecordAddress, str, str], ...]:
        """(address, reason, detail) of the masked documents, for the loader's ledger and its
        skipped examples."""
        return tuple((self.documents[number].address, reason, detail) for number, reason, detail in self.masked)

    @property
    def sources(self) -> tuple[RecordAddress, ...]:
        return tuple(doc.address for doc in self.documents)

    @property
    def num_real_tokens(self) -> int:
        return sum(doc.length for doc in self.documents)

    @property
    def tokens_by_dataset(self) -> dict[str, int]:
        """{dataset: text and placeholder tokens} of the row's documents, what the ledger counts as
        the row is handed over (a caption cut to fit counts what the row holds). A masked document
        counts like the others: it keeps its place in the row."""
        out: dict[str, int] = {}
        for doc in self.documents:
            out[doc.address.dataset] = out.get(doc.address.dataset, 0) + doc.length
        return out

    @property
    def learned_by_dataset(self) -> dict[str, int]:
        """{dataset: learned tokens} of the row's documents (`PlacedDocument.learned`): a masked
        document learns none, as it trains on nothing."""
        masked = {number for number, *_ in self.masked}
        out: dict[str, int] = {}
        for number, doc in enumerate(self.documents):
            learned = 0 if number in masked else doc.learned
            if learned:
                out[doc.address.dataset] = out.get(doc.address.dataset, 0) + learned
        return out

    @property
    def images_by_dataset(self) -> dict[str, int]:
        """{dataset: images} of the row's documents (a masked document's too: they keep their
        slots). A video in a layout of its own counts the frames the row holds for it (`video_frames`)."""
        per = getattr(self.placeholders, "video_temporal_patch", 1)
        out: dict[str, int] = {}
        for doc in self.documents:
            if doc.grids:
                n = sum(video_frames(f, per) if f else 1 for f in doc.video_frames) if doc.video_frames \
                    else len(doc.grids)
                out[doc.address.dataset] = out.get(doc.address.dataset, 0) + n
        return out

    @property
    def length(self) -> int:
        return self.max_length

    @staticmethod
    def assemble_batch(plans: list[RowPlan]) -> tuple[dict, dict, dict]:
        """(tokens, ragged, ragged_counts) of a microbatch made straight from its row plans: what
        collating `[p.assemble() for p in plans]` gives, without building each row first and then
        copying every row's pixels again into the batch."""
        plans = [_decoded(plan) for plan in plans]
        tokens, ragged, counts = _allocate(plans)
        starts = dict.fromkeys(ragged, 0)
        for i, plan in enumerate(plans):
            row = {name: array[i] for name, array in tokens.items()}
            parts = {}
            for name, array in ragged.items():
                n = int(counts[name][i])
                parts[name] = array[starts[name] : starts[name] + n]
                starts[name] += n
            _fill_row(plan, row, parts)
        return tokens, ragged, counts


def assemble_row(plan: RowPlan) -> PackedSequence:
    """Build one packed row (a pure function of the plan; safe on any worker)."""
    plan = _decoded(plan)
    tokens, ragged, _ = _allocate([plan])
    row = {name: array[0] for name, array in tokens.items()}
    _fill_row(plan, row, ragged)
    return PackedSequence(tokens=row, sources=plan.sources, ragged=ragged)


def _decoded(plan: RowPlan) -> RowPlan:
    """The plan with any deferred images decoded here, if the loader's row work did not run (a
    packer used on its own): a failure raises, as nothing would count a masked document. A plan
    without deferred images comes back as it is."""
    return decode_row(plan, on_error="raise")


def _allocate(plans: list[RowPlan]) -> tuple[dict, dict, dict]:
    """The arrays of len(plans) rows, padding-filled; image grids already in place."""
    first = plans[0]
    shape = (len(plans), first.max_length)
    tokens = {
        "input_ids": np.full(shape, first.pad_id, dtype=np.int32),
        "labels": np.full(shape, IGNORE_INDEX, dtype=np.int32),
        "position_ids": np.zeros(shape, dtype=np.int32),
        "document_ids": np.full(shape, PADDING_DOCUMENT, dtype=np.int32),
    }
    if first.mrope:
        tokens["mrope_position_ids"] = np.zeros((len(plans), 3, first.max_length), dtype=np.int32)
    grids = [[g for doc in plan.documents for k, g in enumerate(doc.grids) if not doc.is_video(k)] for plan in plans]
    patches = [sum(r * c for r, c in row) for row in grids]
    every = [g for row in grids for g in row]
    ragged = {
        "pixel_values": np.empty((sum(patches), first.patch_dim), dtype=first.patch_dtype),
        "image_grid": np.array(every, dtype=np.int32).reshape(len(every), 2),
        "image_token_offset": np.empty(len(every), dtype=np.int32),
    }
    images = [len(row) for row in grids]
    counts = {
        "pixel_values": np.array(patches, dtype=np.int64),
        "image_grid": np.array(images, dtype=np.int64),
        "image_token_offset": np.array(images, dtype=np.int64),
    }
    if getattr(first.placeholders, "image_detail", None) == "unpadded":  # of fit="anyres" alone
        # LLaVA-NeXT's model unpads each picture's features by its size as shown (`image_sizes`).
        ragged["image_sizes"] = np.array([size for plan in plans for doc in plan.documents for k, size in
                                          enumerate(doc.sizes) if not doc.is_video(k)], dtype=np.int32).reshape(-1, 2)
        counts["image_sizes"] = counts["image_grid"].copy()
    if video_layout(first.placeholders):
        _allocate_videos(plans, ragged, counts)
    if first.value_names:
        values, value_counts = value_arrays([[doc.values for doc in plan.documents] for plan in plans],
                                            first.value_names)
        ragged.update(values)
        counts.update(value_counts)
    return tokens, ragged, counts


def _allocate_videos(plans: list[RowPlan], ragged: dict, counts: dict) -> None:
    """The rows' video fields: `video_pixel_values`, every frame's uint8 patches (p·p·3, raster
    order), the frames of each temporal patch in turn; `video_grid` (temporal patches, rows, cols),
    Qwen's `video_grid_thw`; `video_token_offset`, each video's first placeholder; in Qwen's
    layout `video_second_per_grid`, the seconds each video's temporal patches span (Qwen2.5-VL's
    `second_per_grid_ts`). Present, maybe empty, on every row of such a packer, so rows always
    batch."""
    placeholders = plans[0].placeholders
    per = placeholders.video_temporal_patch
    grids = [[(temporal_patches(doc.video_frames[k], per), *g) for doc in plan.documents
              for k, g in enumerate(doc.grids) if doc.is_video(k)] for plan in plans]
    patches = [sum(per * t * r * c for t, r, c in row) for row in grids]
    every = [g for row in grids for g in row]
    p = plans[0].patch_size
    ragged["video_pixel_values"] = np.empty((sum(patches), p * p * 3), dtype=np.uint8)
    ragged["video_grid"] = np.array(every, dtype=np.int32).reshape(len(every), 3)
    ragged["video_token_offset"] = np.empty(len(every), dtype=np.int32)
    videos = np.array([len(row) for row in grids], dtype=np.int64)
    counts.update(video_pixel_values=np.array(patches, dtype=np.int64), video_grid=videos,
                  video_token_offset=videos.copy())
    if spaces_videos_by_time(placeholders):
        ragged["video_second_per_grid"] = np.array(
            [doc.video_seconds[k] for plan in plans for doc in plan.documents for k in range(len(doc.grids))
             if doc.is_video(k)], dtype=np.float32)
        counts["video_second_per_grid"] = videos.copy()


def spaces_videos_by_time(placeholders: Placeholders) -> bool:
    """Whether the convention's videos carry the seconds their temporal patches span: Qwen's,
    whose M-RoPE (Qwen2.5-VL) spaces them so; LLaVA-OneVision's model takes no time."""
    return video_layout(placeholders) and isinstance(placeholders, QwenPlaceholders)


def video_frames(frames: int, per: int) -> int:
    """The frames a row holds for a video of `frames` frames: whole temporal patches of `per`."""
    return per * temporal_patches(frames, per)


def _fill_row(plan: RowPlan, row: dict[str, np.ndarray], ragged: dict[str, np.ndarray]) -> None:
    """Write one row's tokens, labels, positions, documents, patches and image (and video)
    offsets in place; `ragged` holds the row's own part of each ragged field, its grids written.

    Position i's label is token i + 1 where that token is text of the same document, so each text
    run writes its own tokens as the labels of the positions just before them (`_write_text`);
    every other label keeps the IGNORE_INDEX the row was allocated with. This is the same as
    masking by a text-position array and `np.where` per document, in one slice write per run.
    """
    input_ids, labels = row["input_ids"], row["labels"]
    position_ids, document_ids = row["position_ids"], row["document_ids"]
    positions = ramp(plan.max_length)
    tokens_for = plan.placeholders.tokens_for
    frame_tokens_for = plan.placeholders.frame_tokens_for if getattr(plan.placeholders, "frame_pad", None) is not None \
        else tokens_for
    p = plan.patch_size
    masked = {number for number, *_ in plan.masked}
    pixel_values, image_offset = ragged["pixel_values"], ragged["image_token_offset"]
    at = patch_at = k = 0
    video_patch_at = v = 0
    item_offsets = []  # every image's and video's first placeholder, in row order (M-RoPE)
    for number, doc in enumerate(plan.documents):
        start, cut, text = at, 0, doc.text
        targets = text if doc.targets is None else doc.targets
        learns = None if number in masked else labels
        for index, (image, (rows, cols), offset) in enumerate(zip(doc.images, doc.grids, doc.offsets)):
            if offset > cut:
                at = _write_text(text[cut:offset], targets[cut:offset], at, start, input_ids, learns)
            cut = offset
            item_offsets.append(at)
            if doc.is_video(index):
                per = plan.placeholders.video_temporal_patch
                temporal = temporal_patches(len(image), per)
                tokens = plan.placeholders.video_tokens_for(temporal, rows, cols, doc.stamp_times(index))
                ragged["video_token_offset"][v] = at
                n = rows * cols
                # Whole temporal patches: Qwen's odd count's last frame twice, as its processors pad.
                for f in range(per * temporal):
                    target = ragged["video_pixel_values"][video_patch_at : video_patch_at + n]
                    _write_patches(target, image[min(f, len(image) - 1)], rows, cols, p)
                    video_patch_at += n
                v += 1
            else:
                if doc.framing:
                    at = _write_ids(doc.framing[index][0], at, input_ids)
                if doc.details:
                    tokens = tokens_for(rows, cols, doc.details[index])
                else:
                    tokens = (frame_tokens_for if doc.frames_as_images else tokens_for)(rows, cols)
                image_offset[k] = at
                n = rows * cols
                _write_patches(pixel_values[patch_at : patch_at + n], image, rows, cols, p)
                patch_at += n
                k += 1
            at = _write_ids(tokens, at, input_ids)
            if doc.framing:
                at = _write_ids(doc.framing[index][1], at, input_ids)
        if len(text) > cut:
            at = _write_text(text[cut:], targets[cut:], at, start, input_ids, learns)
        position_ids[start:at] = positions[: at - start]
        document_ids[start:at] = number
    if plan.mrope:
        fill_mrope_positions(row["mrope_position_ids"], plan.documents, item_offsets, plan.placeholders,
                             plan.mrope_tokens_per_second)


def _write_ids(ids: np.ndarray, at: int, input_ids: np.ndarray) -> int:
    """Write ids no position learns (placeholders, the text around frames) at row position `at`;
    returns the position after them."""
    input_ids[at : at + len(ids)] = ids
    return at + len(ids)


def _write_text(run: np.ndarray, learned: np.ndarray, at: int, start: int, input_ids: np.ndarray,
                labels: np.ndarray | None) -> int:
    """Write a document's text run at row position `at` (the document starts at `start`) and,
    unless `labels` is None (a masked document), its targets (`learned`: the run, IGNORE_INDEX
    where its loss mask leaves a token out) as the labels of the positions before them: all of
    them, or all but the first where the run opens the document. Returns the position after the
    run."""
    end = at + len(run)
    input_ids[at:end] = run
    if labels is not None:
        if at > start:
            labels[at - 1 : end - 1] = learned
        else:
            labels[at : end - 1] = learned[1:]
    return end


def _write_patches(target: np.ndarray, image: np.ndarray, rows: int, cols: int, p: int) -> None:
    """Copy one image into its rows of `pixel_values`: (H, W, C) pixels as raster-order patches,
    (patches, patch_dim) processor rows as they are.

    Each patch row (p pixels of C samples) is contiguous in the image and in the patch, so both
    are viewed as blocks of that many bytes and NumPy moves whole blocks instead of one sample at
    a time (the race's 785 images at 448 px: 48 -> 33 ms per epoch, a plain copy of the same
    bytes 28 ms). Pixels of another dtype than the row's (a `RowPlan` built by hand) are converted
    by the assignment, as a copy of the samples does; so are Python objects (`patch_dtype=object`),
    whose references NumPy will not view as bytes.
    """
    if image.ndim != 3:
        target[...] = image
        return
    channels = image.shape[2]
    if image.dtype != target.dtype or image.dtype.hasobject:
        target.reshape(rows, cols, p, p, channels)[...] = image.reshape(rows, p, cols, p, channels).swapaxes(1, 2)
        return
    block = _block(p * channels * image.itemsize)
    source = np.ascontiguousarray(image).reshape(rows, p, cols, p * channels).view(block)
    target.reshape(rows, cols, p, p * channels).view(block)[...] = source.swapaxes(1, 2)


@cache
def _block(nbytes: int) -> np.dtype:
    """The dtype of one `nbytes` block, made once per size: building one costs ~3 µs, 7 % of
    copying a race image's patches."""
    return np.dtype((np.void, nbytes))


class MultimodalPacker:
    """First-fit packer of text+image documents (the accumulator of `pack_multimodal`).

    `push((address, record))` returns the rows now complete; `flush()` returns every row still
    open, oldest first, and leaves the packer empty. Records it cannot use are not lost: they are
    reported by `drain_skips()` as (address, reason, detail), and documents cut to fit by
    `drain_truncations()` as (address, text tokens dropped); the lane driver collects both.
    With `assemble=False` it emits `RowPlan`s instead of rows, so that the loader assembles them
    straight into the microbatch's arrays as it takes them (`RowPlan.assemble_batch`). `ctx` is accepted for the accumulator-factory shape; packing needs no randomness.

    Thread-safety: thread-unsafe; one instance per lane segment, driven by the lane's thread.
    """

    def __init__(
        self,
        ctx: SegmentContext | None,
        *,
        max_length: int,
        placeholders: Placeholders,
        spec: ImageSpec = DEFAULT_SPEC,
        pad_id: int,
        image_position: str = "before_text",
        text_field: str = "input_ids",
        pixels_field: str = "pixels",
        grid_field: str = "image_grid",
        offsets_field: str = OFFSETS_FIELD,
        max_open_rows: int = 16,
        patch_dim: int | None = None,
        patch_dtype: Any = None,
        assemble: bool = True,
        loss_mask_field: str = LOSS_MASK_FIELD,
        mrope: bool = False,
        mrope_tokens_per_second: float | None = None,
        frame_text: FrameText | None = None,
        document_values: tuple[str, ...] = (),
    ) -> None:
        max_length, max_open_rows = _validate(max_length, image_position, max_open_rows, placeholders, spec, mrope)
        mrope_tokens_per_second = _check_tokens_per_second(mrope_tokens_per_second, mrope, placeholders)
        _check_frame_text(frame_text, mrope, placeholders)
        self.ctx = ctx
        self.max_length = max_length
        self.placeholders = placeholders
        self._placeholder_ids = placeholders.token_ids
        self._placeholder_set = frozenset(self._placeholder_ids)
        self.spec = spec
        self.pad_id = _check_pad_id(pad_id, placeholders)
        self.image_position = image_position
        self.text_field, self.pixels_field = text_field, pixels_field
        self.grid_field, self.offsets_field = grid_field, offsets_field
        self.loss_mask_field = loss_mask_field
        self.value_names = document_values
        self.max_open_rows = max_open_rows
        self.patch_dim = spec.patch_dim if patch_dim is None else int(patch_dim)
        self.patch_dtype = np.dtype(np.uint8 if patch_dtype is None else patch_dtype)
        self.assemble = assemble
        self.mrope = mrope
        self.mrope_tokens_per_second = mrope_tokens_per_second
        self._video_layout = video_layout(placeholders)
        self._per_temporal_patch = getattr(placeholders, "video_temporal_patch", 1)
        self._video_seconds = spaces_videos_by_time(placeholders)
        self._interval_field = frame_interval_field(pixels_field)
        self._stamps = getattr(placeholders, "video_timestamps", None) is not None
        self._times_field = frame_times_field(pixels_field)
        self.frame_text = frame_text
        self._duration_field = video_duration_field(pixels_field)
        detail = getattr(placeholders, "image_detail", None)
        self._image_detail = detail if detail is not None and spec.fit == _DETAIL_FITS[detail][0] else None
        self._sizes_field = sizes_field(pixels_field)
        self._open: FirstFitRows[PlacedDocument] = FirstFitRows(max_length, max_open_rows)
        self._skips: list[tuple[RecordAddress, str, str | Callable[[], str]]] = []
        self._truncations: list[tuple[RecordAddress, int]] = []
        self._lengths: dict[tuple[int, int], int] = {}

    # -- the accumulator protocol -----------------------------------------------------------
    def push(self, item: tuple[RecordAddress, dict]) -> list:
        address, record = item
        doc = self._document(address, record)
        return [] if doc is None else self._place(doc)

    def flush(self) -> list:
        return [self._emit_rows(row) for row in self._open.drain()]

    def drain_skips(self) -> list[tuple[RecordAddress, str, str | Callable[[], str]]]:
        """Records skipped since the last call, as (address, reason, detail); the list is handed over."""
        skips, self._skips = self._skips, []
        return skips

    def drain_truncations(self) -> list[tuple[RecordAddress, int]]:
        """Documents cut to fit since the last call, as (address, text tokens dropped)."""
        cut, self._truncations = self._truncations, []
        return cut

    def empty_row(self) -> PackedSequence:
        """A padding-only row with empty ragged fields (what a finished lane pads a step with)."""
        return assemble_row(self._plan([]))

    # -- decisions --------------------------------------------------------------------------
    def placed(self, address: RecordAddress, record: dict) -> tuple[PlacedDocument, ...] | None:
        """The documents a record becomes, as they would be placed (one here), or None where it is
        skipped: what the token counter counts."""
        doc = self._document(address, record)
        return None if doc is None else (doc,)

    def _document(self, address: RecordAddress, record: dict, side: DocumentFields | None = None,
                  text_room: int | None = None) -> PlacedDocument | None:
        """The record's document as placed, its text, loss mask and image offsets read from `side`'s
        fields (None: the packer's own), or None where it is skipped (reported). Its text is cut
        to what a row leaves beside its images, and to `text_room` tokens where given (a pair's
        share of a row)."""
        text_field, loss_mask_field, offsets_field = side or (self.text_field, self.loss_mask_field,
                                                              self.offsets_field)
        text = record.get(text_field)
        if text is None:
            self._skips.append((address, "missing_text", no_tokens_detail("missing_text", text_field, record)))
            return None
        text = token_ids(text)
        if isinstance(text, str):
            if text != "empty_document":  # ids stored in the data: not a flat list of int32 ids
                self._skips.append((address, text, no_tokens_detail(text, text_field, record)))
                return None
            text = _NO_TEXT  # a document may be images alone
        elif self._holds_a_placeholder(text):
            # A caption that spells a placeholder with a tokenizer that does not split it (not
            # split_special_tokens, or an added token that is not special), or ids from the data.
            self._skips.append((address, "placeholder_in_text",
                                functools.partial(self._placeholder_detail, text, text_field)))
            return None
        targets = targets_of(text, record.get(loss_mask_field))
        if isinstance(targets, str):
            self._skips.append((address, targets, loss_mask_detail(loss_mask_field, text_field, record)))
            return None
        values = read_values(address, record, self.value_names, self._skips) if self.value_names else ()
        if values is None:
            return None
        pixels = record.get(self.pixels_field)
        images = _as_images(pixels, self._video_layout)
        video_frames = None if self._video_layout or not _is_video_frames(pixels) else len(pixels)
        offsets = self._offsets(address, record, len(images), len(text), offsets_field)
        if offsets is None:
            return None
        framing = self._framing(address, record, video_frames, text[offsets[-1]:] if offsets else text) \
            if self.frame_text is not None and video_frames is not None else ()
        grids = self._grids(address, record, images)
        frames = tuple(len(image) if _is_video(image) else 0 for image in images) if self._video_layout else ()
        if not any(frames):
            frames = ()
        sizes = self._shown_sizes(address, record, images) \
            if self._counts_from_sizes(address, video_frames, frames) else ()
        details = _details(self._image_detail, sizes, self.spec)
        seconds = times = ()
        if frames:
            if self._video_seconds:
                seconds = self._seconds_per_temporal_patch(address, record, frames)
            if self._stamps:
                times = self._patch_times(address, record, frames)
        lengths = self._lengths
        per = self._per_temporal_patch
        image_tokens = sum(len(before) + len(after) for before, after in framing)
        for k, grid in enumerate(grids):
            video = bool(frames) and frames[k] > 0  # in a video layout: keyed (temporal patches, rows, cols)
            key = (temporal_patches(frames[k], per), *grid) if video else (*grid, details[k]) if details else grid
            if video and times:  # stamped: a count of its own times' texts, not cached by grid
                image_tokens += self.placeholders.video_num_tokens(*key, times[k])
                continue
            n = lengths.get(key)
            if n is None:
                count = self.placeholders.video_num_tokens if video else self.placeholders.num_tokens
                try:
                    n = lengths[key] = count(*key)
                except ValueError as exc:  # an image the placeholders cannot write: its pixels are not the spec's
                    raise ConfigurationError(f"record {address}: {exc}") from None
            image_tokens += n
        if image_tokens > self.max_length:
            shown = [f"{temporal_patches(frames[k], per)} temporal x {h}x{w}" if frames and frames[k] else f"{h}x{w}"
                     for k, (h, w) in enumerate(grids)]
            self._skips.append((address, "images_exceed_length", f"its {len(grids)} image(s) take {image_tokens} tokens "
                                f"(patch grids {', '.join(shown)}); a row holds {self.max_length}"))
            return None
        if image_tokens + len(text) == 0:
            self._skips.append((address, "empty_document", f"{text_field!r} holds no token ids and it has no image"))
            return None
        room = self.max_length - image_tokens if text_room is None else min(text_room, self.max_length - image_tokens)
        if len(text) > room:
            self._truncations.append((address, len(text) - room))
            # A copy: a view kept the whole text alive as long as the row waited (a shuffle buffer).
            text = text[:room].copy()
            targets = None if targets is None else targets[:room].copy()
            offsets = tuple(min(o, room) for o in offsets)
        return PlacedDocument(address, text, tuple(images), grids, offsets, image_tokens + len(text), frames, seconds,
                              times, sizes, details, framing, video_frames is not None, targets, values)

    def _seconds_per_temporal_patch(self, address, record: dict, frames: tuple[int, ...]) -> tuple[float, ...]:
        """Per item, the seconds a video's temporal patch spans (two of its frame intervals, as
        `decode_video` wrote it beside the frames) and 0 for an image. A video made otherwise (a
        map of the user's) must say it too: Qwen2.5-VL spaces its positions by it."""
        interval = record.get(self._interval_field)
        if isinstance(interval, bool) or not isinstance(interval, (int, float, np.floating, np.integer)) \
                or not np.isfinite(interval) or interval <= 0:
            raise ConfigurationError(
                f"record {address}: a video in Qwen's video layout needs the seconds between its frames, a "
                f"positive number, in {self._interval_field!r} (decode_video writes it), got {reprlib.repr(interval)}"
            )
        return tuple(self._per_temporal_patch * float(interval) if n else 0.0 for n in frames)

    def _patch_times(self, address, record: dict, frames: tuple[int, ...]) -> tuple[tuple[float, ...], ...]:
        """Per item, the times of a video's temporal patches, from the times its frames are shown
        (`decode_video` writes them beside the frames), and () for an image. A video made
        otherwise must say them too: Qwen3-VL writes them as text before each patch."""
        videos = [n for n in frames if n]
        if len(videos) != 1:
            raise ConfigurationError(f"record {address}: Qwen3-VL's stamped layout takes one video a record (as "
                                     f"decode_video writes it), got {len(videos)}")
        shown = _seconds(record.get(self._times_field), videos[0])
        if shown is None:
            raise ConfigurationError(
                f"record {address}: a video in Qwen3-VL's stamped layout needs the time each of its {videos[0]} "
                f"frames is shown, in seconds from its start and none negative, in {self._times_field!r} "
                f"(decode_video writes them), got {reprlib.repr(record.get(self._times_field))}"
            )
        return tuple(patch_times(shown) if n else () for n in frames)

    def _framing(self, address, record: dict, count: int,
                 following: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """Per frame of the record's video of `count` frames, the ids of the `FrameText` before
        and after its block, the outro as it is encoded before the document's text that
        `following` it (`FrameText.outro_before`). A video made otherwise (a map of the user's)
        must carry the frames' times and its duration where the text names them, as
        `decode_video` writes them."""
        times = duration = None
        if self.frame_text.needs_times:
            times = self._named_seconds(address, record, self._times_field, count,
                                        f"the time each of its {count} frames is shown")
        if self.frame_text.needs_duration:
            duration = float(self._named_seconds(address, record, self._duration_field, 1, "its duration")[0])
        pieces = self.frame_text.pieces(count, times, duration)
        outro = self.frame_text.outro_before(following)
        return tuple((pieces[k], outro if k == count - 1 else _NO_TEXT) for k in range(count))

    def _named_seconds(self, address, record: dict, name: str, count: int, what: str) -> np.ndarray:
        """`count` seconds the `FrameText` names (`what`) from the record's `name`, flattened, or a
        named error."""
        given = record.get(name)
        seconds = _seconds(given, count, flat=True)
        if seconds is None:
            raise ConfigurationError(f"record {address}: the text around a video's frames (FrameText) names "
                                     f"{what}, in seconds and none negative, in {name!r} (decode_video writes it), "
                                     f"got {reprlib.repr(given)}")
        return seconds

    def _counts_from_sizes(self, address, video_frames: int | None, frames: tuple[int, ...]) -> bool:
        """Whether the record's pictures are counted from their sizes as shown: where the
        placeholders count so, but for a video's frames taken as images (`video_frames` not
        None), which Idefics3's models take uncut, one tile each (SmolVLM2's), and for a video in
        a layout of its own (`frames`), which the placeholders count by its frames. LLaVA-NeXT's
        placeholders cannot count a frame taken as an image, which has no canvas to unpad, nor
        pictures beside a video in one record, which has no size for the video: a
        ConfigurationError."""
        if not self._image_detail:
            return False
        if frames:
            if len(frames) > 1:
                raise ConfigurationError(f"record {address}: {type(self.placeholders).__name__} counts a picture's "
                                         f"tokens from its size as shown, and a record holding a video holds no "
                                         f"picture beside it to count so (decode_video writes the video alone)")
            return False
        if video_frames is None:
            return True
        if self._image_detail != "tiles":
            raise ConfigurationError(f"record {address}: {type(self.placeholders).__name__} counts a picture's "
                                     f"tokens from its size as shown, and a video's frames have none to count by")
        return False

    def _shown_sizes(self, address, record: dict, images: list) -> tuple[tuple[int, int], ...]:
        """Per image, the (height, width) of the picture as shown, which the placeholders count
        from: a deferred image's from its header, a decoded one's from the record
        (`decode_images` writes it beside the pixels). The pixels alone do not say it: 2x4 and
        4x2 tiles stack alike, and LLaVA-NeXT unpads by the size."""
        if images and all(isinstance(image, DeferredImage) and image.size is not None for image in images):
            sizes = tuple(image.size for image in images)
        else:
            given = record.get(self._sizes_field)
            sizes = () if given is None else _given_grids(given)
            if sizes is None or len(sizes) != len(images) or any(h < 1 or w < 1 for h, w in sizes):
                raise ConfigurationError(
                    f"record {address}: {type(self.placeholders).__name__} counts an image's tokens from the "
                    f"(height, width) of the picture as shown: its {len(images)} image(s) need theirs in "
                    f"{self._sizes_field!r} (decode_images with a fit='split' or 'anyres' ImageSpec writes them), "
                    f"got {reprlib.repr(given)}")
        return sizes

    def _placeholder_detail(self, text: np.ndarray, text_field: str) -> str:
        where = np.flatnonzero(np.isin(text, self._placeholder_ids))
        return (f"{text_field!r} holds the placeholder id {int(text[where[0]])} at token {int(where[0])} "
                f"({len(where)} in all): a tokenizer that does not split special tokens, or ids stored in the data")

    def _holds_a_placeholder(self, text: np.ndarray) -> bool:
        """Whether the text holds one of the placeholders' ids. A caption is a few tokens, which as
        a list against a set cost ~0.8 µs, where a NumPy comparison per id costs ~11 µs whatever
        the length (race captions, 8 tokens on average: half of a document's decisions); past
        `_SHORT_TEXT` tokens the comparisons are used, which cost less from ~200 tokens on."""
        if len(text) <= _SHORT_TEXT:
            return not self._placeholder_set.isdisjoint(text.tolist())
        return any((text == token_id).any() for token_id in self._placeholder_ids)

    def _grids(self, address, record: dict, images: list[np.ndarray]) -> tuple[tuple[int, int], ...]:
        given = record.get(self.grid_field)
        p, cell = self.spec.patch_size, self.spec.cell
        if given is not None:
            grids = _given_grids(given)
            if grids is None:
                raise ConfigurationError(
                    f"record {address}: {self.grid_field}={reprlib.repr(given)} is not a (rows, cols) pair of "
                    "whole numbers per image"
                )
            if len(grids) != len(images):
                raise ConfigurationError(f"record {address}: {len(images)} images but {len(grids)} grids")
        else:
            grids = []
            for image in images:
                if isinstance(image, DeferredImage):
                    grids.append(image.grid)
                    continue
                if image.ndim != 3 and not (self._video_layout and _is_video(image)):
                    raise ConfigurationError(
                        f"record {address}: an image of shape {image.shape} needs its grid in {self.grid_field!r}"
                    )
                h, w = image.shape[-3:-1]
                if h % cell or w % cell:
                    raise ConfigurationError(
                        f"record {address}: a {h}x{w} image is not on the {cell}px grid of the packer's ImageSpec; "
                        "decode it with the same spec"
                    )
                grids.append((h // p, w // p))
            grids = tuple(grids)
        m = self.placeholders.merge_size
        for rows, cols in grids:
            if rows < 1 or cols < 1 or rows % m or cols % m:
                raise ConfigurationError(
                    f"record {address}: a {rows}x{cols} patch grid is not a whole number of the placeholders' "
                    f"{m}x{m} merged cells (does the image processor merge like the placeholders?)"
                )
        for image, (rows, cols) in zip(images, grids):
            if isinstance(image, DeferredImage):
                ok = image.grid == (rows, cols) and image.spec.patch_size == p and image.spec.cell == cell \
                    and self.patch_dtype == np.uint8 and self.patch_dim == image.spec.patch_dim
            elif self._video_layout and _is_video(image):  # the spec's frames, whatever the images' layout
                ok = image.shape[1:] == (rows * p, cols * p, 3) and image.dtype == np.uint8 and len(image) > 0
            elif image.ndim == 3:
                ok = image.shape[:2] == (rows * p, cols * p) and image.dtype == self.patch_dtype \
                    and image.shape[2] * p * p == self.patch_dim
            else:
                ok = image.shape == (rows * cols, self.patch_dim) and image.dtype == self.patch_dtype
            if not ok:
                raise ConfigurationError(
                    f"record {address}: image {image.shape} {image.dtype} does not match grid {rows}x{cols} with "
                    f"patch_dim={self.patch_dim} {self.patch_dtype} (set patch_dim/patch_dtype for processor output)"
                )
        return grids

    def _offsets(self, address, record: dict, num_images: int, num_text: int,
                 offsets_field: str) -> tuple[int, ...] | None:
        """Where each image goes among the text tokens; None for a record skipped (reported).

        Offsets `tokenize(marker=...)` wrote (`MarkerOffsets`) count the markers of the text: a
        count unlike the images is that record's (a caption with two `<image>` and one image, or
        none where it has one), skipped as `marker_count_mismatch`. Offsets from the data that do
        not place each image are refused as a configuration error, naming the record."""
        given = record.get(offsets_field)
        if isinstance(given, MarkerOffsets) and len(given) != num_images:
            self._skips.append((address, "marker_count_mismatch", f"its text held {len(given)} {given.marker!r} "
                                f"marker(s) ({offsets_field!r}) but it has {num_images} image(s) in "
                                f"{self.pixels_field!r}: one marker per image (a video: "
                                f"{'one' if self._video_layout else 'per frame'})"))
            return None
        if given is not None:
            offsets = _whole_numbers(given)
            if offsets is None or len(offsets) != num_images or any(b < a for a, b in pairwise(offsets)) \
                    or (offsets and (offsets[0] < 0 or offsets[-1] > num_text)):
                shown = reprlib.repr(given) if offsets is None else offsets
                raise ConfigurationError(
                    f"record {address}: {offsets_field}={shown} must give one non-decreasing "
                    f"offset in [0, {num_text}] per image ({num_images}), each a whole number"
                )
            return tuple(offsets)
        position = self.image_position
        at = 0 if position == "before_text" else num_text if position == "after_text" else min(1, num_text)
        return (at,) * num_images

    def _place(self, doc: PlacedDocument) -> list:
        return [self._emit_rows(row) for row in self._open.place(doc, doc.length)]

    def _emit_rows(self, documents: list[PlacedDocument]):
        plan = self._plan(documents)
        return assemble_row(plan) if self.assemble else plan

    def _plan(self, documents: list[PlacedDocument]) -> RowPlan:
        return RowPlan(tuple(documents), self.max_length, self.pad_id, self.placeholders,
                       self.spec.patch_size, self.patch_dim, self.patch_dtype, mrope=self.mrope,
                       mrope_tokens_per_second=self.mrope_tokens_per_second, value_names=self.value_names)


def _as_images(value: Any, video_layout: bool) -> list[np.ndarray | DeferredImage]:
    """None -> no image; (H, W, 3) or a DeferredImage -> one; (T, H, W, 3) video -> T frames, or
    itself in a video layout; a list -> each."""
    if value is None:
        return []
    if isinstance(value, DeferredImage):
        return [value]
    if isinstance(value, np.ndarray):
        if value.ndim == 4 and not video_layout:
            return list(value)
        return [value]
    return [v if isinstance(v, DeferredImage) else np.asarray(v) for v in value]


def _seconds(value: Any, count: int, *, flat: bool = False) -> np.ndarray | None:
    """`count` times in seconds from the data as float64, 1-D (any shape of them where `flat`),
    finite and none negative; None where `value` is not such (a string, a bool, the wrong count)."""
    if value is None or isinstance(value, (str, bytes, bool)):
        return None
    try:
        seconds = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if flat:
        seconds = seconds.reshape(-1)
    if seconds.ndim != 1 or len(seconds) != count or not np.isfinite(seconds).all() or (seconds < 0).any():
        return None
    return seconds


def _is_video_frames(value: Any) -> bool:
    """Whether a record's pixels are one decoded video, (T, H, W, 3) frames (`decode_video`'s)."""
    return isinstance(value, np.ndarray) and value.ndim == 4


def _is_video(image: Any) -> bool:
    """Whether a packer item is a video kept whole ((T, H, W, 3) frames, Qwen's video layout)."""
    return not isinstance(image, DeferredImage) and image.ndim == 4


def _whole_numbers(value: Any) -> list[int] | None:
    """The items of a list, tuple or 1-D integer array as ints, or None where `value` is not such a
    sequence or an item is not a whole number. Offsets and grids come from the data, where a string
    "3" was read as 3 and 1.9 truncated to 1, silently; a bool is refused too
    (NumPy reads True among integers as 1), as `token_ids` refuses one among token ids."""
    if isinstance(value, np.ndarray):
        return value.tolist() if value.ndim == 1 and value.dtype.kind in "iu" else None
    if not isinstance(value, (list, tuple)):
        return None  # a bare number, a string, a mapping
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        return None
    return [int(v) for v in value]


def _given_grids(value: Any) -> tuple[tuple[int, int], ...] | None:
    """(rows, cols) per image from a record's grid field, or None where it is not one: an
    (images, 2) integer array (what `decode_images` with a processor writes), a list of pairs, or
    a flat list of an even count of whole numbers, which the packer always took as pairs. An odd
    count failed in `reshape` as a bare ValueError, and fractions and strings were converted."""
    if isinstance(value, np.ndarray) and value.ndim == 2:
        flat = _whole_numbers(value.reshape(-1)) if value.shape[1] == 2 else None
    elif isinstance(value, (list, tuple)) and value and all(isinstance(p, (list, tuple, np.ndarray)) for p in value):
        pairs = [_whole_numbers(pair) for pair in value]
        flat = None if any(p is None or len(p) != 2 for p in pairs) else [n for p in pairs for n in p]
    else:
        flat = _whole_numbers(value)
    if flat is None or len(flat) % 2:
        return None
    return tuple(zip(flat[::2], flat[1::2]))


# The spec presets of each placeholder convention's models, which a merge mismatch's refusal names.
_PRESETS = {"QwenPlaceholders": "ImageSpec.qwen2_vl() or ImageSpec.qwen3_vl()",
            "PixtralPlaceholders": "ImageSpec.pixtral()",
            "Idefics3Placeholders": "ImageSpec.idefics3() or ImageSpec.smolvlm()",
            "LlavaNextPlaceholders": "ImageSpec.llava_next() or ImageSpec.llava_onevision()",
            "Llama4Placeholders": "ImageSpec.llama4()",
            "AyaVisionPlaceholders": "ImageSpec.aya_vision()",
            "Cohere2VisionPlaceholders": "ImageSpec.command_a_vision()"}


def _validate(max_length, image_position, max_open_rows, placeholders, spec, mrope) -> tuple[int, int]:
    """Refuses a bad setting; returns (max_length, max_open_rows) as plain ints. The sizes are
    checked as pack_flat checks its own (`check_count`): a bool is refused, not taken as 1, and a
    NumPy integer is taken, as a plain int, so that the fingerprint holds the number. `mrope` is
    checked before the spec: with Pixtral's placeholders a Qwen spec merges unlike them too, and
    that refusal hid the one saying what was meant. A `spec` of None (a `PackMultimodal`'s, left to
    follow its decoder) is checked once the packer is bound (`PackMultimodal.bound_to`)."""
    max_length = check_count(max_length, "pack_multimodal: max_length")
    if image_position not in IMAGE_POSITIONS:
        raise ConfigurationError(f"pack_multimodal: image_position must be one of {IMAGE_POSITIONS}, "
                                 f"got {image_position!r}")
    max_open_rows = check_count(max_open_rows, "pack_multimodal: max_open_rows")
    if not isinstance(placeholders, Placeholders):
        raise ConfigurationError(f"pack_multimodal: placeholders must be a Placeholders convention "
                                 f"(PixtralPlaceholders, QwenPlaceholders), got {type(placeholders).__name__}")
    if not isinstance(mrope, bool):
        raise ConfigurationError(f"pack_multimodal: mrope must be True or False, got {mrope!r}")
    if mrope and not isinstance(placeholders, QwenPlaceholders):
        # The positions follow Qwen2-VL's layout (start token, merged cells, end token); another
        # convention's tokens would be given positions its model does not compute.
        raise ConfigurationError(f"pack_multimodal: mrope=True gives Qwen2-VL's rotary positions and needs "
                                 f"QwenPlaceholders, got {type(placeholders).__name__}")
    if spec is not None:
        _check_spec(spec, placeholders)
    return max_length, max_open_rows


def _check_tokens_per_second(value, mrope: bool, placeholders: Placeholders) -> float | None:
    """`mrope_tokens_per_second` as a float, or None: Qwen2.5-VL's config value, which scales a
    video's temporal positions; refused where it would change nothing (no M-RoPE, or no video
    layout to position), so a recipe does not believe its videos are spaced by time."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise ConfigurationError(f"pack_multimodal: mrope_tokens_per_second must be a positive number "
                                 f"(Qwen2.5-VL's vision_config.tokens_per_second), got {value!r}")
    if not mrope or not video_layout(placeholders):
        raise ConfigurationError("pack_multimodal: mrope_tokens_per_second spaces the M-RoPE positions of videos in "
                                 "Qwen's video layout: it needs mrope=True and QwenPlaceholders(video_pad=...)")
    if getattr(placeholders, "video_timestamps", None) is not None:
        raise ConfigurationError("pack_multimodal: mrope_tokens_per_second spaces videos by time as Qwen2.5-VL does; "
                                 "with video_timestamps (Qwen3-VL) each temporal patch is its own block at t = 0 "
                                 "and its time is in the stamp's text")
    return float(value)


def _check_frame_text(frame_text, mrope: bool, placeholders: Placeholders) -> None:
    """`frame_text` is a `FrameText` or None, and only where frames are images: Qwen's video layout
    has its own (`video_timestamps`), and M-RoPE would position text it does not know of."""
    if frame_text is None:
        return
    if not isinstance(frame_text, FrameText):
        raise ConfigurationError(f"pack_multimodal: frame_text must be a FrameText (FrameText.internvl(tokenizer), "
                                 f"FrameText.smolvlm(tokenizer)), got {frame_text!r}")
    if video_layout(placeholders):
        raise ConfigurationError(f"pack_multimodal: frame_text writes text around a video's frames taken as images; "
                                 f"{type(placeholders).__name__}(video_pad=...) lays a video out as one block")
    if mrope:
        raise ConfigurationError("pack_multimodal: frame_text and mrope=True: Qwen2-VL's rotary positions do not "
                                 "place text between a video's frames")


def _check_spec(spec, placeholders: Placeholders) -> None:
    """Refuse a spec that is no ImageSpec, merges unlike the placeholders, or that they refuse
    (a convention's own `check_spec`: Aya Vision's, of InternVL's tiles alone)."""
    if not isinstance(spec, ImageSpec):  # else a bare AttributeError on its merge_size below
        raise ConfigurationError(f"pack_multimodal: spec must be an ImageSpec, got {spec!r}")
    if getattr(placeholders, "image_detail", None) is not None:
        _check_detail_spec(spec, placeholders)
    if hasattr(placeholders, "check_spec"):
        placeholders.check_spec(spec)
    if placeholders.merge_size != spec.merge_size:
        m = placeholders.merge_size
        raise ConfigurationError(
            f"pack_multimodal: the placeholders merge {m}x{m} patches into a token but the ImageSpec merges "
            f"{spec.merge_size}x{spec.merge_size} (its patch_size={spec.patch_size}; pack_multimodal's spec=, else the spec of the last "
            f"decode_images or decode_video before it, else ImageSpec()): decode with a spec of merge_size={m} "
            f"before pack_multimodal ({_PRESETS.get(type(placeholders).__name__, f'ImageSpec(merge_size={m})')}), "
            f"or give placeholders of merge_size={spec.merge_size}"
        )


def _check_detail_spec(spec: ImageSpec, placeholders: Placeholders) -> None:
    """Placeholders that count from a picture's size take the pictures of their fits (Idefics3's
    `fit="split"`, or square `"fixed"` ones not split; LLaVA-NeXT's `"anyres"`; Llama 4's
    `"canvas"`); those that name
    tiles, pictures cut into no more rows or columns of tiles than they have names for
    (`longest_edge` / the tile side, rounded up)."""
    kind, detail = type(placeholders).__name__, placeholders.image_detail
    fits = _DETAIL_FITS.get(detail)
    if fits is None:
        raise ConfigurationError(f"pack_multimodal: {kind}.image_detail={detail!r} is none of {tuple(_DETAILS)}")
    if spec.fit not in fits:
        presets = _PRESETS.get(kind, f"ImageSpec(fit={fits[0]!r}, ...)")
        named = " or ".join(repr(fit) for fit in fits)
        raise ConfigurationError(f"pack_multimodal: {kind} counts the tokens of fit={named} images ({presets}), "
                                 f"got an ImageSpec of fit={spec.fit!r}")
    if spec.fit == "fixed":
        if spec.size[0] != spec.size[1]:
            raise ConfigurationError(f"pack_multimodal: {kind} takes a picture not split as one square tile, got "
                                     f"an ImageSpec of fit='fixed' and size={spec.size}")
        return
    if detail != "tiles":
        return
    most = -(-spec.longest_edge // spec.size[0])
    if most > min(placeholders.max_tiles):
        raise ConfigurationError(f"pack_multimodal: a longest_edge of {spec.longest_edge} cuts up to {most}x{most} "
                                 f"tiles of {spec.size[0]} px, and {kind} names at most "
                                 f"{placeholders.max_tiles[0]}x{placeholders.max_tiles[1]}")


def _check_pad_id(pad_id: object, placeholders: Placeholders) -> int:
    """The pad id as an int: a token id (as pack_flat checks its own) that no placeholder uses.
    The model finds an image's slots by the placeholder ids, so padding holding one would be
    taken for image slots without patches (Qwen's `<|image_pad|>` reads like a pad token)."""
    pad_id = check_token_id(pad_id, "pack_multimodal: pad_id")
    if pad_id in placeholders.token_ids:
        raise ConfigurationError(
            f"pack_multimodal: pad_id={pad_id} is an image placeholder id of {type(placeholders).__name__} "
            "(the model would take padding for image slots); pass pack_multimodal(pad_id=...) another token id"
        )
    return pad_id


def _describe(obj: Any) -> dict:
    """A spec's or a placeholders convention's settings for the fingerprint. A convention of the
    user's own need not be a dataclass (it meets the `Placeholders` protocol): it is written as a
    map's callable object is, else building a loader failed on `dataclasses.fields`. A dataclass
    field that JSON writes as it is (the built-in conventions' numbers, strings and tuples) stays
    as it is, so their fingerprints are unchanged; any other (a set, an array) is written by
    `stable_description`, as a map's arguments are: `json.dumps(default=str)` listed a set in the order
    per-process string hashing gives and elided an array's middle. A field added since (its
    metadata says `fingerprint="when set"`) is written only when set, so recipes made before it
    keep their fingerprint."""
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if not dataclasses.is_dataclass(obj):
        return {"class": kind, "settings": stable_description(obj)}
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not f.name.startswith("_")
              and not (f.metadata.get("fingerprint") == "when set" and getattr(obj, f.name) is None)}
    return {"class": kind, **{name: v if _json_native(v) else stable_description(v) for name, v in fields.items()}}


def _json_native(value: Any) -> bool:
    """Whether `json.dumps` writes `value` without a `default`, and so the same in every process."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_native(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int, float, bool)) or k is None for k in value) and \
            all(_json_native(v) for v in value.values())
    return False


@dataclass(frozen=True)
class PackMultimodal:
    """Configuration of `pack_multimodal`: builds one `MultimodalPacker` per lane segment.

    Follows the core's accumulator-operator shape (`kind`, `name`, `field`, `max_length`,
    `factory(default_pad_id)`, `fingerprint(default_pad_id)`), so `Pipeline.apply` takes it. Its
    packers emit `RowPlan`s, which the loader assembles as it takes them into microbatches.
    `pad_id=None` uses the pipeline's default pad id. `spec`, `pixels_field`, `grid_field`,
    `patch_dim` and `patch_dtype` left None follow the last decoder before the packer, as
    `pack_multimodal` has them follow it (`bound_to`; without a decoder: `ImageSpec()`, "pixels",
    "image_grid", the spec's uint8 patches); one given that contradicts that decoder is refused.
    After `decode_images(defer=True)` its `row_work` decodes the deferred images, read from the
    record operators before it, so a packer given to `Pipeline.apply` decodes them as one
    `pack_multimodal` built does.
    `mrope=True` adds each row's `mrope_position_ids` (Qwen2-VL's rotary positions, `vlm._mrope`);
    `mrope_tokens_per_second` spaces a video's temporal positions by time, as Qwen2.5-VL does.
    `document_values` carries record fields' numbers into the rows, one a document, as
    `pack_flat`'s does (`zephon._document_values`).
    """

    max_length: int
    placeholders: Placeholders
    spec: ImageSpec | None = None
    pad_id: int | None = None
    image_position: str = "before_text"
    field: str = "input_ids"
    pixels_field: str | None = None
    grid_field: str | None = None
    offsets_field: str = OFFSETS_FIELD
    max_open_rows: int = 16
    patch_dim: int | None = None
    patch_dtype: str | None = None
    mrope: bool = False
    mrope_tokens_per_second: float | None = None
    frame_text: FrameText | None = None
    loss_mask_field: str = LOSS_MASK_FIELD
    document_values: tuple[str, ...] = ()
    name: str = "pack_multimodal"
    kind = "accumulator"

    def __post_init__(self) -> None:
        # As pack_flat and tokenize check theirs: a field of None or 3 is read from no record, so
        # every document was skipped (`field`) or packed without its images (`pixels_field`), unsaid.
        for name in ("field", "pixels_field", "grid_field", "offsets_field", "loss_mask_field"):
            value = getattr(self, name)
            if value is not None or name not in _UNSET_UNTIL_BOUND:
                check_field_name(value, f"pack_multimodal: {name}")
        if self.loss_mask_field in (self.field, self.pixels_field, self.offsets_field):
            raise ConfigurationError(f"pack_multimodal: loss_mask_field={self.loss_mask_field!r} is also the field of "
                                     "the ids, the pixels or the image offsets; the loss mask is a field of its own")
        sizes = _validate(self.max_length, self.image_position, self.max_open_rows, self.placeholders, self.spec,
                          self.mrope)
        object.__setattr__(self, "max_length", sizes[0])
        object.__setattr__(self, "max_open_rows", sizes[1])
        object.__setattr__(self, "mrope_tokens_per_second",
                           _check_tokens_per_second(self.mrope_tokens_per_second, self.mrope, self.placeholders))
        _check_frame_text(self.frame_text, self.mrope, self.placeholders)
        if self.pad_id is not None:  # checked as pack_flat checks its own: it fills the int32 input_ids
            object.__setattr__(self, "pad_id", _check_pad_id(self.pad_id, self.placeholders))
        object.__setattr__(self, "document_values", check_value_names(
            self.document_values, self.name, documents=self.document_fields, row_fields=ROW_FIELDS))

    @property
    def document_fields(self) -> tuple[str | None, ...]:
        """The record fields a document is read from (its ids, pixels, grids, image offsets and loss
        mask; None where a decoder is yet to name one): none holds a document's value."""
        return self.field, self.pixels_field, self.grid_field, self.offsets_field, self.loss_mask_field

    def bound_to(self, record_operators) -> PackMultimodal:
        """This packer as it packs after `record_operators` (the pipeline's, in order): a copy whose
        settings left None are the last decoder's (`followed_settings`), refused what it could not
        pack as meant, a setting given against that decoder among them (`check_operators_before`).
        The loader calls it as it binds the pipeline, before any record is read, and packs and
        fingerprints with the copy; `pack_multimodal` calls it as it builds. So a packer given to
        `Pipeline.apply` packs, is refused and is fingerprinted as the one `pack_multimodal` builds:
        only the builder followed the decoder, and a packer made by hand with the default 16 px
        spec after a 14 px decoder read each image as a smaller grid of larger patches, unsaid."""
        bound = dataclasses.replace(self, **followed_settings(self, record_operators))
        check_operators_before(bound, record_operators)
        return bound

    def _settled(self) -> PackMultimodal:
        """This packer where no loader bound it (one used on its own): the settings left to a
        decoder at what none gives."""
        return self.bound_to(()) if any(getattr(self, name) is None for name in _UNSET_UNTIL_BOUND) else self

    def factory(self, default_pad_id: int):
        pad = self.pad_id if self.pad_id is not None else default_pad_id
        settled = self._settled()

        def make(ctx: SegmentContext) -> MultimodalPacker:
            return settled._packer(ctx, pad)

        return make

    def _packer(self, ctx: SegmentContext, pad: int) -> MultimodalPacker:
        """A packer of this configuration (settled) padding with `pad`."""
        return MultimodalPacker(ctx, **self._packer_settings(pad))

    def _packer_settings(self, pad: int) -> dict:
        """The keyword arguments of a `MultimodalPacker` of this configuration (settled), emitting plans."""
        return dict(
            max_length=self.max_length, placeholders=self.placeholders, spec=self.spec, pad_id=pad,
            image_position=self.image_position, text_field=self.field, pixels_field=self.pixels_field,
            grid_field=self.grid_field, offsets_field=self.offsets_field, max_open_rows=self.max_open_rows,
            patch_dim=self.patch_dim, patch_dtype=self.patch_dtype, assemble=False, mrope=self.mrope,
            mrope_tokens_per_second=self.mrope_tokens_per_second, frame_text=self.frame_text,
            loss_mask_field=self.loss_mask_field, document_values=self.document_values,
        )

    @property
    def row_field_bytes(self) -> int:
        """Bytes per position of a row's fixed-length fields, for the memory budget: the core's
        four int32 fields, and with `mrope` its three int32 positions."""
        return ROW_FIELD_BYTES + (3 * 4 if self.mrope else 0)

    @property
    def pixel_bytes_per_token(self) -> int | None:
        """Pixel bytes a placeholder token may carry, for the memory budget: a merged cell of uint8
        RGB patches, or where videos have a layout of their own what a video token stands for if
        that is more (a cell in both frames of Qwen's temporal patch, a pooled share of
        LLaVA-OneVision's frame); None leaves the core's count (one cell) where no spec is bound
        yet."""
        if self.spec is None:
            return None
        patch = self.spec.patch_size**2 * 3
        cell = patch * self.spec.merge_size**2
        if not video_layout(self.placeholders):
            return cell
        return max(cell, math.ceil(patch * self.placeholders.video_patches_per_token))

    def row_work(self, on_error: str, record_operators):
        """The stateless work the loader has the runner do on each row before taking it, or None:
        decoding the images the `decode_images(defer=True)` stages among `record_operators` left
        encoded (under their own policy, else the pipeline's `on_error`). Without it the loader
        decoded them on its own thread as it assembled each batch, failing fast on an image that
        `on_error="skip"` masks."""
        deferred, policy = deferred_policy(record_operators)
        return DecodeDeferred(policy or on_error) if deferred else None

    def padding_row(self, default_pad_id: int) -> PackedSequence:
        """A padding-only row with empty ragged fields of the right shapes, for a lane whose finite
        plan ran out (the core's text padding row has no ragged fields to concatenate with)."""
        return self.factory(default_pad_id)(SegmentContext(lane=-1, segment=-1)).empty_row()

    def token_counter(self):
        """(address, record) -> the tokens that record becomes (text plus image placeholders), so
        token estimation weighs VLM datasets by what they really put in a row; its `learned`, the
        text's tokens a loss learns, for `TokenEstimation(count="learned")`."""
        # The pad id does not change a count: any one the packer takes (no placeholder id) does.
        no_placeholder = next(i for i in range(len(self.placeholders.token_ids) + 1)
                              if i not in self.placeholders.token_ids)
        packer = self.factory(no_placeholder)(SegmentContext(lane=-1, segment=-1))
        # Its refusals, with their details, explain a sample that yields no token
        # (`images_exceed_length` for a max_length below one image's tokens).
        refused = RefusedRecords()

        def count(address: RecordAddress, record: dict) -> int:
            documents = packer.placed(address, record)
            refused.extend(packer.drain_skips())
            packer.drain_truncations()
            return 0 if documents is None else sum(doc.length for doc in documents)

        def learned(address: RecordAddress, record: dict) -> int:
            """Of them, the text's tokens a loss learns (`PlacedDocument.learned`: no placeholder)."""
            documents = packer.placed(address, record)
            packer.drain_skips()  # refused by `count` already
            packer.drain_truncations()
            return 0 if documents is None else sum(doc.learned for doc in documents)

        count.drain_skips = refused.drain
        count.learned = learned  # for TokenEstimation(count="learned")
        return count

    def fingerprint(self, default_pad_id: int) -> dict:
        """The settings it packs with: the loader fingerprints its bound copy (`bound_to`), so a
        packer given to `Pipeline.apply` that follows its decoder is fingerprinted as the one
        `pack_multimodal` builds, which holds the same settings."""
        settled = self._settled()
        out = {
            "op": settled.name,
            "max_length": settled.max_length,
            "placeholders": _describe(settled.placeholders),
            "spec": _describe(settled.spec),
            "pad_id": settled.pad_id if settled.pad_id is not None else default_pad_id,
            "image_position": settled.image_position,
            "fields": [settled.field, settled.pixels_field, settled.grid_field, settled.offsets_field],
            "max_open_rows": settled.max_open_rows,
            "patch_dim": settled.patch_dim,
            "patch_dtype": None if settled.patch_dtype is None else np.dtype(settled.patch_dtype).str,
        }
        if settled.mrope:  # a key only when on: the recipes made before the option keep their fingerprint
            out["mrope"] = True
        if settled.mrope_tokens_per_second is not None:  # likewise
            out["mrope_tokens_per_second"] = settled.mrope_tokens_per_second
        if settled.frame_text is not None:  # likewise
            out["frame_text"] = _describe(settled.frame_text)
        if settled.loss_mask_field != LOSS_MASK_FIELD:  # likewise
            out["loss_mask_field"] = settled.loss_mask_field
        if settled.document_values:  # likewise
            out["document_values"] = list(settled.document_values)
        return json.loads(json.dumps(out, default=str))

