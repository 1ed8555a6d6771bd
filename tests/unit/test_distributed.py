"""Layouts given beside an initialised torch.distributed process group (SPEC §4).

A one-process gloo group in this process stands in for a torchrun job: enough to show a layout
that disagrees with the group, which on a real job would leave lanes unread or unsaved.
"""

from __future__ import annotations

import logging

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


def test_gathering_lanes_no_rank_of_the_group_holds_is_refused_at_the_save(one_process_group, pipeline):
    """The merged state of rank 0 of 2 on a one-process group covered lanes 0-3 of 8: the save
    went through, and only a resume on another world size found lanes 4-7 in no checkpoint."""
    from zephon.distributed import gather_state

    with pipeline.shard(0, 2, global_batch_size=16) as loader:
        with pytest.raises(ConfigurationError, match=r"hold no loader of lanes \[4, 5, 6, 7\] \(of 8\)"):
            gather_state(loader)
    with pipeline.shard(global_batch_size=16) as loader:
        assert len(gather_state(loader)["lanes"]) == 8


def test_a_torchtitan_loader_of_more_replicas_than_the_group_holds_is_refused_at_construction(
    one_process_group, pipeline
):
    from zephon.integrations.torchtitan import ZephonDataLoader

    with pytest.raises(ConfigurationError, match="dp_world_size=2 replicas cannot all be among the 1 ranks"):
        ZephonDataLoader(pipeline, 0, 2, 16, local_batch_size=4)
    with ZephonDataLoader(pipeline, 0, 1, 16, local_batch_size=4) as loader:
        next(iter(loader))
        assert loader.state_dict()


@pytest.mark.parametrize("rank,world", [(None, None), (0, None), (None, 1)])
def test_a_torchtitan_loader_given_a_group_smaller_than_the_world_needs_its_data_parallel_rank_and_size(
    one_process_group, pipeline, monkeypatch, rank, world
):
    """Without dp_rank and dp_world_size the loader took the whole world's rank and size, not the
    group's: with a data-parallel group of 2 in a world of 8 it failed saying 8 replicas cannot all
    be among the group's 2 ranks, asking for the data-parallel size the caller had not given. The
    group's own rank is no default: the group may hold tensor-parallel peers. One process cannot
    make a group smaller than its world, so the world's size is stood in for."""
    import torch.distributed as dist

    from zephon.integrations.torchtitan import ZephonDataLoader

    group = dist.new_group([0])
    with ZephonDataLoader(pipeline, rank, world, 16, local_batch_size=4, group=group) as loader:  # the whole world
        assert (loader.dp_rank, loader.dp_world_size) == (0, 1)
    sizes = dist.get_world_size
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 8 if g is None else sizes(g))
    with pytest.raises(ConfigurationError, match=r"group=\.\.\.\) holds 1 of the 8 ranks.*give dp_rank and dp_world_size"):
        ZephonDataLoader(pipeline, rank, world, 16, local_batch_size=4, group=group)
    with ZephonDataLoader(pipeline, 0, 1, 16, local_batch_size=4, group=group) as loader:  # given: taken
        assert (loader.dp_rank, loader.dp_world_size) == (0, 1)


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "4", "RANK": "2"}, {"WORLD_SIZE": "2"}])
def test_a_launcher_world_without_a_process_group_is_refused_not_read_as_one_rank(monkeypatch, pipeline, env):
    """Under torchrun (WORLD_SIZE=4) before init_process_group, `shard()` made every process rank 0
    of 1: each of the four read all eight lanes, the same data four times over, silently."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=f"WORLD_SIZE={env['WORLD_SIZE']} .* no torch.distributed process group"):
        pipeline.shard(global_batch_size=16)


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1", "RANK": "0"}])
def test_one_process_or_an_explicit_layout_is_taken_without_a_process_group_whatever_the_launcher_says(
    monkeypatch, pipeline, env
):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pipeline.shard(global_batch_size=16) as loader:
        assert (loader.rank, loader.world_size) == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pipeline.shard(1, 2, global_batch_size=16) as loader:  # explicit values win, as documented
        assert (loader.rank, loader.world_size) == (1, 2)


def test_finding_the_layout_without_a_process_group_never_imports_torch():
    """No process group can exist in a process that never imported torch, yet asking for the layout
    (`pipeline.shard()` without a rank, `for batch in pipeline`) imported it to check: ~1 s and
    ~190 MiB in a data job that never uses torch, against the module's promise that nothing there
    imports torch unless a process group is in use."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from zephon.distributed import group_size, rank_and_world_size\n"
        "print(rank_and_world_size(), group_size(), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**env, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(0,", "1)", "None", "False"]


def test_without_a_process_group_gathering_returns_the_ranks_own_lanes_and_a_resume_needing_more_refuses_it(
    monkeypatch, pipeline
):
    """What the README and gather_state's docstring say of a job without a process group: there is
    nothing to gather, so rank 0 of 2 gets lanes 0-3 back, and one rank resuming from that alone is
    refused, naming the lanes it lacks."""
    from zephon import CheckpointError
    from zephon.distributed import gather_state

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pipeline.shard(0, 2, global_batch_size=16) as loader:
        next(iter(loader))
        state = gather_state(loader)
    assert sorted(map(int, state["lanes"])) == [0, 1, 2, 3]
    with pipeline.shard(0, 1, global_batch_size=16) as loader:
        with pytest.raises(CheckpointError, match=r"does not cover lanes \[4, 5, 6, 7\]"):
            loader.load_state_dict(state)


def test_a_torchtitan_loader_on_another_rank_of_the_first_replica_leaves_configuration_warnings_to_rank_0(
    one_process_group, pipeline, monkeypatch, caplog
):
    """With tensor or pipeline parallelism, every rank of the first data-parallel replica has
    dp_rank 0: those ranks repeated rank 0's configuration warnings. The process group's own rank
    picks the one process that says them (here the group's rank stands in for a job's 0 and 5)."""
    import torch.distributed as dist

    from zephon.integrations.torchtitan import ZephonDataLoader

    config = ZephonDataLoader.Config(recipe=pipeline)  # no global_batch_size: a warning
    monkeypatch.setenv("RANK", "0")  # a launcher's RANK is read only without a process group
    warned = {}
    for rank in (0, 5):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zephon.integrations.torchtitan"):
            config.build(dp_world_size=1, dp_rank=0, local_batch_size=16, seq_len=None).close()
        warned[rank] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned[0]) == 1 and "global_batch_size is not set" in warned[0][0]
    assert warned[5] == []


def test_gathering_the_state_of_a_pipeline_instead_of_its_loader_names_the_mistake(monkeypatch, pipeline):
    """`gather_state(pipeline)` (the recipe, not `pipeline.shard(...)`) failed with the pipeline's
    AttributeError, "Pipeline has no operator 'state_dict'", not the ConfigurationError that
    gather_state gives any other object that is not a rank's loader."""
    from zephon.distributed import gather_state

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    said = r"takes one rank's Zephon loader \(pipeline\.shard\(\.\.\.\)\), got a Pipeline, which has no state_dict\(\)"
    with pytest.raises(ConfigurationError, match=said):
        gather_state(pipeline)
