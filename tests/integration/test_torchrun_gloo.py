"""Under torchrun with the gloo backend: checkpoint on 2 processes, resume on 4 and on 1; every
global digest equals the uninterrupted single-process run's (SPEC §4, issue 3 item 3).

Each run is real separate processes that learn rank and world size from the process group
(`pipeline.shard()` with no rank), exchange microbatch digests and lane states by all-gather,
and share nothing but the state file rank 0 writes.
"""

from __future__ import annotations

import pytest

from tests.harness import step_digests, text_pipeline
from tests.integration._torchrun_worker import launch

CHECKPOINT_STEP = 3
RESUMED_STEPS = 3

pytestmark = pytest.mark.requires_torch


@pytest.fixture(scope="module")
def corpus_args(make_jsonl_corpus, demo_tokenizer_path) -> list[str]:
    a, b = make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12)
    return ["--corpus-a", str(a), "--corpus-b", str(b), "--tokenizer", str(demo_tokenizer_path)]


@pytest.fixture(scope="module")
def reference(make_jsonl_corpus, demo_tokenizer_path) -> list[str]:
    """The uninterrupted run: one rank, in this process, every step from 0."""
    pipeline = text_pipeline(make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path)
    return step_digests(pipeline, 1, CHECKPOINT_STEP + RESUMED_STEPS)


@pytest.fixture(scope="module")
def checkpoint(corpus_args, reference, tmp_path_factory):
    """2 processes run steps [0, CHECKPOINT_STEP) and rank 0 saves the gathered state."""
    tmp = tmp_path_factory.mktemp("torchrun")
    state = tmp / "state.json"
    before = launch(2, tmp / "before.json", *corpus_args, "--steps", str(CHECKPOINT_STEP), "--save", str(state))
    return before, state


def test_two_processes_match_the_single_process_run_before_the_checkpoint(checkpoint, reference):
    before, _ = checkpoint
    assert before["world_size"] == 2
    assert [before["digests"][str(s)] for s in range(CHECKPOINT_STEP)] == reference[:CHECKPOINT_STEP]


@pytest.mark.parametrize("world_size", [4, 1])
def test_resume_from_two_processes_matches_uninterrupted_run(world_size, checkpoint, corpus_args, reference, tmp_path):
    _, state = checkpoint
    after = launch(
        world_size, tmp_path / "after.json", *corpus_args,
        "--load", str(state), "--first-step", str(CHECKPOINT_STEP), "--steps", str(RESUMED_STEPS),
    )
    assert after["world_size"] == world_size
    resumed = [after["digests"][str(s)] for s in range(CHECKPOINT_STEP, CHECKPOINT_STEP + RESUMED_STEPS)]
    assert resumed == reference[CHECKPOINT_STEP:]
