"""Under torchrun with the gloo backend: checkpoint on 2 processes, resume on 4 and on 1, and
checkpoint those 4 to resume on 2; every global digest equals the uninterrupted single-process
run's (SPEC §4, issue 3 item 3).

Each run is real separate processes that learn rank and world size from the process group
(`pipeline.shard()` with no rank), exchange microbatch digests and lane states by all-gather,
and share nothing but the state file rank 0 writes. The shrink from 4 to 2 resumes from the state
the 4-process resume saved, so one torchrun launch (the slow part of this file) serves two tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import step_digests, text_pipeline
from tests.integration._torchrun_worker import launch

CHECKPOINT_STEP = 3
RESUMED_STEPS = 3
SECOND_CHECKPOINT_STEP = CHECKPOINT_STEP + RESUMED_STEPS

pytestmark = pytest.mark.requires_torch


@pytest.fixture(scope="module")
def corpus_args(make_jsonl_corpus, demo_tokenizer_path) -> list[str]:
    a, b = make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12)
    return ["--corpus-a", str(a), "--corpus-b", str(b), "--tokenizer", str(demo_tokenizer_path)]


@pytest.fixture(scope="module")
def reference(make_jsonl_corpus, demo_tokenizer_path) -> list[str]:
    """The uninterrupted run: one rank, in this process, every step from 0 to the last resumed one."""
    pipeline = text_pipeline(make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path)
    return step_digests(pipeline, 1, SECOND_CHECKPOINT_STEP + RESUMED_STEPS)


@pytest.fixture(scope="module")
def checkpoint(corpus_args, tmp_path_factory):
    """2 processes run steps [0, CHECKPOINT_STEP) and rank 0 saves the gathered state."""
    tmp = tmp_path_factory.mktemp("torchrun")
    state = tmp / "state.json"
    before = launch(2, tmp / "before.json", *corpus_args, "--steps", str(CHECKPOINT_STEP), "--save", str(state))
    return before, state


def resume(world_size: int, state: Path, first_step: int, folder: Path, corpus_args, *save: str) -> list[str]:
    """Launch `world_size` processes that load `state` and run RESUMED_STEPS steps from
    `first_step`; return those steps' global digests."""
    after = launch(
        world_size, folder / f"after-{world_size}.json", *corpus_args,
        "--load", str(state), "--first-step", str(first_step), "--steps", str(RESUMED_STEPS), *save,
    )
    assert after["world_size"] == world_size
    return [after["digests"][str(s)] for s in range(first_step, first_step + RESUMED_STEPS)]


@pytest.fixture(scope="module")
def resumed_on_four(checkpoint, corpus_args, tmp_path_factory):
    """4 processes resume the 2-process checkpoint, run steps [CHECKPOINT_STEP,
    SECOND_CHECKPOINT_STEP) and rank 0 saves the state gathered from the 4 ranks' lanes."""
    _, state = checkpoint
    tmp = tmp_path_factory.mktemp("torchrun-four")
    saved = tmp / "state.json"
    return resume(4, state, CHECKPOINT_STEP, tmp, corpus_args, "--save", str(saved)), saved


def test_two_processes_match_the_single_process_run_before_the_checkpoint(checkpoint, reference):
    before, _ = checkpoint
    assert before["world_size"] == 2
    assert [before["digests"][str(s)] for s in range(CHECKPOINT_STEP)] == reference[:CHECKPOINT_STEP]


def test_resume_from_two_processes_on_four_matches_uninterrupted_run(resumed_on_four, reference):
    resumed, _ = resumed_on_four
    assert resumed == reference[CHECKPOINT_STEP:SECOND_CHECKPOINT_STEP]


def test_resume_from_two_processes_on_one_matches_uninterrupted_run(checkpoint, corpus_args, reference, tmp_path):
    _, state = checkpoint
    resumed = resume(1, state, CHECKPOINT_STEP, tmp_path, corpus_args)
    assert resumed == reference[CHECKPOINT_STEP:SECOND_CHECKPOINT_STEP]


def test_resume_from_four_processes_on_two_matches_uninterrupted_run(resumed_on_four, corpus_args, reference, tmp_path):
    """The shrink: each of the 2 processes takes up the lanes 2 of the 4 saving ranks held."""
    _, state = resumed_on_four
    resumed = resume(2, state, SECOND_CHECKPOINT_STEP, tmp_path, corpus_args)
    assert resumed == reference[SECOND_CHECKPOINT_STEP:]
