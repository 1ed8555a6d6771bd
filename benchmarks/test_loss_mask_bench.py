"""What a loss mask costs the loader's thread: packing and assembling text rows, plain against masked.

The shipped corpus (`zephon/data`: KJV chapters + Jargon File entries) tokenized once with the
shipped tokenizer, then, each round, every document pushed through `pack_flat`'s wrap packer
(2048) and its rows assembled eight at a time, as the loader collates microbatches: the work on
the one thread that makes every decision. "plain" documents carry no mask (every token learned);
"masked" ones a `loss_mask` leaving out their first quarter, as `tokenize(prompt_field=...)`
writes it for a prompt. `extra_info` records ns per token; the ratio of the two is the mask's cost.
`test_count_rows` times the ledger's count of each of those rows as the loader hands it over, with
and without its learned tokens.

    pytest benchmarks/test_loss_mask_bench.py --benchmark-only
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

from zephon._ledger import Ledger
from zephon._packing import FlatRowPlan, WrapPacker
from zephon._records import RecordAddress
from zephon._tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parent.parent / "zephon" / "data"
MICROBATCH = 8
ROUNDS = 5


@pytest.fixture(scope="module")
def documents() -> list[np.ndarray]:
    tokenizer = load_tokenizer(str(DATA / "tokenizer.json")).tokenizer
    texts = [json.loads(line)["text"] for name in ("kjv", "jargon") for shard in sorted((DATA / name).glob("*.jsonl*"))
             for line in _lines(shard)]
    return [np.array(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def _lines(shard: Path) -> list[str]:
    data = shard.read_bytes()
    if shard.suffix == ".zst":
        data = zstandard.ZstdDecompressor().stream_reader(data).read()
    return data.decode("utf-8").splitlines()


def _records(documents: list[np.ndarray], masked: bool) -> list[dict]:
    """The documents as records, each with a mask leaving its first quarter out where `masked`."""
    records = []
    for ids in documents:
        record = {"input_ids": ids}
        if masked:
            record["loss_mask"] = np.arange(len(ids)) >= len(ids) // 4
        records.append(record)
    return records


def _pack(records: list[dict]) -> list[FlatRowPlan]:
    packer = WrapPacker(2048, 2, "input_ids")
    plans = []
    for index, record in enumerate(records):
        plans += packer.push((RecordAddress("d", "s", index), record))
    return plans + packer.flush()


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_pack_and_assemble(benchmark, record_build, documents, masked: bool) -> None:
    records = _records(documents, masked)
    tokens = sum(len(ids) for ids in documents)
    timings = []

    def run():
        started = time.perf_counter()
        plans = _pack(records)
        for at in range(0, len(plans), MICROBATCH):
            FlatRowPlan.assemble_batch(plans[at : at + MICROBATCH])
        timings.append(time.perf_counter() - started)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    record_build.update(masked=masked, tokens=tokens, ns_per_token=min(timings) / tokens * 1e9)


@pytest.mark.parametrize("learned", [False, True], ids=["tokens", "tokens_and_learned"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_count_rows(benchmark, record_build, documents, masked: bool, learned: bool) -> None:
    """The ledger's count of each row as the loader hands it over, with or without its learned
    tokens (`learned_by_dataset`): what counting them adds to the loader's thread."""
    plans = _pack(_records(documents, masked))
    tokens = sum(plan.num_real_tokens for plan in plans)
    timings = []

    def run():
        started = time.perf_counter()
        ledger = Ledger()
        counts = ledger.rows_of(0)
        for plan in plans:
            ledger.count_rows(counts, plan.num_real_tokens, plan.length, plan.tokens_by_dataset,
                              plan.images_by_dataset, plan.learned_by_dataset if learned else {})
        timings.append(time.perf_counter() - started)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    record_build.update(masked=masked, learned=learned, tokens=tokens, ns_per_token=min(timings) / tokens * 1e9)
