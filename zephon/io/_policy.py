"""What a reader reports about bad input, and the policy that turns it into skips or errors.

Readers never decide what to do with a bad record: they put a `Bad` marker in the record's slot,
so that every record index of a chunk is accounted for, and `collect` applies the user's policy.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import BadRecordError, ConfigurationError
from .._records import DETAILS_PER_REASON, Chunk, ChunkRecords, RecordAddress

__all__ = [
    "MALFORMED_JSON",
    "INVALID_UTF8",
    "NOT_AN_OBJECT",
    "TRUNCATED_SHARD",
    "UNCONVERTIBLE_VALUE",
    "DUPLICATE_MEMBER",
    "DUPLICATE_COLUMN",
    "DUPLICATE_KEY",
    "NOT_A_FILE",
    "REASONS",
    "ErrorPolicy",
    "Bad",
    "MAX_JSON_DEPTH",
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
DUPLICATE_COLUMN = "duplicate_column"  # a Parquet row with two columns of one name: which is meant?
DUPLICATE_KEY = "duplicate_key"  # a JSON object naming one key twice: which value is meant?
NOT_A_FILE = "not_a_file"  # a tar member that is a link, FIFO or device: no bytes of its own
REASONS = frozenset({MALFORMED_JSON, INVALID_UTF8, NOT_AN_OBJECT, TRUNCATED_SHARD, UNCONVERTIBLE_VALUE,
                     DUPLICATE_MEMBER, DUPLICATE_COLUMN, DUPLICATE_KEY, NOT_A_FILE})


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
            kept = out.skip_details.get(slot.reason)  # `skip_one` written out: a call per bad record costs
            if kept is None:
                kept = out.skip_details[slot.reason] = {}
            if len(kept) < DETAILS_PER_REASON:
                kept[address] = slot.detail
        else:
            out.records.append(slot)
            out.addresses.append(address)
    return out


def fill_truncated(slots: list[Slot], expected: int, detail: str) -> list[Slot]:
    """Pad `slots` to `expected` with TRUNCATED_SHARD: records the shard promised but no longer holds."""
    slots.extend(Bad(TRUNCATED_SHARD, detail) for _ in range(expected - len(slots)))
    return slots


MAX_JSON_DEPTH = 200
"""How deeply arrays and objects may nest in a JSON record. A fixed limit, not the recursion limit:
how deep `json.loads` can go depends on the stack it runs on (the loader's thread under the inline
runner, a pool thread, a worker process; the frames below it; the build: ~990 levels on 3.11,
~58,000 on 3.14t's main thread, ~3,300 in a thread with a 512 KiB stack), so a record nested
between two such limits was read by one runner and skipped by another."""


_TOO_DEEP = object()  # what json.loads gave when it ran out of stack


class _KeyNamedTwice(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _object_naming_each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        raise _KeyNamedTwice(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return value


# Shared by every thread, as `json.loads` shares its own default decoder: decoding keeps no state.
# Made once: `json.loads(text, object_pairs_hook=...)` builds a decoder per call (~2 µs a record).
_DECODER = json.JSONDecoder(object_pairs_hook=_object_naming_each_key_once)


def parse_json(text: str, where: str = "") -> Any | Bad:
    """The value of a JSON text, or `malformed_json` (prefixed with `where`, e.g. a member's name).

    Besides a syntax error that is JSON Python cannot hold: an integer of over 4,300 digits
    (ValueError) or nesting deeper than `MAX_JSON_DEPTH`. An object, at any depth, that names a key
    twice is `duplicate_key`: `json.loads` keeps the last value and drops the other unsaid, and
    which one the writer meant is not known (as for a tar member or a Parquet column named twice)."""
    try:
        return _held_value(text, where, _DECODER.decode)
    except _KeyNamedTwice as twice:
        # Met as its object closed, before the rest of the text was read, and at a depth the stack
        # allowed on this build and thread: a text that is not JSON Python can hold is malformed
        # whatever it holds, so that is decided first, by the same rules without the check.
        verdict = _held_value(text, where, json.loads)
        if isinstance(verdict, Bad):
            return verdict
        return Bad(DUPLICATE_KEY, f"{where}an object names {twice.key!r} twice: which value is meant is not known"[:300])


def _held_value(text: str, where: str, decode: Callable[[str], Any]) -> Any | Bad:
    """The value `decode` gives, or `malformed_json` where the text is not JSON Python can hold."""
    try:
        value = decode(text)
    except RecursionError:
        value = _TOO_DEEP
    except ValueError as error:  # JSONDecodeError is a ValueError
        if decode is not json.loads and text.startswith("\ufeff"):
            # A decoder's decode() takes a byte order mark for a bad value at column 1, where
            # json.loads names it: asked again, the detail says what is wrong with the line.
            return _held_value(text, where, json.loads)
        return Bad(MALFORMED_JSON, f"{where}{type(error).__name__}: {error}"[:300])
    # Most records are an object of plain values (a text and its metadata), decided at a glance;
    # other nesting needs an opening bracket per level, so most texts are decided by counting them.
    if value is _TOO_DEEP or (
        not _flat_object(value)
        and text.count("[") + text.count("{") > MAX_JSON_DEPTH
        and _nests_deeper(value, MAX_JSON_DEPTH)
    ):
        return Bad(MALFORMED_JSON, f"{where}arrays and objects nested deeper than {MAX_JSON_DEPTH} levels")
    return value


_CONTAINERS = frozenset({list, dict})


def _flat_object(value: Any) -> bool:
    """An object holding no list or dict (every value type looked up in one pass in C: this runs
    for every record, and pays for the duplicate-key hook's cost)."""
    return type(value) is dict and _CONTAINERS.isdisjoint(map(type, value.values()))


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether lists and dicts nest more than `limit` levels in `value` (walked without recursion)."""
    containers = (list, dict)
    stack = [(value, 1)] if isinstance(value, containers) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, containers))
    return False
