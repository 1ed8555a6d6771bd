"""Finished work is freed by reference counting, not left for the cyclic garbage collector.

A reference cycle through a chunk's future keeps the chunk's records (token arrays, decoded
pixels) alive until a collection happens to run; on free-threaded 3.14 that let hundreds of
chunks pile up. With the collector off, only what the loader really holds may be alive.
"""

from __future__ import annotations

import gc

import pytest

from zephon import ChunkRecords, Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

NUM_LANES = 4
PREFETCH = 2


def live_chunks() -> int:
    return sum(1 for obj in gc.get_objects() if type(obj) is ChunkRecords)


@pytest.mark.parametrize("runner", ["inline", "thread"])
def test_only_the_prefetch_window_of_chunks_stays_alive(demo_data_dir, demo_tokenizer_path, runner):
    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0,
                                     records_per_chunk=4)
    pipeline = (
        Pipeline(source)
        .options(num_lanes=NUM_LANES, runner=runner, prefetch=PREFETCH)
        .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text", parallelism=2)
        .pack_flat(max_length=512, algorithm="wrap")
        .shuffle(buffer_size=4, seed=0)
        .batch(microbatch_size=4)
    )
    gc.collect()
    gc.disable()
    try:
        most = 0
        with pipeline.shard(0, 1) as loader:
            for step, _ in enumerate(loader):
                if step % 10 == 9:
                    most = max(most, live_chunks())
                if step == 200:
                    break
    finally:
        gc.enable()
    # each lane: its prefetch window, plus the chunk it is packing and one being handed over
    assert most <= NUM_LANES * (PREFETCH + 2), f"{most} chunks alive"
