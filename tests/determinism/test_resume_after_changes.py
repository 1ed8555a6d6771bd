"""Resuming where the recipe's description changed: a corpus moved to another directory resumes to
the uninterrupted run's batches. Real SHA-256 digests of every global step.
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
