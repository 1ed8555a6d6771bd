"""Which tokens of a document the loss trains on: a prompt is read, not learned.

Instruction data (a question and its answer, a task prefix and a caption, a chat's user turns)
trains on part of each document. A record says which part by a per-token mask beside its ids,
`record["loss_mask"]`: one bool per id, True where that token is a target of the loss (the label
of the position before it). `tokenize(prompt_field=...)` writes it (False over the BOS and the
prompt's ids, True over the text's and the EOS), `tokenize(segments=True)` from a chat's
[text, learned] pairs, and a `map` may write it beside ids stored in the data. A packer reads it
where a record holds it and writes IGNORE_INDEX as the label before every token it marks False,
so a row's labels stay "the next token of the same document, or ignored"; a record without it
trains on every token, as before.

Packers turn a mask into the document's *targets*, its ids with IGNORE_INDEX where the mask is
False, once per document, and cut and copy them beside the ids: a row's labels are then one slice
write per piece, as for an unmasked document.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ._errors import ConfigurationError, check_field_name
from ._field_names import fields_it_has
from ._sequence import IGNORE_INDEX

__all__ = ["LOSS_MASK_FIELD", "check_loss_mask_options", "loss_mask_detail", "prompt_segments", "record_segments",
           "sample", "segments_detail", "segments_problem", "targets_of"]

LOSS_MASK_FIELD = "loss_mask"
"""The field `tokenize(prompt_field=...)` writes and packers read by default."""

_IGNORED = np.int32(IGNORE_INDEX)


def check_loss_mask_options(prompt_field: str | None, segments: bool, loss_mask_field: str,
                            other_fields: tuple[str, ...]) -> None:
    """Refuse, as `tokenize` is called, a prompt or mask field that is no non-empty str, one that
    names a field `tokenize` reads or writes besides (`other_fields`), which it would replace, a
    prompt beside segments, and a `loss_mask_field` given without either, which nothing would write."""
    if not isinstance(segments, bool):
        raise ConfigurationError(f"tokenize: segments must be True or False, got {segments!r}")
    if segments and prompt_field is not None:
        raise ConfigurationError(
            "tokenize: prompt_field and segments=True both say what is learned; segments hold the prompt as a "
            "segment not learned: give one"
        )
    if prompt_field is None and not segments:
        if loss_mask_field != LOSS_MASK_FIELD:
            raise ConfigurationError(
                f"tokenize: loss_mask_field={loss_mask_field!r} is written only with a prompt or segments: give "
                "prompt_field= (the field holding the text not trained on) or segments=True, or leave "
                "loss_mask_field out"
            )
        return
    for name, value in (("prompt_field", prompt_field), ("loss_mask_field", loss_mask_field)):
        if value is not None:  # segments: no prompt field
            check_field_name(value, f"tokenize: {name}")
    for name, value in (("prompt_field", prompt_field), ("loss_mask_field", loss_mask_field)):
        if value in other_fields or (name == "loss_mask_field" and value == prompt_field):
            raise ConfigurationError(
                f"tokenize: {name}={value!r} is also another field tokenize reads or writes; give it one of its own"
            )


def targets_of(tokens: np.ndarray, value: object) -> np.ndarray | None | str:
    """The ids a document's positions learn: None where `value` (its `loss_mask` field) is absent
    (the ids themselves are the targets), else `tokens` (int32) with IGNORE_INDEX
    where the mask is False; or `"bad_loss_mask"` where `value` is not one bool (or 0/1) per id.

    A bool array (what `tokenize` writes) is taken as it is; a list (a mask stored in the data,
    JSON's true/false or 0/1) is checked once here, so a wrong one is counted, never trained on."""
    if value is None:
        return None
    mask = value if type(value) is np.ndarray and value.dtype == np.bool_ else _as_mask(value)
    if mask is None or mask.shape != tokens.shape:
        return "bad_loss_mask"
    # One NumPy call: this runs on the loader's thread for every masked document, where each call
    # costs about a microsecond whatever the length (`benchmarks/test_loss_mask_bench.py`).
    return np.where(mask, tokens, _IGNORED)


def _as_mask(value: object) -> np.ndarray | None:
    """`value` as a 1-D bool array where it holds only bools or 0s and 1s, else None."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        mask = np.asarray(value)
    except (TypeError, ValueError):  # ragged nesting
        return None
    if mask.ndim != 1 or (mask.dtype != np.bool_ and (mask.dtype.kind not in "iu" or not np.isin(mask, (0, 1)).all())):
        return None
    return mask.astype(np.bool_, copy=False)


def loss_mask_detail(field: str, ids_field: str, record: dict) -> Callable[[], str]:
    """What a record refused as `bad_loss_mask` held, made only where the skip is kept as an example."""
    return functools.partial(_describe, field, ids_field, record)


def _describe(field: str, ids_field: str, record: dict) -> str:
    value, ids = record.get(field), record.get(ids_field)
    count = len(ids) if ids is not None and hasattr(ids, "__len__") else "no"
    mask = _as_mask(value)
    if mask is None:
        return f"{field!r} holds {type(value).__name__} {sample(value)}, not one bool (or 0/1) per id of {ids_field!r}"
    return f"{field!r} holds {len(mask)} flags for the {count} ids of {ids_field!r}"


def sample(value: object) -> str:
    """A value as a detail shows it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- tokenize's side: a document's texts as (text, learned) segments ------------------------------

Segment = tuple[str, bool, bool]
"""A text, whether its ids are learned, and whether it is a chat template's own text, whose special
tokens' strings are the control tokens they name (`tokenize(segments=True)`'s third item)."""


def prompt_segments(prompt_field: str, field: str) -> Callable[[dict], list[Segment]]:
    """A record's segments under `tokenize(prompt_field=...)`: its prompt, not learned, then its text."""
    return lambda record: [(record[prompt_field], False, False), (record[field], True, False)]


def record_segments(field: str) -> Callable[[dict], list[Segment]]:
    """A record's segments under `tokenize(segments=True)`: its field's [text, learned] pairs, or
    [text, learned, template] triples."""
    return lambda record: [(item[0], item[1], len(item) == 3 and bool(item[2])) for item in record[field]]


def segments_problem(value: object) -> str | None:
    """Why `value` is no document of segments, or None: `missing_field`; `not_segments` where it is
    not a list of [text, learned] pairs (a str and a bool, as JSON writes them); `empty_document`
    where every text is blank."""
    if value is None:
        return "missing_field"
    if not isinstance(value, (list, tuple)) or not all(_is_segment(item) for item in value):
        return "not_segments"
    return None if any(item[0].strip() for item in value) else "empty_document"


def _is_segment(item: object) -> bool:
    return (isinstance(item, (list, tuple)) and len(item) in (2, 3) and isinstance(item[0], str)
            and all(isinstance(flag, (bool, np.bool_)) for flag in item[1:]))


def segments_detail(field: str, reason: str, record: dict) -> str:
    """What a record's segments held, for a record `segments_problem` refused (or `invalid_utf8`)."""
    value = record.get(field)
    if reason == "missing_field":
        return f"field {field!r}; {fields_it_has(field, record)}"
    if reason == "empty_document":
        return f"field {field!r} holds {len(value)} segment(s), every text blank" if value else \
            f"field {field!r} holds no segment"
    if reason == "invalid_utf8":
        return (f"field {field!r} holds a text with a lone surrogate (as a JSON \\ud800 escape makes), which has "
                "no UTF-8 form")
    bad = value if not isinstance(value, (list, tuple)) else next(item for item in value if not _is_segment(item))
    return (f"field {field!r} holds {sample(bad)}, not a list of [text, learned] pairs (a str and true or false) "
            "or [text, learned, template] triples")
