"""`auto` picks threads only where the interpreter runs without the GIL, and says why."""

from __future__ import annotations

import logging
import subprocess
import sys

from runners import ProcessRunner, ThreadRunner, auto_runner, choose_runner, gil_enabled


def test_auto_chooses_processes_when_the_gil_is_enabled():
    name, reason = choose_runner(gil=True)
    assert name == "process"
    assert reason.startswith("auto: GIL enabled") and reason.endswith("→ process")


def test_auto_chooses_threads_when_the_gil_is_disabled():
    assert choose_runner(gil=False) == ("thread", "auto: GIL disabled (sys._is_gil_enabled() is False) → thread")


def test_auto_runner_follows_this_interpreter_and_logs_its_choice(caplog):
    expected_gil = sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True
    assert gil_enabled() is expected_gil
    with caplog.at_level(logging.INFO, logger="runners.auto"):
        runner = auto_runner()
    try:
        assert isinstance(runner, ProcessRunner if expected_gil else ThreadRunner)
        assert runner.name == ("process" if expected_gil else "thread")
        assert runner.reason == choose_runner(expected_gil)[1]
        assert runner.reason in caplog.text
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
