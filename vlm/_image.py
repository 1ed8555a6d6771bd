"""Image bytes to a uint8 RGB array on a patch grid, with one resize and named failures.

`decode_image` is a pure function of (bytes, spec) for a given Pillow build: the same bytes give the
same pixels on every worker, thread and process. Pillow and pillow-simd share the `PIL` import, so
either works; their resize kernels differ, so pixel digests are only comparable within one build.

Order of work, chosen so that nothing large is allocated before it is known to be wanted:
1. open the header only (no pixel data) and refuse decompression bombs by the header's size;
2. compute the target patch grid from the header's size (`image_grid`);
3. for JPEG and MPO, ask the decoder for a DCT-scaled draft no smaller than `draft_gap` x the
   target (other formats get the same effect from Pillow's integer `reduce` inside the resize);
4. check a PNG's pixel chunks (`_png.check_pixel_data`); decode; convert exotic modes (1, P,
   CMYK, 16-bit, ...) to L, RGB, LA or RGBA;
5. one resize to the target (Pillow premultiplies alpha itself), then composite any alpha on
   `background`, then apply the EXIF orientation; the fits that cut tiles, pad or crop make the
   few further resizes, pads and cuts their models' processors make (`fit` below).

Thread-safety: every function here is safe to call from many threads at once; nothing global is
written once this module is imported (importing it adds one warning filter, see
`_silence_pillows_bomb_warning`). Pillow's own `Image.MAX_IMAGE_PIXELS` guard still applies (see
`ImageSpec`), and its `ImageFile.LOAD_TRUNCATED_IMAGES` switch is read only to be refused (see
`_refuse_load_truncated_images`).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import warnings
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from zephon._errors import ConfigurationError, check_count, check_finite

from . import _png
from ._errors import ImageDecodeError
from ._anyres import (LLAVA_NEXT_PINPOINTS, LLAVA_ONEVISION_PINPOINTS, best_resolution, capped_features, fitted_size,
                      unpadded_features)
from ._area import area_size
from ._canvas import best_canvas, canvas_fitted_size
from ._split import IDEFICS3_MAX_SIDE, split_canvas, split_first_size
from ._split import split_arrangement as _split_arrangement

__all__ = [
    "PILLOW_MAX_IMAGE_PIXELS", "ImageSpec", "decode_image", "image_grid", "import_decoder", "load_rgb", "patchify",
    "CUT_FITS", "SHOWN_SIZE_FITS", "SizedImage", "crop_scaled_size", "decode_image_with_size", "probe_image",
    "probe_image_with_size", "anyres_features", "sizes_field", "split_arrangement", "thin_scaled_up", "tile_arrangement",
    "tile_count", "middle", "canvas_arrangement", "several_features",
]

PILLOW_MAX_IMAGE_PIXELS = 89_478_485
"""Pillow's default `Image.MAX_IMAGE_PIXELS` (about 0.25 GiB of RGB), used as our default refusal size."""


def _silence_pillows_bomb_warning() -> None:
    """Ignore the DecompressionBombWarning `Image.open` gives for a header above Pillow's
    `MAX_IMAGE_PIXELS` (and below twice it, where it raises instead).

    Every such image is refused here anyway, counted as `decompression_bomb` unless
    `max_image_pixels` was raised on purpose; but the warning names the image's pixel count, so
    Python's once-per-message rule printed it once per image size, in every worker: a stderr line
    per large image in a multi-day job. The filter matches only that message from `PIL.Image`
    (which is also what a user's own `Image.open` of such a file in this process would warn),
    and is added once, at import, so no decode changes the filters while other threads read them.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"Image size \(\d+ pixels\) exceeds limit of \d+ pixels",
        category=RuntimeWarning,  # DecompressionBombWarning's base: Pillow is imported only to decode
        module=r"PIL\.Image",
    )


_silence_pillows_bomb_warning()

_RESAMPLE = ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos")
_FITS = ("pixels", "max_side", "fixed", "crop", "pad", "tiles", "split", "anyres", "area", "canvas")
_SIZED_FITS = ("fixed", "crop", "pad", "tiles", "split", "anyres", "canvas")
"""The fits whose images are of `size` (a tile's, with "tiles", "split", "anyres" and "canvas")."""
_TILED_FITS = ("tiles", "split", "anyres", "canvas")
"""The fits whose pixels are tiles stacked top to bottom, one tile wide."""
CUT_FITS = (*_TILED_FITS, "pad")
"""The fits that cut a picture into tiles or pad it, which a video frame is not: FFmpeg resizes a
frame whole, and for fit="crop" its middle is then cut out."""
_SQUARE_TILED_FITS = ("split", "anyres", "canvas")
"""The tiled fits whose models take square tiles only."""
SHOWN_SIZE_FITS = ("split", "anyres", "canvas")
"""The fits whose placeholders are counted from each picture's size as shown (Idefics3's tiles,
named by row and column; LLaVA-NeXT's features, unpadded by it; Llama 4's canvas, its tiles
separated by row and column), which decoding writes beside the pixels (`sizes_field`)."""

# EXIF orientation tag (0x0112) value -> the transpose that displays the image upright.
_EXIF_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE",
                   6: "ROTATE_270", 7: "TRANSVERSE", 8: "ROTATE_90"}
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")

# Formats the JPEG decoder reads, so that it can decode a draft. An MPO (multi-picture JPEG, as
# phones and 3D cameras write) is a JPEG followed by more JPEGs; Pillow opens it as its own
# format, a JpegImageFile subclass that decodes the first picture, as we do: its draft is that
# picture's draft as a JPEG.
_DRAFTABLE = ("JPEG", "MPO")

ONEVISION_SEVERAL_PAD = (127, 127, 127)
"""The colour LLaVA-OneVision's processor pads each picture of a document holding several with:
its `image_mean` (SigLIP's 0.5 a channel) times 255, rounded down."""

GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)
"""The soft tokens a picture may become that Gemma 4's image processor takes (`max_soft_tokens`)."""


@dataclass(frozen=True)
class ImageSpec:
    """How an image becomes pixels on a patch grid.

    The output height and width are multiples of `patch_size * merge_size` (a "grid cell": what one
    placeholder token stands for after merging). `fit` names the sizing rule, each a model
    family's processor's:

    - `fit="pixels"` (default; the Qwen2-VL convention): each side is rounded to the nearest
      multiple of a cell; if the area leaves [min_pixels, max_pixels] the image is scaled by the
      square root of the excess, flooring (too big) or ceiling (too small) to whole cells. Extreme
      aspect ratios that cannot meet `max_pixels` with whole cells are narrowed on the long side;
      where that leaves the bounds (a window a few cells wide), the grid within them nearest the
      image's aspect ratio is taken. The bounds must hold a whole number of cells between them
      (refused otherwise).
      With `min_side` (GLM-4V's processor: one cell), a picture with a side shorter than it is
      first scaled up, both sides by the factor that brings that side to it (the products
      truncated), and the rule applied to that size; the picture is still resized once.
    - `fit="max_side"` (the mistral-common / Pixtral convention): the longest side is scaled down
      (never up) to `max_side`, then each side is rounded *up* to whole cells. `min_pixels` and
      `max_pixels` are not used.
    - `fit="fixed"` (SigLIP's, Gemma 3's, PaliGemma's image processors): every image is resized to
      `size` (height, width), whole cells, whatever its aspect ratio; the bounds are not used. With
      `longest_edge` (Idefics3's and SmolVLM's processors without image splitting:
      `ImageSpec.idefics3(split=False)`), first the longer side to `longest_edge` as "split" does,
      then to `size`: two resizes, the second from the first, as the processor makes them.
    - `fit="crop"` (CLIP's, LLaVA-1.5's image processors): the shorter side is scaled to the
      longer side of `size`, the longer side in proportion (rounded down), and the middle `size`
      cut out (`crop_scaled_size`).
    - `fit="pad"` (LLaVA-1.5's training code, transformers' `LlavaImageProcessor(do_pad=True)`):
      the upright image, transparency composited on `background`, is padded to a square of its
      longer side with `pad_color` (centred, the odd pixel after), then resized to `size`.
    - `fit="tiles"` (InternVL's dynamic tiling): the image is resized to the arrangement of
      `size` tiles, columns x rows, between `tiles` = (min, max) of them, nearest its aspect ratio
      (`tile_arrangement`), cut into those tiles, and, where there is more than one, followed by
      the whole image resized to one tile (`thumbnail`). The pixels are the tiles stacked top to
      bottom in raster order, the thumbnail last: one tile wide, so each tile's patches are
      consecutive in `pixel_values` (`image_tensors(..., tile=)` cuts them apart again). With
      `tile_rule="least_scale"` (Command A Vision's, `Cohere2VisionImageProcessor`) the
      arrangement is instead the one that scales the image up least, or down least where every
      one shrinks it (`tile_arrangement`).
    - `fit="split"` (Idefics3's image splitting: Idefics3, SmolVLM, SmolVLM2): the image's longer
      side is resized to `longest_edge` (up or down), then each side up to whole square `size`
      tiles (`vlm._split`); past one tile the tiles are cut in raster order and followed by the
      whole resized to one tile (the model's "global" image), stacked as "tiles" stacks them. The
      size of each picture as shown is written beside the pixels (`record["pixels_sizes"]`), for
      the placeholders' text names each tile by its row and column (`Idefics3Placeholders`), and
      the stack does not say how many rows and columns there were (`split_arrangement`).
    - `fit="anyres"` (LLaVA-NeXT's): of `pinpoints`, canvases (height, width) of whole square
      `size` tiles, the one that keeps most of the picture's pixels and wastes least
      (`vlm._anyres`); the picture is resized into it with its aspect ratio kept, padded to it,
      centred, with black, and cut into its tiles; the whole picture stretched to one tile (the
      "base" image) goes first, then the tiles in raster order, stacked one tile wide. The size of
      each picture as shown is written beside the pixels, as with "split": the model unpads its
      features by it, and takes it (`image_sizes`). `tile_features` is the features a side of a
      tile gives where that is not its cells (LLaVA-OneVision's SigLIP: 27 of 14 px in 384 px, which
      the pixels carry as 24 patches of 16), and `anyres_max` LLaVA-OneVision's cap on the kept
      features, about that many tiles' worth (`ImageSpec.llava_onevision()`). With `several_pad`
      (LLaVA-OneVision's multi-image rule), each picture of a record holding several is instead
      padded to a square of that colour and resized to one tile, as fit="pad" does
      (`for_pictures`).

    - `fit="area"` (Gemma 4's): the image scaled, its aspect ratio kept, up or down, to
      `max_pixels`, each side rounded down to whole cells; a side that rounds to nothing is one
      cell and the other the image's aspect ratio in whole cells (`vlm._area`). `min_pixels` is
      not used.
    - `fit="canvas"` (Llama 4's): of the canvases of 1 to `tiles[1]` square `size` tiles, the
      one that scales the picture up least, or down least where none scales it up (`vlm._canvas`);
      the picture is resized into it with its aspect ratio kept (up to no more than one tile a
      side), put at its top left, padded with black, and cut into its tiles in raster order,
      followed past one tile by the whole picture resized to one tile (the global tile), stacked
      one tile wide. The size of each picture as shown is written beside the pixels, as with
      "split": the placeholders' text separates the tiles by row and column
      (`Llama4Placeholders`).

    `draft` trades a little fidelity for a lot of speed on large downscales: JPEGs (MPOs too, the
    multi-picture JPEGs of phones and 3D cameras) are decoded at 1/2, 1/4 or 1/8 scale by the
    decoder itself, and any image is first reduced by an integer factor, both never below
    `draft_gap` x the target size (Pillow's `thumbnail` does the same).

    `max_image_pixels` refuses images whose header announces more pixels than this, before any
    pixel is decoded ("decompression_bomb"). Pillow refuses on its own above twice its global
    `Image.MAX_IMAGE_PIXELS`; to accept larger images raise both.
    """

    patch_size: int = 16
    merge_size: int = 1
    min_pixels: int = 32 * 32
    max_pixels: int = 512 * 512
    fit: Literal["pixels", "max_side", "fixed", "crop", "pad", "tiles", "split", "anyres", "area", "canvas"] = "pixels"
    max_side: int = 1024
    max_image_pixels: int = PILLOW_MAX_IMAGE_PIXELS
    resample: str = "bicubic"
    background: tuple[int, int, int] = (255, 255, 255)
    draft: bool = True
    draft_gap: float = 2.0
    exif_transpose: bool = True
    size: tuple[int, int] | None = field(default=None, metadata={"fingerprint": "when set"})
    tiles: tuple[int, int] | None = field(default=None, metadata={"fingerprint": "when set"})
    thumbnail: bool | None = field(default=None, metadata={"fingerprint": "when set"})
    pad_color: tuple[int, int, int] | None = field(default=None, metadata={"fingerprint": "when set"})
    longest_edge: int | None = field(default=None, metadata={"fingerprint": "when set"})
    pinpoints: tuple[tuple[int, int], ...] | None = field(default=None, metadata={"fingerprint": "when set"})
    tile_features: int | None = field(default=None, metadata={"fingerprint": "when set"})
    anyres_max: int | None = field(default=None, metadata={"fingerprint": "when set"})
    min_side: int | None = field(default=None, metadata={"fingerprint": "when set"})
    several_pad: tuple[int, int, int] | None = field(default=None, metadata={"fingerprint": "when set"})
    tile_rule: str | None = field(default=None, metadata={"fingerprint": "when set"})

    def __post_init__(self) -> None:
        counts = {"patch_size": 1, "merge_size": 1, "max_image_pixels": 1, "min_pixels": 0, "max_pixels": 0}
        if self.fit == "max_side":
            counts["max_side"] = 1
        for name, least in counts.items():
            object.__setattr__(self, name, check_count(getattr(self, name), f"ImageSpec: {name}", least))
        if self.fit not in _FITS:
            raise ConfigurationError(f"ImageSpec: fit must be one of {_FITS}, got {self.fit!r}")
        self._check_size()
        self._check_tiles()
        self._check_split()
        self._check_pinpoints()
        if self.min_side is not None:
            if self.fit != "pixels":
                raise ConfigurationError(f"ImageSpec: min_side is fit='pixels''s, got fit={self.fit!r}")
            object.__setattr__(self, "min_side", check_count(self.min_side, "ImageSpec: min_side"))
        self._check_pad_color()
        self._check_several_pad()
        if self.fit == "pixels" and not 0 <= self.min_pixels <= self.max_pixels:
            raise ConfigurationError(f"ImageSpec: need 0 <= min_pixels <= max_pixels, "
                                     f"got {self.min_pixels} and {self.max_pixels}")
        if self.fit in ("pixels", "area") and self.max_pixels < self.cell**2:
            raise ConfigurationError(f"ImageSpec: max_pixels={self.max_pixels} is below one grid cell "
                                     f"({self.cell}x{self.cell} pixels)")
        if self.fit == "pixels" and -(-self.min_pixels // self.cell**2) > self.max_pixels // self.cell**2:
            # A grid is a whole number of cells, so no image could meet both bounds; `image_grid`
            # would grow it for min_pixels past max_pixels.
            raise ConfigurationError(f"ImageSpec: no whole number of {self.cell}x{self.cell} grid cells has an "
                                     f"area in [min_pixels={self.min_pixels}, max_pixels={self.max_pixels}]")
        for name in ("draft", "exif_transpose"):  # "no" would act as True does
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"ImageSpec: {name} must be True or False, got {getattr(self, name)!r}")
        if self.resample not in _RESAMPLE:
            raise ConfigurationError(f"ImageSpec: resample must be one of {_RESAMPLE}, got {self.resample!r}")
        if not check_finite(self.draft_gap, "ImageSpec: draft_gap") >= 1.0:
            raise ConfigurationError(f"ImageSpec: draft_gap must be >= 1, got {self.draft_gap}")
        if len(self.background) != 3 or not all(0 <= int(check_finite(c, "ImageSpec: background")) <= 255 for c in self.background):
            raise ConfigurationError(f"ImageSpec: background must be three values in 0..255, got {self.background}")

    def _check_size(self) -> None:
        """`size` is fit="fixed"'s and "crop"'s (a tile's with "tiles"), and there whole cells: a
        fixed grid the placeholders divide."""
        if (self.fit in _SIZED_FITS) != (self.size is not None):
            raise ConfigurationError(f"ImageSpec: size (height, width) is given with fit in {_SIZED_FITS} and only "
                                     f"then, got fit={self.fit!r} and size={self.size!r}")
        if self.size is None:
            return
        if isinstance(self.size, (str, bytes)) or len(self.size) != 2:
            raise ConfigurationError(f"ImageSpec: size must be (height, width), got {self.size!r}")
        sides = tuple(check_count(side, "ImageSpec: size") for side in self.size)
        if any(side % self.cell for side in sides):
            raise ConfigurationError(f"ImageSpec: size {sides} is not whole {self.cell}x{self.cell} grid cells "
                                     f"(patch_size {self.patch_size} x merge_size {self.merge_size})")
        if self.fit in _SQUARE_TILED_FITS and sides[0] != sides[1]:
            raise ConfigurationError(f"ImageSpec: fit={self.fit!r} cuts square tiles, got size={sides}")
        object.__setattr__(self, "size", sides)

    def _check_pad_color(self) -> None:
        """`pad_color` is fit="pad"'s, and there given: a model's processor pads with its mean."""
        if (self.fit == "pad") != (self.pad_color is not None):
            raise ConfigurationError(f"ImageSpec: pad_color (r, g, b) is given with fit='pad' and only then, got "
                                     f"fit={self.fit!r} and pad_color={self.pad_color!r}")
        if self.pad_color is None:
            return
        if isinstance(self.pad_color, (str, bytes)) or len(self.pad_color) != 3 or not all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in self.pad_color):
            raise ConfigurationError(f"ImageSpec: pad_color must be three ints in 0..255, got {self.pad_color!r}")
        object.__setattr__(self, "pad_color", tuple(self.pad_color))

    def _check_several_pad(self) -> None:
        """`several_pad` is fit="anyres"'s, a colour (r, g, b) when given."""
        if self.several_pad is None:
            return
        if self.fit != "anyres":
            raise ConfigurationError(f"ImageSpec: several_pad is fit='anyres''s, got fit={self.fit!r}")
        colour = self.several_pad
        if isinstance(colour, (str, bytes)) or len(colour) != 3 or not all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in colour):
            raise ConfigurationError(f"ImageSpec: several_pad must be three ints in 0..255, got {colour!r}")
        object.__setattr__(self, "several_pad", tuple(colour))

    def for_pictures(self, count: int) -> ImageSpec:
        """The spec each of a record's `count` pictures is sized with: this one, or where the
        record holds several and `several_pad` is set, one that pads each to a square of that
        colour and resizes it to one tile (LLaVA-OneVision's processor's multi-image rule)."""
        if count < 2 or self.several_pad is None:
            return self
        return dataclasses.replace(self, fit="pad", pad_color=self.several_pad, several_pad=None, pinpoints=None,
                                   tile_features=None, anyres_max=None)

    def _check_tiles(self) -> None:
        """`tiles` (min, max) and `thumbnail` are fit="tiles"'s, (1, 12) and True unless given, and
        fit="canvas"'s, (1, 16) and True unless given, and there from 1 tile with its global tile
        (Llama 4's canvases)."""
        if self.fit not in ("tiles", "canvas"):
            if self.tiles is not None or self.thumbnail is not None or self.tile_rule is not None:
                raise ConfigurationError(f"ImageSpec: tiles, thumbnail and tile_rule are fit='tiles''s (tiles and "
                                         f"thumbnail fit='canvas''s too), got fit={self.fit!r}")
            return
        tiles = ((1, 12) if self.fit == "tiles" else (1, 16)) if self.tiles is None else self.tiles
        if isinstance(tiles, (str, bytes)) or len(tiles) != 2:
            raise ConfigurationError(f"ImageSpec: tiles must be (min, max), got {tiles!r}")
        least, most = (check_count(n, "ImageSpec: tiles") for n in tiles)
        if least > most:
            raise ConfigurationError(f"ImageSpec: tiles must be (min, max) with min <= max, got {tiles!r}")
        thumbnail = True if self.thumbnail is None else self.thumbnail
        if not isinstance(thumbnail, bool):
            raise ConfigurationError(f"ImageSpec: thumbnail must be True or False, got {thumbnail!r}")
        if self.tile_rule not in (None, "least_scale"):
            raise ConfigurationError(f"ImageSpec: tile_rule must be None (InternVL's: the nearest aspect ratio) or "
                                     f"'least_scale' (Command A Vision's), got {self.tile_rule!r}")
        if self.fit == "canvas" and (least != 1 or not thumbnail or self.tile_rule is not None):
            raise ConfigurationError(f"ImageSpec: fit='canvas' takes every canvas from one tile, followed by the "
                                     f"global tile (Llama 4's): give tiles=(1, max) and thumbnail=True, got "
                                     f"tiles={tiles!r}, thumbnail={thumbnail!r}")
        object.__setattr__(self, "tiles", (least, most))
        object.__setattr__(self, "thumbnail", thumbnail)

    def _check_split(self) -> None:
        """`longest_edge` is fit="split"'s (4 tiles unless given, as Idefics3's processor) or, when
        given, fit="fixed"'s first resize; at most `IDEFICS3_MAX_SIDE`."""
        if self.fit != "split" and (self.fit != "fixed" or self.longest_edge is None):
            if self.longest_edge is not None:
                raise ConfigurationError(f"ImageSpec: longest_edge is fit='split''s and fit='fixed''s, "
                                         f"got fit={self.fit!r}")
            return
        longest = 4 * self.size[0] if self.longest_edge is None else self.longest_edge
        longest = check_count(longest, "ImageSpec: longest_edge")
        if longest > IDEFICS3_MAX_SIDE:
            raise ConfigurationError(f"ImageSpec: longest_edge must be at most {IDEFICS3_MAX_SIDE} (Idefics3's "
                                     f"processor scales every picture within it), got {longest}")
        object.__setattr__(self, "longest_edge", longest)

    def _check_pinpoints(self) -> None:
        """`pinpoints` are fit="anyres"'s (LLaVA-NeXT's five unless given): (height, width) canvases
        of whole square `size` tiles; so are `tile_features` and `anyres_max`, counts when given."""
        if self.fit != "anyres":
            for name in ("pinpoints", "tile_features", "anyres_max"):
                if getattr(self, name) is not None:
                    raise ConfigurationError(f"ImageSpec: {name} are fit='anyres''s, got fit={self.fit!r}")
            return
        for name in ("tile_features", "anyres_max"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_count(getattr(self, name), f"ImageSpec: {name}"))
        tile = self.size[0]
        given = LLAVA_NEXT_PINPOINTS if self.pinpoints is None else self.pinpoints
        if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
            raise ConfigurationError(f"ImageSpec: pinpoints must be (height, width) canvases, got {given!r}")
        canvases = []
        for canvas in given:
            if isinstance(canvas, (str, bytes)) or not hasattr(canvas, "__len__") or len(canvas) != 2:
                raise ConfigurationError(f"ImageSpec: pinpoints must be (height, width) canvases, got {given!r}")
            sides = tuple(check_count(side, "ImageSpec: pinpoints") for side in canvas)
            if any(side % tile for side in sides):
                raise ConfigurationError(f"ImageSpec: pinpoint {sides} is not whole {tile} px tiles")
            canvases.append(sides)
        if not canvases:
            raise ConfigurationError("ImageSpec: pinpoints must name at least one canvas")
        object.__setattr__(self, "pinpoints", tuple(canvases))

    @property
    def cell(self) -> int:
        """Side in pixels of what one placeholder token covers: patch_size * merge_size."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch row in `pixel_values`: patch_size * patch_size * 3."""
        return self.patch_size * self.patch_size * 3

    @property
    def max_decoded_pixels(self) -> int:
        """The most pixels an image decodes to under this spec, for the memory budget
        (`zephon._memory`): `size`'s, at most `tiles[1]` tiles and the thumbnail of it with
        "tiles" and "canvas", the tiles of a `longest_edge` square and the global image with
        "split", the base image and the largest canvas with "anyres", a square a cell past
        `max_side` with "max_side", else `max_pixels`."""
        if self.fit in ("tiles", "canvas"):
            return self.size[0] * self.size[1] * (self.tiles[1] + self.thumbnail)
        if self.fit == "split":
            return self.size[0] * self.size[1] * (math.ceil(self.longest_edge / self.size[0]) ** 2 + 1)
        if self.fit == "anyres":
            return self.size[0] * self.size[1] + max(h * w for h, w in self.pinpoints)
        if self.size is not None:
            return self.size[0] * self.size[1]
        if self.fit == "max_side":
            return (self.max_side + self.cell) ** 2
        return self.max_pixels

    @classmethod
    def pixtral(cls, max_side: int = 1024, patch_size: int = 16, merge_size: int = 1, **kwargs) -> ImageSpec:
        """Pixtral-12B sizing as mistral-common encodes it (longest side <= 1024, 16 px patches)."""
        return cls(patch_size=patch_size, merge_size=merge_size, fit="max_side", max_side=max_side, **kwargs)

    @classmethod
    def gemma3(cls, **kwargs) -> ImageSpec:
        """Gemma 3 sizing: every image 896x896 (SigLIP's 14 px patches, 64x64 of them, which the
        model pools 4x4 into 256 tokens), resized bilinearly, as `Gemma3ImageProcessor` does
        without pan and scan; pair with `PadPlaceholders.gemma3`."""
        return cls(**{"patch_size": 14, "merge_size": 4, "fit": "fixed", "size": (896, 896), "resample": "bilinear",
                      **kwargs})

    @classmethod
    def paligemma(cls, size: int = 224, **kwargs) -> ImageSpec:
        """PaliGemma's sizing (PaliGemma 1 and 2): every image `size` x `size` (224, 448 or 896, as
        the checkpoint), resized bicubically as its `SiglipImageProcessor` does, one token per 14
        px patch (256 at 224 px); pair with `PadPlaceholders.paligemma`."""
        return cls(**{"patch_size": 14, "fit": "fixed", "size": (size, size), "resample": "bicubic", **kwargs})

    @classmethod
    def internvl(cls, **kwargs) -> ImageSpec:
        """InternVL's dynamic tiling (InternVL 2.5, 3 and 3.5): 448x448 tiles of 14 px patches, 1 to
        12 of them nearest the image's aspect ratio, and a thumbnail, resized bicubically as
        `GotOcr2ImageProcessor(crop_to_patches=True)` does; each tile's 32x32 patches become 256
        tokens (merge_size 2, the model's pixel shuffle). Pair with `PadPlaceholders` of
        `<IMG_CONTEXT>` between `<img>` and `</img>`."""
        return cls(**{"patch_size": 14, "merge_size": 2, "fit": "tiles", "size": (448, 448), "tiles": (1, 12),
                      "thumbnail": True, "resample": "bicubic", **kwargs})

    @classmethod
    def aya_vision(cls, **kwargs) -> ImageSpec:
        """Aya Vision's tiling (`GotOcr2ImageProcessor(crop_to_patches=True)` at its checkpoints'
        settings): InternVL's rule on 364x364 tiles of 14 px patches, 1 to 12 of them and a
        thumbnail, resized bicubically; each tile's 26x26 patches become 169 tokens (merge_size 2,
        the model's pixel shuffle). Pair with `AyaVisionPlaceholders.from_tokenizer(tokenizer)`."""
        return cls.internvl(**{"size": (364, 364), **kwargs})

    @classmethod
    def command_a_vision(cls, **kwargs) -> ImageSpec:
        """Command A Vision's tiling (`Cohere2VisionImageProcessor`): the arrangement of at most 12
        tiles of 512 px that scales the picture least (`tile_rule="least_scale"`), resized to it
        bicubically and cut, and past one tile the thumbnail; SigLIP2's 16 px patches, each tile's
        32x32 becoming 256 tokens (merge_size 2, the model's pixel shuffle). Pair with
        `Cohere2VisionPlaceholders.from_tokenizer(tokenizer)`."""
        return cls.internvl(**{"patch_size": 16, "size": (512, 512), "tile_rule": "least_scale", **kwargs})

    @classmethod
    def idefics3(cls, *, split: bool = True, **kwargs) -> ImageSpec:
        """Idefics3's image splitting (Idefics3-8B): the longer side to 1456, 364x364 tiles of
        14 px patches, each 26x26 patches becoming 169 tokens (merge_size 2, the model's pixel
        shuffle), resized with Lanczos as `Idefics3ImageProcessor` does. `split=False` is the
        processor's `do_image_splitting=False`: the longer side to 1456, then the whole picture to
        one tile (fit="fixed"). Pair with `Idefics3Placeholders.from_tokenizer(tokenizer,
        merge_size=2)`."""
        return cls(**{"patch_size": 14, "merge_size": 2, "fit": "split" if split else "fixed", "size": (364, 364),
                      "longest_edge": 1456, "resample": "lanczos", **kwargs})

    @classmethod
    def smolvlm(cls, *, split: bool = True, **kwargs) -> ImageSpec:
        """SmolVLM's (SmolVLM-256M and -500M, SmolVLM2): Idefics3's splitting with the longer side
        to 2048 and 512x512 tiles of 16 px patches, each 32x32 patches becoming 64 tokens
        (merge_size 4); `split=False` as `idefics3`'s. Pair with
        `Idefics3Placeholders.from_tokenizer(tokenizer, merge_size=4)`."""
        return cls(**{"patch_size": 16, "merge_size": 4, "fit": "split" if split else "fixed", "size": (512, 512),
                      "longest_edge": 2048, "resample": "lanczos", **kwargs})

    @classmethod
    def llava_next(cls, **kwargs) -> ImageSpec:
        """LLaVA-NeXT's (LLaVA-1.6's) anyres sizing: 336x336 tiles of CLIP's 14 px patches (24x24
        features each), on the canvas of `LLAVA_NEXT_PINPOINTS` that fits the picture best, the base
        image first, resized bicubically as `LlavaNextImageProcessor` does. Pair with
        `LlavaNextPlaceholders.from_tokenizer(tokenizer)`."""
        return cls(**{"patch_size": 14, "fit": "anyres", "size": (336, 336), "resample": "bicubic", **kwargs})

    @classmethod
    def gemma4(cls, max_soft_tokens: int = 280, **kwargs) -> ImageSpec:
        """Gemma 4's sizing (`Gemma4ImageProcessor`): the picture scaled to `max_soft_tokens`
        cells of 48 px (16 px patches the tower pools 3x3), its aspect ratio kept, resized
        bicubically; each cell one soft token. `max_soft_tokens` is one of the processor's
        70, 140, 280, 560 or 1120. Pair with `PadPlaceholders.gemma4(tokenizer)`."""
        if max_soft_tokens not in GEMMA4_SOFT_TOKENS:
            raise ConfigurationError(f"ImageSpec.gemma4: max_soft_tokens must be one of {GEMMA4_SOFT_TOKENS} (Gemma 4's "
                                     f"processor takes no other), got {max_soft_tokens!r}")
        return cls(**{"patch_size": 16, "merge_size": 3, "fit": "area", "max_pixels": max_soft_tokens * 48 * 48,
                      "resample": "bicubic", **kwargs})

    @classmethod
    def llava_onevision(cls, **kwargs) -> ImageSpec:
        """LLaVA-OneVision's anyres_max_9: 384x384 tiles on the canvas of
        `LLAVA_ONEVISION_PINPOINTS` (1x1 to 6x6 tiles) that fits the picture best, the base image
        first, resized bicubically as `LlavaOnevisionImageProcessor` does; SigLIP makes 27x27
        features of a tile (its 14 px patches; the pixels travel as 16 px ones, 384 being no whole
        number of 14), and the kept features are shrunk to about 9 tiles' worth. Each picture of a
        record holding several is padded to a square of `ONEVISION_SEVERAL_PAD` and resized to one
        tile, as the processor sizes a document's pictures where it holds several. Pair with
        `LlavaNextPlaceholders.from_tokenizer(tokenizer)`."""
        return cls(**{"patch_size": 16, "fit": "anyres", "size": (384, 384), "pinpoints": LLAVA_ONEVISION_PINPOINTS,
                      "tile_features": 27, "anyres_max": 9, "several_pad": ONEVISION_SEVERAL_PAD, "resample": "bicubic",
                      **kwargs})

    @classmethod
    def llama4(cls, **kwargs) -> ImageSpec:
        """Llama 4's (Scout, Maverick; `Llama4ImageProcessor`): the picture fitted, its aspect
        ratio kept, into the canvas of 1 to 16 tiles of 336 px that scales it least, padded at
        its bottom and right, the tiles and past one the global tile, resized bilinearly; 14 px
        patches, each tile's 24x24 becoming 144 tokens (merge_size 2, the model's pixel shuffle).
        Pair with `Llama4Placeholders.from_tokenizer(tokenizer)`."""
        return cls(**{"patch_size": 14, "merge_size": 2, "fit": "canvas", "size": (336, 336), "tiles": (1, 16),
                      "resample": "bilinear", **kwargs})

    @classmethod
    def qwen2_vl(cls, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280, **kwargs) -> ImageSpec:
        """Qwen2-VL sizing: 14 px patches merged 2x2, area within [min_pixels, max_pixels]."""
        return cls(patch_size=14, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels, fit="pixels", **kwargs)

    @classmethod
    def glm4v(cls, shortest_edge: int = 112 * 112, longest_edge: int = 28 * 28 * 15000, **kwargs) -> ImageSpec:
        """GLM-4.1V's and GLM-4.5V's sizing (`Glm4vImageProcessor`): Qwen2-VL's 14 px patches
        merged 2x2, resized bicubically, a picture with a side under one cell scaled up first
        (`min_side=28`). `shortest_edge` and `longest_edge` are the processor's `size`, which
        bound a picture's pixels times its two temporal frames: the spec's bounds are half of
        them. Pair with `QwenPlaceholders.glm4v(tokenizer)`."""
        return cls(**{"patch_size": 14, "merge_size": 2, "fit": "pixels", "min_pixels": shortest_edge // 2,
                      "max_pixels": longest_edge // 2, "min_side": 28, "resample": "bicubic", **kwargs})

    @classmethod
    def qwen3_vl(cls, min_pixels: int = 256 * 256, max_pixels: int = 4096 * 4096, **kwargs) -> ImageSpec:
        """Qwen3-VL sizing: 16 px patches merged 2x2 (32 px cells), area within [min_pixels, max_pixels].

        transformers (5.24) has no image processor of Qwen3-VL's own: its auto map gives `qwen3_vl`
        `Qwen2VLImageProcessor`, whose class defaults are Qwen2-VL's (14 px, CLIP mean/std, 56·56 to
        28·28·1280 pixels), and the checkpoint's `preprocessor_config.json` sets Qwen3-VL's. So:

        - `patch_size=16`, `merge_size=2`: `Qwen3VLVisionConfig`'s defaults (`patch_size`,
          `spatial_merge_size`; its `temporal_patch_size` is 2), which `Qwen3VLVideoProcessor`'s
          class attributes repeat;
        - `min_pixels=65536`, `max_pixels=16777216`: the `size` (`shortest_edge`, `longest_edge`)
          of the Qwen/Qwen3-VL checkpoints' `preprocessor_config.json`, which loads them into that
          processor (transformers itself states no image pixel bounds for Qwen3-VL).

        The spec decides the grid, hence the placeholder count, and yields uint8 pixels: the
        normalisation (mean = std = 0.5 per channel: the checkpoints' `image_mean`/`image_std`,
        transformers' `IMAGENET_STANDARD_MEAN`/`_STD`, as `Qwen3VLVideoProcessor` uses) and the
        doubling in time (`temporal_patch_size=2`) are the processor's, in rows of 2·3·16·16 = 1536
        values: the model's vision tower takes those, from `decode_images(processor=...)`.
        """
        return cls(patch_size=16, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels, fit="pixels", **kwargs)


def image_grid(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """(rows, cols) of patches the image of this size is resized to; both multiples of merge_size."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    cell = spec.cell
    if spec.fit in ("fixed", "crop", "pad"):
        return spec.size[0] // spec.patch_size, spec.size[1] // spec.patch_size
    if spec.fit in _TILED_FITS:
        return tile_count(height, width, spec) * spec.size[0] // spec.patch_size, spec.size[1] // spec.patch_size
    if spec.fit == "area":
        rows, cols = area_size(height, width, cell, spec.max_pixels)
        return rows // spec.patch_size, cols // spec.patch_size
    if spec.fit == "max_side":
        ratio = max(height, width) / spec.max_side
        if ratio > 1:
            height, width = max(round(height / ratio), 1), max(round(width / ratio), 1)
        rows, cols = -(-height // cell), -(-width // cell)
        return rows * spec.merge_size, cols * spec.merge_size

    if spec.min_side is not None:  # GLM-4V's: thin pictures scaled up first
        height, width = thin_scaled_up(height, width, spec.min_side)
    # Sides in cells. Python's round (half to even) on purpose: it is the convention's.
    h_cells, w_cells = round(height / cell), round(width / cell)
    area = h_cells * w_cells * cell * cell
    if area > spec.max_pixels:
        shrink = math.sqrt(height * width / spec.max_pixels)
        h_cells, w_cells = math.floor(height / shrink / cell), math.floor(width / shrink / cell)
    elif area < spec.min_pixels:
        grow = math.sqrt(spec.min_pixels / (height * width))
        h_cells, w_cells = math.ceil(height * grow / cell), math.ceil(width * grow / cell)
    h_cells, w_cells = max(h_cells, 1), max(w_cells, 1)
    floor = -(-spec.min_pixels // (cell * cell))
    while h_cells * w_cells < floor:  # flooring while shrinking fell below min_pixels: widen the long side
        if w_cells >= h_cells:
            w_cells += 1
        else:
            h_cells += 1
    cap = spec.max_pixels // (cell * cell)
    if h_cells * w_cells > cap:  # one side was clamped to a single cell: narrow the long side
        if w_cells >= h_cells:
            w_cells = max(cap // h_cells, 1)
        else:
            h_cells = max(cap // w_cells, 1)
    if not floor <= h_cells * w_cells <= cap:  # narrowing undid the widening: a window a few cells wide
        h_cells, w_cells = _grid_in_window(height, width, floor, cap)
    return h_cells * spec.merge_size, w_cells * spec.merge_size


def crop_scaled_size(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """(height, width) a `fit="crop"` image is resized to before its middle `spec.size` is cut
    out: the shorter side the size's longer, the longer side in proportion, rounded down (CLIP's
    `shortest_edge` resize, as transformers' `get_resize_output_image_size` computes it)."""
    side = max(spec.size)
    if width <= height:
        return int(side * height / width), side
    return side, int(side * width / height)


def tile_arrangement(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """(columns, rows) of `fit="tiles"` tiles an image of this size is resized to: of the
    arrangements of `spec.tiles` (min, max) tiles, the one whose aspect ratio is nearest the
    image's; between equally near ones, taken by growing count, a later one replaces the kept
    one while the image's area exceeds half the later one's tiles' area (InternVL's rule, as
    transformers' `get_optimal_tiled_canvas` writes it). With `tile_rule="least_scale"`, Command A
    Vision's (`_least_scale_arrangement`)."""
    if spec.tile_rule == "least_scale":
        return _least_scale_arrangement(height, width, spec.size[0], spec.tiles[1])
    return _tile_arrangement(height, width, spec.size, spec.tiles)


@functools.lru_cache(maxsize=4096)
def _least_scale_arrangement(height: int, width: int, tile: int, most: int) -> tuple[int, int]:
    """(columns, rows) of the arrangement of at most `most` square tiles whose limiting side scales
    the image up least (at or above 1), or, where every one shrinks it, down least; the first such
    of the arrangements ordered by tile count, columns then rows counting up, as
    `Cohere2VisionImageProcessor`'s `get_optimal_tiled_canvas` takes it (it reads no minimum)."""
    arrangements = sorted(((columns, rows) for columns in range(1, most + 1) for rows in range(1, most + 1)
                           if columns * rows <= most), key=lambda each: each[0] * each[1])
    scales = [min(columns * tile / width, rows * tile / height) for columns, rows in arrangements]
    up = [scale if scale >= 1 else math.inf for scale in scales]
    if min(up) == math.inf:
        return arrangements[scales.index(max(scales))]
    return arrangements[up.index(min(up))]


@functools.lru_cache(maxsize=4096)
def _tile_arrangement(height: int, width: int, tile: tuple[int, int], tiles: tuple[int, int]) -> tuple[int, int]:
    least, most = tiles
    candidates = sorted(((columns, rows) for columns in range(1, most + 1) for rows in range(1, most + 1)
                         if least <= columns * rows <= most), key=lambda each: each[0] * each[1])
    ratio, area = width / height, width * height
    best, nearest = (1, 1), math.inf
    for columns, rows in candidates:
        distance = abs(ratio - columns / rows)
        if distance < nearest:
            best, nearest = (columns, rows), distance
        elif distance == nearest and area > 0.5 * tile[0] * tile[1] * columns * rows:
            best = (columns, rows)
    return best


def sizes_field(output_field: str) -> str:
    """The record field `decode_images` writes the (height, width) of each picture as shown to,
    beside its pixels in `output_field`, for the `SHOWN_SIZE_FITS`: an (images, 2) int32 array."""
    return f"{output_field}_sizes"


def split_arrangement(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """(rows, columns) of tiles a `fit="split"` image of this upright size is cut into, (1, 1)
    where it is not cut (Idefics3's `rows` and `cols`, which say 0 and 0 for it)."""
    return _split_arrangement(height, width, spec.longest_edge, spec.size[0])


def canvas_arrangement(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """(rows, columns) of tiles of the canvas a `fit="canvas"` picture of this upright size is
    fitted into (Llama 4's `aspect_ratios`)."""
    tile = spec.size[0]
    canvas_h, canvas_w = best_canvas(height, width, tile, spec.tiles[1])
    return canvas_h // tile, canvas_w // tile


def thin_scaled_up(height: int, width: int, side: int) -> tuple[int, int]:
    """(height, width) of a picture with a side under `side` scaled up, both sides by the factor
    that brings that side to it, the products truncated; any other as it is. The first step of
    GLM-4V's and Qwen3-VL's video processors' `smart_resize`."""
    if height >= side and width >= side:
        return height, width
    scale = max(side / height, side / width)
    return int(height * scale), int(width * scale)


def anyres_features(height: int, width: int, spec: ImageSpec) -> tuple[int, int, int, int]:
    """(tiles, features a side of a tile, feature rows, feature columns) of a `fit="anyres"`
    picture of this size as shown: its canvas's tiles, what the tower makes of each (the base
    image's too), and the rows and columns of their features LLaVA-NeXT keeps once it has dropped
    what only the padding filled (`vlm._anyres.unpadded_features`), shrunk as LLaVA-OneVision's
    `anyres_max` shrinks them (`capped_features`)."""
    tile = spec.size[0]
    side = tile // spec.cell if spec.tile_features is None else spec.tile_features
    canvas = best_resolution(height, width, spec.pinpoints)
    rows, columns = unpadded_features(height, width, canvas, tile, side)
    if spec.anyres_max is not None:
        rows, columns = capped_features(rows, columns, side, spec.anyres_max)
    return canvas[0] // tile * (canvas[1] // tile), side, rows, columns


def several_features(spec: ImageSpec) -> tuple[int, int, int, int]:
    """`anyres_features` of a picture of a record holding several, where the spec pads each to one
    tile (`several_pad`): no tiles but the picture's own, its features a side, and no rows of
    kept features (LLaVA-OneVision's model takes the base image's features and one newline)."""
    return 0, spec.size[0] // spec.cell if spec.tile_features is None else spec.tile_features, 0, 0


def tile_count(height: int, width: int, spec: ImageSpec) -> int:
    """Tiles a `fit="tiles"`, `"split"`, `"anyres"` or `"canvas"` image of this size becomes, its
    thumbnail (its global image, its base image, its global tile) included."""
    if spec.fit == "canvas":
        rows, columns = canvas_arrangement(height, width, spec)
        return rows * columns + (rows * columns > 1)
    if spec.fit == "split":
        rows, columns = split_arrangement(height, width, spec)
        return rows * columns + (rows * columns > 1)
    if spec.fit == "anyres":  # the base image and the canvas's tiles
        return 1 + anyres_features(height, width, spec)[0]
    columns, rows = tile_arrangement(height, width, spec)
    return columns * rows + (spec.thumbnail and columns * rows > 1)


def _grid_in_window(height: int, width: int, floor: int, cap: int) -> tuple[int, int]:
    """(rows, cols) in cells with floor <= rows * cols <= cap, nearest the image's aspect ratio
    (ties: the larger area, then fewer rows).

    Only for windows too narrow for the rules above: widening a grid for min_pixels and then
    narrowing its long side for max_pixels could land below min_pixels (a 1x1 image in a window
    of exactly 3 cells grew to 2x2, then narrowed to 2x1). `ImageSpec` refuses a window holding
    no whole count of cells, so a k x 1 grid always fits. The short side is searched up to
    sqrt(cap), either way round, so the cost stays small for any window.
    """
    aspect = math.log(height / width)
    best = None
    for short in range(1, math.isqrt(cap) + 1):
        low, high = max(short, -(-floor // short)), cap // short
        if low > high:
            continue
        for tall in (True, False):  # the short side as the columns (a tall grid) or as the rows
            ideal = short * (height / width if tall else width / height)
            for long in {min(max(math.floor(ideal), low), high), min(max(math.ceil(ideal), low), high)}:
                rows, cols = (long, short) if tall else (short, long)
                key = (abs(math.log(rows / cols) - aspect), -rows * cols, rows)
                if best is None or key < best[0]:
                    best = (key, (rows, cols))
    return best[1]


def patchify(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """(H, W, C) -> (rows * cols, patch_size * patch_size * C), patches in raster order.

    Each row is one patch flattened as (patch_row, patch_col, channel). Copies once.
    """
    h, w, c = pixels.shape
    rows, cols = h // patch_size, w // patch_size
    if rows * patch_size != h or cols * patch_size != w:
        raise ValueError(f"image {h}x{w} is not a whole number of {patch_size}px patches")
    blocks = pixels.reshape(rows, patch_size, cols, patch_size, c).swapaxes(1, 2)
    return blocks.reshape(rows * cols, patch_size * patch_size * c)


def _refuse_load_truncated_images() -> None:
    """Refuse to decode while Pillow's `ImageFile.LOAD_TRUNCATED_IMAGES` is on.

    Many training scripts (and some libraries, on import) turn it on to silence "image file is
    truncated". Pillow then decodes a truncated or corrupt JPEG with its missing part grey and no
    error, so a broken image was packed and trained on instead of skipped and counted; and the
    switch is a per-process global, so one set after a process runner's workers forked gave
    threads and processes different batches. Pillow reads it nowhere but from that global, so it
    cannot be turned off for one decode without racing other threads: every image is refused
    alike while it is on, so the verdict never depends on the data.
    """
    from PIL import ImageFile

    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise ConfigurationError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True (this program or a library it imports set it): "
            "Pillow then decodes a truncated or corrupt image with its missing part grey and no error, so "
            "broken images would be trained on uncounted. Set it to False before decoding: decode_images "
            "skips such images itself, counted as truncated_image or corrupt_image"
        )


def _open(data: bytes, spec: ImageSpec):
    """The image with its header parsed and no pixel decoded; bombs refused here, and decoding
    at all while Pillow is told to accept truncated images (`_refuse_load_truncated_images`)."""
    from PIL import Image

    _refuse_load_truncated_images()

    if isinstance(data, memoryview):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise ImageDecodeError("corrupt_image", f"expected image bytes, got {type(data).__name__}")
    try:
        image = _open_identified(data)
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError("decompression_bomb", _pillows_cap_detail(exc, spec)) from None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - untrusted bytes fail in many ways; all mean "not an image"
        raise _classify(exc, data) from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageDecodeError("corrupt_image", f"header announces a {width}x{height} image")
    if width * height > spec.max_image_pixels:
        raise ImageDecodeError(
            "decompression_bomb",
            f"header announces {width}x{height} = {width * height} pixels, more than "
            f"max_image_pixels={spec.max_image_pixels}",
        )
    return image


def _pillows_cap_detail(exc: BaseException, spec: ImageSpec) -> str:
    """Pillow's refusal of a header above twice its global `Image.MAX_IMAGE_PIXELS`, with both limits.

    Pillow refuses in `Image.open`, before the spec's limit is compared, and its message names its
    own cap (178,956,970 pixels by default) alone: neither the spec's limit nor, where the spec was
    raised past that cap, why an image the spec allows is refused and what to raise."""
    from PIL import Image

    return (f"{exc} (Pillow's own cap, twice its Image.MAX_IMAGE_PIXELS={Image.MAX_IMAGE_PIXELS}, applies "
            f"whatever ImageSpec.max_image_pixels={spec.max_image_pixels} allows: to accept larger images raise both)")


def _open_identified(data: bytes):
    """`Image.open`, once more after registering every format if no format knew the bytes.

    Pillow registers the formats beyond its first few (WebP, TIFF, ...) on the first open that
    needs them, and an open on another thread that tried the registered formats before that and
    asks to register after it has finished is told there is nothing more to try: a valid image
    then fails as unidentified on one run and not on the next. Registering everything up front
    costs every loader 3.7 MiB and ~0.1 s on 3.14t; retrying costs only bytes that are no image.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        Image.init()  # returns once every format is registered, by this thread or another
        return Image.open(io.BytesIO(data))


def _classify(exc: BaseException, data: bytes) -> ImageDecodeError:
    """The reason Pillow's failure on `data` is counted under."""
    from PIL import UnidentifiedImageError

    if (cut := _webp_cut_short(data)) is not None:
        return ImageDecodeError("truncated_image", cut)
    if not data:  # a failed download kept as an empty file: not a format problem to look for
        return ImageDecodeError("corrupt_image", "the image holds 0 bytes (an empty file or member)")
    if isinstance(exc, UnidentifiedImageError):  # its message names a memory address: not stable
        detail = _png.header_chunk_fault(data) or "no image format recognises these bytes"
        return ImageDecodeError("corrupt_image", detail)
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, EOFError) or "truncated" in message.lower():
        return ImageDecodeError("truncated_image", message)
    return ImageDecodeError("corrupt_image", message)


def _orientation(image, spec: ImageSpec, read_exif=None) -> int:
    """The EXIF orientation still to apply (1 when absent, broken or not applied), read by
    `read_exif(image)`, by default the image's own `getexif`.

    A TIFF's is always 1: Pillow's TIFF decoder applies the orientation itself while loading, and
    reports the upright size from the header on (Pillow >= 11), so applying it again here would
    turn the picture twice (it also means `exif_transpose=False` cannot keep a TIFF as stored).
    """
    if not spec.exif_transpose or image.format == "TIFF":
        return 1
    try:
        value = (read_exif or type(image).getexif)(image).get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block must not lose the image
        return 1
    return value if value in _EXIF_TRANSPOSE else 1


def _webp_cut_short(data: bytes) -> str | None:
    """Why a WebP is cut short, or None: its RIFF header declares more bytes than there are.

    Pillow cannot tell: libwebp's demuxer refuses a WebP cut anywhere at open, with the words it
    uses for a damaged one ("could not create decoder object"), and one cut just after its RIFF
    header is no image Pillow knows. Asked only once Pillow has failed, so a WebP that decodes is
    never refused by this.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    declared = 8 + int.from_bytes(data[4:8], "little")
    return f"the WebP's header declares {declared} bytes, {len(data)} are there" if len(data) < declared else None


def _read_data(step, data: bytes) -> None:
    """Run a Pillow step that reads the pixels of `data` (`load`): its failure on untrusted bytes
    becomes an `ImageDecodeError` with a named reason."""
    try:
        step()
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _classify(exc, data) from None


def _normalise_mode(image):
    """Any mode -> one of L, RGB, LA, RGBA (alpha kept for the composite after resizing)."""
    from PIL import Image

    mode = image.mode
    if mode in ("RGB", "L", "RGBA", "LA"):
        return image
    if mode == "1":
        return image.convert("L")
    if mode in ("P", "PA"):
        has_alpha = mode == "PA" or "transparency" in image.info
        return image.convert("RGBA" if has_alpha else "RGB")
    if mode in _SIXTEEN_BIT:
        # Fixed 16-bit -> 8-bit scaling (x / 257, rounded), never per-image min/max: a dark frame
        # stays dark and the result does not depend on the image's content range.
        wide = np.asarray(image).astype(np.int64, copy=False)
        narrow = (np.clip(wide, 0, 65535) + 128) // 257
        return Image.fromarray(narrow.astype(np.uint8), "L")
    if mode == "F":
        # Samples are read on the 0..255 scale, rounded and saturated (+inf 255, -inf 0), like
        # 16-bit ones never stretched per image. NaN has no place on it, and casting NaN to uint8
        # is undefined (the byte depends on the machine): it becomes 0, like the lowest sample.
        samples = np.nan_to_num(np.asarray(image), nan=0.0)
        return Image.fromarray(np.clip(np.rint(samples), 0, 255).astype(np.uint8), "L")
    if mode == "RGBa":
        return image.convert("RGBA")
    if mode == "La":
        return image.convert("LA")
    return image.convert("RGB")  # CMYK, YCbCr, LAB, HSV, RGBX, ...


def _finish(image, spec: ImageSpec):
    """L/LA/RGBA -> RGB (alpha composited on the fixed background).

    An LA or RGBA image is pasted onto the background as it is, with itself as the mask: Pillow
    reads the alpha band of an RGBA or LA mask, and stores an LA pixel with its L in all three
    colour bytes, so no conversion to RGB and no separate alpha band are made first. The pixels
    are the same as converting and extracting the band (checked on the race's 785 images and on
    random RGBA and LA pixels, Pillow 13 and pillow-simd 12.1); decoding costs 3 % less with
    Pillow and 5 % less with pillow-simd on those images.
    """
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode == "L":
        return image.convert("RGB")
    background = Image.new("RGB", image.size, tuple(int(c) for c in spec.background))
    background.paste(image, (0, 0), image)
    return background


def _decode(data: bytes, spec: ImageSpec, *, resize: bool, probed: bool = False):
    """(the image decoded, resized to the spec or not, and upright; its (height, width) as shown
    before resizing)."""
    image = _open(data, spec)
    orientation = _orientation(image, spec)
    width, height = image.size
    shown = (width, height) if orientation in (5, 6, 7, 8) else (height, width)  # (height, width) upright
    return _decoded_pixels(image, data, spec, orientation, shown, resize, probed), shown


def _decoded_pixels(image, data: bytes, spec: ImageSpec, orientation: int, shown: tuple[int, int], resize: bool,
                    probed: bool):
    swapped = orientation in (5, 6, 7, 8)
    box = None
    target = None
    if resize:
        rows, cols = image_grid(*shown, spec)
        target_h, target_w = rows * spec.patch_size, cols * spec.patch_size
        if spec.fit == "tiles":  # the canvas the tiles are cut from
            columns, tile_rows = tile_arrangement(*shown, spec)
            target_h, target_w = tile_rows * spec.size[0], columns * spec.size[1]
        elif spec.longest_edge is not None:  # the first of Idefics3's two resizes ("split", "fixed")
            target_h, target_w = split_first_size(*shown, spec.longest_edge)
        elif spec.fit == "anyres":  # the picture fitted into its canvas, before the padding
            target_h, target_w = fitted_size(*shown, best_resolution(*shown, spec.pinpoints))
        elif spec.fit == "canvas":  # the picture on its canvas, before the padding
            target_h, target_w = canvas_fitted_size(*shown, spec.size[0], spec.tiles[1])
        elif spec.fit == "crop":  # the scaled image the middle is cut from
            target_h, target_w = crop_scaled_size(*shown, spec)
            if target_h * target_w > spec.max_image_pixels:  # a thin strip scaled up: a bomb of our making
                raise ImageDecodeError(
                    "decompression_bomb", f"fit='crop' scales its {shown[1]}x{shown[0]} pixels to "
                    f"{target_w}x{target_h} before cutting the middle, more than max_image_pixels="
                    f"{spec.max_image_pixels}")
        target = (target_h, target_w) if swapped else (target_w, target_h)  # stored (w, h)
        if spec.draft and image.format in _DRAFTABLE:
            # Capped at the stored size, which a draft never exceeds anyway (it only scales down),
            # so that a large finite draft_gap cannot overflow int().
            wanted = tuple(max(1, int(min(side, t * spec.draft_gap))) for t, side in zip(target, image.size))
            drafted = image.draft(None, wanted)
            if drafted is not None:
                box = drafted[1]
    if image.format == "PNG" and not probed:
        _png.check_pixel_data(data)
    _read_data(image.load, data)
    try:
        image = _normalise_mode(image)
    except (ValueError, OSError) as exc:  # a mode Pillow cannot convert: unusable, not a crash
        raise ImageDecodeError("corrupt_image", f"cannot convert mode {image.mode}: {exc}") from None
    if spec.fit == "tiles" and target is not None:
        return _tiles(image, spec, target, box, orientation)
    if spec.fit == "split" and target is not None:
        return _split(image, spec, target, box, orientation)
    if spec.longest_edge is not None and target is not None:  # fit="fixed" after Idefics3's first resize
        stored = _resized_upright(image, spec, target, box, 1)
        size = spec.size if orientation in (5, 6, 7, 8) else spec.size[::-1]
        return _resized_upright(stored, spec, size, None, orientation)
    if spec.fit == "anyres" and target is not None:
        return _anyres(image, spec, target, box, orientation, shown)
    if spec.fit == "canvas" and target is not None:
        return _canvas(image, spec, target, box, orientation, shown)
    if spec.fit == "pad" and target is not None:
        return _padded_square(image, spec, box, orientation)
    if spec.fit == "crop" and target is not None:
        return middle(np.asarray(_resized_upright(image, spec, target, box, orientation)), spec.size)
    return _resized_upright(image, spec, target, box, orientation)


def _padded_square(image, spec: ImageSpec, box, orientation: int):
    """fit="pad": the upright image on the background, padded to a square of its longer side with
    `pad_color` (the image centred, its start rounded down), resized to `size`; the order of
    LLaVA's processor, so the pad's edge blends into the picture as there."""
    from PIL import Image

    if box is not None:  # a draft: the region of the drafted picture that is the image
        image = image.crop(tuple(round(edge) for edge in box))
    upright = _resized_upright(image, spec, None, None, orientation)
    width, height = upright.size
    side = max(width, height)
    if side * side > spec.max_image_pixels:  # a thin strip padded: a bomb of our making
        raise ImageDecodeError("decompression_bomb", f"fit='pad' pads its {width}x{height} pixels to {side}x{side} "
                                                     f"before resizing, more than max_image_pixels={spec.max_image_pixels}")
    square = Image.new("RGB", (side, side), spec.pad_color)
    square.paste(upright, ((side - width) // 2, (side - height) // 2))
    return square.resize(spec.size[::-1], Image.Resampling[spec.resample.upper()],
                         reducing_gap=spec.draft_gap if spec.draft else None)


def middle(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The middle `size` (height, width) of (H, W, 3) pixels, its top and left rounded down as
    transformers' `center_crop` rounds them."""
    top, left = (pixels.shape[0] - size[0]) // 2, (pixels.shape[1] - size[1]) // 2
    return pixels[top : top + size[0], left : left + size[1]]


def _resized_upright(image, spec: ImageSpec, target: tuple[int, int] | None, box, orientation: int):
    """The decoded image resized to `target` (stored width, height; None: as it is), on the
    background, upright."""
    from PIL import Image

    if target is not None and (image.size != target or box is not None):
        image = image.resize(target, Image.Resampling[spec.resample.upper()], box=box,
                             reducing_gap=spec.draft_gap if spec.draft else None)
    image = _finish(image, spec)
    if orientation != 1:
        image = image.transpose(Image.Transpose[_EXIF_TRANSPOSE[orientation]])
    return image


def _tiles(image, spec: ImageSpec, canvas: tuple[int, int], box, orientation: int) -> np.ndarray:
    """fit="tiles": the image resized to its canvas of tiles (stored width, height), cut into
    them in raster order, and the whole image resized to one tile after them where there is more
    than one, stacked top to bottom: (tiles * tile_height, tile_width, 3)."""
    tile_h, tile_w = spec.size
    upright = np.asarray(_resized_upright(image, spec, canvas, box, orientation))
    tiles = _cut_tiles(upright, tile_h, tile_w)
    if not spec.thumbnail or len(tiles) == tile_h:  # one tile has no thumbnail
        return tiles
    stored = (tile_h, tile_w) if orientation in (5, 6, 7, 8) else (tile_w, tile_h)
    return np.concatenate([tiles, np.asarray(_resized_upright(image, spec, stored, box, orientation))])


def _split(image, spec: ImageSpec, first: tuple[int, int], box, orientation: int) -> np.ndarray:
    """fit="split": the image resized to its first size (stored width, height), then to its
    canvas of whole tiles; past one tile, the canvas cut into them in raster order and the canvas
    resized to one tile after them, stacked top to bottom: (tiles * tile, tile, 3). Each resize is
    from the one before, as Idefics3's processor resizes, and all of them as the picture is stored,
    turned upright after, as the other fits turn theirs."""
    tile = spec.size[0]
    swapped = orientation in (5, 6, 7, 8)
    stored = _resized_upright(image, spec, first, box, 1)
    height, width = (stored.width, stored.height) if swapped else (stored.height, stored.width)
    canvas_h, canvas_w = split_canvas(height, width, tile)
    stored_canvas = _resized_upright(stored, spec, (canvas_h, canvas_w) if swapped else (canvas_w, canvas_h), None, 1)
    canvas = np.asarray(_resized_upright(stored_canvas, spec, None, None, orientation))
    if canvas_h == canvas_w == tile:
        return canvas
    global_image = np.asarray(_resized_upright(stored_canvas, spec, (tile, tile), None, orientation))
    return np.concatenate([_cut_tiles(canvas, tile, tile), global_image])


def _anyres(image, spec: ImageSpec, fitted: tuple[int, int], box, orientation: int,
            shown: tuple[int, int]) -> np.ndarray:
    """fit="anyres": the image stretched to one tile (the base image), then the tiles of its
    canvas: the image resized to `fitted` (stored width, height), padded with black to the canvas,
    centred (the odd pixel after), cut in raster order; stacked top to bottom, (tiles * tile,
    tile, 3). Both resizes are from the decoded image, as LLaVA-NeXT's processor makes them; the
    canvas is chosen by the picture's (height, width) as `shown`, not by a draft's."""
    tile = spec.size[0]
    picture = np.asarray(_resized_upright(image, spec, fitted, box, orientation))
    height, width = picture.shape[:2]
    canvas_h, canvas_w = best_resolution(*shown, spec.pinpoints)
    canvas = np.zeros((canvas_h, canvas_w, 3), np.uint8)
    top, left = (canvas_h - height) // 2, (canvas_w - width) // 2
    canvas[top : top + height, left : left + width] = picture
    base = np.asarray(_resized_upright(image, spec, (tile, tile), box, orientation))
    return np.concatenate([base, _cut_tiles(canvas, tile, tile)])


def _canvas(image, spec: ImageSpec, fitted: tuple[int, int], box, orientation: int,
            shown: tuple[int, int]) -> np.ndarray:
    """fit="canvas": the image resized to `fitted` (stored width, height), at the top left of its
    canvas, the rest black, cut in raster order; past one tile, the image resized to one tile
    after them; stacked top to bottom, (tiles * tile, tile, 3). Both resizes are from the decoded
    image, as Llama 4's processor makes them; the canvas is chosen by the picture's (height,
    width) as `shown`, not by a draft's."""
    tile = spec.size[0]
    picture = np.asarray(_resized_upright(image, spec, fitted, box, orientation))
    height, width = picture.shape[:2]
    canvas = np.zeros((*best_canvas(*shown, tile, spec.tiles[1]), 3), np.uint8)
    canvas[:height, :width] = picture
    tiles = _cut_tiles(canvas, tile, tile)
    if len(tiles) == tile:
        return tiles
    return np.concatenate([tiles, np.asarray(_resized_upright(image, spec, (tile, tile), box, orientation))])


def _cut_tiles(canvas: np.ndarray, tile_h: int, tile_w: int) -> np.ndarray:
    """(H, W, 3) pixels of whole tiles -> the tiles in raster order, stacked top to bottom:
    (tiles * tile_h, tile_w, 3)."""
    rows, columns = canvas.shape[0] // tile_h, canvas.shape[1] // tile_w
    return canvas.reshape(rows, tile_h, columns, tile_w, 3).transpose(0, 2, 1, 3, 4).reshape(-1, tile_w, 3)


DEFAULT_SPEC = ImageSpec()
"""The default ImageSpec (16 px patches, area in [32², 512²])."""


def decode_image(data: bytes, spec: ImageSpec = DEFAULT_SPEC, *, probed: bool = False) -> np.ndarray:
    """Decode image bytes to (H, W, 3) uint8 on the spec's patch grid.

    H = rows * patch_size and W = cols * patch_size with (rows, cols) = `image_grid` of the
    upright image. Raises `ImageDecodeError` with reason corrupt_image, truncated_image or
    decompression_bomb, and `ConfigurationError` while Pillow's `ImageFile.LOAD_TRUNCATED_IMAGES`
    is on (it would decode such images with their missing part grey). The returned array may be
    read-only. `probed`: these bytes passed `probe_image` (deferred decoding), so the checks it
    made are not made again (a PNG's pixel chunks' checksums: 7 µs of a race image's ~1.5 ms).
    """
    return np.asarray(_decode(data, spec, resize=True, probed=probed)[0])


class SizedImage(NamedTuple):
    """An image decoded on its spec's grid, and the (height, width) of the picture as shown,
    before resizing: what the placeholders of a split (Idefics3) or anyres (LLaVA-NeXT) picture
    are counted from, and what LLaVA-NeXT's model is given as `image_sizes`."""

    pixels: np.ndarray
    size: tuple[int, int]


def decode_image_with_size(data: bytes, spec: ImageSpec = DEFAULT_SPEC, *, probed: bool = False) -> SizedImage:
    """`decode_image`, and the size of the picture as decoded (its orientation applied)."""
    pixels, size = _decode(data, spec, resize=True, probed=probed)
    return SizedImage(np.asarray(pixels), size)


def load_rgb(data: bytes, spec: ImageSpec = DEFAULT_SPEC):
    """Decode image bytes to an upright RGB `PIL.Image` at full size (for a user's image processor).

    Same refusals and mode conversion as `decode_image`, no resize and no draft.
    """
    return _decode(data, spec, resize=False)[0]


def import_decoder() -> None:
    """Import Pillow's `Image` and register the formats it opens without a search (`preinit`:
    BMP, GIF, JPEG, PPM, PNG), which the first `probe_image` or `decode_image` would do.

    0.12 s cold on 3.14t (the thirty-third session's machine), which the first chunk's decoding
    threads spent waiting on each other's import: `vlm_pipeline` calls this on a thread of its own
    while it parses the tokenizer. Not `Image.init()`, which registers every format (see
    `_open_identified`)."""
    from PIL import Image

    Image.preinit()


def probe_image(data: bytes, spec: ImageSpec = DEFAULT_SPEC) -> tuple[int, int]:
    """The (rows, cols) patch grid `decode_image(data, spec)` will give, from the header alone.

    Refuses like `decode_image` does what the header shows (no image, bombs), and what a format
    can check without decoding: a PNG whose pixel chunks are cut short or fail their checksums
    (`_png.check_pixel_data`, the check `decode_image` makes too) is refused here. A JPEG's
    entropy-coded data, and whether a PNG's deflate stream ends, are only checked by decoding.

    A plain PNG (`_plain_png_size`) is read without Pillow: its size from its IHDR chunk, its
    orientation 1. Every other image, and every refusal, is Pillow's as it was: the plain path
    accepts only what `Image.open` accepts, with the same size, and sends the rest to it.
    """
    return image_grid(*_probed_size(data, spec), spec)


def probe_image_with_size(data: bytes, spec: ImageSpec = DEFAULT_SPEC) -> tuple[tuple[int, int], tuple[int, int]]:
    """`probe_image`'s grid and the (height, width) of the picture as shown, from the same
    reading of the header: what `decode_image_with_size` will say of it."""
    size = _probed_size(data, spec)
    return image_grid(*size, spec), size


def _probed_size(data: bytes, spec: ImageSpec) -> tuple[int, int]:
    """(height, width) of the image as shown, from its header, refused as `probe_image` says."""
    _refuse_load_truncated_images()
    if (size := _plain_png_size(data, spec)) is not None:
        _png.check_pixel_data(data)
        return size[::-1]
    image = _open(data, spec)
    width, height = image.size
    if _header_orientation(image, spec) in (5, 6, 7, 8):
        width, height = height, width
    if image.format == "PNG":
        _png.check_pixel_data(data)
    return height, width


def _plain_png_size(data: bytes, spec: ImageSpec) -> tuple[int, int] | None:
    """(width, height) of a plain PNG (`_png.plain_size`) within both pixel limits; None for
    anything else, which `probe_image` opens with Pillow.

    Plain PNGs are most of what a crawl or a rendered corpus holds, and `Image.open` was half of
    probing one (17 of ~42 µs on the race's PNGs, 3.14t), the pixel data's checksums most of the
    rest. Pillow's reader opens a plain PNG at its IHDR's size with no orientation (no chunk that
    can hold one comes before its pixels), which is all a probe takes from it. An image above
    `spec.max_image_pixels`, or above Pillow's `Image.MAX_IMAGE_PIXELS` (read now: a program may
    change it), goes to Pillow so that its warning, its refusal and their details stay its own.
    """
    from PIL import Image, PngImagePlugin

    if not isinstance(data, (bytes, bytearray)):
        return None
    size = _png.plain_size(data, PngImagePlugin._MODES)
    if size is None:
        return None
    pixels = size[0] * size[1]
    cap = Image.MAX_IMAGE_PIXELS
    return None if pixels > spec.max_image_pixels or (cap is not None and pixels > cap) else size


def _header_orientation(image, spec: ImageSpec) -> int:
    """The orientation `decode_image` will apply, read without decoding a pixel.

    A PNG's own getexif() decodes the whole image unless an eXIf chunk came before the pixel
    data, even when the orientation is already parsed from a chunk before it: an ImageMagick
    "Raw profile type exif" text chunk or XMP. Pillow's base getexif() reads `image.info` alone,
    which before decoding holds every chunk ahead of the pixel data, so it finds what decoding
    finds there. Only metadata after the pixel data is missed; `DeferredImage.decode` refuses
    the rare image it turns, so the grid planned here is the grid delivered or nothing.
    """
    from PIL import Image

    return _orientation(image, spec, Image.Image.getexif if image.format == "PNG" else None)
