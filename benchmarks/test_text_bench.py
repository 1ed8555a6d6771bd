"""Text pipeline throughput: usable (non-padding) tokens/s by runner x parallelism.

The race's text recipe on the shipped corpus (`zephon/data`: KJV chapters + Jargon File entries,
1.4 M tokens) and the shipped tokenizer: tokenize (parallelism p) → pack_flat wrap 2048 →
shuffle (16 rows per lane) → batch 8; 4 lanes, 16 records per chunk, one rank.

Each round times a fresh loader from its creation until `TOKENS` usable tokens have been
delivered: what a trainer waits for, start-up included (the rate after a warm-up is what
`python -m benchmarks.race` reports, side by side with the peers). `extra_info` records
tokens/s, time to first batch, the runner and why it was chosen, and the interpreter build
(`record_build`: Python version, free-threaded or not).

    pytest benchmarks/test_text_bench.py --benchmark-only        # about a minute on 2 cores
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

DATA = Path(__file__).resolve().parent.parent / "zephon" / "data"
RUNNERS = ["inline", "thread", "process"]
PARALLELISM = [1, 2, 4]
TOKENS = 1_500_000
ROUNDS = 2


def text_pipeline(runner: str, parallelism: int) -> Pipeline:
    source = StaticMixtureWorkSource(
        [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))],
        seed=0, records_per_chunk=16,
    )
    return (
        Pipeline(source)
        .options(num_lanes=4, runner=runner, flush_every_chunks=16)
        .tokenize(tokenizer_id=str(DATA / "tokenizer.json"), field="text", parallelism=parallelism, eos="<|eos|>")
        .pack_flat(max_length=2048, algorithm="wrap")
        .shuffle(buffer_size=16, seed=0)
        .batch(microbatch_size=8)
    )


@pytest.mark.parametrize("parallelism", PARALLELISM)
@pytest.mark.parametrize("runner", RUNNERS)
def test_text_pipeline_throughput(benchmark, record_build, runner: str, parallelism: int) -> None:
    if runner == "inline" and parallelism > 1:
        pytest.skip("the inline runner ignores parallelism")
    pipeline = text_pipeline(runner, parallelism)
    results = []

    def run():
        started = time.perf_counter()
        tokens = 0
        first = None
        with pipeline.shard(0, 1) as loader:
            info = loader.runner_info
            for batch in loader:
                if first is None:
                    first = time.perf_counter() - started
                tokens += batch.num_real_tokens
                if tokens >= TOKENS:
                    break
            delivered = time.perf_counter() - started  # before the loader's close, which no step waits for
        results.append((tokens, delivered, first, info))

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    tokens, seconds, first, info = max(results, key=lambda r: r[0] / r[1])
    record_build.update(
        runner=info["name"], runner_reason=info["reason"], parallelism=parallelism,
        usable_tokens=tokens, usable_tokens_per_s=tokens / seconds, time_to_first_batch_s=first,
    )
    assert tokens >= TOKENS
