"""Bounded memory (docs/RELIABILITY.md, "Memory budget"): the peak RSS of a loader, measured in a
fresh process over a whole epoch, stays within 1.5 x the budget `zephon._memory` derives from its
settings, above the RSS the same process had before iterating. Also with a document of 1000 x the
context length and with 24-megapixel JPEGs.
"""

from __future__ import annotations

import numpy as np
import pytest

from zephon import IGNORE_INDEX, SegmentContext
from zephon._packing import FlatRowPlan, PackFlatOp
from zephon._records import RecordAddress
from zephon._shuffle import ShuffleOp

from tests.reliability.memory_probe import measure_in_subprocess, write_corpus

MARGIN = 1.5
MiB = 1 << 20


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """probe(scenario, runner, parallelism) -> the probe's result, each measured once per module."""
    corpora, results = {}, {}

    def measure(scenario: str, runner: str, parallelism: int) -> dict:
        if scenario not in corpora:
            corpora[scenario] = write_corpus(scenario, tmp_path_factory.mktemp(scenario))
        key = (scenario, runner, parallelism)
        if key not in results:
            results[key] = measure_in_subprocess(scenario, corpora[scenario], runner, parallelism)
        return results[key]

    return measure


def _describe(result: dict) -> str:
    budget = ", ".join(f"{k} {v / MiB:.1f}" for k, v in result["budget"].items())
    return (f"{result['scenario']} on {result['runner']}: grew {(result['peak'] - result['baseline']) / MiB:.1f} MiB "
            f"over a {result['baseline'] / MiB:.1f} MiB baseline; budget (MiB) {budget}")


@pytest.mark.parametrize(
    ("scenario", "runner", "parallelism"),
    [("normal", "thread", 2), ("huge_document", "inline", 1), ("huge_document", "thread", 2),
     ("huge_images", "thread", 2)],
)
def test_peak_memory_stays_within_the_budget(probe, scenario, runner, parallelism):
    result = probe(scenario, runner, parallelism)
    assert result["batches"] > 0 and result["tokens"] > 0
    growth = result["peak"] - result["baseline"]
    assert growth <= MARGIN * result["budget"]["total"], _describe(result)


def test_huge_document_costs_what_the_budget_says_it_costs(probe):
    """The budget is not vacuous: tokenizing a 1000 x context document really takes most of it."""
    result = probe("huge_document", "inline", 1)
    growth = result["peak"] - result["baseline"]
    assert growth >= result["budget"]["tokenizer"] / 4, _describe(result)


def test_process_runner_keeps_trainer_and_workers_within_the_budget(probe):
    result = probe("huge_document", "process", 2)
    budget = result["budget"]["total"]
    assert result["peak"] - result["baseline"] <= MARGIN * budget, _describe(result)
    # A forked worker starts from the parent's pages (at most its baseline) and adds its own work.
    assert result["children_peak"] <= result["baseline"] + MARGIN * budget, _describe(result)


def _token_bytes_referenced(rows) -> int:
    """Bytes of the token arrays that row plans keep alive: each piece's array, or the array it
    is a view of, counted once however many pieces reference it."""
    owners = {}
    for row in rows:
        for piece in row.pieces:
            for array in (piece.tokens, piece.targets):
                if array is not None:
                    owner = array if array.base is None else array.base
                    owners[id(owner)] = owner.nbytes
    return sum(owners.values())


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("algorithm", ["wrap", "first_fit"])
def test_rows_of_long_documents_waiting_in_a_shuffle_buffer_keep_only_their_own_tokens(algorithm, masked):
    """The budget's `rows` term gives a buffered row its own `max_length` positions and its
    `records` term one document per lane. A row cut from a document longer than a row must not
    keep the whole document alive: a shuffle buffer keeps a row or two of many documents, and
    referenced by views, every one of those documents stayed whole in memory. Nor its targets,
    where a loss mask gives it some."""
    max_length, rows_per_document, buffer_size = 64, 20, 64
    packer = PackFlatOp(max_length, algorithm=algorithm).factory(0)(SegmentContext(0, 0))
    shuffle = ShuffleOp(buffer_size, seed=3).factory(0)(SegmentContext(0, 0))
    for i in range(400):
        tokens = np.full(rows_per_document * max_length + 7, i, dtype=np.int32)
        record = {"input_ids": tokens}
        if masked:
            record["loss_mask"] = np.arange(len(tokens)) % 2 == 0
        for row in packer.push((RecordAddress("d", "s", i), record)):
            shuffle.push(row)
        del tokens, record  # what the lane holds once the record's chunk is done
    buffered = shuffle._items
    assert len(buffered) == buffer_size
    # A row's pieces: its max_length tokens (and targets), and the next token of its last document
    # for its labels.
    allowed = buffer_size * (max_length + 1) * 4 * (2 if masked else 1)
    assert _token_bytes_referenced(buffered) <= allowed
    assert all(piece.targets is not None for row in buffered for piece in row.pieces) == masked


def test_rows_cut_from_a_long_document_label_each_last_token_with_the_documents_next_one():
    """A row cut from inside a long document keeps, besides its tokens, the document's next token:
    the label of its last position (copying only the row's own tokens would lose it)."""
    max_length = 8
    tokens = np.arange(1, 3 * max_length + 4, dtype=np.int32)
    for algorithm in ("wrap", "first_fit"):
        packer = PackFlatOp(max_length, algorithm=algorithm).factory(0)(SegmentContext(0, 0))
        rows = packer.push((RecordAddress("d", "s", 0), {"input_ids": tokens})) + packer.flush()
        assembled, _, _ = FlatRowPlan.assemble_batch(rows)
        whole = 3 * max_length
        np.testing.assert_array_equal(assembled["input_ids"][:3].reshape(-1), tokens[:whole])
        np.testing.assert_array_equal(assembled["labels"][:3].reshape(-1), tokens[1 : whole + 1])
        np.testing.assert_array_equal(assembled["labels"][3, :2], tokens[whole + 1 :])
        assert assembled["labels"][3, 2] == IGNORE_INDEX
