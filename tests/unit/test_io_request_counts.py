"""What planning and reading ask of a remote store: on s3 or gcs every `info()` is a HEAD request
(tens of milliseconds, and billed), and fsspec's memory filesystem scans its whole store per `info()`."""

from __future__ import annotations

import random

import pytest

from zephon.io import Dataset, ShardUnavailableError

from .conftest_io import BufferedCountingStore, CountingStore, jsonl_bytes, parquet_bytes, put, registered

_RECORDS_PER_SHARD = 8


@pytest.fixture(params=[CountingStore, BufferedCountingStore], ids=["memory-like", "buffered"])
def store(request):
    with registered(request.param) as cls:
        CountingStore.asked.clear()
        yield cls


def _shards(store: type[CountingStore], n: int) -> list[str]:
    return [
        put(f"{store.protocol}://bucket/data/part-{i:03d}.jsonl",
            jsonl_bytes([{"shard": i, "i": j} for j in range(_RECORDS_PER_SHARD)]))
        for i in range(n)
    ]


def _planned(store: type[CountingStore], n: int, url: str = "data") -> tuple[Dataset, list[str]]:
    """A dataset of `n` fresh shards, planned from `url` (below the bucket) with the counts cleared first."""
    store.store.clear()
    shards = _shards(store, n)
    CountingStore.asked.clear()
    return Dataset.from_path("d", f"{store.protocol}://bucket/{url}", retry_delay=0), shards


@pytest.mark.parametrize(("url", "infos"), [("data", 0), ("data/*.jsonl", 0), ("data/part-000.jsonl", 1)])
def test_planning_takes_each_shards_size_and_version_from_the_listing_asking_no_shards_info(store, url, infos):
    """Planning asked `info()` of every shard for its version, one HEAD per shard on top of the
    listing, which already tells each file's size and ETag (here its creation time). A file named
    directly is asked for its details once, which tell that it is a file, its size and its version
    (they were asked for apart, and whether it is a directory before that). A buffered file asks
    for its own details when it is opened to be counted: those are the filesystem's, one per open."""
    ds, _ = _planned(store, 6, url)
    shard_urls = [shard.url for shard in ds.shards]
    opens = CountingStore.asked_of("open", shard_urls) if store is BufferedCountingStore else 0
    assert CountingStore.asked_of("info", shard_urls) == infos + opens
    assert sum(n for key, n in CountingStore.asked.items() if key[0] == "list") <= 1


@pytest.mark.parametrize("url", ["data", "data/*.jsonl", "data/part-000.jsonl"])
def test_what_a_url_names_is_asked_once_then_listed_at_most_once(url):
    """fsspec's `isdir` and then `isfile` each asked `info()` of the URL: two HEADs on s3 or gcs
    before a glob was expanded or a file named directly was planned. One `info()` tells a
    directory, a file and nothing apart."""
    with registered(CountingStore):
        _planned(CountingStore, 3, url)
        assert CountingStore.asked["info", f"bucket/{url}"] == 1
        assert sum(n for key, n in CountingStore.asked.items() if key[0] == "list") <= 1


def _listings_and_infos_of_planning(n: int) -> int:
    _planned(CountingStore, n)
    return sum(n for key, n in CountingStore.asked.items() if key[0] in ("list", "info"))


def test_planning_asks_as_many_listings_and_infos_for_many_shards_as_for_few():
    with registered(CountingStore):
        assert _listings_and_infos_of_planning(3) == _listings_and_infos_of_planning(30)


def test_planning_a_memory_dataset_scans_its_store_as_often_for_many_shards_as_for_few():
    """Each `info()` of fsspec's memory filesystem scans its whole store: asked once per shard,
    planning N shards took N scans of N files."""
    with registered(CountingStore):
        scans = []
        for n in (4, 40):
            _planned(CountingStore, n)
            scans.append(CountingStore.asked["scan"])
        assert scans[0] == scans[1]


def test_reading_every_chunk_asks_the_store_for_each_shards_version_only_through_its_open(store):
    """Every chunk read asked `info()` for the shard's version, and a buffered file (s3fs, gcsfs)
    asked it once more to open: two HEADs per chunk. The version is now taken from what the open
    learnt, so a memory-like store is asked no `info()` at all, a buffered one the open's only."""
    ds, _ = _planned(store, 3)
    chunks = ds.chunks(2)
    CountingStore.asked.clear()
    records = [record for chunk in chunks for record in ds.read_chunk(chunk).records]
    assert len(records) == 3 * _RECORDS_PER_SHARD
    shard_urls = [shard.url for shard in ds.shards]
    opens = CountingStore.asked_of("open", shard_urls)
    assert opens == len(chunks)
    assert CountingStore.asked_of("info", shard_urls) == (opens if store is BufferedCountingStore else 0)
    assert CountingStore.asked["scan"] == CountingStore.asked_of("info", shard_urls)  # the open's, if any


def test_a_shard_rewritten_after_planning_is_refused_by_the_version_its_open_tells(store):
    ds, shards = _planned(store, 2)
    assert ds.read_chunk(ds.chunks(4)[0]).records
    put(shards[0], jsonl_bytes([{"shard": 0, "i": 9 - j} for j in range(_RECORDS_PER_SHARD)]))  # as many bytes
    with pytest.raises(ShardUnavailableError, match="changed after planning") as caught:
        ds.read_chunk(ds.chunks(4)[1])
    assert caught.value.url == ds.shards[0].url and caught.value.attempts == 1


class _UnversionedListingStore(CountingStore):
    """Lists files by name, size and type alone (as some filesystems do); its `info()` tells more."""

    protocol = "unversioned"
    store: dict = {}
    pseudo_dirs: list = [""]

    def find(self, path, *args, **kwargs):
        found = super().find(path, *args, **kwargs)
        if not kwargs.get("detail"):
            return found
        return {name: {key: entry[key] for key in ("name", "size", "type")} for name, entry in found.items()}


def test_a_shard_whose_listing_tells_no_version_is_asked_for_it_so_a_rewrite_is_still_refused():
    with registered(_UnversionedListingStore):
        ds, shards = _planned(_UnversionedListingStore, 2)
        assert CountingStore.asked_of("info", shards) == 2
        put(shards[1], jsonl_bytes([{"shard": 1, "i": 9 - j} for j in range(_RECORDS_PER_SHARD)]))
        with pytest.raises(ShardUnavailableError, match="changed after planning"):
            ds.read_chunk(ds.chunks(8)[1])


def test_a_parquet_chunk_is_read_in_one_ranged_get_for_its_row_groups_not_one_per_column_chunk(monkeypatch):
    """Read on the calling thread without pyarrow's pre-buffering, a chunk asked the store for
    each column chunk of each row group apart: a ranged GET each where the file's block cache
    (fsspec's default block: 5 MiB) is smaller than a column chunk, 1 + 8 columns x 2 row
    groups here, where pre-buffering coalesced them into one. Now one GET reads the footer and one
    the chunk's row groups; a later chunk of the shard its row groups alone (`_parquet_footers`)."""
    monkeypatch.setattr(BufferedCountingStore, "block_size", 2048)
    text = random.Random(0)
    rows = [{f"c{i}": text.randbytes(400).hex() for i in range(8)} for _ in range(64)]
    with registered(BufferedCountingStore):
        url = put("bufstore://bucket/data/part-000.parquet", parquet_bytes(rows, row_group_size=16))
        ds = Dataset.from_path("d", url, retry_delay=0)
        chunk = ds.chunks(32)[0]
        CountingStore.asked.clear()
        assert ds.read_chunk(chunk).records == rows[:32]
        assert CountingStore.asked_of("get", [url]) == 2
        CountingStore.asked.clear()  # the next chunk's row groups only: the footer was parsed and kept
        assert ds.read_chunk(ds.chunks(32)[1]).records == rows[32:]
        assert CountingStore.asked_of("get", [url]) == 1
