"""Microbatches and the SHA-256 of a global batch.

A microbatch holds `microbatch_size` packed rows of one lane. Its position in the global batch is
(lane, index); `global_batch_digest` sorts by that, so every layout of ranks hashes the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ._errors import ZephonError
from ._records import RecordAddress
from ._sequence import PackedSequence
from ._sha256 import sha256

__all__ = ["Batch", "global_batch_digest", "combine_digests", "collate"]


@dataclass
class Batch:
    """One microbatch of one lane at one global step.

    `tokens` holds (microbatch_size, max_length) int32 arrays (a packer may add a field with an
    axis between: VLM's `mrope_position_ids` is (microbatch_size, 3, max_length)); `ragged` holds
    per-row payloads concatenated along axis 0 with `ragged_counts[name][i]` entries from row i.
    `sources[i][d]` is the record whose tokens are where `document_ids[i] == d` (one entry per
    document of row i; a record read twice, in two epochs, may appear twice).
    """

    lane: int
    step: int
    index: int
    tokens: dict[str, np.ndarray]
    ragged: dict[str, np.ndarray] = field(default_factory=dict)
    ragged_counts: dict[str, np.ndarray] = field(default_factory=dict)
    sources: tuple[tuple[RecordAddress, ...], ...] = ()

    @property
    def num_real_tokens(self) -> int:
        return int(np.count_nonzero(self.tokens["document_ids"] >= 0))

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


_ID_FIELDS = frozenset({"input_ids", "labels", "position_ids", "document_ids", "mrope_position_ids"})


def global_batch_digest(batches: Iterable[Batch]) -> str:
    """SHA-256 of a global batch: over its microbatch digests in canonical (lane, index) order.

    Hashing digests rather than raw bytes lets ranks exchange 32 bytes per microbatch instead of
    the tensors, and still agree on one number per step. A global batch holds each (lane, index)
    once: one given twice (a rank's part gathered twice) is refused, since hashing it twice would
    give a digest no run's global batch has.
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
    return combine_digests(b.digest() for b in batches)


def combine_digests(microbatch_digests: Iterable[str]) -> str:
    """The global digest from microbatch digests already in canonical order."""
    h = sha256()
    for digest in microbatch_digests:
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


def collate(rows: list, lane: int, step: int, index: int) -> Batch:
    """Stack fixed-length fields; concatenate ragged ones with per-row counts.

    `rows` are `PackedSequence`s or row plans (see `Accumulator`); plans of one kind that can
    assemble a whole microbatch at once do so, others are assembled one by one first.
    """
    sources = tuple(r.sources for r in rows)
    kind = type(rows[0])
    assemble_batch = getattr(kind, "assemble_batch", None)
    if assemble_batch is not None and all(type(r) is kind for r in rows):
        tokens, ragged, counts = assemble_batch(rows)
        return Batch(lane, step, index, tokens, ragged, counts, sources)
    rows = [r if isinstance(r, PackedSequence) else r.assemble() for r in rows]
    tokens = {name: np.stack([r.tokens[name] for r in rows]) for name in rows[0].tokens}
    ragged, counts = {}, {}
    for name in rows[0].ragged:
        parts = [r.ragged[name] for r in rows]
        ragged[name] = np.concatenate(parts, axis=0)
        counts[name] = np.array([len(p) for p in parts], dtype=np.int64)
    return Batch(lane, step, index, tokens, ragged, counts, sources)
