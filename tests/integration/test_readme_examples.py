"""The README's Python examples run as printed, on the shipped data, and do what the text says.

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
