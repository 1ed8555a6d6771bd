"""Which tokens of a document the loss trains on: a prompt is read, not learned.

Instruction data (a question and its answer, a task prefix and a caption, a chat's user turns)
trains on part of each document. A record says which part by a per-token mask beside its ids,
`record["loss_mask"]`: one bool per id, True where that token is a target of the loss (the label
of the position before it). `tokenize(prompt_field=...)` writes it (False over the BOS and the
prompt's ids, True over the text's and the EOS); a `map` may write it for any layout (a chat's
several assistant turns). A packer reads it where a record holds it and writes IGNORE_INDEX as the
label before every token it marks False, so a row's labels stay "the next token of the same
document, or ignored"; a record without it trains on every token, as before.

Packers turn a mask into the document's *targets*, its ids with IGNORE_INDEX where the mask is
False, once per document, and cut and copy them beside the ids: a row's labels are then one slice
write per piece, as for an unmasked document.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ._errors import ConfigurationError
from ._sequence import IGNORE_INDEX

__all__ = ["LOSS_MASK_FIELD", "check_prompt", "loss_mask_detail", "targets_of"]

LOSS_MASK_FIELD = "loss_mask"
"""The field `tokenize(prompt_field=...)` writes and packers read by default."""

_IGNORED = np.int32(IGNORE_INDEX)


def check_prompt(prompt_field: str | None, loss_mask_field: str, other_fields: tuple[str, ...]) -> None:
    """Refuse, as `tokenize` is called, a prompt or mask field that is no non-empty str, one that
    names a field `tokenize` reads or writes besides (`other_fields`), which it would replace, and
    a `loss_mask_field` given without a prompt, which nothing would write."""
    if prompt_field is None:
        if loss_mask_field != LOSS_MASK_FIELD:
            raise ConfigurationError(
                f"tokenize: loss_mask_field={loss_mask_field!r} is written only with a prompt: give prompt_field= "
                "(the field holding the text not trained on) or leave loss_mask_field out"
            )
        return
    for name, value in (("prompt_field", prompt_field), ("loss_mask_field", loss_mask_field)):
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"tokenize: {name} must be a record field's name (a non-empty str), got {value!r}")
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
        return f"{field!r} holds {type(value).__name__} {_sample(value)}, not one bool (or 0/1) per id of {ids_field!r}"
    return f"{field!r} holds {len(mask)} flags for the {count} ids of {ids_field!r}"


def _sample(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
