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

import json
import os
import signal
import threading
import traceback

import pytest

from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from tests.unit.test_loader_fork import CHILD_ALARM_S, CHILD_DEADLINE_S, GUARD_S, HoldOnce, _exit_code_within
from zephon import _tokenizer
from zephon.work import TokenEstimation


def _fork_and_build(pipeline, layout, out) -> int | None:
    """Fork; the child builds a loader from `pipeline`, iterates it to its end and closes it,
    writing the batches' digests to `out`. Returns the child's exit code (None: it hung)."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler, copied with the test
            signal.alarm(CHILD_ALARM_S)
            with pipeline.shard(0, 1, **layout) as loader:
                out.write_text(json.dumps([batch.digest() for batch in loader]))
            code = 0
        except BaseException:
            out.with_suffix(".error").write_text(traceback.format_exc())
        finally:
            os._exit(code)
    return _exit_code_within(child, CHILD_DEADLINE_S)


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
    held = HoldOnce(lambda: None)
    held.arm()

    def deciding() -> None:
        with _tokenizer._pool_decision.lock:
            held()

    thread = threading.Thread(target=deciding)
    thread.start()
    return held, thread


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
        code = _fork_and_build(pipeline, layout, out)
    finally:
        held.release()
        thread.join(GUARD_S)
    error = out.with_suffix(".error")
    assert code == 0, error.read_text() if error.exists() else f"the child hung ({code}: its alarm ended it)"
    assert json.loads(out.read_text()) == reference
