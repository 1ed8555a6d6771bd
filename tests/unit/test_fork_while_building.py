"""A process forked while another thread of the parent builds a loader (a trainer starting a
multiprocessing.Process, a torch DataLoader forking its workers, as a second loader is built on
another thread) copies the locks that building takes as they stand: held, by a thread the child
does not have. A child building a loader of its own from the same pipeline takes them again: the
work source's measurement lock (`_MixtureWorkSource._measuring`, held while a token estimate is
measured) and the tokenizer's pool decision (`_tokenizer._pool_decision.lock`, held while the
first tokenize operator decides tokenizers' own pool). The child must build and iterate its loader
as a process forked before or after that build would.

The locks are held for certain with events, as in `test_loader_fork`: the child has an alarm and
the parent waits for it with a deadline, so a child that hangs fails the test instead of hanging
the suite.
"""

from __future__ import annotations

import threading

import pytest

from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from tests.unit.test_loader_fork import GUARD_S, HoldOnce, hold_in_a_thread, run_in_a_child, what_the_child_wrote
from zephon import _tokenizer
from zephon.work import TokenEstimation


def _build_and_iterate(pipeline, layout):
    """The child's work: build a loader from `pipeline`, iterate it to its end, close it."""
    with pipeline.shard(0, 1, **layout) as loader:
        return [batch.digest() for batch in loader]


def _hold_measuring_in_a_build(pipeline, monkeypatch):
    """Another thread building a loader from the pipeline, held inside its token estimate's
    measurement, under the work source's `_measuring`."""
    held = HoldOnce(TokenEstimation.measure)
    monkeypatch.setattr(TokenEstimation, "measure", lambda self, dataset, count: held(self, dataset, count))
    held.arm()
    builder = threading.Thread(target=lambda: pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)).close())
    builder.start()
    return held, builder


def _hold_the_pool_decision(pipeline, monkeypatch):
    """Another thread holding the tokenizer's pool decision, as the first tokenize operator built
    in a process does while it decides tokenizers' pool and says so."""
    return hold_in_a_thread(_tokenizer._pool_decision.lock)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize(
    "hold", [_hold_measuring_in_a_build, _hold_the_pool_decision],
    ids=["measuring_held_by_a_token_estimate", "pool_decision_held_by_a_tokenize_operator"],
)
def test_a_child_forked_while_another_thread_builds_a_loader_builds_and_iterates_its_own(tmp_path, monkeypatch, hold):
    """Before, the child's loader waited for ever, as it was built, on the lock no thread of the
    child would release. Its batches are those of a loader built in an untouched process: a
    measurement the parent's thread had begun is made again in the child, to the same stats."""
    data = jsonl_dataset(tmp_path / "data")
    reference_pipeline = text_pipeline(data, runner="inline", estimate_tokens=True)
    layout = dict(global_batch_size=global_batch(reference_pipeline))
    with reference_pipeline.shard(0, 1, **layout) as loader:
        reference = [batch.digest() for batch in loader]
    pipeline = text_pipeline(data, runner="inline", estimate_tokens=True)
    held, thread = hold(pipeline, monkeypatch)
    out = tmp_path / "child.json"
    try:
        assert held.wait_inside(), "the lock is held"
        code = run_in_a_child(lambda: _build_and_iterate(pipeline, layout), out)
    finally:
        held.release()
        thread.join(GUARD_S)
    assert what_the_child_wrote(code, out) == reference
