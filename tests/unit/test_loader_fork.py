"""A process forked while another thread holds one of a loader's locks (a torch DataLoader forking
its workers, a trainer starting a multiprocessing.Process, as an asynchronous checkpointer saves or
the trainer's thread takes a microbatch) holds a copy of the loader whose locks are copied held,
by a thread the child does not have. The copy must still work in the child, as a copy forked
between two microbatches does: save, iterate with a runner of its own, close.

Each lock is held for certain with events: a save held inside `make_state` (under `_moving`), the
trainer's thread held inside the pipeline's map while it takes a microbatch (the inline runner
maps on that thread, under `_moving`), and another thread holding `_lifecycle` as a `close()`
does while it swaps the lanes out. The child reports what it got in a file; the parent waits for
it with a deadline, so a child that hangs fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback

import pytest

from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from zephon import _loader

GUARD_S = 30  # a hang guard only: the events below are set long before
CHILD_ALARM_S = 20  # a child stuck on a copied lock dies of its alarm...
CHILD_DEADLINE_S = 60  # ...and one that outlives this is killed by the parent
TAKEN_BEFORE = 2  # microbatches the parent hands over before a lock is held


class HoldOnce:
    """Calls `fn` through; the first call after `arm()` says so (`inside`) and waits for `go_on`
    first. Its state is private, so as a pipeline's map its fingerprint never changes, and a copy
    forked while it waits is disarmed: the child's calls go through."""

    def __init__(self, fn) -> None:
        self._fn = fn
        self._armed = False
        self._inside, self._go_on = threading.Event(), threading.Event()

    def __call__(self, *args):
        if self._armed:
            self._armed = False
            self._inside.set()
            assert self._go_on.wait(GUARD_S)
        return self._fn(*args)

    def arm(self) -> None:
        self._armed = True

    def wait_inside(self) -> bool:
        return self._inside.wait(GUARD_S)

    def entered(self) -> bool:
        return self._inside.is_set()

    def release(self) -> None:
        self._go_on.set()


def _exit_code_within(child: int, seconds: float) -> int | None:
    """The child's exit code, or None (and the child killed) if it has not exited in `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return None


def run_in_a_child(work, out) -> int | None:
    """Fork; the child runs `work` under an alarm and writes what it returns to `out` as JSON (its
    traceback, if it fails, beside it). Returns the child's exit code (None: it hung)."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler, copied with the test
            signal.alarm(CHILD_ALARM_S)
            out.write_text(json.dumps(work()))
            code = 0
        except BaseException:
            out.with_suffix(".error").write_text(traceback.format_exc())
        finally:
            os._exit(code)
    return _exit_code_within(child, CHILD_DEADLINE_S)


def what_the_child_wrote(code: int | None, out):
    """What `run_in_a_child` wrote, once its child has exited cleanly."""
    error = out.with_suffix(".error")
    assert code == 0, error.read_text() if error.exists() else f"the child hung ({code}: its alarm ended it)"
    return json.loads(out.read_text())


def hold_in_a_thread(lock):
    """Another thread holding `lock` until the returned HoldOnce is released; and that thread."""
    held = HoldOnce(lambda: None)
    held.arm()

    def holding() -> None:
        with lock:
            held()

    thread = threading.Thread(target=holding)
    thread.start()
    return held, thread


def _use_the_copy(loader):
    """The child's use of its copy: save its state, iterate it to its end, close it."""
    state = loader.state_dict()
    digests = [batch.digest() for batch in loader]
    loader.close()
    return {"state": state, "digests": digests}


def _use_the_titan_copy(titan):
    """The child's use of its ZephonDataLoader copy: save its state, iterate it to its end, close it."""
    used = {"state": titan.local_state_dict(), "batches": list(titan)}
    titan.close()
    return used


def _hold_moving_in_a_save(loader, map_fn, monkeypatch, batches, taken):
    """A save on another thread, held inside `make_state`, under `_moving`."""
    held = HoldOnce(_loader.make_state)
    monkeypatch.setattr(_loader, "make_state", held)
    held.arm()
    saver = threading.Thread(target=loader.state_dict)
    saver.start()
    return held, saver


def _hold_moving_in_a_microbatch(loader, map_fn, monkeypatch, batches, taken):
    """The trainer's thread, held inside the map while it takes a microbatch, under `_moving`:
    it asks for microbatches until one maps a record (one whose chunks were mapped already is
    handed over, into `taken`)."""
    map_fn.arm()

    def trainer() -> None:
        while not map_fn.entered():
            taken.append(next(batches).digest())

    thread = threading.Thread(target=trainer)
    thread.start()
    return map_fn, thread


def _hold_lifecycle(loader, map_fn, monkeypatch, batches, taken):
    """Another thread holding `_lifecycle`, as `close()` does while it swaps the lanes out."""
    return hold_in_a_thread(loader._lifecycle)


def _pipeline_with_a_map_to_hold(tmp_path):
    """(its map, which a test can hold inside a record; the inline pipeline; its shard layout; the
    digests of its whole run)."""
    map_fn = HoldOnce(lambda record: record)
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", map_fn=map_fn)
    layout = dict(global_batch_size=global_batch(pipeline))
    with pipeline.shard(0, 1, **layout) as loader:
        reference = [batch.digest() for batch in loader]
    return map_fn, pipeline, layout, reference


def _assert_the_copy_went_on_after(handed_over: int, child: dict, same_point, reference: list[str]) -> None:
    """The child saved the state of a loader that handed over `handed_over` microbatches (as
    `same_point` does once it has) and iterated on from the next."""
    with same_point:
        assert [batch.digest() for _, batch in zip(range(handed_over), same_point)] == reference[:handed_over]
        expected_state = same_point.state_dict()
    assert child["state"] == expected_state
    assert child["digests"] == reference[handed_over:]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize(
    "hold", [_hold_moving_in_a_save, _hold_moving_in_a_microbatch, _hold_lifecycle],
    ids=["moving_held_by_a_save", "moving_held_by_the_trainer_taking_a_microbatch", "lifecycle_held_by_a_close"],
)
def test_a_child_forked_while_another_thread_holds_a_loader_lock_saves_iterates_and_closes_its_copy(
        tmp_path, monkeypatch, hold):
    """The child's copy is the loader as it stood after its last microbatch handed over: it saves
    that state and hands over the rest of the run's batches. Before, the child's first save or
    `next()` waited for ever on the lock no thread of the child would release."""
    map_fn, pipeline, layout, reference = _pipeline_with_a_map_to_hold(tmp_path)
    loader = pipeline.shard(0, 1, **layout)
    batches = iter(loader)
    taken = [next(batches).digest() for _ in range(TAKEN_BEFORE)]
    held, thread = hold(loader, map_fn, monkeypatch, batches, taken)
    out = tmp_path / "child.json"
    try:
        assert held.wait_inside(), "the lock is held"
        handed_over = len(taken)  # the held microbatch, if any, is added once it is released
        code = run_in_a_child(lambda: _use_the_copy(loader), out)
    finally:
        held.release()
        thread.join(GUARD_S)
    try:
        child = what_the_child_wrote(code, out)
        rest = [batch.digest() for batch in batches]
        assert taken + rest == reference, "the parent goes on undisturbed"
        _assert_the_copy_went_on_after(handed_over, child, pipeline.shard(0, 1, **layout), reference)
    finally:
        loader.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_child_forked_while_the_titan_loader_takes_a_local_batch_goes_on_from_the_batch_before(
        tmp_path, monkeypatch):
    """TorchTitan's ZephonDataLoader holds its rank loader's `_moving` over a whole local batch,
    taking its microbatches one by one and handing them back if it cannot yield them. Forked
    while the trainer's thread is inside that hold (here: held as the batch is stacked), the
    child has the microbatches counted as taken and a batch never yielded, which no thread of
    the child will hand back: the child's copy saved the state after that batch and went on
    from the batch after it. It must take up the state it yielded last, as the parent will."""
    from zephon.integrations.torchtitan import ZephonDataLoader

    collate = HoldOnce(lambda group: [batch.digest() for batch in group])  # no torch needed
    monkeypatch.setattr(ZephonDataLoader, "_collate", lambda self, group: collate(group))
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline")
    size = global_batch(pipeline)
    assert size // pipeline.microbatch_size > 1  # a local batch of several microbatches
    with ZephonDataLoader(pipeline, 0, 1, size, local_batch_size=size) as titan:
        reference = list(titan)
    titan = ZephonDataLoader(pipeline, 0, 1, size, local_batch_size=size)
    batches = iter(titan)
    taken = [next(batches) for _ in range(TAKEN_BEFORE)]
    collate.arm()
    trainer = threading.Thread(target=lambda: taken.append(next(batches)))
    out = tmp_path / "child.json"
    try:
        trainer.start()
        assert collate.wait_inside(), "the trainer's thread holds the local batch"
        code = run_in_a_child(lambda: _use_the_titan_copy(titan), out)
    finally:
        collate.release()
        trainer.join(GUARD_S)
    try:
        child = what_the_child_wrote(code, out)
        assert taken + list(batches) == reference, "the parent goes on undisturbed"
        with ZephonDataLoader(pipeline, 0, 1, size, local_batch_size=size) as same_point:
            same = iter(same_point)
            assert [next(same) for _ in range(TAKEN_BEFORE)] == reference[:TAKEN_BEFORE]
            expected_state = same_point.local_state_dict()
        assert child["batches"] == reference[TAKEN_BEFORE:]
        assert child["state"] == expected_state
    finally:
        titan.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_child_forked_while_a_rank_loader_takes_a_block_as_one_goes_on_from_the_block_s_start(tmp_path):
    """`RankLoader.take_as_one` hands a block's microbatches back in a child forked while the
    parent's thread is inside it only when `hand_back_a_block_cut_by_fork()` is called there, which
    the TorchTitan adapter did and any other caller of the public seam had to know to: the child's
    copy of a plain rank loader saved the state after the block and iterated on from the microbatch
    after it, the block's microbatches lost. The rank loader's own iteration, save, load and
    `take_as_one` now hand it back first."""
    map_fn, pipeline, layout, reference = _pipeline_with_a_map_to_hold(tmp_path)
    loader = pipeline.shard(0, 1, **layout)
    batches = iter(loader)
    taken = [next(batches).digest()]  # the map runs in the first three microbatches only: one before the block

    def take_until_a_record_is_mapped() -> list[str]:
        """A microbatch, then more until one maps a record (held there, the block's first taken)."""
        block = [next(batches).digest()]
        map_fn.arm()
        while not map_fn.entered():
            block.append(next(batches).digest())
        return block

    blocks = []
    trainer = threading.Thread(target=lambda: blocks.append(loader.take_as_one(take_until_a_record_is_mapped)))
    out = tmp_path / "child.json"
    try:
        trainer.start()
        assert map_fn.wait_inside(), "the trainer's thread is inside the block"
        assert loader._rows_taken == 2 * loader.microbatch_size, "the block took a microbatch before"
        code = run_in_a_child(lambda: _use_the_copy(loader), out)
    finally:
        map_fn.release()
        trainer.join(GUARD_S)
    try:
        child = what_the_child_wrote(code, out)
        rest = [batch.digest() for batch in batches]
        assert taken + blocks[0] + rest == reference, "the parent goes on undisturbed"
        _assert_the_copy_went_on_after(len(taken), child, pipeline.shard(0, 1, **layout), reference)
    finally:
        loader.close()
