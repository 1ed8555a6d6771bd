"""The named errors Zephon raises.

Every failure a user can hit has its own class so that training scripts can catch exactly what
they mean to, and every message names the numbers, fields or record address involved.
"""

from __future__ import annotations

import math
import numbers
import os

__all__ = [
    "check_count",
    "check_finite",
    "is_finite_number",
    "check_seed",
    "check_token_id",
    "relative_path_note",
    "ZephonError",
    "ConfigurationError",
    "BadRecordError",
    "UserFunctionError",
    "PartialGlobalBatchError",
    "CheckpointError",
    "StateLacksLanesError",
    "RecipeMismatchError",
]


class ZephonError(Exception):
    """Base class of every error Zephon raises on purpose."""


class ConfigurationError(ZephonError, ValueError):
    """The recipe or the layout (lanes, ranks, batch sizes) cannot work; raised at construction."""


def check_field_name(value: object, what: str) -> str:
    """`value` if it names a record field (a non-empty str), else ConfigurationError naming `what`:
    None, 3 or "" is read from no record, so every record was skipped or packed without what the
    field held, unsaid."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be a record field's name (a non-empty str), got {value!r}")
    return value


def check_count(value: object, what: str, least: int = 1) -> int:
    """`value` as a plain int if it is an integer (a NumPy one too) of at least `least`, else
    ConfigurationError naming `what`.

    A bool is not a count, and a float or a string that looks like one is refused rather than
    rounded: these numbers enter recipe fingerprints and array shapes, where 8.0 and "8" are not 8.
    Callers keep the returned int, so a fingerprint holds 8 and not numpy.int64(8).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ConfigurationError(f"{what} must be an integer >= {least}, got {value!r}")
    return int(value)


def is_finite_number(value: object) -> bool:
    """A real number, not a bool, that a float holds finitely: no NaN, no infinity, and no int past
    float's range (10**400 is finite, but math.isfinite raises OverflowError on it)."""
    try:
        return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:
        return False


def check_finite(value: object, what: str) -> float:
    """`value` unchanged if it is a finite real number, else ConfigurationError naming `what`.

    NaN is false under every comparison and infinity passes a bound like `>= 1`, so a range check
    alone lets both through, to fail later as a bare OverflowError or as every record dropped.
    """
    if not is_finite_number(value):
        raise ConfigurationError(f"{what} must be a finite number, got {value!r}")
    return value


def check_token_id(value: object, what: str) -> int:
    """`value` as a plain int if it can be a token id: an integer in [0, 2**31), which the int32
    token arrays hold as it is, else ConfigurationError naming `what`."""
    token_id = check_count(value, f"{what} (a token id)", 0)
    if token_id >= 2**31:
        raise ConfigurationError(f"{what}={token_id} is not a token id: it does not fit the int32 token arrays")
    return token_id


def check_seed(value: object, what: str) -> int:
    """`value` as a plain int of any sign, else ConfigurationError naming `what`. A seed enters
    the keys of random streams as its decimal text, where None, 1.5 or True would silently
    name another stream than the integer a user meant."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigurationError(f"{what} must be an integer, got {value!r}")
    return int(value)


def relative_path_note(path: str) -> str:
    """Where a relative local path was looked for, for an error saying it names nothing: a path
    copied from an example (`zephon/data/kjv`) names the file only from the directory it was
    written for, and the message did not say which directory it was looked for from."""
    if os.path.isabs(os.path.expanduser(path)):
        return ""
    return f" (a relative path: looked for from the working directory {os.getcwd()})"


class BadRecordError(ZephonError):
    """A record could not be used and the policy is to fail fast; the message names its address."""

    def __init__(self, address: object, reason: str, detail: str = "") -> None:
        self.address = address
        self.reason = reason
        self.detail = detail
        suffix = f": {detail}" if detail else ""
        super().__init__(f"bad record {address} ({reason}){suffix}")

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (type(self), (self.address, self.reason, self.detail))


class PartialGlobalBatchError(ZephonError):
    """Microbatches handed to `global_batch_digest` lack some (lane, index) of their step: a rank's
    part not gathered, or a microbatch dropped. `missing` lists them, sorted."""

    def __init__(self, message: str, missing: list[tuple[int, int]]) -> None:
        self.missing = missing
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.missing))


class UserFunctionError(ZephonError):
    """A user `map`/`filter` function raised; carries the record address and the original traceback."""

    def __init__(self, address: object, operator: str, original: str) -> None:
        self.address = address
        self.operator = operator
        self.original = original
        super().__init__(f"{operator} failed on record {address}\n--- original traceback ---\n{original}")

    def __reduce__(self):
        return (type(self), (self.address, self.operator, self.original))


class CheckpointError(ZephonError):
    """A checkpoint is malformed, truncated, of an unknown version or does not cover the lanes needed."""


class StateLacksLanesError(CheckpointError):
    """A loader state that lacks lanes of the rank loading it (one rank's state, unmerged).
    `lanes`: the rank's lanes it lacks. Raised as a subclass so that an adapter whose users save
    states another way (TorchTitan's `state_dict()`) can name the way that gives every lane."""

    def __init__(self, message: str, lanes: list[int]) -> None:
        self.lanes = lanes
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.lanes))


class RecipeMismatchError(CheckpointError):
    """A checkpoint was taken with a different recipe; the message names every field that changed.

    `changed` holds the recipe's keys for them (`plan.seed`, `operators[1].pack_flat.max_length`),
    so that a front end building the pipeline from settings of its own (TorchTitan's `DataRecipe`)
    can name those settings too. It is an attribute, not an argument kept in `args`: a pickle (a
    process runner sending the error to its parent) rebuilds the error from its message and then
    restores its attributes, `changed` and the notes the worker added among them."""

    def __init__(self, message: str, changed: tuple[str, ...] = ()) -> None:
        self.changed = tuple(changed)
        super().__init__(message)
