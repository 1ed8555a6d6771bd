"""A Hypothesis state machine over pipeline iteration: take microbatches on any rank, checkpoint,
resume on another world size (and runner) from the last checkpoint, in any order.

Invariant: every microbatch ever delivered, at (step, lane, index), has the digest of the
uninterrupted single-rank run at the same (step, lane, index) — whatever was taken, saved and
resumed before it, and however often a resume re-delivers what came after the checkpoint.
A checkpoint of ranks that have taken different numbers of rows is refused by name, and the last good checkpoint stays; so is a resume that would split a step's
rest unevenly over the ranks, and the run resumes on the world size it ran on instead.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from tests.fuzz.conftest import fuzz_settings
from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from zephon import CheckpointError, merge_states

STEPS = 8  # the horizon: microbatches of later steps are not taken
WORLD_SIZES = (1, 2, 4)


@cache
def _dataset():
    root = Path(tempfile.mkdtemp(prefix="zephon-fuzz-resume-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return jsonl_dataset(root)


def pipeline(runner: str = "inline"):
    """An endless plan (num_epochs=None), a flush every 2 chunks, a shuffle buffer of 8 rows."""
    return text_pipeline(_dataset(), runner=runner, num_epochs=None, max_length=48)


@cache
def reference() -> dict[tuple[int, int, int], str]:
    out = {}
    p = pipeline()
    with p.shard(0, 1, global_batch_size=global_batch(p)) as loader:
        for batch in loader:
            if batch.step >= STEPS:
                break
            out[(batch.step, batch.lane, batch.index)] = batch.digest()
    return out


class IterateCheckpointResume(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.checkpoint = None
        self.delivered = 0
        self._open(1, "inline")

    def _open(self, world: int, runner: str) -> None:
        p = pipeline(runner)
        self.world = world
        self.loaders = [p.shard(rank, world, global_batch_size=global_batch(p)) for rank in range(world)]
        if self.checkpoint is not None:
            for loader in self.loaders:
                loader.load_state_dict(self.checkpoint)
        self.iterators = [iter(loader) for loader in self.loaders]
        self.at_horizon = [False] * world

    def _close(self) -> None:
        for loader in self.loaders:
            loader.close()

    @rule(rank=st.integers(0, max(WORLD_SIZES) - 1), n=st.integers(1, 6))
    def take(self, rank: int, n: int) -> None:
        rank %= self.world
        for _ in range(n):
            if self.at_horizon[rank]:
                return
            batch = next(self.iterators[rank])
            key = (batch.step, batch.lane, batch.index)
            if batch.step >= STEPS:
                self.at_horizon[rank] = True
                return
            assert batch.digest() == reference()[key], f"microbatch {key} differs from the uninterrupted run"
            self.delivered += 1

    @rule()
    def catch_up(self) -> None:
        """Every rank takes microbatches until it has taken as many as the furthest one: where the
        ranks of a trainer stand when it checkpoints."""
        target = max(map(_rows_taken, self.loaders))
        for rank, loader in enumerate(self.loaders):
            while not self.at_horizon[rank] and _rows_taken(loader) < target:
                self.take(rank, 1)

    @rule()
    def save(self) -> None:
        states = [loader.state_dict() for loader in self.loaders]
        if len({state["rows_taken"] for state in states}) > 1:  # an endless plan: no lane ever finishes
            with pytest.raises(CheckpointError, match="saved at different steps"):
                merge_states(states)
            return
        self.checkpoint = merge_states(states)

    @precondition(lambda self: self.checkpoint is not None)
    @rule(world=st.sampled_from(WORLD_SIZES), runner=st.sampled_from(["inline", "thread"]))
    def resume(self, world: int, runner: str) -> None:
        self._close()
        previous = self.world
        try:
            self._open(world, runner)
        except CheckpointError as exc:
            # A state saved partway through a step, on a world size that would split its rest
            # unevenly. The loaders resume on the world size that took it up, or saved it, before.
            assert "saved partway through step" in str(exc)
            self._close()
            self._open(previous, runner)

    def teardown(self) -> None:
        self._close()


def _rows_taken(loader) -> int:
    return loader.state_dict()["rows_taken"]


IterateCheckpointResume.TestCase.settings = fuzz_settings(ci=25, stateful_step_count=15)
TestIterateCheckpointResume = IterateCheckpointResume.TestCase
