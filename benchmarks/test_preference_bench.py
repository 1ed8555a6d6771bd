"""What packing preference pairs costs the loader's thread, against packing the same documents alone.

The shipped corpus tokenized once (`test_loss_mask_bench.documents`), each document cut to its first
1,024 ids so that every pair fits a 2,048-id row, each with a loss mask leaving out its first quarter
(a prompt). Each round, "pairs" pushes documents 2i and 2i+1 as one record's chosen and rejected
through `pack_pairs`' first-fit packer; "single" pushes every document alone through `pack_flat`'s
first-fit packer; both assemble their rows eight at a time, as the loader collates microbatches.
`extra_info` records ns per token; the ratio of the two is what keeping a pair together costs.

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


def _records(documents: list[np.ndarray], pairs: bool) -> list[tuple[RecordAddress, dict]]:
    masked = [_masked(ids) for ids in documents]
    if not pairs:
        return [(RecordAddress("d", "s", i), {"input_ids": ids, "loss_mask": mask})
                for i, (ids, mask) in enumerate(masked)]
    return [(RecordAddress("d", "s", i), {"chosen_ids": masked[2 * i][0], "chosen_loss_mask": masked[2 * i][1],
                                          "rejected_ids": masked[2 * i + 1][0],
                                          "rejected_loss_mask": masked[2 * i + 1][1]})
            for i in range(len(masked) // 2)]


@pytest.mark.parametrize("pairs", [False, True], ids=["single", "pairs"])
def test_pack_and_assemble(benchmark, record_build, documents, pairs: bool) -> None:  # noqa: F811
    records = _records(documents[: len(documents) // 2 * 2], pairs)
    op = PackPairsOp(ROW) if pairs else PackFlatOp(ROW, "first_fit")
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
    record_build.update(pairs=pairs, tokens=tokens[0], ns_per_token=min(timings) / tokens[0] * 1e9)
