"""Fixtures shared by every test module. Keep this file small: harnesses live in their own modules.

- ``demo_data_dir`` / ``demo_tokenizer_path``: the shipped corpus and tokenizer (``zephon/data``).
- ``make_jsonl_corpus(num_shards, records_per_shard, seed)``: a deterministic synthetic JSON Lines
  corpus in a session temp dir (cached per argument triple), for tests that need exact counts.
- ``@pytest.mark.requires_torch`` (or ``from tests.conftest import requires_torch``): skips when
  torch cannot be imported, as on free-threaded 3.14t where no CPU build exists.
- ``@pytest.mark.requires_torchtitan``: skips when ``torchtitan`` cannot be imported. The nox
  session on 3.11 installs it (``noxfile.TORCHTITAN``) and fails if it does not import, so in CI
  these checks run wherever torch does. (That importing the library leaves the GIL off on 3.14t
  is checked by the nox session itself, before its tests.)
- ``@pytest.mark.requires_aiohttp``: skips when ``aiohttp`` (``zephon[http]``, what fsspec reads
  ``http(s)://`` with) cannot be imported, as in a venv without that extra.
- ``ZEPHON_TESTS_REQUIRE``: the modules of the markers above (``torch``, ``torchtitan``,
  ``aiohttp``, comma-separated) whose tests must run, and fail where the module is missing, not
  skip. Both nox sessions install ``zephon[http]`` and set it to ``aiohttp``
  (``noxfile.TESTS_REQUIRE``), so in CI a missing aiohttp fails. Nothing else in the suite may skip.
"""

from __future__ import annotations

import importlib
import json
import os
import random
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # pragma: no cover - hypothesis is a test extra
    _hypothesis_settings = None

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA_DIR = REPO_ROOT / "zephon" / "data"
TORCH_SKIP_REASON = "torch is not installed (no CPU build exists for this Python)"
TORCHTITAN_SKIP_REASON = "torchtitan is not installed (the nox session on 3.11 installs it)"
AIOHTTP_SKIP_REASON = "aiohttp is not installed (pip install 'zephon[http]'; both nox sessions install it)"

requires_torch = pytest.mark.requires_torch

if _hypothesis_settings is not None:
    # The free-threaded build and a shared 2-core machine make per-example timing meaningless.
    _hypothesis_settings.register_profile("zephon", deadline=None, print_blob=True)
    _hypothesis_settings.load_profile("zephon")


@cache
def torch_available() -> bool:
    """True when ``import torch`` works (a CUDA-only build without its libraries counts as absent)."""
    try:
        importlib.import_module("torch")
    except Exception:
        return False
    return True


@cache
def torchtitan_available() -> bool:
    """True when TorchTitan's data-loader module imports (it needs torch)."""
    try:
        importlib.import_module("torchtitan.components.dataloader")
    except Exception:
        return False
    return True


@cache
def aiohttp_available() -> bool:
    """True when aiohttp, which fsspec's HTTPFileSystem reads `http(s)://` with, imports."""
    try:
        importlib.import_module("aiohttp")
    except ImportError:
        return False
    return True


def _required_in_this_run() -> set[str]:
    """The modules `ZEPHON_TESTS_REQUIRE` names: their tests are not skipped where they are missing."""
    return {name.strip() for name in os.environ.get("ZEPHON_TESTS_REQUIRE", "").split(",") if name.strip()}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"requires_torch: skip with '{TORCH_SKIP_REASON}' when torch is absent")
    config.addinivalue_line(
        "markers", f"requires_torchtitan: skip with '{TORCHTITAN_SKIP_REASON}' when torchtitan is absent"
    )
    config.addinivalue_line(
        "markers", f"requires_aiohttp: skip with '{AIOHTTP_SKIP_REASON}' when aiohttp is absent, unless required"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # torch (or torchtitan, aiohttp) is imported only if some collected test needs it, and then only once.
    required = _required_in_this_run()
    for marker, module, available, reason in (
        ("requires_torch", "torch", torch_available, TORCH_SKIP_REASON),
        ("requires_torchtitan", "torchtitan", torchtitan_available, TORCHTITAN_SKIP_REASON),
        ("requires_aiohttp", "aiohttp", aiohttp_available, AIOHTTP_SKIP_REASON),
    ):
        needing = [item for item in items if item.get_closest_marker(marker)]
        if needing and module not in required and not available():
            for item in needing:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def demo_data_dir() -> Path:
    """``zephon/data``: ``kjv/*.jsonl.zst`` (4 shards) and ``jargon/*.jsonl`` (3 shards)."""
    assert (DEMO_DATA_DIR / "tokenizer.json").is_file(), f"shipped demo data missing under {DEMO_DATA_DIR}"
    return DEMO_DATA_DIR


@pytest.fixture(scope="session")
def demo_tokenizer_path(demo_data_dir: Path) -> Path:
    """The shipped byte-level BPE ``tokenizer.json`` (vocab 8192; <|bos|>=0, <|eos|>=1, <|pad|>=2)."""
    return demo_data_dir / "tokenizer.json"


_WORDS = (
    "alpha beta gamma delta lane shard chunk token pack shuffle batch flush replay seed mixture "
    "record window buffer worker thread process rank epoch sequence document the of and a to in"
).split()


def write_jsonl_corpus(root: Path, num_shards: int, records_per_shard: int, seed: int) -> Path:
    """Write ``part-NNNNN.jsonl`` shards of ``{"id", "shard", "index", "text"}`` records.

    Content is a pure function of the arguments: ``id`` is ``"s{shard}-r{index}"`` and ``text``
    holds 1–200 words drawn from a small vocabulary (lengths vary so packing has real work).
    """
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"zephon-synthetic:{seed}")
    for shard in range(num_shards):
        lines = []
        for index in range(records_per_shard):
            n_words = rng.randint(1, 200)
            text = " ".join(rng.choice(_WORDS) for _ in range(n_words))
            lines.append(json.dumps({"id": f"s{shard}-r{index}", "shard": shard, "index": index, "text": text}))
        (root / f"part-{shard:05d}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def make_jsonl_corpus(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int, int], Path]:
    """Factory: ``make_jsonl_corpus(num_shards, records_per_shard, seed) -> directory``.

    The same arguments return the same directory within a session; treat it as read-only.
    """
    made: dict[tuple[int, int, int], Path] = {}

    def make(num_shards: int, records_per_shard: int, seed: int = 0) -> Path:
        key = (num_shards, records_per_shard, seed)
        if key not in made:
            root = tmp_path_factory.mktemp(f"corpus-{num_shards}x{records_per_shard}-s{seed}", numbered=True)
            made[key] = write_jsonl_corpus(root, *key)
        return made[key]

    return make
