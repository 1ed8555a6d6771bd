"""A directory of JSONL shards on a remote filesystem, read on many threads against its local copy,
and one of them rewritten after planning."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from zephon.io import Dataset, ShardUnavailableError


def write_shards(directory: Path) -> None:
    """Eight JSONL shards of 600 records into `directory`, made here."""
    directory.mkdir()
    for shard in range(8):
        lines = (json.dumps({"shard": shard, "i": i, "pad": "x" * (i % 97)}) for i in range(600))
        (directory / f"s{shard}.jsonl").write_text("\n".join(lines) + "\n")


def assert_read_on_many_threads_as_local(url: str, local: Path, **options) -> Dataset:
    """Plan the dataset at `url` and read its chunks on eight threads at once: the records are
    those of its local copy `local`. Returns the dataset."""
    plain = Dataset.from_path("d", str(local))
    expected = [plain.read_chunk(chunk).records for chunk in plain.chunks(50)]
    ds = Dataset.from_path("d", url, retries=1, **options)
    with ThreadPoolExecutor(8) as pool:
        chunks = list(pool.map(lambda chunk: ds.read_chunk(chunk, on_error="raise").records, ds.chunks(50)))
    assert chunks == expected
    return ds


def assert_rewrite_refused(url: str, local: Path, **options) -> None:
    """Plan the dataset at `url` (served from `local`), rewrite one shard with as many bytes and a
    modification time 100 s later, and read a chunk of it: refused as changed after planning, not
    its new records handed out under the planned addresses."""
    ds = Dataset.from_path("d", url, retry_delay=0, **options)
    shard = local / "s3.jsonl"
    before = shard.stat()
    shard.write_bytes(shard.read_bytes().replace(b'"shard": 3', b'"shard": 9'))
    os.utime(shard, (before.st_atime, before.st_mtime + 100))
    chunk = next(chunk for chunk in ds.chunks(100) if ds.shards[chunk.shard].url.endswith("/s3.jsonl"))
    with pytest.raises(ShardUnavailableError, match="changed after planning"):
        ds.read_chunk(chunk, on_error="raise")
