"""The race's stateless work and accumulators for the peers, importing no Zephon code.

Peers run in their own virtual environments, and `zephon` 0.2.0 even has our import name, so they
cannot import `zephon` or `vlm`. This module gives them the same work in plain numpy, Pillow and
`tokenizers`, written to cost what ours costs (`bound.py` measures both side by side):

- text: `encode_text` (tokens + EOS as int32, one document per call, through `encode_batch_fast`),
  `WrapPacker` (concatenate and cut at `max_length`,
  rows with input_ids / labels / position_ids / document_ids as Zephon's `pack_flat`);
- VLM: `decode_image` (header, JPEG draft, mode normalisation, one resize to the Pixtral 16 px
  grid with the longest side <= max_side, alpha composited on white: the steps of
  `vlm.decode_image`), `pixtral_tokens` (the [IMG]/[IMG_BREAK]/[IMG_END] layout), `FirstFitPacker`
  (documents never split, up to 16 open rows) and `assemble_vlm_row` (tokens, labels masked on
  image tokens, positions, document ids, raster-order pixel patches);
- `ShuffleBuffer`, `collate` and `usable_tokens` (non-padding positions of a batch).

Thread-safety: the functions are pure; packers and shuffle buffers are thread-unsafe, one per
consumer.
"""

from __future__ import annotations

import glob
import io
import json
import os
import random
import tarfile

import numpy as np

IGNORE = -100
PADDING_DOCUMENT = -1


# -- data ------------------------------------------------------------------------------------

def text_shards(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.jsonl")))


def read_text_shard(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def pair_shards(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.tar")))


def read_pair_shard(path: str) -> list[tuple[bytes, str]]:
    """(image bytes, caption) per WebDataset key of one tar shard, in shard order."""
    members: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.rpartition(".")
            members.setdefault(key, {})[ext] = tar.extractfile(member).read()
    out = []
    for parts in members.values():
        image = parts.get("png") or parts.get("jpg")
        if image is not None and "txt" in parts:
            out.append((image, parts["txt"].decode("utf-8")))
    return out


# -- text ------------------------------------------------------------------------------------

def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)


def encode_text(tokenizer, text: str, bos: int | None, eos: int | None) -> np.ndarray:
    """One document's ids (+ BOS/EOS) as int32.

    Through `encode_batch_fast` with a batch of one where tokenizers has it (>= 0.20), as Zephon
    tokenizes: it computes no character offsets, and it releases the GIL while it encodes, which
    `encode` does not: with `encode`, the peers' tokenizing cost ~20 % more CPU per token (race
    bound: 1.16-1.21 against 0.94-0.96 s per text epoch) and their threads on a GIL build
    tokenized one at a time (grain 3.11 `threads` mode: 1.02 cores busy at p=2).
    """
    fast = getattr(tokenizer, "encode_batch_fast", None)
    if fast is not None:
        ids = fast([text], add_special_tokens=False)[0].ids
    else:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
    return ids_array(ids, bos, eos)


def ids_array(ids: list[int], bos: int | None, eos: int | None) -> np.ndarray:
    """A document's ids with BOS/EOS as int32, built as Zephon's tokenize stage builds them: into
    the fresh list tokenizers returns, then `fromiter` with a count (one pass). Two list
    concatenations and `np.array` cost the peers and the bound ~1 % more CPU per text token."""
    if bos is not None:
        ids.insert(0, bos)
    if eos is not None:
        ids.append(eos)
    return np.fromiter(ids, dtype=np.int32, count=len(ids))


def text_row(pieces: list[tuple[np.ndarray, int, int]], length: int, pad: int) -> dict[str, np.ndarray]:
    input_ids = np.full(length, pad, dtype=np.int32)
    labels = np.full(length, IGNORE, dtype=np.int32)
    position_ids = np.zeros(length, dtype=np.int32)
    document_ids = np.full(length, PADDING_DOCUMENT, dtype=np.int32)
    at = 0
    for doc, (tokens, start, stop) in enumerate(pieces):
        n = stop - start
        input_ids[at:at + n] = tokens[start:stop]
        following = tokens[start + 1:stop + 1]
        labels[at:at + len(following)] = following
        position_ids[at:at + n] = np.arange(n, dtype=np.int32)
        document_ids[at:at + n] = doc
        at += n
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": document_ids}


class WrapPacker:
    """Concatenate documents and cut every `length` tokens (documents may span rows)."""

    def __init__(self, length: int, pad: int) -> None:
        self.length, self.pad = length, pad
        self._pieces: list[tuple[np.ndarray, int, int]] = []
        self._filled = 0

    def push(self, tokens: np.ndarray) -> list[dict]:
        out, start = [], 0
        while start < len(tokens):
            take = min(len(tokens) - start, self.length - self._filled)
            self._pieces.append((tokens, start, start + take))
            self._filled += take
            start += take
            if self._filled == self.length:
                out.append(text_row(self._pieces, self.length, self.pad))
                self._pieces, self._filled = [], 0
        return out


# -- images ----------------------------------------------------------------------------------

def image_grid(height: int, width: int, max_side: int, patch: int) -> tuple[int, int]:
    """Pixtral sizing: longest side scaled down (never up) to max_side, sides rounded up to patches."""
    ratio = max(height, width) / max_side
    if ratio > 1:
        height, width = max(round(height / ratio), 1), max(round(width / ratio), 1)
    return -(-height // patch), -(-width // patch)


def decode_image(data: bytes, max_side: int, patch: int, draft: bool = True) -> np.ndarray:
    """(H, W, 3) uint8 on the patch grid: open, draft (JPEG), decode, normalise mode, one resize,
    alpha on white."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    width, height = image.size
    rows, cols = image_grid(height, width, max_side, patch)
    target = (cols * patch, rows * patch)
    box = None
    if draft and image.format == "JPEG":
        drafted = image.draft(None, (target[0] * 2, target[1] * 2))
        if drafted is not None:
            box = drafted[1]
    image.load()
    mode = image.mode
    if mode == "1":
        image = image.convert("L")
    elif mode in ("P", "PA"):
        image = image.convert("RGBA" if (mode == "PA" or "transparency" in image.info) else "RGB")
    elif mode not in ("RGB", "L", "RGBA", "LA"):
        image = image.convert("RGB")
    if image.size != target or box is not None:
        image = image.resize(target, Image.Resampling.BICUBIC, box=box, reducing_gap=2.0 if draft else None)
    if image.mode == "L":
        image = image.convert("RGB")
    elif image.mode != "RGB":
        # LA/RGBA pasted with itself as the mask, as `vlm.decode_image` does: the same pixels as
        # converting to RGB and pasting through the alpha band, ~2 % less CPU per race image
        # (that step: 0.10 against 0.08 s per epoch); the peers must not pay for the detour.
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, (0, 0), image)
        image = background
    return np.asarray(image)


def pixtral_tokens(rows: int, cols: int, img: int, brk: int, end: int) -> np.ndarray:
    grid = np.full((rows, cols + 1), img, dtype=np.int32)
    grid[:, -1] = brk
    grid[-1, -1] = end
    return grid.reshape(-1)


class Placeholders:
    """Pixtral placeholder ids per grid, cached."""

    def __init__(self, img: int, brk: int, end: int) -> None:
        self.ids = (img, brk, end)
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def tokens(self, rows: int, cols: int) -> np.ndarray:
        got = self._cache.get((rows, cols))
        if got is None:
            got = self._cache[(rows, cols)] = pixtral_tokens(rows, cols, *self.ids)
        return got


def vlm_document(tokenizer, caption: str, image: bytes, max_side: int, patch: int, bos: int, eos: int) -> dict:
    """The stateless part of one VLM sample: decoded pixels and caption tokens."""
    return {"pixels": decode_image(image, max_side, patch), "text": encode_text(tokenizer, caption, bos, eos)}


def assemble_vlm_row(docs: list[dict], length: int, pad: int, patch: int, placeholders: Placeholders) -> dict:
    """One row from documents placed by the packer: image right after BOS, then the caption."""
    input_ids = np.full(length, pad, dtype=np.int32)
    labels = np.full(length, IGNORE, dtype=np.int32)
    position_ids = np.zeros(length, dtype=np.int32)
    document_ids = np.full(length, PADDING_DOCUMENT, dtype=np.int32)
    is_text = np.zeros(length + 1, dtype=bool)
    grids = [(d["pixels"].shape[0] // patch, d["pixels"].shape[1] // patch) for d in docs]
    pixel_values = np.empty((sum(r * c for r, c in grids), patch * patch * 3), dtype=np.uint8)
    offsets = np.empty(len(docs), dtype=np.int32)
    at = patch_at = 0
    for number, (doc, (rows, cols)) in enumerate(zip(docs, grids)):
        start, text = at, doc["text"]
        cut = min(1, len(text))
        input_ids[at:at + cut] = text[:cut]
        is_text[at:at + cut] = True
        at += cut
        tokens = placeholders.tokens(rows, cols)
        input_ids[at:at + len(tokens)] = tokens
        offsets[number] = at
        at += len(tokens)
        n = rows * cols
        pixel_values[patch_at:patch_at + n].reshape(rows, cols, patch, patch, 3)[...] = \
            doc["pixels"].reshape(rows, patch, cols, patch, 3).swapaxes(1, 2)
        patch_at += n
        rest = text[cut:]
        input_ids[at:at + len(rest)] = rest
        is_text[at:at + len(rest)] = True
        at += len(rest)
        position_ids[start:at] = np.arange(at - start, dtype=np.int32)
        document_ids[start:at] = number
        labels[start:at - 1] = np.where(is_text[start + 1:at], input_ids[start + 1:at], IGNORE)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": document_ids,
            "pixel_values": pixel_values, "image_grid": np.array(grids, dtype=np.int32).reshape(-1, 2),
            "image_token_offset": offsets}


class FirstFitPacker:
    """First-fit multimodal packing: a document is never split; up to `max_open_rows` open rows,
    the oldest emitted when one more is needed."""

    def __init__(self, length: int, pad: int, patch: int, placeholders: Placeholders, max_open_rows: int = 16) -> None:
        self.length, self.pad, self.patch, self.placeholders = length, pad, patch, placeholders
        self.max_open_rows = max_open_rows
        self._rows: list[list[dict]] = []
        self._free: list[int] = []

    def doc_length(self, doc: dict) -> int:
        h, w = doc["pixels"].shape[:2]
        rows, cols = h // self.patch, w // self.patch
        return rows * (cols + 1) + len(doc["text"])

    def push(self, doc: dict) -> list[dict]:
        n = self.doc_length(doc)
        if n > self.length:
            return []
        for i, free in enumerate(self._free):
            if free >= n:
                self._rows[i].append(doc)
                self._free[i] -= n
                return [self._emit(i)] if self._free[i] == 0 else []
        out = []
        if len(self._rows) == self.max_open_rows:
            out.append(self._emit(0))
        self._rows.append([doc])
        self._free.append(self.length - n)
        return out

    def _emit(self, i: int) -> dict:
        self._free.pop(i)
        return assemble_vlm_row(self._rows.pop(i), self.length, self.pad, self.patch, self.placeholders)


# -- shuffle and batch -----------------------------------------------------------------------

class ShuffleBuffer:
    def __init__(self, size: int, seed: int) -> None:
        self.size, self._rng, self._items = size, random.Random(seed), []

    def push(self, item) -> list:
        if len(self._items) < self.size:
            self._items.append(item)
            return []
        i = self._rng.randrange(len(self._items))
        out, self._items[i] = self._items[i], item
        return [out]


RAGGED = ("pixel_values", "image_grid", "image_token_offset")


def collate(rows: list[dict]) -> dict[str, np.ndarray]:
    """Stack fixed-length fields, concatenate ragged ones (with per-row counts)."""
    out = {}
    for name in rows[0]:
        if name in RAGGED:
            out[name] = np.concatenate([r[name] for r in rows], axis=0)
            out[name + "_counts"] = np.array([len(r[name]) for r in rows], dtype=np.int64)
        else:
            out[name] = np.stack([r[name] for r in rows])
    return out


def usable_tokens(batch) -> int:
    """Non-padding positions of a collated batch (document_ids >= 0)."""
    return int(np.count_nonzero(np.asarray(batch["document_ids"]) >= 0))


def num_images(batch) -> int:
    grid = batch.get("image_grid") if hasattr(batch, "get") else None
    return 0 if grid is None else int(np.asarray(grid).reshape(-1, 2).shape[0])
