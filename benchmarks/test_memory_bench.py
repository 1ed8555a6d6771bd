"""Peak memory by runner and parallelism (docs/RELIABILITY.md, "Memory budget").

    python -m pytest benchmarks/test_memory_bench.py --benchmark-only

Each case runs a whole epoch of one scenario in a fresh process (tests/reliability/memory_probe.py)
and records in `extra_info`: the RSS before iterating (`baseline_mib`), the peak RSS while
iterating (`peak_mib`, VmHWM) and its growth (`growth_mib`), the largest worker process's peak
(`children_peak_mib`, process runner), the budget `zephon._memory` derives and its terms
(`budget_mib`, ...), and `within_budget` (growth <= 1.5 x budget). The timed part is the whole
child process (start-up included); the memory numbers are the point.
"""

from __future__ import annotations

import pytest

from tests.reliability.memory_probe import (
    SCENARIOS,
    measure_in_subprocess,
    write_corpus,
)

MiB = 1 << 20
LAYOUTS = [("inline", 1), ("thread", 1), ("thread", 2), ("thread", 4), ("process", 1), ("process", 2), ("process", 4)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return {scenario: write_corpus(scenario, tmp_path_factory.mktemp(scenario)) for scenario in SCENARIOS}


@pytest.mark.parametrize(("runner", "parallelism"), LAYOUTS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_peak_rss_by_runner(benchmark, record_build, corpora, scenario, runner, parallelism):
    result = benchmark.pedantic(
        measure_in_subprocess, args=(scenario, corpora[scenario], runner, parallelism), rounds=1, iterations=1
    )
    growth = result["peak"] - result["baseline"]
    budget = result["budget"]
    record_build.update(
        scenario=scenario, runner=runner, parallelism=parallelism,
        baseline_mib=round(result["baseline"] / MiB, 1), peak_mib=round(result["peak"] / MiB, 1),
        growth_mib=round(growth / MiB, 1), children_peak_mib=round(result["children_peak"] / MiB, 1),
        budget_mib=round(budget["total"] / MiB, 1),
        **{f"budget_{term}_mib": round(value / MiB, 1) for term, value in budget.items() if term != "total"},
        within_budget=growth <= 1.5 * budget["total"], epoch_seconds=round(result["seconds"], 2),
        tokens=result["tokens"],
    )
    assert result["batches"] > 0
