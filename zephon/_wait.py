"""How long the trainer waited for data: the time its thread spent inside a loader's `next()`.

The first thing to ask when step time or MFU drops is whether the job is waiting on its data.
These numbers answer it for one loader object in one process: wall-clock, different on every run,
machine and load, so unlike the ledger's counts they are no part of a recipe's outcome. They are
never saved in a checkpoint, and neither a resume nor `load_state_dict` restores or resets them: a
loader resumed in a new process starts from zero, and a loader that loads a state or is iterated
again carries on, the replay its next batch waits for counted in that batch's wait. A copy forked
with the process (a `multiprocessing.Process` the trainer starts) starts from its parent's numbers
as they were at the fork and counts its own batches on from there.

A `next()` may also wait for a `state_dict()` or `load_state_dict()` running on another thread
(an asynchronous checkpointer), which holds the loader while it reads or replaces the cursors.
That time says nothing about the data, and counted as data wait it made a checkpointer's stalls
look like a slow input pipeline: it is kept apart (`checkpoint_s`).

The numbers are one tuple, replaced whole per batch (`after`): the loader stores it in the same
statement that moves a lane's cursor past the microbatch, so an interrupt counts a wait exactly
when it counts the microbatch as handed over, and a reader on another thread sees one batch's
numbers, never half of them.
"""

from __future__ import annotations

__all__ = ["NO_WAITS", "after", "checkpoint_s", "report"]

NO_WAITS = (0, 0.0, None, None, 0.0, 0.0)
"""(batches handed over, seconds waited for data in all, the first batch's wait, the last one's,
the longest, seconds waited for a save or load on another thread in all)."""


def after(waits: tuple, waited: float, held_back: float) -> tuple:
    """`waits` with one more batch handed over after `waited` seconds waiting for data and
    `held_back` seconds waiting for a save or load on another thread."""
    batches, total, first, _, longest, checkpoint = waits
    return (
        batches + 1, total + waited, waited if first is None else first, waited, waited if waited > longest else longest,
        checkpoint + held_back,
    )


def report(waits: tuple) -> dict:
    """The wait section of `RankLoader.stats()`; `first_s` and `last_s` are None before any batch."""
    batches, total, first, last, longest, _ = waits
    return {"batches": batches, "total_s": total, "first_s": first, "last_s": last, "longest_s": longest}


def checkpoint_s(waits: tuple) -> float:
    """`RankLoader.stats()["checkpoint_wait_s"]`: the seconds the handed-over batches' `next()`
    calls waited for a save or load on another thread."""
    return waits[5]
