"""`auto` picks threads only where the interpreter runs without the GIL (or no process can start), and says why."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from runners import ProcessRunner, ThreadRunner, auto_runner, choose_runner, gil_enabled


def test_auto_chooses_processes_when_the_gil_is_enabled():
    name, reason = choose_runner(gil=True)
    assert name == "process"
    assert reason.startswith("auto: GIL enabled") and reason.endswith("→ process")


def test_auto_chooses_threads_when_the_gil_is_disabled():
    assert choose_runner(gil=False) == ("thread", "auto: GIL disabled (sys._is_gil_enabled() is False) → thread")


def test_auto_runner_follows_this_interpreter_and_logs_its_choice_at_debug(caplog):
    expected_gil = sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True
    assert gil_enabled() is expected_gil
    with caplog.at_level(logging.DEBUG, logger="runners.auto"):
        runner = auto_runner()
    try:
        assert isinstance(runner, ProcessRunner if expected_gil else ThreadRunner)
        assert runner.name == ("process" if expected_gil else "thread")
        assert runner.reason == choose_runner(expected_gil)[1]
        assert [r.levelname for r in caplog.records if runner.reason in r.getMessage()] == ["DEBUG"]
    finally:
        runner.close()


def test_only_the_runner_in_use_is_imported():
    """A loader on threads must not pay for the process runner's imports (multiprocessing and its
    socket, subprocess and tempfile machinery); checked in a fresh interpreter, since this one's
    tests import every runner."""
    script = (
        "import sys, zephon\n"
        "zephon.make_runner('thread').close()\n"
        "print('multiprocessing' in sys.modules, 'runners.process' in sys.modules)\n"
        "zephon.make_runner('process').close()\n"
        "print('multiprocessing' in sys.modules, 'runners.process' in sys.modules)\n"
    )
    lines = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert lines == ["False", "False", "True", "True"]


def _report_auto_choice(conn) -> None:
    runner = auto_runner()
    try:
        conn.send((runner.name, runner.reason))
    finally:
        runner.close()
        conn.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_auto_chooses_threads_in_a_daemonic_process_where_no_process_can_start():
    """A torch DataLoader worker is a daemonic process, which multiprocessing allows no children:
    on a GIL build `auto` picked the process runner there, and every loader left at the default
    runner failed in a DataLoader worker at its first batch."""
    import multiprocessing

    assert choose_runner(gil=True, daemonic=True) == (
        "thread", "auto: in a daemonic process (a torch DataLoader worker), which can start no processes → thread"
    )
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_report_auto_choice, args=(send,), daemon=True)
    child.start()
    send.close()
    assert receive.poll(30), "the daemonic child reported"
    assert receive.recv() == ("thread", choose_runner(gil_enabled(), daemonic=True)[1])
    child.join(30)
