"""Storage: vanished and flaky shards, Hugging Face URLs and the local-disk cache."""

from __future__ import annotations

import base64
import errno
import fcntl
import gc
import gzip
import io
import json
import logging
import multiprocessing
import os
import pathlib
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
import types
import uuid
import weakref

import fsspec
import httpx2
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zephon import ConfigurationError
from zephon.io import Dataset, ShardUnavailableError, UnsizedShardError
from zephon.io import _atomic_cache, _dataset, _retry, _storage, _version
from zephon.io._format import ShardFile

from tests.reliability.harness import checkpoint_after, clean_records, jsonl_dataset, run_epoch, text_pipeline

from .conftest_io import (
    _PrefixedMemoryFileSystem,
    FakeHubFileSystem,
    FlakyFileSystem,
    ListingKeepingStore,
    ObjectStoreFileSystem,
    arrow_bytes,
    jsonl_bytes,
    memory_root,
    parquet_bytes,
    put,
    registered,
    serving_over_http,
    tar_bytes,
)


@pytest.fixture
def flaky():
    with registered(FlakyFileSystem) as cls:
        cls.failures = cls.listing_failures = cls.ls_failures = cls.opens = cls.infos = 0
        cls.error, cls.ls_failing = ConnectionResetError, None
        put("flaky://bucket/a.jsonl", jsonl_bytes([{"i": i} for i in range(5)]))
        yield cls


@pytest.fixture
def object_store():
    with registered(ObjectStoreFileSystem) as cls:
        cls.read_delay_s, cls.failing_reads, cls.reads_before_failing = 0.0, 0, 0
        yield cls


@pytest.fixture
def hub():
    with registered(FakeHubFileSystem) as cls:
        yield cls


def test_shard_that_vanished_after_planning_raises_naming_its_url():
    root = memory_root()
    url = put(f"{root}/a.jsonl", jsonl_bytes([{"i": 1}]))
    ds = Dataset.from_path("d", root, retry_delay=0)
    fsspec.filesystem("memory").rm(url)
    with pytest.raises(ShardUnavailableError) as caught:
        ds.read_chunk(ds.chunks(1)[0])
    assert caught.value.url == ds.shards[0].url
    assert ds.shards[0].url in str(caught.value) and "3 attempt" in str(caught.value)


@pytest.mark.parametrize("shard_format", ["jsonl", "parquet", "arrow"])
def test_a_shard_grown_after_planning_raises_naming_it_instead_of_handing_out_other_records(shard_format):
    """A shard regenerated in place with longer records was read at its planned offsets: a JSON
    Lines chunk began inside a line and handed out later lines under earlier addresses, a
    Parquet chunk handed out the new file's rows, with no error."""
    root = memory_root()
    write = {"jsonl": jsonl_bytes, "parquet": lambda rows: parquet_bytes(rows, row_group_size=8),
             "arrow": lambda rows: arrow_bytes(pa.Table.from_pylist(rows), [8] * 8)}[shard_format]
    url = put(f"{root}/a.{shard_format}", write([{"i": i} for i in range(64)]))
    ds = Dataset.from_path("d", root, retry_delay=0)
    put(url, write([{"i": i, "pad": "x" * 40} for i in range(64)]))
    with pytest.raises(ShardUnavailableError, match="changed after planning") as caught:
        ds.read_chunk(ds.chunks(16)[1])
    assert caught.value.url == ds.shards[0].url and caught.value.attempts == 1


def _same_size_rewrites(shard_format: str) -> tuple[bytes, bytes]:
    """A shard's bytes when planned and after it is regenerated in place: other records, as many
    bytes (Parquet uncompressed, so that its strings of one length give files of one length)."""
    def parquet(word: str) -> bytes:
        sink = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([{"s": f"{word} {i:03d}"} for i in range(64)]), sink,
                       row_group_size=8, compression="NONE")
        return sink.getvalue()

    planned, rewritten = {
        "jsonl": lambda: (jsonl_bytes([{"s": f"old {i:03d}"} for i in range(64)]),
                          jsonl_bytes([{"s": f"new {i:03d}"} for i in range(64)])),
        "text": lambda: (b"".join(b"old line %03d\n" % i for i in range(64)),
                         b"".join(b"new %03d\nline\n" % i for i in range(64))),
        "parquet": lambda: (parquet("old"), parquet("new")),
        "arrow": lambda: (arrow_bytes(pa.Table.from_pylist([{"s": f"old {i:03d}"} for i in range(64)]), [8] * 8),
                          arrow_bytes(pa.Table.from_pylist([{"s": f"new {i:03d}"} for i in range(64)]), [8] * 8)),
        "webdataset": lambda: (tar_bytes([(f"{i:03d}.txt", b"old") for i in range(64)]),
                               tar_bytes([(f"{i:03d}.txt", b"new") for i in range(64)])),
    }[shard_format]()
    assert len(planned) == len(rewritten) and planned != rewritten
    return planned, rewritten


def _rewrite_keeping_size(path: pathlib.Path, data: bytes) -> None:
    """Write `data`, as long as the file, over it in place (same inode), a second later: two writes
    within the filesystem's timestamp granularity (a few milliseconds) may leave one mtime."""
    planned = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(planned.st_atime_ns, planned.st_mtime_ns + 10**9))


@pytest.mark.parametrize("shard_format", ["jsonl", "text", "parquet", "webdataset", "arrow"])
def test_a_local_shard_rewritten_after_planning_with_as_many_bytes_raises_naming_it_instead_of_handing_out_other_records(
    tmp_path, shard_format
):
    """Only a shard that grew was refused: one regenerated in place with as many bytes was read at
    the planned offsets, row groups or members, and handed out the new file's lines (or pieces of
    them), rows or members under the planned addresses, with no error."""
    planned, rewritten = _same_size_rewrites(shard_format)
    path = tmp_path / f"a.{ {'text': 'txt', 'webdataset': 'tar'}.get(shard_format, shard_format)}"
    path.write_bytes(planned)
    ds = Dataset.from_path("d", str(tmp_path), retry_delay=0)
    assert ds.read_chunk(ds.chunks(16)[0]).records  # read as planned
    _rewrite_keeping_size(path, rewritten)
    with pytest.raises(ShardUnavailableError, match="changed after planning") as caught:
        ds.read_chunk(ds.chunks(16)[1])
    assert caught.value.url == str(path) and caught.value.attempts == 1


def test_a_local_shard_replaced_by_a_shorter_file_that_is_no_prefix_raises_instead_of_handing_out_its_lines(tmp_path):
    """A shorter file was taken for the planned one cut short: its lines were handed out under the
    planned addresses up to its end, the rest counted `truncated_shard`."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl_bytes([{"s": f"old {i:03d}"} for i in range(64)]))
    ds = Dataset.from_path("d", str(tmp_path), retry_delay=0)
    path.write_bytes(jsonl_bytes([{"s": f"new {i}"} for i in range(64)]))
    with pytest.raises(ShardUnavailableError, match="changed after planning"):
        ds.read_chunk(ds.chunks(16)[0])


@pytest.mark.parametrize("cache", [False, True])
def test_a_remote_shard_rewritten_after_planning_with_as_many_bytes_raises_naming_it(tmp_path, cache):
    """The same on a remote filesystem, whose `info()` gives the version (here the memory
    filesystem's creation time), with and without the local-disk cache: the cache copied the
    new version and the read handed out its records under the planned addresses."""
    planned, rewritten = _same_size_rewrites("jsonl")
    root = memory_root()
    url = put(f"{root}/a.jsonl", planned)
    ds = Dataset.from_path("d", root, retry_delay=0, cache={"enabled": cache, "dir": str(tmp_path / "cache")})
    put(url, rewritten)
    with pytest.raises(ShardUnavailableError, match="changed after planning") as caught:
        ds.read_chunk(ds.chunks(16)[1])
    assert caught.value.url == ds.shards[0].url and caught.value.attempts == 1


class _GenerationStore(_PrefixedMemoryFileSystem):
    """Tells versions as Google Cloud Storage does: `generation` changes with the content alone,
    `etag` with the object's metadata too (a label set, a content type changed)."""

    protocol = "genstore"
    store: dict = {}
    pseudo_dirs: list = [""]
    metadata_updates = 0

    def info(self, path, **kwargs):
        return self._described(super().info(path, **kwargs))

    def find(self, path, *args, **kwargs):
        found = super().find(path, *args, **kwargs)
        return {name: self._described(entry) for name, entry in found.items()} if kwargs.get("detail") else found

    @staticmethod
    def _described(info):
        """A file's details as GCS lists them and gives them from `info()`: with both fields."""
        if info["type"] != "file":
            return info
        created = info["created"] if isinstance(info["created"], float) else info["created"].timestamp()
        return {**info, "generation": int(created * 1e6), "etag": f"{created}-{_GenerationStore.metadata_updates}"}


def test_a_remote_shards_version_is_its_contents_so_a_metadata_update_does_not_fail_the_run():
    """Every content field `info()` gave was compared: a shard whose metadata changed after
    planning (GCS changes the etag, not the generation) failed the run as rewritten."""
    with registered(_GenerationStore) as store:
        records = [{"i": i} for i in range(8)]
        url = put("genstore://bucket/a.jsonl", jsonl_bytes(records))
        ds = Dataset.from_path("d", "genstore://bucket", retry_delay=0)
        store.metadata_updates += 1
        assert ds.read_chunk(ds.chunks(8)[0]).records == records
        time.sleep(0.001)  # a later creation time: another generation
        put(url, jsonl_bytes([{"i": 9 - i} for i in range(8)]))
        with pytest.raises(ShardUnavailableError, match="changed after planning"):
            ds.read_chunk(ds.chunks(8)[0])


def _info_calls_of_reading_the_first_chunk(ds: Dataset, monkeypatch) -> int:
    """How many times reading `ds`'s first 64-record chunk (all 64 records) asks the memory
    filesystem for a file's info."""
    asked = []
    info = fsspec.implementations.memory.MemoryFileSystem.info
    monkeypatch.setattr(fsspec.implementations.memory.MemoryFileSystem, "info",
                        lambda self, path, **kwargs: asked.append(path) or info(self, path, **kwargs))
    assert len(ds.read_chunk(ds.chunks(64)[0]).records) == 64
    return len(asked)


def test_a_local_plan_read_on_another_host_is_not_refused_for_its_files_modification_time(tmp_path, monkeypatch):
    """A local file's inode and mtime describe it on the host that planned: a Dataset pickled to
    another node reads that node's copy of the data, whose inode and mtime differ, and is not
    refused for them. On the host that planned, a file touched since planning is refused."""
    path = tmp_path / "a.jsonl"
    records = [{"s": f"record {i}"} for i in range(8)]
    path.write_bytes(jsonl_bytes(records))
    ds = pickle.loads(pickle.dumps(Dataset.from_path("d", str(tmp_path), retry_delay=0)))
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(ShardUnavailableError, match="changed after planning"):
        ds.read_chunk(ds.chunks(8)[0])
    monkeypatch.setattr(_version, "_this_host", lambda: "another-node")
    assert ds.read_chunk(ds.chunks(8)[0]).records == records


def test_a_shards_version_is_not_part_of_the_fingerprint_a_checkpoint_is_checked_by(tmp_path):
    """A checkpoint resumed on another node, or from a copy of the data, sees other modification
    times: resuming is judged by URLs, record counts and sizes, not refused for those."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl_bytes([{"s": f"record {i}"} for i in range(8)]))
    before = Dataset.from_path("d", str(tmp_path)).fingerprint()
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))
    assert Dataset.from_path("d", str(tmp_path)).fingerprint() == before


def test_flaky_storage_is_retried_until_it_answers(flaky):
    ds = Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001)
    flaky.failures, flaky.opens = 2, 0
    assert ds.read_chunk(ds.chunks(5)[0]).records == [{"i": i} for i in range(5)]
    assert flaky.opens == 3


class _FakeAiohttp(types.ModuleType):
    """aiohttp's client errors as fsspec's HTTPFileSystem lets them through (aiohttp is an extra,
    `zephon[http]`, which these tests do without): the hierarchy of aiohttp.client_exceptions, and
    a response error's status."""

    class ClientError(Exception):
        pass

    class ClientConnectionError(ClientError):
        pass

    class ServerDisconnectedError(ClientConnectionError):
        pass

    class ClientPayloadError(ClientError):
        pass

    class ClientResponseError(ClientError):
        def __init__(self, message: str, status: int) -> None:
            super().__init__(message)
            self.status = status


def _installed(monkeypatch, fake: types.ModuleType) -> types.ModuleType:
    """`fake` in sys.modules under its name for the test, where Zephon looks its errors up."""
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    return fake


@pytest.fixture
def aiohttp(monkeypatch):
    return _installed(monkeypatch, _FakeAiohttp("aiohttp"))


class _FakeGcsfsRetry(types.ModuleType):
    """gcsfs.retry's HttpError, which gcsfs raises for a status other than 403, 404, 412 and 502
    once its own six tries are spent (gcsfs is not installed here: its Google client needs grpcio,
    which has no wheel for 3.14t); `code` is the status."""

    class HttpError(Exception):
        def __init__(self, message: str, code: int) -> None:
            super().__init__(message)
            self.code = code


@pytest.fixture
def gcsfs_errors(monkeypatch):
    return _installed(monkeypatch, _FakeGcsfsRetry("gcsfs.retry"))


@pytest.mark.parametrize("error", [
    httpx2.ReadTimeout,
    httpx2.RemoteProtocolError,
    lambda message: _FakeAiohttp.ServerDisconnectedError(message),
    lambda message: _FakeAiohttp.ClientPayloadError(message),
    lambda message: _FakeAiohttp.ClientResponseError(message, status=503),
    lambda message: _FakeGcsfsRetry.HttpError(message, code=503),
    lambda message: _FakeGcsfsRetry.HttpError(message, code=429),
], ids=["httpx2-timeout", "httpx2-protocol", "aiohttp-disconnected", "aiohttp-payload", "aiohttp-503", "gcsfs-503",
        "gcsfs-429"])
def test_http_transport_errors_that_are_not_oserrors_are_retried(flaky, aiohttp, gcsfs_errors, error):
    """hf:// surfaces httpx2's errors once huggingface_hub's own backoff gives up, http(s)://
    surfaces aiohttp's as they are, and gs:// gcsfs's HttpError for a 5xx or 429 once its own
    tries are spent: none is an OSError, and each is as transient as one."""
    ds = Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001)
    flaky.failures, flaky.opens, flaky.error = 2, 0, error
    assert ds.read_chunk(ds.chunks(5)[0]).records == [{"i": i} for i in range(5)]
    assert flaky.opens == 3


@pytest.mark.parametrize("error", [
    ValueError,
    lambda message: _FakeAiohttp.ClientResponseError(message, status=403),
    lambda message: _FakeGcsfsRetry.HttpError(message, code=400),
], ids=["bug", "aiohttp-403", "gcsfs-400"])
def test_errors_that_reading_again_cannot_mend_surface_at_once(flaky, aiohttp, gcsfs_errors, error):
    ds = Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001)
    flaky.failures, flaky.opens, flaky.error = 2, 0, error
    with pytest.raises(Exception, match="flaky storage dropped") as caught:
        ds.read_chunk(ds.chunks(5)[0])
    assert not isinstance(caught.value, ShardUnavailableError) and flaky.opens == 1


def test_a_read_that_is_retried_logs_a_warning_naming_the_shard_the_error_and_the_attempt(flaky, caplog, monkeypatch):
    """A flaky store mended by a retry still costs the run its backoff: the trainer only saw the
    loader slow down (up to a minute a wait), with nothing in the log saying why."""
    monkeypatch.setattr(_retry, "_retry_log", _retry._RetryLog())
    ds = Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001)
    flaky.failures, flaky.opens = 2, 0
    with caplog.at_level(logging.WARNING, logger="zephon"):
        assert ds.read_chunk(ds.chunks(5)[0]).records == [{"i": i} for i in range(5)]
    retried = [r.getMessage() for r in caplog.records if r.name.startswith("zephon")]
    assert len(retried) == 2, retried
    for attempt, message in enumerate(retried, 1):
        assert "flaky://bucket" in message and "flaky storage dropped" in message, message
        assert f"attempt {attempt} of 3" in message, message


def test_retried_reads_are_logged_at_the_first_second_fourth_and_eighth_not_one_line_each(flaky, caplog, monkeypatch):
    """A store failing one read in ten over a multi-day job must not write a line per chunk."""
    monkeypatch.setattr(_retry, "_retry_log", _retry._RetryLog())
    ds = Dataset.from_path("d", "flaky://bucket", retries=2, retry_delay=0.001)
    chunk = ds.chunks(5)[0]
    with caplog.at_level(logging.WARNING, logger="zephon"):
        for _ in range(9):
            flaky.failures = 1
            assert ds.read_chunk(chunk).records == [{"i": i} for i in range(5)]
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("zephon")]
    assert [int(m.split("retried read ")[1].split()[0]) for m in logged] == [1, 2, 4, 8], logged


def test_a_retry_log_let_go_is_collected_not_kept_alive_for_forked_children():
    """Each retry log registered an `os.register_at_fork` handler of its own, holding it, and such a
    handler can never be removed: every log made (one per test that counts retries) stayed alive,
    and was renewed in every forked child, for the life of the process."""
    retry_log = _retry._RetryLog()
    gone = weakref.ref(retry_log)
    del retry_log
    gc.collect()
    assert gone() is None


def test_a_retried_read_on_one_rank_of_a_job_is_logged_naming_that_rank(flaky, caplog, monkeypatch):
    """Each rank reads its own lanes' shards: a flaky store seen by one rank of a thousand must say which."""
    monkeypatch.setattr(_retry, "_retry_log", _retry._RetryLog())
    monkeypatch.setenv("RANK", "517")
    ds = Dataset.from_path("d", "flaky://bucket", retries=2, retry_delay=0.001)
    flaky.failures = 1
    with caplog.at_level(logging.WARNING, logger="zephon"):
        ds.read_chunk(ds.chunks(5)[0])
    [logged] = [r.getMessage() for r in caplog.records if r.name.startswith("zephon")]
    assert logged.startswith("rank 517: reading flaky://bucket"), logged


def test_planning_is_retried_too(flaky):
    flaky.failures = 1
    assert Dataset.from_path("d", "flaky://bucket/a.jsonl", retry_delay=0.001).num_records == 5


def test_listing_a_dataset_is_retried_and_a_store_out_of_reach_is_named_with_the_dataset(flaky):
    """`hf://ORG/NAME/CONFIG/SPLIT` on a machine that cannot reach the hub: the listing's bare
    `httpx2.ConnectError: [Errno -2] Name or service not known` named neither the URL nor the
    dataset, and was not retried, though `from_path` retries storage errors."""
    flaky.error = httpx2.ConnectError
    flaky.listing_failures = 2
    assert Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001).num_records == 5
    flaky.listing_failures = 100
    with pytest.raises(ShardUnavailableError, match="flaky://bucket unavailable after 3 attempt") as caught:
        Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001)
    assert isinstance(caught.value.__cause__, httpx2.ConnectError)
    assert "while listing dataset 'd' at flaky://bucket" in caught.value.__notes__


def _eio(message: str) -> OSError:
    return OSError(errno.EIO, message)


@pytest.mark.parametrize("failing", ["listing_failures", "ls_failures"], ids=["info", "ls"])
@pytest.mark.parametrize("error", [ConnectionRefusedError, _eio], ids=["refused", "EIO"])
def test_a_store_out_of_reach_while_locating_is_retried_not_taken_for_nothing_there(flaky, failing, error):
    """fsspec's `isdir` and `isfile` say False for every OSError, and its generic walk takes a
    directory it cannot list for an empty one: a refused connection or EIO while locating read as
    a URL naming nothing (or matching no files), a ConfigurationError no retry looked at."""
    flaky.error = error
    setattr(flaky, failing, 2)
    assert Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001).num_records == 5
    setattr(flaky, failing, 100)
    with pytest.raises(ShardUnavailableError, match="flaky://bucket unavailable after 3 attempt") as caught:
        Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001)
    assert isinstance(caught.value.__cause__, OSError)
    assert "while listing dataset 'd' at flaky://bucket" in caught.value.__notes__


@pytest.mark.parametrize("url", ["flaky://bucket", "flaky://bucket/**/*.jsonl"], ids=["directory", "glob"])
@pytest.mark.parametrize(
    "error",
    [ConnectionRefusedError, _eio, FileNotFoundError, lambda message: _FakeAiohttp.ClientResponseError(message, 503)],
    ids=["refused", "EIO", "vanished", "aiohttp-503"],
)
def test_a_subdirectory_a_generic_walk_cannot_list_is_retried_then_named_not_taken_for_an_empty_one(
    flaky, aiohttp, url, error
):
    """fsspec's generic walk (sftp, ftp, smb, http) hands `on_error="raise"` to the directory
    asked only: one below it that could not be listed read as empty, and its shards were left out
    of the plan unsaid. An HTTP status that says "try again" is no OSError from aiohttp."""
    put("flaky://bucket/deep/sub/b.jsonl", jsonl_bytes([{"i": i} for i in range(3)]))
    flaky.error, flaky.ls_failing, flaky.ls_failures = error, "bucket/deep/sub", 2
    assert Dataset.from_path("d", url, retries=3, retry_delay=0.001).num_records == 8
    flaky.ls_failures = 100
    with pytest.raises(ShardUnavailableError, match="unavailable after 3 attempt") as caught:
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert "bucket/deep/sub, a directory of flaky://bucket" in str(caught.value), caught.value
    assert f"while listing dataset 'd' at {url}" in caught.value.__notes__


@pytest.mark.parametrize(
    "error",
    [PermissionError, lambda message: _FakeAiohttp.ClientResponseError(message, 403)],
    ids=["denied", "aiohttp-403"],
)
def test_a_subdirectory_a_generic_walk_may_not_list_is_a_configuration_error_naming_it_at_once(flaky, aiohttp, error):
    """A denial lasts until the permissions change, as for the directory named; aiohttp's 403 is
    no PermissionError."""
    put("flaky://bucket/sub/b.jsonl", jsonl_bytes([{"i": 0}]))
    flaky.error, flaky.ls_failing, flaky.ls_failures = error, "bucket/sub", 100
    named = "bucket/sub, a directory of flaky://bucket, may not be listed"
    with pytest.raises(ConfigurationError, match=named) as caught:
        Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001)
    assert isinstance(caught.value.__cause__, (PermissionError, aiohttp.ClientResponseError))
    assert "while listing dataset 'd' at flaky://bucket" in caught.value.__notes__
    assert flaky.ls_failures == 99


@pytest.mark.parametrize("error", [PermissionError, ConnectionRefusedError], ids=["denied", "refused"])
@pytest.mark.parametrize(
    ("url", "unlisted", "records"),
    [
        ("flaky://bucket/2024-*/*.jsonl", "bucket/private", 3),
        ("flaky://bucket/*/day/*.jsonl", "bucket/2024-01/other", 4),
    ],
    ids=["magic", "literal"],
)
def test_a_directory_a_glob_cannot_match_below_is_not_listed_so_it_failing_to_list_fails_nothing(
    flaky, url, unlisted, records, error
):
    """fsspec's generic glob lists every directory down to the pattern's depth, matching or not;
    each that failed to list then failed the dataset (a denial at once, anything else after the
    retries), for a directory none of whose files the glob could take, as a local glob does not.
    One the glob could match below still fails it."""
    put("flaky://bucket/2024-01/day/b.jsonl", jsonl_bytes([{"i": i} for i in range(3)]))
    put("flaky://bucket/2024-01/b.jsonl", jsonl_bytes([{"i": i} for i in range(3)]))
    put("flaky://bucket/private/day/c.jsonl", jsonl_bytes([{"i": 0}]))
    put("flaky://bucket/2024-01/other/c.jsonl", jsonl_bytes([{"i": 0}]))
    flaky.error, flaky.ls_failing, flaky.ls_failures = error, unlisted, 100
    assert Dataset.from_path("d", url, retries=2, retry_delay=0.001).num_records == records
    assert flaky.ls_failures == 100
    flaky.ls_failing = "bucket/2024-01"
    with pytest.raises((ConfigurationError, ShardUnavailableError), match="bucket/2024-01, a directory of"):
        Dataset.from_path("d", url, retries=2, retry_delay=0.001)

class _LinkingFlakyFileSystem(FlakyFileSystem):
    """Symbolic links as sftp lists them (`listdir_attr` does not follow them): typed "link" by
    `ls`, and resolved by `info` and `open`, which follow them."""

    protocol = "linking"
    store: dict = {}
    pseudo_dirs: list = [""]
    links: dict = {}  # a link's path -> its target's

    def ls(self, path, detail=True, **kwargs):
        here = self._strip_protocol(path)
        listed = super().ls(path, detail=True, **kwargs)
        listed += [{"name": link, "type": "link", "size": 0} for link in self.links if link.rpartition("/")[0] == here]
        return listed if detail else [info["name"] for info in listed]

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        if path in self.links:
            return {**super().info(self.links[path], **kwargs), "name": path}
        return super().info(path, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        path = self._strip_protocol(path)
        return super()._open(self.links.get(path, path), mode, **kwargs)


@pytest.fixture
def linking(flaky):
    with registered(_LinkingFlakyFileSystem) as cls:
        cls.links = {}
        put("linking://bucket/a.jsonl", jsonl_bytes([{"i": i} for i in range(5)]))
        put("linking://data/real.jsonl", jsonl_bytes([{"i": i} for i in range(3)]))
        yield cls


@pytest.mark.parametrize("url", ["linking://bucket", "linking://bucket/*.jsonl"], ids=["directory", "glob"])
def test_a_shard_that_is_a_link_on_a_generic_walk_s_filesystem_is_planned_not_dropped(linking, url):
    """sftp types a link "link", neither file nor directory, and the listing kept files only:
    a dataset of linked shards lost them, unsaid."""
    linking.links = {"bucket/b.jsonl": "data/real.jsonl"}
    ds = Dataset.from_path("d", url)
    assert ds.num_records == 8
    assert [shard.num_records for shard in ds.shards] == [5, 3]
    assert [record["i"] for record in ds.read_chunk(ds.chunks(16)[1]).records] == [0, 1, 2]


@pytest.mark.parametrize(
    ("link", "target", "named"),
    [("bucket/more", "data", "bucket/more, a link of linking://bucket to a directory"),
     ("bucket/gone.jsonl", "data/gone.jsonl",
      "bucket/gone.jsonl is a shard of linking://bucket that is a link to nothing")],
    ids=["to a directory", "dangling"],
)
def test_a_link_on_a_generic_walk_s_filesystem_it_cannot_follow_is_a_configuration_error_naming_it(
    linking, link, target, named
):
    """A link to a directory (which the walk does not follow: nothing tells it a loop) and one to
    nothing were dropped from the listing, their shards missing from the plan unsaid."""
    linking.links = {link: target}
    with pytest.raises(ConfigurationError, match=named):
        Dataset.from_path("d", "linking://bucket")


def test_a_link_to_a_directory_a_glob_cannot_match_below_fails_nothing(linking):
    """Only a directory the walk would list is refused for being a link."""
    put("linking://bucket/2024-01/c.jsonl", jsonl_bytes([{"i": i} for i in range(2)]))
    linking.links = {"bucket/more": "data"}
    assert Dataset.from_path("d", "linking://bucket/*.jsonl").num_records == 5
    assert Dataset.from_path("d", "linking://bucket/2024-*/*.jsonl").num_records == 2


class _OwnGlobFlakyFileSystem(FlakyFileSystem):
    """A glob of its own over fsspec's generic walk, as http's."""

    protocol = "ownglob"
    store: dict = {}
    pseudo_dirs: list = [""]

    def glob(self, path, **kwargs):
        return super().glob(path, **kwargs)


def test_a_glob_of_its_own_over_the_generic_walk_is_retried_where_its_directory_cannot_be_listed(flaky):
    """Such a glob is left for fsspec's generic one over the walk that raises."""
    with registered(_OwnGlobFlakyFileSystem):
        put("ownglob://bucket/a.jsonl", jsonl_bytes([{"i": 0}]))
        flaky.error, flaky.ls_failures = ConnectionRefusedError, 100
        with pytest.raises(ShardUnavailableError, match="ownglob://bucket/\\*.jsonl unavailable after 2 attempt"):
            Dataset.from_path("d", "ownglob://bucket/*.jsonl", retries=2, retry_delay=0.001)


@pytest.fixture(params=["sync-http", pytest.param("http", marks=pytest.mark.requires_aiohttp)],
                ids=["blocking", "aiohttp"])
def scheme(request):
    """The URL scheme of an `http_index` path: fsspec's blocking HTTP filesystem, or its usual
    one over aiohttp (`zephon[http]`), whose errors are aiohttp's own."""
    return request.param


@pytest.fixture
def http_index(tmp_path):
    """data/2024-01/a.jsonl (3 records), data/2024-02/b.jsonl (2) and data/private/c.jsonl (1),
    served over HTTP with index pages."""
    for path, count in {"data/2024-01/a.jsonl": 3, "data/2024-02/b.jsonl": 2, "data/private/c.jsonl": 1}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(jsonl_bytes([{"i": i} for i in range(count)]))
    with serving_over_http(tmp_path) as server:
        yield server


def test_an_http_glob_plans_the_shards_of_each_subdirectory_with_the_sizes_their_server_tells(
    http_index, scheme, tmp_path
):
    """An HTTP index page tells no file's size: every shard an http(s) glob found was refused as
    a link to nothing, so no http(s) glob could be planned."""
    ds = Dataset.from_path("d", http_index.url("data/*/*.jsonl", scheme), retries=1)
    assert ds.num_records == 6
    shards = ("data/2024-01/a.jsonl", "data/2024-02/b.jsonl", "data/private/c.jsonl")
    assert [shard.nbytes for shard in ds.shards] == [(tmp_path / path).stat().st_size for path in shards]
    assert [record["i"] for record in ds.read_chunk(ds.chunks(8)[1]).records] == [0, 1]


def test_an_http_glob_asks_the_sizes_of_the_shards_it_found_several_at_a_time(http_index):
    """One HEAD per shard, each waiting for the one before: planning thousands of shards on a
    distant server took thousands of round trips. Here each shard's HEAD is answered only once
    the three are asked together."""
    shards = {"/data/2024-01/a.jsonl", "/data/2024-02/b.jsonl", "/data/private/c.jsonl"}
    http_index.meeting = shards, threading.Barrier(len(shards), timeout=20)
    assert Dataset.from_path("d", http_index.url("data/*/*.jsonl"), retries=1).num_records == 6
    assert not http_index.meeting[1].broken


def test_an_http_file_that_is_no_shard_is_not_asked_its_size_so_one_that_cannot_be_fails_nothing(http_index, tmp_path):
    """Only a shard needs its size: every file a glob found was asked it (a HEAD each), a README or
    a hidden file beside the shards as well, and one the server would not describe (a broken link
    on the index page) failed the whole dataset."""
    for name in ("README.md", "._a.jsonl"):
        (tmp_path / "data/2024-01" / name).write_text("not a shard")
        http_index.statuses[f"/data/2024-01/{name}"] = [404] * 10
    assert Dataset.from_path("d", http_index.url("data/2024-01/*"), retries=2, retry_delay=0.001).num_records == 3
    assert http_index.requests["/data/2024-01/README.md"] == http_index.requests["/data/2024-01/._a.jsonl"] == 0


@pytest.mark.parametrize("pattern", ["data/2024-01/", "data/2024-01/**"])
def test_an_http_file_in_a_hidden_directory_is_not_asked_its_size_so_one_that_cannot_be_fails_nothing(
    http_index, tmp_path, pattern
):
    """A file in a hidden directory below the URL (Jupyter's checkpoint copy) is no shard, yet it
    was asked its size as one (a HEAD each), and one the server would not describe failed the
    dataset it is no part of."""
    (tmp_path / "data/2024-01/.ipynb_checkpoints").mkdir()
    (tmp_path / "data/2024-01/.ipynb_checkpoints/a-checkpoint.jsonl").write_bytes(jsonl_bytes([{"i": 0}]))
    http_index.statuses["/data/2024-01/.ipynb_checkpoints/a-checkpoint.jsonl"] = [404] * 10
    assert Dataset.from_path("d", http_index.url(pattern), retries=2, retry_delay=0.001).num_records == 3
    assert http_index.requests["/data/2024-01/.ipynb_checkpoints/a-checkpoint.jsonl"] == 0


def test_an_http_shard_a_glob_does_not_match_is_not_asked_its_size(http_index, tmp_path):
    """The glob's walk found every file of a directory that could hold a match, and each was asked
    its size before the pattern was matched: a shard of the split left out of the dataset that
    the server would not describe failed it."""
    (tmp_path / "data/2024-01/test.jsonl").write_bytes(jsonl_bytes([{"i": 0}]))
    http_index.statuses["/data/2024-01/test.jsonl"] = [404] * 10
    assert Dataset.from_path("d", http_index.url("data/2024-01/a*.jsonl"), retries=2, retry_delay=0.001).num_records == 3
    assert http_index.requests["/data/2024-01/test.jsonl"] == 0


def test_an_http_shard_its_index_lists_that_cannot_be_looked_at_is_retried_then_named(http_index):
    """Planning asks each shard found its size; one the server will not describe is neither
    dropped nor taken for a glob that matched nothing."""
    url = http_index.url("data/*/*.jsonl")
    http_index.statuses["/data/2024-02/b.jsonl"] = [503, 503]  # HEAD, then GET
    assert Dataset.from_path("d", url, retries=2, retry_delay=0.001).num_records == 6
    http_index.statuses["/data/2024-02/b.jsonl"] = [404] * 4
    with pytest.raises(ShardUnavailableError, match="unavailable after 2 attempt") as caught:
        Dataset.from_path("d", url, retries=2, retry_delay=0.001)
    assert f"{http_index.url('data/2024-02/b.jsonl')[5:]}, a file of {url} its directory lists" in str(caught.value)


@pytest.mark.parametrize("status", [401, 403])
def test_an_http_shard_its_index_lists_that_its_server_denies_is_a_configuration_error_naming_it_at_once(
    http_index, scheme, status
):
    """A denial lasts until the credentials change: such a shard was retried as one the server
    could not describe now, then reported as unavailable."""
    url = http_index.url("data/*/*.jsonl", scheme)
    http_index.statuses["/data/2024-02/b.jsonl"] = [status] * 4
    shard = re.escape(http_index.url("data/2024-02/b.jsonl", "http"))
    named = rf"{shard}, a file of {re.escape(url)} its directory lists, may not be read: .* HTTP {status}"
    with pytest.raises(ConfigurationError, match=named) as caught:
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert f"while listing dataset 'd' at {url}" in caught.value.__notes__
    assert http_index.statuses["/data/2024-02/b.jsonl"] == [status] * 2  # a HEAD, then a GET, once


@pytest.mark.parametrize("status", [503, 404], ids=["unavailable", "listed-but-not-found"])
def test_an_http_subdirectory_that_cannot_be_listed_is_retried_then_named_not_taken_for_an_empty_one(
    http_index, status
):
    """http(s)' glob walked below its directory taking a subdirectory it could not list for an
    empty one: its shards were left out of the plan, unsaid. A 404 for a link its parent's index
    lists is retried too: each attempt lists the parent again, so a directory removed meanwhile is
    no longer linked, while one still linked that cannot be listed fails the dataset."""
    url = http_index.url("data/*/*.jsonl")
    http_index.statuses["/data/2024-02"] = [status, status]
    assert Dataset.from_path("d", url, retries=3, retry_delay=0.001).num_records == 6
    assert http_index.statuses["/data/2024-02"] == []
    http_index.statuses["/data/2024-02"] = [status] * 3
    with pytest.raises(ShardUnavailableError, match="unavailable after 3 attempt") as caught:
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert f"{http_index.url('data/2024-02')[5:]}, a directory of {url}, could not be listed" in str(caught.value)
    assert f"while listing dataset 'd' at {url}" in caught.value.__notes__


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("denied", ["data/2024-02", "data"], ids=["subdirectory", "glob-directory"])
def test_an_http_directory_that_may_not_be_listed_is_a_configuration_error_naming_it_at_once(
    http_index, scheme, denied, status
):
    """A denial lasts until the credentials change, as on every other store; on http(s) a
    subdirectory denied read as an empty one, and the glob's own directory was retried."""
    url = http_index.url("data/*/*.jsonl", scheme)
    http_index.statuses[f"/{denied}"] = [status] * 3
    named = re.escape(http_index.url(denied, "http")) + f"/?, a directory of {re.escape(url)}, may not be listed"
    with pytest.raises(ConfigurationError, match=named) as caught:
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert f"while listing dataset 'd' at {url}" in caught.value.__notes__
    assert http_index.statuses[f"/{denied}"] == [status] * 2


def test_an_http_subdirectory_a_glob_cannot_match_below_is_not_asked(http_index):
    """Only a directory that could hold a match is listed, as on every generic walk's filesystem."""
    http_index.statuses["/data/private"] = [403] * 3
    assert Dataset.from_path("d", http_index.url("data/2024-*/*.jsonl"), retries=1).num_records == 5
    assert http_index.requests["/data/private"] == 0


@pytest.mark.parametrize("named", ["data/2024-01/a.jsonl", "data/*/*.jsonl"], ids=["file", "glob"])
def test_an_http_shard_whose_server_tells_no_size_is_refused_naming_it_and_what_to_serve_at_once(
    http_index, scheme, named
):
    """A server that sends a file in chunks with no Content-Length (a page made on request) tells
    no size: such a shard a glob found was refused as "a link to nothing", one named directly
    failed with a bare TypeError. Waiting does not make the server tell one."""
    http_index.unsized.add("/data/2024-01/a.jsonl")
    url = http_index.url(named, scheme)
    shard = http_index.url("data/2024-01/a.jsonl", "http") if named.endswith("*.jsonl") else url
    with pytest.raises(UnsizedShardError, match=re.escape(shard)) as caught:
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert "without a Content-Length" in str(caught.value) and "serve the shards" in str(caught.value)
    assert isinstance(caught.value, ConfigurationError) and caught.value.url == shard
    assert f"while listing dataset 'd' at {url}" in caught.value.__notes__
    assert http_index.requests["/data/2024-01/a.jsonl"] == 2  # a HEAD, then a GET, once


@pytest.mark.requires_aiohttp
def test_an_http_shard_its_server_sends_with_a_content_encoding_is_refused_saying_so(http_index, tmp_path):
    """A file stored gzip-compressed with `Content-Encoding: gzip` (S3 metadata many uploaders
    set on `.gz` files) comes with a Content-Length, which fsspec does not take for the file's
    size (it is the encoding's): the error said the server sent no Content-Length, and told its
    owner to serve one, which it does."""
    (tmp_path / "data/2024-01/a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes([{"i": 0}])))
    http_index.encoded.add("/data/2024-01/a.jsonl.gz")
    url = http_index.url("data/2024-01/a.jsonl.gz", "http")
    with pytest.raises(UnsizedShardError, match=re.escape(url)) as caught:
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert "Content-Encoding" in str(caught.value)


def test_an_http_file_of_another_format_whose_server_tells_no_size_fails_nothing(http_index, tmp_path):
    """Only a shard of the dataset's format needs a size."""
    (tmp_path / "data/2024-01/notes.txt").write_text("a line\n")
    http_index.unsized.add("/data/2024-01/notes.txt")
    assert Dataset.from_path("d", http_index.url("data/2024-01/*"), format="jsonl", retries=1).num_records == 3
    assert http_index.requests["/data/2024-01/notes.txt"] == 2  # asked before the format is chosen


@pytest.mark.parametrize("status", [401, 403])
def test_an_http_url_its_server_denies_is_a_configuration_error_naming_it_and_the_status_at_once(
    http_index, scheme, status
):
    """fsspec's HTTP `info()` raises FileNotFoundError whatever went wrong: a dataset's own URL
    denied read as a URL naming nothing, which sends its owner looking for a typo, not at the
    credentials (a directory below it denied was already a ConfigurationError naming it)."""
    http_index.statuses["/data/2024-01/a.jsonl"] = [status] * 4
    url = http_index.url("data/2024-01/a.jsonl", scheme)
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} may not be read: its server answered HTTP {status}"
                       ) as caught:
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert "check the credentials" in str(caught.value)
    assert f"while listing dataset 'd' at {url}" in caught.value.__notes__
    assert http_index.statuses["/data/2024-01/a.jsonl"] == [status] * 2  # a HEAD, then a GET, once


def test_an_http_signed_url_its_server_denies_is_named_with_the_status_not_taken_for_a_glob(http_index, scheme):
    """A signed URL (S3's, GCS's, a CDN's) carries its signature in a query, after a `?`: one
    expired or refused (403) was expanded as a glob, `?` matching one character, and read as a
    glob that matched no files. One that is let through is the shard it names."""
    path = "data/2024-01/a.jsonl?X-Amz-Expires=60&X-Amz-Signature=0ff1ce"
    url = http_index.url(path, scheme)
    http_index.statuses[f"/{path}"] = [403] * 4
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} may not be read: its server answered HTTP 403"):
        Dataset.from_path("d", url, format="jsonl", retries=3, retry_delay=0.001)
    assert http_index.statuses[f"/{path}"] == [403] * 2  # a HEAD, then a GET, once
    http_index.statuses[f"/{path}"] = []
    assert Dataset.from_path("d", url, format="jsonl", retries=1).num_records == 3


def test_an_http_url_its_server_does_not_have_still_names_nothing(http_index, scheme):
    url = http_index.url("data/2024-01/z.jsonl", scheme)
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} is not a file, a directory or a glob"):
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert http_index.requests["/data/2024-01/z.jsonl"] == 2


def test_an_http_glob_whose_pattern_its_server_denies_as_a_url_is_still_expanded(http_index, scheme):
    """Servers that hide what they do not have (S3, CloudFront) answer 403 for a URL naming no
    file, as a glob's pattern taken literally is: the pattern is expanded, and a denial of a
    directory it lists is named as such."""
    http_index.statuses["/data/*/*.jsonl"] = [403] * 2
    assert Dataset.from_path("d", http_index.url("data/*/*.jsonl", scheme), retries=1).num_records == 6
    assert http_index.statuses["/data/*/*.jsonl"] == []


def test_an_http_url_its_server_cannot_answer_now_is_retried_not_taken_for_nothing_there(http_index, scheme):
    """A 5xx to what the dataset's own URL names read as a URL naming nothing, not retried, where
    every other store's is (fsspec's HTTP `info()` raises FileNotFoundError for any failure)."""
    url = http_index.url("data/2024-01/a.jsonl", scheme)
    http_index.statuses["/data/2024-01/a.jsonl"] = [503, 503]  # a HEAD, then a GET
    assert Dataset.from_path("d", url, retries=2, retry_delay=0.001).num_records == 3
    http_index.statuses["/data/2024-01/a.jsonl"] = [503] * 4
    with pytest.raises(ShardUnavailableError, match=rf"{re.escape(url)} unavailable after 2 attempt.*503") as caught:
        Dataset.from_path("d", url, retries=2, retry_delay=0.001)
    assert f"while listing dataset 'd' at {url}" in caught.value.__notes__


def test_an_http_signed_url_s_format_and_compression_are_guessed_from_its_path_not_its_query(
    http_index, scheme, tmp_path
):
    """A signed URL's query followed its name: `a.jsonl?X-Amz-Signature=…` told no format, so
    every signed URL needed format=, and `a.jsonl.gz?…` read with format="jsonl" was taken for
    plain lines of gzip bytes. A path that tells no format is still named as such."""
    query = "?X-Amz-Expires=60&X-Amz-Signature=0ff1ce"
    ds = Dataset.from_path("d", http_index.url(f"data/2024-01/a.jsonl{query}", scheme), retries=1)
    assert (ds.format, ds.num_records) == ("jsonl", 3)
    (tmp_path / "data/2024-01/z.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes([{"i": 7}, {"i": 8}])))
    ds = Dataset.from_path("d", http_index.url(f"data/2024-01/z.jsonl.gz{query}", scheme), retries=1)
    assert ds.read_chunk(ds.chunks(8)[0]).records == [{"i": 7}, {"i": 8}]
    (tmp_path / "data/2024-01/blob").write_bytes(jsonl_bytes([{"i": 0}]))
    url = http_index.url(f"data/2024-01/blob{query}", scheme)
    with pytest.raises(ConfigurationError, match=rf"cannot infer the format of {re.escape(url)} from its name; pass format="):
        Dataset.from_path("d", url, retries=1)


def test_an_http_directory_url_is_read_as_the_shards_its_index_page_links_to_as_its_glob_and_local_copy_are(
    tmp_path, scheme
):
    """`http://host/data/` (what `python -m http.server`, nginx's autoindex and Apache serve) was
    one file to fsspec's `info()`: its index page, whose format could not be guessed, or read as
    a shard of HTML with format= given. Its shards are the files of the format it links to, its
    subdirectories' too, sorted: the batches of the same shards globbed or read from disk."""
    jsonl_dataset(tmp_path / "data")
    jsonl_dataset(tmp_path / "data" / "more", name="more")
    (tmp_path / "data/README.md").write_text("not a shard")
    local = Dataset.from_path("d", str(tmp_path / "data"))
    whole = run_epoch(text_pipeline(local), keep_batches=False)
    with serving_over_http(tmp_path) as server:
        remote = Dataset.from_path("d", server.url("data/", scheme), retries=1)
        globbed = Dataset.from_path("d", server.url("data/**/*.jsonl", scheme), retries=1)
        names = [shard.url.split("/data/", 1)[1] for shard in remote.shards]
        assert names == [os.path.relpath(shard.url, tmp_path / "data") for shard in local.shards]
        assert [shard.url for shard in remote.shards] == [shard.url for shard in globbed.shards]
        assert run_epoch(text_pipeline(remote), keep_batches=False).digests == whole.digests


def test_an_http_index_page_s_links_up_deeper_elsewhere_or_with_a_query_are_no_shards_of_its_directory(
    tmp_path, scheme
):
    """fsspec's `ls` keeps every link under the page's URL: a `../` path, a deeper one (a shard
    of a directory the page does not link), a query (Apache's sort links, a download button) or
    a fragment were planned as shards. Only what is directly below the directory is, and its
    linked subdirectories' shards, from their own pages."""
    for path in ("data/a.jsonl", "data/sub/b.jsonl", "data/unlinked/deep.jsonl", "other/x.jsonl"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(jsonl_bytes([{"path": path}]))
    links = ["a.jsonl", "sub/", "../other/x.jsonl", "/data/unlinked/deep.jsonl", "a.jsonl?dl=1", "?C=N;O=D",
             "#top", "./", "http://elsewhere.invalid/data/y.jsonl"]
    (tmp_path / "data/index.html").write_text("".join(f'<a href="{link}">{link}</a>\n' for link in links))
    with serving_over_http(tmp_path) as server:
        ds = Dataset.from_path("d", server.url("data/", scheme), retries=1)
        assert [shard.url for shard in ds.shards] == [server.url(p, "http") for p in ("data/a.jsonl", "data/sub/b.jsonl")]
        assert [ds.read_chunk(chunk).records for chunk in ds.chunks(4)] == [[{"path": "data/a.jsonl"}],
                                                                            [{"path": "data/sub/b.jsonl"}]]


def test_an_http_index_page_s_links_through_dot_segments_or_the_other_scheme_to_its_files_are_its_shards(
    tmp_path, scheme
):
    """Caddy's file server links every entry as `./name` (`./a.jsonl`, `./sub/`), and a page made
    behind a TLS proxy may link its files absolutely in the other scheme: fsspec keeps both, as
    `…/data/./a.jsonl` and `https://…/data/b.jsonl`, and they were taken for deeper or foreign
    links, so the shards they name were missing from the dataset. Each is the file it resolves to,
    named in the directory URL's scheme, once; `more/.` is the directory `more/`."""
    for path in ("data/a.jsonl", "data/b.jsonl", "data/more/d.jsonl", "data/sub/c.jsonl"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(jsonl_bytes([{"path": path}]))
    with serving_over_http(tmp_path) as server:
        other = server.url("data/b.jsonl", "https")
        links = ["./a.jsonl", "a.jsonl", "./sub/", "sub/./c.jsonl", other, "./../data/b.jsonl", "more/."]
        (tmp_path / "data/index.html").write_text("".join(f'<a href="{link}">{link}</a>\n' for link in links))
        ds = Dataset.from_path("d", server.url("data/", scheme), retries=1)
        expected = ("data/a.jsonl", "data/b.jsonl", "data/more/d.jsonl", "data/sub/c.jsonl")
        assert [shard.url for shard in ds.shards] == [server.url(p, "http") for p in expected]
        assert [ds.read_chunk(chunk).records for chunk in ds.chunks(4)] == [[{"path": p}] for p in expected]


def test_an_http_directory_whose_server_follows_a_link_back_up_is_a_configuration_error_not_its_shards_again(
    tmp_path, scheme
):
    """A static file server follows a symbolic link to a directory above it (`data/loop -> ..`)
    and lists it as a subdirectory; HTTP does not tell a link, so the walk went round it until the
    server's own limit on links: `data/a.jsonl` was planned 41 times, its records read 41 times
    an epoch. A directory listing what the two above it at the same step list is refused, naming
    it, as a local loop is; directories nested under their own name (`nested/nested/`) are not."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data/a.jsonl").write_bytes(jsonl_bytes([{"i": 0}]))
    os.symlink("..", tmp_path / "data/loop")
    (tmp_path / "nested/nested/nested").mkdir(parents=True)
    (tmp_path / "nested/nested/nested/x.jsonl").write_bytes(jsonl_bytes([{"i": 1}]))
    with serving_over_http(tmp_path) as server:
        url = server.url("data/", scheme)
        looped = re.escape(server.url("data/loop/data/loop/data", "http"))
        with pytest.raises(ConfigurationError, match=rf"{looped}, a directory of {re.escape(url)}, lists what "):
            Dataset.from_path("d", url, retries=1)
        assert Dataset.from_path("d", server.url("nested/", scheme), retries=1).num_records == 1


def test_an_http_directory_url_holding_no_shard_or_nothing_is_named_as_a_local_one_is(http_index, scheme, tmp_path):
    """The errors of a local directory: an empty index page, or one of no shard of the format,
    says what the directory holds; a page its server does not have names nothing."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/README.md").write_text("not a shard")
    url = http_index.url("empty/", scheme)
    with pytest.raises(ConfigurationError, match=rf"the directory {re.escape(url)} exists but holds no jsonl file: it is empty"):
        Dataset.from_path("d", url, format="jsonl", retries=1)
    url = http_index.url("docs/", scheme)
    with pytest.raises(ConfigurationError, match=rf"the directory {re.escape(url)} exists but holds no file of a format read "
                       r"here .*; it holds README.md\n"):
        Dataset.from_path("d", url, retries=1)
    url = http_index.url("data/2099/", scheme)
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} is not a file, a directory or a glob"):
        Dataset.from_path("d", url, retries=3, retry_delay=0.001)
    assert http_index.requests["/data/2099"] == 1  # a 404 is nothing there, not retried


@pytest.mark.requires_aiohttp
def test_an_http_url_without_the_slash_answering_with_an_index_page_is_refused_saying_to_add_it(http_index):
    """`http://host/data` (no slash) answers with the index page too: read with format=, its HTML
    was planned as a shard of garbage lines. The error says how to read the directory."""
    url = http_index.url("data", "http")
    for format in (None, "jsonl"):
        with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} answers with an HTML page .*end the URL with '/' "
                           rf"\({re.escape(url)}/\)"):
            Dataset.from_path("d", url, format=format, retries=1)
    assert Dataset.from_path("d", f"{url}/", retries=1).num_records == 6


@pytest.mark.requires_aiohttp
def test_an_http_file_with_a_suffix_its_server_sends_as_html_is_read_as_the_format_given(http_index, tmp_path):
    """A server whose MIME map lacks a suffix sends it as its default type, which may be text/html
    (nginx's `default_type`, a CDN's): `e.ndjson` read with format="jsonl" was refused as an index
    page to end with "/", though its name is a file's. A page its server redirected to the URL
    with the slash is a directory's whatever its name; one whose suffix tells no format still
    asks for format=."""
    (tmp_path / "data/2024-01/e.ndjson").write_bytes(jsonl_bytes([{"i": 9}]))
    http_index.content_types[".ndjson"] = "text/html"
    url = http_index.url("data/2024-01/e.ndjson", "http")
    assert Dataset.from_path("d", url, format="jsonl", retries=1).num_records == 1
    with pytest.raises(ConfigurationError, match=rf"cannot infer the format of {re.escape(url)} from its name; pass format="):
        Dataset.from_path("d", url, retries=1)
    (tmp_path / "data/v1.0").mkdir()
    url = http_index.url("data/v1.0", "http")
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} answers with an HTML page .*\({re.escape(url)}/\)"):
        Dataset.from_path("d", url, format="jsonl", retries=1)


_CACHE_LAYERS = ("simplecache", "filecache")  # blockcache is refused: test_io_cache_layers.py


def _behind(layer: str, url: str, tmp_path) -> tuple[str, dict]:
    """`url` read through fsspec's cache `layer`, and the storage_options that keep its copies under tmp_path."""
    return f"{layer}::{url}", {layer: {"cache_storage": str(tmp_path / "cache")}}


@pytest.mark.parametrize("layer", _CACHE_LAYERS)
def test_an_http_directory_or_signed_url_behind_a_cache_is_read_as_the_same_url_without_it(
    http_index, scheme, layer, tmp_path
):
    """`simplecache::https://host/data/` got none of http's handling: Zephon asked the cache, whose
    protocol is its own, whether it was http. The directory was one shard of HTML whose format
    could not be guessed (`filecache::` and `blockcache::` describe a file from a listing of its
    directory, which tells no size, so every shard was refused as sizeless), and a signed URL
    told no format. Through the cache they are the shards, records and reads of the URL without it."""
    plain = Dataset.from_path("d", http_index.url("data/", scheme), retries=1)
    url, options = _behind(layer, http_index.url("data/", scheme), tmp_path)
    cached = Dataset.from_path("d", url, storage_options=options, retries=1)
    assert [shard.url for shard in cached.shards] == [shard.url for shard in plain.shards]
    assert [cached.read_chunk(c).records for c in cached.chunks(2)] == [plain.read_chunk(c).records for c in plain.chunks(2)]
    url, options = _behind(layer, http_index.url("data/2024-01/a.jsonl?X-Amz-Expires=60&X-Amz-Signature=0ff1ce", scheme),
                           tmp_path)
    signed = Dataset.from_path("d", url, storage_options=options, retries=1)
    assert (signed.format, signed.read_chunk(signed.chunks(8)[0]).records) == ("jsonl", [{"i": i} for i in range(3)])


@pytest.mark.requires_aiohttp
@pytest.mark.parametrize("layer", _CACHE_LAYERS)
def test_an_http_url_behind_a_cache_that_its_server_denies_or_answers_with_an_index_page_is_named_so(
    http_index, layer, tmp_path
):
    """A 403 behind a cache read as a URL naming nothing, and `…/data` (no slash), an index page, as a
    shard of HTML (or one of no size): the errors of the URL without the cache, naming it as written."""
    http_index.statuses["/data/2024-01/a.jsonl"] = [403] * 4
    url, options = _behind(layer, http_index.url("data/2024-01/a.jsonl", "http"), tmp_path)
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} may not be read: its server answered HTTP 403"):
        Dataset.from_path("d", url, storage_options=options, retries=3, retry_delay=0.001)
    url, options = _behind(layer, http_index.url("data", "http"), tmp_path)
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} answers with an HTML page .*\({re.escape(url)}/\)"):
        Dataset.from_path("d", url, format="jsonl", storage_options=options, retries=1)


@pytest.mark.requires_aiohttp
@pytest.mark.parametrize("layer", _CACHE_LAYERS)
def test_a_shard_read_through_a_cache_in_front_of_http_waits_as_its_server_asked(
    http_index, layer, tmp_path, monkeypatch
):
    """`simplecache::` and `filecache::` ask the server whether a shard exists before copying it, and
    keep yes or no: a 429's Retry-After was lost (a FileNotFoundError, retried after the backoff
    alone), and reads through `filecache::` and `blockcache::` were refused as changed after
    planning, their version asked of a listing that tells none."""
    url, options = _behind(layer, http_index.url("data/2024-01/a.jsonl", "http"), tmp_path)
    ds = Dataset.from_path("d", url, storage_options=options, retries=3, retry_delay=0.001)
    for copy in (tmp_path / "cache").iterdir():  # the copy planning made: the read asks the server again
        if copy.name != "cache":  # filecache's and blockcache's record of what they hold
            copy.unlink()
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    # A rate limit on the next three requests: the cache's GET asking whether the shard exists, and
    # the HEAD, then GET, of the store's `info()` that asks what it said; the retry reads the shard.
    http_index.statuses["/data/2024-01/a.jsonl"] = [429] * 3
    http_index.retry_after["/data/2024-01/a.jsonl"] = "7"
    assert ds.read_chunk(ds.chunks(8)[0]).records == [{"i": i} for i in range(3)]
    assert waits == [7.0]


@pytest.mark.parametrize("page, content_type", [
    ('<html><head><title>Sign in</title><link href="/site-assets/app.css"></head><body><a href="/login">Sign in</a>'
     "</body></html>", "text/html"),
    ('{"items": [], "next": null}', "application/json"),
    ("service is up", "text/plain"),
    ('<html><head><title>Sign in</title><link rel="canonical" href="https://example.com/site/"></head><body>'
     '<form action="/site/" method="post"><a href="/login?next=/site/">Sign in</a></form></body></html>', "text/html"),
], ids=["html", "json", "text", "html_linking_to_itself"])
def test_an_http_directory_url_answering_with_a_page_that_is_no_listing_is_refused_naming_it_not_read_as_empty(
    http_index, scheme, tmp_path, page, content_type
):
    """A URL ending in "/" whose server answers with a login page, a JSON body or a text/plain 200 was
    read as an empty directory (no link fsspec could list), which surfaced as a dataset holding no
    shard. An empty directory's own index page still says it is empty (next test). A login page
    that links to its own URL (its form's action, a canonical link, `?next=`) names the path only
    in a link, not in its text as an index page's title does: it too is refused."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site/index.html").write_text(page)
    http_index.content_types[".html"] = content_type
    url = http_index.url("site/", scheme)
    sent = rf"Content-Type {re.escape(content_type)}" if scheme == "http" else "a Content-Type fsspec's blocking"
    with pytest.raises(ConfigurationError, match=rf"{re.escape(url)} answers with a page \({sent}.*\) that is no "
                       r"directory listing Zephon can read: .* Name the shards by their own URLs, or give a glob"):
        Dataset.from_path("d", url, format="jsonl", retries=1)


@pytest.mark.parametrize("index", [None, '<html><title>Index of /data/empty/</title><a href="../">../</a></html>'],
                         ids=["python", "nginx"])
def test_an_http_directory_url_whose_index_page_lists_nothing_is_named_an_empty_directory(
    http_index, scheme, tmp_path, index
):
    """An empty directory's index page (Python's, which links nothing; nginx's, which links only
    `../`) links to no file either, and is told apart from a page that is no listing by naming the
    directory: it is said to be empty, not refused as no listing."""
    (tmp_path / "data/empty").mkdir()
    if index is not None:
        (tmp_path / "data/empty/index.html").write_text(index)
    url = http_index.url("data/empty/", scheme)
    with pytest.raises(ConfigurationError, match=rf"the directory {re.escape(url)} exists but holds no jsonl file: it is empty"):
        Dataset.from_path("d", url, format="jsonl", retries=1)


@pytest.mark.requires_aiohttp
@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_a_dataset_read_over_http_gives_the_batches_of_its_local_copy_and_resumes_to_them(tmp_path, runner):
    """fsspec reads `http(s)://` with aiohttp (`zephon[http]`), which no test ran: every HTTP test
    read `sync-http://`, fsspec's blocking filesystem. Here a glob over `http://` is listed from
    its index page, planned, read on each runner (the process runner's forked workers refused
    every read of it: see the next test), resumed on another rank count and read through the
    cache, and hands out the batches of the same shards read from disk."""
    local = jsonl_dataset(tmp_path / "data")
    whole = run_epoch(text_pipeline(local, runner=runner), keep_batches=False)
    with serving_over_http(tmp_path) as server:
        remote = Dataset.from_path("d", server.url("data/*.jsonl", "http"))
        shards = [server.url(f"data/part-0000{i}.jsonl", "http") for i in (0, 1)]
        assert [shard.url for shard in remote.shards] == shards
        assert [(shard.num_records, shard.nbytes) for shard in remote.shards] == [
            (shard.num_records, shard.nbytes) for shard in local.shards]
        assert run_epoch(text_pipeline(remote, runner=runner), keep_batches=False).digests == whole.digests
        state = checkpoint_after(text_pipeline(remote, runner=runner), 2, 3)
        cached = text_pipeline(remote, runner=runner).options(
            io_options={"cache": {"enabled": True, "dir": str(tmp_path / "cache")}})
        resumed = run_epoch(cached, 1, keep_batches=False, state=state).digests
    assert len(whole.digests) - len(resumed) == 2 * 3
    assert resumed == {key: digest for key, digest in whole.digests.items() if key in resumed}
    copies = sorted(path.read_bytes() for path in (tmp_path / "cache").iterdir())
    assert copies == sorted(path.read_bytes() for path in (tmp_path / "data").iterdir())


def test_a_dataset_on_an_asynchronous_filesystem_is_read_in_the_process_runner_s_forked_workers():
    """The process runner forks its workers with the Dataset: an asynchronous filesystem (http(s)
    over aiohttp, s3fs, gcsfs) that they inherited refused every read, "This class is not
    fork-safe" (its requests ran on the parent's event loop), so no such dataset could be read on
    the default runner of a GIL build. fsspec's asynchronous wrapper of the memory filesystem
    stands in for them."""
    root = memory_root()
    for shard in range(2):
        put(f"{root}/part-{shard}.jsonl", jsonl_bytes(clean_records(16, shard)))
    wrapped = Dataset.from_path("d", f"async_wrapper::{root}")
    reference = run_epoch(text_pipeline(Dataset.from_path("d", root)), keep_batches=False)
    assert run_epoch(text_pipeline(wrapped, runner="process"), keep_batches=False).digests == reference.digests


def test_a_filesystem_that_keeps_its_listings_keeps_them_in_the_process_runner_s_forked_workers(monkeypatch):
    """huggingface_hub's HfFileSystem keeps the listings it asked the hub for, and a pickle of it
    carries them. Each forked worker made its own from the constructor arguments alone, keeping
    none, so it asked the hub again for every shard directory it read (and HfFileSystem for the
    repository too). Made as a pickle would make it, a worker's has the parent's listings."""
    monkeypatch.setattr(ListingKeepingStore, "listings_asked", multiprocessing.get_context("fork").Value("i", 0))
    with registered(ListingKeepingStore):
        root = f"listkeeping://bucket/{uuid.uuid4().hex}"
        for shard in range(2):
            put(f"{root}/part-{shard}.jsonl", jsonl_bytes(clean_records(16, shard)))
        ds = Dataset.from_path("d", root)
        assert ListingKeepingStore.listings_asked.value > 0  # counting the shards opened them
        reference = run_epoch(text_pipeline(ds), keep_batches=False)
        ListingKeepingStore.listings_asked.value = 0
        assert run_epoch(text_pipeline(ds, runner="process"), keep_batches=False).digests == reference.digests
    assert ListingKeepingStore.listings_asked.value == 0


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_the_hub_s_own_filesystem_made_in_a_forked_child_has_the_listings_of_the_parent_s():
    """What `ListingKeepingStore` stands in for, on huggingface_hub's HfFileSystem itself (no
    request is made): made anew from its constructor arguments in a forked child, it had none."""
    from huggingface_hub import HfFileSystem

    hub = HfFileSystem(token=False, skip_instance_cache=True)
    directory = "datasets/acme/raw/data"
    hub.dircache[directory] = [{"name": f"{directory}/a.jsonl", "size": 9, "type": "file"}]
    assert _in_a_forked_child(lambda: _storage.filesystem_made_here(hub).dircache) == hub.dircache


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_blocking_filesystem_made_in_a_forked_child_has_connections_of_its_own(tmp_path):
    """fsspec's sync-http reads through a requests session, whose pool keeps the parent's
    keep-alive connections: forked children sharing one read each other's responses. Blocking as
    it is, it is made anew in a forked child, with a session of its own."""
    with serving_over_http(tmp_path):  # registers sync-http
        parent = fsspec.filesystem("sync-http")
    assert _in_a_forked_child(lambda: _storage.filesystem_made_here(parent).session is parent.session) is False


def _in_a_forked_child(ask):
    """What `ask()` returns in a child forked from this process."""
    context = multiprocessing.get_context("fork")
    answers = context.SimpleQueue()
    child = context.Process(target=lambda: answers.put(ask()))
    child.start()
    child.join()
    assert child.exitcode == 0
    return answers.get()


def test_an_http_server_out_of_reach_is_retried_not_taken_for_nothing_there(http_index, scheme):
    """A refused connection to the dataset's own URL read as a URL naming nothing, not retried."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"{scheme}://127.0.0.1:{closed.getsockname()[1]}/data/a.jsonl"
    with pytest.raises(ShardUnavailableError, match=rf"{re.escape(url)} unavailable after 2 attempt") as caught:
        Dataset.from_path("d", url, retries=2, retry_delay=0.001)
    assert f"while listing dataset 'd' at {url}" in caught.value.__notes__


def test_a_store_that_denies_listing_is_a_configuration_error_naming_the_url_and_dataset_at_once(flaky):
    """A denial lasts until the credentials or permissions change: retrying it only delays the
    error. It read as a URL naming nothing."""
    flaky.error, flaky.listing_failures = PermissionError, 100
    with pytest.raises(ConfigurationError, match="flaky://bucket may not be listed .*could not say what") as caught:
        Dataset.from_path("d", "flaky://bucket", retries=3, retry_delay=0.001)
    assert isinstance(caught.value.__cause__, PermissionError)
    assert "while listing dataset 'd' at flaky://bucket" in caught.value.__notes__
    assert flaky.infos == 1


def test_a_path_or_glob_naming_nothing_on_a_store_is_still_a_configuration_error(flaky):
    """Only FileNotFoundError means nothing is there; a generic walk told to raise raises it for a
    glob whose directory is missing, which is a glob matching nothing, not a store to retry."""
    with pytest.raises(ConfigurationError, match="flaky://bucket/missing is not a file, a directory or a glob"):
        Dataset.from_path("d", "flaky://bucket/missing", retries=3, retry_delay=0.001)
    with pytest.raises(ConfigurationError, match="flaky://bucket/missing/\\*.jsonl matches no files"):
        Dataset.from_path("d", "flaky://bucket/missing/*.jsonl", retries=3, retry_delay=0.001)


def test_storage_that_keeps_failing_raises_after_the_configured_attempts(flaky):
    ds = Dataset.from_path("d", "flaky://bucket", retries=4, retry_delay=0.001)
    flaky.failures, flaky.opens = 100, 0
    with pytest.raises(ShardUnavailableError, match="flaky://bucket/a.jsonl unavailable after 4") as caught:
        ds.read_chunk(ds.chunks(5)[0])
    assert flaky.opens == 4
    assert isinstance(caught.value.__cause__, ConnectionResetError)


def test_backoff_between_attempts_doubles_up_to_a_minute_not_for_days(monkeypatch):
    """Doubling without a bound, retries=20 waited 0.5 * 2**18 s (three days) before its last
    attempt, a hang in all but name; past ~1,000 attempts the wait overflowed a float."""
    from zephon.io._retry import MAX_RETRY_DELAY_S, RetryPolicy

    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)

    def failing():
        raise ConnectionResetError("dropped")

    with pytest.raises(ShardUnavailableError, match="after 20 attempt"):
        RetryPolicy(20, 0.5).call("memory://x/a.jsonl", failing)
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0] and max(waits) == MAX_RETRY_DELAY_S == 60.0 and len(waits) == 19
    waits.clear()
    with pytest.raises(ShardUnavailableError):
        RetryPolicy(1100, 0.5).call("memory://x/a.jsonl", failing)
    assert len(waits) == 1099
    waits.clear()
    with pytest.raises(ShardUnavailableError):  # a first wait asked above the bound is kept
        RetryPolicy(3, 90.0).call("memory://x/a.jsonl", failing)
    assert waits == [90.0, 90.0]


@pytest.mark.parametrize("status", [429, 503])
def test_a_shard_read_its_server_answers_with_retry_after_waits_as_asked_then_reads_it(
    http_index, scheme, status, monkeypatch, caplog
):
    """A rate-limited (429) or unavailable (503) server that says when to come back was asked
    again after the doubling backoff alone (here 1 ms), sooner than it asked: a rate limit counts
    those early attempts too."""
    ds = Dataset.from_path("d", http_index.url("data/2024-01/a.jsonl", scheme), retries=3, retry_delay=0.001)
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    monkeypatch.setattr(_retry, "_retry_log", _retry._RetryLog())
    http_index.statuses["/data/2024-01/a.jsonl"] = [status] * 2  # opening asks a HEAD, then a GET
    http_index.retry_after["/data/2024-01/a.jsonl"] = "7"
    with caplog.at_level(logging.WARNING, logger="zephon"):
        assert ds.read_chunk(ds.chunks(8)[0]).records == [{"i": i} for i in range(3)]
    assert waits == [7.0]
    assert "retrying in 7 s (its server asked for 7 s: Retry-After)" in caplog.records[0].getMessage()


def test_listing_a_dataset_its_server_answers_with_retry_after_waits_as_asked(http_index, scheme, monkeypatch):
    """The listing at `Dataset.from_path` is retried by the same policy, a directory's index page
    as well as the URL of one file."""
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    http_index.statuses["/data/2024-01/a.jsonl"] = [429] * 2  # a HEAD, then a GET
    http_index.retry_after["/data/2024-01/a.jsonl"] = "5"
    url = http_index.url("data/2024-01/a.jsonl", scheme)
    assert Dataset.from_path("d", url, retries=2, retry_delay=0.001).num_records == 3
    http_index.statuses["/data/2024-02"] = [503]  # the index page the glob lists
    http_index.retry_after["/data/2024-02"] = "3"
    assert Dataset.from_path("d", http_index.url("data/2024-02/*.jsonl", scheme), retries=2, retry_delay=0.001
                             ).num_records == 2
    assert waits == [5.0, 3.0]


def test_a_retry_after_beyond_the_longest_wait_waits_that_long_and_says_the_server_asked_for_more(
    http_index, monkeypatch, caplog
):
    """An hour's Retry-After, waited as asked, would hold every rank of the job for an hour per
    attempt: the wait stops at `MAX_RETRY_DELAY_S`, and the warning says what the server asked."""
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    monkeypatch.setattr(_retry, "_retry_log", _retry._RetryLog())
    http_index.statuses["/data/2024-01/a.jsonl"] = [429] * 2
    http_index.retry_after["/data/2024-01/a.jsonl"] = "3600"
    with caplog.at_level(logging.WARNING, logger="zephon"):
        assert Dataset.from_path("d", http_index.url("data/2024-01/a.jsonl"), retries=2).num_records == 3
    assert waits == [_retry.MAX_RETRY_DELAY_S]
    message = caplog.records[0].getMessage()
    assert "retrying in 60 s, the most a wait lasts, though its server asked for 3600 s (Retry-After)" in message


def test_a_retry_after_date_is_the_seconds_until_it_and_one_that_does_not_parse_is_not_a_wait():
    """Retry-After is seconds or an HTTP date (RFC 9110); it counts where the error is wrapped
    (fsspec's `info()` raises FileNotFoundError from the client's error), and only for a 429 or
    503. Anything else leaves the backoff alone."""
    from zephon.io._retry_after import retry_after_s

    class ResponseError(Exception):  # aiohttp's ClientResponseError: a status, the response's headers
        def __init__(self, status, headers):
            super().__init__(status)
            self.status, self.headers = status, headers

    now = 1_800_000_000.0
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now + 90))
    assert retry_after_s(ResponseError(503, {"Retry-After": date}), now) == 90.0
    assert retry_after_s(ResponseError(503, {"Retry-After": date}), now + 600) == 0.0  # a date past: at once
    wrapped = FileNotFoundError("http://h/a.jsonl")
    wrapped.__cause__ = ResponseError(429, {"Retry-After": " 12 "})
    assert retry_after_s(wrapped, now) == 12.0
    for status, value in [(429, "soon"), (429, "-3"), (429, "1.5"), (500, "12"), (429, None)]:
        assert retry_after_s(ResponseError(status, {} if value is None else {"Retry-After": value}), now) is None


class ClientOptionsFileSystem(_PrefixedMemoryFileSystem):
    """Keeps a nested storage option, as s3fs keeps `client_kwargs={"endpoint_url": ...}`."""

    protocol = "clientopts"
    store: dict = {}
    pseudo_dirs: list = [""]

    def __init__(self, client_kwargs=None, **kwargs):
        super().__init__(**kwargs)
        self.client_kwargs = dict(client_kwargs or {})


def test_storage_options_changed_after_planning_change_neither_the_dataset_nor_its_pickles():
    """A pickle rebuilds an fsspec filesystem from the options it was given, and a nested dict of
    them was the caller's own: options reused for the next dataset (one endpoint after another)
    sent a worker process's copy of the first dataset to the second endpoint, while the inline
    runner read the first."""
    options = {"client_kwargs": {"endpoint_url": "https://first"}}
    with registered(ClientOptionsFileSystem):
        put("clientopts://bucket/a.jsonl", jsonl_bytes([{"i": 0}]))
        ds = Dataset.from_path("d", "clientopts://bucket", storage_options=options)
        options["client_kwargs"]["endpoint_url"] = "https://second"
        clone = pickle.loads(pickle.dumps(ds))
    assert ds._fs.client_kwargs == clone._fs.client_kwargs == {"endpoint_url": "https://first"}


def test_shard_unavailable_error_survives_pickling():
    error = pickle.loads(pickle.dumps(ShardUnavailableError("s3://b/x.jsonl", 3, "OSError: gone")))
    assert (error.url, error.attempts, error.cause) == ("s3://b/x.jsonl", 3, "OSError: gone")


def test_hf_url_resolves_to_the_hub_parquet_conversion(hub):
    base = "hf://datasets/acme/wiki@~parquet"
    rows = [{"text": f"row {i}"} for i in range(7)]
    put(f"{base}/default/train/0001.parquet", parquet_bytes(rows[4:], row_group_size=2))
    put(f"{base}/default/train/0000.parquet", parquet_bytes(rows[:4], row_group_size=2))
    put(f"{base}/default/test/0000.parquet", parquet_bytes(rows[:1], row_group_size=2))
    put(f"{base}/other/train/0000.parquet", parquet_bytes(rows[:1], row_group_size=2))
    ds = Dataset.from_path("wiki", "hf://acme/wiki/default/train")
    assert ds.url == "hf://acme/wiki/default/train" and ds.format == "parquet"
    assert [s.url for s in ds.shards] == [f"{base}/default/train/0000.parquet", f"{base}/default/train/0001.parquet"]
    assert [r for c in ds.chunks(3) for r in ds.read_chunk(c).records] == rows


def test_hf_url_of_a_split_the_hub_converted_only_in_part_names_the_partial_conversion(hub):
    """The hub converts only the first 5 GB of a large split, into `CONFIG/partial-SPLIT/`: the
    shorthand's glob `CONFIG/SPLIT/*.parquet` said only that it "matches no files", and nothing
    told where the split was, nor that what is there is part of it."""
    base = "hf://datasets/acme/web@~parquet"
    put(f"{base}/default/partial-train/0000.parquet", parquet_bytes([{"text": "row"}], row_group_size=2))
    with pytest.raises(ConfigurationError) as raised:
        Dataset.from_path("web", "hf://acme/web/default/train", retry_delay=0)
    message = str(raised.value)
    assert f"{base}/default/partial-train/*.parquet" in message and "first 5 GB" in message
    assert "hf://datasets/acme/web" in message  # the repository's own files, for the whole split
    with pytest.raises(ConfigurationError, match="matches no files") as raised:  # no split of that name at all
        Dataset.from_path("web", "hf://acme/web/default/test", retry_delay=0)
    assert "partial" not in str(raised.value)


def test_hf_url_with_another_format_is_refused(hub):
    with pytest.raises(ConfigurationError, match="hub Parquet"):
        Dataset.from_path("wiki", "hf://acme/wiki/default/train", format="jsonl")


def test_explicit_hub_paths_are_used_as_written(hub):
    put("hf://datasets/acme/raw/data/a.jsonl", jsonl_bytes([{"i": 0}]))
    ds = Dataset.from_path("raw", "hf://datasets/acme/raw/data")
    assert ds.shards[0].url == "hf://datasets/acme/raw/data/a.jsonl"


def test_remote_shards_are_cached_on_local_disk(tmp_path, flaky):
    cache = tmp_path / "cache"
    ds = Dataset.from_path("d", "flaky://bucket", cache={"enabled": True, "dir": str(cache)}, retry_delay=0)
    assert len(list(cache.iterdir())) == 1  # planning already made the copy
    flaky.failures = 1_000  # the remote file is still listed, but opening it fails: reads use the copy
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.read_chunk(clone.chunks(5)[0]).records == [{"i": i} for i in range(5)]


@pytest.mark.parametrize("rewritten", [[{"text": "new 1"}, {"text": "new 2"}],  # the same size
                                       [{"text": f"new {i}"} for i in range(1, 4)]])
def test_a_shard_rewritten_remotely_is_copied_anew_not_read_from_the_old_copy(tmp_path, rewritten):
    """simplecache named a copy by its path alone: a shard regenerated in place was planned with the
    new file's size and the old copy's records, the new records missing without a word."""
    root = memory_root()
    cache = {"enabled": True, "dir": str(tmp_path / "cache")}
    put(f"{root}/a.jsonl", jsonl_bytes([{"text": "old 1"}, {"text": "old 2"}]))
    assert Dataset.from_path("d", root, cache=cache, retry_delay=0).num_records == 2
    put(f"{root}/a.jsonl", jsonl_bytes(rewritten))
    ds = Dataset.from_path("d", root, cache=cache, retry_delay=0)
    assert [record for chunk in ds.chunks(2) for record in ds.read_chunk(chunk).records] == rewritten
    assert ds.shards[0].raw_bytes == ds.shards[0].nbytes == len(jsonl_bytes(rewritten))


def test_a_shard_rewritten_while_it_is_copied_is_refused_naming_it_not_a_type_error(tmp_path, object_store,
                                                                                    monkeypatch):
    """fsspec's simplecache asks for the copy's name again after copying; the name holds the
    shard's version, so a shard rewritten meanwhile named a copy that did not exist and the read
    failed with `TypeError: expected str ... not NoneType` (not retried, naming nothing). A copy
    whose file is another version once it is whole cannot be told to hold the planned one: it is
    not kept, and the read is refused naming the shard."""
    records = [{"text": f"record {i}"} for i in range(20)]
    put("objstore://bucket/a.jsonl", jsonl_bytes(records))
    ds = Dataset.from_path("d", "objstore://bucket", retry_delay=0).with_io_options(
        {"cache": {"enabled": True, "dir": str(tmp_path / "cache")}})
    copy = ObjectStoreFileSystem.get_file

    def copy_then_rewrite(self, rpath, lpath, **kwargs):
        copy(self, rpath, lpath, **kwargs)
        put("objstore://bucket/a.jsonl", jsonl_bytes([{"text": f"new {i}"} for i in range(20)]))

    monkeypatch.setattr(ObjectStoreFileSystem, "get_file", copy_then_rewrite)
    with pytest.raises(ShardUnavailableError, match="changed after planning or while it was copied") as caught:
        ds.read_chunk(ds.chunks(20)[0])
    assert caught.value.url == ds.shards[0].url and caught.value.attempts == 1
    assert not list((tmp_path / "cache").iterdir()), "neither a copy nor its temporary file is left"


def test_a_shard_rewritten_between_its_version_check_and_its_copy_is_refused_not_copied_and_read(
    tmp_path, object_store, monkeypatch
):
    """A read checks the shard's version, then the cache copies it, naming the copy by the version
    it asks for again: a shard rewritten in between was copied as the new version and its records
    handed out under the planned addresses."""
    planned, rewritten = _same_size_rewrites("jsonl")
    put("objstore://bucket/a.jsonl", planned)
    ds = Dataset.from_path("d", "objstore://bucket", retry_delay=0).with_io_options(
        {"cache": {"enabled": True, "dir": str(tmp_path / "cache")}})
    check = _dataset.check_unchanged

    def check_then_rewrite(*args):
        check(*args)
        put("objstore://bucket/a.jsonl", rewritten)

    monkeypatch.setattr(_dataset, "check_unchanged", check_then_rewrite)
    with pytest.raises(ShardUnavailableError, match="changed") as caught:
        ds.read_chunk(ds.chunks(16)[0])
    assert caught.value.url == ds.shards[0].url
    assert not list((tmp_path / "cache").iterdir()), "neither a copy nor its temporary file is left"


def test_a_cached_read_asks_the_remote_for_the_shards_version_once(tmp_path, monkeypatch):
    """The copy of the version planned is found by that version: asking the remote again to name
    the copy, after the read had checked it, was a second round trip per read."""
    root = memory_root()
    put(f"{root}/a.jsonl", jsonl_bytes([{"i": i} for i in range(64)]))
    ds = Dataset.from_path("d", root, retry_delay=0, cache={"enabled": True, "dir": str(tmp_path / "cache")})
    assert _info_calls_of_reading_the_first_chunk(ds, monkeypatch) == 1


@pytest.mark.parametrize("where", ["file", "below a file"])
@pytest.mark.parametrize("when", ["planning", "reading"])
def test_a_cache_directory_that_cannot_be_made_is_a_named_configuration_error(tmp_path, where, when):
    """It escaped as a bare `FileExistsError: File exists` or `NotADirectoryError` naming the
    path, from planning or from the first read of a worker, with no word that it is the cache."""
    root = memory_root()
    put(f"{root}/a.jsonl", jsonl_bytes([{"i": 0}]))
    (tmp_path / "afile").write_text("not a directory")
    directory = tmp_path / "afile" if where == "file" else tmp_path / "afile" / "cache"
    cache = {"enabled": True, "dir": str(directory)}
    with pytest.raises(ConfigurationError, match=f"cache directory {directory}"):
        if when == "planning":
            Dataset.from_path("d", root, cache=cache, retry_delay=0)
        else:
            ds = Dataset.from_path("d", root, retry_delay=0).with_io_options({"cache": cache})
            ds.read_chunk(ds.chunks(1)[0])


def test_a_cache_directory_under_home_spelled_with_a_tilde_is_under_home(tmp_path, monkeypatch, flaky):
    """`{"dir": "~/cache"}` made a directory named `~` in the working directory and cached there."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    Dataset.from_path("d", "flaky://bucket", cache={"enabled": True, "dir": "~/cache"}, retry_delay=0)
    assert len(list((tmp_path / "home" / "cache").iterdir())) == 1
    assert not (tmp_path / "~").exists()


def test_local_shards_are_never_copied(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_bytes(jsonl_bytes([{"i": 0}]))
    cache = tmp_path / "cache"
    ds = Dataset.from_path("d", str(tmp_path / "data"), cache={"enabled": True, "dir": str(cache)})
    assert ds.read_chunk(ds.chunks(1)[0]).records == [{"i": 0}]
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("reads_before_failing", [0, 2])
def test_a_copy_that_fails_halfway_leaves_nothing_and_the_retry_reads_the_whole_shard(tmp_path, object_store,
                                                                                     reads_before_failing):
    """A partial copy left in the cache was read as the whole shard, by the retry and by every
    later run: records vanished from the plan with no error and no skip."""
    records = [{"text": f"record number {i}"} for i in range(200)]
    put("objstore://bucket/a.jsonl", jsonl_bytes(records))
    cache = {"enabled": True, "dir": str(tmp_path / "cache")}
    object_store.failing_reads, object_store.reads_before_failing = 1, reads_before_failing
    ds = Dataset.from_path("d", "objstore://bucket", cache=cache, retries=3, retry_delay=0)
    assert object_store.failing_reads == 0, "the transient error must have hit the copy"
    assert [record for chunk in ds.chunks(50) for record in ds.read_chunk(chunk).records] == records
    assert Dataset.from_path("d", "objstore://bucket", cache=cache, retry_delay=0).num_records == len(records)
    assert [path.read_bytes() for path in (tmp_path / "cache").iterdir()] == [jsonl_bytes(records)]


def test_workers_copying_a_shard_at_once_never_read_a_partial_copy(tmp_path, object_store):
    """A cache set through io_options applies after planning, so the workers' first reads copy the
    shards, several at once; one that read another's unfinished copy lost records, and the
    batches then differed by runner."""
    object_store.read_delay_s = 0.002
    for shard in range(2):
        put(f"objstore://corpus/part-{shard}.jsonl",
            jsonl_bytes([{"text": f"shard {shard} holds record {i} " * 3} for i in range(64)]))
    dataset = Dataset.from_path("d", "objstore://corpus", retry_delay=0)
    reference = run_epoch(text_pipeline(dataset, runner="inline"), keep_batches=False)
    cached = run_epoch(text_pipeline(dataset, runner="thread").options(
        read_parallelism=4, io_options={"cache": {"enabled": True, "dir": str(tmp_path / "cache")}}), keep_batches=False)
    assert dict(cached.totals["d"]) == dict(reference.totals["d"]) == {"read": 128, "emitted": 128, "filtered": 0}
    assert cached.digests == reference.digests


_KILLED_MID_DOWNLOAD = """
import sys
from tests.unit.conftest_io import ObjectStoreFileSystem, jsonl_bytes, put, registered
from zephon.io import Dataset

with registered(ObjectStoreFileSystem) as store:
    put("objstore://elsewhere/a.jsonl", jsonl_bytes([{"text": "a record"}] * 64))
    store.read_delay_s = 3600  # the download hangs at its first read, until the process is killed
    Dataset.from_path("d", "objstore://elsewhere", cache={"enabled": True, "dir": sys.argv[1]})
"""


def _download_in_another_process(cache) -> tuple[subprocess.Popen, pathlib.Path]:
    """A process downloading into `cache`, hung mid-download, and its temporary file."""
    repository = pathlib.Path(__file__).parents[2]  # where `tests.unit.conftest_io` imports from
    process = subprocess.Popen([sys.executable, "-c", _KILLED_MID_DOWNLOAD, str(cache)], cwd=repository)
    while not (parts := list(cache.glob("*.part"))) or not _locked_by_another(parts[0]):
        assert process.poll() is None, "the downloading process ended before its download began"
        time.sleep(0.01)
    return process, parts[0]


def _locked_by_another(part: pathlib.Path) -> bool:
    """Whether another process holds the download's lock: the file exists a moment before."""
    handle = os.open(part, os.O_RDWR)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(handle)  # drops the lock where this process took it
    return False


def _download_another_shard(cache) -> None:
    put("objstore://bucket/b.jsonl", jsonl_bytes([{"i": 0}]))
    Dataset.from_path("d", "objstore://bucket", cache={"enabled": True, "dir": str(cache)}, retry_delay=0)


def test_a_download_killed_midway_leaves_a_temporary_file_that_a_later_download_removes(
    tmp_path, object_store
):
    """A process killed mid-download (SIGKILL, the OOM killer) left its temporary file in the cache
    for good; one still downloading, however long untouched, must keep it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    process, part = _download_in_another_process(cache)
    try:
        long_ago = time.time() - _atomic_cache.ABANDONED_AFTER_S - 1
        os.utime(part, (long_ago, long_ago))
        _download_another_shard(cache)
        assert part.exists(), "a download still in progress was removed"
    finally:
        process.kill()
        process.wait()
    # The download may have opened its file for writing after the first back-dating, which the
    # killed download's file would not have been touched since.
    os.utime(part, (long_ago, long_ago))
    for copy in cache.iterdir():
        if copy != part:
            copy.unlink()  # so that the shard is downloaded again
    _download_another_shard(cache)
    assert not part.exists()
    assert [copy.read_bytes() for copy in cache.iterdir()] == [jsonl_bytes([{"i": 0}])]


@pytest.mark.parametrize("whose", ["recent", "another host's", "not a download's"])
def test_temporary_files_that_may_belong_to_a_live_download_are_left(tmp_path, object_store, whose):
    """Another host's lock may not be visible here, and a file just made may not be locked yet."""
    cache = tmp_path / "cache"
    cache.mkdir()
    host = "elsewhere-" + socket.gethostname() if whose == "another host's" else socket.gethostname()
    name = f"{'0' * 64}.{host}.abcdefgh.part" if whose != "not a download's" else "notes.part"
    left = cache / name
    left.write_bytes(b"{")
    if whose != "recent":
        long_ago = time.time() - _atomic_cache.ABANDONED_AFTER_S - 1
        os.utime(left, (long_ago, long_ago))
    _download_another_shard(cache)
    assert left.read_bytes() == b"{"


def test_every_read_of_a_memory_shard_has_a_position_of_its_own():
    """fsspec's memory filesystem hands every opener of a file the one object it stores: a read
    that seeks moved the position of every other read of that shard (thread-runner workers reading
    two chunks of one shard), so they read each other's lines."""
    root = memory_root()
    put(f"{root}/a.jsonl", jsonl_bytes([{"i": i} for i in range(64)]))
    ds = Dataset.from_path("d", root)
    shard = ShardFile(ds.shards[0].url, ds._access[0].path, None, ds._filesystems()[1])
    with shard.open() as first, shard.open() as second:
        first.seek(100)
        assert second.read(8) == b'{"i": 0}'


def test_threads_reading_chunks_of_one_memory_shard_get_their_own_records():
    """The same through `read_chunk` on many threads at once (the thread runner's read stage)."""
    import sys
    import threading

    root = memory_root()
    records = [{"text": f"record {i} " + "x" * (i % 50)} for i in range(2000)]
    put(f"{root}/a.jsonl", jsonl_bytes(records))
    ds = Dataset.from_path("d", root)
    chunks = ds.chunks(50)
    threads = 16
    barrier, wrong = threading.Barrier(threads), []

    def read(k: int) -> None:
        barrier.wait()
        for _ in range(30):
            for chunk in chunks[k::threads]:
                got = ds.read_chunk(chunk)
                if got.records != records[chunk.start:chunk.stop] or got.skipped:
                    wrong.append(chunk)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # with the GIL: switch threads between a read's seek and its read
    try:
        workers = [threading.Thread(target=read, args=(k,)) for k in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []


class _FullDisk:
    """A file opened for writing on a disk that is full (or over its quota): writes fail."""

    def __init__(self, code: int) -> None:
        self.code = code

    def write(self, data):
        raise OSError(self.code, os.strerror(self.code))

    def close(self):
        pass


@pytest.mark.parametrize(("step", "code"), [("write", errno.ENOSPC), ("write", errno.EDQUOT),
                                             ("create", errno.EROFS), ("create", errno.EACCES)])
@pytest.mark.parametrize("when", ["planning", "reading"])
def test_a_cache_disk_that_is_full_or_read_only_is_a_named_error_at_once_not_a_failing_shard(
    tmp_path, object_store, monkeypatch, when, step, code
):
    """Writing the copy failed on the local disk (full, over quota, read-only, not writable) and
    was retried as if the remote had failed, then reported as the shard being unavailable: the
    user was sent to check the remote store, not the cache directory."""
    put("objstore://bucket/a.jsonl", jsonl_bytes([{"i": i} for i in range(5)]))
    directory = tmp_path / "cache"
    cache = {"enabled": True, "dir": str(directory)}
    downloads = []
    copy = ObjectStoreFileSystem.get_file
    monkeypatch.setattr(ObjectStoreFileSystem, "get_file",
                        lambda self, *args, **kwargs: downloads.append(1) or copy(self, *args, **kwargs))
    if step == "write":  # fsspec's get_file opens the temporary copy with the built-in open
        monkeypatch.setattr(fsspec.spec, "open", lambda *args, **kwargs: _FullDisk(code), raising=False)
    else:
        def refuse(*args, **kwargs):
            raise OSError(code, os.strerror(code), str(directory))
        monkeypatch.setattr(_atomic_cache.tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigurationError, match=f"cache directory {directory} cannot be written") as caught:
        if when == "planning":
            Dataset.from_path("d", "objstore://bucket", cache=cache, retries=3, retry_delay=0)
        else:
            ds = Dataset.from_path("d", "objstore://bucket", retries=3, retry_delay=0).with_io_options({"cache": cache})
            ds.read_chunk(ds.chunks(5)[0])
    assert os.strerror(code) in str(caught.value) and errno.errorcode[code] in str(caught.value)
    remedy = {errno.ENOSPC: "free space on its disk", errno.EDQUOT: "quota", errno.EROFS: "mounted read-only",
              errno.EACCES: "write permission"}[code]
    assert remedy in str(caught.value), "the error told the operator to do something that cannot help"
    if code != errno.ENOSPC:
        assert "free space on its disk" not in str(caught.value)
    assert len(downloads) <= 1, "a local disk error was retried as if the remote had failed"
    assert not list(directory.glob("*.part")), "the temporary copy was left behind"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow"])
def test_an_http_dataset_whose_server_answers_no_range_requests_is_read_chunk_by_chunk_from_each_shards_start(
    scheme, fmt, tmp_path, caplog
):
    """`python -m http.server` answers a range request with the whole file. Zephon plans such a
    directory, but fsspec refused every read of a chunk past the start of its shard ("The HTTP
    server doesn't appear to support range requests", a ValueError that failed the loader), and
    a Parquet shard's footer at planning. The shards are read from their start instead, chunks in
    any order, with the records of the local copy, and the cost is said once per dataset with the
    ways around it."""
    root = tmp_path / "site"
    (root / "data").mkdir(parents=True)
    if fmt == "jsonl":
        for shard in range(2):
            rows = [{"shard": shard, "i": i, "text": "w" * (i % 200)} for i in range(3_000)]
            (root / "data" / f"s{shard}.jsonl").write_bytes(jsonl_bytes(rows))
    else:  # over fsspec's 5 MiB block: a smaller file is fetched whole by its first read
        rows = [{"i": i, "text": base64.b64encode(os.urandom(1_200)).decode()} for i in range(6_000)]
        (root / "data" / f"s0.{fmt}").write_bytes(
            parquet_bytes(rows, row_group_size=500) if fmt == "parquet"
            else arrow_bytes(pa.Table.from_pylist(rows), [500] * 12))
    local = Dataset.from_path("d", str(root / "data"))
    with serving_over_http(root) as server, caplog.at_level(logging.WARNING, logger="zephon"):
        ds = Dataset.from_path("d", server.url("data/", scheme), retries=1)
        chunks = ds.chunks(500)
        read = {chunk: ds.read_chunk(chunk, on_error="raise").records for chunk in reversed(chunks)}
    assert [read[chunk] for chunk in chunks] == [local.read_chunk(chunk).records for chunk in local.chunks(500)]
    assert len(chunks) == 12
    said = [r.getMessage() for r in caplog.records if "does not answer range requests" in r.getMessage()]
    assert len(said) == 1 and "cache={'enabled': True}" in said[0]
