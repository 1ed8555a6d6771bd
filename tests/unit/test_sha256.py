"""zephon._sha256: the interpreter's built-in SHA-256 gives hashlib's digests, and a loader's
process never loads OpenSSL for its own small digests."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from zephon._sha256 import sha256


@pytest.mark.parametrize("data", [b"", b"abc", bytes(range(256)) * 4099])
def test_digests_equal_hashlibs(data):
    assert sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()


def test_incremental_updates_equal_one_update():
    pieces = [b"recipe", b"|", "lañe 3".encode(), bytes(70_000)]
    digest = sha256()
    for piece in pieces:
        digest.update(piece)
    assert digest.digest() == hashlib.sha256(b"".join(pieces)).digest()


def test_the_built_in_implementation_is_used():
    """Falling back to hashlib would bring OpenSSL back without any test noticing otherwise."""
    assert sha256.__module__ in ("_sha2", "_sha256")


def test_a_text_loader_and_its_checkpoint_load_neither_openssl_nor_numpy_random(
        make_jsonl_corpus, demo_tokenizer_path):
    """Checked in a fresh interpreter, since this one's tests import both themselves."""
    corpus = make_jsonl_corpus(2, 40)
    script = (
        "import sys\n"
        "from tests.harness import text_pipeline\n"
        f"pipeline = text_pipeline({str(corpus)!r}, {str(corpus)!r}, {str(demo_tokenizer_path)!r}, runner='thread')\n"
        "with pipeline.shard(0, 1) as loader:\n"
        "    batches = [batch for _, batch in zip(range(4), loader)]\n"
        "    state = loader.state_dict()\n"
        "print(len(batches), bool(state), '_hashlib' in sys.modules, 'numpy.random' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["4", "True", "False", "False"]
