"""A rank loader copied into torch DataLoader workers: refused, not iterated there.

A trainer that wraps its loader in `torch.utils.data.DataLoader(..., num_workers=N)` forks N
workers, each holding a copy of the loader made in the trainer's process, and each copy iterates
the rank's whole stream. With N ≥ 2 the DataLoader took from each worker in turn, so the trainer
got every microbatch N times, silently. With N = 1 the batches were right, but the copy that moved
was the worker's: the trainer's `loader.state_dict()` stayed where it was built, so a checkpoint
saved from it resumed from there and replayed data, silently too. Zephon's runner already works
in parallel, so a DataLoader worker adds nothing: every copy is refused. A loader each worker
builds for itself is its own and is not refused.

torch is asked only where it is already imported: a DataLoader worker has imported it, and a
process without it has no such workers.
"""

from __future__ import annotations

import os
import sys

from ._errors import ConfigurationError

__all__ = ["refuse_copies_in_dataloader_workers"]


def refuse_copies_in_dataloader_workers(built_in_pid: int) -> None:
    """Raise where this process is a DataLoader worker iterating a copy of a loader built in
    process `built_in_pid` (the trainer's)."""
    if os.getpid() == built_in_pid:
        return
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    if info is None:
        return
    repeated = (
        f"every copy hands over the rank's whole stream, so the trainer would get each microbatch "
        f"{info.num_workers} times"
        if info.num_workers > 1
        else "the worker's copy would move while the trainer's loader.state_dict() stayed where it was built, "
        "so a checkpoint saved from it would resume there and replay the data"
    )
    raise ConfigurationError(
        f"this loader is iterated in torch DataLoader worker {info.id} of {info.num_workers}, a copy of the "
        f"loader built in the trainer's process: {repeated}. Iterate the loader itself, or give the DataLoader "
        "num_workers=0 (Zephon's runner already reads and tokenizes in parallel: .options(runner=...), "
        "parallelism=), or build the loader inside each worker from the Pipeline"
    )
