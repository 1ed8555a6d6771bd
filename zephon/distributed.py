"""torch.distributed integration: rank discovery and gathering every rank's lane state.

torch stays optional: nothing here imports it unless a process group is actually in use.
"""

from __future__ import annotations

import json
import os
import sys

from ._checkpoint import STATE_FORMAT, merge_states
from ._errors import ConfigurationError

__all__ = ["rank_and_world_size", "job_rank", "group_size", "gather_state"]


def _dist():
    """torch.distributed where a process group is initialised, else None. A process that never
    imported torch has none, so torch is not imported to ask (~1 s and ~190 MiB for a data job
    that never uses it)."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world_size(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Explicit values win; otherwise the initialised process group's; otherwise (0, 1), unless a
    launcher's `WORLD_SIZE` says there is more than one process (refused: see below).

    Without a process group, one of the two alone is refused: a world size without a rank would
    make every process rank 0 (all reading the same lanes), and a rank without a world size means
    nothing. With one, the value given alone must be the group's own: the group's rank in another
    world size (a world size of 8 on 4 processes) leaves the lanes of the missing ranks unread, and
    another rank in the group's world size gives two processes the same lanes, both silently. With
    neither, no group, and `WORLD_SIZE` > 1 (torchrun before `init_process_group`), every process
    would take rank 0 of 1 and read the whole stream, the same on each: refused."""
    if rank is not None and world_size is not None:
        return rank, world_size
    dist = _dist()
    if dist is not None:
        group_rank, group_world = dist.get_rank(), dist.get_world_size()
        if (rank, world_size) not in ((None, None), (group_rank, None), (None, group_world)):
            raise ConfigurationError(
                f"rank={rank!r} and world_size={world_size!r} with a process group of rank {group_rank} in "
                f"{group_world}: the one given alone differs from the group's, so give both (a data-parallel "
                "rank and size of your own) or neither"
            )
        return group_rank, group_world
    if rank is not None or world_size is not None:
        raise ConfigurationError(
            f"rank={rank!r} and world_size={world_size!r}: give both, or neither (then they come from an "
            "initialised torch.distributed process group, else a single rank)"
        )
    launched = _launcher_world_size()
    if launched > 1:
        raise ConfigurationError(
            f"WORLD_SIZE={launched} in the environment (a torchrun-style launch) but no torch.distributed process "
            "group is initialised: as a single rank every process would read every lane, the same data on each. "
            "Call torch.distributed.init_process_group() before building the loader, or give rank and world_size"
        )
    return 0, 1


def _launcher_world_size() -> int:
    """The world size a launcher (torchrun, torch.distributed.launch) put in `WORLD_SIZE`; 1 when it
    is unset or not a number. Read only to refuse the one-rank default under a multi-process launch,
    never taken as the layout itself: without a process group `gather_state` could not gather the
    other ranks' lanes, and every checkpoint would hold only its own rank's."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def job_rank() -> int | None:
    """This process's rank in the whole job: the initialised process group's, else the `RANK` a
    launcher (torchrun) set, else None. Unlike a loader's data-parallel rank, it tells every
    process of the job apart (the tensor- and pipeline-parallel ranks of one data-parallel rank
    too), so it is what a log line names and what picks the one process that speaks for the job
    (`zephon._job_log`)."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank()
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def group_size(group=None) -> int | None:
    """The number of ranks `gather_state(loader, group)` gathers from; None without a process group."""
    dist = _dist()
    return None if dist is None else dist.get_world_size(group)


def gather_state(loader, group=None) -> dict:
    """Every rank's lane cursors merged into one state that covers all lanes (an all-gather of
    small JSON). Each rank can save the result with its own checkpoint: resuming on any world
    size then needs no shared filesystem. A collective: every rank of the group calls it at the
    same step (one rank alone waits for the others until the group's timeout).

    Lanes that no rank of the group holds (loaders given a world size larger than the group, or
    a group that leaves out some data-parallel ranks) are refused here, at the save, rather than
    at a resume on another world size, which would find them missing from every checkpoint.
    Without an initialised process group there is nothing to gather: the loader's own state comes
    back, every lane only for a loader of world size 1 (`ZephonDataLoader.state_dict` relies on
    this); merge the ranks' states with `zephon.merge_states`, or a resume that needs the other
    ranks' lanes refuses it, naming them."""
    dist = _dist()
    # A Pipeline (the recipe, given in place of its loader) has no state_dict at all.
    state_dict = getattr(loader, "state_dict", None)
    local = state_dict() if callable(state_dict) else None
    if not (isinstance(local, dict) and local.get("format") == STATE_FORMAT):
        # With a process group the merge would refuse it, without one it would come back as it
        # is: the same mistake must get the same answer either way.
        what = (
            "whose state_dict() is not a Zephon loader state (a ZephonDataLoader's state_dict() gathers "
            "every rank's state itself)"
            if callable(state_dict)
            else "which has no state_dict()"
        )
        raise ConfigurationError(
            f"gather_state takes one rank's Zephon loader (pipeline.shard(...)), got a {type(loader).__name__}, {what}"
        )
    if dist is None:
        return local
    states: list = [None] * group_size(group)
    dist.all_gather_object(states, json.dumps(local), group=group)
    merged = merge_states(json.loads(s) for s in states)
    missing = sorted(set(range(merged["num_lanes"])) - set(map(int, merged["lanes"])))
    if missing:
        raise ConfigurationError(
            f"the process group's {len(states)} ranks hold no loader of lanes {missing} (of "
            f"{merged['num_lanes']}), so a state saved now could not resume them: give every data-parallel rank "
            f"a loader, with rank and world size of the group gathered over (this one: rank {loader.rank} of "
            f"{loader.world_size})"
        )
    return merged
