"""A corpus of gzip or zstd JSON Lines shards written as many frames or members (cut inside lines,
as `pzstd` and `bgzip` cut them) trains as the same records stored uncompressed or in one stream
do: the same global-batch SHA-256s on every runner and world size, and after a resume on another
world size, each chunk read entered at the frame holding its first line; and one written as a
single gzip stream, its reads starting from the resume points they noted (`_resume_points`)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import zstandard

from tests.harness import checkpoint_after, space_resume_points, step_digests, text_pipeline
from zephon.io import _resume_points

STEPS = 6
MAX_LENGTH = 2048  # about a KJV chapter a row: the steps take records from many chunks, not a few
_PIECE = 2500  # bytes of text a frame or member holds: a KJV chapter is 1-8 KB, so most begin inside a line


def _lines_of(kjv: Path) -> dict[str, bytes]:
    """Each shipped KJV shard's text, by its name without the compression suffix."""
    return {path.name.removesuffix(".zst"): zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read()
            for path in sorted(kjv.glob("*.jsonl.zst"))}


@pytest.fixture(scope="module")
def kjv_stored(tmp_path_factory, demo_data_dir) -> dict[str, Path]:
    """The shipped KJV shards stored five ways: uncompressed, in one zstd stream (as shipped), in one
    gzip stream, in zstd frames and in gzip members of `_PIECE` bytes of text."""
    codecs = {"zst": zstandard.ZstdCompressor().compress, "gz": gzip.compress}
    stored = {}
    for way in ("plain", "zstd stream", "gzip stream", "zstd frames", "gzip members"):
        root = stored[way] = tmp_path_factory.mktemp(way.replace(" ", "-"))
        for name, text in _lines_of(demo_data_dir / "kjv").items():
            if way == "plain":
                (root / name).write_bytes(text)
            elif way in ("zstd stream", "gzip stream"):
                suffix = "zst" if way == "zstd stream" else "gz"
                (root / f"{name}.{suffix}").write_bytes(codecs[suffix](text))
            else:
                suffix = "zst" if way == "zstd frames" else "gz"
                pieces = (codecs[suffix](text[at:at + _PIECE]) for at in range(0, len(text), _PIECE))
                (root / f"{name}.{suffix}").write_bytes(b"".join(pieces))
    return stored


@pytest.fixture(scope="module")
def reference(kjv_stored, demo_data_dir, demo_tokenizer_path) -> list[str]:
    return step_digests(text_pipeline(demo_data_dir / "jargon", kjv_stored["plain"], demo_tokenizer_path,
                                      max_length=MAX_LENGTH), 1, STEPS)


@pytest.fixture
def close_resume_points(monkeypatch) -> None:
    space_resume_points(monkeypatch, 8192)


@pytest.mark.parametrize("way, runner, world_size", [
    ("zstd stream", "inline", 1), ("zstd frames", "thread", 4), ("gzip members", "process", 2),
    ("zstd frames", "inline", 2), ("gzip stream", "thread", 4), ("gzip stream", "process", 2),
])
def test_compressed_shards_give_the_global_batches_their_records_give_uncompressed(
        reference, kjv_stored, demo_data_dir, demo_tokenizer_path, close_resume_points, way, runner, world_size):
    pipeline = text_pipeline(demo_data_dir / "jargon", kjv_stored[way], demo_tokenizer_path, runner=runner,
                             parallelism=2, max_length=MAX_LENGTH)
    assert step_digests(pipeline, world_size, STEPS) == reference
    if way == "gzip stream" and runner == "thread":  # read on this process's threads, from the points they noted
        assert _resume_points.resume_points.count() > 10


@pytest.mark.parametrize("way, runner, world_size", [
    ("zstd stream", "process", 2), ("gzip stream", "thread", 4), ("zstd stream", "inline", 1),
])
def test_shards_in_one_stream_read_from_their_seekable_copies_give_the_same_global_batches(
        reference, kjv_stored, demo_data_dir, demo_tokenizer_path, tmp_path, way, runner, world_size):
    copies = {"scan_cache": tmp_path, "seekable_copies": True}
    pipeline = text_pipeline(demo_data_dir / "jargon", kjv_stored[way], demo_tokenizer_path, runner=runner,
                             parallelism=2, max_length=MAX_LENGTH, dataset_options=copies)
    assert len(list(tmp_path.glob("*/*.zst"))) == len(list(kjv_stored[way].iterdir()))
    assert step_digests(pipeline, world_size, STEPS) == reference


def test_a_run_reading_seekable_copies_resumes_without_them_on_another_world_size(
        reference, kjv_stored, demo_data_dir, demo_tokenizer_path, tmp_path):
    def pipeline(runner: str, copies: dict | None):
        return text_pipeline(demo_data_dir / "jargon", kjv_stored["zstd stream"], demo_tokenizer_path,
                             runner=runner, parallelism=2, max_length=MAX_LENGTH, dataset_options=copies)

    state = checkpoint_after(pipeline("process", {"scan_cache": tmp_path, "seekable_copies": True}), 2, 3)
    assert step_digests(pipeline("thread", None), 4, STEPS - 3, state=state, start_step=3) == reference[3:]


def test_a_run_reading_shards_of_many_frames_resumes_on_another_world_size(
        reference, kjv_stored, demo_data_dir, demo_tokenizer_path):
    def pipeline(runner: str):
        return text_pipeline(demo_data_dir / "jargon", kjv_stored["gzip members"], demo_tokenizer_path,
                             runner=runner, parallelism=2, max_length=MAX_LENGTH)

    state = checkpoint_after(pipeline("process"), 2, 3)
    assert step_digests(pipeline("thread"), 4, STEPS - 3, state=state, start_step=3) == reference[3:]
