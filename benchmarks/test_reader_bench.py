"""What reading a chunk costs in each format a corpus is commonly kept in, the same records each time.

The shipped corpus (both datasets, 3,496 records, 5.6 MB of text) written to a temporary directory
as JSON Lines (and compressed with zstd, one shard, which every chunk read decompresses from its
start; with gzip, one shard, read in a lane's seeded order from the resume points earlier rounds
noted, with none at each round's start, and with none at all, every read from its start; and in
zstd frames or gzip members of 1,000 lines
each, as pzstd and bgzip write many, which a chunk read enters at the one holding its first
line), as Parquet (row groups of 1,000 rows,
pyarrow's default compression, snappy; and in one row group, as `pyarrow.parquet.write_table` writes
up to 1,048,576 rows) and as an Arrow stream in record batches of 1,000 rows, as Hugging Face
`datasets`' `save_to_disk` writes it (and in one record batch, as a writer's `write_table` does with
a table of one chunk; and with a dictionary-encoded column more, each record's source, its
dictionary before the first batch or replaced at every batch, as pandas categoricals written a
frame at a time are); and as a WebDataset tar of one `.txt` member a record, plain, compressed whole
as one gzip stream (from resume points, and with them off), in gzip members of 64 KiB of tar, as
one zstd stream and in zstd frames of 64 KiB; and the JSON Lines and the tar in one zstd or gzip
stream read from the seekable copies planning keeps in its scan cache (`seekable_copies=True`), in
a seeded order too, each recording the copy's size beside the shard's. Each round reads every chunk of 128 records (the work sources' default) on
the calling thread, through `Dataset.read_chunk`, as a runner's worker does; "arrow, unvalidated" is
the same Arrow read with the full validation of each batch taken out (`_arrow._validate`), which is
what that validation costs. `extra_info` records records/s and MB/s of text; the ratios between the
rows are the measurement, not their absolute times. A last benchmark reads chunks of one Parquet
shard of 1,000,000 short rows in 1,000 row groups, whose footer each chunk read looks its row groups
up in.

    pytest benchmarks/test_reader_bench.py --benchmark-only
"""

from __future__ import annotations

import gzip
import io
import json
import random
import tarfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from zephon.io import Dataset, _arrow, _resume_points

DATA = Path(__file__).resolve().parents[1] / "zephon" / "data"
CHUNK = 128
BATCH_ROWS = 1000
ROUNDS = 5
DIRECTORY = {  # each kind of read, and the directory of the corpus it reads
    "jsonl": "jsonl",
    "jsonl.zst, one shard": "jsonl_zst",
    "jsonl.zst, one shard in frames": "jsonl_zst_frames",
    "jsonl.gz, one shard": "jsonl_gz",
    "jsonl.gz, one shard, no resume point yet": "jsonl_gz",
    "jsonl.gz, one shard, resume points off": "jsonl_gz",
    "jsonl.gz, one shard in members": "jsonl_gz_members",
    "jsonl.zst, one shard, seekable copy": "jsonl_zst",
    "jsonl.gz, one shard, seekable copy": "jsonl_gz",
    "parquet": "parquet",
    "parquet, one row group": "parquet_one_group",
    "arrow": "arrow",
    "arrow, unvalidated": "arrow",
    "arrow, one record batch": "arrow_one_batch",
    "arrow, a dictionary-encoded column": "arrow_dictionary",
    "arrow, a dictionary replaced at every batch": "arrow_dictionaries",
    "tar": "tar",
    "tar.gz, one shard": "tar_gz",
    "tar.gz, one shard, resume points off": "tar_gz",
    "tar.gz, one shard in members": "tar_gz_members",
    "tar.zst, one shard": "tar_zst",
    "tar.zst, one shard in frames": "tar_zst_frames",
    "tar.gz, one shard, seekable copy": "tar_gz",
    "tar.zst, one shard, seekable copy": "tar_zst",
}
TAR_PIECE = 1 << 16  # bytes of tar a gzip member or zstd frame holds, as bgzip's


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, int]:
    """A directory per format holding the shipped records, and their text's bytes."""
    records, sources = [], []
    for path in sorted((DATA / "kjv").glob("*.jsonl.zst")) + sorted((DATA / "jargon").glob("*.jsonl")):
        raw = path.read_bytes()
        if path.suffix == ".zst":
            raw = zstandard.ZstdDecompressor().stream_reader(raw).read()
        records += [json.loads(line) for line in raw.decode().splitlines() if line]
        sources += [path.parent.name] * (len(records) - len(sources))
    records = [{"id": r["id"], "text": r["text"]} for r in records]
    root = tmp_path_factory.mktemp("formats")
    for name in set(DIRECTORY.values()):
        (root / name).mkdir()
    lines = [(json.dumps(r) + "\n").encode() for r in records]
    (root / "jsonl" / "corpus.jsonl").write_bytes(b"".join(lines))
    (root / "jsonl_zst" / "corpus.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines)))
    (root / "jsonl_gz" / "corpus.jsonl.gz").write_bytes(gzip.compress(b"".join(lines)))
    pieces = [b"".join(lines[k:k + BATCH_ROWS]) for k in range(0, len(lines), BATCH_ROWS)]
    (root / "jsonl_zst_frames" / "corpus.jsonl.zst").write_bytes(
        b"".join(map(zstandard.ZstdCompressor().compress, pieces)))
    (root / "jsonl_gz_members" / "corpus.jsonl.gz").write_bytes(b"".join(map(gzip.compress, pieces)))
    table = pa.Table.from_pylist(records)
    pq.write_table(table, root / "parquet" / "corpus.parquet", row_group_size=BATCH_ROWS)
    pq.write_table(table, root / "parquet_one_group" / "corpus.parquet")
    with pa.ipc.new_stream(str(root / "arrow" / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=BATCH_ROWS)
    with pa.ipc.new_stream(str(root / "arrow_one_batch" / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table.combine_chunks())
    sourced = table.append_column("source", pa.array(sources).dictionary_encode())
    with pa.ipc.new_stream(str(root / "arrow_dictionary" / "data-00000-of-00001.arrow"), sourced.schema) as writer:
        writer.write_table(sourced, max_chunksize=BATCH_ROWS)
    with pa.ipc.new_stream(str(root / "arrow_dictionaries" / "data-00000-of-00001.arrow"), sourced.schema) as writer:
        for k in range(0, len(records), BATCH_ROWS):  # each batch's own dictionary, as pa.RecordBatch.from_pandas
            source = pa.array(sources[k:k + BATCH_ROWS]).dictionary_encode()
            writer.write_table(table.slice(k, BATCH_ROWS).append_column("source", source))
    tar = _tar_of(records)
    (root / "tar" / "corpus.tar").write_bytes(tar)
    (root / "tar_gz" / "corpus.tar.gz").write_bytes(gzip.compress(tar))
    tar_pieces = [tar[k:k + TAR_PIECE] for k in range(0, len(tar), TAR_PIECE)]
    (root / "tar_gz_members" / "corpus.tgz").write_bytes(b"".join(map(gzip.compress, tar_pieces)))
    (root / "tar_zst" / "corpus.tar.zst").write_bytes(zstandard.ZstdCompressor().compress(tar))
    (root / "tar_zst_frames" / "corpus.tzst").write_bytes(
        b"".join(map(zstandard.ZstdCompressor().compress, tar_pieces)))
    return root, sum(len(r["text"].encode()) for r in records)


def _tar_of(records: list[dict]) -> bytes:
    """The records as a WebDataset tar, each its text as one `<id>.txt` member."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w") as tar:
        for number, record in enumerate(records):
            text = record["text"].encode()
            info = tarfile.TarInfo(f"{number:06d}.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    return sink.getvalue()


@pytest.mark.parametrize("kind", list(DIRECTORY))
def test_reading_every_chunk(benchmark, record_build, corpus, monkeypatch, tmp_path, kind: str) -> None:
    root, text_bytes = corpus
    if kind == "arrow, unvalidated":
        monkeypatch.setattr(_arrow, "_validate", lambda batch: None)
    copies = {"scan_cache": tmp_path / "scans", "seekable_copies": True} if kind.endswith("seekable copy") else {}
    dataset = Dataset.from_path("corpus", str(root / DIRECTORY[kind]), **copies)
    chunks = dataset.chunks(CHUNK)
    forget = None
    if copies:  # what the copy costs on disk beside the shard
        shard, = (root / DIRECTORY[kind]).iterdir()
        record_build.update(copy_bytes=sum(p.stat().st_size for p in (tmp_path / "scans").glob("*/*.zst")),
                            shard_bytes=shard.stat().st_size)
    if copies or kind.startswith(("jsonl.gz, one shard", "tar.gz, one shard")):  # in a lane's seeded order
        chunks = random.Random(0).sample(chunks, len(chunks))
        _resume_points.resume_points.forget()  # no point left by an earlier kind
        if kind.endswith("no resume point yet"):
            forget = _resume_points.resume_points.forget
        if kind.endswith("resume points off"):  # every read from the shard's start, as before them
            monkeypatch.setattr(_resume_points, "key_of", lambda shard: None)

    records, mean = _read_in_rounds(benchmark, dataset, chunks, setup=forget)
    assert records == dataset.num_records == 3496
    record_build.update(records_per_s=round(records / mean), text_mb_per_s=round(text_bytes / mean / 1e6, 1))


def _read_in_rounds(benchmark, dataset: Dataset, chunks: list, setup=None) -> tuple[int, float]:
    """The records of `chunks`, read `ROUNDS` times after one warm-up round (`setup()` before each
    round, where given), and a round's mean seconds."""
    def read() -> int:
        return sum(len(dataset.read_chunk(chunk).records) for chunk in chunks)

    started = time.perf_counter()
    records = benchmark.pedantic(read, rounds=ROUNDS, iterations=1, warmup_rounds=1, setup=setup)
    mean = benchmark.stats.stats.mean if benchmark.stats else (time.perf_counter() - started) / (ROUNDS + 1)
    return records, mean


@pytest.fixture(scope="module")
def many_row_groups(tmp_path_factory) -> Path:
    """One Parquet shard of 1,000,000 short rows in 1,000 row groups (two columns, a 491 KB footer),
    as a corpus written in one file with `row_group_size=1000` is."""
    root = tmp_path_factory.mktemp("many-row-groups")
    rows = 1_000_000
    table = pa.table({"id": pa.array(range(rows)), "text": [("word%d " % (i % 1000)) * 20 for i in range(rows)]})
    pq.write_table(table, root / "corpus.parquet", row_group_size=BATCH_ROWS)
    return root


def test_reading_chunks_of_a_parquet_shard_of_many_row_groups(benchmark, record_build, many_row_groups) -> None:
    """Every 20th chunk of 128 rows (391 reads, each finding its row group in the shard's footer)."""
    dataset = Dataset.from_path("corpus", str(many_row_groups))
    chunks = dataset.chunks(CHUNK)[::20]
    records, mean = _read_in_rounds(benchmark, dataset, chunks)
    assert records == len(chunks) * CHUNK
    record_build.update(records_per_s=round(records / mean), ms_per_chunk_read=round(mean / len(chunks) * 1e3, 3))
