"""A corpus moved to another directory (the same shards under another root) resumes to the same
batches, warned of with the old and new roots; moved and changed, it is another recipe (SPEC §3.3).
Every later global batch is compared in tests/determinism/test_resume_after_changes.py.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest

from tests.reliability.harness import checkpoint_after, global_batch, jsonl_dataset, run_epoch, text_pipeline
from zephon import RecipeMismatchError
from zephon.io import Dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return jsonl_dataset(tmp_path_factory.mktemp("moved") / "mnt" / "corpus", name="a")


@pytest.fixture(scope="module")
def state(dataset):
    return checkpoint_after(text_pipeline(dataset), 1, 2)


def load(pipeline, state) -> str:
    """The first microbatch digest of a rank loader of `pipeline` after it loaded `state`."""
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader.load_state_dict(state)
        return next(iter(loader)).digest()


def moved_copy(dataset: Dataset, to) -> Dataset:
    """`dataset`'s shards copied under `to`, listed there."""
    shutil.copytree(dataset.url, to)
    return Dataset.from_path(dataset.name, str(to))


def test_a_moved_corpus_resumes_to_the_same_batches_and_is_logged_with_both_roots(dataset, state, tmp_path, caplog):
    moved = moved_copy(dataset, tmp_path / "scratch" / "corpus")
    with caplog.at_level(logging.WARNING, logger="zephon"):
        resumed = run_epoch(text_pipeline(moved), 1, state=state, keep_batches=False).digests
    assert resumed == run_epoch(text_pipeline(dataset), 1, state=state, keep_batches=False).digests
    assert f"dataset 0 ('a'): {dataset.url}/ in the checkpoint, {tmp_path}/scratch/corpus/ now" in caplog.text


def test_a_moved_corpus_whose_shard_changed_is_refused_naming_both_roots(dataset, state, tmp_path):
    """Moved and rewritten: not the same shards, so another recipe, and the refusal says both."""
    to = tmp_path / "scratch" / "corpus"
    shutil.copytree(dataset.url, to)
    shard = to / "part-00001.jsonl"
    shard.write_bytes(shard.read_bytes() + json.dumps({"text": "one record more"}).encode() + b"\n")
    with pytest.raises(RecipeMismatchError) as refusal:
        load(text_pipeline(Dataset.from_path("a", str(to))), state)
    assert refusal.value.changed == ("plan.datasets",)
    assert f"under {dataset.url}/ in the checkpoint, {to}/ now)" in str(refusal.value)


def test_a_moved_corpus_beside_a_recipe_change_is_refused_naming_the_change_and_the_move(dataset, state, tmp_path):
    moved = moved_copy(dataset, tmp_path / "scratch" / "corpus")
    with pytest.raises(RecipeMismatchError) as refusal:
        load(text_pipeline(moved, shuffle_buffer=16), state)
    assert refusal.value.changed == ("operators[2].shuffle.buffer_size",)
    assert "The datasets moved, which alone is accepted: dataset 0 ('a')" in str(refusal.value)


def test_a_state_written_before_roots_were_saved_refuses_a_moved_corpus_as_before(dataset, state, tmp_path):
    """A version-6 summary holds no root: whether the shards only moved cannot be told."""
    from zephon._checkpoint import _checksum

    old = {k: v for k, v in json.loads(json.dumps(state)).items() if k != "checksum"}
    old["version"] = 6
    old["datasets"] = [{k: v for k, v in s.items() if k not in ("root", "shards_under_root")} for s in old["datasets"]]
    old = {**old, "checksum": _checksum(old)}
    moved = moved_copy(dataset, tmp_path / "scratch" / "corpus")
    assert load(text_pipeline(dataset), old) == load(text_pipeline(dataset), state)
    with pytest.raises(RecipeMismatchError, match=re.escape("shard list changed (same count and total size)")):
        load(text_pipeline(moved), old)
