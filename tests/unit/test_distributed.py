"""Layouts given beside an initialised torch.distributed process group (SPEC §4).

A one-process gloo group in this process stands in for a torchrun job: enough to show a layout
that disagrees with the group, which on a real job would leave lanes unread or unsaved.
"""

from __future__ import annotations

import pytest

from zephon import ConfigurationError
from zephon.demo._recipe import demo_pipeline

pytestmark = pytest.mark.requires_torch


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipeline():
    return demo_pipeline(runner="inline")  # 8 lanes, microbatches of 2


@pytest.mark.parametrize("rank,world", [(None, 2), (1, None)])
def test_a_rank_or_world_size_alone_that_is_not_the_groups_is_refused(one_process_group, pipeline, rank, world):
    """`shard(world_size=2)` on one process read lanes 0-3 of 8 and none of the others."""
    with pytest.raises(ConfigurationError, match="differs from the group's"):
        pipeline.shard(rank, world, global_batch_size=16)


@pytest.mark.parametrize("rank,world", [(None, None), (0, None), (None, 1), (0, 2)])
def test_the_groups_layout_or_an_explicit_pair_is_taken(one_process_group, pipeline, rank, world):
    with pipeline.shard(rank, world, global_batch_size=16) as loader:
        assert (loader.rank, loader.world_size) == (0, 1 if world is None else world)
