"""What a resume from a checkpoint of another recipe accepts: the changes named in
`load_state_dict(state, accept_changes=[...])` and nothing else, never one that would move the
cursors (SPEC §3.3). The batches such a resume hands over are compared in
tests/determinism/test_resume_after_changes.py.
"""

from __future__ import annotations

import logging
import re

import pytest

from tests.reliability.harness import checkpoint_after, global_batch, jsonl_dataset, text_pipeline
from zephon import ConfigurationError, RecipeMismatchError

SHUFFLE_BUFFER = "operators[2].shuffle.buffer_size"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return jsonl_dataset(tmp_path_factory.mktemp("accept") / "mnt" / "corpus", name="a")


@pytest.fixture(scope="module")
def state(dataset):
    return checkpoint_after(text_pipeline(dataset), 1, 2)


def load(pipeline, state, **accept):
    """The first microbatch digest of a rank loader of `pipeline` after it loaded `state`."""
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader.load_state_dict(state, **accept)
        return next(iter(loader)).digest()


def test_a_refusal_of_a_change_that_may_be_accepted_says_how_to_accept_it(dataset, state):
    with pytest.raises(RecipeMismatchError) as refusal:
        load(text_pipeline(dataset, shuffle_buffer=16), state)
    assert refusal.value.changed == (SHUFFLE_BUFFER,)
    assert f"accept_changes={[SHUFFLE_BUFFER]!r}" in str(refusal.value)
    assert "not bit-identical to an uninterrupted run of either recipe" in str(refusal.value)


def test_a_named_change_is_accepted_and_logged_while_an_unnamed_one_is_still_refused(dataset, state, caplog):
    changed = text_pipeline(dataset, shuffle_buffer=16, max_length=96)
    with pytest.raises(RecipeMismatchError) as refusal:
        load(changed, state, accept_changes=[SHUFFLE_BUFFER])
    assert refusal.value.changed == ("operators[1].pack_flat.max_length",)
    assert re.search(
        rf"changed: operators\[1\]\.pack_flat\.max_length \(accept_changes named {re.escape(SHUFFLE_BUFFER)}\)",
        str(refusal.value),
    )
    both = [SHUFFLE_BUFFER, "operators[1].pack_flat.max_length"]
    with caplog.at_level(logging.WARNING, logger="zephon"):
        load(changed, state, accept_changes=both)
    assert f"accepting the changes named in accept_changes: {', '.join(both)}." in caplog.text


@pytest.mark.parametrize("named", [["operators[2].shuffle.buffer_sise"], [SHUFFLE_BUFFER, "plan.sead"]])
def test_a_key_named_that_is_no_recipe_key_is_refused_naming_it_and_a_close_one(dataset, state, named):
    """A typo must not pass silently: the checkpoint would resume while the user believed a change
    they named had been looked at."""
    with pytest.raises(ConfigurationError, match=re.escape(f"accept_changes names {named[-1]} (did you mean")) as refusal:
        load(text_pipeline(dataset, shuffle_buffer=16), state, accept_changes=named)
    assert "which is no recipe key" in str(refusal.value)
    assert f"changed: {SHUFFLE_BUFFER}" in str(refusal.value)


def test_a_key_left_named_after_the_new_recipe_saved_its_own_checkpoint_resumes_with_a_warning(dataset, caplog):
    """A job restarted from its first checkpoint of the new recipe still has accept_changes in its
    configuration: refused, it would stop at every restart until someone edited the job."""
    changed = text_pipeline(dataset, shuffle_buffer=16)
    own_state = checkpoint_after(changed, 1, 2)
    with caplog.at_level(logging.WARNING, logger="zephon"):
        resumed = load(changed, own_state, accept_changes=[SHUFFLE_BUFFER])
    assert resumed == load(changed, own_state)
    assert f"accept_changes names {SHUFFLE_BUFFER}, in which the checkpoint's recipe does not differ" in caplog.text
    assert "accepting the changes" not in caplog.text


# change -> the key named, which no resume may accept: its cursors would stand elsewhere
CURSOR_KEYS = {
    "seed": ({"seed": 8}, "plan.seed"),
    "records_per_chunk": ({"records_per_chunk": 8}, "plan.records_per_chunk"),
    "token_estimation": ({"estimate_tokens": True}, "plan.tokens_per_byte"),
    "flush_every_chunks": ({"flush_every_chunks": 3}, "flush_every_chunks"),
    "num_lanes": ({"num_lanes": 8}, "num_lanes"),
    "microbatch_size": ({"microbatch_size": 1}, "operators[3].batch.microbatch_size"),
}


@pytest.mark.parametrize("case", sorted(CURSOR_KEYS))
def test_a_change_that_would_move_the_cursors_is_refused_even_when_named(dataset, state, case):
    """Every key the refusal listed is named, as a user taking its word would."""
    change, key = CURSOR_KEYS[case]
    pipeline = text_pipeline(dataset, **change)
    with pytest.raises(RecipeMismatchError) as plain:
        load(pipeline, state)
    assert key in plain.value.changed
    assert "accept_changes" not in str(plain.value), "a refusal must not offer what would be refused in turn"
    with pytest.raises(RecipeMismatchError, match=rf"^accept_changes cannot accept (.*; )?{re.escape(key)}: "):
        load(pipeline, state, accept_changes=plain.value.changed)


def test_another_global_batch_size_is_refused_even_when_named(dataset, state):
    pipeline = text_pipeline(dataset)
    with pipeline.shard(0, 1, global_batch_size=2 * global_batch(pipeline)) as loader, pytest.raises(
        RecipeMismatchError, match="accept_changes cannot accept global_batch_size: a cursor's row count"
    ):
        loader.load_state_dict(state, accept_changes=["global_batch_size"])


def test_an_operator_added_before_the_batch_renumbers_its_microbatch_size_without_refusing_it(dataset, state):
    """A map added at the front renumbers every operator's keys (`operators[3].batch` becomes
    `operators[4].batch`): each is a change to name, and the microbatch size, the same, is not one
    that moves the cursors."""
    pipeline = text_pipeline(dataset, map_fn=_kept)
    with pytest.raises(RecipeMismatchError) as refusal:
        load(pipeline, state)
    assert {"operators[3].batch.microbatch_size", "operators[4].batch.microbatch_size"} <= set(refusal.value.changed)
    load(pipeline, state, accept_changes=refusal.value.changed)


def _kept(record: dict) -> dict:
    return record


def test_accept_changes_given_as_one_string_is_refused_saying_to_list_it(dataset, state):
    with pytest.raises(ConfigurationError, match=re.escape(f"accept_changes=[{SHUFFLE_BUFFER!r}]")):
        load(text_pipeline(dataset, shuffle_buffer=16), state, accept_changes=SHUFFLE_BUFFER)


def test_a_refused_accept_changes_leaves_the_loader_as_it_was(dataset, state):
    pipeline = text_pipeline(dataset, shuffle_buffer=16)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(ConfigurationError):
            loader.load_state_dict(state, accept_changes=["plan.sed"])
        assert loader.state_dict()["lanes"] == {str(lane): [0, 0, 0] for lane in range(4)}
