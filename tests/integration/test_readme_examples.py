"""The README's Python examples (and docs/RELIABILITY.md's) run as printed, on the shipped data or
a small corpus of the dataset they name, and do what the text says.

The blocks are read from README.md itself, so an example that drifts from the API fails here. The
names the text leaves to the reader are supplied: `rank`, `world_size`, a `train_step` that checks
what the comment promises, and `states_of_all_ranks`.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO_ROOT, requires_torch

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(encoding="utf-8"), re.S)


class Enough(Exception):
    """Ends the README's endless training loop."""


@requires_torch
def test_readme_pipeline_and_checkpoint_examples_run_as_printed(monkeypatch):
    import torch

    import zephon

    pipeline_block, checkpoint_block = BLOCKS  # the README shows exactly these two
    monkeypatch.chdir(REPO_ROOT)  # its paths are relative to the repository
    seen = []

    def train_step(batch):
        assert {"input_ids", "labels", "position_ids", "document_ids"} <= set(batch)
        assert all(isinstance(t, torch.Tensor) for t in batch.values())
        seen.append(tuple(batch["input_ids"].shape))
        if len(seen) == 3:
            raise Enough

    namespace = {"rank": 0, "world_size": 1, "train_step": train_step}
    with pytest.raises(Enough):
        exec(compile(pipeline_block, "README.md", "exec"), namespace)
    assert seen == [(8, 2048)] * 3, "microbatch_size=8 rows of max_length=2048"

    pipeline = namespace["pipeline"]
    with pipeline.shard(0, 2, global_batch_size=256) as first, pipeline.shard(1, 2, global_batch_size=256) as second:
        taken = [next(iter(first)), next(iter(second))]
        states = [first.state_dict(), second.state_dict()]
    with pipeline.shard(0, 1, global_batch_size=256) as loader:
        namespace.update(zephon=zephon, loader=loader, states_of_all_ranks=states)
        exec(compile(checkpoint_block, "README.md", "exec"), namespace)
        json.dumps(namespace["state"])  # "plain JSON"
        resumed = next(iter(loader))
    assert [(b.lane, b.step, b.index) for b in taken] == [(0, 0, 0), (4, 0, 0)]
    assert (resumed.lane, resumed.step, resumed.index) == (0, 0, 1), "resumed after the microbatch already taken"


RELIABILITY_BLOCKS = re.findall(
    r"```python\n(.*?)```", (REPO_ROOT / "docs" / "RELIABILITY.md").read_text(encoding="utf-8"), re.S
)


def test_reliability_stats_example_reads_the_keys_it_shows_and_its_ledger_balances(tmp_path):
    """docs/RELIABILITY.md's `loader.stats()` block, run on a dataset named `web` as printed,
    after a whole epoch of lines that are malformed, empty or filtered out."""
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    [stats_block] = RELIABILITY_BLOCKS  # the page shows exactly this one
    lines = [json.dumps({"text": f"document number {i} " * (i % 5 + 1)}) for i in range(40)]
    lines[3] = lines[17] = '{"text": "cut'  # malformed_json
    lines[8] = json.dumps({"text": "   "})  # empty_document
    (tmp_path / "web.jsonl").write_text("\n".join(lines) + "\n")
    source = StaticMixtureWorkSource([Dataset.from_path("web", str(tmp_path / "web.jsonl"))],
                                     records_per_chunk=5, num_epochs=1)
    pipeline = (
        Pipeline(source).options(num_lanes=2, runner="inline")
        .filter(lambda record: not record["text"].startswith("document number 2"))  # 2, 20..29
        .tokenize(str(REPO_ROOT / "zephon" / "data" / "tokenizer.json"))
        .pack_flat(max_length=16).batch(1)
    )
    with pipeline.shard(0, 1, global_batch_size=2) as loader:
        rows = sum(len(batch.tokens["input_ids"]) for batch in loader)
        namespace = {"loader": loader}
        exec(compile(stats_block, "docs/RELIABILITY.md", "exec"), namespace)
    stats = namespace["stats"]
    total = stats["datasets"]["web"]["total"]
    assert total == {"read": 40, "emitted": 26, "filtered": 11,
                     "skipped": {"malformed_json": 2, "empty_document": 1}}
    lanes = stats["datasets"]["web"]["lanes"]
    assert set(lanes) == set(stats["lanes"]) == {0, 1}
    for lane in lanes.values():
        assert lane["read"] == lane["emitted"] + lane["filtered"] + sum(lane["skipped"].values())
    assert {key for lane in stats["lanes"].values() for key in lane} == {"rows", "tokens", "padding", "datasets"}
    assert sum(lane["rows"] for lane in stats["lanes"].values()) == rows
    assert all(lane["datasets"] == {"web": {"tokens": lane["tokens"], "images": 0}} for lane in stats["lanes"].values())
    assert stats["mixture"] == {"web": {"tokens": sum(lane["tokens"] for lane in stats["lanes"].values()), "images": 0}}
