"""Packed sequences: what packers emit, shuffles reorder and batches stack.

Fixed-length per-token arrays (`input_ids`, `labels`, `position_ids`, `document_ids`, all of
length `max_length`) live in `tokens`; variable-size per-sequence payloads (image patches and
their grids, for VLM) live in `ragged` and are concatenated, not stacked, when batched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._records import RecordAddress

__all__ = ["PackedSequence", "IGNORE_INDEX", "PADDING_DOCUMENT"]

IGNORE_INDEX = -100
"""Label value that a loss ignores (padding, image placeholders, document boundaries)."""

PADDING_DOCUMENT = -1
"""`document_ids` value of padding positions."""


@dataclass
class PackedSequence:
    tokens: dict[str, np.ndarray]
    sources: tuple[RecordAddress, ...] = ()
    ragged: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_real_tokens(self) -> int:
        """Tokens that are not padding."""
        return int(np.count_nonzero(self.tokens["document_ids"] != PADDING_DOCUMENT))

    @property
    def length(self) -> int:
        return int(self.tokens["input_ids"].shape[0])

    @property
    def document_counts(self) -> list[tuple[str, int, int]]:
        """(dataset, tokens, images) of each document in `document_ids` order, read from the arrays
        (an image belongs to the document at its first placeholder, `image_token_offset`): what the
        ledger counts per dataset as the row is handed over. A row plan says the same from its
        pieces without building the arrays. A row that names no `sources` has none to count."""
        if not self.sources:
            return []
        documents, n = self.tokens["document_ids"], len(self.sources)
        tokens = np.bincount(documents[documents != PADDING_DOCUMENT], minlength=n)
        offsets = self.ragged.get("image_token_offset", ())
        images = np.bincount(documents[offsets], minlength=n) if len(offsets) else np.zeros(n, dtype=np.int64)
        return list(zip([address.dataset for address in self.sources], tokens.tolist(), images.tolist()))
