"""Benchmark fixtures: every row records the interpreter build, so results from GIL and
free-threaded runs can sit in one table."""

from __future__ import annotations

import os
import platform
import sys

import pytest


def build_info() -> dict:
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "free_threaded": not gil,
        "gil_enabled": gil,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }


@pytest.fixture
def record_build(benchmark):
    """Adds the build facts to this benchmark's `extra_info` and returns that dict for more."""
    benchmark.extra_info.update(build_info())
    return benchmark.extra_info
