"""The stateful half of every operator.

An accumulator sees every item of one lane, in order, on one thread, and makes every stateful
decision (which documents share a packed row, what a shuffle buffer emits). It lives for exactly
one *segment*: the items between two flush sentinels. A new segment gets a new accumulator built
from the segment's context, so its behaviour after a flush is a pure function of the input after
that flush — which is what lets a checkpoint hold cursors instead of buffers.

Thread-safety: an accumulator is thread-unsafe by contract; the lane driver is its only caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from ._random import SeededStream

__all__ = ["Accumulator", "AccumulatorFactory", "SegmentContext"]


@dataclass(frozen=True)
class SegmentContext:
    """Everything an accumulator may depend on besides its input: the lane and segment it serves."""

    lane: int
    segment: int

    def rng(self, seed: int, purpose: str) -> SeededStream:
        """A stream derived from (seed, purpose, lane, segment) and nothing else.

        Never from a rank, a worker id or the wall clock: the same segment of the same lane gets the
        same stream on every layout and after every resume.
        """
        return SeededStream.from_key(f"{seed}/{purpose}/{self.lane}/{self.segment}")


@runtime_checkable
class Accumulator(Protocol):
    """`push` takes one item and returns the items now ready (possibly none), in order;
    `flush` returns everything still held and leaves the accumulator empty.

    An accumulator that refuses items (it cannot place them) also offers `drain_skips()`, returning
    and forgetting the items refused since the last call, as (address, reason) pairs or (address,
    reason, detail) triples; the lane driver passes them to the ledger. A detail says what was wrong
    (`stats()["skipped_examples"]` shows it): a string, or a function making it, called only for the
    few skips kept as examples. One that cuts items to fit offers `drain_truncations()` likewise, as
    (address, tokens dropped) pairs, counted as `truncated` and `truncated_tokens`.

    The last accumulator of a pipeline emits rows: `PackedSequence`s, or row plans. A row names the
    record of each of its documents (`sources`, see `PackedSequence`; one holding a document it
    names none for is refused with ConfigurationError). A row plan has
    `num_real_tokens`, `length`, `sources`, `tokens_by_dataset` and `images_by_dataset` (what the
    ledger counts per dataset; a row without them is refused with ConfigurationError) like a row,
    `assemble()` returning its
    `PackedSequence`, and may offer a static `assemble_batch(plans)` returning a microbatch's
    (tokens, ragged, ragged_counts) directly. The loader assembles plans only when it collates them
    into a microbatch, so rows waiting in later accumulators (shuffle buffers) cost references, not
    copies, and rows a resume replays past are never assembled.

    A packing *operator* may offer `bound_to(record_operators)`, returning the operator the loader
    uses in its place (see `Pipeline.apply`), and `row_work(on_error, record_operators)`: stateless
    work the loader has done on each row a few rows before it takes it (vlm: decoding the images
    its record operators packed encoded), never for rows a resume replays past. It has `order(row)` (what the
    work needs, or None), a pure `run(order)` that runs on the runner's workers, and
    `apply(row, result)` returning the finished row. A row may then report `masked_documents`,
    (address, reason) or (address, reason, detail) tuples the ledger counts with the rows and
    `stats()["skipped_examples"]` names with their detail.
    A packing operator that packs token ids alone says so with `carries_media = False`
    (`pack_flat`): the loader then refuses it after a record operator declaring `media_fields`
    (see `RecordOperator`), whose media it would drop.
    """

    def push(self, item: Any) -> list[Any]: ...

    def flush(self) -> list[Any]: ...


AccumulatorFactory = Callable[[SegmentContext], Accumulator]
