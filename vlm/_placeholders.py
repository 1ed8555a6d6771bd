"""How an image of (rows, cols) patches becomes placeholder tokens in the text sequence.

The count is a pure function of the patch grid and the model family's convention; the model later
replaces these tokens by the image's embeddings, so a count that differs from the model's own
processor by one token breaks training silently. Every convention here is checked in the tests
against its reference implementation (mistral-common's image encoder, transformers' processors).

Rows and cols are always in *patches* (patch_size pixels); with merge_size m, one placeholder
token stands for an m x m block of patches, so rows and cols must be multiples of m.

Thread-safety: instances are immutable; `tokens_for` caches per grid and is safe to share.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np

from zephon._errors import ConfigurationError, check_count, check_token_id
from zephon._sha256 import sha256
from zephon._tokenizer import load_tokenizer

__all__ = ["QWEN_TEMPORAL_PATCH", "AyaVisionPlaceholders", "Cohere2VisionPlaceholders", "Idefics3Placeholders",
           "Llama4Placeholders", "LlavaNextPlaceholders", "PadPlaceholders", "PixtralPlaceholders", "Placeholders",
           "QwenPlaceholders", "TimestampText", "lookup_token_id", "patch_times", "temporal_patches", "video_layout"]


@runtime_checkable
class Placeholders(Protocol):
    """An image-token convention: the token ids an image of a given patch grid expands to. One
    that also counts from the picture's size as shown has an `image_detail` ("tiles",
    "unpadded", "canvas"), and the packer hands `tokens_for` and `num_tokens` that detail after
    the grid. One that takes pictures of some sizings only may say so with a
    `check_spec(spec)`, which the packer calls as it is made (a `ConfigurationError` refuses)."""

    merge_size: int

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    def tokens_for(self, rows: int, cols: int) -> np.ndarray: ...

    def num_tokens(self, rows: int, cols: int) -> int: ...


def lookup_token_id(tokenizer: Any, token: str) -> int:
    """The id of a special token by its string, for a transformers tokenizer, a `tokenizers.Tokenizer`,
    a mistral-common tokenizer, or the `tokenizer_id` that `Pipeline.tokenize` takes (a tokenizer.json,
    a directory holding one, a hub id), so a recipe names its tokenizer once; raises
    ConfigurationError if the vocabulary lacks it."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(os.fspath(tokenizer)).tokenizer
    found = None
    if hasattr(tokenizer, "instruct_tokenizer"):  # mistral_common MistralTokenizer
        tokenizer = tokenizer.instruct_tokenizer.tokenizer
    if hasattr(tokenizer, "get_special_token"):  # mistral_common Tekkenizer / SentencePieceTokenizer
        try:
            found = tokenizer.get_special_token(token)
        except Exception:  # noqa: BLE001 - it raises on unknown tokens; we name the token below
            found = None
    elif hasattr(tokenizer, "convert_tokens_to_ids"):  # transformers
        found = tokenizer.convert_tokens_to_ids(token)
        unk = getattr(tokenizer, "unk_token_id", None)
        if found is not None and unk is not None and found == unk and token != getattr(tokenizer, "unk_token", None):
            found = None
    elif hasattr(tokenizer, "token_to_id"):  # tokenizers.Tokenizer
        found = tokenizer.token_to_id(token)
    else:
        raise ConfigurationError(f"cannot look up token ids in a {type(tokenizer).__name__}")
    if found is None:
        raise ConfigurationError(f"the tokenizer has no token {token!r}; is it the model's tokenizer?")
    return int(found)


def _check_grid(rows: int, cols: int, merge: int) -> None:
    if rows < 1 or cols < 1 or rows % merge or cols % merge:
        raise ValueError(f"a {rows}x{cols} patch grid is not a whole number of {merge}x{merge} merged cells")


_NOT_IDS = ("merge_size", "video_timestamps", "text_before", "text_after", "tile_names", "row_end", "last_row_end",
            "video_frame", "video_frame_tokens", "video_newline", "global_tile")
"""A convention's settings that are no token ids."""


class _GridTokens:
    """What the conventions share: the merge check and one read-only array per grid, built once."""

    merge_size: int
    _cache: dict

    def __post_init__(self) -> None:
        object.__setattr__(self, "merge_size", check_count(self.merge_size, f"{type(self).__name__}: merge_size"))
        for name in self._id_fields():
            if getattr(self, name) is not None:  # an optional id left out (QwenPlaceholders.video_pad)
                object.__setattr__(self, name, check_token_id(getattr(self, name), f"{type(self).__name__}: {name}"))
        # The packer places and masks images by position, but the model finds an image's slots
        # by id: a row break, start or end sharing the slot id is one more slot than there are
        # patches, and two shared structural ids cannot be told apart. Nothing downstream can.
        if len(set(self.token_ids)) < len(self.token_ids):
            given = ", ".join(f"{name}={getattr(self, name)}" for name in self._id_fields()
                              if getattr(self, name) is not None)
            raise ConfigurationError(f"{type(self).__name__}: the placeholder ids must be distinct, got {given}")

    @classmethod
    def _id_fields(cls) -> tuple[str, ...]:
        return tuple(each.name for each in fields(cls) if each.init and each.name not in _NOT_IDS)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every id the convention places. The model finds an image's slots by these ids, so a
        text token holding one would be taken for part of an image (see the packer)."""
        return tuple(getattr(self, name) for name in self._id_fields() if getattr(self, name) is not None)

    def tokens_for(self, rows: int, cols: int, *detail) -> np.ndarray:
        """int32 placeholder ids for an image of rows x cols patches (read-only, cached); a
        convention with an `image_detail` is handed that detail too, and keys its cache by it."""
        key = (rows, cols, *detail)
        cached = self._cache.get(key)
        if cached is None:
            _check_grid(rows, cols, self.merge_size)
            cached = self._build(rows, cols, *detail)
            cached.flags.writeable = False
            self._cache[key] = cached
        return cached

    def num_tokens(self, rows: int, cols: int, *detail) -> int:
        """How many ids `tokens_for` writes: its cached array's length, where a convention has no
        arithmetic of its own (the tiled ones, whose text between tiles varies)."""
        return len(self.tokens_for(rows, cols, *detail))

    def _build(self, rows: int, cols: int, *detail) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class PixtralPlaceholders(_GridTokens):
    """Pixtral (mistral-common) convention: one row of `[IMG]` per merged row of the image, each
    row closed by `[IMG_BREAK]` except the last, which is closed by `[IMG_END]` instead.

    An image of rows x cols patches gives (rows/m) * (cols/m + 1) tokens.
    """

    img_id: int
    break_id: int
    end_id: int
    merge_size: int = 1
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, merge_size: int = 1, img: str = "[IMG]",
                       img_break: str = "[IMG_BREAK]", img_end: str = "[IMG_END]") -> PixtralPlaceholders:
        return cls(lookup_token_id(tokenizer, img), lookup_token_id(tokenizer, img_break),
                   lookup_token_id(tokenizer, img_end), merge_size)

    def num_tokens(self, rows: int, cols: int) -> int:
        m = self.merge_size
        _check_grid(rows, cols, m)
        return (rows // m) * (cols // m + 1)

    def _build(self, rows: int, cols: int) -> np.ndarray:
        m = self.merge_size
        grid = np.full((rows // m, cols // m + 1), self.img_id, dtype=np.int32)
        grid[:, -1] = self.break_id
        grid[-1, -1] = self.end_id
        return grid.reshape(-1)


@dataclass(frozen=True)
class PadPlaceholders(_GridTokens):
    """One pad id per merged cell, between an optional start and end id, the whole optionally
    between ids of plain text: the convention of models whose processor writes an image as a run
    of one token, as many as the vision tower gives features. LLaVA: `<image>` per feature, no
    start or end (`from_tokenizer(tokenizer, pad="<image>")`, merge_size 1, e.g. 576 at 336 px in
    14 px patches); Gemma 3: `gemma3(tokenizer)`; Gemma 4: `gemma4(tokenizer)`.

    `text_before` and `text_after` are ids of ordinary text around each image (Gemma 3's `\\n\\n`),
    encoded apart from the caption: they are no placeholder ids (a caption may hold them) and,
    as the rest of the block, learn nothing. An image of rows x cols patches gives
    rows * cols / merge_size**2 pads, plus the start, end and text ids.

    `frame_pad` is the pad of a video's frames, each taken as an image, where the model takes them
    apart from pictures by it (Gemma 4's `<|video|>`): a frame's block is a picture's with
    `frame_pad` for `pad` (`frame_tokens_for`).
    """

    pad: int
    start: int | None = None
    end: int | None = None
    merge_size: int = 1
    text_before: tuple[int, ...] = ()
    text_after: tuple[int, ...] = ()
    frame_pad: int | None = field(default=None, metadata={"fingerprint": "when set"})
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_text_ids(self, ("text_before", "text_after"))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, pad: str, start: str | None = None, end: str | None = None,
                       merge_size: int = 1, text_before: str = "", text_after: str = "") -> PadPlaceholders:
        """The ids looked up in the model's tokenizer; `text_before` / `text_after` encoded by it."""
        def ids_of(text: str) -> tuple[int, ...]:
            return _plain_ids(_tokenizers_tokenizer(tokenizer), text) if text else ()

        def id_of(token: str | None) -> int | None:
            return None if token is None else lookup_token_id(tokenizer, token)

        return cls(lookup_token_id(tokenizer, pad), id_of(start), id_of(end), merge_size, ids_of(text_before),
                   ids_of(text_after))

    @classmethod
    def gemma3(cls, tokenizer: Any) -> PadPlaceholders:
        """Gemma 3's convention as its processor writes an image: `\\n\\n<start_of_image>`, 256
        `<image_soft_token>` (a 64x64 patch grid pooled 4x4: `ImageSpec.gemma3()`),
        `<end_of_image>\\n\\n`."""
        return cls.from_tokenizer(tokenizer, pad="<image_soft_token>", start="<start_of_image>", end="<end_of_image>",
                                  merge_size=4, text_before="\n\n", text_after="\n\n")

    @classmethod
    def paligemma(cls, tokenizer: Any) -> PadPlaceholders:
        """PaliGemma's convention as its processor writes a picture: one `<image>` per patch, nothing
        around them (`ImageSpec.paligemma()`); the picture goes before the BOS
        (`image_position="before_text"`)."""
        return cls.from_tokenizer(tokenizer, pad="<image>")

    @classmethod
    def gemma4(cls, tokenizer: Any, *, video: bool = False) -> PadPlaceholders:
        """Gemma 4's convention as its processor writes an image: the tokenizer's `boi_token`, one
        `image_token` per soft token (a cell of 3x3 patches: `ImageSpec.gemma4()`), its
        `eoi_token`; the three read from the tokenizer, as the processor reads them. With
        `video=True`, a video's frames as its processor writes them, each a picture's block of
        `<|video|>` (`frame_pad`; pair with `FrameText.gemma4(tokenizer)` for the time before
        each frame)."""
        names = _named_tokens(tokenizer, ("image_token", "boi_token", "eoi_token"), "PadPlaceholders.gemma4",
                              "Gemma 4's does; give from_tokenizer(tokenizer, pad=, start=, end=, merge_size=3)")
        placeholders = cls.from_tokenizer(tokenizer, pad=names["image_token"], start=names["boi_token"],
                                          end=names["eoi_token"], merge_size=3)
        if not video:
            return placeholders
        return dataclasses.replace(placeholders, frame_pad=lookup_token_id(tokenizer, GEMMA4_VIDEO_TOKEN))

    def num_tokens(self, rows: int, cols: int) -> int:
        m = self.merge_size
        _check_grid(rows, cols, m)
        frame = (self.start is not None) + (self.end is not None) + len(self.text_before) + len(self.text_after)
        return rows * cols // (m * m) + frame

    def _build(self, rows: int, cols: int) -> np.ndarray:
        m = self.merge_size
        pads = [self.pad] * (rows * cols // (m * m))
        start = [] if self.start is None else [self.start]
        end = [] if self.end is None else [self.end]
        return np.array([*self.text_before, *start, *pads, *end, *self.text_after], dtype=np.int32)

    def frame_tokens_for(self, rows: int, cols: int) -> np.ndarray:
        """int32 ids of a video's frame of rows x cols patches taken as an image (read-only,
        cached): a picture's block with `frame_pad` for its pads; needs `frame_pad`."""
        key = ("frame", rows, cols)
        cached = self._cache.get(key)
        if cached is None:
            if self.frame_pad is None:
                raise ConfigurationError("PadPlaceholders: a frame's block needs frame_pad (Gemma 4's <|video|> id)")
            cached = self.tokens_for(rows, cols).copy()
            cached[cached == self.pad] = self.frame_pad
            cached.flags.writeable = False
            self._cache[key] = cached
        return cached


def _named_tokens(tokenizer: Any, names: tuple[str, ...], caller: str, advice: str) -> dict[str, str]:
    """{name: token} of the image tokens a model's tokenizer names as attributes (its processor
    reads them so), in the order of `names`; a named error for those it does not name."""
    tokens = {name: getattr(tokenizer, name, None) for name in names}
    missing = [name for name, token in tokens.items() if not isinstance(token, str)]
    if missing:
        raise ConfigurationError(f"{caller}: the tokenizer names no {', '.join(missing)} ({advice})")
    return tokens


GEMMA4_VIDEO_TOKEN = "<|video|>"
"""The token Gemma 4's processor writes a video's frames with (it adds it to the tokenizer)."""


def _check_text_ids(convention, names: tuple[str, ...]) -> None:
    """Each of `names`, ids of plain text a convention writes around its images, as a tuple of
    token ids holding no placeholder id (the model would take that text for part of an image)."""
    for name in names:
        object.__setattr__(convention, name, _text_ids(convention, name, getattr(convention, name)))


def _text_ids(convention, name: str, value) -> tuple[int, ...]:
    """`value`, ids of plain text the convention's `name` holds, as a tuple of token ids, refused
    where it holds a placeholder id."""
    kind = type(convention).__name__
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigurationError(f"{kind}: {name} must be a sequence of token ids, got {value!r}")
    ids = tuple(check_token_id(i, f"{kind}: {name}") for i in value)
    if set(ids) & set(convention.token_ids):
        raise ConfigurationError(f"{kind}: {name} {ids} holds a placeholder id: the model would take that text "
                                 f"for part of an image")
    return ids


@dataclass(frozen=True)
class Idefics3Placeholders(_GridTokens):
    """Idefics3's convention (Idefics3, SmolVLM, SmolVLM2) for `ImageSpec(fit="split")` images,
    and square `fit="fixed"` ones (not split: each one tile), as `Idefics3Processor` writes it. A
    picture cut into rows x columns tiles is, tile by tile in raster order,
    `<fake_token_around_image><row_r_col_c>` and a tile's `<image>` run, each row of tiles ended by
    `\n`, the last by `\n\n`, then its global image; a picture not cut is its global image alone:
    `<fake_token_around_image><global-img>`, the `<image>` run, `<fake_token_around_image>`. A tile
    of cols x cols patches gives (cols / merge_size)**2 `<image>` (the processor's
    `image_seq_len`: 64 for SmolVLM's 512 px tiles, 169 for Idefics3's 364 px).

    `tile_names[r][c]` is the id of `<row_{r+1}_col_{c+1}>`; `row_end` and `last_row_end` are
    ids of ordinary text (the tokenizer's `\n` and `\n\n`: between two special tokens the
    processor's text is encoded apart), as `PadPlaceholders`' `text_before`. The pixels' stack
    does not say how its tiles were arranged, so the packer works it out from the size of the
    picture as shown, written beside them (`record["pixels_sizes"]`, by `decode_images`), and
    asks `tokens_for(rows, cols, tiles)`.
    """

    image: int
    fake_around: int
    global_image: int
    tile_names: tuple[tuple[int, ...], ...]
    merge_size: int = 1
    row_end: tuple[int, ...] = ()
    last_row_end: tuple[int, ...] = ()
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    image_detail = "tiles"
    """What the packer hands `tokens_for` and `num_tokens` beside the grid: each image's (rows,
    columns) of tiles (`split_arrangement` of the picture's size as shown)."""

    def __post_init__(self) -> None:
        names = self.tile_names
        if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__") or not names or any(
                isinstance(row, (str, bytes)) or not hasattr(row, "__iter__") for row in names) \
                or len({len(row) for row in names}) != 1 or not len(names[0]):
            raise ConfigurationError(f"Idefics3Placeholders: tile_names must be rows of <row_r_col_c> ids, one per "
                                     f"column, got {names!r}")
        object.__setattr__(self, "tile_names", tuple(
            tuple(check_token_id(i, "Idefics3Placeholders: tile_names") for i in row) for row in names))
        super().__post_init__()
        _check_text_ids(self, ("row_end", "last_row_end"))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, merge_size: int, image: str = "<image>",
                       fake_around: str = "<fake_token_around_image>", global_image: str = "<global-img>",
                       tile_name: str = "<row_{row}_col_{column}>", max_tiles_per_side: int = 6,
                       row_end: str = "\n", last_row_end: str = "\n\n") -> Idefics3Placeholders:
        """The ids looked up in the model's tokenizer (its `<row_r_col_c>` up to 6 x 6, as
        Idefics3's processor looks them up); `row_end` and `last_row_end` encoded by it."""
        side = range(1, check_count(max_tiles_per_side, "Idefics3Placeholders: max_tiles_per_side") + 1)
        names = tuple(tuple(lookup_token_id(tokenizer, tile_name.format(row=r, column=c)) for c in side) for r in side)
        text = _tokenizers_tokenizer(tokenizer)
        return cls(lookup_token_id(tokenizer, image), lookup_token_id(tokenizer, fake_around),
                   lookup_token_id(tokenizer, global_image), names, merge_size, _plain_ids(text, row_end),
                   _plain_ids(text, last_row_end))

    @property
    def token_ids(self) -> tuple[int, ...]:
        return (self.image, self.fake_around, self.global_image, *(i for row in self.tile_names for i in row))

    @property
    def max_tiles(self) -> tuple[int, int]:
        """The most (rows, columns) of tiles it has names for."""
        return len(self.tile_names), len(self.tile_names[0])

    def num_tokens(self, rows: int, cols: int, tiles: tuple[int, int] = (1, 1)) -> int:
        per_tile = self._per_tile(rows, cols, tiles)
        tile_rows, tile_columns = tiles
        whole = per_tile + 3
        if tile_rows * tile_columns == 1:
            return whole
        return (tile_rows * tile_columns * (per_tile + 2) + (tile_rows - 1) * len(self.row_end)
                + len(self.last_row_end) + whole)

    def _build(self, rows: int, cols: int, tiles: tuple[int, int] = (1, 1)) -> np.ndarray:
        """The ids of a stack of rows x cols patches cut as `tiles` (rows, columns)."""
        run = [self.image] * self._per_tile(rows, cols, tiles)
        tile_rows, tile_columns = tiles
        ids = []
        if tile_rows * tile_columns > 1:
            for r in range(tile_rows):
                for c in range(tile_columns):
                    ids += [self.fake_around, self.tile_names[r][c], *run]
                ids += self.row_end if r < tile_rows - 1 else self.last_row_end
        ids += [self.fake_around, self.global_image, *run, self.fake_around]
        return np.array(ids, dtype=np.int32)

    def _per_tile(self, rows: int, cols: int, tiles: tuple[int, int]) -> int:
        """`<image>` per tile (`_tile_cells`), within the tiles the convention has names for."""
        per_tile = _tile_cells(rows, cols, tiles, self.merge_size)
        (tile_rows, tile_columns), (most_rows, most_columns) = tiles, self.max_tiles
        if tile_rows * tile_columns > 1 and (tile_rows > most_rows or tile_columns > most_columns):
            raise ValueError(f"{tile_rows}x{tile_columns} tiles: the convention names at most "
                             f"{most_rows}x{most_columns}")
        return per_tile


def _tile_cells(rows: int, cols: int, tiles: tuple[int, int], merge: int) -> int:
    """A tile's merged cells, once the stack of rows x cols patches is checked to be `tiles`
    (rows, columns) of square tiles and, past one, their global tile (Idefics3's and Llama 4's
    stacks)."""
    _check_grid(rows, cols, merge)
    tile_rows, tile_columns = tiles
    count = tile_rows * tile_columns
    if tile_rows < 1 or tile_columns < 1 or rows != cols * (count + (count > 1)):
        raise ValueError(f"a {rows}x{cols} patch stack is not {tile_rows}x{tile_columns} square tiles "
                         f"of {cols}x{cols} patches and their global tile")
    return (cols // merge) ** 2


@dataclass(frozen=True)
class LlavaNextPlaceholders(_GridTokens):
    """LLaVA-NeXT's convention (LLaVA-1.6; transformers' `LlavaNextProcessor`; LLaVA-OneVision's
    `LlavaOnevisionProcessor`) for `ImageSpec(fit="anyres")` pictures: a run of `<image>`, one per
    feature the model keeps. Those are the base image's (a tile's features, squared: CLIP's class
    token dropped, the "default" feature strategy of the LLaVA-NeXT checkpoints; SigLIP has none),
    the features of its tiles that remain once the rows or columns only the padding filled are
    dropped (and, for OneVision, shrunk to its cap), and one newline feature after each of their
    rows. What remains depends on the picture's size as shown, which the stack of tiles does not
    hold: the packer works it out from the size written beside the pixels
    (`record["pixels_sizes"]`) as (tiles, features a side of a tile, feature rows, feature
    columns) (`anyres_features`) and asks `tokens_for(rows, cols, that)`; its rows carry the sizes
    as `image_sizes`, by which the model unpads. A picture of a record holding several, padded to
    one tile (`ImageSpec(several_pad=...)`, LLaVA-OneVision's), is (0 tiles, features a side, 0,
    0): its features and one newline.

    With `video_pad` (`<video>`'s id), a decoded video is one block, as LLaVA-OneVision's and
    LLaVA-NeXT-Video's processors write it (`llava_onevision`, `llava_next_video`):
    `video_frame_tokens` `<video>` for each frame (the frame's features pooled), then one more
    where `video_newline` (OneVision's newline feature after the whole video). Every frame is one
    size, `video_frame` (rows, cols) patches: the model pools a fixed grid of features, so a frame
    of another size is refused rather than counted wrong. The packer writes the frames to the
    rows' `video_*` fields, one frame a temporal patch.
    """

    image: int
    merge_size: int = 1
    video_pad: int | None = field(default=None, metadata={"fingerprint": "when set"})
    video_frame: tuple[int, int] | None = field(default=None, metadata={"fingerprint": "when set"})
    video_frame_tokens: int | None = field(default=None, metadata={"fingerprint": "when set"})
    video_newline: bool | None = field(default=None, metadata={"fingerprint": "when set"})
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    image_detail = "unpadded"
    """What the packer hands `tokens_for` and `num_tokens` beside the grid: (tiles, features a
    side of a tile, feature rows, feature columns) of the picture's features the model keeps
    (`anyres_features`)."""

    video_temporal_patch = 1
    """Frames per temporal patch of its video layout: each frame is pooled on its own."""

    def __post_init__(self) -> None:
        super().__post_init__()
        video = (self.video_frame, self.video_frame_tokens, self.video_newline)
        if self.video_pad is None:
            if video != (None, None, None):
                raise ConfigurationError("LlavaNextPlaceholders: video_frame, video_frame_tokens and video_newline "
                                         "lay out a video's block: give video_pad (<video>'s id) too")
            return
        frame = self.video_frame
        if isinstance(frame, (str, bytes)) or not hasattr(frame, "__len__") or len(frame) != 2:
            raise ConfigurationError(f"LlavaNextPlaceholders: video_frame must be a frame's (rows, cols) in patches, "
                                     f"got {frame!r}")
        object.__setattr__(self, "video_frame", tuple(check_count(n, "LlavaNextPlaceholders: video_frame")
                                                      for n in frame))
        object.__setattr__(self, "video_frame_tokens",
                           check_count(self.video_frame_tokens, "LlavaNextPlaceholders: video_frame_tokens"))
        if self.video_newline is None:
            object.__setattr__(self, "video_newline", False)
        if not isinstance(self.video_newline, bool):
            raise ConfigurationError(f"LlavaNextPlaceholders: video_newline must be True or False, "
                                     f"got {self.video_newline!r}")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, image: str = "<image>", merge_size: int = 1) -> LlavaNextPlaceholders:
        return cls(lookup_token_id(tokenizer, image), merge_size)

    @classmethod
    def llava_onevision(cls, tokenizer: Any, *, image: str = "<image>", video: str = "<video>",
                        frame_patches: int = 24, frame_features: int = 27) -> LlavaNextPlaceholders:
        """LLaVA-OneVision's pictures and videos as its processor writes them: a picture as
        `from_tokenizer` does, a video as `<video>` once per pooled feature of every frame and
        once for the newline after them. A frame is `VideoSpec.llava_onevision()`'s, 384 px:
        `frame_patches` a side in the pixels' 16 px patches, `frame_features` a side in SigLIP's
        14 px ones, which the model pools to ceil(27 / 2) = 14 a side, 196 `<video>` a frame."""
        pooled = -(-check_count(frame_features, "LlavaNextPlaceholders: frame_features") // 2)
        return cls(lookup_token_id(tokenizer, image), video_pad=lookup_token_id(tokenizer, video),
                   video_frame=(frame_patches, frame_patches), video_frame_tokens=pooled**2, video_newline=True)

    @classmethod
    def llava_next_video(cls, tokenizer: Any, *, image: str = "<image>", video: str = "<video>",
                         frame_patches: int = 24) -> LlavaNextPlaceholders:
        """LLaVA-NeXT-Video's pictures and videos as its processor writes them: a picture as
        `from_tokenizer` does, a video as `<video>` once per pooled feature of every frame, no
        newline. A frame is `VideoSpec.llava_next_video()`'s, 336 px: `frame_patches` a side in
        CLIP's 14 px patches, which the model average-pools 2x2, (24 // 2)**2 = 144 `<video>` a
        frame."""
        side = check_count(frame_patches, "LlavaNextPlaceholders: frame_patches")
        return cls(lookup_token_id(tokenizer, image), video_pad=lookup_token_id(tokenizer, video),
                   video_frame=(side, side), video_frame_tokens=(side // 2) ** 2, video_newline=False)

    def num_tokens(self, rows: int, cols: int, kept: tuple[int, int, int, int]) -> int:
        _check_grid(rows, cols, self.merge_size)
        tiles, side, feature_rows, feature_columns = kept
        if tiles < 0 or rows != cols * (1 + tiles):
            raise ValueError(f"a {rows}x{cols} patch stack is not a base image and {tiles} tiles of {cols}x{cols} "
                             f"patches")
        if tiles == 0:  # one of a record's several pictures (`several_features`): its features and a newline
            return side**2 + 1
        return side**2 + feature_rows * (feature_columns + 1)

    def _build(self, rows: int, cols: int, kept: tuple[int, int, int, int]) -> np.ndarray:
        """The ids of a stack of rows x cols patches whose tiles keep `kept` features."""
        return np.full(self.num_tokens(rows, cols, kept), self.image, dtype=np.int32)

    @property
    def video_patches_per_token(self) -> float:
        """Patches a video token stands for: a frame's over its tokens (for the memory budget)."""
        rows, cols = self.video_frame
        return rows * cols / self.video_frame_tokens

    def video_num_tokens(self, temporal: int, rows: int, cols: int, times: tuple[float, ...] = ()) -> int:
        """Tokens of a video of `temporal` frames (one a temporal patch), each rows x cols patches."""
        if (rows, cols) != self.video_frame:
            frame_rows, frame_cols = self.video_frame
            raise ValueError(f"a video's frames of {rows}x{cols} patches; the model pools frames of "
                             f"{frame_rows}x{frame_cols} (size them with VideoSpec.llava_onevision() or "
                             f"llava_next_video(), or give video_frame their grid)")
        return temporal * self.video_frame_tokens + int(self.video_newline)

    def video_tokens_for(self, temporal: int, rows: int, cols: int, times: tuple[float, ...] = ()) -> np.ndarray:
        """int32 placeholder ids of such a video (read-only, cached by its frame count)."""
        key = ("video", temporal, rows, cols)
        cached = self._cache.get(key)
        if cached is None:
            cached = np.full(self.video_num_tokens(temporal, rows, cols), self.video_pad, dtype=np.int32)
            cached.flags.writeable = False
            self._cache[key] = cached
        return cached


@dataclass(frozen=True)
class Llama4Placeholders(_GridTokens):
    """Llama 4's convention (`Llama4Processor`) for `ImageSpec(fit="canvas")` pictures:
    `<|image_start|>`, then past one tile each row of tiles, a tile's `<|patch|>` run after run
    with `<|tile_x_separator|>` between them and `<|tile_y_separator|>` after the row, then
    `<|image|>` and the global tile's (or the only tile's) run, `<|image_end|>`. A tile of
    cols x cols patches gives (cols / merge_size)**2 `<|patch|>` (144 for 336 px tiles of 14 px
    patches, pixel-shuffled 2x2). The stack of tiles does not say its canvas's rows and columns,
    so the packer works them out from the size of the picture as shown, written beside the pixels
    (`record["pixels_sizes"]`), and asks `tokens_for(rows, cols, (tile rows, tile columns))`.
    """

    image_start: int
    image: int
    image_end: int
    patch: int
    tile_x_separator: int
    tile_y_separator: int
    merge_size: int = 2
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    image_detail = "canvas"
    """What the packer hands `tokens_for` and `num_tokens` beside the grid: the (rows, columns) of
    tiles of the picture's canvas (`canvas_arrangement` of its size as shown)."""

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, merge_size: int = 2) -> Llama4Placeholders:
        """The ids of Llama 4's six image tokens, looked up in the model's tokenizer."""
        names = ("<|image_start|>", "<|image|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>",
                 "<|tile_y_separator|>")
        return cls(*(lookup_token_id(tokenizer, name) for name in names), merge_size)

    def _build(self, rows: int, cols: int, tiles: tuple[int, int] = (1, 1)) -> np.ndarray:
        """The ids of a stack of rows x cols patches cut as `tiles` (rows, columns)."""
        run = [self.patch] * _tile_cells(rows, cols, tiles, self.merge_size)
        tile_rows, tile_columns = tiles
        ids = [self.image_start]
        if tile_rows * tile_columns > 1:
            for _ in range(tile_rows):
                for column in range(tile_columns):
                    ids += run + ([self.tile_x_separator] if column < tile_columns - 1 else [])
                ids.append(self.tile_y_separator)
        ids += [self.image, *run, self.image_end]
        return np.array(ids, dtype=np.int32)


@dataclass(frozen=True)
class AyaVisionPlaceholders(_GridTokens):
    """Aya Vision's convention (`AyaVisionProcessor`) for `ImageSpec.aya_vision()` pictures
    (InternVL's tiles, `fit="tiles"`, with their thumbnail): `<|START_OF_IMG|>`, then past one
    tile each tile's name (`TILE_1`, `TILE_2`, ...) and its `<|IMG_PATCH|>` run, then
    `TILE_GLOBAL` and the thumbnail's (or the only tile's) run, `<|END_OF_IMG|>`. A tile of
    cols x cols patches gives (cols / merge_size)**2 `<|IMG_PATCH|>` (169 for 364 px tiles of
    14 px patches, pixel-shuffled 2x2); the stack's tiles are its rows over its columns, so the
    grid alone gives the count.

    `tile_names[k]` are the ids of `TILE_{k+1}` and `global_tile` those of `TILE_GLOBAL`, text the
    tokenizer encodes between two special tokens, as `Idefics3Placeholders`' `row_end` is: no
    placeholder ids, learning nothing as the rest of the block.
    """

    start: int
    patch: int
    end: int
    tile_names: tuple[tuple[int, ...], ...]
    global_tile: tuple[int, ...]
    merge_size: int = 2
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        names = self.tile_names
        if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__") or not names:
            raise ConfigurationError(f"AyaVisionPlaceholders: tile_names must be the ids of TILE_1, TILE_2, ..., "
                                     f"got {names!r}")
        super().__post_init__()
        object.__setattr__(self, "tile_names", tuple(_text_ids(self, "tile_names", row) for row in names))
        _check_text_ids(self, ("global_tile",))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, merge_size: int = 2, max_tiles: int = 12) -> AyaVisionPlaceholders:
        """The ids of Aya Vision's image tokens looked up in the model's tokenizer, and its tiles'
        names up to `max_tiles` (the processor's `max_patches`) and `TILE_GLOBAL` encoded by it."""
        text = _tokenizers_tokenizer(tokenizer)
        count = check_count(max_tiles, "AyaVisionPlaceholders: max_tiles")
        names = tuple(_plain_ids(text, f"TILE_{k}") for k in range(1, count + 1))
        return cls(lookup_token_id(tokenizer, "<|START_OF_IMG|>"), lookup_token_id(tokenizer, "<|IMG_PATCH|>"),
                   lookup_token_id(tokenizer, "<|END_OF_IMG|>"), names, _plain_ids(text, "TILE_GLOBAL"), merge_size)

    def check_spec(self, spec) -> None:
        """Refuse pictures of another sizing than InternVL's tiles with their thumbnail (the last
        tile is written as the global one), or of more tiles than it has names for."""
        _check_thumbnailed_tiles(self, spec, "ImageSpec.aya_vision()", len(self.tile_names))

    def _build(self, rows: int, cols: int) -> np.ndarray:
        """The ids of a stack of rows x cols patches: its square tiles, the last the thumbnail."""
        run = [self.patch] * _square_tile_cells(rows, cols, self.merge_size)
        tiles = rows // cols
        if tiles - 1 > len(self.tile_names):
            raise ValueError(f"{tiles} tiles (the thumbnail among them): the convention names at most "
                             f"{len(self.tile_names)} and the global tile")
        ids = [self.start]
        if tiles > 1:
            for name in self.tile_names[: tiles - 1]:
                ids += [*name, *run]
        ids += [*self.global_tile, *run, self.end]
        return np.array(ids, dtype=np.int32)


@dataclass(frozen=True)
class Cohere2VisionPlaceholders(_GridTokens):
    """Command A Vision's convention (`Cohere2VisionProcessor`) for `ImageSpec.command_a_vision()`
    pictures (tiles with their thumbnail, `fit="tiles"`): the tokenizer's `boi_token`, then each
    tile's `image_token` run followed by `img_line_break_token`, the thumbnail's last, then its
    `eoi_token`. A tile of cols x cols patches gives (cols / merge_size)**2 image tokens (256 for
    512 px tiles of 16 px patches, pixel-shuffled 2x2); the stack's rows over its columns give the
    tiles, so the grid alone gives the count.
    """

    boi: int
    image: int
    line_break: int
    eoi: int
    merge_size: int = 2
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, merge_size: int = 2) -> Cohere2VisionPlaceholders:
        """The four tokens the tokenizer names (`boi_token`, `image_token`, `img_line_break_token`,
        `eoi_token`), as the processor reads them, looked up in it."""
        tokens = _named_tokens(tokenizer, ("boi_token", "image_token", "img_line_break_token", "eoi_token"),
                               "Cohere2VisionPlaceholders.from_tokenizer", "Command A Vision's does")
        return cls(*(lookup_token_id(tokenizer, token) for token in tokens.values()), merge_size)

    def check_spec(self, spec) -> None:
        """Refuse pictures of another sizing than tiles with their thumbnail."""
        _check_thumbnailed_tiles(self, spec, "ImageSpec.command_a_vision()")

    def _build(self, rows: int, cols: int) -> np.ndarray:
        """The ids of a stack of rows x cols patches: its square tiles, the last the thumbnail."""
        run = [*[self.image] * _square_tile_cells(rows, cols, self.merge_size), self.line_break]
        return np.array([self.boi, *run * (rows // cols), self.eoi], dtype=np.int32)


def _check_thumbnailed_tiles(convention, spec, preset: str, most: int | None = None) -> None:
    """Refuse a spec whose pictures are not `fit="tiles"` tiles with their thumbnail (which a
    convention writing the last tile as the global one needs), or, given `most`, of more tiles."""
    if spec.fit != "tiles" or not spec.thumbnail or (most is not None and spec.tiles[1] > most):
        within = "" if most is None else f", of at most {most} tiles"
        raise ConfigurationError(f"pack_multimodal: {type(convention).__name__} writes fit='tiles' pictures with "
                                 f"their thumbnail{within} ({preset}), got fit={spec.fit!r}, tiles={spec.tiles!r}, "
                                 f"thumbnail={spec.thumbnail!r}")


def _square_tile_cells(rows: int, cols: int, merge: int) -> int:
    """A tile's merged cells in a stack of rows x cols patches of square tiles; refuses a stack
    that is not whole square tiles."""
    if rows % cols:
        raise ValueError(f"a {rows}x{cols} patch stack is not square tiles of {cols}x{cols} patches")
    return (cols // merge) ** 2


QWEN_TEMPORAL_PATCH = 2
"""Frames per temporal patch of Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers (their
processors' `temporal_patch_size`): a video's frames are taken in pairs, the last repeated when
their count is odd, as the processors do."""


def temporal_patches(frames: int, per: int = QWEN_TEMPORAL_PATCH) -> int:
    """The temporal patches of a video of `frames` frames, `per` frames each (Qwen's pairs by
    default), a last short one filled by repeating its last frame, as Qwen's processors do."""
    return -(-frames // per)


def video_layout(placeholders) -> bool:
    """Whether the convention lays a video out as one block of its own (`QwenPlaceholders`,
    `LlavaNextPlaceholders` given `video_pad`) rather than as one image per frame."""
    return getattr(placeholders, "video_pad", None) is not None


def _plain_ids(tokenizer, text: str) -> tuple[int, ...]:
    """`text`'s ids from a `tokenizers.Tokenizer`, without special tokens and without the padding
    a hub tokenizer.json may switch on (a stamp or a `\\n\\n` padded to a fixed length is not
    what the model's processor writes)."""
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return tuple(i for i, kept in zip(encoding.ids, encoding.attention_mask) if kept)


def _tokenizers_tokenizer(tokenizer: Any):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, a `tokenizers.Tokenizer`,
    or a `tokenizer_id` (`lookup_token_id`'s forms but mistral-common's, whose Qwen has none)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(os.fspath(tokenizer)).tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # transformers' fast tokenizers
    if not (hasattr(backend, "to_str") and hasattr(backend, "encode")):
        raise ConfigurationError(f"time stamps and text around images are encoded with a tokenizers or transformers "
                                 f"fast tokenizer, got {type(tokenizer).__name__}")
    return backend


@dataclass(frozen=True)
class _EncodedText:
    """Text the placeholders write beside their tokens, encoded with the model's tokenizer:
    `tokenizer_digest` (SHA-256 of the tokenizer's JSON) is what the recipe's fingerprint holds of
    it, so a checkpoint resumes only with the ids it packed. Encodings are cached per text,
    read-only; safe to share between lanes' packers (a race encodes a text twice, to the same ids)."""

    tokenizer_digest: str
    _tokenizer: Any = field(default=None, repr=False, compare=False, hash=False, kw_only=True)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self._tokenizer is None:
            raise ConfigurationError(f"{type(self).__name__}: make it with {type(self).__name__}.from_tokenizer(tokenizer)")

    @staticmethod
    def _backend_and_digest(tokenizer: Any) -> tuple[Any, str]:
        """The `tokenizers.Tokenizer` behind `tokenizer` and its digest."""
        backend = _tokenizers_tokenizer(tokenizer)
        return backend, sha256(backend.to_str().encode()).hexdigest()

    def _encoded(self, text: str) -> np.ndarray:
        """int32 ids of `text` (read-only, cached by it)."""
        cached = self._cache.get(text)
        if cached is None:
            cached = np.array(_plain_ids(self._tokenizer, text), dtype=np.int32)
            cached.flags.writeable = False
            self._cache[text] = cached
        return cached


@dataclass(frozen=True)
class TimestampText(_EncodedText):
    """Qwen3-VL's time stamps: the text `template.format(seconds=t)` before each temporal patch of
    a video, encoded with the model's tokenizer (`<0.5 seconds>` at Qwen3-VL's default, t the
    mean time of the patch's two frames). The model learns a frame's time from this text, not
    from its rotary positions.

    Make one with `from_tokenizer`; the tokenizer and the cache (one entry for each tenth of a
    second a dataset's clips reach) as `_EncodedText`'s.
    """

    template: str = "<{seconds:.1f} seconds>"

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            self.template.format(seconds=0.5)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigurationError(f"TimestampText: template {self.template!r} must format one float named "
                                     f"'seconds': {exc!r}") from None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, template: str = "<{seconds:.1f} seconds>") -> TimestampText:
        """Stamps encoded with `tokenizer` (a transformers fast tokenizer, a `tokenizers.Tokenizer`
        or a `tokenizer_id`)."""
        backend, digest = cls._backend_and_digest(tokenizer)
        return cls(digest, template, _tokenizer=backend)

    def ids(self, seconds: float) -> np.ndarray:
        """int32 ids of the stamp of a patch at `seconds` (read-only, cached by its text)."""
        text = self.template.format(seconds=seconds)
        ids = self._encoded(text)
        if not len(ids):
            raise ConfigurationError(f"TimestampText: the tokenizer encodes the stamp {text!r} as no tokens")
        return ids


def patch_times(frame_times: np.ndarray) -> tuple[float, ...]:
    """The time of each temporal patch of a video whose frames are shown at `frame_times`: the
    mean of its two frames' times (an odd count's last frame paired with itself), as Qwen3-VL's
    processor stamps it."""
    times = [float(t) for t in frame_times]
    if len(times) % QWEN_TEMPORAL_PATCH:
        times.append(times[-1])
    last = QWEN_TEMPORAL_PATCH - 1
    return tuple((times[i] + times[i + last]) / 2 for i in range(0, len(times), QWEN_TEMPORAL_PATCH))


@dataclass(frozen=True)
class QwenPlaceholders(_GridTokens):
    """Qwen2-VL convention: `<|vision_start|>`, then one `<|image_pad|>` per merged cell
    (rows * cols / merge_size**2 of them), then `<|vision_end|>`.

    With `video_pad` (`<|video_pad|>`'s id), a decoded video is laid out as Qwen2-VL and
    Qwen2.5-VL lay out a video, one block for the whole clip: `<|vision_start|>`, one
    `<|video_pad|>` per merged cell of every temporal patch (frame pair), `<|vision_end|>`; the
    packer writes its frames to the rows' `video_*` fields. With `video_timestamps` too, as
    Qwen3-VL lays it out: each temporal patch a block of its own, `<|vision_start|>`, its cells'
    `<|video_pad|>`, `<|vision_end|>`, after its time stamp's text (`TimestampText`). Without
    `video_pad`, a video's frames are packed as images, one block each.
    """

    vision_start: int
    image_pad: int
    vision_end: int
    merge_size: int = 2
    video_pad: int | None = field(default=None, metadata={"fingerprint": "when set"})
    video_timestamps: TimestampText | None = field(default=None, metadata={"fingerprint": "when set"})
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    video_temporal_patch = QWEN_TEMPORAL_PATCH
    """Frames per temporal patch of its video layout: the tower takes them in pairs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.video_timestamps is not None:
            if not isinstance(self.video_timestamps, TimestampText):
                raise ConfigurationError(f"QwenPlaceholders: video_timestamps must be a TimestampText, "
                                         f"got {self.video_timestamps!r}")
            if self.video_pad is None:
                raise ConfigurationError("QwenPlaceholders: video_timestamps stamp the temporal patches of Qwen's "
                                         "video layout: give video_pad (<|video_pad|>'s id) too")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, merge_size: int = 2, vision_start: str = "<|vision_start|>",
                       image_pad: str = "<|image_pad|>", vision_end: str = "<|vision_end|>",
                       video_pad: str | None = None, video_timestamps: bool = False) -> QwenPlaceholders:
        """The ids looked up in the model's tokenizer; `video_pad="<|video_pad|>"` lays videos
        out as Qwen2-VL's videos, and `video_timestamps=True` besides as Qwen3-VL's, their stamps
        encoded with this tokenizer (see the class)."""
        stamps = TimestampText.from_tokenizer(tokenizer) if video_timestamps else None
        return cls(lookup_token_id(tokenizer, vision_start), lookup_token_id(tokenizer, image_pad),
                   lookup_token_id(tokenizer, vision_end), merge_size,
                   None if video_pad is None else lookup_token_id(tokenizer, video_pad), stamps)

    @classmethod
    def glm4v(cls, tokenizer: Any) -> QwenPlaceholders:
        """GLM-4.1V's and GLM-4.5V's images, as their chat template and processor write them:
        `<|begin_of_image|>`, one `<|image|>` per merged cell, `<|end_of_image|>`; Qwen2-VL's
        layout under other names, its M-RoPE positions the same (`mrope=True`). Their videos,
        each frame after its time, are not laid out here."""
        return cls.from_tokenizer(tokenizer, vision_start="<|begin_of_image|>", image_pad="<|image|>",
                                  vision_end="<|end_of_image|>")

    def num_tokens(self, rows: int, cols: int) -> int:
        m = self.merge_size
        _check_grid(rows, cols, m)
        return rows * cols // (m * m) + 2

    def _build(self, rows: int, cols: int) -> np.ndarray:
        tokens = np.full(self.num_tokens(rows, cols), self.image_pad, dtype=np.int32)
        tokens[0], tokens[-1] = self.vision_start, self.vision_end
        return tokens

    @property
    def video_patches_per_token(self) -> float:
        """Patches a video token stands for: a merged cell in both frames of its temporal patch
        (for the memory budget)."""
        return self.merge_size**2 * QWEN_TEMPORAL_PATCH

    def video_num_tokens(self, temporal: int, rows: int, cols: int, times: tuple[float, ...] = ()) -> int:
        """Tokens of a video of `temporal` temporal patches, each rows x cols patches; with
        `video_timestamps`, `times` are the patches' (`patch_times`), each a block with its stamp."""
        cells = self.num_tokens(rows, cols) - 2
        if self.video_timestamps is None:
            return temporal * cells + 2
        return temporal * (cells + 2) + sum(len(self.video_timestamps.ids(t)) for t in self._stamped(temporal, times))

    def video_tokens_for(self, temporal: int, rows: int, cols: int, times: tuple[float, ...] = ()) -> np.ndarray:
        """int32 placeholder ids of such a video (read-only); needs `video_pad`. Cached by grid
        without stamps; with them built each time (every clip's times differ)."""
        if self.video_timestamps is not None:
            frame = self._video_block(1, rows, cols)
            stamp_ids = self.video_timestamps.ids
            return np.concatenate([part for t in self._stamped(temporal, times) for part in (stamp_ids(t), frame)])
        return self._video_block(temporal, rows, cols)

    def _video_block(self, temporal: int, rows: int, cols: int) -> np.ndarray:
        """`<|vision_start|>`, the cells of `temporal` patches, `<|vision_end|>` (read-only, cached)."""
        key = ("video", temporal, rows, cols)
        cached = self._cache.get(key)
        if cached is None:
            if self.video_pad is None:
                raise ConfigurationError("QwenPlaceholders: a video layout needs video_pad (<|video_pad|>'s id)")
            cells = self.num_tokens(rows, cols) - 2
            cached = np.full(temporal * cells + 2, self.video_pad, dtype=np.int32)
            cached[0], cached[-1] = self.vision_start, self.vision_end
            cached.flags.writeable = False
            self._cache[key] = cached
        return cached

    @staticmethod
    def _stamped(temporal: int, times: tuple[float, ...]) -> tuple[float, ...]:
        if len(times) != temporal:
            raise ValueError(f"a video of {temporal} temporal patches needs as many stamp times, got {len(times)}")
        return times
