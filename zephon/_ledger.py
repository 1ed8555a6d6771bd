"""The ledger: what happened to every record, per dataset and lane.

Record counts (read, emitted, filtered, skipped by reason) are kept per lane *segment* as chunk
results are consumed. Segments before a lane's replay point are *settled* and travel in the
checkpoint; a resumed loader restores them into a new ledger, which it installs with the cursors in
one step (so an interrupted load leaves the old ledger whole), and recounts the replayed segments
from scratch, so no record is counted twice or lost across a resume, on any world size. Row counts
(rows, tokens, padding, learned tokens, documents masked in them, and the tokens, images and learned
tokens of each dataset in them: the realised mixture) are taken when rows are handed to the trainer
and travel as they are: a microbatch's rows are counted into a copy of its lane's counts, which the
loader stores in the statement that moves the lane's cursor past them (see `rows`).

A lane's row counts are one flat Counter, per-dataset ones under `tokens:<dataset>`,
`images:<dataset>` and `learned:<dataset>` (as masked documents are under `masked:<reason>`), so
they travel in a checkpoint in the shape it always had. A state saved before a count was kept
carries none of it: that count, in a run resumed from it, covers the rows handed over since.

Record counts are kept per lane, then per segment: a rank may own hundreds of lanes, and settling
or replaying one lane (every lane at each `state_dict`) must not walk the others' counts. Keyed by
(lane, segment) pairs, each settle walked them all: a save of 1,024 lanes took 0.28 s in it.

Thread-unsafe: counts are kept on the loader's thread only, so they need no locks. `snapshot` may
be read from another thread (a monitor calling `stats()` while the trainer iterates), and shows
whole counting steps: a lane's record counts (`_LaneRecords`) are never changed in place, but
counted into copies that one store puts in place of the old, per call (a chunk, an accumulator's
skips or cuts, a settle), as its row counts are per microbatch. The snapshot copies the two
per-lane dicts in one C call each (`list(d.items())`) and walks the copies. Counted in place, key
by key, a snapshot could show a chunk read but its skips not yet counted, or a skip taken from
`emitted` and not yet added to `skipped`, and a segment being settled in neither its settled nor
its open counts. Under any snapshot, then, `read == emitted + filtered + skipped` for every dataset
and lane, and a lane's per-dataset tokens and learned tokens add up to its `tokens` and `learned`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import NamedTuple

from ._records import ChunkRecords

__all__ = ["Ledger"]


class _LaneRecords(NamedTuple):
    """A lane's record counts: `settled` ({dataset: Counter}) and `open` ({segment: {dataset:
    Counter}}). Never changed once stored, dicts and Counters alike: a change is a new one."""

    settled: dict[str, Counter]
    open: dict[int, dict[str, Counter]]


_NO_RECORDS = _LaneRecords({}, {})


class Ledger:
    """One loader's counts of records per lane and segment and of rows per lane (see the module
    docstring for what is counted when, and what a monitor's `snapshot` sees)."""

    def __init__(self) -> None:
        self._records: dict[int, _LaneRecords] = {}
        # Row counts per lane. A lane's Counter is replaced whole, never changed in place: the
        # loader counts a microbatch's rows into a copy (`rows_of`, `count_rows`, `count_masked`)
        # and stores it in the one statement that moves the lane's cursor past them. Counted in
        # place, an interrupt between two rows left the first counted with the cursor before the
        # microbatch, and it was counted again when the microbatch was handed over again.
        self.rows: dict[int, Counter] = defaultdict(Counter)

    def count_chunk(self, lane: int, segment: int, batch: ChunkRecords) -> None:
        chunk = batch.chunk
        counts = Counter(self._records.get(lane, _NO_RECORDS).open.get(segment, {}).get(chunk.dataset, ()))
        counts["read"] += chunk.num_records
        counts["emitted"] += len(batch.records)
        counts["filtered"] += len(batch.filtered)
        for _, reason in batch.skipped:
            counts[f"skipped:{reason}"] += 1
        self._store_open(lane, segment, {chunk.dataset: counts})

    def count_skips(self, lane: int, segment: int, skips: list) -> None:
        """Items an accumulator refused, as (address, reason[, detail]): no longer emitted, now skipped."""
        counts = self._open_copies(lane, segment, skips)
        for address, reason, *_ in skips:
            dataset = counts[address.dataset]
            dataset["emitted"] -= 1
            dataset[f"skipped:{reason}"] += 1
        self._store_open(lane, segment, counts)

    def count_truncations(self, lane: int, segment: int, cuts: list) -> None:
        """Items an accumulator cut to fit, as (address, tokens dropped): still emitted, counted as
        `truncated` (items) and `truncated_tokens`."""
        counts = self._open_copies(lane, segment, cuts)
        for address, dropped in cuts:
            dataset = counts[address.dataset]
            dataset["truncated"] += 1
            dataset["truncated_tokens"] += dropped
        self._store_open(lane, segment, counts)

    def _open_copies(self, lane: int, segment: int, items: list) -> dict[str, Counter]:
        """Copies of the lane's open counts in `segment` of each dataset of `items` (tuples whose
        first item is an address), to count them into and store with `_store_open`."""
        datasets = self._records.get(lane, _NO_RECORDS).open.get(segment, {})
        return {address.dataset: Counter(datasets.get(address.dataset, ())) for address, *_ in items}

    def _store_open(self, lane: int, segment: int, counts: dict[str, Counter]) -> None:
        """Put `counts` ({dataset: Counter}) in place of the lane's open ones in `segment`, in one store."""
        records = self._records.get(lane, _NO_RECORDS)
        datasets = {**records.open.get(segment, {}), **counts}
        self._records[lane] = _LaneRecords(records.settled, {**records.open, segment: datasets})

    def rows_of(self, lane: int) -> Counter:
        """A copy of the lane's row counts, for a microbatch's rows to be counted into (see `rows`)."""
        return Counter(self.rows.get(lane, ()))

    def count_rows(
        self, counts: Counter, real_tokens: int, total_tokens: int, tokens_by_dataset: dict, images_by_dataset: dict,
        learned_by_dataset: dict,
    ) -> None:
        """One row handed to the trainer, counted into `counts` (from `rows_of`), with its
        `tokens_by_dataset` (adding up to `real_tokens`), `images_by_dataset` and
        `learned_by_dataset` (the tokens a loss counts, adding up to the lane's `learned`)."""
        counts["rows"] += 1
        counts["tokens"] += real_tokens
        counts["padding"] += total_tokens - real_tokens
        counts["learned"] += sum(learned_by_dataset.values())
        for dataset, tokens in tokens_by_dataset.items():
            counts["tokens:" + dataset] += tokens
        for dataset, images in images_by_dataset.items():
            counts["images:" + dataset] += images
        for dataset, learned in learned_by_dataset.items():
            counts["learned:" + dataset] += learned

    def count_masked(self, counts: Counter, masked) -> None:
        """Documents a row kept in place but trains nothing on (its row work failed on them), as
        (address, reason) or (address, reason, detail): counted into `counts` with the rows handed to
        the trainer, as `masked:<reason>`."""
        for _, reason, *_ in masked:
            counts[f"masked:{reason}"] += 1

    def settle(self, lane: int, segment: int) -> None:
        """Fold the lane's segments before `segment` (its new replay point) into its settled counts.

        The sums are made on copies and stored in one statement: taken out of the open counts
        first and then added dataset by dataset, an interrupt in between (Ctrl-C at the trainer's
        next ask, after a microbatch took the lane into a new segment) lost them for good, since
        those segments are never read again."""
        records = self._records.get(lane, _NO_RECORDS)
        folded = [s for s in records.open if s < segment]
        if not folded:
            return
        settled = defaultdict(Counter, {d: Counter(c) for d, c in records.settled.items()})
        for s in folded:
            for dataset, counts in records.open[s].items():
                settled[dataset].update(counts)
        still_open = {s: counts for s, counts in records.open.items() if s >= segment}
        self._records[lane] = _LaneRecords(dict(settled), still_open)

    def replay(self, lane: int, segment: int) -> None:
        """The lane is read again from the start of `segment` (a new iteration of the loader):
        settle what lies before it and drop the counts from it on, which the replay counts anew."""
        self.settle(lane, segment)
        records = self._records.get(lane)
        if records is not None:
            self._records[lane] = _LaneRecords(records.settled, {})

    def lane_state(self, lane: int, segment: int) -> dict:
        """JSON-able counts a checkpoint needs for a lane whose replay starts at `segment`."""
        self.settle(lane, segment)
        settled = self._records.get(lane, _NO_RECORDS).settled
        return {
            "records": {d: dict(sorted(c.items())) for d, c in sorted(settled.items())},
            "rows": dict(sorted(self.rows[lane].items())),
        }

    def restore(self, lane: int, state: dict) -> None:
        """Take up a lane's settled counts; everything from its replay point will be recounted."""
        settled = {d: Counter(c) for d, c in state.get("records", {}).items()}
        self._records[lane] = _LaneRecords(settled, {})
        self.rows[lane] = Counter(state.get("rows", {}))

    def snapshot(self) -> dict:
        """A fresh, JSON-able copy (never the live counters): record counts per dataset (per lane and
        total); row counts per lane, each with its `datasets` ({dataset: {"tokens", "images",
        "learned"}}); and
        the `mixture`, those per-dataset row counts summed over the lanes."""
        records, rows = list(self._records.items()), list(self.rows.items())
        per_dataset: dict[str, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
        for lane, (settled, segments) in records:
            for datasets in (settled, *segments.values()):
                for dataset, counts in datasets.items():
                    per_dataset[dataset][lane].update(counts)
        out = {}
        for dataset, lanes in sorted(per_dataset.items()):
            total = Counter()
            for counts in lanes.values():
                total.update(counts)
            out[dataset] = {"lanes": {lane: _split(c) for lane, c in sorted(lanes.items())}, "total": _split(total)}
        lanes = {lane: _split_rows(c) for lane, c in sorted(rows)}
        mixture: dict[str, Counter] = defaultdict(Counter)
        for lane in lanes.values():
            for dataset, counts in lane["datasets"].items():
                mixture[dataset].update(counts)
        return {
            "datasets": out,
            "lanes": lanes,
            "mixture": {dataset: dict(counts) for dataset, counts in sorted(mixture.items())},
        }


def _split(counts: Counter) -> dict:
    out = {k: v for k, v in counts.items() if not k.startswith("skipped:")}
    for key in ("read", "emitted", "filtered"):
        out.setdefault(key, 0)
    out["skipped"] = {k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("skipped:") and v}
    return out


_PER_DATASET = ("tokens", "images", "learned")
"""The row counts kept per dataset, as `<kind>:<dataset>`."""


def _split_rows(counts: Counter) -> dict:
    """A lane's row counts with its `tokens:<dataset>`, `images:<dataset>` and `learned:<dataset>`
    ones gathered under `datasets`, each dataset with all three."""
    out: dict = {"learned": 0}  # a lane restored from a state saved before learned tokens were counted
    datasets: dict[str, dict[str, int]] = {}
    for key, value in counts.items():
        kind, per_dataset, dataset = key.partition(":")
        if per_dataset and kind in _PER_DATASET:
            datasets.setdefault(dataset, dict.fromkeys(_PER_DATASET, 0))[kind] = value
        else:
            out[key] = value
    out["datasets"] = dict(sorted(datasets.items()))
    return out
