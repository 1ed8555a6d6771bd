"""VLM pairs stored as WebDataset tars compressed whole (`.tar.gz` in one gzip stream, `.tgz` in
gzip members, `.tar.zst` in one zstd frame) train as the plain tars they hold: the same
global-batch SHA-256s, pixels included, on every runner and world size, and after a resume on
another world size; the single gzip stream's reads start from the resume points they noted."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import zstandard

from tests.harness import checkpoint_after, space_resume_points, step_digests
from vlm import ImageSpec
from vlm._assets import pair_shards, tekken_tokenizer
from vlm._demo import vlm_pipeline
from zephon.io import Dataset, _resume_points
from zephon.io._seekable_copy import COPY_FRAME_BYTES

SPEC = ImageSpec.pixtral(max_side=128)
STEPS = 3
_PIECE = 4096  # bytes of tar a gzip member holds: most begin inside a PNG


def _gzip_members(tar: bytes) -> bytes:
    return b"".join(gzip.compress(tar[at:at + _PIECE]) for at in range(0, len(tar), _PIECE))


WAYS = {
    "plain": (".tar", lambda tar: tar),
    "gzip stream": (".tar.gz", gzip.compress),
    "gzip members": (".tgz", _gzip_members),
    "zstd frame": (".tar.zst", zstandard.ZstdCompressor().compress),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> dict[str, Path]:
    """The determinism pairs (4 shards of 64 PNG+caption records) stored each of `WAYS`."""
    tars = sorted(pair_shards(4, 64).directory.glob("*.tar"))
    out = {}
    for way, (suffix, compress) in WAYS.items():
        root = out[way] = tmp_path_factory.mktemp(way.replace(" ", "-"))
        for tar in tars:
            (root / f"{tar.stem}{suffix}").write_bytes(compress(tar.read_bytes()))
    return out


def _pipeline(directory: Path | Dataset, runner: str = "inline", parallelism: int = 1):
    return vlm_pipeline(directory, tekken_tokenizer(), runner=runner, parallelism=parallelism, spec=SPEC, num_lanes=8,
                        max_length=256, microbatch_size=2, records_per_chunk=4, flush_every_chunks=2,
                        shuffle_buffer=4, seed=5, defer=True)


@pytest.fixture(scope="module")
def reference(stored) -> list[str]:
    return step_digests(_pipeline(stored["plain"]), 1, STEPS)


@pytest.fixture
def close_resume_points(monkeypatch) -> None:
    space_resume_points(monkeypatch, 16384)


@pytest.mark.parametrize("way, runner, world_size", [
    ("gzip stream", "thread", 2), ("gzip stream", "process", 4), ("gzip members", "thread", 1),
    ("gzip members", "process", 2), ("zstd frame", "inline", 1),
])
def test_compressed_tars_give_the_global_batches_their_plain_tars_give(stored, reference, close_resume_points, way,
                                                                       runner, world_size):
    assert step_digests(_pipeline(stored[way], runner, 2), world_size, STEPS) == reference
    if way == "gzip stream" and runner == "thread":  # read on this process's threads, from the points they noted
        assert _resume_points.resume_points.count() > 10


@pytest.mark.parametrize("way, runner, world_size", [("gzip stream", "process", 2), ("zstd frame", "thread", 4)])
def test_tars_in_one_stream_read_from_their_seekable_copies_give_the_global_batches_their_plain_tars_give(
        stored, reference, tmp_path, way, runner, world_size):
    copied = Dataset.from_path("pairs", str(stored[way]), format="webdataset", scan_cache=tmp_path,
                               seekable_copies=True)
    longer_than_a_frame = sum(tar.stat().st_size > COPY_FRAME_BYTES for tar in stored["plain"].iterdir())
    assert len(list(tmp_path.glob("*/*.zst"))) == longer_than_a_frame == 3  # one of the four fits one frame
    assert step_digests(_pipeline(copied, runner, 2), world_size, STEPS) == reference


def test_a_run_reading_a_gzip_stream_of_tar_resumes_on_another_world_size(stored, reference, close_resume_points):
    state = checkpoint_after(_pipeline(stored["gzip stream"], "process", 2), 2, 1)
    assert step_digests(_pipeline(stored["gzip stream"], "thread", 2), 4, STEPS - 1, state=state,
                        start_step=1) == reference[1:]
