"""Which loaders race, in which virtual environment, with which configurations.

Every peer lives in its own virtual environment (never a dependency of this project; `zephon`
0.2.0 even has our import name). `benchmarks/race/setup_peers.sh` creates them under
`$ZEPHON_RACE_VENVS` (default `/work/peers`). Our own loader runs in the project's environments:
3.11 in `$ZEPHON_RACE_PY311` (default: the interpreter running the race) and free-threaded 3.14t in
`$ZEPHON_RACE_PY314T` (default: `.nox/tests-3-14t`, made by `nox -s tests-3.14t`); the
pillow-simd variants ("Zephon's default decode stack") in their own venvs beside the peers.

A peer with several `configs` is run in each, and its best configuration at each parallelism is
the one compared ("its best-performing configuration, not a strawman").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENVS = Path(os.environ.get("ZEPHON_RACE_VENVS", "/work/peers"))


def compile_sources(python: str) -> None:
    """Compile the repository's packages and the race's workers to bytecode for `python`, as
    `pip install` leaves every peer's package: with PYTHONDONTWRITEBYTECODE set (this machine's
    environment) a loader run from the source tree would compile its modules at every start and
    carry the compiler's time into its first batch and its memory into its peak (3.14t: 4.2 MiB
    of PSS and 145 ms importing zephon from source against 1.8 MiB and 83 ms from bytecode)."""
    sources = [str(REPO / name) for name in ("zephon", "runners", "vlm", "benchmarks/race/workers")]
    subprocess.run([python, "-m", "compileall", "-q", *sources], check=True, stdout=subprocess.DEVNULL)


# Worker scripts that import this repository's packages: Zephon's loader, and the bound, whose
# "ours" functions are Zephon's. The peers' scripts import none of them.
OUR_SCRIPTS = ("zephon_ours.py", "bound.py")


def worker_env(script: str) -> dict[str, str]:
    """What a worker's environment needs beyond the race's settings, so that it runs this checkout.

    Every interpreter racing our code holds an editable install of whichever checkout made it
    (setup_peers.sh, `nox`): run from any other worktree, `import zephon` in its worker found that
    checkout's code, not the one the race was started from (and compiled, `compile_sources`). With
    this checkout first on the path our scripts import its packages; the peers' scripts get no
    path, so `import zephon` in `zephon020` stays the PyPI one.
    """
    return {"PYTHONPATH": str(REPO)} if script in OUR_SCRIPTS else {}


def python_for(venv: str) -> str | None:
    """The interpreter of a named environment, or None when it is not there."""
    if venv == "project-3.11":
        path = os.environ.get("ZEPHON_RACE_PY311", sys.executable)
    elif venv == "project-3.14t":
        path = os.environ.get("ZEPHON_RACE_PY314T", str(REPO / ".nox" / "tests-3-14t" / "bin" / "python"))
    else:
        path = str(VENVS / venv / "bin" / "python")
    return path if os.path.exists(path) else None


LOADERS: dict[str, dict] = {
    "zephon thread 3.14t": {
        "family": "zephon", "stack": "Pillow", "venv": "project-3.14t", "script": "zephon_ours.py",
        "pipelines": ("text", "vlm"), "configs": [{"runner": "thread"}],
    },
    "zephon process 3.11": {
        "family": "zephon", "stack": "Pillow", "venv": "project-3.11", "script": "zephon_ours.py",
        "pipelines": ("text", "vlm"), "configs": [{"runner": "process"}],
    },
    "zephon thread 3.11": {
        "family": "zephon", "stack": "Pillow", "venv": "project-3.11", "script": "zephon_ours.py",
        "pipelines": ("text", "vlm"), "configs": [{"runner": "thread"}],
    },
    "zephon thread 3.14t simd": {
        "family": "zephon-simd", "stack": "pillow-simd", "venv": "simd314t", "script": "zephon_ours.py",
        "pipelines": ("vlm",), "configs": [{"runner": "thread"}],
    },
    "zephon process 3.11 simd": {
        "family": "zephon-simd", "stack": "pillow-simd", "venv": "simd311", "script": "zephon_ours.py",
        "pipelines": ("vlm",), "configs": [{"runner": "process"}],
    },
    "grain 3.11": {
        "family": "peer", "stack": "Pillow", "venv": "grain311", "script": "grain_peer.py",
        "pipelines": ("text", "vlm"), "configs": [{"mode": "threads"}, {"mode": "mp"}],
    },
    "grain-free-threading 3.14t": {
        "family": "peer", "stack": "Pillow", "venv": "grainft314t", "script": "grain_peer.py",
        "pipelines": ("text", "vlm"), "configs": [{"mode": "threads"}, {"mode": "mt"}],
    },
    "zephon 0.2.0 3.11": {
        "family": "peer", "stack": "Pillow", "venv": "zephon020", "script": "zephon020_peer.py",
        "pipelines": ("text", "vlm"), "configs": [{"runner": "threads"}, {"runner": "process"}],
    },
    "torch DataLoader 3.11": {
        "family": "peer", "stack": "Pillow", "venv": "torch311", "script": "torch_peer.py",
        "pipelines": ("text", "vlm"), "configs": [{}, {"in_order": False}],
    },
}

# Where the compute bound is measured: (venv, whose functions). "variants": functions also measured
# two more ways (`VARIANTS`), to tell how much of a loader's shortfall no loader of its kind could
# make up.
BOUNDS: dict[str, dict] = {
    "3.11 Pillow": {"venv": "project-3.11", "stack": "Pillow", "functions": ["ours", "work"], "variants": ["ours"]},
    "3.14t Pillow": {"venv": "project-3.14t", "stack": "Pillow", "functions": ["ours", "work"], "variants": ["ours"]},
    "3.14t pillow-simd": {"venv": "simd314t", "stack": "pillow-simd", "functions": ["ours"], "variants": ["ours"]},
    "3.11 pillow-simd": {"venv": "simd311", "stack": "pillow-simd", "functions": ["ours"], "variants": ["ours"]},
}

# "at once": one copy per core, all running together, their rates added: what the machine gives
# when every core works (shared caches, memory bandwidth, clocks that drop with load).
# "idle thread": one copy with an idle thread started beside it: glibc's malloc leaves its
# single-threaded fast path for good once a process has a second thread, as every threaded loader
# (and tokenizers' Rust inside it) then pays on each allocation.
VARIANTS = ("at once", "idle thread")


def variant_name(name: str, variant: str, cores: int) -> str:
    """The name a bound's variant measurement is recorded under."""
    return f"{name} ×{cores} at once" if variant == "at once" else f"{name}, idle thread beside it"
