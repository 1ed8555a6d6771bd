"""What to say when a record lacks the field a stage reads: the fields it does have.

A misnamed field (`tokenize(field="txt")` on records holding "text") used to be reported by the
asked name alone, so the user had to open a shard to learn what the records call it. The names
are worked out only when an error is built, from the one record the error is about: the skip path
(`on_error="skip"`) keeps no field list per record and pays nothing for this.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from ._records import RecordAddress

__all__ = ["MISSING_FIELD_REASONS", "AbsentField", "fields_it_has", "first_absent_field", "first_lacking_packed_field"]

SHOWN_FIELDS = 12
"""Enough for the usual layouts (a WebDataset sample's extensions, a Parquet file's columns); a
wide table is cut there with a count, so the message stays one readable line."""

MISSING_FIELD_REASONS = frozenset({"missing_field", "missing_image", "missing_video"})
"""The skip reasons that mean a record lacks the field (or every candidate field) a stage reads."""


def fields_it_has(asked: str | Iterable[str], fields: Iterable[object]) -> str:
    """"fields it has: 'a', 'b'; did you mean 'text'?" for a record with `fields` that lacks
    `asked` (a name, or the candidate names a VLM stage tries): sorted, at most `SHOWN_FIELDS`
    with "… and N more", and the close matches to an asked name where there are any; "'text' is
    null" where the record has an asked field whose value is null."""
    names = sorted(str(name) for name in fields)
    asked = [asked] if isinstance(asked, str) else list(asked)
    # A JSON `null` or a Parquet null is skipped as missing too: the field is there, so no other
    # name is guessed for it.
    nulls = [name for name in asked if name in names]
    if nulls:
        return " and ".join(repr(name) for name in nulls) + (" is null" if len(nulls) == 1 else " are null")
    if not names:
        return "it has no fields"
    shown = ", ".join(repr(name) for name in names[:SHOWN_FIELDS])
    more = f" … and {len(names) - SHOWN_FIELDS} more" if len(names) > SHOWN_FIELDS else ""
    import difflib  # here: only a record lacking a field is described

    close: list[str] = []
    for name in asked:
        close += [match for match in difflib.get_close_matches(name, names) if match not in close]
    guess = "; did you mean " + " or ".join(repr(name) for name in close) + "?" if close else ""
    return f"fields it has: {shown}{more}{guess}"


class AbsentField(NamedTuple):
    """A record that lacked the field a stage reads, as token estimation saw it: where it is, the
    name (or candidate names) asked for, and the fields it had."""

    address: RecordAddress
    asked: tuple[str, ...]
    fields: tuple[str, ...]

    def describe(self) -> str:
        asked = " or ".join(repr(name) for name in self.asked)
        return f"record {self.address} lacks {asked}: {fields_it_has(self.asked, self.fields)}"


def first_absent_field(
    op: object, records: dict[RecordAddress, dict], skipped: list[tuple[RecordAddress, str]]
) -> AbsentField | None:
    """The first of `skipped` (what stage `op` just dropped, of `records` by address) dropped for
    lacking its field, as an `AbsentField`; None if there is none. Token estimation calls it on its
    sample only: a loader's counted skips never do.

    A record holding a value at an asked field is passed over: `decode_video` drops a field holding
    an empty list with the same reason, and such a record was said to lack the field, as null."""
    asked = getattr(op, "field", None)
    if asked is None:
        return None
    asked = (asked,) if isinstance(asked, str) else tuple(asked)
    for address, reason in skipped:
        record = records.get(address)
        if reason in MISSING_FIELD_REASONS and record is not None and all(record.get(n) is None for n in asked):
            return AbsentField(address, asked, tuple(sorted(map(str, record))))
    return None


def first_lacking_packed_field(
    packer: object, addresses: list[RecordAddress], records: list[dict]
) -> AbsentField | None:
    """The first record that reached `packer` without the field it packs (`pack_flat`'s token ids),
    as an `AbsentField`; None if every record has it or the packer names no field. The packer's
    counter gives only its reason (`missing_field`), so the record is looked for here, on the sample
    only, to name the fields it has."""
    field = getattr(packer, "field", None)
    if not isinstance(field, str):
        return None
    for address, record in zip(addresses, records):
        if record.get(field) is None:
            return AbsentField(address, (field,), tuple(sorted(map(str, record))))
    return None
