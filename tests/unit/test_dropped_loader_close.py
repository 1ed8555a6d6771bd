"""A loader dropped without close() has its runner closed, whichever thread's collection finds it.

A finalizer runs on the thread whose garbage collection finds the loader: a process runner's own
reader thread while it holds the runner's lock, or a stage thread of another loader's runner
while it holds a lock that the dropped runner's running items wait for. Closing the runner there
waited for that lock for ever. Each script below forces a collection at such a point (an
automatic one may land there), then checks that the dropped loader's runner is closed and that
the process exits; a watchdog ends a script that hangs, printing every thread's stack. A runner
whose close is still queued when the interpreter exits is closed there by its own exit hook.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest

_COLLECT_ON_THE_READER_UNDER_ITS_LOCK = """
import faulthandler, gc, os, sys, threading, time
from pathlib import Path
from runners import process
from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline

faulthandler.dump_traceback_later(60, exit=True)
dropped, collecting = threading.Event(), threading.Event()
dispatch_locked = process.ProcessRunner._dispatch_locked

def collect_under_the_lock(self, *args):  # where an automatic collection may land
    if dropped.is_set() and threading.current_thread() is self._reader and not collecting.is_set():
        collecting.set()
        gc.collect()
    return dispatch_locked(self, *args)

process.ProcessRunner._dispatch_locked = collect_under_the_lock

def slow(record):
    time.sleep(0.05)
    return record

pipeline = text_pipeline(jsonl_dataset(Path(sys.argv[1])), runner="process", map_fn=slow, num_epochs=None)
loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
batches = iter(loader)
next(batches)
runner = loader._runner
while len(runner._held) < 2:  # seconds of slow work in flight, whose replies come after the drop
    next(batches)
gc.disable()  # only the reader thread's collection finds the loader
del loader, batches
dropped.set()
if not collecting.wait(30):
    print("no reply reached the reader after the loader was dropped", flush=True)
    os._exit(4)
deadline = time.monotonic() + 30
while time.monotonic() < deadline and (runner._reader.is_alive() or runner.shm_directory is not None):
    time.sleep(0.05)
if runner._reader.is_alive() or runner.shm_directory is not None:
    print("the dropped loader's runner was not closed", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    os._exit(3)
print("closed", flush=True)
"""

_COLLECT_ON_ANOTHER_RUNNERS_THREAD_HOLDING_A_SHARED_LOCK = """
import faulthandler, functools, gc, os, sys, threading, time
from pathlib import Path
from runners import ThreadRunner
from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline

faulthandler.dump_traceback_later(60, exit=True)
shared = threading.Lock()  # what both loaders' maps take: a shared cache, a rate limiter
dropped, dropped_map_runs, held, collected = (threading.Event() for _ in range(4))

def dropped_loaders_map(record):
    if dropped.is_set():  # an item still running when its loader is dropped
        dropped_map_runs.set()
        held.wait()
        with shared:
            pass
    time.sleep(0.01)
    return record

def live_loaders_map(record):
    if dropped_map_runs.is_set() and not collected.is_set():
        with shared:
            held.set()
            gc.collect()  # where an automatic collection may land
        collected.set()
    return record

patient = functools.partial(ThreadRunner, close_timeout_s=600)  # waits for running items as long as it takes
data = jsonl_dataset(Path(sys.argv[1]))
dropped_pipeline = text_pipeline(data, runner=patient, map_fn=dropped_loaders_map, num_epochs=None)
live_pipeline = text_pipeline(data, runner=patient, map_fn=live_loaders_map, num_epochs=None)
loader = dropped_pipeline.shard(0, 1, global_batch_size=global_batch(dropped_pipeline))
batches = iter(loader)
next(batches)
runner = loader._runner
gc.disable()  # only the live loader's stage thread's collection finds the dropped loader
del loader, batches
dropped.set()
if not dropped_map_runs.wait(30):
    print("no item of the dropped loader ran after it was dropped", flush=True)
    os._exit(4)
live = live_pipeline.shard(0, 1, global_batch_size=global_batch(live_pipeline))
for _ in live:
    if collected.is_set():
        break
threads = [thread for pool in runner._pools for thread in pool.threads]
deadline = time.monotonic() + 30
while time.monotonic() < deadline and (not runner._closed or any(t.is_alive() for t in threads)):
    time.sleep(0.05)
if not runner._closed or any(t.is_alive() for t in threads):
    print("the dropped loader's runner was not closed", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    os._exit(3)
live.close()
print("closed", flush=True)
"""


def _run(script: str, data_dir, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-c", script, str(data_dir), *args], capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the process did not exit in 120 s: {hung.stdout!r} {hung.stderr!r}")


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_process_runner_loader_collected_on_the_runners_reader_thread_under_its_lock_is_closed(tmp_path):
    done = _run(_COLLECT_ON_THE_READER_UNDER_ITS_LOCK, tmp_path / "data")
    assert done.returncode == 0 and done.stdout.split() == ["closed"], done.stdout + done.stderr


def test_a_thread_runner_loader_collected_on_a_thread_holding_what_its_running_items_wait_for_is_closed(tmp_path):
    done = _run(_COLLECT_ON_ANOTHER_RUNNERS_THREAD_HOLDING_A_SHARED_LOCK, tmp_path / "data")
    assert done.returncode == 0 and done.stdout.split() == ["closed"], done.stdout + done.stderr


_EXIT_WITH_A_CLOSE_STILL_QUEUED = """
import gc, os, sys, threading
from pathlib import Path
from runners import process, thread
from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from zephon import _runner_closer

kind = sys.argv[2]
_runner_closer.start()
_runner_closer.close_later(threading.Event().wait)  # the closer is busy with an earlier close until exit
# what each runner's exit hook calls
exit_steps = {"process": (process.ProcessRunner, "_close"), "thread": (thread.ThreadRunner, "_stop_threads")}
runner_class, exit_step = exit_steps[kind]
original = getattr(runner_class, exit_step)

def reported(self):
    os.write(1, f"{exit_step}-on-{threading.current_thread().name}\\n".encode())
    return original(self)

setattr(runner_class, exit_step, reported)
pipeline = text_pipeline(jsonl_dataset(Path(sys.argv[1])), runner=kind, num_epochs=None)
loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
batches = iter(loader)
next(batches)
del loader, batches
gc.collect()
os.write(1, f"queued-{_runner_closer._queue.qsize()}\\n".encode())
"""


@pytest.mark.parametrize("kind, exit_step", [("thread", "_stop_threads"), ("process", "_close")])
def test_a_dropped_loaders_runner_whose_close_is_still_queued_at_exit_is_closed_by_its_exit_hook(
        tmp_path, kind, exit_step):
    done = _run(_EXIT_WITH_A_CLOSE_STILL_QUEUED, tmp_path / "data", kind)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["queued-1", f"{exit_step}-on-MainThread"], done.stdout + done.stderr


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_forked_child_closes_the_runners_of_its_own_dropped_loaders(tmp_path):
    """The parent's closer thread does not survive a fork: a child that took it for running would
    queue its dropped loaders' closes for ever."""
    from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
    from zephon import _runner_closer

    _runner_closer.start()
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="thread", num_epochs=None)
    child = os.fork()
    if child == 0:
        code = 3
        try:
            signal.alarm(60)  # a child stuck anywhere dies instead of hanging the test
            loader = pipeline.shard(0, 1, global_batch_size=global_batch(pipeline))
            batches = iter(loader)
            next(batches)
            runner = loader._runner
            del loader, batches
            gc.collect()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not runner._closed:
                time.sleep(0.05)
            code = 0 if runner._closed else 3
        finally:
            os._exit(code)
    assert os.waitpid(child, 0)[1] == 0, "the child's dropped loader had its runner closed"


_EXIT_WHILE_THE_CLOSER_CLOSES_A_THREAD_RUNNER = """
import faulthandler, os, sys, threading, time
from runners import ThreadRunner
from zephon import _runner_closer
from zephon._runner import Stage

faulthandler.dump_traceback_later(60, exit=True)
marker = sys.argv[1]
started = threading.Event()

def writes_when_done(x):
    started.set()
    time.sleep(1.0)
    with open(marker, "w") as out:
        out.write("finished")
    return x

runner = ThreadRunner(close_timeout_s=30)
runner.start([Stage("write", writes_when_done, 1)])
runner.submit(0, 1)
assert started.wait(30)
_runner_closer.start()
_runner_closer.close_later(runner.close)  # what a dropped loader's finalizer hands over
while not runner._pools[0]._stopped:  # the closer thread's close has begun: it waits for the item
    time.sleep(0.01)
os.write(1, b"exiting\\n")
"""


def test_interpreter_exit_while_the_closer_thread_closes_a_thread_runner_waits_for_its_running_items(tmp_path):
    """A thread runner never closed gets `close_timeout_s` at exit for its running items. One the
    closer thread was closing (a loader dropped just before exit) had left the exit hook's set when
    its close began, so exit did not wait, and the running item was cut off mid-call."""
    marker = tmp_path / "finished"
    done = _run(_EXIT_WHILE_THE_CLOSER_CLOSES_A_THREAD_RUNNER, marker)
    assert done.returncode == 0 and done.stdout.split() == ["exiting"], done.stdout + done.stderr
    assert marker.exists(), "the item running at exit was cut off instead of waited for"


_A_CLOSE_RAISING_SYSTEM_EXIT_THEN_ANOTHER = """
import faulthandler, sys, threading
from zephon import _runner_closer

faulthandler.dump_traceback_later(60, exit=True)
second_closed = threading.Event()

def close_raising_system_exit():  # a runner whose close calls something that raises it
    raise SystemExit(2)

_runner_closer.start()
_runner_closer.close_later(close_raising_system_exit)
_runner_closer.close_later(second_closed.set)
print("second-closed" if second_closed.wait(20) else "second-never-closed", flush=True)
"""


def test_a_close_raising_a_base_exception_on_the_closer_thread_is_logged_and_later_closes_still_run(tmp_path):
    """The closer thread caught only Exception: a close raising SystemExit (or any other
    BaseException) ended the thread without a word, and since it still counted as started, every
    loader dropped later in the process kept its runner (threads, workers, shared memory) open."""
    done = _run(_A_CLOSE_RAISING_SYSTEM_EXIT_THEN_ANOTHER, tmp_path)
    assert done.returncode == 0 and done.stdout.split() == ["second-closed"], done.stdout + done.stderr
    assert "SystemExit" in done.stderr, "the failed close is logged"


_ANOTHER_THREAD_CLOSES_A_RUNNER_AS_THE_EXIT_HOOK_GATHERS_THEM = """
import faulthandler, sys, threading, time
from runners import ThreadRunner, thread
from zephon._runner import Stage

faulthandler.dump_traceback_later(60, exit=True)
marker = sys.argv[1]
started = threading.Event()

def writes_when_done(x):
    started.set()
    time.sleep(0.5)
    with open(marker, "w") as out:
        out.write("finished")
    return x

running = ThreadRunner(close_timeout_s=30)
running.start([Stage("write", writes_when_done, 1)])
running.submit(0, 1)
idle = ThreadRunner()
idle.start([Stage("idle", lambda x: x, 1)])
assert started.wait(30)
closing, closed = threading.Event(), threading.Event()

def close_idle():  # another thread (the closer, a trainer's) closes a runner as exit begins
    closing.wait()
    idle.close()
    closed.set()

threading.Thread(target=close_idle, daemon=True).start()

iterations = []  # the iterations of the hook's set begun, in Python

def pause_the_exit_hook_between_two_runners(frame, event, arg):
    # A Python-level iteration of the hook's set, resumed after its first runner, lets the other
    # thread close one first: what a thread switch there (or free threading) does by chance.
    if event == "call" and frame.f_code.co_name == "__iter__" and frame.f_locals.get("self") is thread._started:
        if frame not in iterations:
            iterations.append(frame)
        elif not closing.is_set():
            closing.set()
            closed.wait(10)
    return None

sys.settrace(pause_the_exit_hook_between_two_runners)
"""


def test_a_runner_closed_on_another_thread_while_the_exit_hook_gathers_the_open_ones_breaks_no_exit_step(tmp_path):
    """The thread runners' exit hook listed its open runners by iterating a WeakSet in Python; a
    runner closed on another thread meanwhile (the closer thread's close) changed the set under
    it: the hook died on RuntimeError ("Set changed size during iteration"), so no other runner
    was stopped at exit and their running items were cut off."""
    marker = tmp_path / "finished"
    done = _run(_ANOTHER_THREAD_CLOSES_A_RUNNER_AS_THE_EXIT_HOOK_GATHERS_THEM, marker)
    assert done.returncode == 0 and "Error" not in done.stderr, done.stdout + done.stderr
    assert marker.exists(), "the open runner's running item was cut off at exit"
