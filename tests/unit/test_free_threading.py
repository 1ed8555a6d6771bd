"""Importing the library must not re-enable the GIL on free-threaded CPython (SPEC §3.4)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import sys
before = sys._is_gil_enabled()
import zephon, runners, vlm
import zephon.io, zephon.work, vlm._image, vlm._video, runners.thread, runners.process
print(before, sys._is_gil_enabled())
"""


@pytest.mark.requires_free_threading
def test_importing_zephon_runners_and_vlm_leaves_the_gil_disabled():
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}  # a stray PYTHON_GIL=1 would fake it
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], f"GIL enabled (before, after importing): {out.stdout.split()}"
