"""The default prefetch window: deep (8 chunks per worker) for small chunks, 4 per worker otherwise."""

from __future__ import annotations

import json

import pytest

from zephon import Pipeline
from zephon._prefetch import DEEP_WINDOW_EXTRA_BYTES, mean_chunk_raw_bytes
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

RECORDS_PER_CHUNK = 4


def loader_of(directory, tokenizer, parallelism: int, prefetch: int | None = None):
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(directory))], seed=0,
                                     records_per_chunk=RECORDS_PER_CHUNK)
    pipeline = (
        Pipeline(source)
        .options(num_lanes=2, runner="inline", prefetch=prefetch)
        .tokenize(tokenizer_id=str(tokenizer), field="text", parallelism=parallelism)
        .pack_flat(max_length=256, algorithm="wrap")
        .batch(microbatch_size=2)
    )
    return pipeline.shard(0, 1)


def write_documents(directory, shards: int, records: int, chars: int):
    directory.mkdir()
    for shard in range(shards):
        text = ("lane shard chunk " * (chars // 17 + 1))[:chars]
        lines = [json.dumps({"text": f"{index} {text}"}) + "\n" for index in range(records)]
        (directory / f"part-{shard}.jsonl").write_text("".join(lines), encoding="utf-8")
    return directory


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_small_chunks_get_eight_per_worker(make_jsonl_corpus, demo_tokenizer_path, parallelism):
    with loader_of(make_jsonl_corpus(3, 50), demo_tokenizer_path, parallelism) as loader:
        assert 4 * parallelism * mean_chunk_raw_bytes(loader.plan) <= DEEP_WINDOW_EXTRA_BYTES
        assert loader.prefetch == 8 * parallelism


def test_large_chunks_keep_four_per_worker(tmp_path, demo_tokenizer_path):
    # chunks of 4 records of 40 KB: 8 more of them (p=2) would hold 1.3 MB per lane
    directory = write_documents(tmp_path / "large", shards=2, records=8, chars=40_000)
    with loader_of(directory, demo_tokenizer_path, parallelism=2) as loader:
        assert 8 * mean_chunk_raw_bytes(loader.plan) > DEEP_WINDOW_EXTRA_BYTES
        assert loader.prefetch == 8


def test_an_explicit_prefetch_is_kept(make_jsonl_corpus, demo_tokenizer_path):
    with loader_of(make_jsonl_corpus(3, 50), demo_tokenizer_path, parallelism=2, prefetch=3) as loader:
        assert loader.prefetch == 3


def test_the_mean_from_shard_sizes_is_the_mean_of_the_chunks(tmp_path):
    # shards of 9 records: every shard ends with a short chunk of one record
    directory = write_documents(tmp_path / "mixed", shards=3, records=9, chars=300)
    dataset = Dataset.from_path("d", str(directory))
    chunks = dataset.chunks(RECORDS_PER_CHUNK)
    exact = sum(dataset.raw_bytes(chunk) for chunk in chunks) / len(chunks)

    class Plan:
        datasets = {"d": dataset}

        class source:
            records_per_chunk = RECORDS_PER_CHUNK

    assert len(chunks) == 9
    assert mean_chunk_raw_bytes(Plan) == pytest.approx(exact)
