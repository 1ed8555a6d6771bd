"""A compressed line shard written as many zstd frames or gzip members is entered, for each chunk
read, at the last frame before the chunk's first line (`zephon/io/_lines.py`, `entry_points`)."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest

from zephon.io import Dataset, ShardUnavailableError, _dataset, _lines

from .conftest_io import compress, read_all
_SKIPPABLE = (0x184D2A50).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"about"  # as pzstd writes before each


def _records(n: int) -> list[dict]:
    rng = random.Random(n)
    return [{"i": i, "text": "w" * rng.randrange(0, 90)} for i in range(n)]


def _lines_of(records: list[dict]) -> list[bytes]:
    return [json.dumps(r).encode() + b"\n" for r in records]


def _framed(lines: list[bytes], compression: str, lines_per_frame: int, between: bytes = b"") -> bytes:
    """The lines compressed `lines_per_frame` at a time, the frames concatenated, `between` before each."""
    return b"".join(between + compress(b"".join(lines[k:k + lines_per_frame]), compression)
                    for k in range(0, len(lines), lines_per_frame))


def _cut_anywhere(data: bytes, compression: str, seed: int) -> bytes:
    """`data` compressed in pieces of 1 to 300 bytes, cut inside lines as bgzip and pzstd cut."""
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(data):
        size = rng.randrange(1, 300)
        pieces.append(compress(data[at:at + size], compression))
        at += size
    return b"".join(pieces)


@pytest.fixture
def entered_at(monkeypatch) -> list[int]:
    """Where in its shard each compressed chunk read began decompressing."""
    began: list[int] = []
    decompress = _lines.decompressed_blocks

    def noting(f, compression, *args):
        began.append(f.tell())
        return decompress(f, compression, *args)

    monkeypatch.setattr(_lines, "decompressed_blocks", noting)
    return began


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_each_chunk_of_a_shard_of_many_frames_is_read_from_the_frame_holding_its_first_line(
        tmp_path, compression, entered_at):
    records = _records(1000)
    data = _framed(_lines_of(records), compression, 100)
    (tmp_path / f"a.jsonl.{compression}").write_bytes(data)
    ds = Dataset.from_path("d", str(tmp_path))
    seek = ds._access[0].seek
    frame_sizes = [len(compress(b"".join(_lines_of(records)[k:k + 100]), compression)) for k in range(0, 1000, 100)]
    assert seek.tolist() == [np.cumsum([0, *frame_sizes[:-1]]).tolist(), list(range(0, 1000, 100)), [0] * 10]
    entered_at.clear()
    for records_per_chunk in (1, 37, 128):
        assert read_all(ds, records_per_chunk) == (records, [])
    chunk = ds.chunks(37)[20]  # lines 740-776, in the frame of lines 700-799
    entered_at.clear()
    assert [r["i"] for r in ds.read_chunk(chunk).records] == list(range(740, 777))
    assert entered_at == [seek[0, 7]]
    assert ds.wasteful_decoding(10) is None


@pytest.mark.parametrize("compression", ["gz", "zst"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frames_cut_inside_lines_are_entered_at_the_first_line_starting_in_them(tmp_path, compression, seed,
                                                                                  monkeypatch):
    """Every chunk reads its lines exactly, whichever byte each frame begins at: a frame holding no
    line's start is no entry point, and one that begins inside a line is entered past that line's
    end. The seek stride of 2 keeps many entry points."""
    monkeypatch.setattr(_lines, "SEEK_STRIDE", 2)
    records = _records(400)
    data = _cut_anywhere(b"".join(_lines_of(records)), compression, seed)
    (tmp_path / f"a.jsonl.{compression}").write_bytes(data)
    ds = Dataset.from_path("d", str(tmp_path))
    compressed, first_lines, skipped = ds._access[0].seek
    assert len(first_lines) > 60 and first_lines[0] == 0 and np.all(np.diff(first_lines // 2) > 0)
    assert np.any(skipped > 0)  # frames beginning inside lines were kept
    for records_per_chunk in (1, 2, 3, 7, 64):
        assert read_all(ds, records_per_chunk) == (records, [])


def test_one_line_frames_keep_an_entry_point_per_seek_stride_lines_not_per_line(tmp_path):
    lines = _lines_of(_records(1000))
    (tmp_path / "a.jsonl.zst").write_bytes(_framed(lines, "zst", 1))
    seek = Dataset.from_path("d", str(tmp_path))._access[0].seek
    assert seek[1].tolist() == list(range(0, 1000, _lines.SEEK_STRIDE))


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_a_shard_written_as_one_stream_is_read_from_its_start_as_before(tmp_path, compression, entered_at):
    records = _records(300)
    (tmp_path / f"a.jsonl.{compression}").write_bytes(compress(b"".join(_lines_of(records)), compression))
    ds = Dataset.from_path("d", str(tmp_path))
    assert ds._access[0].seek is None
    assert read_all(ds, 50) == (records, [])
    assert set(entered_at) == {0}


@pytest.mark.parametrize("compression, between", [("zst", _SKIPPABLE), ("gz", b"\0" * 9)])
def test_skippable_frames_and_nul_padding_between_members_are_passed_over_from_any_entry_point(
        tmp_path, compression, between):
    """pzstd writes a skippable frame before each of its frames; some gzip writers pad members
    with NUL bytes (never before the first: `_compression`)."""
    records = _records(500)
    data = _framed(_lines_of(records), compression, 40, between)
    (tmp_path / f"a.jsonl.{compression}").write_bytes(data.removeprefix(b"\0" * 9))
    ds = Dataset.from_path("d", str(tmp_path))
    assert ds._access[0].seek.shape[1] >= 12
    for records_per_chunk in (1, 33):
        assert read_all(ds, records_per_chunk) == (records, [])


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_a_shard_of_many_frames_cut_after_planning_counts_the_records_it_lost(tmp_path, compression, monkeypatch):
    """On storage that tells no version (else a cut file is another version, refused), the chunks
    before the cut read whole, and each record after it is counted as truncated."""
    monkeypatch.setattr(_dataset, "version_of", lambda fs, path: None)
    records = _records(600)
    data = _framed(_lines_of(records), compression, 50)
    path = tmp_path / f"a.jsonl.{compression}"
    path.write_bytes(data)
    ds = Dataset.from_path("d", str(tmp_path))
    cut_in = int(ds._access[0].seek[0, 6]) + 10  # inside the frame of lines 300-349
    path.write_bytes(data[:cut_in])
    kept, skipped = read_all(ds, 32)
    assert kept == records[:len(kept)] and 300 <= len(kept) < 350
    assert [reason for _, reason in skipped] == ["truncated_shard"] * (600 - len(kept))


def test_entry_points_are_kept_in_the_scan_cache_and_a_damaged_table_is_scanned_again(tmp_path, caplog):
    lines = _lines_of(_records(300))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl.gz").write_bytes(_framed(lines, "gz", 20))
    scans = tmp_path / "scans"
    planned = Dataset.from_path("d", str(tmp_path / "data"))._access[0].seek
    assert np.array_equal(Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans)._access[0].seek, planned)
    (entry,) = scans.glob("*/*.npz")
    with np.load(entry) as stored:
        fields = dict(stored)
    fields["seek"] = fields["seek"].copy()
    fields["seek"][2, 3] = -1  # a negative distance into a frame
    np.savez(entry, **fields)
    with caplog.at_level(logging.WARNING, logger="zephon"):
        again = Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans)._access[0].seek
    assert np.array_equal(again, planned)
    assert any("could not be trusted" in r.getMessage() and "seek table" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_damage_in_one_frame_fails_only_the_chunk_reads_that_decompress_it(tmp_path, compression, monkeypatch):
    """A byte corrupted after planning (on storage that tells no version) is named unreadable by
    each chunk read decompressing its frame; chunks entering at a later frame read as planned."""
    monkeypatch.setattr(_dataset, "version_of", lambda fs, path: None)
    records = _records(400)
    data = bytearray(_framed(_lines_of(records), compression, 100))
    path = tmp_path / f"a.jsonl.{compression}"
    path.write_bytes(bytes(data))
    ds = Dataset.from_path("d", str(tmp_path))
    middle = (int(ds._access[0].seek[0, 1]) + int(ds._access[0].seek[0, 2])) // 2  # inside lines 100-199's frame
    data[middle] ^= 0xFF
    path.write_bytes(bytes(data))
    failed, read = [], []
    for chunk in ds.chunks(50):
        try:
            read += ds.read_chunk(chunk).records
        except ShardUnavailableError as error:
            assert "undecodable" in str(error)
            failed.append(chunk.start)
    assert failed == [100, 150] and read == records[:100] + records[200:]
