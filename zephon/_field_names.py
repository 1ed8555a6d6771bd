"""What to say when a record lacks the field a stage reads: the fields it does have.

A misnamed field (`tokenize(field="txt")` on records holding "text") used to be reported by the
asked name alone, so the user had to open a shard to learn what the records call it. The names
are worked out only when an error is built, from the one record the error is about: the skip path
(`on_error="skip"`) keeps no field list per record and pays nothing for this.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["fields_it_has"]

SHOWN_FIELDS = 12
"""Enough for the usual layouts (a WebDataset sample's extensions, a Parquet file's columns); a
wide table is cut there with a count, so the message stays one readable line."""


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
