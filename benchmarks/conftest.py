"""Benchmark fixtures: every row records the interpreter build and the versions of the libraries
the timed work runs in, so results from GIL and free-threaded runs, or from two NumPy or Pillow
releases, can sit in one table and be told apart."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import sysconfig

import pytest


# The distributions whose code the benchmarks time (pillow-simd installs as its own name); the
# ones not installed are left out.
LIBRARIES = ("zephon", "numpy", "tokenizers", "pillow", "pillow-simd", "pyarrow", "fsspec", "av")


def library_versions() -> dict:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def build_info() -> dict:
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "free_threaded": not gil,
        "gil_enabled": gil,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "configure": sysconfig.get_config_var("CONFIG_ARGS") or "",  # PGO, LTO, shared libpython
        "versions": library_versions(),
    }


@pytest.fixture
def record_build(benchmark):
    """Adds the build facts to this benchmark's `extra_info` and returns that dict for more."""
    benchmark.extra_info.update(build_info())
    return benchmark.extra_info
