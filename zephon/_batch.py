"""Microbatches and the SHA-256 of a global batch.

A microbatch holds `microbatch_size` packed rows of one lane. Its position in the global batch is
(lane, index); `global_batch_digest` sorts by that, so every layout of ranks hashes the same bytes.
Each microbatch a loader makes also says the shape of its step (`StepShape`), so that a global
batch missing a (lane, index) is refused rather than hashed into a digest no run's step has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ._errors import PartialGlobalBatchError, ZephonError
from ._records import RecordAddress
from ._sequence import PackedSequence
from ._sha256 import sha256

__all__ = ["Batch", "StepShape", "MicrobatchDigest", "global_batch_digest", "combine_digests", "collate"]


@dataclass(frozen=True)
class StepShape:
    """What every global step of a loader holds: `microbatches_per_lane` microbatches (indices 0 to
    `microbatches_per_lane - 1`) of each of `num_lanes` lanes. In a `finite` plan a lane ends at a
    step of its own: its last microbatch (`Batch.ends_lane`) may come before the step's last index,
    and a lane that has ended gives none in later steps."""

    num_lanes: int
    microbatches_per_lane: int
    finite: bool


@dataclass
class Batch:
    """One microbatch of one lane at one global step.

    `tokens` holds (microbatch_size, max_length) int32 arrays (a packer may add a field with an
    axis between: VLM's `mrope_position_ids` is (microbatch_size, 3, max_length)); `ragged` holds
    per-row payloads concatenated along axis 0 with `ragged_counts[name][i]` entries from row i.
    `sources[i][d]` is the record whose tokens are where `document_ids[i] == d` (one entry per
    document of row i; a record read twice, in two epochs, may appear twice).
    `step_shape` is the shape of the step it belongs to and `ends_lane` whether its lane has no
    microbatch after it: what lets `global_batch_digest` name the microbatches a step lacks (a
    Batch made by hand has no shape, and is checked for duplicates only). Neither enters a digest.
    """

    lane: int
    step: int
    index: int
    tokens: dict[str, np.ndarray]
    ragged: dict[str, np.ndarray] = field(default_factory=dict)
    ragged_counts: dict[str, np.ndarray] = field(default_factory=dict)
    sources: tuple[tuple[RecordAddress, ...], ...] = ()
    step_shape: StepShape | None = None
    ends_lane: bool = False

    @property
    def num_real_tokens(self) -> int:
        return int(np.count_nonzero(self.tokens["document_ids"] >= 0))

    def learned_by_dataset(self, row: int) -> dict[str, int]:
        """{dataset: learned tokens} of row `row`, read from its labels: the positions a loss
        counts, each for its document's dataset (see `PackedSequence.learned_by_dataset`)."""
        tokens = {name: self.tokens[name][row] for name in ("labels", "document_ids")}
        return PackedSequence(tokens, self.sources[row]).learned_by_dataset

    def to_numpy(self) -> dict[str, np.ndarray]:
        """The microbatch's arrays by name, each ragged field beside its `<name>_counts` (entries
        per row); `to_training` gives the same as torch tensors."""
        out = dict(self.tokens)
        out.update(self.ragged)
        out.update({f"{k}_counts": v for k, v in self.ragged_counts.items()})
        return out

    def to_training(self) -> dict:
        """torch tensors for a training step (int64 ids, as embedding layers expect)."""
        try:
            import torch
        except ImportError as exc:  # torch is an extra: say which, not just that a module is missing
            raise ModuleNotFoundError("Batch.to_training needs torch: pip install 'zephon[torch]'", name="torch") from exc

        out = {}
        for name, array in self.to_numpy().items():
            tensor = torch.from_numpy(np.ascontiguousarray(array))
            out[name] = tensor.long() if array.dtype == np.int32 and name in _ID_FIELDS else tensor
        return out

    def update_digest(self, h) -> None:
        """Feed this microbatch's content, in a fixed field order, into a hashlib object."""
        for group in (self.tokens, self.ragged, self.ragged_counts):
            for name in sorted(group):
                array = np.ascontiguousarray(group[name])
                h.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
                h.update(array.tobytes())

    def digest(self) -> str:
        """SHA-256 of this microbatch's arrays (names, dtypes, shapes and bytes, in a fixed order):
        what `global_batch_digest` combines, and what a rank sends the others instead of its
        tensors (`combine_digests`)."""
        import hashlib  # OpenSSL's SHA-256 for whole tensors, loaded only by who asks (see _sha256)

        h = hashlib.sha256()
        self.update_digest(h)
        return h.hexdigest()

    def to_digest(self) -> MicrobatchDigest:
        """This microbatch's digest with its place in the global batch: what a rank gathers from
        the others (a hundred bytes, not the tensors) for `global_batch_digest` to check and combine."""
        return MicrobatchDigest(self.lane, self.step, self.index, self.digest(), self.step_shape, self.ends_lane)


@dataclass(frozen=True)
class MicrobatchDigest:
    """A microbatch reduced to its SHA-256 (`sha256`) and what `global_batch_digest` checks a
    global batch by: picklable, so `torch.distributed.all_gather_object` can gather it, and
    written as plain JSON by `as_json()` for ranks that hand their results over in files (the
    elastic demo's rank processes), so the global batch is checked there too, not only combined."""

    lane: int
    step: int
    index: int
    sha256: str
    step_shape: StepShape | None = None
    ends_lane: bool = False

    def as_json(self) -> dict:
        """A dict of JSON's own types; `from_json` makes this digest again from it."""
        shape = self.step_shape
        return {"lane": self.lane, "step": self.step, "index": self.index, "sha256": self.sha256,
                "step_shape": None if shape is None else [shape.num_lanes, shape.microbatches_per_lane, shape.finite],
                "ends_lane": self.ends_lane}

    @classmethod
    def from_json(cls, data: dict) -> MicrobatchDigest:
        """The digest `as_json()` wrote `data` from."""
        shape = data["step_shape"]
        return cls(data["lane"], data["step"], data["index"], data["sha256"],
                   None if shape is None else StepShape(*shape), data["ends_lane"])


_ID_FIELDS = frozenset({"input_ids", "labels", "position_ids", "document_ids", "mrope_position_ids"})


def global_batch_digest(batches: Iterable[Batch | MicrobatchDigest]) -> str:
    """SHA-256 of a global batch: over its microbatch digests in canonical (lane, index) order.

    Takes `Batch`es, or their `to_digest()`s gathered from the ranks. Hashing digests rather than
    raw bytes lets ranks exchange 32 bytes per microbatch instead of the tensors, and still agree
    on one number per step. The digest of a set of microbatches that is not one whole step matches
    no run's step, and a determinism check comparing it would report a difference (or none) about
    the wrong thing, so it is refused: microbatches of different steps, a (lane, index) given twice
    (a rank's part gathered twice), and, from the step's shape that a loader's microbatches carry,
    a (lane, index) missing (`PartialGlobalBatchError`: a rank's part not gathered, a microbatch
    dropped). In a finite plan a lane may have ended, so only the indices of the lanes present are
    checked there: up to the step's last, or up to the lane's own last microbatch.
    """
    batches = sorted(batches, key=lambda b: (b.lane, b.index))
    if not batches:
        raise ZephonError("global_batch_digest needs at least one microbatch")
    steps = {b.step for b in batches}
    if len(steps) != 1:
        raise ZephonError(f"microbatches of different steps cannot form one global batch: {sorted(steps)}")
    twice = sorted({(a.lane, a.index) for a, b in zip(batches, batches[1:]) if (a.lane, a.index) == (b.lane, b.index)})
    if twice:
        raise ZephonError(
            f"microbatches (lane, index) {twice} are given more than once: a global batch holds each once "
            "(was one rank's part gathered twice?)"
        )
    _refuse_a_partial_step(batches, steps.pop())
    return combine_digests(b.digest() if isinstance(b, Batch) else b.sha256 for b in batches)


def _refuse_a_partial_step(batches: list, step: int) -> None:
    """Refuse a step that lacks a (lane, index) its shape holds, or holds one its shape does not."""
    shapes = {b.step_shape for b in batches}
    if len(shapes) != 1:
        raise ZephonError(
            f"microbatches of step {step} come from loaders of different step shapes {sorted(map(str, shapes))}: "
            "one global batch is one loader recipe's microbatches"
        )
    shape = shapes.pop()
    if shape is None:
        return  # made by hand: nothing says what the step holds
    given: dict[int, set[int]] = {}
    last: dict[int, int] = {}
    for b in batches:
        given.setdefault(b.lane, set()).add(b.index)
        if b.ends_lane:
            last[b.lane] = b.index
    lanes = sorted(given) if shape.finite else range(shape.num_lanes)
    full = shape.microbatches_per_lane
    missing = [(lane, i) for lane in lanes for i in range(last.get(lane, full - 1) + 1) if i not in given.get(lane, ())]
    beyond = [
        (lane, i) for lane, indices in sorted(given.items()) for i in sorted(indices)
        if not 0 <= lane < shape.num_lanes or not 0 <= i <= last.get(lane, full - 1)
    ]
    if beyond:
        raise ZephonError(
            f"microbatches (lane, index) {beyond} of step {step} lie outside the step's {shape.num_lanes} lanes of "
            f"{full} microbatches each (or after their lane's last): they are not of this loader's steps"
        )
    if missing:
        raise PartialGlobalBatchError(
            f"step {step} lacks microbatches (lane, index) {_abridged(missing)} of its {shape.num_lanes} lanes of "
            f"{full} microbatches each: its digest would be of no run's step. Gather every rank's microbatches "
            "of the step (in a finite plan's ragged end, every rank's that it handed over)",
            missing,
        )


def _abridged(pairs: list[tuple[int, int]], shown: int = 16) -> str:
    """The pairs, the first `shown` of a long list and how many more (a rank of 64 lanes left out)."""
    if len(pairs) <= shown:
        return str(pairs)
    return f"{str(pairs[:shown])[:-1]}, … and {len(pairs) - shown} more]"


def combine_digests(microbatch_digests: Iterable[str]) -> str:
    """The global digest from microbatch digests already in canonical order."""
    h = sha256()
    for digest in microbatch_digests:
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


def collate(
    rows: list, lane: int, step: int, index: int, step_shape: StepShape | None = None, ends_lane: bool = False
) -> Batch:
    """Stack fixed-length fields; concatenate ragged ones with per-row counts.

    `rows` are `PackedSequence`s or row plans (see `Accumulator`); plans of one kind that can
    assemble a whole microbatch at once do so, others are assembled one by one first.
    """
    sources = tuple(r.sources for r in rows)
    kind = type(rows[0])
    assemble_batch = getattr(kind, "assemble_batch", None)
    if assemble_batch is not None and all(type(r) is kind for r in rows):
        tokens, ragged, counts = assemble_batch(rows)
        return Batch(lane, step, index, tokens, ragged, counts, sources, step_shape, ends_lane)
    rows = [r if isinstance(r, PackedSequence) else r.assemble() for r in rows]
    tokens = {name: np.stack([r.tokens[name] for r in rows]) for name in rows[0].tokens}
    ragged, counts = {}, {}
    for name in rows[0].ragged:
        parts = [r.ragged[name] for r in rows]
        ragged[name] = np.concatenate(parts, axis=0)
        counts[name] = np.array([len(p) for p in parts], dtype=np.int64)
    return Batch(lane, step, index, tokens, ragged, counts, sources, step_shape, ends_lane)
