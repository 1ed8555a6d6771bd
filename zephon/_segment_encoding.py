"""A document of (text, learned) segments as ids and a loss mask (`tokenize(segments=True)`, and
`tokenize(prompt_field=...)`'s prompt and text).

A chat's segments are cut where the learned text starts and ends, not where the model's tokenizer
would cut it. Encoded apart, every cut is a seam the document encoded whole does not have: a
SentencePiece tokenizer starts each text with its word boundary (`▁A` where the chat holds `\\nA`),
and a merge across the cut (`\\n` + `\\nfine` as `\\n\\n`) is lost, so the ids are not those the
model reads at inference. So segments are *joined*: consecutive segments alike in how their
special tokens' strings are read (a chat template's own text, or text) are one text, encoded
whole, and each id is learned where any character it covers is, as transformers' assistant mask
maps the characters of a `{% generation %}` block to the tokens holding them. An id that straddles
the start of the learned text (` fine` after `Bot:`) is learned: predicting it predicts learned
text. A seam remains only where template text and a message's own text meet (a content quoting a
control token, `zephon._chat`), and at a marker, where a processor splits the text too.

A prompt and its text (`prompt_field`) stay encoded apart, as a processor encodes a prefix and
its suffix.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["encode_segments", "learned_ids"]


class _Run(NamedTuple):
    """Consecutive segments encoded as one text: the text, whether it is a template's, and whether
    it is learned: one bool where its segments are learned alike, else the (start, end) character
    spans of its learned segments."""

    text: str
    template: bool
    learned: bool | list[tuple[int, int]]


def _runs_of(segments, joined: bool) -> list[_Run]:
    """A document's segments as the texts encoded: each segment alone, or joined (module
    docstring) where `joined`."""
    if not joined:
        return [_Run(text, template, bool(learned)) for text, learned, template in segments]
    runs: list[_Run] = []
    start = 0
    for end in range(1, len(segments) + 1):
        if end < len(segments) and segments[end][2] == segments[start][2]:
            continue
        group = segments[start:end]
        flags = {bool(learned) for _, learned, _ in group}
        runs.append(_Run("".join(text for text, _, _ in group), bool(group[0][2]),
                         flags.pop() if len(flags) == 1 else _learned_spans(group)))
        start = end
    return runs


def _learned_spans(group) -> list[tuple[int, int]]:
    """The (start, end) character spans of the learned texts of segments joined, consecutive
    learned segments one span."""
    spans: list[tuple[int, int]] = []
    at = 0
    for text, learned, _ in group:
        if learned and text:
            if spans and spans[-1][1] == at:
                spans[-1] = (spans[-1][0], at + len(text))
            else:
                spans.append((at, at + len(text)))
        at += len(text)
    return spans


def learned_ids(encoding, count: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [first, end) ids of each character span, as the `encoding` of `count` ids places them
    (`char_to_token`, `token_to_chars`): from the first id holding its first character through
    the last holding its last, so every id holding any of its characters (a `▁` a SentencePiece
    tokenizer writes before a newline holds the newline too); a character no id holds (a marker's,
    one a normalizer dropped) is passed over, and a span of such characters alone has no id."""
    out = []
    for start, end in spans:
        first = next((t for t in map(encoding.char_to_token, range(start, end)) if t is not None), None)
        if first is None:
            continue
        last = next(t for t in map(encoding.char_to_token, range(end - 1, start - 1, -1)) if t is not None)
        while last + 1 < count and (encoding.token_to_chars(last + 1) or (end, end))[0] < end:
            last += 1
        out.append((first, last + 1))
    return out


def encode_segments(encoded_runs, documents: list[list[tuple[str, bool, bool]]], prefix: list[int],
                    suffix: list[int], marker: str | None, joined: bool) -> list[tuple[np.ndarray, object, np.ndarray]]:
    """Each document of segments as (ids, marker offsets or None, loss mask): BOS (`prefix`), the
    ids of its runs (`_runs_of`), EOS (`suffix`); the mask False over BOS, each id flagged as the
    characters it holds are, and EOS as the last segment (an answer's end is learned with it).
    `encoded_runs(texts, templates, spans)` gives each text's (ids, `learned_ids` of its `spans`
    where those are given, marker offsets), a template's text with its control tokens matched:
    every run of the chunk in one call, as `tokenize` encodes a chunk's texts; a marker's offset
    counts every id before it."""
    from ._markers import MarkerOffsets

    runs_of = [_runs_of(segments, joined) for segments in documents]
    every = [run for runs in runs_of for run in runs]
    pieces = iter(encoded_runs([run.text for run in every], [run.template for run in every],
                               [None if isinstance(run.learned, bool) else run.learned for run in every]))
    out = []
    for segments, runs in zip(documents, runs_of):
        ids, flags, offsets = list(prefix), [np.zeros(len(prefix), bool)], []
        for run in runs:
            piece, learned_spans, marks = next(pieces)
            if marker is not None:
                offsets += [len(ids) + at for at in marks]
            ids += piece
            if learned_spans is None:
                flags.append(np.full(len(piece), run.learned))
            else:
                learned = np.zeros(len(piece), bool)
                for first, end in learned_spans:
                    learned[first:end] = True
                flags.append(learned)
        ids += suffix
        flags.append(np.full(len(suffix), bool(segments[-1][1])))
        tokens = np.fromiter(ids, dtype=np.int32, count=len(ids))
        out.append((tokens, None if marker is None else MarkerOffsets(offsets, marker), np.concatenate(flags)))
    return out
