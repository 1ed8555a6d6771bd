"""Importing the library must not re-enable the GIL on free-threaded CPython (SPEC §3.4)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import sys
gil = getattr(sys, "_is_gil_enabled", lambda: True)
before = gil()
import zephon, runners, vlm
import zephon.io, zephon.work, vlm._image, vlm._video, runners.thread, runners.process
print(before, gil())
"""


def test_importing_zephon_runners_and_vlm_leaves_the_gil_as_it_was():
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert before == after, f"GIL was {before} before importing and {after} after"
    free_threaded_build = bool(getattr(sys, "_is_gil_enabled", None)) and "t" in sys.abiflags
    if free_threaded_build:
        assert after == "False", "on a free-threaded build the GIL must stay disabled"
