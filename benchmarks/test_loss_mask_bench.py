"""What a loss mask costs the loader's thread: packing and assembling text rows, plain against masked.

The shipped corpus (`zephon/data`: KJV chapters + Jargon File entries) tokenized once with the
shipped tokenizer, then, each round, every document pushed through `pack_flat`'s wrap packer
(2048) and its rows assembled eight at a time, as the loader collates microbatches: the work on
the one thread that makes every decision. "plain" documents carry no mask (every token learned);
"masked" ones a `loss_mask` leaving out their first quarter, as `tokenize(prompt_field=...)`
writes it for a prompt. `extra_info` records ns per token; the ratio of the two is the mask's cost.

    pytest benchmarks/test_loss_mask_bench.py --benchmark-only
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

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


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_pack_and_assemble(benchmark, record_build, documents, masked: bool) -> None:
    records = []
    for ids in documents:
        record = {"input_ids": ids}
        if masked:
            record["loss_mask"] = np.arange(len(ids)) >= len(ids) // 4
        records.append(record)
    tokens = sum(len(ids) for ids in documents)
    timings = []

    def run():
        started = time.perf_counter()
        packer = WrapPacker(2048, 2, "input_ids")
        plans = []
        for index, record in enumerate(records):
            plans += packer.push((RecordAddress("d", "s", index), record))
        plans += packer.flush()
        for at in range(0, len(plans), MICROBATCH):
            FlatRowPlan.assemble_batch(plans[at : at + MICROBATCH])
        timings.append(time.perf_counter() - started)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    record_build.update(masked=masked, tokens=tokens, ns_per_token=min(timings) / tokens * 1e9)
