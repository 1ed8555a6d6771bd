"""A rank loader copied into several torch DataLoader workers: refused, not handed over once per worker.

A trainer that wraps its loader in `torch.utils.data.DataLoader(..., num_workers=N)` forks N
workers, each holding a copy of the loader made in the trainer's process. Every copy iterates the
rank's whole stream, and the DataLoader takes from each worker in turn, so with N ≥ 2 the trainer
got every microbatch N times, silently: no global batch was the recipe's. One worker hands each
microbatch over once, and a loader each worker builds for itself is its own; neither is refused.

torch is asked only where it is already imported: a DataLoader worker has imported it, and a
process without it has no such workers.
"""

from __future__ import annotations

import os
import sys

from ._errors import ConfigurationError

__all__ = ["refuse_copies_in_several_dataloader_workers"]


def refuse_copies_in_several_dataloader_workers(built_in_pid: int) -> None:
    """Raise where this process is one of several DataLoader workers iterating a copy of a loader
    built in process `built_in_pid` (the trainer's)."""
    if os.getpid() == built_in_pid:
        return
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    if info is None or info.num_workers < 2:
        return
    raise ConfigurationError(
        f"this loader is iterated in torch DataLoader worker {info.id} of {info.num_workers}, each holding a copy "
        f"of the loader built in the trainer's process: every copy hands over the rank's whole stream, so the "
        f"trainer would get each microbatch {info.num_workers} times. Iterate the loader itself, or give the "
        "DataLoader num_workers=0 (Zephon's runner already reads and tokenizes in parallel: "
        ".options(runner=...), parallelism=); with num_workers=1 the worker's copy is the one that moves, so "
        "the trainer's loader.state_dict() stays where it was"
    )
