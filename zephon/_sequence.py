"""Packed sequences: what packers emit, shuffles reorder and batches stack.

Fixed-length per-token arrays (`input_ids`, `labels`, `position_ids`, `document_ids`, all of
length `max_length`, and any a packer adds, its last axis `max_length`: VLM's (3, max_length)
`mrope_position_ids`) live in `tokens`; variable-size per-sequence payloads (image patches and
their grids, for VLM) live in `ragged` and are concatenated, not stacked, when batched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._errors import ConfigurationError
from ._records import RecordAddress

__all__ = ["PackedSequence", "IGNORE_INDEX", "PADDING_DOCUMENT"]

IGNORE_INDEX = -100
"""Label value that a loss ignores (padding, image placeholders, document boundaries)."""

PADDING_DOCUMENT = -1
"""`document_ids` value of padding positions."""


@dataclass
class PackedSequence:
    """One packed row. `sources[d]` is the record of the document where `document_ids == d`, one
    for each document the row holds: the ledger counts each document's tokens and images for its
    record's dataset (`stats()["mixture"]`), and a batch hands them on (`Batch.sources`). A row
    holding a document without one is refused as it is handed over (see `tokens_by_dataset`)."""

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
    def tokens_by_dataset(self) -> dict[str, int]:
        """{dataset: tokens} of the row, what the ledger counts as the row is handed over: each
        document's tokens (where `document_ids` holds its number) for the dataset `sources` names.
        A row plan says the same from its pieces, without the arrays."""
        real = self.tokens["document_ids"]
        return self._by_dataset(real[real != PADDING_DOCUMENT])

    @property
    def learned_by_dataset(self) -> dict[str, int]:
        """{dataset: learned tokens} of the row: the positions whose label a loss counts (not
        IGNORE_INDEX), each for its document's dataset. A row plan says the same from its pieces."""
        documents = self.tokens["document_ids"]
        learned = (self.tokens["labels"] != IGNORE_INDEX) & (documents != PADDING_DOCUMENT)
        return self._by_dataset(documents[learned])

    @property
    def images_by_dataset(self) -> dict[str, int]:
        """{dataset: images} of the row: an image is its document's at its first placeholder
        (`image_token_offset`). A video in a layout of its own (`video_token_offset`) counts the
        frames the row holds for it: `video_grid`'s (temporal patches, rows, cols) times the
        frames of a temporal patch, which the row's `video_pixel_values` say (its patches over the
        videos' patches a frame: two frames a temporal patch in Qwen's layout, one in
        LLaVA-OneVision's)."""
        document_ids = self.tokens["document_ids"]
        offsets = self.ragged.get("image_token_offset", ())
        out = self._by_dataset(document_ids[offsets]) if len(offsets) else {}
        videos = self.ragged.get("video_token_offset", ())
        if len(videos):
            grids = self.ragged["video_grid"].astype(np.int64)
            per_patch = len(self.ragged["video_pixel_values"]) // int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum())
            frames = per_patch * grids[:, 0]
            for dataset, n in self._by_dataset(document_ids[videos], frames).items():
                out[dataset] = out.get(dataset, 0) + n
        return out

    def _by_dataset(self, documents: np.ndarray, weights: np.ndarray | None = None) -> dict[str, int]:
        """How often each document number occurs in `documents` (or the sum of its `weights`),
        summed by its dataset.

        A document `sources` names no record for is a ConfigurationError: its tokens were counted
        in the lane's `tokens` and for no dataset (a plugin's row made without `sources`), so the
        realised mixture fell short of the tokens handed over, and nothing said so."""
        per_document = np.bincount(documents, weights, minlength=len(self.sources)).astype(np.int64)
        if len(per_document) > len(self.sources):
            raise ConfigurationError(
                f"a PackedSequence holds documents 0 to {len(per_document) - 1} and names the record of "
                f"{len(self.sources)} (its sources): the last accumulator of a pipeline names each document's "
                "record, sources[d] for document_ids == d, whose dataset the loader counts the document's "
                "tokens and images for as it hands the row over (stats()['mixture'])"
            )
        out: dict[str, int] = {}
        for address, n in zip(self.sources, per_document.tolist()):
            if n:
                out[address.dataset] = out.get(address.dataset, 0) + n
        return out
