"""Marker strings in a text (LLaVA's `<image>`) turned into token offsets by `tokenize(marker=...)`.

A LLaVA-style record says where its image goes by a marker in its text (`"<image>\\nA photo of a
dog."`); a packer places image k right before text token `offsets[k]`. The text is split at each
marker, its pieces are encoded in the chunk's one batched call beside the texts that hold none,
and each record's pieces' ids are joined; the marker's text is dropped and its place kept as the
length of the ids before it.
"""

from __future__ import annotations

from typing import NamedTuple

from ._errors import ConfigurationError

__all__ = ["OFFSETS_FIELD", "MarkedText", "MarkerOffsets", "check_marker", "encode_at_markers"]

OFFSETS_FIELD = "image_offsets"
"""`tokenize`'s default `offsets_field`, the field `pack_multimodal` reads by default."""


class MarkerOffsets(tuple):
    """The token offsets of one text's markers, a tuple of ints to any reader, holding the marker.

    The type tells a packer that the count is the number of markers found in the text, not offsets
    stored in the data: a count unlike the record's images is then that record's fault (a caption
    with two `<image>` and one image), skipped and counted as `marker_count_mismatch`, where
    offsets from the data that do not fit are a configuration error. A map that rebuilds the field
    makes it data again."""

    marker: str

    def __new__(cls, offsets, marker: str) -> MarkerOffsets:
        self = super().__new__(cls, offsets)
        self.marker = marker
        return self

    def __reduce__(self):
        """Pickled with its marker (a process runner's records cross by pickle)."""
        return MarkerOffsets, (tuple(self), self.marker)


class MarkedText(NamedTuple):
    """One text's ids with its markers dropped, and each marker's offset among them (no BOS yet);
    where asked, its pieces' encodings, to say which id holds a character (`char_to_token`)."""

    ids: list[int]
    offsets: list[int]
    pieces: tuple = ()

    def char_to_token(self, at: int) -> int | None:
        """The index of the first id that holds character `at` of the text, None for a marker's,
        as an `Encoding`'s `char_to_token` says."""
        for start, base, encoding in reversed(self.pieces):
            if at >= start:
                token = encoding.char_to_token(at - start)
                return None if token is None else base + token
        return None

    def token_to_chars(self, index: int) -> tuple[int, int] | None:
        """The (start, end) characters of the text that id `index` holds, as an `Encoding`'s
        `token_to_chars` says."""
        for start, base, encoding in reversed(self.pieces):
            if index >= base:
                chars = encoding.token_to_chars(index - base)
                return None if chars is None else (chars[0] + start, chars[1] + start)
        return None


def encode_at_markers(encode_batch, marker: str, texts: list[str], *, add_special_tokens: bool,
                      locate: bool = False) -> list[MarkedText]:
    """Each of `texts` encoded with `encode_batch` (one call for all their pieces) as its pieces
    between `marker`s, their ids joined: a marker's offset is the number of ids before it. A text
    without the marker is one piece, encoded as `tokenize` encodes it without `marker`. Bound to
    its first two arguments it is called as `encode_batch` is. With `locate`, each text keeps its
    pieces' encodings (where each starts among the characters and among the ids)."""
    splits = [text.split(marker) for text in texts]
    # Empty pieces (a marker at either end, two adjacent) are not encoded: each costs a call's
    # setup in `tokenizers` for no id.
    pieces = [piece for parts in splits for piece in parts if piece]
    encodings = iter(encode_batch(pieces, add_special_tokens=add_special_tokens) if pieces else ())
    out = []
    for parts in splits:
        ids, offsets, at, kept = [], [], 0, []
        for number, piece in enumerate(parts):
            if number:
                offsets.append(len(ids))
                at += len(marker)
            if piece:
                encoding = next(encodings)
                if locate:
                    kept.append((at, len(ids), encoding))
                ids += encoding.ids
            at += len(piece)
        out.append(MarkedText(ids, offsets, tuple(kept)))
    return out


def check_marker(marker: str | None, offsets_field: str, field: str, output_field: str) -> None:
    """Refuse, as `tokenize` is called, a marker that is no non-empty str (an empty one splits
    every text between its characters), an `offsets_field` given without a marker (nothing would
    write it, and the packer would place the images by its `image_position`, unsaid), and one
    naming the text or ids field, which the offsets would replace."""
    if marker is None:
        if offsets_field != OFFSETS_FIELD:
            raise ConfigurationError(
                f"tokenize: offsets_field={offsets_field!r} is written only with a marker: give marker= "
                "(the string that says where an image goes, e.g. '<image>') or leave offsets_field out"
            )
        return
    if not isinstance(marker, str) or not marker:
        raise ConfigurationError(f"tokenize: marker must be a non-empty str (e.g. '<image>') or None, got {marker!r}")
    if offsets_field in (field, output_field):
        raise ConfigurationError(
            f"tokenize: offsets_field={offsets_field!r} is also the text or ids field ({field!r}, {output_field!r}); "
            "the offsets would replace it: give it a field of its own"
        )
