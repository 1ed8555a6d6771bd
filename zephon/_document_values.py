"""Per-document values: numbers a record holds beside its text, carried into each row that holds
its document, one value per document.

Some losses weigh or label each sequence, not each token: KTO's desirable or undesirable
completion, a reward-weighted regression's reward, a per-sample loss weight, a reward model's margin
between a pair. A trainer reading them from its own table would need each document's record, which
only `Batch.sources` names; `pack_flat(document_values=("label",))` (and `pack_pairs`,
`pack_multimodal`, `pack_multimodal_pairs`) write them into the row instead, as the ragged field
`label`: (documents of the row,) float64 values, value d that of the document at
`document_ids == d`. A batch concatenates its rows' (`label_counts`: how many each row holds), so
row by row and document by document, the order in which `zephon.preference.document_log_probs`
gives each document's summed log-probabilities.

float64 holds every JSON number (a double) and every integer up to 2**53 as it is. A record whose
value is missing is skipped (`missing_field`), one whose value is no finite number, or an integer
float64 would round, as `bad_document_value`: a trainer given NaN, or a label read from a string,
would learn from it silently.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from ._errors import ConfigurationError, check_field_name
from ._field_names import fields_it_has
from ._records import RecordAddress

__all__ = ["ROW_FIELDS", "check_value_names", "read_values", "value_arrays"]

ROW_FIELDS = ("input_ids", "labels", "position_ids", "document_ids")
"""The row's own fields, which a value may not be named as (it would stand beside one of them)."""

_EXACT_INTEGERS = 2**53
"""The integers float64 holds exactly: beyond them an id or a count would come back another."""


def check_value_names(value: object, caller: str, documents: Sequence[str | None],
                      row_fields: Sequence[str] = ROW_FIELDS) -> tuple[str, ...]:
    """The names of `document_values` as a tuple of distinct record fields, else ConfigurationError:
    one of the `documents` fields the packer reads ids, loss masks (or images) from holds no number;
    a name of the packer's `row_fields`, or one that ends in `_counts`, would stand where the batch
    writes another field (`Batch.to_numpy` writes each ragged field's counts as `<name>_counts`)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigurationError(f"{caller}: document_values must be a list of record fields' names, got {value!r}")
    names = tuple(check_field_name(name, f"{caller}: document_values' names") for name in value)
    if len(set(names)) < len(names):
        raise ConfigurationError(f"{caller}: document_values names a field twice: {list(names)}")
    for name in names:
        if name in documents:
            raise ConfigurationError(f"{caller}: document_values names {name!r}, the field of a document's ids, "
                                     "loss mask or images, not of a number")
        if name in row_fields or name.endswith("_counts"):
            stands = (f"the rows hold their own {name!r}" if name in row_fields else
                      "a batch names each value's counts '<name>_counts'")
            raise ConfigurationError(f"{caller}: document_values cannot carry {name!r} into the rows: {stands}; "
                                     "give the field another name with a map")
    return names


def read_values(address: RecordAddress, record: dict, names: Sequence[str], skips: list) -> tuple[float, ...] | None:
    """The record's values of `names`, as float64 holds them, or None where one is missing or no
    number (module docstring), (address, reason, detail) appended to `skips` for the first."""
    values = []
    for name in names:
        value = record.get(name)
        if value is None:
            skips.append((address, "missing_field", f"document value {name!r}; {fields_it_has(name, record)}"))
            return None
        number = _exact_number(value)
        if number is None:
            skips.append((address, "bad_document_value", f"{name!r} holds {value!r} ({type(value).__name__}), "
                                                         "not a finite number that float64 holds as it is"))
            return None
        values.append(number)
    return tuple(values)


def _exact_number(value: object) -> float | None:
    """`value` as a float, where it is a bool, an integer float64 holds exactly or a finite real
    (NumPy's too); else None. JSON's and Arrow's floats, bools and ints are looked at first, by
    their exact type: the generic checks are abstract classes', which cost a record a microsecond
    on the loader's thread."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is bool:
        return float(value)
    if kind is int:
        return float(value) if -_EXACT_INTEGERS <= value <= _EXACT_INTEGERS else None
    if isinstance(value, np.bool_):
        return float(value)
    if isinstance(value, numbers.Integral):
        return float(value) if abs(int(value)) <= _EXACT_INTEGERS else None
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def value_arrays(rows: Sequence[Sequence[tuple[float, ...]]], names: Sequence[str]) -> tuple[dict, dict]:
    """(ragged, counts) of rows whose documents hold `values` (one tuple a document, in `names`'
    order): each name's values of every row's documents in order, float64, and how many each row
    holds, as `collate` concatenates ragged fields."""
    per_document = [values for row in rows for values in row]
    columns = zip(*per_document) if per_document else [()] * len(names)
    counts = np.array([len(row) for row in rows], dtype=np.int64)
    return ({name: np.array(column, dtype=np.float64) for name, column in zip(names, columns)},
            {name: counts.copy() for name in names})
