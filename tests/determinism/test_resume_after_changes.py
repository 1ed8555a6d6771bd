"""Resuming where the recipe's description changed: a corpus moved to another directory resumes to
the uninterrupted run's batches, and a recipe change accepted on purpose (`accept_changes`) goes on
from the cursors with the new recipe's batches. Real SHA-256 digests of every global step.
"""

from __future__ import annotations

import logging
import shutil

import pytest

from tests.harness import checkpoint_after, step_digests, text_pipeline

SAVED_AT = 5  # global steps taken before the checkpoint: lane 0 is past its first flush by then
AFTER = 5  # global steps compared after it


@pytest.fixture(scope="module")
def make(corpora, demo_tokenizer_path):
    return lambda a=corpora[0], b=corpora[1], **kw: text_pipeline(a, b, demo_tokenizer_path, **kw)


def _uninterrupted(pipeline) -> list[str]:
    return step_digests(pipeline, 1, SAVED_AT + AFTER)[SAVED_AT:]


@pytest.mark.parametrize("spelling", ["path", "file_url"])
def test_a_corpus_moved_to_another_directory_resumes_to_the_uninterrupted_runs_batches(
    make, corpora, tmp_path, caplog, spelling
):
    """The same shards copied under another root (`/mnt/a/corpus/*.jsonl` to
    `/scratch/corpus/*.jsonl`): their URLs changed, so the dataset list's digest did, and the
    checkpoint was refused as another recipe (`shard list changed (same count and total size)`).
    The plan reads no URL (chunks are cut by record counts, dealt by a seed of the dataset's name,
    weighed by the records), so the resume is taken up, warned of with both roots, and every later
    global batch is the uninterrupted run's; saved on 2 ranks, resumed on 4."""
    state = checkpoint_after(make(), 2, SAVED_AT)
    moved = [shutil.copytree(corpus, tmp_path / "scratch" / name) for corpus, name in zip(corpora, "ab")]
    urls = [f"file://{path}" if spelling == "file_url" else str(path) for path in moved]
    with caplog.at_level(logging.WARNING, logger="zephon"):
        resumed = step_digests(make(*urls), 4, AFTER, state=state, start_step=SAVED_AT)
    assert resumed == _uninterrupted(make())
    said = [r.getMessage() for r in caplog.records if "whose datasets moved" in r.getMessage()]
    assert said, caplog.text
    for corpus, path, label in zip(corpora, moved, ("dataset 0 ('a')", "dataset 1 ('b')")):
        assert f"{label}: {corpus}/ in the checkpoint, {path}/ now" in said[0]


def _misspelt(record: dict) -> dict:
    """The map as first shipped: it wrote 'alpha' for every 'beta' (each two tokens of the shipped
    tokenizer, so the fix changes token ids, not how many: the lanes' rows fall alike)."""
    return {**record, "text": record["text"].replace("beta", "alpha")}


def _fixed(record: dict) -> dict:
    """The map fixed: the text as written."""
    return record


@pytest.mark.parametrize(
    ("saved_with", "resumed_with", "key"),
    [
        ({"shuffle_seed": 42}, {"shuffle_seed": 5}, "operators[2].shuffle.seed"),
        ({"map_fn": _misspelt}, {"map_fn": _fixed}, "operators[0].map.fn"),
    ],
    ids=["shuffle_seed", "map_function_fixed"],
)
def test_an_accepted_recipe_change_goes_on_from_the_cursors_with_the_new_recipes_batches(
    make, caplog, saved_with, resumed_with, key
):
    """A change named in accept_changes resumes the checkpoint's cursors with the new recipe. Both
    changes here leave every lane's rows per segment as they were (a shuffle reorders within a
    segment; the fixed map gives as many tokens), so the new recipe's own run has the same cursors
    at the checkpoint's step, as asserted, and the resumed run must hand over exactly its later
    global batches: none of the old recipe's. Token estimation is left out for the map, whose
    measured rate would otherwise be part of the plan, which no resume may accept."""
    estimate = "map_fn" not in saved_with
    old, new = make(**saved_with, estimate_tokens=estimate), make(**resumed_with, estimate_tokens=estimate)
    state = checkpoint_after(old, 2, SAVED_AT)
    assert checkpoint_after(new, 2, SAVED_AT)["lanes"] == state["lanes"], "the premise: the same cursors"
    with caplog.at_level(logging.WARNING, logger="zephon"):
        resumed = step_digests(new, 2, AFTER, state=state, start_step=SAVED_AT, accept_changes=[key])
    expected = _uninterrupted(new)
    assert resumed == expected
    assert not set(expected) & set(_uninterrupted(old)), "the change must reach every later batch"
    assert f"accepting the changes named in accept_changes: {key}." in caplog.text
