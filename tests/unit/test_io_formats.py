"""Each shard format reads the records it holds, in order, and accounts for every bad one."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import tarfile
import tracemalloc

import pytest

from zephon import BadRecordError, Chunk, RecordAddress
from zephon.io import Dataset, ShardUnavailableError, _dataset, _lines
from zephon.io._compression import decompressed_blocks, raw_blocks

from .conftest_io import compress, jsonl_bytes, lines_bytes, parquet_bytes, read_all, tar_bytes


@pytest.fixture
def storage_telling_no_version(monkeypatch):
    """Shards planned on storage that tells no version of its files (an HTTP server sending neither
    an ETag nor a Last-Modified): a file changed after planning is known there by its size alone,
    so a file cut after planning meets the readers' own handling of a shard shorter than planned.
    (Where the storage tells a version, a cut file is another version: refused before it is read.)"""
    monkeypatch.setattr(_dataset, "version_of", lambda fs, path: None)


def noisy_records(n: int) -> list[dict]:
    """Records that compress poorly, so a cut compressed file still decodes part of its lines."""
    rng = random.Random(n)
    return [{"i": i, "noise": rng.getrandbits(128)} for i in range(n)]


@pytest.mark.parametrize("compression", [None, "gz", "zst"])
@pytest.mark.parametrize("records_per_chunk", [1, 97, 256, 1000])
def test_jsonl_chunks_read_every_record_in_order(tmp_path, compression, records_per_chunk):
    records = noisy_records(700)
    suffix = ".jsonl" + (f".{compression}" if compression else "")
    (tmp_path / f"a{suffix}").write_bytes(jsonl_bytes(records, compression))
    ds = Dataset.from_path("d", str(tmp_path / f"a{suffix}"))
    assert ds.format == "jsonl" and ds.num_records == 700
    assert read_all(ds, records_per_chunk) == (records, [])


def test_jsonl_chunk_in_the_middle_reads_exactly_its_range(tmp_path):
    records = [{"i": i} for i in range(1000)]
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(records))
    ds = Dataset.from_path("d", str(tmp_path / "a.jsonl"))
    for start, stop in [(0, 1), (255, 257), (256, 512), (300, 301), (999, 1000), (511, 900)]:
        out = ds.read_chunk(Chunk("d", 0, start, stop))
        assert out.records == records[start:stop]
        assert [a.index for a in out.addresses] == list(range(start, stop))


def test_jsonl_every_range_reads_exactly_its_lines_across_seek_points(tmp_path):
    """Reads start at a seek point before the range and stop at the seek point after it."""
    records = noisy_records(70)
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(records))
    ds = Dataset.from_path("d", str(tmp_path / "a.jsonl"))
    for start in range(70):
        for stop in range(start + 1, 71):
            assert ds.read_chunk(Chunk("d", 0, start, stop)).records == records[start:stop]


def test_plain_jsonl_cut_after_planning_counts_every_missing_record(tmp_path, storage_telling_no_version):
    records = noisy_records(60)
    whole = jsonl_bytes(records)
    path = tmp_path / "a.jsonl"
    path.write_bytes(whole)
    ds = Dataset.from_path("d", str(path))
    path.write_bytes(whole[: whole.index(b"\n", len(whole) // 2) + 1])  # keeps whole lines only
    kept = sum(1 for _ in path.read_bytes().splitlines())
    out = ds.read_chunk(Chunk("d", 0, 10, 60))
    assert out.records == records[10:kept]
    assert [(a.index, reason) for a, reason in out.skipped] == [(i, "truncated_shard") for i in range(kept, 60)]


def test_jsonl_bad_lines_are_skipped_with_their_reason_and_address(tmp_path):
    lines = [b'{"ok": 0}', b'{"broken', b'"\xff\xfe"', b"[1, 2]", b"", b'{"ok": 5}\r', b'{"ok": 6}']
    path = tmp_path / "a.json"
    path.write_bytes(lines_bytes(lines, final_newline=False))
    ds = Dataset.from_path("d", str(path))
    assert ds.num_records == 7
    out = ds.read_chunk(ds.chunks(10)[0])
    assert out.records == [{"ok": 0}, {"ok": 5}, {"ok": 6}]
    assert [a.index for a in out.addresses] == [0, 5, 6]
    shard = str(path)
    assert out.skipped == [
        (RecordAddress("d", shard, 1), "malformed_json"),
        (RecordAddress("d", shard, 2), "invalid_utf8"),
        (RecordAddress("d", shard, 3), "not_an_object"),
        (RecordAddress("d", shard, 4), "malformed_json"),
    ]


def test_raise_policy_fails_on_the_first_bad_record_naming_its_address(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(lines_bytes([b'{"ok": 0}', b"{nope", b"[]"]))
    ds = Dataset.from_path("d", str(path))
    with pytest.raises(BadRecordError) as caught:
        ds.read_chunk(ds.chunks(3)[0], on_error="raise")
    assert caught.value.reason == "malformed_json"
    assert caught.value.address == RecordAddress("d", str(path), 1)
    assert f"{path}#1" in str(caught.value)


@pytest.mark.parametrize("compression", ["gz", "zst"])
@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_compressed_shard_corrupted_after_planning_is_named_unreadable(tmp_path, compression, suffix):
    whole = compress(jsonl_bytes(noisy_records(300)), compression)
    path = tmp_path / f"a{suffix}.{compression}"
    path.write_bytes(whole)
    ds = Dataset.from_path("d", str(path), retries=3, retry_delay=0)
    # gzip checks a CRC, so any flip fails; zstd frames carry no checksum by default, so flipped
    # literal bytes would decode to garbage lines (counted as malformed_json): flip its frame header.
    at = len(whole) // 2 if compression == "gz" else 4
    flipped = bytearray(whole)
    for i in range(at, at + 64):
        flipped[i] ^= 0xFF
    planned = path.stat()
    path.write_bytes(bytes(flipped))
    os.utime(path, ns=(planned.st_atime_ns, planned.st_mtime_ns))  # bit rot: the same size, inode and mtime
    with pytest.raises(ShardUnavailableError, match=f"undecodable {'gzip' if compression == 'gz' else 'zstd'}") as caught:
        read_all(ds, 300)
    assert caught.value.url == str(path) and caught.value.attempts == 1  # corrupt bytes are not retried
    with pytest.raises(ShardUnavailableError, match="undecodable"):
        Dataset.from_path("d", str(path))  # and planning it again names it too


def test_a_zstd_shard_written_with_a_long_window_is_named_with_what_to_do(tmp_path):
    """`zstd --long=31` (a common setting for large corpora) writes frames whose window is larger
    than the 128 MiB a zstd decoder takes by default: planning said only "Frame requires too much
    memory for decoding", which tells neither the cause nor what to do."""
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=31, enable_ldm=True)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()  # streamed: no content size
    (tmp_path / "a.jsonl.zst").write_bytes(writer.compress(jsonl_bytes(noisy_records(50))) + writer.flush())
    with pytest.raises(ShardUnavailableError, match="undecodable zstd") as caught:
        Dataset.from_path("d", str(tmp_path / "a.jsonl.zst"), retry_delay=0)
    assert "zstd --long" in str(caught.value) and "recompress" in str(caught.value)
    assert caught.value.attempts == 1


@pytest.mark.parametrize("unit", ["line", "file"])
@pytest.mark.parametrize("padding", [10, 1 << 19])  # the larger runs on over several read blocks
def test_gzip_padded_with_nul_bytes_reads_like_pythons_gzip(tmp_path, unit, padding):
    """Block writers pad a gzip file with NULs; Python's gzip skips them after any member."""
    first, second = jsonl_bytes(noisy_records(40)), jsonl_bytes(noisy_records(7))
    nuls = b"\0" * padding
    data = compress(first, "gz") + nuls + compress(second, "gz") + nuls
    (tmp_path / "a.txt.gz").write_bytes(data)
    assert gzip.decompress(data) == first + second
    ds = Dataset.from_path("d", str(tmp_path / "a.txt.gz"), text_unit=unit)
    records, skipped = read_all(ds, 16)
    assert "".join(r["text"] + ("\n" if unit == "line" else "") for r in records) == (first + second).decode()
    assert skipped == [] and ds.shards[0].raw_bytes == len(first + second)


@pytest.mark.parametrize(
    "name, data",
    [
        ("nuls-first.txt.gz", b"\0\0" + compress(b"x\n", "gz")),  # padding follows a member, never leads
        ("garbage-after-nuls.txt.gz", compress(b"x\n", "gz") + b"\0\0junk"),
        ("nuls-after.txt.zst", compress(b"x\n", "zst") + b"\0" * 8),  # the zstd tool refuses these too
    ],
)
def test_bytes_after_a_frame_that_are_not_its_codecs_padding_stay_undecodable(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ShardUnavailableError, match="undecodable"):
        Dataset.from_path("d", str(tmp_path / name))


def test_zstd_skippable_frames_are_passed_over(tmp_path):
    skippable = (0x184D2A50).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"about"
    data = skippable + compress(b"a\n", "zst") + skippable + compress(b"b\n", "zst") + skippable
    (tmp_path / "a.txt.zst").write_bytes(data)
    assert read_all(Dataset.from_path("d", str(tmp_path / "a.txt.zst")), 4) == ([{"text": "a"}, {"text": "b"}], [])


def test_a_zstd_stream_of_many_frames_is_decoded_with_one_context_and_still_notices_a_cut(monkeypatch):
    """A zstd context costs ~10 µs to make: one per frame was most of the time spent reading a
    shard of one-line frames (1.2 s of 100,000 frames, 0.16 s with one context per stream)."""
    import zstandard

    made, make = [], zstandard.ZstdDecompressor

    def counted(*args, **kwargs):  # no subclass: python-zstandard 0.25 crashes freeing one's instance
        made.append(1)
        return make(*args, **kwargs)

    monkeypatch.setattr(zstandard, "ZstdDecompressor", counted)
    frames = [compress(b"line %d\n" % i, "zst") for i in range(50)]
    data = b"".join(frames)
    assert b"".join(decompressed_blocks(io.BytesIO(data), "zstd")) == b"".join(b"line %d\n" % i for i in range(50))
    assert len(made) == 1
    between_frames, inside_a_frame = len(data) - len(frames[-1]), len(data) - 3
    assert len(b"".join(decompressed_blocks(io.BytesIO(data[:between_frames]), "zstd"))) == len(b"".join(
        b"line %d\n" % i for i in range(49)))
    with pytest.raises(EOFError, match="inside a frame"):
        list(decompressed_blocks(io.BytesIO(data[:inside_a_frame]), "zstd"))


@pytest.mark.parametrize("compression", [None, "gz", "zst"])
def test_text_lines_keep_empty_lines_as_records(tmp_path, compression):
    data = b"first\r\n\nthird \xff\nlast without newline"
    suffix = ".txt" + (f".{compression}" if compression else "")
    (tmp_path / f"a{suffix}").write_bytes(compress(data, compression))
    ds = Dataset.from_path("d", str(tmp_path))
    assert ds.format == "text" and ds.num_records == 4
    records, skipped = read_all(ds, 3)
    assert records == [{"text": "first"}, {"text": ""}, {"text": "last without newline"}]
    assert [(a.index, reason) for a, reason in skipped] == [(2, "invalid_utf8")]


def test_text_file_unit_makes_one_record_per_file(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"one\ntwo\n")
    (tmp_path / "b.txt.gz").write_bytes(compress("três".encode(), "gz"))
    (tmp_path / "c.txt").write_bytes(b"")
    ds = Dataset.from_path("d", str(tmp_path), text_unit="file")
    assert [s.num_records for s in ds.shards] == [1, 1, 0]
    assert read_all(ds, 5) == ([{"text": "one\ntwo\n"}, {"text": "três"}], [])


@pytest.mark.parametrize("kept", [0, 11])
def test_text_file_unit_counts_a_file_cut_after_planning_as_truncated_not_a_shorter_text(
    tmp_path, storage_telling_no_version, kept
):
    """A plain text file is one record, the whole file: cut or emptied after planning, it was handed
    out as a shorter (or empty) text with no word, where a line shard or a compressed file cut
    the same way counts what it lost as `truncated_shard`."""
    path = tmp_path / "a.txt"
    path.write_bytes(b"first line\nsecond line\nthird\n")
    ds = Dataset.from_path("d", str(tmp_path), text_unit="file")
    path.write_bytes(path.read_bytes()[:kept])
    assert read_all(ds, 1) == ([], [(RecordAddress("d", str(path), 0), "truncated_shard")])
    with pytest.raises(BadRecordError, match="truncated_shard"):
        read_all(ds, 1, on_error="raise")


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_text_file_unit_counts_a_compressed_file_emptied_after_planning_as_truncated_not_an_empty_text(
    tmp_path, storage_telling_no_version, compression
):
    """An empty file holds no stream to be found cut: it was read as an empty text."""
    path = tmp_path / f"a.txt.{compression}"
    path.write_bytes(compress(b"a document\n", compression))
    ds = Dataset.from_path("d", str(tmp_path), text_unit="file")
    path.write_bytes(b"")
    assert read_all(ds, 1) == ([], [(RecordAddress("d", str(path), 0), "truncated_shard")])


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_text_file_unit_plans_a_compressed_file_by_its_decompressed_size(tmp_path, compression):
    """raw_bytes sizes prefetching and the memory budget: it is the text's size, not the stored one."""
    text = "".join(f"line {i} of a document that compresses well\n" for i in range(2000)).encode()
    (tmp_path / f"a.txt.{compression}").write_bytes(compress(text, compression))
    cut = compress(text, compression)
    (tmp_path / f"b.txt.{compression}").write_bytes(cut[: len(cut) // 2])
    ds = Dataset.from_path("d", str(tmp_path), text_unit="file")
    whole, truncated = ds.shards
    assert whole.nbytes < len(text) // 10 and whole.raw_bytes == len(text)
    assert ds.raw_bytes(ds.chunks(1)[0]) == len(text)
    assert truncated.raw_bytes < len(text)  # what the cut stream still decodes to
    assert read_all(ds, 1) == ([{"text": text.decode()}], [(RecordAddress("d", truncated.url, 0), "truncated_shard")])


@pytest.mark.parametrize("compression", ["gz", "zst"])
@pytest.mark.parametrize("kept", [0.05, 0.8])
def test_cut_compressed_shard_reports_its_lost_records_as_truncated(tmp_path, compression, kept):
    data = jsonl_bytes(noisy_records(3000), compression)
    path = tmp_path / f"a.jsonl.{compression}"
    path.write_bytes(data[: int(len(data) * kept)])
    ds = Dataset.from_path("d", str(path))
    assert 0 < ds.num_records < 3000
    records, skipped = read_all(ds, 500)
    assert records == noisy_records(3000)[: len(records)]
    assert skipped and {reason for _, reason in skipped} == {"truncated_shard"}
    assert len(records) + len(skipped) == ds.num_records


def test_parquet_chunks_across_row_groups_read_the_right_rows(tmp_path):
    rows = [{"i": i, "text": f"row {i}", "blob": bytes([i % 256])} for i in range(1000)]
    (tmp_path / "a.parquet").write_bytes(parquet_bytes(rows[:700], row_group_size=64))
    (tmp_path / "b.parquet").write_bytes(parquet_bytes(rows[700:], row_group_size=1000))
    ds = Dataset.from_path("d", str(tmp_path))
    assert ds.format == "parquet" and [s.num_records for s in ds.shards] == [700, 300]
    for records_per_chunk in (1, 63, 64, 65, 300, 1000):
        assert read_all(ds, records_per_chunk) == (rows, [])
    out = ds.read_chunk(Chunk("d", 0, 100, 130))  # inside row group 1, not at its start
    assert out.records == rows[100:130]


def test_webdataset_groups_members_by_key_and_decodes_txt_and_json(tmp_path):
    members = [
        ("shard/", None),
        ("shard/0001.jpg", b"\xff\xd8jpeg"),
        ("shard/0001.txt", "a caption é".encode()),
        ("shard/0001.json", b'{"w": 3}'),
        ("shard/0002.seg.png", b"png"),
        ("shard/0002.en.txt", b"second"),
        ("NOTES", b"no extension: not part of any record"),
        ("top.cls", b"7"),
    ]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    ds = Dataset.from_path("d", str(tmp_path / "a.tar"))
    assert ds.format == "webdataset" and ds.num_records == 3
    records, skipped = read_all(ds, 2)
    assert skipped == []
    assert records == [
        {"__key__": "shard/0001", "jpg": b"\xff\xd8jpeg", "txt": "a caption é", "json": {"w": 3}},
        {"__key__": "shard/0002", "seg.png": b"png", "en.txt": "second"},
        {"__key__": "top", "cls": b"7"},
    ]


def test_webdataset_bad_members_skip_their_record(tmp_path):
    """A .json member is parsed like a JSON line: JSON Python cannot hold (an integer of over 4,300
    digits, nesting deeper than 200 levels) is malformed_json too, not a failed read."""
    members = [("0.txt", b"ok"), ("1.txt", b"\xff"), ("2.json", b"{"), ("3.txt", b"ok"),
               ("4.json", b'{"id": ' + b"9" * 5000 + b"}"), ("5.json", b"[" * 100_000 + b"]" * 100_000)]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    ds = Dataset.from_path("d", str(tmp_path))
    records, skipped = read_all(ds, 6)
    assert [r["__key__"] for r in records] == ["0", "3"]
    assert [(a.index, reason) for a, reason in skipped] == [
        (1, "invalid_utf8"), (2, "malformed_json"), (4, "malformed_json"), (5, "malformed_json")]


def test_webdataset_member_named_like_the_key_field_is_not_part_of_any_record(tmp_path):
    """`0001.__key__` would overwrite the record's key; planning and reading both leave it out."""
    members = [m for i in range(40) for m in [(f"{i:04d}.__key__", b"x")] * (i % 3 == 1)
               + [(f"{i:04d}.txt", f"cap {i}".encode()), (f"{i:04d}.jpg", b"J")]]
    members += [("0040.__key__", b"alone: no record")]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    ds = Dataset.from_path("d", str(tmp_path / "a.tar"))
    assert ds.num_records == 40
    for records_per_chunk in (1, 7, 16, 40):
        records, skipped = read_all(ds, records_per_chunk)
        assert skipped == []
        assert records == [{"__key__": f"{i:04d}", "txt": f"cap {i}", "jpg": b"J"} for i in range(40)]


def test_webdataset_hidden_members_such_as_macos_appledouble_files_are_part_of_no_record(tmp_path):
    """A tar made on macOS holds `._0001.jpg` (AppleDouble metadata) just before `0001.jpg`. Read as
    a member of key `imgs/` it split every sample into two half-records between junk records."""
    members = [m for i in range(40) for ext in ("jpg", "txt")
               for m in [(f"imgs/._{i:04d}.{ext}", b"\x00\x05\x16\x07AppleDouble"),
                         (f"imgs/{i:04d}.{ext}", f"cap {i}".encode() if ext == "txt" else b"J")]]
    members += [("imgs/.DS_Store", b"Bud1"), (".hidden.txt", b"not a record")]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    ds = Dataset.from_path("d", str(tmp_path / "a.tar"))
    assert ds.num_records == 40
    for records_per_chunk in (1, 7, 16, 40):
        assert read_all(ds, records_per_chunk) == (
            [{"__key__": f"imgs/{i:04d}", "jpg": b"J", "txt": f"cap {i}"} for i in range(40)], [])


def test_webdataset_member_extensions_in_upper_or_mixed_case_read_as_their_lower_case_fields(tmp_path):
    """Camera dumps and Windows tools write `0001.JPG`; the WebDataset library lowercases the
    extension when it groups members. Read as fields "JPG" and "Txt", the image and the caption
    were counted `missing_image` / `missing_field` while the tar held them. The field is the
    lower-cased extension, and a `.txt` or `.json` member is decoded whatever its case."""
    def members(case):
        return [(f"imgs/0001.{case('jpg')}", b"\xff\xd8jpeg"), (f"imgs/0001.{case('txt')}", "a caption é".encode()),
                (f"imgs/0001.{case('json')}", b'{"w": 3}'), (f"imgs/0002.{case('seg.png')}", b"png"),
                (f"imgs/0002.{case('en.txt')}", b"\xef\xbb\xbfsecond")]
    mixed = iter([str.upper, str.title, str.upper, str.upper, str.title])
    (tmp_path / "upper").mkdir(), (tmp_path / "lower").mkdir()
    (tmp_path / "upper" / "a.tar").write_bytes(tar_bytes(members(lambda ext: next(mixed)(ext))))
    (tmp_path / "lower" / "a.tar").write_bytes(tar_bytes(members(str.lower)))
    expected = [{"__key__": "imgs/0001", "jpg": b"\xff\xd8jpeg", "txt": "a caption é", "json": {"w": 3}},
                {"__key__": "imgs/0002", "seg.png": b"png", "en.txt": "second"}]
    for case in ("upper", "lower"):
        ds = Dataset.from_path("d", str(tmp_path / case / "a.tar"))
        assert ds.num_records == 2
        for records_per_chunk in (1, 2):
            assert read_all(ds, records_per_chunk) == (expected, [])


def test_webdataset_record_holding_one_field_in_two_cases_is_skipped_as_duplicate_member(tmp_path):
    """`0001.jpg` and `0001.JPG` are two payloads for the field jpg: which is the record's is not
    known, as for a member named twice. The record is counted once, at planning and when read."""
    members = [("0000.jpg", b"J0"), ("0000.txt", b"cap 0"),
               ("0001.jpg", b"lower"), ("0001.JPG", b"upper"), ("0001.txt", b"cap 1"),
               ("0002.Txt", b"cap 2"), ("0002.jpg", b"J2")]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    ds = Dataset.from_path("d", str(tmp_path / "a.tar"))
    assert ds.num_records == 3
    for records_per_chunk in (1, 3):
        records, skipped = read_all(ds, records_per_chunk)
        assert records == [{"__key__": "0000", "jpg": b"J0", "txt": "cap 0"},
                           {"__key__": "0002", "txt": "cap 2", "jpg": b"J2"}]
        assert [(a.index, reason) for a, reason in skipped] == [(1, "duplicate_member")]
    with pytest.raises(BadRecordError) as info:
        read_all(ds, 3, on_error="raise")
    assert (info.value.address.index, info.value.reason) == (1, "duplicate_member")
    assert "0001.JPG" in str(info.value) and "'jpg'" in str(info.value)


def test_webdataset_keys_keep_their_case_so_keys_differing_only_in_case_are_two_records(tmp_path):
    """Only the extension is a field name; the key names a sample as its writer spelled it, as in
    the WebDataset library: `A.jpg` and `a.jpg` are two samples. A member whose extension is the
    key field in any case (`0001.__KEY__`) is part of no record: lower-cased, it would overwrite the key."""
    members = [("A.jpg", b"upper"), ("A.txt", b"cap A"), ("a.jpg", b"lower"), ("a.TXT", b"cap a"),
               ("a.__KEY__", b"x"), ("B.__Key__", b"alone: no record")]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    ds = Dataset.from_path("d", str(tmp_path / "a.tar"))
    assert ds.num_records == 2
    for records_per_chunk in (1, 2):
        assert read_all(ds, records_per_chunk) == (
            [{"__key__": "A", "jpg": b"upper", "txt": "cap A"}, {"__key__": "a", "jpg": b"lower", "txt": "cap a"}], [])


def _tar_with_links() -> bytes:
    """Five records: 0 and 4 of plain files; 1 whose image is a hard link to record 0's; 2 made of
    symbolic links alone; 3 whose label is a FIFO. A directory with a dot in its name sits among
    them, as `tar` stores the directories it walks."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, payload: bytes | None = None, kind: bytes = tarfile.REGTYPE, target: str = ""):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            info.size = len(payload) if payload is not None else 0
            tar.addfile(info, io.BytesIO(payload) if payload is not None else None)
        add("imgs.v2", kind=tarfile.DIRTYPE)
        add("imgs.v2/0.jpg", b"J0"), add("imgs.v2/0.txt", b"cap 0")
        add("imgs.v2/1.jpg", kind=tarfile.LNKTYPE, target="imgs.v2/0.jpg"), add("imgs.v2/1.txt", b"cap 1")
        add("imgs.v2/2.jpg", kind=tarfile.SYMTYPE, target="0.jpg")
        add("imgs.v2/2.txt", kind=tarfile.SYMTYPE, target="0.txt")
        add("imgs.v2/3.jpg", b"J3"), add("imgs.v2/3.txt", b"cap 3"), add("imgs.v2/3.cls", kind=tarfile.FIFOTYPE)
        add("imgs.v2/4.jpg", b"J4"), add("imgs.v2/4.txt", b"cap 4")
    return sink.getvalue()


def test_webdataset_link_or_fifo_members_skip_their_record_as_not_a_file_instead_of_vanishing(tmp_path):
    """A member that is a link (hard or symbolic) or a FIFO holds no payload in the tar. It was
    left out of its record unsaid: a record of links alone was missing from the plan and the
    count, and one with a link among its files was handed out without that member (an image
    then counted as `missing_image`, though the tar names one; a label dropped, uncounted)."""
    (tmp_path / "a.tar").write_bytes(_tar_with_links())
    ds = Dataset.from_path("d", str(tmp_path / "a.tar"))
    assert ds.num_records == 5
    for records_per_chunk in (1, 2, 5):
        records, skipped = read_all(ds, records_per_chunk)
        assert records == [{"__key__": f"imgs.v2/{i}", "jpg": f"J{i}".encode(), "txt": f"cap {i}"} for i in (0, 4)]
        assert [(a.index, reason) for a, reason in skipped] == [(1, "not_a_file"), (2, "not_a_file"), (3, "not_a_file")]
    with pytest.raises(BadRecordError) as info:
        read_all(ds, 5, on_error="raise")
    assert (info.value.address.index, info.value.reason) == (1, "not_a_file")
    assert "imgs.v2/1.jpg is a hard link to imgs.v2/0.jpg" in str(info.value)


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT])
def test_webdataset_keys_do_not_depend_on_the_locale_of_the_machine_reading_the_tar(tmp_path, monkeypatch, tar_format):
    """Outside PAX headers a member's name is bytes; tarfile decoded them with the reading machine's
    file-system encoding, so under a Latin-1 locale `café/0001` became `cafÃ©/0001`."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=tar_format, encoding="utf-8") as tar:
        for name, payload in (("café/0001.txt", b"un"), ("café/0002.txt", b"deux")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "a.tar").write_bytes(sink.getvalue())
    monkeypatch.setattr(tarfile.TarFile, "encoding", "latin-1")  # what a Latin-1 locale makes the default
    assert read_all(Dataset.from_path("d", str(tmp_path / "a.tar")), 2) == (
        [{"__key__": "café/0001", "txt": "un"}, {"__key__": "café/0002", "txt": "deux"}], [])


def long_name(i: int) -> str:
    return f"{'deep/' * 30}{i:05d}"  # over 100 characters: stored with a PAX header


def test_webdataset_chunks_far_into_a_shard_with_long_names(tmp_path):
    n = 100
    members = [m for i in range(n) for m in [(f"{long_name(i)}.txt", str(i).encode()), (f"{long_name(i)}.cls", b"c")]]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    ds = Dataset.from_path("d", str(tmp_path / "a.tar"))
    assert ds.num_records == n
    for records_per_chunk in (1, 15, 17, 100):
        records, skipped = read_all(ds, records_per_chunk)
        assert skipped == []
        assert [(r["__key__"], r["txt"]) for r in records] == [(long_name(i), str(i)) for i in range(n)]


def cut_tar(num_records: int, cut_in_record: int) -> tuple[bytes, bytes]:
    members = [(f"{i:03d}.txt", json.dumps(i).encode() * 300) for i in range(num_records)]
    whole = tar_bytes(members)
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        cut = tar.getmembers()[cut_in_record].offset_data + 100  # inside that member's data
    return whole, whole[:cut]


def test_tar_cut_short_before_planning_reports_the_cut_record(tmp_path):
    _, cut = cut_tar(10, cut_in_record=7)
    (tmp_path / "a.tar").write_bytes(cut)
    ds = Dataset.from_path("d", str(tmp_path))
    assert ds.num_records == 8
    records, skipped = read_all(ds, 3)
    assert [r["__key__"] for r in records] == [f"{i:03d}" for i in range(7)]
    assert [(a.index, reason) for a, reason in skipped] == [(7, "truncated_shard")]


def test_tar_cut_short_after_planning_counts_every_missing_record(tmp_path, storage_telling_no_version):
    whole, cut = cut_tar(10, cut_in_record=7)
    path = tmp_path / "a.tar"
    path.write_bytes(whole)
    ds = Dataset.from_path("d", str(path))
    assert ds.num_records == 10
    path.write_bytes(cut)
    records, skipped = read_all(ds, 4)
    assert len(records) == 7
    assert [(a.index, reason) for a, reason in skipped] == [(i, "truncated_shard") for i in (7, 8, 9)]
    with pytest.raises(BadRecordError, match="truncated_shard"):
        read_all(ds, 10, on_error="raise")


def _pairs_tar(num_records: int) -> tuple[bytes, dict[str, int]]:
    """A tar of records of a caption and a JSON member each, and the offset of each member's header."""
    whole = tar_bytes([m for i in range(num_records)
                       for m in [(f"{i:03d}.txt", f"caption {i}".encode()), (f"{i:03d}.json", b'{"i": %d}' % i)]])
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        return whole, {member.name: member.offset for member in tar.getmembers()}


@pytest.mark.parametrize("inside_the_header", [False, True])
@pytest.mark.parametrize("records_per_chunk", [4, 20])
def test_tar_cut_after_planning_between_members_of_a_record_hands_out_no_part_of_that_record(
    tmp_path, storage_telling_no_version, records_per_chunk, inside_the_header
):
    """A tar cut after planning at (or inside) the header of a record's second member ends the
    walk as if the archive ended there: the record was handed out without that member (a caption
    without its image), with no count. A file shorter than planned that does not end in the
    end-of-archive blocks may have lost members of its last record, so that record is counted
    `truncated_shard` with the records after it."""
    whole, offsets = _pairs_tar(20)
    path = tmp_path / "a.tar"
    path.write_bytes(whole)
    ds = Dataset.from_path("d", str(tmp_path))
    path.write_bytes(whole[: offsets["010.json"] + (100 if inside_the_header else 0)])
    records, skipped = read_all(ds, records_per_chunk)
    assert [r["__key__"] for r in records] == [f"{i:03d}" for i in range(10)]
    assert all(set(r) == {"__key__", "txt", "json"} for r in records)
    assert [(a.index, reason) for a, reason in skipped] == [(i, "truncated_shard") for i in range(10, 20)]


@pytest.mark.parametrize("inside_the_header", [False, True])
def test_tar_cut_before_planning_between_members_of_a_record_counts_that_record_as_truncated(
    tmp_path, inside_the_header
):
    """Planning cannot tell where a tar without its end-of-archive blocks was cut and counts the key
    it ends in as a record; reading handed that record out without its later members (a caption
    without its image), uncounted. It is now counted `truncated_shard`, as a cut inside a member is."""
    whole, offsets = _pairs_tar(20)
    (tmp_path / "a.tar").write_bytes(whole[: offsets["010.json"] + (100 if inside_the_header else 0)])
    ds = Dataset.from_path("d", str(tmp_path))
    assert ds.num_records == 11
    for records_per_chunk in (4, 11):
        records, skipped = read_all(ds, records_per_chunk)
        assert [r["__key__"] for r in records] == [f"{i:03d}" for i in range(10)]
        assert [(a.index, reason) for a, reason in skipped] == [(10, "truncated_shard")]


def test_tar_cut_after_planning_inside_its_end_of_archive_blocks_keeps_its_last_record(tmp_path, storage_telling_no_version):
    """Zeros after the last member are the end of the archive: its last record is whole."""
    whole, offsets = _pairs_tar(20)
    path = tmp_path / "a.tar"
    path.write_bytes(whole)
    ds = Dataset.from_path("d", str(tmp_path))
    end = offsets["019.json"] + 2 * tarfile.BLOCKSIZE  # its header and its data's one block
    path.write_bytes(whole[: end + 700])
    records, skipped = read_all(ds, 20)
    assert len(records) == 20 and skipped == []


def test_json_python_cannot_hold_is_a_malformed_line(tmp_path):
    lines = [b'{"a": 1}', b'{"id": ' + b"9" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000, b'{"a": 2}']
    (tmp_path / "a.jsonl").write_bytes(lines_bytes(lines))
    records, skipped = read_all(Dataset.from_path("d", str(tmp_path)), 2)
    assert records == [{"a": 1}, {"a": 2}]
    assert [(a.index, reason) for a, reason in skipped] == [(1, "malformed_json"), (2, "malformed_json")]



def test_a_json_object_naming_a_key_twice_is_skipped_as_duplicate_key_not_read_with_one_value_dropped(tmp_path):
    """`json.loads` keeps the last of two values of one key and drops the other without a word, as
    a tar record's member and a Parquet file's column named twice did before they were skipped."""
    lines = [b'{"text": "kept"}', b'{"text": "one", "text": "two"}', b'{"text": "ok", "meta": {"k": 1, "k": 2}}',
             b'[{"a": 1, "a": 1}]', b'{"text": "also kept", "meta": {"k": 1}, "k": 2}']
    (tmp_path / "a.jsonl").write_bytes(lines_bytes(lines))
    records, skipped = read_all(Dataset.from_path("d", str(tmp_path / "a.jsonl")), 2)
    assert records == [{"text": "kept"}, {"text": "also kept", "meta": {"k": 1}, "k": 2}]
    assert [(a.index, reason) for a, reason in skipped] == [(1, "duplicate_key"), (2, "duplicate_key"),
                                                             (3, "duplicate_key")]
    members = [("0.json", b'{"caption": "a"}'), ("1.json", b'{"caption": "a", "caption": "b"}')]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    records, skipped = read_all(Dataset.from_path("t", str(tmp_path / "a.tar")), 2)
    assert records == [{"__key__": "0", "json": {"caption": "a"}}]
    assert [(a.index, reason) for a, reason in skipped] == [(1, "duplicate_key")]
    with pytest.raises(BadRecordError, match="'caption' twice"):
        read_all(Dataset.from_path("t", str(tmp_path / "a.tar")), 2, on_error="raise")


def on_a_thread_with_stack(call, stack_bytes: int):
    """`call()`'s value, called on a new thread given `stack_bytes` of stack (0: the default), as a
    runner's pool thread with a small stack would call it."""
    import threading

    out, previous = [], threading.stack_size(stack_bytes)
    try:
        thread = threading.Thread(target=lambda: out.append(call()))
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    return out[0]


def test_json_nesting_gets_the_same_verdict_on_every_thread_and_stack(tmp_path):
    """How deep `json.loads` can nest depends on the stack it runs on: the thread (the loader's for
    the inline runner, a pool thread's, a worker process's), the frames below it, the Python build
    (~990 levels on 3.11, ~58,000 on 3.14t's main thread). Whether a record is read or skipped
    must not: every depth gets one verdict, up to the fixed limit read, past it `malformed_json`,
    under a deep call stack and in a thread with a small stack alike."""
    from zephon.io._policy import MAX_JSON_DEPTH

    depths = [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 900, 5_000, 100_000]
    lines = [b'{"a": ' + b"[" * (d - 1) + b"]" * (d - 1) + b"}" for d in depths]
    (tmp_path / "a.jsonl").write_bytes(lines_bytes(lines))
    ds = Dataset.from_path("d", str(tmp_path))
    chunk = Chunk("d", 0, 0, len(depths))

    def verdicts() -> list:
        return [(a.index, reason) for a, reason in ds.read_chunk(chunk).skipped]

    def under_frames(n: int) -> list:
        return verdicts() if n == 0 else under_frames(n - 1)

    expected = [(i, "malformed_json") for i in range(1, len(depths))]
    assert verdicts() == expected
    assert under_frames(500) == expected
    assert on_a_thread_with_stack(verdicts, 512 * 1024) == expected
    assert on_a_thread_with_stack(verdicts, 0) == expected


def test_a_line_that_is_not_json_is_malformed_even_where_an_object_in_it_names_a_key_twice(tmp_path):
    """A repeated key is a fault of a JSON text; a line that is no JSON text Python can hold (cut
    off, trailing data, an integer of over 4,300 digits, nested deeper than the fixed limit) is
    `malformed_json` whatever objects it holds. The decoder meets an object's repeated key as that
    object closes, before it has read the rest of the line, and how deep it gets before running
    out of stack depends on the build and thread: a repeated key deep inside a too-deep record was
    `duplicate_key` on 3.14t's main thread and `malformed_json` on 3.11."""
    from zephon.io._policy import MAX_JSON_DEPTH

    twice = b'{"k": 1, "k": 2}'
    lines = [b'{"text": "a", "text": "b"} trailing', b'{"text": "a", "text": "b"',
             b'[' + twice + b', ' + b"9" * 5_000 + b']']
    # the object naming a key twice is the d-th level: inside the outer object and d - 2 arrays
    lines += [b'{"a": ' + b"[" * (d - 2) + twice + b"]" * (d - 2) + b"}" for d in (MAX_JSON_DEPTH, 900, 5_000)]
    (tmp_path / "a.jsonl").write_bytes(lines_bytes(lines))
    ds = Dataset.from_path("d", str(tmp_path))
    chunk = Chunk("d", 0, 0, len(lines))

    def verdicts() -> list:
        return [(a.index, reason) for a, reason in ds.read_chunk(chunk).skipped]

    expected = [(i, "malformed_json") for i in range(len(lines))]
    expected[3] = (3, "duplicate_key")  # nested just to the limit: read, and its repeated key found
    assert verdicts() == expected
    assert on_a_thread_with_stack(verdicts, 512 * 1024) == expected


def test_parquet_value_python_cannot_hold_skips_its_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"t": ["a", "b", "c"], "ts": pa.array([0, 3 * 10**17, 1], pa.timestamp("us"))})
    pq.write_table(table, tmp_path / "a.parquet")
    records, skipped = read_all(Dataset.from_path("d", str(tmp_path)), 3)
    assert [r["t"] for r in records] == ["a", "c"]
    assert [(a.index, reason) for a, reason in skipped] == [(1, "unconvertible_value")]


_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A hang as the child exits (after its faulthandler has stopped) fails the test in minutes, with
# what the child wrote, not at pytest's 900 s timeout with nothing.
CHILD_EXIT_LIMIT_S = 300
_READ_WITHOUT_PANDAS = """
import faulthandler, importlib.abc, sys
faulthandler.dump_traceback_later(120, exit=True)  # a hang before the exit ends with its stacks on stderr
class NoPandas(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == "pandas":
            raise ImportError("pandas is not installed here")
sys.meta_path.insert(0, NoPandas())
from zephon.io import Dataset
ds = Dataset.from_path("d", sys.argv[1])
records, skipped = [], []
for chunk in ds.chunks(2):
    out = ds.read_chunk(chunk)
    records += out.records
    skipped += [(a.index, reason) for a, reason in out.skipped]
print(repr((records, skipped)))
"""


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_dictionary_encoded_columns_read_as_their_values_nested_ones_and_nanoseconds_included(tmp_path, suffix):
    """A dictionary-encoded column (a pandas categorical, or one written so) reads as its values,
    which the read decodes before making them Python objects (`_arrow_rows._for_python`): in a
    struct and a list too, and a dictionary of nanosecond timestamps by the microsecond rule (its
    row with a part below a microsecond `unconvertible_value`)."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    def encoded(values, kind=None):
        return pa.array(values, kind).dictionary_encode()

    ns = 1_700_000_000 * 10**9
    table = pa.table({
        "source": encoded(["kjv", "jargon", "kjv", "kjv", "jargon", None]),
        "n": encoded([1, 2, 3, 1, 2, 3]),
        "meta": pa.StructArray.from_arrays([encoded(["a", "b", "a", "b", "a", "b"])], ["tag"]),
        "tags": pa.ListArray.from_arrays(pa.array([0, 1, 1, 2, 3, 5, 6]), encoded(["x", "y", "x", "y", "y", "x"])),
        "ts": encoded([ns, ns, ns, ns, ns + 1, ns], pa.timestamp("ns")),
    })
    if suffix == ".parquet":
        pq.write_table(table, tmp_path / "a.parquet", row_group_size=4)
    else:
        with pa.ipc.new_stream(str(tmp_path / "a.arrow"), table.schema) as writer:
            writer.write_table(table, max_chunksize=4)
    records, skipped = read_all(Dataset.from_path("d", str(tmp_path)), 2)
    moment = datetime.datetime(2023, 11, 14, 22, 13, 20)
    assert records == [
        {"source": "kjv", "n": 1, "meta": {"tag": "a"}, "tags": ["x"], "ts": moment},
        {"source": "jargon", "n": 2, "meta": {"tag": "b"}, "tags": [], "ts": moment},
        {"source": "kjv", "n": 3, "meta": {"tag": "a"}, "tags": ["y"], "ts": moment},
        {"source": "kjv", "n": 1, "meta": {"tag": "b"}, "tags": ["x"], "ts": moment},
        {"source": None, "n": 3, "meta": {"tag": "b"}, "tags": ["x"], "ts": moment},
    ]
    assert all(type(record["source"]) in (str, type(None)) for record in records)
    assert [(a.index, reason) for a, reason in skipped] == [(4, "unconvertible_value")]


def test_parquet_nanosecond_values_read_the_same_whether_or_not_pandas_is_installed(tmp_path):
    """pyarrow turns a nanosecond timestamp or duration into a pandas object when pandas can be
    imported, and refuses one with a part below a microsecond otherwise: a row was kept (holding a
    `pd.Timestamp`) where pandas was installed, as in the 3.11 test environment, and skipped as
    `unconvertible_value` where it was not, as in the 3.14t one, so the ledger and the batches
    depended on an optional package. A nanosecond time of day lost its part below a microsecond
    unsaid. Now each is a standard-library value, or its row is `unconvertible_value`."""
    import datetime
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    ns = 1_700_000_000 * 10**9
    table = pa.table({
        "text": ["whole", "stamp", "span", "time", "nested", "aware"],
        "ts": pa.array([ns, ns + 1, ns, ns, ns, ns], pa.timestamp("ns")),
        "span": pa.array([1000, 1000, 7, 1000, 1000, 1000], pa.duration("ns")),
        "at": pa.array([2000, 2000, 2000, 2001, 2000, 2000], pa.time64("ns")),
        "many": pa.array([[ns], [ns], [ns], [ns], [ns, ns + 5], [ns]], pa.list_(pa.timestamp("ns"))),
        "utc": pa.array([ns, ns, ns, ns, ns, ns + 999], pa.timestamp("ns", "UTC")),
    })
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=4)
    records, skipped = read_all(Dataset.from_path("d", str(tmp_path)), 2)
    moment = datetime.datetime(2023, 11, 14, 22, 13, 20)
    assert records == [{"text": "whole", "ts": moment, "span": datetime.timedelta(microseconds=1),
                        "at": datetime.time(0, 0, 0, 2), "many": [moment],
                        "utc": moment.replace(tzinfo=datetime.timezone.utc)}]
    assert all(type(v) in (str, datetime.datetime, datetime.timedelta, datetime.time, list) for v in records[0].values())
    assert [(a.index, reason) for a, reason in skipped] == [(i, "unconvertible_value") for i in range(1, 6)]
    try:
        without_pandas = subprocess.run([sys.executable, "-c", _READ_WITHOUT_PANDAS, str(tmp_path)],
                                        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _REPO_ROOT},
                                        timeout=CHILD_EXIT_LIMIT_S)
    except subprocess.TimeoutExpired as hung:  # its message names the command alone, not what the child wrote
        stdout, stderr = (b"" if out is None else out for out in (hung.stdout, hung.stderr))  # bytes, despite text=True
        pytest.fail(f"the pandas-free child did not exit in {CHILD_EXIT_LIMIT_S} s; stdout:\n"
                    f"{stdout.decode(errors='replace')}\nstderr:\n{stderr.decode(errors='replace')}")
    assert without_pandas.returncode == 0, without_pandas.stderr
    assert without_pandas.stdout.strip() == repr((records, [(a.index, reason) for a, reason in skipped]))


def test_a_parquet_read_calls_into_python_only_on_its_own_thread_so_an_exit_after_it_cannot_hang(tmp_path):
    """pyarrow's thread pools read a Python file through Python (each read of row groups, as it
    pre-buffers them) and free the bytes read from it there, some after `read_row_groups` has
    returned (18 times in 2,000 reads on 3.14t). CPython 3.14 hangs for ever a thread that enters
    Python as the interpreter exits, and the exit then waited for it for ever in pyarrow's pool
    shutdown, after faulthandler had stopped: the likely cause of the pandas-free child above
    hanging the 3.14t CI once. A read now reads and decodes on the thread that asked for it,
    which frees everything it read."""
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon.io._format import ShardFile
    from zephon.io._parquet import Parquet

    python_ran_on = set()

    class Read(bytes):
        def __del__(self):
            python_ran_on.add(threading.get_ident())

    class Traced(io.FileIO):
        def read(self, size=-1):
            python_ran_on.add(threading.get_ident())
            return Read(super().read(size))

        def seek(self, *args):
            python_ran_on.add(threading.get_ident())
            return super().seek(*args)

    class Files:
        protocol = "file"  # local files, opened with no fsspec options

        def open(self, path, mode="rb"):
            return Traced(path, mode)

    table = pa.table({"text": [f"t{i}" for i in range(400)], "n": list(range(400)), "l": [[i, i] for i in range(400)]})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=50)
    shard = ShardFile(str(tmp_path / "a.parquet"), str(tmp_path / "a.parquet"), None, Files())
    for _ in range(20):
        assert Parquet().scan(shard).num_records == 400
        for start in range(0, 400, 100):
            assert Parquet().read(shard, None, start, start + 100) == table.slice(start, 100).to_pylist()
    assert python_ran_on == {threading.get_ident()}


_READ_EVERY_CHUNK = """
import sys
from zephon.io import Dataset, ShardUnavailableError
dataset = Dataset.from_path("d", sys.argv[1], retry_delay=0)
for chunk in dataset.chunks(2):
    try:
        print(len(dataset.read_chunk(chunk).records))
    except ShardUnavailableError as refused:
        print(type(refused).__name__)
"""


def test_a_parquet_file_whose_column_statistics_are_corrupt_is_refused_without_aborting_the_process(tmp_path):
    """One byte of the footer's size statistics changed: pyarrow (26) parses the footer, then
    aborts the process (`terminate called`, an uncaught C++ exception) when Python asks for that
    column chunk's metadata, which the reader did to find the row groups' bytes. Its own read of
    the row group raises an OSError: the file is now read without asking, and the training job
    gets a ShardUnavailableError naming the shard where it lost its process (found by
    tests/fuzz/test_fuzz_readers.py, which aborted a 3.14t run)."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.table({"id": [[7], None, [9, 8, 1], [], [6, 5, 5], [4]]}), sink, row_group_size=2)
    data = bytearray(sink.getvalue())
    data[782] = 249  # the repetition level histogram of the last row group's column: 4 entries for 2
    shard = tmp_path / "corrupt.parquet"
    shard.write_bytes(bytes(data))
    asks = "import pyarrow.parquet as pq, sys; m = pq.read_metadata(sys.argv[1]); m.row_group(2).column(0)"
    premise = subprocess.run([sys.executable, "-c", asks, str(shard)], capture_output=True, text=True, timeout=60)
    assert premise.returncode != 0 and "histogram size mismatch" in premise.stderr, "pyarrow no longer aborts here"
    done = subprocess.run([sys.executable, "-c", _READ_EVERY_CHUNK, str(shard)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2", "ShardUnavailableError"]


def test_parquet_rows_of_a_file_that_repeats_a_column_name_are_skipped_not_read_with_one_value_dropped(tmp_path):
    """pyarrow writes such a file; its rows as dicts kept the last `text` and lost the first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_arrays([pa.array(["a", "b"]), pa.array(["x", "y"]), pa.array([1, 2])], ["text", "text", "n"])
    pq.write_table(table, tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["c"], "n": [3]}), tmp_path / "b.parquet")
    records, skipped = read_all(Dataset.from_path("d", str(tmp_path)), 3)
    assert records == [{"text": "c", "n": 3}]
    assert [(a.index, reason) for a, reason in skipped] == [(0, "duplicate_column"), (1, "duplicate_column")]


def test_every_bad_record_reason_is_a_public_name_of_zephon_io():
    """`zephon.io` exports each reason its readers report under the constant's name, so a caller
    can match `BadRecordError.reason` without spelling the string (duplicate_column was missing)."""
    import zephon.io

    constants = [name for name in zephon.io.__all__ if name.isupper() and name not in ("REASONS", "FORMATS")]
    exported = {getattr(zephon.io, name) for name in constants}
    assert exported == zephon.io.REASONS


@pytest.mark.parametrize("compression", [None, "gz"])
def test_a_byte_order_mark_opening_a_shard_is_not_part_of_its_first_record(tmp_path, compression):
    bom = b"\xef\xbb\xbf"
    suffix = "" if compression is None else f".{compression}"
    (tmp_path / f"a.jsonl{suffix}").write_bytes(compress(bom + b'{"a": 1}\n{"a": 2}\n', compression))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / f"a.txt{suffix}").write_bytes(compress(bom + "héllo\nworld\n".encode(), compression))
    assert read_all(Dataset.from_path("d", str(tmp_path / f"a.jsonl{suffix}")), 1) == ([{"a": 1}, {"a": 2}], [])
    assert read_all(Dataset.from_path("t", str(tmp_path / "t")), 1)[0] == [{"text": "héllo"}, {"text": "world"}]
    file_unit = Dataset.from_path("f", str(tmp_path / "t"), text_unit="file")
    assert read_all(file_unit, 1)[0] == [{"text": "héllo\nworld\n"}]


def test_a_byte_order_mark_inside_a_shard_is_named_in_its_line_s_malformed_json_detail(tmp_path):
    """A BOM opening a line other than the shard's first (files joined by `cat`, one saved by a
    Windows editor) makes that line `malformed_json`; the detail says so, as `json.loads` did
    ("Unexpected UTF-8 BOM"), not "Expecting value" at column 1 of a line that reads as JSON."""
    (tmp_path / "a.jsonl").write_bytes(b'{"a": 1}\n\xef\xbb\xbf{"a": 2}\n')
    with pytest.raises(BadRecordError, match=r"\(malformed_json\): .*BOM"):
        read_all(Dataset.from_path("d", str(tmp_path / "a.jsonl")), 2, on_error="raise")


def test_a_byte_order_mark_opening_a_tar_txt_or_json_member_is_not_part_of_its_text(tmp_path):
    """`json.loads` refuses a str opening with a BOM: the whole sample was skipped as malformed_json."""
    bom = b"\xef\xbb\xbf"
    members = [("0.json", bom + b'{"w": 3}'), ("0.txt", bom + "héllo".encode()), ("0.jpg", bom + b"raw")]
    (tmp_path / "a.tar").write_bytes(tar_bytes(members))
    assert read_all(Dataset.from_path("d", str(tmp_path / "a.tar")), 1) == (
        [{"__key__": "0", "json": {"w": 3}, "txt": "héllo", "jpg": bom + b"raw"}], [])


def test_plain_lines_cut_inside_a_line_after_planning_hand_out_no_piece_of_it(tmp_path, storage_telling_no_version):
    lines = [f"sentence number {i}".encode() for i in range(40)]
    whole = lines_bytes(lines)
    for name, fmt in (("a.txt", "text"), ("a.jsonl", "jsonl")):
        path = tmp_path / fmt / name
        path.parent.mkdir()
        data = whole if fmt == "text" else jsonl_bytes([{"s": line.decode()} for line in lines])
        path.write_bytes(data)
        ds = Dataset.from_path("d", str(path.parent))
        cut = data.index(b"\n", len(data) // 3) + 12  # 12 bytes into a line well before the last 16
        path.write_bytes(data[:cut])
        kept = data[:cut].count(b"\n")
        for records_per_chunk in (1, 7, 16):  # chunks that end before the shard's last seek point
            records, skipped = read_all(ds, records_per_chunk)
            assert len(records) == kept and {reason for _, reason in skipped} == {"truncated_shard"}
            assert [a.index for a, _ in skipped] == list(range(kept, 40))


@pytest.mark.parametrize("records_per_chunk", [8, 40])
@pytest.mark.parametrize("fmt", ["text", "jsonl"])
def test_plain_lines_cut_inside_a_line_past_the_last_seek_point_hand_out_no_piece_of_it(
    tmp_path, storage_telling_no_version, fmt, records_per_chunk
):
    """A chunk that reads on to the end of the file took the piece of a line left by a cut after
    planning for a last line without a newline: handed out as a record (a text cut mid-line) or
    counted `malformed_json`, where a chunk ending before the last seek point counted it
    `truncated_shard`. The file is shorter than planned, so its unterminated tail is a cut line."""
    lines = [f"sentence number {i}" for i in range(40)]
    data = lines_bytes([line.encode() for line in lines]) if fmt == "text" else jsonl_bytes([{"s": s} for s in lines])
    path = tmp_path / ("a.txt" if fmt == "text" else "a.jsonl")
    path.write_bytes(data)
    ds = Dataset.from_path("d", str(tmp_path))
    cut = data.index(b"\n", data.index(b"sentence number 35")) - 5  # inside line 35, past seek point 32
    path.write_bytes(data[:cut])
    records, skipped = read_all(ds, records_per_chunk)
    assert len(records) == 35
    assert [(a.index, reason) for a, reason in skipped] == [(i, "truncated_shard") for i in range(35, 40)]


def test_a_line_spanning_many_blocks_is_not_copied_once_per_block(tmp_path, monkeypatch):
    """A line is read in blocks; copying what came so far at every block made a 200 MB line take
    15 s (quadratic). Counted in bytes allocated while each block is split, not in time."""
    line = b"".join(b"%07d," % i for i in range(1 << 19))  # 4 MiB: 64 blocks of 64 KiB
    (tmp_path / "a.txt").write_bytes(b"short\n" + line + b"\nlast\n")
    ds = Dataset.from_path("d", str(tmp_path / "a.txt"))
    allocated = []  # per block: the most memory the reader allocated before asking for the next one

    def measured_blocks(f):
        for block in raw_blocks(f, 1 << 16):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            yield block
            allocated.append(tracemalloc.get_traced_memory()[1] - before)

    monkeypatch.setattr(_lines, "raw_blocks", measured_blocks)
    tracemalloc.start()
    try:
        records = ds.read_chunk(ds.chunks(3)[0]).records
    finally:
        tracemalloc.stop()
    assert records == [{"text": "short"}, {"text": line.decode()}, {"text": "last"}]
    assert len(allocated) >= 64 and sum(allocated) < len(line)  # copied at every block: 31 times its size


_PLANNING_PEAK = """
import sys, tracemalloc
from zephon.io import Dataset
Dataset.from_path("warm-up", sys.argv[1])  # what planning imports on first use is no part of it
tracemalloc.start()
ds = Dataset.from_path("d", sys.argv[2])
print(ds.num_records, tracemalloc.get_traced_memory()[1])
"""


def test_planning_a_plain_line_shard_holds_under_a_mib_of_heap_whatever_its_size(tmp_path):
    """Planning counts lines on threads whose heaps keep what the count touched for the rest of the
    run (`_lines.SCAN_BLOCK_SIZE`): 1 MiB blocks and their newline masks held over 2 MiB at once.
    Measured in a process of its own: tracemalloc counts every thread's allocations, and a thread
    an earlier test left running (a loop of fsspec's, a runner closing) made it 1.5 MiB once."""
    import subprocess
    import sys

    record = json.dumps({"text": "x" * 4000}).encode()
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "a.jsonl").write_bytes(lines_bytes([record] * 1024))  # 4 MiB
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "a.jsonl").write_bytes(lines_bytes([record]))
    done = subprocess.run([sys.executable, "-c", _PLANNING_PEAK, str(tmp_path / "small"), str(tmp_path / "big")],
                          capture_output=True, text=True, timeout=120, check=True)
    records, peak = map(int, done.stdout.split())
    assert records == 1024
    assert peak < 1 << 20, peak  # 128 KiB blocks: 0.3 MiB on 3.11, 0.5-0.7 on 3.14t
