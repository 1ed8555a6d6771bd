"""Who says what in a job's log: the configuration once per job, a process's own events with its rank.

Every rank of a data-parallel job runs its own loader on the same configuration, so a line about
that configuration (an ignored argument, the runner chosen, a tokenizer setting) came once per
rank: a thousand identical lines from a thousand GPUs. Such a line keeps its level on the one
process that speaks for the job and drops to DEBUG on the others, where whoever debugs one rank
still finds it. An event of one process (a worker crashed, a read retried) is that process's
alone, so it stays on every rank, naming which.
"""

from __future__ import annotations

import logging

from .distributed import job_rank

__all__ = ["RankLog", "config_level"]


def config_level(level: int, dp_rank: int | None = None) -> int:
    """`level` where this process speaks for the job, else DEBUG.

    The job's rank 0 speaks (`job_rank`: the process group's, or torchrun's `RANK`). Where no job
    rank is known (ranks given by hand, no launcher), the data-parallel rank 0 does: `dp_rank`,
    and a process that knows neither is a job of its own."""
    rank = job_rank()
    if rank is None:
        rank = dp_rank or 0
    return level if rank == 0 else logging.DEBUG


class RankLog(logging.LoggerAdapter):
    """A logger whose lines begin with the process's rank in the job (`job_rank`) where one is
    known: "worker crashed" from one of a thousand ranks says nothing of which node to look at.
    The rank is looked up only for a line that is written, so a quiet logger costs nothing."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})

    def process(self, msg, kwargs):
        rank = job_rank()
        return (msg if rank is None else f"rank {rank}: {msg}"), kwargs
