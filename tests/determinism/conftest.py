"""Fixtures shared by the determinism tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def corpora(make_jsonl_corpus):
    """Two synthetic JSON Lines datasets of the text determinism matrix (3×60 and 2×50 records)."""
    return make_jsonl_corpus(3, 60, 1), make_jsonl_corpus(2, 50, 2)
