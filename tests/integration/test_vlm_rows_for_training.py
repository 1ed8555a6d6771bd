"""What a VLM trainer reads from a multimodal batch, checked against an oracle of the test's own.

Real Parquet shards of interleaved documents (noise PNGs, so a patch out of place shows, and token
ids) go through the real pipeline (decode_images -> pack_multimodal -> batch) on every runner,
decoding before and after packing. Each row is then rebuilt here from nothing but the records its
`sources` name, the documented layout (README "What a packed row carries") and Pillow: the token
ids with each convention's placeholders written out by hand, the shifted labels, the positions and
documents restarting per document, every image's patches cut from Pillow's own decode, the grids,
the token offsets and the per-row counts, rows without images and padding rows included; and, for
an image that fails when decoded after packing, the masked document the README describes. None of
the packer's helpers is called, so a packer that drifted from the layout a model expects fails here.
"""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.unit.test_vlm_assets import stored_png
from vlm import ImageSpec, PixtralPlaceholders, QwenPlaceholders
from zephon import IGNORE_INDEX, Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

MAX_LENGTH = 48
PAD = 0
TEXT_BASE = 100  # text ids start here, clear of the placeholder ids and the pad id
CONVENTIONS = {
    # name: (placeholders, spec, the patch sides the noise images have, on the spec's grid)
    "pixtral": (PixtralPlaceholders(3, 4, 5), ImageSpec.pixtral(max_side=64, patch_size=8), (1, 2, 3, 4)),
    "pixtral-merged": (PixtralPlaceholders(3, 4, 5, merge_size=2),
                       ImageSpec.pixtral(max_side=128, patch_size=8, merge_size=2), (2, 4)),
    "qwen": (QwenPlaceholders(6, 7, 8, merge_size=2),
             ImageSpec(patch_size=8, merge_size=2, min_pixels=16 * 16, max_pixels=128 * 128), (2, 4)),
}


def _png(rng: np.random.Generator, rows: int, cols: int, patch: int, mode: str) -> bytes:
    pixels = rng.integers(0, 256, (rows * patch, cols * patch, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="PNG")
    return out.getvalue()


def _records(convention: str) -> list[dict]:
    """Documents of 0-3 images and up to 11 text tokens, interleaved by `image_offsets` or placed
    before the text; two of text alone that nearly fill a row, one whose text must be cut to fit,
    one whose image alone overfills a row."""
    _, spec, sides = CONVENTIONS[convention]
    rng = np.random.default_rng(7)
    records = []
    for i in range(36):
        n = [0, 1, 2, 0, 3, 1][i % 6]
        grids = [(int(rng.choice(sides)), int(rng.choice(sides))) for _ in range(n)]
        length = 0 if i == 10 else int(rng.integers(1, 12))
        if i == 17:
            length = 60  # longer than a row: its text is cut
        if i in (30, 33):
            length = MAX_LENGTH - 1  # text alone, filling a row that then holds no image
        text = list(range(TEXT_BASE + 100 * i, TEXT_BASE + 100 * i + length))
        offsets = sorted(int(o) for o in rng.integers(0, length + 1, n)) if i % 2 else None
        images = [_png(rng, r, c, spec.patch_size, "L" if i % 5 == 0 else "RGB") for r, c in grids]
        records.append({"images": images, "input_ids": text, "image_offsets": offsets})
    big = 8 * spec.merge_size  # 8x8 merged cells: more placeholder tokens than MAX_LENGTH
    records[23] = {"images": [_png(rng, big, big, spec.patch_size, "RGB")], "input_ids": [TEXT_BASE],
                   "image_offsets": None}
    return records


def _write(root: Path, records: list[dict]) -> dict[tuple[str, int], dict]:
    """Two Parquet shards of `records`; returns them by (shard file name, index in it)."""
    by_address = {}
    for shard in range(2):
        part = records[shard::2]
        table = pa.table({
            "images": pa.array([r["images"] for r in part], pa.list_(pa.binary())),
            "input_ids": pa.array([r["input_ids"] for r in part], pa.list_(pa.int32())),
            "image_offsets": pa.array([r["image_offsets"] for r in part], pa.list_(pa.int32())),
        })
        name = f"docs-{shard:03d}.parquet"
        pq.write_table(table, root / name)
        by_address.update({(name, index): record for index, record in enumerate(part)})
    return by_address


@pytest.fixture(scope="module", params=list(CONVENTIONS))
def corpus(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"interleaved-{request.param}")
    return request.param, root, _write(root, _records(request.param))


def _pipeline(convention: str, root: Path, runner: str, defer: bool) -> Pipeline:
    placeholders, spec, _ = CONVENTIONS[convention]
    source = StaticMixtureWorkSource([Dataset.from_path("docs", str(root))], seed=5, records_per_chunk=5,
                                     num_epochs=1)
    return (
        Pipeline(source)
        .options(num_lanes=2, runner=runner, flush_every_chunks=2)
        .decode_images(field="images", spec=spec, parallelism=2, defer=defer)
        .pack_multimodal(MAX_LENGTH, placeholders, pad_id=PAD)
        .batch(2)
    )


def _placeholder_tokens(convention: str, rows: int, cols: int) -> list[int]:
    """The convention's tokens for one image, written out as the model's own processor lays them."""
    placeholders, _, _ = CONVENTIONS[convention]
    m = placeholders.merge_size
    if convention.startswith("pixtral"):  # per merged row: [IMG] per merged column, then [IMG_BREAK]; last [IMG_END]
        tokens = []
        for r in range(rows // m):
            tokens += [placeholders.img_id] * (cols // m)
            tokens.append(placeholders.end_id if r == rows // m - 1 else placeholders.break_id)
        return tokens
    return [placeholders.vision_start] + [placeholders.image_pad] * (rows * cols // (m * m)) + [placeholders.vision_end]


def _grid(data: bytes, patch: int) -> tuple[int, int]:
    """(rows, cols) in patches of an image on the grid, from its header alone."""
    width, height = Image.open(io.BytesIO(data)).size
    return height // patch, width // patch


def _patches(data: bytes, patch: int) -> np.ndarray:
    """Pillow's decode of the image cut into patches, row-major, each (patch_row, patch_col, channel)."""
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    rows, cols = _grid(data, patch)
    cut = [pixels[r * patch:(r + 1) * patch, c * patch:(c + 1) * patch].reshape(-1)
           for r in range(rows) for c in range(cols)]
    return np.array(cut, dtype=np.uint8).reshape(rows * cols, patch * patch * 3)


def _image_tokens(convention: str, record: dict) -> int:
    _, spec, _ = CONVENTIONS[convention]
    return sum(len(_placeholder_tokens(convention, *_grid(data, spec.patch_size))) for data in record["images"])


def _expected_row(convention: str, documents: list[dict], failing: frozenset[bytes] = frozenset()) -> dict:
    """One row rebuilt from its documents: tokens, labels, positions, documents, images. An image
    in `failing` (decoded after packing, it fails) has zero patches and its document no label."""
    _, spec, _ = CONVENTIONS[convention]
    ids, positions, document_ids, labels = [], [], [], []
    patches, grids, offsets = [], [], []
    for number, record in enumerate(documents):
        images = []
        for data in record["images"]:
            rows, cols = _grid(data, spec.patch_size)
            failed = np.zeros((rows * cols, spec.patch_dim), np.uint8)
            pixels = failed if data in failing else _patches(data, spec.patch_size)
            images.append((pixels, (rows, cols)))
        trains = not failing.intersection(record["images"])
        image_tokens = _image_tokens(convention, record)
        room = MAX_LENGTH - image_tokens
        text = record["input_ids"][:room]  # a document too long is cut on the text side
        at = record["image_offsets"] or [0] * len(images)  # before_text by default
        at = [min(o, len(text)) for o in at]
        doc_ids, doc_text = [], []
        cut = 0
        for (image, grid), offset in zip(images, at):
            doc_ids += text[cut:offset]
            doc_text += [True] * (offset - cut)
            cut = offset
            offsets.append(len(ids) + len(doc_ids))
            tokens = _placeholder_tokens(convention, *grid)
            doc_ids += tokens
            doc_text += [False] * len(tokens)
            patches.append(image)
            grids.append(grid)
        doc_ids += text[cut:]
        doc_text += [True] * (len(text) - cut)
        # At i, the next token of the document when it is text; -100 before an image token and at the end.
        labels += [doc_ids[i + 1] if trains and doc_text[i + 1] else -100 for i in range(len(doc_ids) - 1)] + [-100]
        ids += doc_ids
        positions += list(range(len(doc_ids)))
        document_ids += [number] * len(doc_ids)
    padding = MAX_LENGTH - len(ids)
    assert padding >= 0, "the packer put more into a row than it holds"
    return {
        "input_ids": ids + [PAD] * padding,
        "labels": labels + [-100] * padding,
        "position_ids": positions + [0] * padding,
        "document_ids": document_ids + [-1] * padding,
        "pixel_values": np.concatenate(patches) if patches else np.empty((0, spec.patch_dim), np.uint8),
        "image_grid": grids,
        "image_token_offset": offsets,
    }


def _check_batches(convention: str, by_address: dict, batches: list,
                   failing: frozenset[bytes] = frozenset()) -> Counter:
    """Every row of every microbatch equals the oracle's; returns how often each record was packed."""
    packed = Counter()
    for batch in batches:
        arrays = batch.to_numpy()
        counts = {name: arrays[f"{name}_counts"] for name in ("pixel_values", "image_grid", "image_token_offset")}
        assert counts["image_grid"].tolist() == counts["image_token_offset"].tolist()
        patch_at = image_at = 0
        for i, sources in enumerate(batch.sources):
            documents = [by_address[(Path(a.shard).name, a.index)] for a in sources]
            packed.update((Path(a.shard).name, a.index) for a in sources)
            want = _expected_row(convention, documents, failing)
            where = f"step {batch.step} lane {batch.lane} row {i} ({[str(a) for a in sources]})"
            for name in ("input_ids", "labels", "position_ids", "document_ids"):
                assert arrays[name][i].tolist() == want[name], f"{name} of {where}"
            images, patches = int(counts["image_grid"][i]), int(counts["pixel_values"][i])
            in_row = slice(image_at, image_at + images)
            assert arrays["image_grid"][in_row].tolist() == [list(g) for g in want["image_grid"]], where
            assert arrays["image_token_offset"][in_row].tolist() == want["image_token_offset"], where
            assert np.array_equal(arrays["pixel_values"][patch_at:patch_at + patches], want["pixel_values"]), \
                f"the patches of {where} are not its images' pixels in placeholder order"
            patch_at += patches
            image_at += images
        assert patch_at == len(arrays["pixel_values"]) and image_at == len(arrays["image_grid"]), \
            "the per-row counts account for every patch and image of the microbatch"
    return packed


def _run(convention: str, root: Path, runner: str, defer: bool) -> tuple[list, dict]:
    with _pipeline(convention, root, runner, defer).shard(0, 1) as loader:
        batches = list(loader)
        return batches, loader.stats()


@pytest.mark.parametrize("defer", [False, True], ids=["decode-before-packing", "decode-after-packing"])
@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_every_packed_row_is_what_the_model_expects_from_its_documents_and_their_pixels(corpus, runner, defer):
    convention, root, by_address = corpus
    batches, stats = _run(convention, root, runner, defer)
    packed = _check_batches(convention, by_address, batches)

    image_tokens = {key: _image_tokens(convention, record) for key, record in by_address.items()}
    too_big = {key for key, n in image_tokens.items() if n > MAX_LENGTH}
    cut = {key for key, n in image_tokens.items()
           if key not in too_big and n + len(by_address[key]["input_ids"]) > MAX_LENGTH}
    assert too_big and cut, "the corpus holds a document no row can hold and one that must be cut"
    totals = stats["datasets"]["docs"]["total"]
    assert totals["read"] == len(by_address)
    assert totals["skipped"] == {"images_exceed_length": len(too_big)}, \
        "images too big for a row: a named, counted skip"
    assert set(packed.values()) == {1} and set(packed) == set(by_address) - too_big, \
        "every record not skipped lands whole in exactly one row"
    assert totals["truncated"] == len(cut), "a document longer than a row is cut on its text side and counted"
    lanes = stats["lanes"].values()
    assert sum(lane["rows"] for lane in lanes) == sum(len(b.sources) for b in batches)
    assert sum(lane["tokens"] for lane in lanes) == sum(int((b.tokens["document_ids"] >= 0).sum()) for b in batches)
    assert sum(lane["padding"] for lane in lanes) == sum(int((b.tokens["document_ids"] < 0).sum()) for b in batches), \
        "padding is counted as such, not as usable tokens"
    assert stats["mixture"] == {"docs": {"tokens": sum(lane["tokens"] for lane in lanes),
                                         "images": sum(len(b.ragged["image_grid"]) for b in batches),
                                         "learned": sum(int((b.tokens["labels"] != IGNORE_INDEX).sum())
                                                        for b in batches)}}, \
        "the dataset's tokens (cut captions as cut), images and learned tokens in the rows handed over"
    assert any(len(sources) and not images for b in batches
               for sources, images in zip(b.sources, b.ragged_counts["image_grid"])), \
        "a row of documents without images was checked"

    reference = [(b.step, b.lane, b.index, b.digest()) for b in _run(convention, root, "inline", False)[0]]
    assert [(b.step, b.lane, b.index, b.digest()) for b in batches] == reference


def _cut_between_pixel_chunks(rng: np.random.Generator, rows: int, cols: int, patch: int) -> bytes:
    """A PNG whose header and first pixel chunk are whole and whose second pixel chunk is gone:
    its header passes the check made before packing, its pixels fail when decoded."""
    whole = stored_png(rng.integers(0, 256, (rows * patch, cols * patch, 3), dtype=np.uint8), pieces=2)
    return whole[: whole.rindex(b"IDAT") - 4]


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_a_document_whose_image_fails_after_packing_trains_nothing_and_its_row_neighbours_are_intact(tmp_path, runner):
    """Decoded after packing, a document with an image that does not decode keeps its place: that
    image's patches are zeros, its other images keep their pixels, none of its tokens has a label,
    and the documents sharing its row are exactly as they would be without it."""
    convention = "pixtral"
    _, spec, _ = CONVENTIONS[convention]
    records = _records(convention)
    rng = np.random.default_rng(11)
    failing = set()
    for i in (4, 5):  # the first image of a document of three and of a document of one
        bad = _cut_between_pixel_chunks(rng, 3, 2, spec.patch_size)
        records[i] = dict(records[i], images=[bad] + records[i]["images"][1:])
        failing.add(bad)
    by_address = _write(tmp_path, records)

    batches, stats = _run(convention, tmp_path, runner, defer=True)
    packed = _check_batches(convention, by_address, batches, frozenset(failing))
    assert {key for key, r in by_address.items() if failing.intersection(r["images"])} <= set(packed)
    masked = sum(lane.get("masked:truncated_image", 0) for lane in stats["lanes"].values())
    assert masked == len(failing), "each masked document is counted by its reason"
    learned = sum(int((b.tokens["labels"] != IGNORE_INDEX).sum()) for b in batches)
    assert stats["mixture"]["docs"]["learned"] == learned, "a masked document learns nothing"
