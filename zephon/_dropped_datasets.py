"""A warning for a dataset of a mixture whose every record this rank read was dropped.

Without `TokenEstimation` nothing refuses such a dataset (its text under another field name than
the others'): the other datasets give rows, so no lane is barren (`_barren`), and the run trains on
them alone, endlessly, the dataset's weight unmet, every record counted in `stats()` and nothing
said. Once every lane of this rank has read a full pass of its share of the dataset's records
(`MixturePlan.records_per_pass`) with none handed on to packing (net of those a packer refused), the
loader says so once at WARNING on the `zephon` logger: the dataset, its drop reasons and counts, its
mixture weight, and that `TokenEstimation` would refuse it at planning. Per lane, since lanes read at
their own pace: a lane whose share is all dropped reads it over and over (it yields no tokens to
meet the weight), and summed over the rank that made a pass while another lane, its share holding
good records, had not yet read them.

A log, not a refusal: a refusal must be the recipe's decision, the same on every world size (as
`_barren` makes it for a recipe that drops everything), and what one rank has read is not that. It
reads no record and changes no batch. The counts are the ledger's, taken up as each iteration opens
its lanes (`recount`) and carried on chunk by chunk: a record replayed by a new iteration or a resume
is counted once, and a resumed run counts the records read before it. The warning is process-local
like `SkipExamples`: once per loader object, never saved.

Thread-unsafe: `recount` and `note_*` run on the loader's thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Mapping

from ._barren import filtered_note
from ._records import ChunkRecords

__all__ = ["DroppedDatasets"]


class _Seen:
    """What this rank read of one watched dataset: records read per lane, records handed on to
    packing and not refused since, and the drops by reason."""

    __slots__ = ("read", "emitted", "drops")

    def __init__(self) -> None:
        self.read, self.emitted, self.drops = Counter(), 0, Counter()


class DroppedDatasets:
    """Watches the datasets given `passes` ({dataset: {lane: records the lane reads of it in one
    pass}}) and `weights` (a phrase per dataset) until each is found dropping everything, warned of
    once on `log`."""

    def __init__(self, passes: Mapping[str, Mapping[int, int]], weights: Mapping[str, str],
                 log: logging.LoggerAdapter | logging.Logger) -> None:
        self._passes = {dataset: {lane: n for lane, n in lanes.items() if n > 0} for dataset, lanes in passes.items()}
        self._weights = dict(weights)
        self._log = log
        self._watched = {dataset: _Seen() for dataset, lanes in self._passes.items() if lanes}

    def recount(self, datasets: Mapping[str, Mapping]) -> None:
        """Take up the ledger's counts (`Ledger.snapshot()["datasets"]`) of each watched dataset as
        an iteration opens its lanes, their replayed segments taken out: a new iteration (or a
        load) reads those again, and counted on top, a rank that had read a third of its share,
        all dropped, said it had read a full pass."""
        for dataset, seen in list(self._watched.items()):
            counts = datasets.get(dataset, {})
            total = counts.get("total", {})
            seen.read = Counter({lane: c.get("read", 0) for lane, c in counts.get("lanes", {}).items()})
            seen.emitted = total.get("emitted", 0)
            seen.drops = Counter(total.get("skipped", {}))
            if total.get("filtered"):
                seen.drops["filtered"] = total["filtered"]
            self._decide(dataset, seen)

    def note_chunk(self, lane: int, batch: ChunkRecords) -> None:
        seen = self._watched.get(batch.chunk.dataset) if self._watched else None
        if seen is None:
            return
        seen.read[lane] += batch.chunk.num_records
        seen.emitted += len(batch.records)
        if batch.skipped:
            seen.drops.update(reason for _, reason in batch.skipped)
        if batch.filtered:
            seen.drops["filtered"] += len(batch.filtered)
        self._decide(batch.chunk.dataset, seen)

    def note_skips(self, skips: list) -> None:
        """Items an accumulator refused, as (address, reason[, detail]): handed on, then dropped."""
        if not self._watched:
            return
        for address, reason, *_ in skips:
            seen = self._watched.get(address.dataset)
            if seen is not None:
                seen.emitted -= 1
                seen.drops[reason] += 1
                self._decide(address.dataset, seen)

    def _decide(self, dataset: str, seen: _Seen) -> None:
        """Warn once each lane has read a full pass of its share with nothing left handed on. One
        that handed records on stays watched: a packer may refuse them later (`note_skips`)."""
        if seen.emitted > 0 or any(seen.read[lane] < n for lane, n in self._passes[dataset].items()):
            return
        del self._watched[dataset]
        commonest = sorted(seen.drops.items(), key=lambda item: (-item[1], item[0]))[:5]
        listed = ", ".join(f"{reason}: {n}" for reason, n in commonest) or "none counted"
        self._log.warning(
            "dataset %r: every one of the %d records this rank read of it (a full pass of its share) was dropped "
            "(%s), so the run trains on the other datasets alone and its mixture weight (%s) goes unmet; "
            "TokenEstimation would refuse this dataset at planning. Check its field names and filters against "
            "its data: loader.stats()['skipped_examples'] names the first records dropped%s",
            dataset, sum(seen.read.values()), listed, self._weights.get(dataset, "?"), filtered_note(seen.drops),
        )
