"""Which records a loader skipped, by example: the counts in `stats()` say how many of each reason,
these say where to look.

The ledger counts skips by (dataset, reason) and keeps no address, so an operator seeing
`corrupt_video: 1` could find the clip only by running the data again with `on_error="raise"`,
which stops at the first bad record. A loader keeps the first `EXAMPLES_PER_REASON` skipped
records of each dataset and reason it took from its lanes, with the lane and what was wrong (the
detail a `BadRecordError` would carry), shown by `stats()["skipped_examples"]`, and logs the first
of each at WARNING on the `zephon` logger.

They are this process's observations, like `stats()["wait"]`: never in `state_dict()`, kept as
they are by `load_state_dict()`, no part of the recipe and no effect on a batch. They are taken in
the order the loader takes its lanes' chunks (never in the order workers finish them), so the same
run on any runner shows the same examples; a record read again (a resume's replay, a second
iteration) is not shown twice.

The details come with the chunk that skipped them (`ChunkRecords.skip_details`, the first few of
each reason per chunk), so a chunk costs a look at its few details, never a walk of its skips, and
nothing when it skipped none. A skip a packer decides (`drain_skips`) may carry its detail as a
function, made only for the skips kept here: a misnamed field refuses every record, and describing
each (its fields, a close name) would cost more than packing it. A document masked in a row handed
over (an image that failed only when its row was decoded, `decode_images(defer=True)`) is kept
under `masked:<reason>`, the name the lane's count has, with the detail its row work gave (the
decoder's error, as a skip's): it is counted per lane, not among the dataset's skips, so its log
line says where.

Thread-unsafe like the ledger: `note_*` run on the loader's thread only. `snapshot` may be read on
another thread (`stats()` from a monitor): an example list is never changed in place but replaced
by a longer tuple in one store, and the snapshot copies the dict in one C call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ._records import DETAILS_PER_REASON, ChunkRecords, RecordAddress

__all__ = ["DETAIL_CHARS", "EXAMPLES_PER_REASON", "SkipExamples", "shown_detail"]

EXAMPLES_PER_REASON = DETAILS_PER_REASON
"""Examples kept per (dataset, reason): enough to tell one bad file from a pattern across shards,
few enough that a `stats()` of many datasets and reasons stays readable."""

DETAIL_CHARS = 500
"""The most of a detail an example keeps and logs: a user's image processor may raise with its
input in the message, which made a log line and a `stats()` entry as long as that input."""


def shown_detail(detail: str | Callable[[], str]) -> str:
    """A skip's detail as an example shows it: made where it is a function, cut to `DETAIL_CHARS`.
    The token estimate's refusal shows its sample's first skip of each reason in these words too."""
    if not isinstance(detail, str):
        detail = detail()
    if len(detail) > DETAIL_CHARS:
        detail = f"{detail[:DETAIL_CHARS]}… ({len(detail) - DETAIL_CHARS} more characters)"
    return detail


_LATER = (
    "later skips are counted in loader.stats()['datasets'], and the first {n} of each dataset and reason "
    "are listed in loader.stats()['skipped_examples']"
)


_LATER_MASKED = (
    "its row was handed over with that image's patches zero and the document's labels -100; later ones "
    "are counted per lane in loader.stats()['lanes'], and the first {n} of each dataset and reason are "
    "listed in loader.stats()['skipped_examples']"
)


class SkipExamples:
    """The first skipped records of each (dataset, reason) this loader took from its lanes."""

    def __init__(self, log: logging.LoggerAdapter | logging.Logger) -> None:
        self._log = log
        # {(dataset, reason): ((lane, address, detail), ...)}, at most EXAMPLES_PER_REASON each
        self._examples: dict[tuple[str, str], tuple[tuple[int, RecordAddress, str], ...]] = {}

    def note_chunk(self, lane: int, batch: ChunkRecords) -> None:
        """A chunk's records as its lane took them: its skips' kept details, in the chunk's order."""
        for reason, details in batch.skip_details.items():
            for address, detail in details.items():
                if not self._note(lane, address, reason, detail):
                    break

    def note_skips(self, lane: int, skips: list) -> None:
        """Items an accumulator refused, as (address, reason) or (address, reason, detail)."""
        for address, reason, *detail in skips:
            self._note(lane, address, reason, detail[0] if detail else "")

    def note_masked(self, lane: int, masked) -> None:
        """Documents masked in a row the loader handed over, as (address, reason) or (address,
        reason, detail)."""
        for address, reason, *detail in masked:
            self._note(lane, address, f"masked:{reason}", detail[0] if detail else "", masked=True)

    def _note(self, lane: int, address: RecordAddress, reason: str, detail: str | Callable[[], str],
              masked: bool = False) -> bool:
        """Keep the skip as an example if its (dataset, reason) has fewer; False once it is full. A
        detail given as a function is made only then."""
        key = (address.dataset, reason)
        examples = self._examples.get(key, ())
        if len(examples) >= EXAMPLES_PER_REASON:
            return False
        if any(seen == address for _, seen, _ in examples):
            return True
        detail = shown_detail(detail)
        self._examples[key] = (*examples, (lane, address, detail))
        if not examples:
            self._log.warning(
                "dataset %r: %s as %s at %s (lane %d)%s; %s",
                address.dataset, "masked a document" if masked else "skipped a record", reason, address, lane,
                f": {detail}" if detail else "", (_LATER_MASKED if masked else _LATER).format(n=EXAMPLES_PER_REASON),
            )
        return True

    def snapshot(self) -> dict:
        """A fresh JSON-able copy: {dataset: {reason: [{"address", "shard", "index", "lane",
        "detail"}, ...]}}, datasets and reasons sorted, each list in the order its skips were taken."""
        out: dict[str, dict[str, list[dict]]] = {}
        for (dataset, reason), examples in sorted(list(self._examples.items())):
            out.setdefault(dataset, {})[reason] = [
                {"address": str(address), "shard": address.shard, "index": address.index, "lane": lane,
                 "detail": detail}
                for lane, address, detail in examples
            ]
        return out
