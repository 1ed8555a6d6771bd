"""Datasets in an S3 bucket (`s3://bucket/prefix/`), read through s3fs as users read them, from a
real S3 endpoint: moto's server, in this process, on a local port. Every other remote test stands
an fsspec filesystem in for the store; these run s3fs, aiobotocore and botocore themselves."""

from __future__ import annotations

import io
import json
import logging
import sys
import tarfile
import threading
import uuid
from pathlib import Path

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from moto.server import ThreadedMotoServer
from s3fs.core import S3File, S3FileSystem
from s3fs.utils import FileExpired

from zephon import ConfigurationError
from zephon.io import Dataset, ShardUnavailableError
from zephon.io._retry import RetryPolicy
from zephon.io._version import forget_listing

from tests.reliability.harness import jsonl_dataset, run_epoch, text_pipeline

from .remote_shards import assert_read_on_many_threads_as_local, write_shards

_REGION = "us-east-1"
_KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


class _Endpoint:
    """moto's S3 server on a local port: its URL, the s3fs options that reach it, and a bucket each."""

    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        self.client = boto3.client("s3", endpoint_url=self.url, region_name=_REGION, **_KEYS)

    def options(self) -> dict:
        """s3fs's storage_options for this endpoint, botocore trying each request once (its own
        retries would wait seconds where a test stops the server)."""
        return {"key": _KEYS["aws_access_key_id"], "secret": _KEYS["aws_secret_access_key"],
                "client_kwargs": {"endpoint_url": self.url, "region_name": _REGION},
                "config_kwargs": {"retries": {"max_attempts": 1}}}

    def bucket_with(self, directory: Path) -> str:
        """A new bucket holding `directory`'s files under `data/`; its URL."""
        bucket = f"b-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=bucket)
        for path in sorted(directory.iterdir()):
            self.client.upload_file(str(path), bucket, f"data/{path.name}")
        return f"s3://{bucket}/data/"

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture
def endpoint():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    served = _Endpoint()
    yield served
    served.stop()


@pytest.mark.parametrize("naming", ["directory", "glob", "cached"])
def test_a_jsonl_dataset_in_a_bucket_is_planned_and_read_on_eight_threads_as_its_local_copy(
        endpoint, tmp_path, naming):
    write_shards(tmp_path / "local")
    url = endpoint.bucket_with(tmp_path / "local")
    options = {"cache": {"enabled": True, "dir": str(tmp_path / "cache")}} if naming == "cached" else {}
    ds = assert_read_on_many_threads_as_local(url + ("*.jsonl" if naming == "glob" else ""), tmp_path / "local",
                                              storage_options=endpoint.options(), **options)
    assert [shard.url for shard in ds.shards] == [f"{url}s{i}.jsonl" for i in range(8)]
    if naming == "cached":
        copies = sorted(path.read_bytes() for path in (tmp_path / "cache").iterdir())
        assert copies == sorted(path.read_bytes() for path in (tmp_path / "local").iterdir())


def test_a_parquet_dataset_in_a_bucket_is_read_in_row_groups_as_its_local_copy(endpoint, tmp_path):
    """Each chunk is read with ranged requests for its row groups (the footer, then the groups)."""
    (tmp_path / "local").mkdir()
    for shard in range(3):
        table = pa.table({"i": list(range(4000)), "text": [f"shard {shard} row {i} " * (i % 13) for i in range(4000)]})
        pq.write_table(table, tmp_path / "local" / f"p{shard}.parquet", row_group_size=500)
    url = endpoint.bucket_with(tmp_path / "local")
    local = Dataset.from_path("p", str(tmp_path / "local"))
    remote = Dataset.from_path("p", url, storage_options=endpoint.options())
    assert [s.num_records for s in remote.shards] == [4000] * 3
    expected = [local.read_chunk(chunk).records for chunk in local.chunks(700)]
    assert [remote.read_chunk(chunk, on_error="raise").records for chunk in remote.chunks(700)] == expected


def _shard_of(format: str, directory: Path) -> int:
    """One shard of about 6 MiB in `directory`; the records a chunk of it holds."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    if format == "jsonl":
        lines = (json.dumps({"i": i, "text": rng.bytes(48).hex()}) for i in range(50_000))
        (directory / "a.jsonl").write_text("\n".join(lines) + "\n")
        return 1000
    if format == "parquet":
        texts = [rng.bytes(60).hex() for _ in range(50_000)]
        pq.write_table(pa.table({"i": range(50_000), "text": texts}), directory / "a.parquet", row_group_size=5000)
        return 5000  # a row group a chunk: a chunk inside one reads all of it
    with tarfile.open(directory / "a.tar", "w") as tar:
        for i in range(120):
            for extension, payload in (("txt", f"record {i}".encode()), ("bin", rng.bytes(50_000))):
                member = tarfile.TarInfo(f"{i:05d}.{extension}")
                member.size = len(payload)
                tar.addfile(member, io.BytesIO(payload))
    return 16


@pytest.mark.parametrize("format", ["jsonl", "parquet", "webdataset"])
def test_reading_every_chunk_of_a_shard_fetches_about_the_shard_not_a_block_per_chunk(
        endpoint, tmp_path, monkeypatch, format):
    """Each chunk read opens the shard anew, and an s3fs file fetches a 50 MiB block beyond each
    read it cannot serve: reading a 24 MiB JSONL shard chunk by chunk fetched 2.4 GB. A chunk's
    lines and Parquet's spans are fetched as read, a tar chunk's members in one request."""
    per_chunk = _shard_of(format, tmp_path / "local")
    fetched = []
    fetch = S3File._fetch_range
    monkeypatch.setattr(S3File, "_fetch_range", lambda f, start, end: fetched.append(end - start) or fetch(f, start, end))
    ds = Dataset.from_path("d", endpoint.bucket_with(tmp_path / "local"), storage_options=endpoint.options())
    local = Dataset.from_path("d", str(tmp_path / "local"))
    chunks = ds.chunks(per_chunk)
    fetched.clear()
    assert [ds.read_chunk(chunk).records for chunk in chunks] == [local.read_chunk(c).records for c in local.chunks(per_chunk)]
    assert sum(fetched) <= 1.2 * ds.shards[0].nbytes, (sum(fetched), ds.shards[0].nbytes, len(chunks))
    assert len(fetched) <= 2 * len(chunks)  # a Parquet chunk: its footer, then its span


@pytest.mark.parametrize("runner", ["thread", "process"])
@pytest.mark.parametrize("cached", [False, True])
def test_a_text_pipeline_over_a_bucket_delivers_its_local_copy_s_batches(endpoint, tmp_path, runner, cached):
    """Two workers tokenizing; the process runner's are forked with the s3fs filesystem, whose
    event loop is the parent's (`Dataset.__getstate__`), and copy shards into the cache at their
    first reads."""
    local = jsonl_dataset(tmp_path / "local")
    remote = Dataset.from_path("d", endpoint.bucket_with(tmp_path / "local"), storage_options=endpoint.options())
    expected = run_epoch(text_pipeline(local, parallelism=2), keep_batches=False).digests
    pipeline = text_pipeline(remote, runner=runner, parallelism=2)
    if cached:
        pipeline = pipeline.options(io_options={"cache": {"enabled": True, "dir": str(tmp_path / "cache")}})
    assert run_epoch(pipeline, keep_batches=False).digests == expected
    if cached:
        copies = sorted(path.read_bytes() for path in (tmp_path / "cache").iterdir())
        assert copies == sorted(path.read_bytes() for path in (tmp_path / "local").iterdir())


@pytest.mark.parametrize("cached", [False, True])
def test_an_object_overwritten_after_planning_with_as_many_bytes_is_refused_naming_it(endpoint, tmp_path, cached):
    """Its ETag is its version: the records of the new object are not handed out under the
    addresses planned in the old one, from the bucket or from a copy in the cache. s3fs describes
    a file, and opens it, from the listing planning made: every check compared the planned ETag
    with itself, so the cache's copy of the new object was read, and reading the bucket failed
    only because s3fs's reads ask for the ETag the open saw (retried as a failing store)."""
    write_shards(tmp_path / "local")
    url = endpoint.bucket_with(tmp_path / "local")
    ds = Dataset.from_path("d", url, storage_options=endpoint.options(), retry_delay=0,
                           cache={"enabled": cached, "dir": str(tmp_path / "cache")})
    bucket, key = url[len("s3://"):].split("/", 1)
    planned = (tmp_path / "local" / "s3.jsonl").read_bytes()
    endpoint.client.put_object(Bucket=bucket, Key=f"{key}s3.jsonl", Body=planned.replace(b'"shard": 3', b'"shard": 9'))
    chunk = next(chunk for chunk in ds.chunks(100) if ds.shards[chunk.shard].url.endswith("s3.jsonl"))
    with pytest.raises(ShardUnavailableError, match=r"changed after planning \(planned: .*ETag") as caught:
        ds.read_chunk(chunk, on_error="raise")
    assert (caught.value.url, caught.value.attempts) == (f"{url}s3.jsonl", 1)  # refused as opened, not retried


def test_an_object_rewritten_between_its_open_and_its_read_is_refused_at_once_not_retried():
    """s3fs's reads ask for the ETag its open saw and refuse another (FileExpired, an OSError):
    retried as a failing store, each attempt refused the same, and the run ended naming neither
    the cause nor the plan."""
    def expired():
        raise FileExpired("b/data/s0.jsonl", '"0123"')

    with pytest.raises(ShardUnavailableError, match="changed after planning") as caught:
        RetryPolicy(3, 0).call("s3://b/data/s0.jsonl", expired)
    assert caught.value.attempts == 1


def test_a_read_whose_endpoint_went_away_is_retried_then_names_the_shard(endpoint, tmp_path):
    """botocore's connection errors are no OSError: a connection lost mid-run ended it with
    botocore's EndpointConnectionError, which Zephon's retry did not look at."""
    write_shards(tmp_path / "local")
    ds = Dataset.from_path("d", endpoint.bucket_with(tmp_path / "local"), storage_options=endpoint.options(),
                           retries=3, retry_delay=0)
    endpoint.stop()
    with pytest.raises(ShardUnavailableError, match="EndpointConnectionError") as caught:
        ds.read_chunk(ds.chunks(100)[0], on_error="raise")
    assert (caught.value.url, caught.value.attempts) == (ds.shards[0].url, 3)


def test_listing_a_bucket_whose_endpoint_is_out_of_reach_is_retried_not_taken_for_nothing_there(endpoint):
    endpoint.stop()
    with pytest.raises(ShardUnavailableError, match="EndpointConnectionError") as caught:
        Dataset.from_path("d", "s3://bucket/data/", storage_options=endpoint.options(), retries=2, retry_delay=0)
    assert caught.value.attempts == 2


def test_a_bucket_listed_without_credentials_is_a_configuration_error_saying_what_to_give(endpoint, tmp_path,
                                                                                        monkeypatch):
    write_shards(tmp_path / "local")
    url = endpoint.bucket_with(tmp_path / "local")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
    options = endpoint.options()
    del options["key"], options["secret"]
    with pytest.raises(ConfigurationError, match=r"found no credentials .*'anon': True") as caught:
        Dataset.from_path("d", url, storage_options=options, retry_delay=0)
    assert url in str(caught.value)


def test_listings_dropped_on_many_threads_at_once_raise_nothing():
    """Every chunk read drops its shard's listing and its directory's; fsspec's DirCache looks a key
    up and then deletes it, so on a thread runner two reads of one prefix at once had the second
    delete raise KeyError, which ended the run (3.14t). No request is made: dropping is local.
    Under a GIL the race does not show and the lister holds the droppers off for seconds (8 s
    alone, 49 s beside CI's other work), so they drop a tenth as often there."""
    rounds = 2_000 if getattr(sys, "_is_gil_enabled", lambda: True)() else 20_000
    fs = S3FileSystem(anon=True, skip_instance_cache=True)
    listing = [{"name": "b/data/s0.jsonl", "size": 1, "type": "file"}]
    errors, done = [], threading.Event()

    def list_again() -> None:
        while not done.is_set():
            fs.dircache["b/data"] = listing

    def drop() -> None:
        try:
            for _ in range(rounds):
                forget_listing(fs, "b/data/s0.jsonl")
        except KeyError as error:
            errors.append(error)

    lister = threading.Thread(target=list_again)
    lister.start()
    droppers = [threading.Thread(target=drop) for _ in range(4)]
    for thread in droppers:
        thread.start()
    for thread in droppers:
        thread.join()
    done.set()
    lister.join()
    assert errors == []
