"""The text a model's processor writes around a video's frames where it takes them as images.

InternVL, SmolVLM2 and Gemma 4 feed a video to their vision tower frame by frame, each frame an
image with its own placeholder block, and tell the model which frame is which in text: InternVL
numbers them (`Frame1: <img>...</img>` and a newline between frames), SmolVLM2 opens with the
count of frames and the video's length and stamps each frame with its time
(`\\nFrame from 00:05:`), Gemma 4 writes each frame's time before it (`00:05 <boi>...`). A frame's
block is its placeholders' (`tokens_for`); this module is the text between, encoded with the
model's tokenizer, so the packer can put it where the processor does.

Each piece of text is what the processor's prompt holds between two blocks (which open and close
with special tokens), encoded on its own, as the processor's tokenizer encodes the text between
two special tokens: the intro and the first frame's text are one piece, the text after a frame
and the next frame's another. The outro runs on into the document's text, which the processor
encodes with it: it is encoded so (`FrameText.outro_before`).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from zephon import ConfigurationError

from ._placeholders import _EncodedText, _plain_ids

__all__ = ["FrameText"]

_NAMES = {"intro": ("frames", "frames_in_words", "duration"), "before_frame": ("number", "time"),
          "between": (), "outro": ()}
"""The fields each piece's template may name: the video's frame count (in digits and in English
words), its duration as H:MM:SS, a frame's number from 1 and its time as MM:SS."""

_NO_IDS = np.zeros(0, dtype=np.int32)
_NO_IDS.flags.writeable = False

_SEAM_TOKENS = 3
"""Tokens of the text after the outro it is encoded with (`FrameText.outro_before`): enough for
the seam's pre-tokenisation to see what follows it."""


@dataclass(frozen=True)
class FrameText(_EncodedText):
    """Text around a video's frames where the placeholders take each frame as an image
    (`pack_multimodal(frame_text=...)`): `intro` before the first frame, `before_frame` before
    each, `between` after each but the last, `outro` after the last. Templates of `str.format`:
    `intro` may name `{frames}`, `{frames_in_words}` (SmolVLM's `num2words`) and `{duration}` (the
    video's length, whole seconds as H:MM:SS), `before_frame` `{number}` (from 1) and `{time}`
    (the time the frame is shown, whole minutes and seconds as MM:SS).

    Make one with `from_tokenizer`, `internvl`, `smolvlm` or `gemma4`; the tokenizer and the cache (one
    entry per piece of text) as `_EncodedText`'s.
    """

    intro: str = ""
    before_frame: str = ""
    between: str = ""
    outro: str = ""
    _named: frozenset = field(default=frozenset(), init=False, repr=False, compare=False, hash=False)
    """The fields the templates name, parsed once (a record's video reads them)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        named = set()
        for piece, allowed in _NAMES.items():
            template = getattr(self, piece)
            if not isinstance(template, str):
                raise ConfigurationError(f"FrameText: {piece} must be a str, got {template!r}")
            for _, name, spec, conversion in _fields(template, piece):
                if name not in allowed or spec or conversion:
                    shown = ", ".join("{" + each + "}" for each in allowed) or "no field"
                    raise ConfigurationError(f"FrameText: {piece} {template!r} may name {shown}, as they are, "
                                             f"got {{{name}{'!' + conversion if conversion else ''}"
                                             f"{':' + spec if spec else ''}}}")
                named.add(name)
        object.__setattr__(self, "_named", frozenset(named))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, intro: str = "", before_frame: str = "", between: str = "",
                       outro: str = "") -> FrameText:
        """Text encoded with `tokenizer` (a transformers fast tokenizer, a `tokenizers.Tokenizer`
        or a `tokenizer_id`)."""
        backend, digest = cls._backend_and_digest(tokenizer)
        return cls(digest, intro, before_frame, between, outro, _tokenizer=backend)

    @classmethod
    def internvl(cls, tokenizer: Any) -> FrameText:
        """InternVL's (`InternVLProcessor`): `Frame1: ` before the first frame's `<img>`, a newline
        and the next number between frames."""
        return cls.from_tokenizer(tokenizer, before_frame="Frame{number}: ", between="\n")

    @classmethod
    def smolvlm(cls, tokenizer: Any) -> FrameText:
        """SmolVLM2's (`SmolVLMProcessor`): the count of frames in words and the video's length,
        then `\\nFrame from MM:SS:` before each frame, `\\n\\n` after the last. Needs `num2words`."""
        return cls.from_tokenizer(
            tokenizer, intro="You are provided the following series of {frames_in_words} frames from a {duration} "
                             "[H:MM:SS] video.\n",
            before_frame="\nFrame from {time}:", outro="\n\n")

    @classmethod
    def gemma4(cls, tokenizer: Any) -> FrameText:
        """Gemma 4's (`Gemma4Processor`): each frame's time as MM:SS and a space before its block,
        a space between frames."""
        return cls.from_tokenizer(tokenizer, before_frame="{time} ", between=" ")

    @property
    def needs_times(self) -> bool:
        """Whether a frame's text names its time (the packer then needs the frames' times)."""
        return "time" in self._named

    @property
    def needs_duration(self) -> bool:
        """Whether the intro names the video's duration (the packer then needs it)."""
        return "duration" in self._named

    def pieces(self, frames: int, times: np.ndarray | None = None, duration_s: float | None = None) -> list[np.ndarray]:
        """The `frames + 1` int32 id arrays around a video's frames: before the first (the intro
        and its text), before each next (the text after the one before and its own), after the
        last. `times` (seconds each frame is shown) and `duration_s` are read where the templates
        name them, and must be given there."""
        if (self.needs_times and times is None) or (self.needs_duration and duration_s is None):
            raise ConfigurationError("FrameText: its templates name the frames' times or the video's duration, "
                                     "and pieces() was given none")
        values = {"frames": frames, "duration": None if duration_s is None else str(timedelta(seconds=int(duration_s)))}
        if "frames_in_words" in self._named:
            values["frames_in_words"] = _in_words(frames)
        texts = []
        for k in range(frames):
            opening = self.intro.format(**values) if k == 0 else self.between
            time = None if times is None else float(times[k])
            texts.append(opening + self.before_frame.format(number=k + 1, time=None if time is None else
                                                            f"{int(time // 60):02d}:{int(time % 60):02d}"))
        texts.append(self.outro)
        return [self._ids(text) for text in texts]

    def outro_before(self, following: np.ndarray) -> np.ndarray:
        """The outro's ids where the document's text `following` (its token ids) runs straight on
        after it, as the processor's prompt has it: the processor encodes the two as one text,
        and a tokenizer may split the seam otherwise than the outro alone (a byte-level BPE
        encodes `\n\n` alone as one token, before a word as two `\n`). The outro is encoded with
        the following text's first tokens, decoded; where that encoding ends with those very
        tokens, what comes before them is the outro's. Where it does not (the seam merges into
        the text's own tokens, which are already packed), the outro alone. Not cached: every
        caption opens otherwise, and a cache by it would grow with the dataset; it is one short
        encoding a video."""
        alone = self._ids(self.outro)
        head = following[:_SEAM_TOKENS].tolist()
        if not len(alone) or not head:
            return alone
        joint = np.array(_plain_ids(self._tokenizer, self.outro + self._tokenizer.decode(head)), dtype=np.int32)
        if len(joint) > len(head) and joint[-len(head):].tolist() == head:
            return joint[: -len(head)]
        return alone

    def _ids(self, text: str) -> np.ndarray:
        """int32 ids of a piece of text (read-only, cached by it); none for no text."""
        return self._encoded(text) if text else _NO_IDS


def _fields(template: str, piece: str) -> list[tuple]:
    """The replacement fields of a template, or a named error where it does not parse."""
    try:
        return [part for part in string.Formatter().parse(template) if part[1] is not None]
    except ValueError as exc:
        raise ConfigurationError(f"FrameText: {piece} {template!r} is no format template: {exc}") from None


def _in_words(count: int) -> str:
    """A count in English words, as SmolVLM's processor writes it (`num2words`)."""
    try:
        from num2words import num2words
    except ImportError:
        raise ConfigurationError("FrameText: {frames_in_words} needs num2words (pip install 'zephon[vlm]')") from None
    return num2words(count)
