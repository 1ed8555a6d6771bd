"""What a reader reports about bad input, and the policy that turns it into skips or errors.

Readers never decide what to do with a bad record: they put a `Bad` marker in the record's slot,
so that every record index of a chunk is accounted for, and `collect` applies the user's policy.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from .._errors import BadRecordError, ConfigurationError
from .._records import Chunk, ChunkRecords, RecordAddress

__all__ = [
    "MALFORMED_JSON",
    "INVALID_UTF8",
    "NOT_AN_OBJECT",
    "TRUNCATED_SHARD",
    "UNCONVERTIBLE_VALUE",
    "DUPLICATE_MEMBER",
    "REASONS",
    "ErrorPolicy",
    "Bad",
    "parse_json",
    "Slot",
    "collect",
    "fill_truncated",
]

MALFORMED_JSON = "malformed_json"
INVALID_UTF8 = "invalid_utf8"
NOT_AN_OBJECT = "not_an_object"
TRUNCATED_SHARD = "truncated_shard"
UNCONVERTIBLE_VALUE = "unconvertible_value"  # a stored value Python cannot hold (a date past year 9999)
DUPLICATE_MEMBER = "duplicate_member"  # a tar record with two members of one extension: which is meant?
REASONS = frozenset({MALFORMED_JSON, INVALID_UTF8, NOT_AN_OBJECT, TRUNCATED_SHARD, UNCONVERTIBLE_VALUE,
                     DUPLICATE_MEMBER})


class ErrorPolicy(enum.StrEnum):
    """What `Dataset.read_chunk` does with a bad record: count it as skipped, or fail fast."""

    SKIP = "skip"
    RAISE = "raise"

    @classmethod
    def parse(cls, value: str | ErrorPolicy) -> ErrorPolicy:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ConfigurationError(f"on_error={value!r} is not one of {choices}") from None


@dataclass(frozen=True)
class Bad:
    """The slot of a record that could not be read; `reason` is one of `REASONS`."""

    reason: str
    detail: str = ""


Slot = dict[str, Any] | Bad


def collect(chunk: Chunk, shard_url: str, slots: list[Slot], policy: ErrorPolicy) -> ChunkRecords:
    """Turn the slots of a chunk (one per record index, from `chunk.start`) into ChunkRecords.

    Under `ErrorPolicy.RAISE` the first bad slot raises `BadRecordError` naming its address.
    """
    out = ChunkRecords(chunk=chunk)
    for offset, slot in enumerate(slots):
        address = RecordAddress(chunk.dataset, shard_url, chunk.start + offset)
        if isinstance(slot, Bad):
            if policy is ErrorPolicy.RAISE:
                raise BadRecordError(address, slot.reason, slot.detail)
            out.skipped.append((address, slot.reason))
        else:
            out.records.append(slot)
            out.addresses.append(address)
    return out


def fill_truncated(slots: list[Slot], expected: int, detail: str) -> list[Slot]:
    """Pad `slots` to `expected` with TRUNCATED_SHARD: records the shard promised but no longer holds."""
    slots.extend(Bad(TRUNCATED_SHARD, detail) for _ in range(expected - len(slots)))
    return slots


def parse_json(text: str, where: str = "") -> Any | Bad:
    """The value of a JSON text, or `malformed_json` (prefixed with `where`, e.g. a member's name).

    Besides a syntax error that is JSON Python cannot hold: an integer of over 4,300 digits
    (ValueError) or nesting deeper than the recursion limit (RecursionError)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
        return Bad(MALFORMED_JSON, f"{where}{type(error).__name__}: {error}"[:300])
