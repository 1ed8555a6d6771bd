"""WebDataset shards compressed whole (`.tar.gz`, `.tgz`, `.tar.zst`, `.tzst`): planned and read
as the plain tar they hold, record for record and reason for reason, whether written as one stream
or as many gzip members or zstd frames, read in any order, from resume points or not; a stream cut
short or undecodable reported as a plain tar's or a JSON Lines shard's would be
(`zephon.io._webdataset`, `_decompressed_view`)."""

from __future__ import annotations

import gzip
import io
import logging
import random
import tarfile
import zlib
from array import array

import numpy as np
import pytest
import zstandard

from tests.harness import space_resume_points
from tests.unit.test_io_tar_walk import END, outcomes, records, shards
from zephon.io import Dataset, ShardUnavailableError, _resume_points
from zephon.io._decompressed_view import DecompressedView
from zephon.io._webdataset import WebDataset

_PIECE = 1000  # bytes of tar a member or frame holds: most begin inside a header or a payload


def _gzip_members(tar: bytes) -> bytes:
    return b"".join(gzip.compress(tar[at:at + _PIECE]) for at in range(0, len(tar), _PIECE))


def _zstd_frames(tar: bytes) -> bytes:
    compress = zstandard.ZstdCompressor().compress
    return b"".join(compress(tar[at:at + _PIECE]) for at in range(0, len(tar), _PIECE))


LAYOUTS = {
    "a.tar.gz": gzip.compress,
    "a.tgz": _gzip_members,
    "a.tar.zst": zstandard.ZstdCompressor().compress,
    "a.tzst": _zstd_frames,
}


@pytest.fixture
def close_resume_points(monkeypatch) -> _resume_points.ResumePoints:
    return space_resume_points(monkeypatch, 2048)


def _as_plain(outcome: list, name: str) -> str:
    """An outcome as the plain tar's would read: its shard named `a.tar` in its errors' words."""
    return repr(outcome).replace(name, "a.tar")


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("shard", list(shards()))
def test_a_compressed_tar_plans_and_reads_as_the_tar_it_holds(tmp_path, close_resume_points, shard, name):
    """Every kind of header, and tars damaged (a header corrupted, cut anywhere) before they were
    compressed: the same count or planning error, the same records and reasons at every chunk size,
    the same errors record by record."""
    tar = shards()[shard]
    (tmp_path / "a.tar").write_bytes(tar)
    (tmp_path / name).write_bytes(LAYOUTS[name](tar))
    plain = outcomes(lambda: Dataset.from_path("d", str(tmp_path / "a.tar")), fast=True)
    assert _as_plain(outcomes(lambda: Dataset.from_path("d", str(tmp_path / name)), fast=True), name) == repr(plain)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunks_read_in_any_order_from_resume_points_or_entries_give_what_they_give_read_in_order(
        tmp_path, close_resume_points, monkeypatch, name):
    """A read noting resume points in an earlier member, then one entering a later member, read
    the decompressed offsets the later member stands at (a point before the member's start was
    taken for where the member began: every record of that chunk read as truncated)."""
    tar = shards()["dirs-links-global-pax"]
    (tmp_path / name).write_bytes(LAYOUTS[name](tar))
    ds = Dataset.from_path("d", str(tmp_path / name))
    chunks = ds.chunks(3)
    with monkeypatch.context() as without_points:
        without_points.setattr(_resume_points, "key_of", lambda shard: None)
        in_order = [ds.read_chunk(chunk) for chunk in chunks]
    assert close_resume_points.count() == 0
    order = random.Random(4).sample(range(len(chunks)), len(chunks))
    for k in order + order[::-1] + list(range(len(chunks))):
        got = ds.read_chunk(chunks[k])
        assert (got.records, got.skipped) == (in_order[k].records, in_order[k].skipped), k
    if name == "a.tar.gz":
        assert close_resume_points.count() > 2
    elif "zst" in name:  # zstandard's decoders cannot be copied
        assert close_resume_points.count() == 0


def _decompressed_before_the_cut(stored: bytes, name: str) -> bytes:
    """What a compressed tar cut short decompresses to before its cut, read by its codec's own library."""
    out, rest = [], stored
    while rest:  # member after member, frame after frame
        decoder = (zstandard.ZstdDecompressor().decompressobj() if "zst" in name
                   else zlib.decompressobj(wbits=zlib.MAX_WBITS | 16))
        out.append(decoder.decompress(rest))
        rest = decoder.unused_data
    return b"".join(out)


@pytest.mark.parametrize("name", ["a.tar.gz", "a.tgz", "a.tar.zst", "a.tzst"])
@pytest.mark.parametrize("cut", [0.05, 0.2, 0.5, 0.97])
def test_a_compressed_tar_cut_short_plans_and_reads_as_the_tar_it_held_up_to_the_cut(tmp_path, name, cut):
    """Planned and read as the plain tar cut where its decompression stops: the same count (or
    refusal), the same records, the rest `truncated_shard`; nothing raises while reading."""
    stored = LAYOUTS[name](shards()["pax-long-names"])
    stored = stored[: int(len(stored) * cut)]
    (tmp_path / name).write_bytes(stored)
    (tmp_path / "a.tar").write_bytes(_decompressed_before_the_cut(stored, name))

    def plan_and_read(shard: str):
        try:
            ds = Dataset.from_path("d", str(tmp_path / shard))
        except tarfile.ReadError as error:
            return "refused", str(error).partition(":")[0]
        reads = [ds.read_chunk(chunk) for chunk in ds.chunks(7)]
        return ds.num_records, [r for read in reads for r in read.records], [
            (a.index, reason) for read in reads for a, reason in read.skipped]

    if not (tmp_path / "a.tar").stat().st_size:  # nothing decompressed: an empty plain tar holds no records
        assert plan_and_read(name) == ("refused", "truncated header")  # where this stream's cut is named
        return
    plain = plan_and_read("a.tar")
    assert plan_and_read(name) == plain
    assert plain[0] == "refused" or ("truncated_shard" in {reason for _, reason in plain[2]})


def test_a_compressed_tar_cut_inside_its_end_of_archive_blocks_reads_its_last_record_as_the_plain_tar_does(tmp_path):
    """A cut in the zeros after the last member loses no member: the plain tar cut there reads its
    last record, and so does the compressed one (its view reads short at the cut, as a file cut
    there does; it raised EOFError, and the record was counted `truncated_shard`)."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w") as tar:
        for number in range(3):
            info = tarfile.TarInfo(f"{number}.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    whole = sink.getvalue()
    last_member_end = 3 * 2 * tarfile.BLOCKSIZE
    stored = b"".join(gzip.compress(whole[at:at + 64]) for at in range(0, last_member_end + 320, 64))
    stored += gzip.compress(whole[last_member_end + 320:])[:20]  # a member cut inside the end-of-archive zeros
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.tar").write_bytes(_decompressed_before_the_cut(stored, "a.tgz"))
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "a.tgz").write_bytes(stored)
    plain, cut = (Dataset.from_path("d", str(tmp_path / where)) for where in ("plain", "cut"))
    assert [cut.read_chunk(c).records for c in cut.chunks(1)] == [plain.read_chunk(c).records for c in plain.chunks(1)]
    assert [r["__key__"] for c in cut.chunks(1) for r in cut.read_chunk(c).records] == ["0", "1", "2"]


@pytest.mark.parametrize("name", ["a.tar.gz", "a.tar.zst"])
def test_undecodable_bytes_in_a_compressed_tar_fail_planning_naming_the_shard_as_in_a_jsonl_shard(tmp_path, name):
    tar = shards()["pax-long-names"]
    stored = bytearray(LAYOUTS[name](tar))
    stored[len(stored) // 2 : len(stored) // 2 + 64] = bytes(64)
    (tmp_path / name).write_bytes(bytes(stored))
    with pytest.raises(ShardUnavailableError, match=rf"{name}.*undecodable"):
        Dataset.from_path("d", str(tmp_path / name))


def test_planning_warns_of_a_large_tar_in_one_zstd_frame_and_not_of_one_in_small_frames(tmp_path):
    """A single zstd stream is decompressed from its start for every chunk (its decoders cannot
    be copied): planning names it as it names such a JSON Lines shard, and how to store it."""
    tar = records(range(200)) + END  # 200 chunks of one record: each reads half the stream on average
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.tar.zst").write_bytes(zstandard.ZstdCompressor().compress(tar))
    (tmp_path / "frames").mkdir()
    (tmp_path / "frames" / "a.tzst").write_bytes(_zstd_frames(tar))
    warning = Dataset.from_path("d", str(tmp_path / "one")).wasteful_decoding(1)
    assert warning is not None and "zstd frames" in warning and "plain tars" in warning, warning
    assert Dataset.from_path("d", str(tmp_path / "frames")).wasteful_decoding(1) is None


def test_the_view_reads_and_seeks_as_the_decompressed_bytes_would(close_resume_points):
    """Reads of any size from any offset, forward and back, as slices of the decompressed stream."""
    rng = random.Random(0)
    data = bytes(rng.getrandbits(8) for _ in range(20_000)) + b"caption " * 10_000
    for compressed, codec in ((gzip.compress(data), "gzip"), (_gzip_members(data), "gzip"),
                              (zstandard.ZstdCompressor().compress(data), "zstd")):
        for trial in range(200):
            view = DecompressedView(io.BytesIO(compressed), codec, resume_key=("k", codec, len(compressed)))
            at = rng.randrange(len(data) + 10)
            view.seek(at)
            size = rng.choice([0, 1, 511, 512, 3000, 70_000, -1])
            assert view.read(size) == (data[at:] if size < 0 else data[at : at + size]), (codec, at, size)
            back = max(0, view.tell() - rng.choice([1, 512, 60_000]))
            view.seek(back)
            assert view.read(100) == data[back : back + 100]
    assert close_resume_points.count() > 0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_compressed_tar_s_scan_is_kept_in_the_scan_cache_and_planned_from_it(tmp_path, monkeypatch, caplog, name):
    """Its three-row seek table is an entry the scan cache trusts (it checked it as a compressed
    JSON Lines shard's, which no tar's is, and scanned every such shard again at every start)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / name).write_bytes(LAYOUTS[name](records(range(40)) + END))
    scans = tmp_path / "scans"

    def facts(ds: Dataset) -> tuple:
        return ds.shards, [access.seek.tolist() for access in ds._access], ds.fingerprint()

    scanned = facts(Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans))
    with monkeypatch.context() as patched, caplog.at_level(logging.WARNING, logger="zephon"):
        patched.setattr(WebDataset, "scan", lambda self, shard: pytest.fail(f"{shard.url} was scanned again"))
        assert facts(Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans)) == scanned
    assert not [r for r in caplog.records if "scan cache" in r.getMessage()]


def test_a_view_sent_back_to_its_start_while_planning_notes_each_member_once():
    """Planning notes where each member begins (its entry points); a seek back past what the view
    keeps starts the decoder again, and the members it passes again are not noted twice."""
    data = bytes(random.Random(1).getrandbits(8) for _ in range(300_000))
    stored = _gzip_members(data)
    once = array("q")
    DecompressedView(io.BytesIO(stored), "gzip", frame_starts=once).decompressed_length()
    again = array("q")
    view = DecompressedView(io.BytesIO(stored), "gzip", frame_starts=again)
    assert view.read(200_000) == data[:200_000]
    view.seek(10)  # further back than the view keeps
    assert view.read() == data[10:]
    assert again == once and len(once) == 2 * 300


@pytest.mark.parametrize("damage", ["entry past its point", "entries out of order", "a point fewer"])
def test_a_damaged_compressed_tar_table_in_the_scan_cache_is_scanned_again(tmp_path, caplog, damage):
    """The rows the generic check leaves (entries' decompressed starts) and the points' count are
    the tar's own to check: a table they do not fit is not trusted, and the shard is scanned again."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.tgz").write_bytes(_gzip_members(records(range(100)) + END))
    scans = tmp_path / "scans"
    planned = Dataset.from_path("d", str(tmp_path / "data"))._access[0].seek
    Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans)
    (entry,) = scans.glob("*/*.npz")
    with np.load(entry) as stored:
        fields = dict(stored)
    seek = fields["seek"].copy()
    if damage == "entry past its point":
        seek[2, 3] = seek[0, 3] + 1
    elif damage == "entries out of order":
        seek[2, 2], seek[2, 3] = seek[2, 3], seek[2, 2] - 1
    else:
        seek = seek[:, :-1]
    fields["seek"] = seek
    np.savez(entry, **fields)
    with caplog.at_level(logging.WARNING, logger="zephon"):
        again = Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans)._access[0].seek
    assert np.array_equal(again, planned)
    assert any("could not be trusted" in r.getMessage() and "seek table" in r.getMessage() for r in caplog.records)
