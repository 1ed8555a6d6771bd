"""LLaVA-style records, `<image>` markers in the text: `tokenize(marker="<image>")` then
`pack_multimodal` puts each image in the row where its marker was (vlm/README.md, "Images placed
by markers in the text")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_vlm_assets import encode, gradient, package_dir
from vlm import ImageSpec, PixtralPlaceholders
from zephon import ConfigurationError, Pipeline
from zephon._tokenizer import load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

SPEC = ImageSpec(max_pixels=48 * 48)
PLACEHOLDERS = PixtralPlaceholders(3, 4, 5)
TOKENIZER = str(package_dir("zephon") / "data" / "tokenizer.json")
MISMATCHED = 7  # the record whose text holds two markers for its one image


def text_and_images(k: int) -> tuple[str, int]:
    """The text of record k of the corpus (shard k // 6, index k % 6), with its images' count."""
    if k == MISMATCHED:
        return "<image><image>\nTwo markers, one picture.", 1
    return [
        (f"<image>\nWhat is in picture {k}?", 1),
        (f"Compare <image> with <image>, number {k}.", 2),
        (f"A caption of {k} words ending on its picture <image>", 1),
        (f"Only text here, number {k}.", 0),
    ][k % 4]


def marked_text(k: int) -> tuple[dict, int]:
    """Record k's fields besides its images, with its images' count."""
    text, images = text_and_images(k)
    return {"text": text}, images


def write_corpus(root: Path, record_of=marked_text, name: str = "llava") -> Path:
    """`root/<name>/part-00N.jsonl`: {"image": [paths], **fields} with `record_of(k)`'s fields (by
    default a text with `<image>` markers), its PNG gradients beside the shards."""
    corpus = root / name
    (corpus / "images").mkdir(parents=True)
    for shard in range(2):
        lines = []
        for i in range(6):
            k = shard * 6 + i
            fields, images = record_of(k)
            names = [f"images/k{k:02d}-{n}.png" for n in range(images)]
            for n, path in enumerate(names):
                (corpus / path).write_bytes(encode(gradient(20 + 7 * (k % 5) + 9 * n, 40 - 3 * (k % 4)), "PNG"))
            lines.append(json.dumps({"image": names, **fields}))
        (corpus / f"part-{shard:03d}.jsonl").write_text("".join(line + "\n" for line in lines))
    return corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("markers"))


def _pipeline(corpus: Path, runner: str, **tokenize_options) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("llava", str(corpus))], seed=5, records_per_chunk=3,
                                     num_epochs=1)
    return (Pipeline(source).options(num_lanes=2, runner=runner)
            .decode_images(field="image", spec=SPEC, paths=True, parallelism=2)
            .tokenize(TOKENIZER, field="text", bos="<|bos|>", eos="<|eos|>", marker="<image>", parallelism=2,
                      **tokenize_options)
            .pack_multimodal(128, PLACEHOLDERS)
            .batch(2))


def texts_in(arrays: dict, tokenizer: str = TOKENIZER, placeholders=PLACEHOLDERS) -> list[str]:
    """Each document of the batch's rows read back: its text ids decoded, with `<image>` written
    where an image's placeholders stood (found by `image_token_offset` and `image_grid`)."""
    decoder = load_tokenizer(tokenizer).tokenizer
    image_rows = np.repeat(np.arange(len(arrays["input_ids"])), arrays["image_grid_counts"])
    images_at = {}
    for row, (rows, cols), at in zip(image_rows, arrays["image_grid"], arrays["image_token_offset"]):
        expected = placeholders.tokens_for(int(rows), int(cols))
        assert arrays["input_ids"][row, at : at + len(expected)].tolist() == expected.tolist()
        images_at[(int(row), int(at))] = len(expected)
    texts = []
    for row, (ids, documents) in enumerate(zip(arrays["input_ids"].tolist(), arrays["document_ids"].tolist())):
        pieces, at = {}, 0
        while at < len(ids):
            if documents[at] < 0:  # padding
                at += 1
                continue
            piece = pieces.setdefault(documents[at], [[]])
            if (row, at) in images_at:
                piece.append([])
                at += images_at[(row, at)]
                continue
            piece[-1].append(ids[at])
            at += 1
        for document in pieces.values():
            texts.append("<image>".join(decoder.decode(p, skip_special_tokens=False) for p in document))
    return texts


def _run(corpus: Path, runner: str) -> tuple[list[str], list[str], dict]:
    digests, texts = [], []
    with _pipeline(corpus, runner).shard(0, 1) as loader:
        for batch in loader:
            digests.append(batch.digest())
            texts += texts_in(batch.to_numpy())
        stats = loader.stats()
    return digests, texts, stats


def test_each_image_lands_in_the_row_where_its_marker_was_and_a_mismatch_is_skipped_by_name(corpus):
    digests, texts, stats = _run(corpus, "inline")
    wanted = [text_and_images(k)[0] for k in range(12) if k != MISMATCHED]
    assert sorted(texts) == sorted(f"<|bos|>{text}<|eos|>" for text in wanted)
    assert stats["datasets"]["llava"]["total"]["skipped"] == {"marker_count_mismatch": 1}
    [example] = stats["skipped_examples"]["llava"]["marker_count_mismatch"]
    assert example["index"] == MISMATCHED - 6 and example["shard"].endswith("part-001.jsonl")
    assert example["detail"] == ("its text held 2 '<image>' marker(s) ('image_offsets') but it has 1 image(s) in "
                                 "'pixels': one marker per image (a video: per frame)")
    assert _run(corpus, "thread")[0] == digests, "the same batch SHA-256s on the thread runner"


def test_a_tokenize_writing_marker_offsets_where_the_packer_does_not_read_them_is_refused(corpus):
    """The packer would place every image by its image_position, the markers gone from the text."""
    with pytest.raises(ConfigurationError, match=r"pack_multimodal reads image offsets from 'image_offsets', but "
                                                 r"tokenize\(marker='<image>'\) writes them to 'where'"):
        _pipeline(corpus, "inline", offsets_field="where")
