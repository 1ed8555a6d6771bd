"""A rank's work per step grows with its lanes, not with their square.

A rank may own hundreds of lanes (1,024 on one rank, or on each of a few). In a finite plan the
loader looks past the lane that ends its part of a step (`RankLoader._look_past`) once per lane
per step; each look found its lane in the rank's lane list and copied the rest of the list, so a
step read the list once per lane (1,024 lanes: 11 ms a step).
"""

from __future__ import annotations

from collections.abc import Sequence

from tests.reliability.harness import clean_records, jsonl_lines, text_pipeline, write_lines
from zephon.io import Dataset

LANES = 32


class _CountedLanes(Sequence):
    """A rank's lane list that counts the lane numbers read from it (a slice reads each it holds)."""

    def __init__(self, lanes: list[int]) -> None:
        self._lanes, self.reads = list(lanes), 0

    def __len__(self) -> int:
        return len(self._lanes)

    def __getitem__(self, index):
        got = self._lanes[index]
        self.reads += len(got) if isinstance(index, slice) else 1
        return got


def test_a_finite_epoch_reads_the_ranks_lane_list_a_few_times_a_step_not_once_per_lane(tmp_path):
    for shard in range(4):
        write_lines(tmp_path / f"part-{shard:05d}.jsonl", jsonl_lines(clean_records(64, f"scale/{shard}")))
    pipeline = text_pipeline(Dataset.from_path("d", str(tmp_path)), num_lanes=LANES, num_epochs=1)
    with pipeline.shard(0, 1, global_batch_size=LANES * 2) as loader:
        loader.lanes = lanes = _CountedLanes(loader.lanes)
        steps = [batch.step for batch in loader]
    assert len(set(steps)) >= 3 and len(steps) > LANES, "the epoch must span steps of many lanes"
    # Opening the lanes reads the list once, and each round of the loader once (a step, plus at
    # most one round in which nothing is handed over, and the last); once per look past would be
    # LANES times a step.
    assert lanes.reads <= 3 * LANES * (steps[-1] + 2)
