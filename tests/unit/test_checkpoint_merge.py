"""merge_states combines rank states and never launders a damaged one."""

from __future__ import annotations

import copy

import pytest

from tests.harness import GLOBAL_BATCH, text_pipeline
from zephon import CheckpointError, merge_states


@pytest.fixture(scope="module")
def rank_states(make_jsonl_corpus, demo_tokenizer_path):
    pipeline = text_pipeline(make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path)
    states = []
    for rank in range(2):
        with pipeline.shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            it = iter(loader)
            for _ in range(6):
                next(it)
            states.append(loader.state_dict())
    return states


def test_merging_rank_states_covers_every_lane(rank_states):
    merged = merge_states(rank_states)
    assert sorted(map(int, merged["lanes"])) == list(range(8))
    assert merge_states([merged]) == merged


def test_merging_refuses_an_edited_state(rank_states):
    edited = copy.deepcopy(rank_states[0])
    edited["lanes"]["0"][1] += 5
    with pytest.raises(CheckpointError, match="checksum"):
        merge_states([edited, rank_states[1]])


def test_merging_refuses_overlapping_lanes_with_different_cursors(rank_states):
    other = merge_states(rank_states)
    with pytest.raises(CheckpointError, match="appears in two states"):
        merge_states([rank_states[0], _rebuilt(other, lane="0", skip_delta=1)])


def _rebuilt(state, lane, skip_delta):
    """A different but intact state: a cursor moved, the checksum recomputed as Zephon would."""
    from zephon._checkpoint import _checksum

    body = copy.deepcopy({k: v for k, v in state.items() if k != "checksum"})
    body["lanes"][lane][1] += skip_delta
    return {**body, "checksum": _checksum(body)}
