"""A shard written as one gzip stream is read from the resume points this process noted
(`zephon.io._resume_points`): every chunk gives the records it gives read from the shard's start,
in any order and on several threads, a read after the first pass decompresses little more than its
chunk, the points stay within their bounds, a zstd stream notes none, and a forked child holds
none of its parent's."""

from __future__ import annotations

import gzip
import io
import json
import multiprocessing
import random
import threading
import zlib

import pytest

from zephon.io import Dataset, _compression, _resume_points
from zephon.io._resume_points import ResumePoints, settled_spacing

from .conftest_io import compress

SPACING = 4096  # decompressed bytes between points, small to note many in a small shard
BLOCK = 512  # compressed bytes a read feeds its decoder at once


@pytest.fixture
def points(monkeypatch) -> ResumePoints:
    """A store of this test's own with points SPACING apart, read in blocks of BLOCK."""
    store = ResumePoints(first_spacing=SPACING)
    monkeypatch.setattr(_resume_points, "resume_points", store)
    monkeypatch.setattr(_compression, "_COMPRESSED_BLOCK_SIZE", BLOCK)
    return store


def _records(count: int, seed: int = 0) -> list[dict]:
    """Records of 20 to ~3,000 bytes, some lines spanning several blocks' output."""
    rng = random.Random(seed)
    return [{"i": i, "text": " ".join(f"w{rng.randrange(10_000)}" for _ in range(rng.choice((2, 40, 500))))}
            for i in range(count)]


def _write(directory, records: list[dict], codec: str = "gz", *, member_at: int | None = None) -> None:
    """One stream, or two members, the second from line `member_at` on."""
    directory.mkdir()
    lines = [(json.dumps(r) + "\n").encode() for r in records]
    pieces = [lines] if member_at is None else [lines[:member_at], lines[member_at:]]
    (directory / f"part.jsonl.{codec}").write_bytes(b"".join(compress(b"".join(piece), codec) for piece in pieces))


def _read_in(ds: Dataset, chunks: list) -> list[list[dict]]:
    return [ds.read_chunk(chunk).records for chunk in chunks]


def _count_decompressed(monkeypatch) -> list[int]:
    """A list to which each gzip decoder made from now on, and each copy of one, adds the bytes it
    decompresses, to its last item."""
    counted = [0]
    real = zlib.decompressobj

    class Counting:
        def __init__(self, decoder):
            self._decoder = decoder

        def decompress(self, data):
            out = self._decoder.decompress(data)
            counted[-1] += len(out)
            return out

        def copy(self):
            return Counting(self._decoder.copy())

        def __getattr__(self, name):
            return getattr(self._decoder, name)

    monkeypatch.setattr(zlib, "decompressobj", lambda *a, **k: Counting(real(*a, **k)))
    return counted


def test_every_chunk_read_in_a_seeded_order_gives_the_records_read_from_the_start(tmp_path, points):
    records = _records(1500)
    _write(tmp_path / "one", records)
    ds = Dataset.from_path("one", str(tmp_path / "one"))
    chunks = ds.chunks(16)
    order = random.Random(1).sample(range(len(chunks)), len(chunks))
    got = dict(zip(order, _read_in(ds, [chunks[k] for k in order])))
    assert points.count() > 10
    assert [r for k in range(len(chunks)) for r in got[k]] == records


def test_a_read_after_the_first_pass_decompresses_about_its_chunk_and_a_spacing(tmp_path, points, monkeypatch):
    records = _records(1500)
    _write(tmp_path / "one", records)
    ds = Dataset.from_path("one", str(tmp_path / "one"))
    chunks = ds.chunks(16)
    order = random.Random(2).sample(range(len(chunks)), len(chunks))
    counted = _count_decompressed(monkeypatch)
    _read_in(ds, [chunks[k] for k in order])
    decompressed = []
    for k in order:
        counted.append(0)
        ds.read_chunk(chunks[k])
        decompressed.append(counted[-1])
    for k, spent in zip(order, decompressed):
        chunk_bytes = ds.raw_bytes(chunks[k])
        # from a point before its first line: at most 2 spacings apart (`wants`), a block's output more
        assert chunk_bytes <= spent <= chunk_bytes + 2 * SPACING + 64 * BLOCK, k
    first_pass_from_start = sum(ds.raw_bytes(chunks[k]) for k in range(len(chunks))) * len(chunks) / 2
    assert sum(decompressed) < first_pass_from_start / 10


def test_no_point_keeps_more_of_an_unfinished_line_than_the_longest_begun(tmp_path, points, monkeypatch):
    monkeypatch.setattr(_resume_points, "LONGEST_BEGUN", 1000)
    records = _records(1500, seed=10)
    _write(tmp_path / "one", records)
    ds = Dataset.from_path("one", str(tmp_path / "one"))
    chunks = ds.chunks(16)
    order = random.Random(3).sample(range(len(chunks)), len(chunks))
    got = dict(zip(order, _read_in(ds, [chunks[k] for k in order])))
    assert [r for k in range(len(chunks)) for r in got[k]] == records
    kept = [point for shard in points._shards.values() for point in shard.points]
    assert len(kept) > 10 and max(len(point.begun) for point in kept) <= 1000
    assert any(point.begun for point in kept)  # some stand inside a line


def test_reads_on_threads_at_once_give_the_records(tmp_path, points):
    records = _records(1200, seed=3)
    _write(tmp_path / "one", records, member_at=5)  # one entry point still; a point may stand after a member
    ds = Dataset.from_path("one", str(tmp_path / "one"))
    chunks = ds.chunks(8)
    expected = [records[chunk.start:chunk.stop] for chunk in chunks]
    wrong: list[tuple[int, int]] = []  # (lane, chunk) of each read that gave other records

    def read(lane: int) -> None:
        for k in random.Random(lane).sample(range(len(chunks)), len(chunks)):
            if ds.read_chunk(chunks[k]).records != expected[k]:
                wrong.append((lane, k))

    threads = [threading.Thread(target=read, args=(lane,)) for lane in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    assert points.count() > 10


def test_points_stay_within_a_shard_s_and_the_process_s_bounds(tmp_path, monkeypatch):
    store = ResumePoints(first_spacing=SPACING, per_shard=8, per_process=12)
    monkeypatch.setattr(_resume_points, "resume_points", store)
    monkeypatch.setattr(_compression, "_COMPRESSED_BLOCK_SIZE", BLOCK)
    for name, seed in (("a", 4), ("b", 5), ("c", 6)):
        records = _records(800, seed)
        _write(tmp_path / name, records)
        ds = Dataset.from_path(name, str(tmp_path / name))
        chunks = ds.chunks(16)
        order = random.Random(seed).sample(range(len(chunks)), len(chunks))
        got = dict(zip(order, _read_in(ds, [chunks[k] for k in order])))
        assert [r for k in range(len(chunks)) for r in got[k]] == records
        assert store.count() <= 12
        by_shard = [len(shard.points) for shard in store._shards.values()]
        assert max(by_shard) <= 8 and sum(by_shard) == store.count()
    assert len(store._shards) >= 2  # thinned out to share the process's points, not forgotten


def test_a_cut_stream_read_from_a_point_gives_what_a_read_from_its_start_gives(tmp_path, points, monkeypatch):
    records = _records(600, seed=7)
    _write(tmp_path / "one", records)
    path = tmp_path / "one" / "part.jsonl.gz"
    path.write_bytes(path.read_bytes()[:-2000])  # its last records lost
    ds = Dataset.from_path("one", str(tmp_path / "one"))
    chunks = ds.chunks(16)
    with monkeypatch.context() as without_points:
        without_points.setattr(_resume_points, "key_of", lambda shard: None)
        from_start = [(c.records, c.skipped) for c in map(ds.read_chunk, chunks)]
    assert points.count() == 0 and from_start[-1][1]  # truncated records are counted, not lost
    last_first = [(c.records, c.skipped) for c in map(ds.read_chunk, reversed(chunks))][::-1]
    assert points.count() > 5
    assert last_first == from_start
    assert [(c.records, c.skipped) for c in map(ds.read_chunk, chunks)] == from_start


def test_a_zstd_stream_notes_no_points(tmp_path, points):
    records = _records(600, seed=8)
    _write(tmp_path / "one", records, codec="zst")
    ds = Dataset.from_path("one", str(tmp_path / "one"))
    assert [r for c in _read_in(ds, ds.chunks(16)) for r in c] == records
    assert points.count() == 0


def _count_in_child(queue) -> None:
    queue.put(_resume_points.resume_points.count())


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_forked_child_holds_none_of_its_parent_s_points(tmp_path, points):
    _write(tmp_path / "one", _records(600, seed=9))
    ds = Dataset.from_path("one", str(tmp_path / "one"))
    _read_in(ds, ds.chunks(16))
    assert points.count() > 5
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_count_in_child, args=(queue,))
    child.start()
    assert queue.get(timeout=60) == 0
    child.join()


def test_settled_spacing_counts_the_shard_s_and_the_dataset_s_bytes():
    mib = 1 << 20
    assert settled_spacing(64 * mib, 64 * mib) == mib
    assert settled_spacing(65 * mib, 65 * mib) == 2 * mib  # 64 points a shard
    assert settled_spacing(mib, 512 * mib) == mib  # no point fits within it: read from its start
    assert settled_spacing(8 * mib, 257 * mib) == 2 * mib  # 256 points a process
    assert settled_spacing(1 << 30, 1 << 30) == 16 * mib


def test_planning_warns_of_a_large_gzip_stream_only_where_its_points_would_be_far_apart(tmp_path):
    text = b"".join(json.dumps({"text": f"record {i} " + "x" * 200}).encode() + b"\n" for i in range(12_000))
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "part.jsonl.gz").write_bytes(gzip.compress(text))  # 2.5 MB: points 1 MiB apart
    (tmp_path / "zst").mkdir()
    (tmp_path / "zst" / "part.jsonl.zst").write_bytes(compress(text, "zst"))
    assert Dataset.from_path("gz", str(tmp_path / "gz")).wasteful_decoding(128) is None
    said = Dataset.from_path("zst", str(tmp_path / "zst")).wasteful_decoding(128)
    assert said is not None and "hold up to 12,000 records" in said


@pytest.mark.parametrize("layout", ["one member", "members ending inside blocks", "padded members"])
def test_a_decompression_from_any_point_it_gave_decodes_the_rest_of_the_stream(monkeypatch, layout):
    """Every point a pass gives, between two compressed blocks, starts a pass that decompresses
    exactly what follows it: never where a member ended inside a block with more to decode."""
    monkeypatch.setattr(_compression, "_COMPRESSED_BLOCK_SIZE", 300)
    text = b"".join(b"line %d %s\n" % (i, b"abc" * (i % 50)) for i in range(2000))
    if layout == "one member":
        stream = gzip.compress(text)
    else:
        cuts = range(0, len(text), 1700)
        padding = b"\0" * 7 if layout == "padded members" else b""
        stream = b"".join(gzip.compress(text[at:at + 1700]) + padding for at in cuts)
    pass_ = _compression.Decompression("gzip")
    source = io.BytesIO(stream)
    decoded, points = b"", []
    for block in pass_.blocks(source):
        decoded += block
        if (point := pass_.point()) is not None:
            assert point.decompressed == len(decoded)
            points.append(point)
    assert decoded == text and len(points) > 20
    for point in points:
        source = io.BytesIO(stream)
        source.seek(point.compressed)
        rest = b"".join(_compression.Decompression("gzip", point=point).blocks(source))
        assert rest == text[point.decompressed:]
