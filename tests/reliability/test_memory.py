"""Bounded memory (docs/RELIABILITY.md, "Memory budget"): the peak RSS of a loader, measured in a
fresh process over a whole epoch, stays within 1.5 x the budget `zephon._memory` derives from its
settings, above the RSS the same process had before iterating. Also with a document of 1000 x the
context length and with 24-megapixel JPEGs.
"""

from __future__ import annotations

import pytest

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
