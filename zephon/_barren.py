"""A recipe whose every record is dropped (a misnamed field, a filter or an image spec nothing
passes) fails naming why, instead of reading forever (an endless plan) or ending after zero steps
(a finite plan: a training job that "succeeds" having trained on nothing).

Both refusals share one message (`barren_error`): how many records were read without a row, what
dropped them by reason, and what to check. An endless plan's lane decides alone, once it has read
its share without a row (`LaneStream`, bounded by `MixturePlan.barren_records`). A finite plan is
decided at its end, for the whole recipe (`refuse_a_finite_run_without_rows`).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping

from ._errors import ConfigurationError
from ._ledger import Ledger

__all__ = ["barren_error", "filtered_note", "refuse_a_finite_run_without_rows"]

_WHAT_TO_CHECK = (
    "Check the field names, the filters and the image or video specs against the data: with "
    '.options(on_error="raise") the first record dropped fails naming itself and why (a missing field by its name).'
)


_FILTERED_MEANS = (
    "'filtered' counts the records a filter returned false for and those a map returned None for: one that "
    "changes its record in place needs `return record`"
)


def filtered_note(drops: Mapping[str, int]) -> str:
    """What `filtered` among the drop reasons may mean, said where a refusal counts it: a map that
    changes its record in place and returns nothing drops every record as filtered, in a recipe
    that may have no filter at all, and the refusal sent its author to the filters."""
    return f" ({_FILTERED_MEANS})" if drops.get("filtered") else ""


def barren_error(read: str, drops: Counter, why: str) -> ConfigurationError:
    """The refusal of a recipe that `read` records (a phrase: "lane 3 read 4096 records in a
    row") and handed over no row, naming the five commonest reasons in `drops` (ties by name, so
    the message is the same whichever order they were counted in) and `why` it is refused."""
    commonest = sorted(drops.items(), key=lambda item: (-item[1], item[0]))[:5]
    listed = ", ".join(f"{reason}: {n}" for reason, n in commonest)
    return ConfigurationError(
        f"{read} and handed over no row (dropped: {listed or 'none counted'}): {why}. {_WHAT_TO_CHECK}"
        + filtered_note(drops)
    )


def refuse_a_finite_run_without_rows(
    num_lanes: int,
    rank_lanes: list[int],
    rank_ledger: Ledger,
    *,
    handed_over_a_row: bool,
    finite: Callable[[int], bool],
    gives_a_row: Callable[[int, Ledger], bool],
) -> None:
    """Called by a rank loader whose lanes of a finite plan are all finished: raise the barren
    error if no lane of the recipe ever gave a row although its lanes read records.

    The rank says what it knows, and nothing else of it is read here: the recipe's `num_lanes`, the
    rank's own lanes and the ledger they counted into, whether any of them `handed_over_a_row`,
    whether a lane is `finite`, and `gives_a_row(lane, ledger)`: whether another rank's lane, read
    from its start on a stream of its own, gives a row, its records counted into `ledger` only.

    The decision is the recipe's, not the rank's, so that it is the same on every world size: in
    the ragged end of a tiny dataset, or with a filter that keeps few records, some lanes rightly
    give no row (`test_a_rank_whose_every_lane_gives_no_row_...`), and on enough ranks every lane
    of one rank may be such a lane while the others train. So a rank that handed over no row asks
    the other ranks' lanes too, each from its start on a stream of its own (records counted apart
    from the rank's ledger), in order until one gives a row; if none does, every rank refuses,
    naming the same counts (the whole recipe's) on any world size.
    Asking costs nothing on a rank that handed over a row, the first rows of the other lanes on a
    rank that handed over none in a run that has rows, and, in a recipe that drops everything,
    a read of the lanes of the other ranks (the whole data on each rank, the price of one answer
    on every world size). A plan that holds no record at all ends as before, with no batch: there
    is nothing to name, and an empty dataset is refused earlier where it cannot be planned.

    A rank that handed over rows before (a resumed run, a second iteration) is never refused: a
    run that ran out after some batches ended as it should. An endless lane of another rank (a
    user's `WorkPlan` mixing finite and endless lanes) may give rows later, so it is not asked."""
    if handed_over_a_row:
        return
    mine = set(rank_lanes)
    others = [lane for lane in range(num_lanes) if lane not in mine]
    if not all(finite(lane) for lane in others):
        return
    apart = Ledger()
    if any(gives_a_row(lane, apart) for lane in others):
        return
    read, drops = 0, Counter()
    for ledger in (rank_ledger, apart):
        for counts in ledger.snapshot()["datasets"].values():
            total = counts["total"]
            read += total["read"]
            drops.update(total["skipped"])
            if total["filtered"]:
                drops["filtered"] += total["filtered"]
    if read:
        raise barren_error(
            f"the finite plan's {num_lanes} lanes read {read} records",
            drops,
            "every record was dropped, and the run would end having trained on nothing",
        )
