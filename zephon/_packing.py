"""Flat packing of token documents into fixed-length rows.

The accumulator decides which document pieces go into which row and emits that decision as a
`FlatRowPlan`; the loader writes the plans of a microbatch straight into its arrays. Two algorithms:

- `wrap`: documents are laid end to end and cut every `max_length` tokens; no padding except in
  the last row of a segment, documents may be split across rows.
- `first_fit`: a document is placed in the first open row with room for it; a document that fits
  in a row is never split (longer ones are cut into `max_length` pieces first). Up to
  `max_open_rows` rows stay open; the oldest is emitted (padded) when one more is needed.
- `pad`: no packing, each document in a row of its own, padded (a longer one cut into
  `max_length` pieces, each a row): what a model trained or evaluated on one sample a row takes.

Every row carries `input_ids`, `labels` (the next token of the same document, IGNORE_INDEX at a
document's end, before a token its loss mask leaves out (`_loss_mask`) and on padding),
`position_ids` (restarting at each document piece) and `document_ids` (0, 1, … per piece in the
row, PADDING_DOCUMENT on padding).

A document longer than a row is cut into pieces by default (`overlong="split"`): a chat or an
answer cut so trains its later pieces without what came before them. `overlong="truncate"` keeps
its first `max_length` tokens and drops the rest, `overlong="keep_end"` its last (TRL's
`truncation_mode="keep_end"`: the answer kept, the start of its prompt dropped), reported by
`drain_truncations()` (the ledger's `truncated` and `truncated_tokens`); `overlong="skip"` refuses
it (`document_too_long`).

A record whose field holds no tokens to pack is refused and reported by `drain_skips()`:
`missing_field`, `not_tokens` (not a flat sequence of integer ids in [0, 2**31)) or
`empty_document` (no ids), with what the field held (`no_tokens_detail`); so is one whose loss
mask is not one flag per id (`bad_loss_mask`). Without a tokenizer the ids come from the data as
it is stored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ._accumulator import SegmentContext
from ._document_values import check_value_names, read_values, value_arrays
from ._errors import ConfigurationError, check_count, check_field_name, check_token_id
from ._field_names import fields_it_has
from ._first_fit import FirstFitRows
from ._loss_mask import LOSS_MASK_FIELD, loss_mask_detail, targets_of
from ._records import RecordAddress
from ._sequence import IGNORE_INDEX, PADDING_DOCUMENT, PackedSequence

__all__ = ["OVERLONG", "FirstFitPacker", "FlatRowPlan", "PackFlatOp", "PadPacker", "Piece", "RefusedAndCut",
           "RefusedRecords", "WrapPacker", "assemble_row", "counter_of_placed", "fit_document", "kept_part",
           "learned_labels", "no_tokens_detail", "token_ids"]


class Piece(NamedTuple):
    """Tokens [start, stop) of a document.

    A named tuple rather than a frozen dataclass: packers make one per document per row, on the
    loader's thread, and a tuple is built and unpacked faster (text race corpus, 3.14t: packing
    2.7-4.1 -> 2.0-2.6 ns per token)."""

    tokens: np.ndarray
    start: int
    stop: int
    address: RecordAddress
    targets: np.ndarray | None = None
    """The ids its positions learn, IGNORE_INDEX where the document's loss mask leaves a token
    out (`_loss_mask`); None: the tokens themselves."""
    values: tuple[float, ...] = ()
    """Its record's `document_values` (`_document_values`), in the packer's order of names."""

    @property
    def length(self) -> int:
        return self.stop - self.start


def token_ids(value: object) -> np.ndarray | str:
    """A document's ids as a 1-D int32 array, or the reason it has none to pack.

    A 1-D int32 array (what `tokenize` writes) is taken as it is, unchecked: this runs on the
    loader's thread for every document, and a check would cost a pass over every id. A `map` that
    writes such an array owns its values (a negative id fails later, in the embedding lookup).
    Anything else (ids stored in the data, lists, other dtypes) is checked once here, so that no id
    is wrapped, truncated or rejected later inside a batch."""
    if type(value) is np.ndarray and value.dtype == np.int32 and value.ndim == 1:
        return value if len(value) else "empty_document"
    if value is None:
        return "missing_field"
    if isinstance(value, (str, bytes)):
        return "not_tokens"
    try:
        ids = np.asarray(value)
    except (TypeError, ValueError):  # ragged nesting
        return "not_tokens"
    if ids.ndim != 1:
        return "not_tokens"
    if ids.size == 0:
        return "empty_document"
    if ids.dtype.kind not in "iu":
        return "not_tokens"
    low = ids.min()
    if low < 0 or ids.max() >= 2**31:
        return "not_tokens"
    if low <= 1 and isinstance(value, (list, tuple)) and _holds_a_bool(value, ids):
        return "not_tokens"
    return ids.astype(np.int32, copy=False)


def _holds_a_bool(value: list | tuple, ids: np.ndarray) -> bool:
    """Whether a list of ids holds a bool, which NumPy reads as 0 or 1 among integers: a JSON
    `true` in an id list became token 1 (a list of bools alone has dtype bool and is refused).
    Only the items read as 0 or 1 are looked at, so the cost is one vectorised comparison and
    usually a few items (a BOS id of 1), not a Python pass over every id; ids that hold no 0 or 1
    never get here."""
    return any(isinstance(value[i], (bool, np.bool_)) for i in np.flatnonzero(ids <= 1).tolist())


def no_tokens_detail(reason: str, field: str, record: dict) -> Callable[[], str]:
    """What `record[field]` held, for a record `token_ids` refused for `reason`: a function making
    the detail `stats()["skipped_examples"]` shows, so that only the few skips kept as examples pay
    for it (a misnamed field refuses every record)."""
    return functools.partial(_describe_no_tokens, reason, field, record)


def _describe_no_tokens(reason: str, field: str, record: dict) -> str:
    value = record.get(field)
    if value is None:
        has = fields_it_has(field, record)  # "'input_ids' is null" where the record holds it as null
        return has if field in record else f"it lacks {field!r}: {has}"
    if reason == "empty_document":
        return f"{field!r} holds no token ids"
    return f"{field!r} holds {_what_it_holds(value)}, not a flat list of token ids in [0, 2**31)"


def _what_it_holds(value: object) -> str:
    """The first of `token_ids`' refusals that `value` meets, in words."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters (token ids are what `tokenize` writes)"
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    try:
        ids = np.asarray(value)
    except (TypeError, ValueError):
        return "lists of unequal lengths"
    if ids.ndim == 0:  # a number or a mapping, which NumPy wraps as a 0-D array no record holds
        return f"a single {type(value).__name__}"
    if ids.ndim != 1:
        return f"a {ids.ndim}-D array of shape {ids.shape}"
    if ids.dtype.kind not in "iu":
        return f"{ids.dtype} values"
    low, high = ids.min(), ids.max()
    if low < 0 or high >= 2**31:
        return f"ids from {low} to {high}"
    return "a bool among its ids"


def _own_piece(tokens: np.ndarray, start: int, stop: int, address: RecordAddress,
               targets: np.ndarray | None = None, values: tuple[float, ...] = ()) -> Piece:
    """Tokens [start, stop) of a document longer than a row, as a piece holding a copy of them
    and of the token after them (its last position's label), not a view of the document.

    A view keeps the whole document alive as long as any row cut from it waits: a shuffle buffer
    keeps a row or two of many documents, and held every one of them whole (documents of 20 rows
    through a 64-row buffer: 3x the tokens of the rows it held), beyond the memory budget's one
    document per lane. Only such documents are copied, once each (a memcpy per token, against
    microseconds to tokenize it); a shorter one is referenced by at most two rows. Its targets,
    where it has its own, are copied alike."""
    own = None if targets is None else targets[start : stop + 1].copy()
    return Piece(tokens[start : stop + 1].copy(), 0, stop - start, address, own, values)


def read_document(address: RecordAddress, record: dict, field: str, loss_mask_field: str,
                  skips: list) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A record's (ids, targets) as a flat packer places them (targets None: the ids, every token
    learned), or None where it is refused, its (address, reason, detail) appended to `skips`."""
    tokens = token_ids(record.get(field))
    if isinstance(tokens, str):
        skips.append((address, tokens, no_tokens_detail(tokens, field, record)))
        return None
    mask = record.get(loss_mask_field)
    if mask is None:  # most documents: no call made for them
        return tokens, None
    targets = targets_of(tokens, mask)
    if isinstance(targets, str):
        skips.append((address, targets, loss_mask_detail(loss_mask_field, field, record)))
        return None
    return tokens, targets


def learned_labels(document: tuple[np.ndarray, np.ndarray | None]) -> int:
    """The labels a document's rows hold that a loss counts: every id but the first (each the
    label of the one before it), or those its loss mask keeps, as `FlatRowPlan.learned_by_dataset`
    counts them."""
    tokens, targets = document
    return len(tokens) - 1 if targets is None else int(np.count_nonzero(targets[1:] != IGNORE_INDEX))


OVERLONG = ("split", "truncate", "keep_end", "skip")
"""What `pack_flat` does with a document longer than a row (module docstring)."""


def kept_part(document: tuple[np.ndarray, np.ndarray | None], keep: int,
              from_end: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """A document's first `keep` (ids, targets), or its last ones `from_end`, copied: a view would
    keep the whole document alive while its row waits. The first id kept from the end is no label
    (the one before it is gone), as a document's first never is."""
    tokens, targets = document
    part = slice(len(tokens) - keep, None) if from_end else slice(keep)
    return tokens[part].copy(), None if targets is None else targets[part].copy()


def fit_document(document: tuple[np.ndarray, np.ndarray | None], address: RecordAddress, max_length: int,
                 overlong: str, skips: list, truncations: list | None) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A document's (ids, targets) as `overlong` lets it into rows of `max_length`: as it is when
    it fits or is to be split; its first (last, "keep_end") `max_length` tokens, copied
    (`kept_part`), with (address, tokens dropped) appended to `truncations` (None: not counted); or
    None, (address, "document_too_long", detail) appended to `skips`."""
    tokens = document[0]
    if len(tokens) <= max_length or overlong == "split":
        return document
    if overlong == "skip":
        skips.append((address, "document_too_long",
                      f"{len(tokens)} tokens, more than a row's max_length={max_length} (pack_flat overlong='skip')"))
        return None
    if truncations is not None:
        truncations.append((address, len(tokens) - max_length))
    return kept_part(document, max_length, overlong == "keep_end")


def assemble_row(pieces: Sequence[Piece], max_length: int, pad_id: int,
                 value_names: tuple[str, ...] = ()) -> PackedSequence:
    """Build one packed row from document pieces (a stateless function)."""
    return FlatRowPlan(tuple(pieces), max_length, pad_id, value_names).assemble()


@dataclass(frozen=True)
class FlatRowPlan:
    """One flat row as the pieces that fill it: references to their documents' token arrays
    (to copies of its own tokens for a document longer than a row, see `_own_piece`).

    Packers emit plans and the loader assembles them only when it collates a microbatch
    (`assemble_batch`, straight into the microbatch's arrays), so a row is written once instead
    of being built, kept in a shuffle buffer as four arrays, and copied again into its batch.
    `value_names` are the packer's `document_values`: each names a ragged field of the row, one
    value a document (`_document_values`).
    """

    pieces: tuple[Piece, ...]
    max_length: int
    pad_id: int
    value_names: tuple[str, ...] = ()

    def assemble(self) -> PackedSequence:
        tokens, ragged, _ = self.assemble_batch([self])
        return PackedSequence(tokens={name: array[0] for name, array in tokens.items()}, sources=self.sources,
                              ragged=ragged)

    @property
    def sources(self) -> tuple[RecordAddress, ...]:
        """The record of each document, in `document_ids` order: a record read again (the next
        epoch) is named again, so `sources[d]` stays the record of `document_ids == d`."""
        return tuple(p.address for p in self.pieces)

    @property
    def num_real_tokens(self) -> int:
        return sum(p.stop - p.start for p in self.pieces)

    @property
    def tokens_by_dataset(self) -> dict[str, int]:
        """{dataset: tokens} of the row's pieces, what the ledger counts as the row is handed over:
        a piece of a document cut across rows counts the tokens this row holds, padding none.
        Summed here, per row, rather than listed per piece: the ledger then updates its counts
        once per dataset, not once per piece (on the loader's thread, for every row)."""
        out: dict[str, int] = {}
        for _, start, stop, address, _, _ in self.pieces:
            out[address.dataset] = out.get(address.dataset, 0) + stop - start
        return out

    @property
    def learned_by_dataset(self) -> dict[str, int]:
        """{dataset: learned tokens} of the row's pieces: the labels `_assemble` writes that a loss
        counts. A piece learns each token after its first up to one past its end, where its
        document has one; a masked document's, where its targets keep them. Counted without the
        arrays but for a masked piece's targets, as `tokens_by_dataset` counts its tokens."""
        out: dict[str, int] = {}
        for tokens, start, stop, address, targets, _ in self.pieces:
            if targets is None:
                learned = min(stop, len(tokens) - 1) - start
            else:
                learned = int(np.count_nonzero(targets[start + 1 : stop + 1] != IGNORE_INDEX))
            if learned:
                out[address.dataset] = out.get(address.dataset, 0) + learned
        return out

    @property
    def images_by_dataset(self) -> dict[str, int]:
        """A text row holds no images."""
        return {}

    @property
    def length(self) -> int:
        return self.max_length

    @staticmethod
    def assemble_batch(plans: list[FlatRowPlan]) -> tuple[dict, dict, dict]:
        """(tokens, ragged, counts) of a microbatch: what stacking `[p.assemble() for p in plans]` gives;
        ragged and counts empty but for `document_values`."""
        # One packer's plans: one length, one pad id and one list of values.
        first = plans[0]
        tokens = _assemble([plan.pieces for plan in plans], first.max_length, first.pad_id)
        if not first.value_names:
            return tokens, {}, {}
        ragged, counts = value_arrays([[piece.values for piece in plan.pieces] for plan in plans], first.value_names)
        return tokens, ragged, counts


def _assemble(rows: Sequence[Sequence[Piece]], max_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """The four (rows, max_length) arrays of rows of pieces, written piece by piece.

    Runs on the loader's thread for every microbatch, so every NumPy call per piece counts: the
    positions are slices of one `arange` instead of a new one per piece (text race corpus, 3.14t:
    9.0 -> 7.0 ns per token).
    """
    shape = (len(rows), max_length)
    input_ids = np.empty(shape, dtype=np.int32)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int32)
    position_ids = np.zeros(shape, dtype=np.int32)
    document_ids = np.full(shape, PADDING_DOCUMENT, dtype=np.int32)
    positions = np.arange(max_length, dtype=np.int32)  # sliced for every piece, made once
    for i, pieces in enumerate(rows):
        row_ids, row_labels, row_positions, row_documents = input_ids[i], labels[i], position_ids[i], document_ids[i]
        at = 0
        for doc, (tokens, start, stop, _, targets, _) in enumerate(pieces):
            end = at + stop - start
            row_ids[at:end] = tokens[start:stop]
            # One shorter at the document's end.
            following = (tokens if targets is None else targets)[start + 1 : stop + 1]
            row_labels[at : at + len(following)] = following
            row_positions[at:end] = positions[: stop - start]
            row_documents[at:end] = doc
            at = end
        row_ids[at:] = pad_id
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": document_ids}


class RefusedAndCut:
    """The records a packer refused or cut to fit since the ledger last asked: its `_skips` and
    `_truncations`, which `drain_skips()` and `drain_truncations()` hand over (see `Accumulator`)."""

    def __init__(self) -> None:
        self._skips: list[tuple[RecordAddress, str, str | Callable[[], str]]] = []
        self._truncations: list[tuple[RecordAddress, int]] = []

    def drain_skips(self) -> list[tuple[RecordAddress, str, str | Callable[[], str]]]:
        """Records refused since the last call, as (address, reason, detail); the list is handed over."""
        skips, self._skips = self._skips, []
        return skips

    def drain_truncations(self) -> list[tuple[RecordAddress, int]]:
        """Records cut to a row since the last call (`overlong`), as (address, tokens dropped); the
        list is handed over."""
        cuts, self._truncations = self._truncations, []
        return cuts


class _FlatPacker(RefusedAndCut):
    """What the flat packers share: their settings, how a record becomes the document they place
    (`push`; each packer places it its own way, `_place`) and the records they refused or cut."""

    def __init__(self, max_length: int, pad_id: int, field: str, loss_mask_field: str, overlong: str,
                 value_names: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.max_length = max_length
        self.pad_id = pad_id
        self.field = field
        self.loss_mask_field = loss_mask_field
        self.overlong = overlong
        self.value_names = value_names

    def push(self, item: tuple[RecordAddress, dict]) -> list[FlatRowPlan]:
        """The rows the record's document completes; none where it is refused (`drain_skips`)."""
        address, record = item
        document = read_document(address, record, self.field, self.loss_mask_field, self._skips)
        values = () if document is None or not self.value_names else read_values(
            address, record, self.value_names, self._skips)
        if document is not None and values is not None and len(document[0]) > self.max_length:
            # Most documents fit: no call made for them.
            document = fit_document(document, address, self.max_length, self.overlong, self._skips, self._truncations)
        if document is None or values is None:
            return []
        tokens, targets = document
        return self._place(tokens, targets, address, values, _own_piece if len(tokens) > self.max_length else Piece)

    def _place(self, tokens: np.ndarray, targets: np.ndarray | None, address: RecordAddress,
               values: tuple[float, ...], cut: Callable[..., Piece]) -> list[FlatRowPlan]:
        """The rows completed by placing a document, whose pieces `cut(tokens, start, stop,
        address, targets, values)` makes (copies of a document longer than a row: `_own_piece`)."""
        raise NotImplementedError

    def _row(self, pieces: Sequence[Piece]) -> FlatRowPlan:
        return FlatRowPlan(tuple(pieces), self.max_length, self.pad_id, self.value_names)


class WrapPacker(_FlatPacker):
    """Concatenate-and-cut packing. Thread-unsafe; one per lane segment."""

    def __init__(self, max_length: int, pad_id: int, field: str, loss_mask_field: str = LOSS_MASK_FIELD,
                 overlong: str = "split", value_names: tuple[str, ...] = ()) -> None:
        super().__init__(max_length, pad_id, field, loss_mask_field, overlong, value_names)
        self._pieces: list[Piece] = []
        self._filled = 0

    def _place(self, tokens: np.ndarray, targets: np.ndarray | None, address: RecordAddress,
               values: tuple[float, ...], cut: Callable[..., Piece]) -> list[FlatRowPlan]:
        start, out = 0, []
        while start < len(tokens):
            take = min(len(tokens) - start, self.max_length - self._filled)
            self._pieces.append(cut(tokens, start, start + take, address, targets, values))
            self._filled += take
            start += take
            if self._filled == self.max_length:
                out.append(self._emit())
        return out

    def flush(self) -> list[FlatRowPlan]:
        return [self._emit()] if self._pieces else []

    def _emit(self) -> FlatRowPlan:
        row = self._row(self._pieces)
        self._pieces, self._filled = [], 0
        return row


class FirstFitPacker(_FlatPacker):
    """First-fit bin packing that never splits a document shorter than a row. Thread-unsafe."""

    def __init__(self, max_length: int, pad_id: int, field: str, max_open_rows: int,
                 loss_mask_field: str = LOSS_MASK_FIELD, overlong: str = "split",
                 value_names: tuple[str, ...] = ()) -> None:
        super().__init__(max_length, pad_id, field, loss_mask_field, overlong, value_names)
        self.max_open_rows = max_open_rows
        self._open: FirstFitRows[Piece] = FirstFitRows(max_length, max_open_rows)

    def _place(self, tokens: np.ndarray, targets: np.ndarray | None, address: RecordAddress,
               values: tuple[float, ...], cut: Callable[..., Piece]) -> list[FlatRowPlan]:
        out = []
        start = 0
        while len(tokens) - start > self.max_length:
            out.append(self._row([cut(tokens, start, start + self.max_length, address, targets, values)]))
            start += self.max_length
        if start < len(tokens):
            piece = cut(tokens, start, len(tokens), address, targets, values)
            out.extend(self._row(row) for row in self._open.place(piece, piece.length))
        return out

    def flush(self) -> list[FlatRowPlan]:
        return [self._row(row) for row in self._open.drain()]


class PadPacker(_FlatPacker):
    """One document a row, padded; keeps nothing between pushes. Thread-unsafe."""

    def _place(self, tokens: np.ndarray, targets: np.ndarray | None, address: RecordAddress,
               values: tuple[float, ...], cut: Callable[..., Piece]) -> list[FlatRowPlan]:
        return [self._row([cut(tokens, start, min(start + self.max_length, len(tokens)), address, targets, values)])
                for start in range(0, len(tokens), self.max_length)]

    def flush(self) -> list[FlatRowPlan]:
        return []


ALGORITHMS = ("wrap", "first_fit", "pad")


def counter_of_placed(placed: Callable[[RecordAddress, dict, list], Sequence | None]):
    """The token counter of a packer that places, of a record, the documents `placed(address,
    record, skips)` returns ((ids, targets) each; None where it refuses the record, its skip
    appended to `skips`): it counts their ids, and `learned`, of them those a loss learns
    (`learned_labels`); the records it refused since the last call come from its `drain_skips()`."""
    refused = RefusedRecords()

    def count(address: RecordAddress, record: dict) -> int:
        documents = placed(address, record, refused)
        return 0 if documents is None else sum(len(tokens) for tokens, _ in documents)

    def learned(address: RecordAddress, record: dict) -> int:
        documents = placed(address, record, [])  # refused by `count` already
        return 0 if documents is None else sum(map(learned_labels, documents))

    count.drain_skips = refused.drain
    count.learned = learned
    return count


class RefusedRecords(list):
    """The records a packer's token counter refused, as (address, reason, detail), for its
    `drain_skips()`: what the loader's planning refusal names (the reasons counted, the first record
    of each with its detail) when a dataset's sample yields no token."""

    def drain(self) -> list[tuple[RecordAddress, str, str | Callable[[], str]]]:
        """The records since the last call; this list is emptied."""
        records = self.copy()
        self.clear()
        return records


@dataclass(frozen=True)
class PackFlatOp:
    """Configuration of `Pipeline.pack_flat`; builds one packer per lane segment."""

    max_length: int
    algorithm: str = "wrap"
    pad_id: int | None = None
    field: str = "input_ids"
    max_open_rows: int = 16
    loss_mask_field: str = LOSS_MASK_FIELD
    overlong: str = "split"
    document_values: tuple[str, ...] = ()
    name: str = "pack_flat"
    kind = "accumulator"
    carries_media = False  # token ids alone: the loader refuses operators declaring `media_fields`

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_length", check_count(self.max_length, "pack_flat: max_length"))
        if self.algorithm not in ALGORITHMS:
            raise ConfigurationError(f"pack_flat: algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.overlong not in OVERLONG:
            raise ConfigurationError(f"pack_flat: overlong must be one of {OVERLONG}, got {self.overlong!r}")
        object.__setattr__(self, "max_open_rows", check_count(self.max_open_rows, "pack_flat: max_open_rows"))
        # As tokenize checks its fields: None (or a tuple) read no field of any record, so every
        # record was skipped as missing_field, and the loader's check of the field let None by.
        for name in ("field", "loss_mask_field"):
            check_field_name(getattr(self, name), f"pack_flat: {name}")
        if self.loss_mask_field == self.field:
            raise ConfigurationError(f"pack_flat: loss_mask_field and field are both {self.field!r}; the ids and "
                                     "their loss mask are two fields")
        if self.pad_id is not None:
            object.__setattr__(self, "pad_id", check_token_id(self.pad_id, "pack_flat: pad_id"))
        object.__setattr__(self, "document_values", check_value_names(
            self.document_values, "pack_flat", documents=(self.field, self.loss_mask_field)))

    def factory(self, default_pad_id: int):
        pad = self.pad_id if self.pad_id is not None else default_pad_id

        def make(ctx: SegmentContext):
            values = self.document_values
            if self.algorithm == "wrap":
                return WrapPacker(self.max_length, pad, self.field, self.loss_mask_field, self.overlong, values)
            if self.algorithm == "pad":
                return PadPacker(self.max_length, pad, self.field, self.loss_mask_field, self.overlong, values)
            return FirstFitPacker(self.max_length, pad, self.field, self.max_open_rows, self.loss_mask_field,
                                  self.overlong, values)

        return make

    def padding_row(self, default_pad_id: int) -> PackedSequence:
        """The row that fills the microbatch of a lane whose finite plan ran out: padding with the
        pad id this packer pads its own rows with (`pad_id`, else the pipeline's default), so a
        batch never holds two pad ids."""
        return assemble_row([], self.max_length, self.pad_id if self.pad_id is not None else default_pad_id,
                            self.document_values)

    def token_counter(self):
        """What token estimation counts of a record: the ids a packer places, none of one it
        refuses (for its ids, its loss mask or its `document_values`); `learned`, of them those a
        loss learns (`TokenEstimation(count="learned")`).
        The records it refused since the last call come from its `drain_skips()`, with what each
        held, as `pack_multimodal`'s do: a sample whose ids are all stored as text is then refused
        naming `not_tokens` and what the first record held, where it said only that it yielded no token."""
        field, loss_mask_field, max_length, overlong = self.field, self.loss_mask_field, self.max_length, self.overlong
        value_names = self.document_values

        def placed(address: RecordAddress, record: dict,
                   skips: list) -> tuple[tuple[np.ndarray, np.ndarray | None]] | None:
            document = read_document(address, record, field, loss_mask_field, skips)
            if document is not None and value_names and read_values(address, record, value_names, skips) is None:
                return None
            if document is not None:
                document = fit_document(document, address, max_length, overlong, skips, None)
            return None if document is None else (document,)

        return counter_of_placed(placed)

    def fingerprint(self, default_pad_id: int) -> dict:
        """What decides the rows. `max_open_rows` only for first_fit: wrap keeps a single row open
        and pad none, and a setting they ignore must not refuse a resume; `loss_mask_field` and
        `overlong` and `document_values` only where they are not the default, so the recipes that
        never set them keep the digests their checkpoints hold."""
        return {
            "op": self.name,
            "max_length": self.max_length,
            "algorithm": self.algorithm,
            "pad_id": self.pad_id if self.pad_id is not None else default_pad_id,
            "field": self.field,
            **({"max_open_rows": self.max_open_rows} if self.algorithm == "first_fit" else {}),
            **({"loss_mask_field": self.loss_mask_field} if self.loss_mask_field != LOSS_MASK_FIELD else {}),
            **({"overlong": self.overlong} if self.overlong != "split" else {}),
            **({"document_values": list(self.document_values)} if self.document_values else {}),
        }
