"""The ledger's learned tokens (`stats()["lanes"][lane]["learned"]`, and each dataset's in the lane's
`"datasets"` and in `"mixture"`): the positions whose label a loss counts, taken from a plugin's row
plan that does not count them, and counted on after a resume from a state saved before they were."""

from __future__ import annotations

import json
from collections import Counter

from tests.harness import RowsHandedOnAs
from zephon import IGNORE_INDEX, Pipeline
from zephon._checkpoint import _checksum
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

GLOBAL_BATCH = 4


class _PlanWithoutLearnedCounts:
    """A plugin's row plan written before rows counted their learned tokens: it counts its tokens
    and images per dataset, and has no `learned_by_dataset`."""

    def __init__(self, plan) -> None:
        self.num_real_tokens, self.length, self.sources = plan.num_real_tokens, plan.length, plan.sources
        self.tokens_by_dataset, self.images_by_dataset = plan.tokens_by_dataset, plan.images_by_dataset
        self.assemble = plan.assemble


def _pipeline(demo_data_dir, demo_tokenizer_path, plugin=None) -> Pipeline:
    source = StaticMixtureWorkSource(
        [Dataset.from_path("kjv", str(demo_data_dir / "kjv")), Dataset.from_path("jargon", str(demo_data_dir / "jargon"))],
        seed=1, records_per_chunk=8, num_epochs=1,
    )
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline")
                .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text").pack_flat(max_length=64))
    return (pipeline if plugin is None else pipeline.apply(plugin)).batch(microbatch_size=2)


def _learned_in(batches) -> dict[int, int]:
    """{lane: positions whose label is not IGNORE_INDEX} in the microbatches themselves."""
    out = Counter()
    for batch in batches:
        out[batch.lane] += int((batch.tokens["labels"] != IGNORE_INDEX).sum())
    return dict(out)


def _as_saved_before_learned_tokens_were_counted(state: dict) -> dict:
    """`state` without the lanes' `learned` row counts, under its checksum: what a Zephon that did
    not count them saved."""
    body = {key: value for key, value in json.loads(json.dumps(state)).items() if key != "checksum"}
    for lane in body["ledger"].values():
        lane["rows"] = {key: n for key, n in lane["rows"].items() if not key.startswith("learned")}
    return {**body, "checksum": _checksum(body)}


def _take(loader, microbatches: int) -> list:
    it = iter(loader)
    return [next(it) for _ in range(microbatches)]


def test_a_plugin_row_plan_that_does_not_count_learned_tokens_has_them_read_from_its_labels(
    demo_data_dir, demo_tokenizer_path
):
    with _pipeline(demo_data_dir, demo_tokenizer_path).shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        counted = _take(loader, 40)
        stats = loader.stats()
    plugin = _pipeline(demo_data_dir, demo_tokenizer_path, RowsHandedOnAs("rows_without_learned_counts", _PlanWithoutLearnedCounts))
    with plugin.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        read = _take(loader, 40)
        plugin_stats = loader.stats()
    assert [b.digest() for b in read] == [b.digest() for b in counted]
    assert {lane: c["learned"] for lane, c in plugin_stats["lanes"].items()} == _learned_in(read)
    assert plugin_stats["lanes"] == stats["lanes"] and plugin_stats["mixture"] == stats["mixture"]
    assert all(0 < c["learned"] < c["tokens"] for c in stats["mixture"].values()), stats["mixture"]


def test_a_resume_from_a_state_saved_before_learned_tokens_were_counted_counts_them_from_there(
    demo_data_dir, demo_tokenizer_path
):
    """The per-lane row counts of such a state carry tokens but no `learned`: the resumed loader
    carries the tokens on and counts the learned tokens of the rows it hands over."""
    pipeline = _pipeline(demo_data_dir, demo_tokenizer_path)
    with pipeline.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        before = _take(loader, 8)
        saved = loader.state_dict()
    state = _as_saved_before_learned_tokens_were_counted(saved)
    assert any(key.startswith("learned") for lane in saved["ledger"].values() for key in lane["rows"])
    with pipeline.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        loader.load_state_dict(state)
        after = _take(loader, 12)
        stats = loader.stats()
    assert {lane: c["learned"] for lane, c in stats["lanes"].items()} == _learned_in(after)
    assert sum(c["learned"] for c in stats["mixture"].values()) == sum(_learned_in(after).values())
    handed = sum(int((b.tokens["document_ids"] >= 0).sum()) for b in before + after)
    assert sum(c["tokens"] for c in stats["lanes"].values()) == handed, "the tokens carry on"
