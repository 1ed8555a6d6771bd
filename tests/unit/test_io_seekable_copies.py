"""`Dataset.from_path(..., scan_cache=DIR, seekable_copies=True)`: a JSON Lines, text or WebDataset
tar shard written as one gzip or zstd stream is copied in zstd frames into DIR while planning counts
it, and its chunk reads enter the copy at the frame before their records, reading what the shard
holds."""

from __future__ import annotations

import errno
import gzip
import io
import logging
import os
import random
import tarfile
from array import array

import pytest
import zstandard

from zephon import ConfigurationError
from zephon.io import Dataset, _compression, _decompressed_view, _jsonl, _lines, _seekable_copy

from .conftest_io import read_all

_FRAME = 4096  # bytes of text a frame of the copies holds here: a shard of ~140 KB makes ~35
_LINES = 1500

_COMPRESS = {"zst": zstandard.ZstdCompressor().compress, "gz": gzip.compress}


@pytest.fixture(autouse=True)
def small_frames(monkeypatch):
    monkeypatch.setattr(_seekable_copy, "COPY_FRAME_BYTES", _FRAME)


def _text(lines: int = _LINES, seed: int = 0) -> bytes:
    """JSON Lines of 20 to 180 characters of text each, no two alike."""
    rng = random.Random(seed)
    return b"".join(b'{"text": "%d %s"}\n' % (i, b"x" * rng.randrange(20, 180)) for i in range(lines))


def _shard(tmp_path, data: bytes, suffix: str, format: str = "jsonl") -> str:
    """`data` as one stream in the one shard (`part.jsonl.zst`, `part.txt.gz`, ...) of a new
    dataset directory; the directory."""
    root = tmp_path / "data"
    root.mkdir()
    (root / f"part.{'txt' if format == 'text' else 'jsonl'}.{suffix}").write_bytes(_COMPRESS[suffix](data))
    return str(root)


def _copies(scans) -> list[str]:
    return sorted(str(path.relative_to(scans)) for path in scans.glob("*/*.zst*"))


def _in_any_order(ds: Dataset, records_per_chunk: int) -> list[dict]:
    """Every record of `ds`, its chunks read in a shuffled order and put back in order."""
    chunks = ds.chunks(records_per_chunk)
    order = list(range(len(chunks)))
    random.Random(records_per_chunk).shuffle(order)
    read = {k: ds.read_chunk(chunks[k]).records for k in order}
    return [record for k in range(len(chunks)) for record in read[k]]


@pytest.mark.parametrize("suffix", ["zst", "gz"])
@pytest.mark.parametrize("format", ["jsonl", "text"])
def test_a_shard_in_one_stream_is_read_from_its_copy_as_the_shard_itself_reads(tmp_path, suffix, format):
    root = _shard(tmp_path, _text(), suffix, format)
    scans = tmp_path / "scans"
    plain = Dataset.from_path("d", root)
    copied = Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True)
    assert len(_copies(scans)) == 1 and copied._access[0].copy == str(scans / _copies(scans)[0])
    assert plain.shards == copied.shards and copied._access[0].seek.shape[0] == 3
    expected, _ = read_all(plain, 1000)
    assert len(expected) == _LINES
    for shard in os.listdir(root):  # its reads go to the copy alone
        os.unlink(os.path.join(root, shard))
    for records_per_chunk in (1, 7, 100, _LINES):
        assert _in_any_order(copied, records_per_chunk) == expected


def test_a_chunk_read_from_a_copy_decompresses_a_frame_at_most_before_its_lines(tmp_path, monkeypatch):
    copied = Dataset.from_path("d", _shard(tmp_path, _text(), "zst"), scan_cache=tmp_path / "scans",
                               seekable_copies=True)
    decompressed = []
    blocks_of = _lines.decompressed_blocks

    def counting(f, compression, frame_starts=None):
        for block in blocks_of(f, compression, frame_starts):
            decompressed.append(len(block))
            yield block

    monkeypatch.setattr(_lines, "decompressed_blocks", counting)
    last = copied.chunks(10)[-1]
    assert len(copied.read_chunk(last).records) == 10
    text_of_chunk = int(copied._access[0].record_offsets[-1] - copied._access[0].record_offsets[last.start])
    assert 0 < sum(decompressed) <= 2 * _FRAME + text_of_chunk  # a frame before, the block past its end


def test_a_second_planning_takes_the_copy_from_the_scan_cache_without_reading_the_shard(tmp_path, monkeypatch):
    root, scans = _shard(tmp_path, _text(), "zst"), tmp_path / "scans"
    first = Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True)

    def no_scan(self, shard):
        raise AssertionError(f"{shard.url} scanned again")

    monkeypatch.setattr(_jsonl.JsonLines, "scan", no_scan)
    again = Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True)
    assert again._access[0].copy == first._access[0].copy
    assert (again._access[0].seek == first._access[0].seek).all()
    assert read_all(again, 64) == read_all(first, 64)


@pytest.mark.parametrize("damage", ["removed", "cut", "grown"])
def test_an_entry_whose_copy_is_gone_or_of_another_size_is_scanned_again_and_its_copy_made_again(
        tmp_path, caplog, damage):
    root, scans = _shard(tmp_path, _text(), "zst"), tmp_path / "scans"
    expected = read_all(Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True), 64)
    copy = scans / _copies(scans)[0]
    whole = copy.read_bytes()
    if damage == "removed":
        copy.unlink()
    else:
        copy.write_bytes(whole[:-100] if damage == "cut" else whole + b"\0")
    with caplog.at_level(logging.WARNING, logger="zephon"):
        again = Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True)
    assert "could not be trusted" in caplog.text and "seekable copy" in caplog.text
    assert copy.read_bytes() == whole
    assert read_all(again, 64) == expected


@pytest.mark.parametrize("kind", ["frames", "cut", "small", "uncompressed"])
def test_no_copy_is_kept_of_a_shard_in_frames_cut_short_small_or_uncompressed(tmp_path, kind):
    """A shard in frames has entry points of its own; one cut short is read from itself, its tail
    truncated; one within a frame of the copy has nothing to skip; an uncompressed one is seeked."""
    data = _text()
    root = tmp_path / "data"
    root.mkdir()
    compress = _COMPRESS["zst"]
    shard = {
        "frames": lambda: compress(data[:60000]) + compress(data[60000:]),
        "cut": lambda: compress(data)[:-50],
        "small": lambda: compress(data[:3000]),
        "uncompressed": lambda: data,
    }[kind]()
    (root / ("part.jsonl" if kind == "uncompressed" else "part.jsonl.zst")).write_bytes(shard)
    scans = tmp_path / "scans"
    copied = Dataset.from_path("d", str(root), scan_cache=scans, seekable_copies=True)
    assert copied._access[0].copy is None and _copies(scans) == []
    assert read_all(copied, 64) == read_all(Dataset.from_path("d", str(root)), 64)
    if kind == "cut":
        assert read_all(copied, 64)[1][-1][1] == "truncated_shard"


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
def test_a_copy_gone_while_reading_is_read_from_the_shard_itself_said_once(tmp_path, caplog, kind):
    """A tar's own seek is the copy's points, each entered at the stream's start (`stream_seek`)."""
    root = _shard(tmp_path, _text(), "gz") if kind == "jsonl" else _tar_shard(tmp_path, _tar(), "gz")
    copied = Dataset.from_path("d", root, scan_cache=tmp_path / "scans", seekable_copies=True)
    expected, _ = read_all(copied, 16)
    os.unlink(copied._access[0].copy)
    with caplog.at_level(logging.WARNING, logger="zephon"):
        assert _in_any_order(copied, 16) == expected
    gone = [r for r in caplog.records if "seekable copy" in r.getMessage()]
    assert len(gone) == 1 and "is gone" in gone[0].getMessage()


def test_storing_a_shard_s_new_version_removes_its_old_copy(tmp_path):
    root, scans = _shard(tmp_path, _text(), "zst"), tmp_path / "scans"
    Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True)
    old = _copies(scans)
    with open(os.path.join(root, "part.jsonl.zst"), "wb") as f:
        f.write(_COMPRESS["zst"](_text(seed=1)))
    new = Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True)
    assert len(_copies(scans)) == 1 and _copies(scans) != old
    assert read_all(new, 64) == read_all(Dataset.from_path("d", root), 64)


def test_planning_with_copies_does_not_warn_of_decompressing_each_chunk_s_shard_from_its_start(tmp_path):
    root = _shard(tmp_path, _text(), "zst")
    assert "seekable_copies=True" in Dataset.from_path("d", root).wasteful_decoding(10)
    copied = Dataset.from_path("d", root, scan_cache=tmp_path / "scans", seekable_copies=True)
    assert copied.wasteful_decoding(10) is None


def test_a_disk_too_full_for_a_copy_is_a_configuration_error_naming_the_scan_cache(tmp_path, monkeypatch):
    root, scans = _shard(tmp_path, _text(), "zst"), tmp_path / "scans"

    class FullFile:
        def __init__(self, path, mode):
            self.file = open(path, mode)

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            self.file.close()

    monkeypatch.setattr(_seekable_copy, "open", FullFile, raising=False)
    with pytest.raises(ConfigurationError, match=f"scan cache directory {scans} cannot be written .*ENOSPC"):
        Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True)
    assert _copies(scans) == [] and not list(scans.glob("*/*.npz"))


@pytest.mark.parametrize("options, said", [
    ({"seekable_copies": True}, "give scan_cache=DIR too"),
    ({"seekable_copies": "yes", "scan_cache": "x"}, "must be True or False"),
])
def test_seekable_copies_are_asked_with_a_scan_cache_and_a_bool(tmp_path, options, said):
    with pytest.raises(ConfigurationError, match=said):
        Dataset.from_path("d", _shard(tmp_path, _text(50), "zst"), **options)


def _tar(records: int = 300, seed: int = 0) -> bytes:
    """A WebDataset tar of `records` records, each a `.txt` and a `.bin` member of 20 to 900 bytes."""
    rng = random.Random(seed)
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w") as tar:
        for number in range(records):
            for extension in ("txt", "bin"):
                payload = (b"%d " % number) + bytes(rng.randrange(97, 123) for _ in range(rng.randrange(20, 900)))
                info = tarfile.TarInfo(f"{number:05d}.{extension}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return sink.getvalue()


def _tar_shard(tmp_path, data: bytes, suffix: str) -> str:
    root = tmp_path / "tars"
    root.mkdir()
    (root / f"part.tar.{suffix}").write_bytes(_COMPRESS[suffix](data))
    return str(root)


@pytest.mark.parametrize("suffix", ["zst", "gz"])
def test_a_tar_in_one_stream_is_read_from_its_copy_as_the_plain_tar_reads(tmp_path, suffix):
    data = _tar()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "part.tar").write_bytes(data)
    expected, _ = read_all(Dataset.from_path("d", str(tmp_path / "plain")), 1000)
    root, scans = _tar_shard(tmp_path, data, suffix), tmp_path / "scans"
    copied = Dataset.from_path("d", root, scan_cache=scans, seekable_copies=True)
    assert len(_copies(scans)) == 1 and copied._access[0].copy is not None
    assert copied.wasteful_decoding(4) is None
    assert "seekable_copies=True" in Dataset.from_path("d", root).wasteful_decoding(4)
    os.unlink(os.path.join(root, f"part.tar.{suffix}"))  # its reads go to the copy alone
    for records_per_chunk in (1, 7, 100):
        assert _in_any_order(copied, records_per_chunk) == expected


@pytest.mark.parametrize("kind", ["members", "cut"])
def test_no_copy_is_kept_of_a_tar_in_members_or_cut_short(tmp_path, kind):
    data = _tar()
    stored = (b"".join(gzip.compress(data[at:at + 30000]) for at in range(0, len(data), 30000)) if kind == "members"
              else gzip.compress(data)[:-300])
    root = tmp_path / "tars"
    root.mkdir()
    (root / "part.tar.gz").write_bytes(stored)
    scans = tmp_path / "scans"
    copied = Dataset.from_path("d", str(root), scan_cache=scans, seekable_copies=True)
    assert copied._access[0].copy is None and _copies(scans) == []
    assert read_all(copied, 16) == read_all(Dataset.from_path("d", str(root)), 16)



def test_a_copy_written_from_a_view_sent_back_to_its_start_holds_each_byte_once(tmp_path, monkeypatch):
    """Planning a tar copies what its view decompresses (`_decompressed_view`); a seek back past
    what the view keeps starts the stream again, and what is decompressed twice is copied once."""
    monkeypatch.setattr(_compression, "_COMPRESSED_BLOCK_SIZE", 1024)  # blocks of ~2 KB: the view keeps 64 KiB
    rng = random.Random(1)
    data = b" ".join(b"%d" % rng.randrange(10**9) for _ in range(40_000))
    copy = _seekable_copy.FramedCopy(str(tmp_path / "copy.zst"))
    view = _decompressed_view.DecompressedView(io.BytesIO(gzip.compress(data)), "gzip", frame_starts=array("q"),
                                               copy=copy)
    assert view.read(200_000) == data[:200_000]
    started = []
    monkeypatch.setattr(view, "_start", lambda target, start=view._start: started.append(target) or start(target))
    view.seek(10)  # further back than the view keeps: decompressed again from the start
    assert view.read() == data[10:] and started == [10]
    copy.finish()
    with open(copy.path, "rb") as f:
        assert zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True).read() == data
