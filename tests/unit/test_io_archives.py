"""Shards inside an archive named by an fsspec chain (`tar://data::file://a.tar`, `zip://…`), read
on many threads at once (`zephon.io._shared_handles`)."""

from __future__ import annotations

import json
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from zephon.io import Dataset


def _shards(directory) -> None:
    directory.mkdir()
    for shard in range(8):
        lines = (json.dumps({"shard": shard, "i": i, "pad": "x" * (i % 97)}) for i in range(1_500))
        (directory / f"s{shard}.jsonl").write_text("\n".join(lines) + "\n")


def _archived(kind: str, tmp_path) -> str:
    plain = tmp_path / "plain"
    if kind == "tar":
        with tarfile.open(tmp_path / "a.tar", "w") as archive:
            archive.add(plain, arcname="data")
        return f"tar://data::file://{tmp_path / 'a.tar'}"
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as archive:
        for shard in sorted(plain.iterdir()):
            archive.write(shard, f"data/{shard.name}")
    return f"zip://data::file://{tmp_path / 'a.zip'}"


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_shards_in_an_archive_planned_and_read_on_many_threads_at_once_are_the_shards_themselves(kind, tmp_path):
    """fsspec's `tar://` reads every member through the archive's one file object, seeking it to
    the member and then reading: reads of two chunks on two threads interleaved those steps, and
    a chunk took another member's bytes (its records skipped as bad JSON, or other records) or
    failed with `tarfile.ReadError: unexpected end of data`. Planning counts
    the shards on many threads too. `zipfile` locks its reads but counts the members open without
    a lock: on 3.14t closing the archive after such reads failed its count's assertion."""
    _shards(tmp_path / "plain")
    plain = Dataset.from_path("d", str(tmp_path / "plain"))
    expected = [plain.read_chunk(chunk).records for chunk in plain.chunks(50)]
    url = _archived(kind, tmp_path)
    for _ in range(20):  # each try a new dataset, so planning races too
        ds = Dataset.from_path("d", url, retries=1)
        with ThreadPoolExecutor(16) as pool:
            chunks = list(pool.map(lambda chunk: ds.read_chunk(chunk, on_error="raise").records, ds.chunks(50)))
        assert chunks == expected
        ds._filesystems()[0].close()  # zipfile asserts it counted every member opened as closed
    assert [shard.num_records for shard in ds.shards] == [1_500] * 8
