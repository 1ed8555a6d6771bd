"""The race harness's own bookkeeping: the order runs are made in and the bound a loader is held to.

The published efficiencies depend on both, so they are checked here, without running any loader.
"""

from __future__ import annotations

from collections import Counter

from benchmarks.race.__main__ import round_order
from benchmarks.race._report import _median_bounds
from benchmarks.race.workers._passes import time_passes


def plan() -> list[tuple]:
    loaders = [("a", {"mode": 1}), ("a", {"mode": 2}), ("b", {}), ("c", {})]
    return [(pipeline, name, config, p) for pipeline in ("text", "vlm") for name, config in loaders for p in (1, 2, 4)]


def run_key(run: tuple) -> tuple:
    """A run, hashable (its config is a dict)."""
    return run[0], run[1], str(run[2]), run[3]


def test_every_round_runs_the_whole_plan_once_and_starts_each_pipeline_with_another_loader():
    runs = plan()
    firsts = []
    for round_ in range(3):
        ordered = round_order(runs, round_)
        assert Counter(map(run_key, ordered)) == Counter(map(run_key, runs))
        assert [run[0] for run in ordered] == sorted((run[0] for run in runs), key=["text", "vlm"].index)
        firsts.append(tuple(next(run[1] for run in ordered if run[0] == pipeline) for pipeline in ("text", "vlm")))
        for pipeline in ("text", "vlm"):  # a loader's runs stay together, in the plan's order
            names = [run[1] for run in ordered if run[0] == pipeline]
            assert [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n] == list(dict.fromkeys(names))
            for name in set(names):
                mine = [run for run in ordered if run[:2] == (pipeline, name)]
                assert mine == [run for run in runs if run[:2] == (pipeline, name)]
    assert firsts == [("a", "a"), ("b", "b"), ("c", "c")]
    assert round_order(runs, 3) == round_order(runs, 0)


def test_the_bound_is_the_median_rounds_measurement_and_failed_rounds_do_not_count():
    def measured(rate, round_, ok=True):
        return {"pipeline": "text", "name": "3.14t Pillow", "functions": "ours", "usable_tokens_per_s": rate,
                "parts": {"tokenize_s": 1.0 / rate}, "round": round_, "ok": ok}

    # the median (990) is neither the first, last, middle, lowest nor highest round
    rates = [1020.0, 990.0, 950.0, 1000.0, 960.0]
    found = [measured(rate, round_) for round_, rate in enumerate(rates)] + [measured(5.0, 5, ok=False)]
    bound = _median_bounds(found)[("text", "3.14t Pillow", "ours")]
    assert bound["usable_tokens_per_s"] == 990.0 and bound["round"] == 1
    assert bound["parts"] == {"tokenize_s": 1.0 / 990.0}  # the median round's own parts, not a mixture
    assert (bound["rounds"], bound["spread"]) == (5, (950.0, 1020.0))
    single = _median_bounds([measured(900.0, 0)])[("text", "3.14t Pillow", "ours")]
    assert (single["usable_tokens_per_s"], single["rounds"], single["spread"]) == (900.0, 1, (900.0, 900.0))


def test_bound_parts_take_turns_after_a_warm_up_and_cost_their_mean_pass_not_their_fastest():
    # the warm-up pass (first four ticks) is not counted; then CPU: read 1, 2, 1; tokenize 3, 4, 2
    ticks = iter([0, 9, 9, 99, 0, 1, 1, 4, 4, 6, 6, 10, 10, 11, 11, 13]).__next__
    calls = []

    def read(out):
        calls.append("read")
        return len(calls)

    def tokenize(out):
        calls.append("tokenize")
        return out["read"] * 10  # a later part sees the same pass's earlier output

    passes = time_passes([("read", read), ("tokenize", tokenize)], repeats=3, clock=ticks, wall=lambda: 0.0)
    assert calls == ["read", "tokenize"] * 4
    assert passes.cpu == {"read": [1, 2, 1], "tokenize": [3, 4, 2]}
    assert passes.means() == {"read": 4 / 3, "tokenize": 3.0}
    assert passes.fastests() == {"read": 1, "tokenize": 2}
    assert passes.outputs == {"read": 7, "tokenize": 70}
