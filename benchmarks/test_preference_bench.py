"""What packing preference pairs, or labelled documents, costs the loader's thread, against packing
the same documents alone.

The shipped corpus tokenized once (`test_loss_mask_bench.documents`), each document cut to its first
1,024 ids so that every pair fits a 2,048-id row, each with a loss mask leaving out its first quarter
(a prompt). Each round, "pairs" pushes documents 2i and 2i+1 as one record's chosen and rejected
through `pack_pairs`' first-fit packer; "single" pushes every document alone through `pack_flat`'s
first-fit packer; "labelled" pushes them alone with a KTO label and a weight each, carried into the
rows (`document_values`); all assemble their rows eight at a time, as the loader collates
microbatches. `extra_info` records ns per token; the ratios to "single" are what keeping a pair
together and carrying a document's values cost.

    pytest benchmarks/test_preference_bench.py --benchmark-only
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from benchmarks.test_loss_mask_bench import documents  # noqa: F401  (a fixture)
from zephon import SegmentContext
from zephon._packing import FlatRowPlan, PackFlatOp
from zephon._preference import PackPairsOp
from zephon._records import RecordAddress

ROW = 2048
MICROBATCH = 8
ROUNDS = 5


def _masked(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = ids[: ROW // 2]
    return ids, np.arange(len(ids)) >= len(ids) // 4


def _records(documents: list[np.ndarray], kind: str) -> list[tuple[RecordAddress, dict]]:
    masked = [_masked(ids) for ids in documents]
    if kind != "pairs":
        values = (lambda i: {"label": i % 3 != 0, "weight": 1 + i / 1000}) if kind == "labelled" else (lambda i: {})
        return [(RecordAddress("d", "s", i), {"input_ids": ids, "loss_mask": mask, **values(i)})
                for i, (ids, mask) in enumerate(masked)]
    return [(RecordAddress("d", "s", i), {"chosen_ids": masked[2 * i][0], "chosen_loss_mask": masked[2 * i][1],
                                          "rejected_ids": masked[2 * i + 1][0],
                                          "rejected_loss_mask": masked[2 * i + 1][1]})
            for i in range(len(masked) // 2)]


OPS = {"single": PackFlatOp(ROW, "first_fit"), "pairs": PackPairsOp(ROW),
       "labelled": PackFlatOp(ROW, "first_fit", document_values=("label", "weight"))}


@pytest.mark.parametrize("kind", list(OPS))
def test_pack_and_assemble(benchmark, record_build, documents, kind: str) -> None:  # noqa: F811
    records = _records(documents[: len(documents) // 2 * 2], kind)
    op = OPS[kind]
    timings, tokens = [], []

    def run():
        started = time.perf_counter()
        packer = op.factory(2)(SegmentContext(lane=0, segment=0))
        plans = [plan for record in records for plan in packer.push(record)] + packer.flush()
        for at in range(0, len(plans), MICROBATCH):
            FlatRowPlan.assemble_batch(plans[at : at + MICROBATCH])
        timings.append(time.perf_counter() - started)
        tokens.append(sum(plan.num_real_tokens for plan in plans))

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    assert len(set(tokens)) == 1, "every round packs the same tokens"
    record_build.update(kind=kind, tokens=tokens[0], ns_per_token=min(timings) / tokens[0] * 1e9)
