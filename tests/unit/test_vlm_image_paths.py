"""`decode_images(paths=True)`: image fields naming files (LLaVA-style JSON lines), read beside the
record's shard as `decode_video` reads its paths (vlm/README.md, "Images named by path").

The batches' equality with the same images held as bytes, on every runner and world size, is
tests/determinism/test_vlm_image_paths.py, which builds its corpus and pipelines with the helpers here.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_vlm_assets import encode, gradient, package_dir
from vlm import IMAGE_REASONS, DecodeImages, ImageSpec, PixtralPlaceholders, decode_image
from vlm._deferred import DeferredImage
from zephon import Pipeline
from zephon._checkpoint import recipe_digests
from zephon._errors import BadRecordError, ConfigurationError
from zephon._records import Chunk, ChunkRecords, RecordAddress
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

SPEC = ImageSpec(max_pixels=64 * 64)
SHARD_SIZES = [7, 5, 1]
MISSING = (0, 4)  # (shard, record) whose image file is not there
TOKENIZER = str(package_dir("zephon") / "data" / "tokenizer.json")


def write_corpus(root: Path) -> Path:
    """`root/llava/part-00N.jsonl` naming `images/kNNN.{jpg,png}` beside them (one by its absolute path)."""
    corpus = root / "llava"
    (corpus / "images").mkdir(parents=True)
    for shard, size in enumerate(SHARD_SIZES):
        lines = []
        for i in range(size):
            k = shard * 10 + i
            names = [f"images/k{k:03d}.jpg"] + ([f"images/k{k:03d}b.png"] if k % 3 == 1 else [])
            for name in names:
                if (shard, i) != MISSING:
                    fmt = "PNG" if name.endswith(".png") else "JPEG"
                    (corpus / name).write_bytes(encode(gradient(30 + 5 * (k % 9), 60 - 3 * (k % 5)), fmt))
            image = names if len(names) > 1 else names[0]
            if k == 12:
                image = str(corpus / names[0])
            lines.append(json.dumps({"image": image, "text": f"picture {k} " * (1 + k % 4)}))
        (corpus / f"part-{shard:03d}.jsonl").write_text("".join(line + "\n" for line in lines))
    return corpus


class ReadFromRoot:
    """The reference: the image files read by a map that knows the corpus root, as bytes."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __call__(self, record: dict) -> dict:
        out = dict(record)
        names = record["image"] if isinstance(record["image"], list) else [record["image"]]
        try:
            read = [Path(self.root, name).read_bytes() for name in names]
        except FileNotFoundError:
            del out["image"]  # dropped as missing_image, where the paths pipeline says missing_image_file
            return out
        out["image"] = read if isinstance(record["image"], list) else read[0]
        return out


def llava_pipeline(corpus: Path, runner: str = "inline", defer: bool = False, *, paths: bool = True,
                   parallelism: int = 2) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("llava", str(corpus))], seed=3, records_per_chunk=2,
                                     num_epochs=2)
    pipeline = Pipeline(source).options(num_lanes=2, runner=runner, flush_every_chunks=2)
    if paths:
        pipeline = pipeline.decode_images(field="image", spec=SPEC, defer=defer, paths=True, parallelism=parallelism)
    else:
        pipeline = (pipeline.map(ReadFromRoot(str(corpus)), parallelism=parallelism)
                    .decode_images(field="image", spec=SPEC, defer=defer, parallelism=parallelism))
    return (pipeline.tokenize(TOKENIZER, field="text", bos="<|bos|>", eos="<|eos|>", parallelism=parallelism)
            .pack_multimodal(160, PixtralPlaceholders(3, 4, 5))
            .shuffle(buffer_size=3, seed=2)
            .batch(1))


def stage_on(shard: Path | str, values: list, **options) -> ChunkRecords:
    """Run `DecodeImages(field="image", paths=True)` on records holding `values`, read from `shard`."""
    addresses = [RecordAddress("llava", str(shard), i) for i in range(len(values))]
    stage = DecodeImages("image", SPEC, paths=True, **options)
    return stage(ChunkRecords(Chunk("llava", 0, 0, len(values)), [{"image": v} for v in values], addresses))


@pytest.fixture
def picture(tmp_path) -> bytes:
    data = encode(gradient(40, 70), "JPEG")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(data)
    return data


def test_a_path_in_every_form_decodes_as_the_bytes_of_its_file_beside_the_shard_not_the_working_directory(
    tmp_path, picture, monkeypatch
):
    """Bare, absolute, in a Hugging Face struct, in a list: each the file beside the shard, whatever
    file of that name the working directory holds."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "images").mkdir(parents=True)
    (elsewhere / "images" / "a.jpg").write_bytes(encode(gradient(90, 30), "JPEG"))
    monkeypatch.chdir(elsewhere)
    shard = tmp_path / "part-000.jsonl"
    out = stage_on(shard, ["images/a.jpg", str(tmp_path / "images" / "a.jpg"),
                           {"bytes": None, "path": "images/a.jpg"}, ["images/a.jpg", picture]], on_error="raise")
    expected = decode_image(picture, SPEC)
    assert [np.array_equal(r["pixels"], expected) for r in out.records[:3]] == [True, True, True]
    assert [np.array_equal(p, expected) for p in out.records[3]["pixels"]] == [True, True]
    assert all("image" not in r for r in out.records)


def test_without_paths_a_path_is_still_skipped_and_told_of_the_option(tmp_path, picture):
    """Off by default: reading paths would change which records an existing recipe keeps."""
    address = RecordAddress("llava", str(tmp_path / "part-000.jsonl"), 0)
    chunk = ChunkRecords(Chunk("llava", 0, 0, 1), [{"image": "images/a.jpg"}], [address])
    assert DecodeImages("image").paths is False
    with pytest.raises(BadRecordError) as raised:
        DecodeImages("image", on_error="raise")(chunk)
    assert raised.value.reason == "not_media_bytes"
    assert "'images/a.jpg'" in raised.value.detail and "decode_images(paths=True)" in raised.value.detail


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_an_image_path_naming_no_file_is_counted_as_a_missing_file_naming_the_path_and_shard(tmp_path, runner):
    """A corpus copied without some of its images (a folder left out, a wrong root) is told apart
    from damaged images, and the detail names the path as written, as resolved, and the shard."""
    corpus = write_corpus(tmp_path)  # part-000's record 4 names files that are not there
    with llava_pipeline(corpus, runner).shard(0, 1, global_batch_size=2) as loader:
        list(loader)
        total = loader.stats()["datasets"]["llava"]["total"]
    assert total["skipped"] == {"missing_image_file": 2}  # its record, in each of 2 epochs
    address = RecordAddress("llava", str(corpus / "part-000.jsonl"), 4)
    with pytest.raises(BadRecordError) as raised:
        DecodeImages("image", paths=True, on_error="raise")(
            ChunkRecords(Chunk("llava", 0, 0, 1), [{"image": ["images/k004.jpg", "images/k004b.png"]}], [address]))
    assert (raised.value.address, raised.value.reason) == (address, "missing_image_file")
    assert raised.value.detail == (
        f"no file at {str(corpus / 'images' / 'k004.jpg')!r} (FileNotFoundError: No such file or directory); "
        f"the record names 'images/k004.jpg', resolved beside its shard {corpus / 'part-000.jsonl'}")


def test_an_absolute_image_path_naming_no_file_says_it_was_taken_as_written(tmp_path):
    missing = str(tmp_path / "nowhere" / "a.jpg")
    with pytest.raises(BadRecordError) as raised:
        stage_on(tmp_path / "part-000.jsonl", [missing], on_error="raise")
    assert raised.value.detail == (f"no file at {missing!r} (FileNotFoundError: No such file or directory); "
                                   f"the record names the absolute path {missing!r}")


@pytest.mark.parametrize("kind", ["directory", "symlink loop", "fifo", "nul"])
def test_an_image_path_naming_what_cannot_be_read_as_a_file_is_counted_as_unopenable(tmp_path, kind):
    """No image was read, so neither corrupt_image nor missing: a directory, a name the OS refuses
    (a symlink loop; permission denied, which root is never refused, is the same refusal), a FIFO
    (read, it would block the worker for ever) and a name holding a NUL (the OS refuses to be
    asked with a ValueError, which would escape the stage and stop the run)."""
    written, error = {
        "directory": ("images", "is a directory, not a file"),
        "symlink loop": ("loop.jpg", "cannot be opened (OSError: Too many levels of symbolic links)"),
        "fifo": ("pipe.jpg", "is not a regular file (a FIFO, socket or device)"),
        "nul": ("a\x00.jpg", "holds a NUL character, which no file name can"),
    }[kind]
    if kind == "directory":
        (tmp_path / "images").mkdir()
    elif kind == "symlink loop":
        (tmp_path / "loop.jpg").symlink_to(tmp_path / "loop.jpg")
    elif kind == "fifo":
        os.mkfifo(tmp_path / "pipe.jpg")
    shard = tmp_path / "part-000.jsonl"
    assert [reason for _, reason in stage_on(shard, [written]).skipped] == ["unopenable_image_file"]
    with pytest.raises(BadRecordError) as raised:
        stage_on(shard, [written], on_error="raise")
    assert raised.value.reason == "unopenable_image_file" and "unopenable_image_file" in IMAGE_REASONS
    assert raised.value.detail == (f"{os.path.join(str(tmp_path), written)!r} {error}; "
                                   f"the record names {written!r}, resolved beside its shard {shard}")


@pytest.mark.parametrize("shard", ["s3://bucket/llava/part-000.jsonl", "hf://datasets/org/llava/part-000.jsonl",
                                   "part-000.jsonl"], ids=["s3", "hf", "relative-shard-url"])
def test_a_relative_image_path_in_a_shard_that_is_not_a_local_file_is_skipped_as_unresolvable(
    tmp_path, picture, monkeypatch, shard
):
    """As a video's: no directory on the worker to resolve it from, and never the working directory."""
    monkeypatch.chdir(tmp_path)
    out = stage_on(shard, ["images/a.jpg", {"bytes": None, "path": "images/a.jpg"},
                           str(tmp_path / "images" / "a.jpg")])
    assert [(a.index, reason) for a, reason in out.skipped] == [(0, "unresolvable_path"), (1, "unresolvable_path")]
    assert [a.index for a in out.addresses] == [2], "an absolute path is read as a local file"
    with pytest.raises(BadRecordError, match=r"unresolvable_path.*'images/a.jpg'.*" + re.escape(shard)):
        stage_on(shard, ["images/a.jpg"], on_error="raise")


def test_a_deferred_image_read_from_a_path_holds_the_bytes_read_not_the_path(tmp_path, picture):
    """The header is probed from the file's bytes and those bytes are what waits and crosses to the
    row decode: the file is read once, and the pixels are those of the bytes the grid was planned
    from, even where the file is gone or replaced by then."""
    out = stage_on(tmp_path / "part-000.jsonl", ["images/a.jpg"], defer=True, on_error="raise")
    deferred = out.records[0]["pixels"]
    assert isinstance(deferred, DeferredImage) and bytes(deferred.data) == picture
    (tmp_path / "images" / "a.jpg").write_bytes(encode(gradient(90, 30), "JPEG"))
    crossed = pickle.loads(pickle.dumps(deferred, protocol=5))
    assert np.array_equal(crossed.decode(), decode_image(picture, SPEC))
    (tmp_path / "images" / "a.jpg").unlink()
    assert np.array_equal(deferred.decode(), decode_image(picture, SPEC))


def test_paths_is_in_the_fingerprint_only_when_on_so_existing_recipes_keep_their_digests(tmp_path):
    """A recipe without the option writes the keys it always wrote: the decoder's recipe digests of
    an existing pipeline (files read by a map, as before the option) are those it had before it
    existed, pinned here, so its checkpoints resume. On, the option enters the recipe: a path
    pipeline keeps records the other skips."""
    assert "paths" not in DecodeImages(field="jpg").fingerprint()
    assert DecodeImages(field="jpg", paths=True).fingerprint() == {**DecodeImages(field="jpg").fingerprint(),
                                                                   "paths": True}
    corpus = write_corpus(tmp_path)
    with llava_pipeline(corpus, defer=True, paths=False).shard(0, 1, global_batch_size=2) as loader:
        digests = {k: v for k, v in recipe_digests(loader.recipe).items() if ".decode_images." in k}
    assert digests == {
        "operators[1].decode_images.field": "8e79b7dd85a286cf",
        "operators[1].decode_images.spec": "dcb1060da3414ee1",
        "operators[1].decode_images.output_field": "3e3846ae39fe5947",
        "operators[1].decode_images.processor": "74234e98afe7498f",
        "operators[1].decode_images.keep_source": "fcbcf165908dd18a",  # false
        "operators[1].decode_images.grid_field": "b59ea864f04d594d",
        "operators[1].decode_images.defer": "b5bea41b6c623f7c",  # true
    }
    with llava_pipeline(corpus, defer=True).shard(0, 1, global_batch_size=2) as loader:
        assert recipe_digests(loader.recipe)["operators[0].decode_images.paths"] == "b5bea41b6c623f7c"  # true


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_paths_must_be_true_or_false(flag):
    with pytest.raises(ConfigurationError, match="decode_images: paths must be True or False"):
        DecodeImages(paths=flag)
