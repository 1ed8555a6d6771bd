"""Preference pairs (DPO and its kin): each record's chosen and rejected completions packed side by side.

A preference loss compares what a model gives the chosen completion of a prompt with what it gives
the rejected one, so the two must reach the same forward pass, and neither may be cut across rows
(a sequence's log-probability is a sum over all of it). `pack_pairs` reads a record's two token
documents (two `tokenize` stages with their own `output_field` and `loss_mask_field` write them) and
places them in one row, the chosen one as document 2k of the row and its rejected one as 2k+1: a
loss sums each document's log-probabilities over the positions whose label is not IGNORE_INDEX
(`document_ids` says which) and pairs document 2k with 2k+1. Rows are the flat packers' rows
(`FlatRowPlan`): `input_ids`, `labels`, `position_ids`, `document_ids`.

Two ways of filling rows: "first_fit" (pairs in the first open row with room, never split) and
"pad" (one pair a row, padded). A pair longer than a row is skipped (`pair_too_long`) by default;
`overlong="truncate"` keeps the first tokens of each, `overlong="keep_end"` the last (the answers
kept, the starts of their prompts dropped), the row shared between them (the shorter kept whole
where it takes at most half), counted as `truncated` and `truncated_tokens`, unless either then
learns nothing, when it is skipped as `pair_too_long` all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._accumulator import SegmentContext
from ._errors import ConfigurationError, check_count, check_field_name, check_token_id
from ._first_fit import FirstFitRows
from ._document_values import check_value_names, read_values
from ._packing import (FlatRowPlan, Piece, RefusedAndCut, assemble_row, counter_of_placed, kept_part,
                       learned_labels, read_document)
from ._records import RecordAddress
from ._sequence import PackedSequence

__all__ = ["PAIR_ALGORITHMS", "PAIR_OVERLONG", "PackPairsOp", "PairFields", "PairPacker", "check_pair_tokenizers"]

PAIR_ALGORITHMS = ("first_fit", "pad")
PAIR_OVERLONG = ("skip", "truncate", "keep_end")

Document = tuple[np.ndarray, "np.ndarray | None"]
"""(ids, targets) as the flat packers read a document (`read_document`)."""


@dataclass(frozen=True)
class PairFields:
    """The four fields a record's pair is read from."""

    chosen: str
    rejected: str
    chosen_loss_mask: str
    rejected_loss_mask: str


def read_pair(address: RecordAddress, record: dict, fields: PairFields,
              skips: list) -> tuple[Document, Document] | None:
    """The record's (chosen, rejected) documents, or None where either is refused: its one skip
    (the first refused of the two) appended to `skips`, so that a record is skipped once."""
    chosen = read_document(address, record, fields.chosen, fields.chosen_loss_mask, skips)
    if chosen is None:
        return None
    rejected = read_document(address, record, fields.rejected, fields.rejected_loss_mask, skips)
    return None if rejected is None else (chosen, rejected)


def row_shares(chosen: int, rejected: int, max_length: int) -> tuple[int, int]:
    """How many of each document's tokens (its first, or its last) a row of `max_length` keeps of
    a pair longer than it: the shorter one whole where it takes at most half, the longer the rest;
    else half each (the chosen one the odd token)."""
    half = max_length // 2
    if chosen <= half:
        return chosen, max_length - chosen
    if rejected <= half:
        return max_length - rejected, rejected
    return max_length - half, half


def fit_pair(pair: tuple[Document, Document], address: RecordAddress, max_length: int, overlong: str,
             skips: list, truncations: list | None) -> tuple[Document, Document] | None:
    """The pair as `overlong` lets it into a row: as it is where it fits; each document's first
    (last, "keep_end") tokens by `row_shares`, copied (`kept_part`), with (address, tokens dropped)
    appended to `truncations` (None: not counted); or None, (address, "pair_too_long", detail)
    appended to `skips`."""
    (chosen, _), (rejected, _) = pair
    if len(chosen) + len(rejected) <= max_length:
        return pair
    detail = f"{len(chosen)} + {len(rejected)} tokens, more than a row's max_length={max_length}"
    if overlong == "skip":
        skips.append((address, "pair_too_long", f"{detail} (pack_pairs overlong='skip')"))
        return None
    shares = row_shares(len(chosen), len(rejected), max_length)
    kept = tuple(document if keep == len(document[0]) else kept_part(document, keep, overlong == "keep_end")
                 for document, keep in zip(pair, shares))
    if not all(map(learned_labels, kept)):
        skips.append((address, "pair_too_long", f"{detail}; cut to fit, one of the two would learn nothing"))
        return None
    if truncations is not None:
        truncations.append((address, len(chosen) + len(rejected) - max_length))
    return kept


def check_pair_tokenizers(fields: PairFields, record_operators, caller: str) -> None:
    """Refuse, before anything is read, what would pack the wrong pair: a `tokenize` writing one
    of the two documents whose loss mask goes to another field than the packer reads it from (it
    would train on the prompt, or on the other completion's mask); and, where tokenizers and
    filters are the whole of the stages, a document no tokenizer writes."""
    tokenizers = [op for op in record_operators if op.name == "tokenize"]
    only_tokenizers = all(op.name in ("tokenize", "filter") for op in record_operators)
    for side, ids, mask in (("chosen", fields.chosen, fields.chosen_loss_mask),
                            ("rejected", fields.rejected, fields.rejected_loss_mask)):
        writers = [op for op in tokenizers if op.output_field == ids]
        # Each of them: tokenizers scoped to datasets (texts and chats) may write one document.
        for op in writers:
            if (op.prompt_field is not None or op.segments) and op.loss_mask_field != mask:
                raise ConfigurationError(
                    f"{caller} reads the {side} document's loss mask from {mask!r}, but tokenize(output_field="
                    f"{ids!r}) writes it to {op.loss_mask_field!r}: give that tokenize loss_mask_field={mask!r} "
                    f"(or {caller} {side}_loss_mask_field={op.loss_mask_field!r})")
        if tokenizers and only_tokenizers and not writers:
            raise ConfigurationError(
                f"{caller}({side}_field={ids!r}) packs a field no operator writes: the tokenizers write "
                f"{sorted({op.output_field for op in tokenizers})}")


class PairPacker(RefusedAndCut):
    """Places each record's pair in one row, chosen then rejected. Thread-unsafe; one per lane segment."""

    def __init__(self, max_length: int, pad_id: int, fields: PairFields, algorithm: str, max_open_rows: int,
                 overlong: str, value_names: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.max_length = max_length
        self.pad_id = pad_id
        self.fields = fields
        self.overlong = overlong
        self.value_names = value_names
        self._open: FirstFitRows[tuple[Piece, Piece]] | None = (
            FirstFitRows(max_length, max_open_rows) if algorithm == "first_fit" else None)

    def push(self, item: tuple[RecordAddress, dict]) -> list[FlatRowPlan]:
        """The rows the record's pair completes; none where it is refused (`drain_skips`)."""
        address, record = item
        pair = read_pair(address, record, self.fields, self._skips)
        values = () if pair is None or not self.value_names else read_values(
            address, record, self.value_names, self._skips)
        if pair is not None and values is not None:
            pair = fit_pair(pair, address, self.max_length, self.overlong, self._skips, self._truncations)
        if pair is None or values is None:
            return []
        pieces = tuple(Piece(tokens, 0, len(tokens), address, targets, values) for tokens, targets in pair)
        if self._open is None:
            return [self._row([pieces])]
        return [self._row(row) for row in self._open.place(pieces, pieces[0].length + pieces[1].length)]

    def flush(self) -> list[FlatRowPlan]:
        return [] if self._open is None else [self._row(row) for row in self._open.drain()]

    def _row(self, pairs: Sequence[tuple[Piece, Piece]]) -> FlatRowPlan:
        return FlatRowPlan(tuple(piece for pair in pairs for piece in pair), self.max_length, self.pad_id,
                           self.value_names)


@dataclass(frozen=True)
class PackPairsOp:
    """Configuration of `Pipeline.pack_pairs`; builds one packer per lane segment."""

    max_length: int
    algorithm: str = "first_fit"
    pad_id: int | None = None
    chosen_field: str = "chosen_ids"
    rejected_field: str = "rejected_ids"
    chosen_loss_mask_field: str = "chosen_loss_mask"
    rejected_loss_mask_field: str = "rejected_loss_mask"
    max_open_rows: int = 16
    overlong: str = "skip"
    document_values: tuple[str, ...] = ()
    name: str = "pack_pairs"
    kind = "accumulator"
    carries_media = False  # token ids alone: the loader refuses operators declaring `media_fields`

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_length", check_count(self.max_length, "pack_pairs: max_length"))
        if self.max_length < 4:
            raise ConfigurationError(f"pack_pairs: max_length={self.max_length} leaves no room for two documents "
                                     "that each learn a token; at least 4")
        if self.algorithm not in PAIR_ALGORITHMS:
            raise ConfigurationError(f"pack_pairs: algorithm must be one of {PAIR_ALGORITHMS}, got {self.algorithm!r}")
        if self.overlong not in PAIR_OVERLONG:
            raise ConfigurationError(f"pack_pairs: overlong must be one of {PAIR_OVERLONG}, got {self.overlong!r}")
        object.__setattr__(self, "max_open_rows", check_count(self.max_open_rows, "pack_pairs: max_open_rows"))
        names = ("chosen_field", "rejected_field", "chosen_loss_mask_field", "rejected_loss_mask_field")
        for name in names:
            check_field_name(getattr(self, name), f"pack_pairs: {name}")
        values = [getattr(self, name) for name in names]
        if len(set(values)) < len(values):
            raise ConfigurationError(f"pack_pairs: {', '.join(f'{n}={v!r}' for n, v in zip(names, values))} must be "
                                     "four fields: a pair's ids and loss masks read from one field would be one "
                                     "document twice")
        if self.pad_id is not None:
            object.__setattr__(self, "pad_id", check_token_id(self.pad_id, "pack_pairs: pad_id"))
        object.__setattr__(self, "document_values",
                           check_value_names(self.document_values, "pack_pairs", documents=values))

    @property
    def fields(self) -> PairFields:
        return PairFields(self.chosen_field, self.rejected_field, self.chosen_loss_mask_field,
                          self.rejected_loss_mask_field)

    def bound_to(self, record_operators) -> PackPairsOp:
        """Refuse, before anything is read, what would pack the wrong pair (`check_pair_tokenizers`)."""
        check_pair_tokenizers(self.fields, record_operators, "pack_pairs")
        return self

    def factory(self, default_pad_id: int):
        pad = self.pad_id if self.pad_id is not None else default_pad_id

        def make(ctx: SegmentContext) -> PairPacker:
            return PairPacker(self.max_length, pad, self.fields, self.algorithm, self.max_open_rows, self.overlong,
                              self.document_values)

        return make

    def padding_row(self, default_pad_id: int) -> PackedSequence:
        """The row that fills the microbatch of a lane whose finite plan ran out, padded with this
        packer's pad id (see `PackFlatOp.padding_row`)."""
        return assemble_row([], self.max_length, self.pad_id if self.pad_id is not None else default_pad_id,
                            self.document_values)

    def token_counter(self):
        """What token estimation counts of a record: the ids of its pair as placed, none of one
        refused (whose reasons come from its `drain_skips()`); `learned`, of them those a loss learns."""
        fields, max_length, overlong, value_names = self.fields, self.max_length, self.overlong, self.document_values

        def placed(address: RecordAddress, record: dict, skips: list) -> tuple[Document, Document] | None:
            pair = read_pair(address, record, fields, skips)
            if pair is None or (value_names and read_values(address, record, value_names, skips) is None):
                return None
            return fit_pair(pair, address, max_length, overlong, skips, None)

        return counter_of_placed(placed)

    def fingerprint(self, default_pad_id: int) -> dict:
        """What decides the rows; `max_open_rows` only for first_fit, which alone keeps rows open."""
        return {
            "op": self.name,
            "max_length": self.max_length,
            "algorithm": self.algorithm,
            "pad_id": self.pad_id if self.pad_id is not None else default_pad_id,
            "fields": [self.chosen_field, self.rejected_field, self.chosen_loss_mask_field,
                       self.rejected_loss_mask_field],
            **({"max_open_rows": self.max_open_rows} if self.algorithm == "first_fit" else {}),
            "overlong": self.overlong,
            **({"document_values": list(self.document_values)} if self.document_values else {}),
        }
