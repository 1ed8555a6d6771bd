"""`probe_image` reads a plain PNG's grid from its IHDR chunk, and gives every image the verdict
Pillow's path gives it: the same grid, or the same refusal (reason and detail).

The plain path (`vlm._image._plain_png_size`) may only ever answer where `Image.open` would have
opened the bytes as a PNG of that size with no orientation; for anything else it must defer. So
each image below is probed twice, with the plain path and with it turned off, and the answers
compared; and whether it was read as plain is checked too, so that a plain path that deferred on
everything, or accepted an orientation-bearing chunk, fails here.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from tests.unit.test_vlm_assets import (
    REAL_PNGS,
    encode,
    gradient,
    palette_alpha_png,
    png_chunk,
    raw_profile_exif_png,
    real_file,
    sixteen_bit_png,
    stored_png,
    xmp_png,
)
from vlm import ImageDecodeError, ImageSpec, decode_image
from vlm import _image
from vlm._image import probe_image

SPECS = {
    "default": ImageSpec(),
    "pixtral": ImageSpec.pixtral(max_side=128),
    "qwen2-vl": ImageSpec.qwen2_vl(max_pixels=256 * 256),
    "small-cap": ImageSpec(max_image_pixels=5000),  # most of the corpus is a bomb here
}
_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_RACE_PAIRS = Path.home() / ".cache" / "zephon" / "vlm" / "pairs" / "tuxpaint-8xall"


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    """(type, body) of each chunk of a well-formed PNG."""
    out, position = [], len(_SIGNATURE)
    while position < len(png):
        length, kind = struct.unpack_from(">I4s", png, position)
        out.append((kind, png[position + 8 : position + 8 + length]))
        position += 12 + length
    return out


def _rebuilt(png: bytes, change) -> bytes:
    """The PNG with its chunk list passed through `change` (list -> list), checksums recomputed."""
    return _SIGNATURE + b"".join(png_chunk(kind, body) for kind, body in change(_chunks(png)))


def _before_idat(png: bytes, *extra: tuple[bytes, bytes]) -> bytes:
    def insert(chunks):
        at = next(i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT")
        return chunks[:at] + list(extra) + chunks[at:]
    return _rebuilt(png, insert)


def _with_ihdr(png: bytes, **fields) -> bytes:
    """The PNG with IHDR fields replaced (width, height, depth, colour, compression, filter,
    interlace, or `body` for the whole chunk), its checksum recomputed."""
    names = ("width", "height", "depth", "colour", "compression", "filter", "interlace")
    def change(chunks):
        body = chunks[0][1]
        if "body" in fields:
            body = fields["body"]
        else:
            values = dict(zip(names, struct.unpack(">IIBBBBB", body)))
            body = struct.pack(">IIBBBBB", *(fields.get(name, values[name]) for name in names))
        return [(b"IHDR", body)] + chunks[1:]
    return _rebuilt(png, change)


def _flip_crc(png: bytes, kind: bytes) -> bytes:
    at = png.index(kind)
    length = struct.unpack_from(">I", png, at - 4)[0]
    crc = at + 4 + length
    return png[:crc] + bytes([png[crc] ^ 0x01]) + png[crc + 1 :]


def _raw_png(pixels: np.ndarray, depth: int, colour: int, *, interlace: bool = False) -> bytes:
    """A PNG written here from samples (big-endian at 16 bits), rows unfiltered, Adam7-interlaced
    when asked: what Pillow's writer does not make (16-bit RGB/RGBA, interlacing)."""
    height, width = pixels.shape[:2]
    samples = pixels.astype(">u2" if depth == 16 else np.uint8)
    passes = ([(0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4), (2, 0, 4, 2), (0, 1, 2, 2), (1, 0, 2, 1)]
              if interlace else [(0, 0, 1, 1)])
    raw = b""
    for top, left, down, across in passes:  # (first row, first column, row step, column step)
        sub = samples[top::down, left::across]
        if sub.size:
            raw += b"".join(b"\x00" + row.tobytes() for row in sub)
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, int(interlace))
    return (_SIGNATURE + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(raw))
            + png_chunk(b"IEND", b""))


def _saved(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **options)
    return buffer.getvalue()


def _mode_i(grey: np.ndarray) -> dict[str, bytes]:
    """A mode I image as Pillow-SIMD 12.1 writes it (16-bit grey); Pillow 13 writes no mode I."""
    try:
        return {"mode-I": _saved(Image.fromarray(grey.astype(np.int32) * 100, "I"))}
    except OSError:
        return {}


def _exif_png(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _saved(Image.fromarray(gradient()), exif=exif)


def _apng() -> bytes:
    frames = [Image.fromarray(gradient()), Image.fromarray(gradient()[::-1].copy())]
    return _saved(frames[0], save_all=True, append_images=frames[1:], duration=100)


def _corpus() -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(plain, not plain): PNGs the plain path must read itself, and bytes it must leave to Pillow
    (each of which Pillow opens, refuses or turns as it does)."""
    rgb = gradient()
    png = encode(rgb)
    grey = np.asarray(Image.fromarray(rgb).convert("L"))
    wide = (np.arange(40 * 56 * 3, dtype=np.uint32).reshape(40, 56, 3) * 37 % 65536).astype(np.uint16)
    wide_alpha = np.concatenate([wide, np.full((40, 56, 1), 40000, np.uint16)], axis=2)
    palette_one = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    plain = {
        "mode-1": encode(rgb, mode="1"),
        "mode-L": encode(rgb, mode="L"),
        "mode-LA": encode(rgb, mode="LA"),
        "mode-P": encode(rgb, mode="P"),
        "mode-P-transparency-index": _saved(palette_one, transparency=3),
        "mode-P-palette-alpha": palette_alpha_png(),
        "mode-RGB": png,
        "mode-RGBA": encode(rgb, mode="RGBA"),
        "mode-I;16": sixteen_bit_png(),
        **_mode_i(grey),
        "four-bit-palette": _saved(palette_one, bits=4),
        "mode-L-transparency": _saved(Image.fromarray(grey), transparency=7),
        "mode-RGB-transparency": _saved(Image.fromarray(rgb), transparency=(1, 2, 3)),
        "optimize": encode(rgb, optimize=True),
        "interlaced-rgb": _raw_png(rgb, 8, 2, interlace=True),
        "interlaced-16-bit-rgba": _raw_png(wide_alpha, 16, 6, interlace=True),
        "16-bit-rgb": _raw_png(wide, 16, 2),
        "16-bit-rgba": _raw_png(wide_alpha, 16, 6),
        "16-bit-grey-alpha": _raw_png(wide_alpha[..., 2:], 16, 4),
        "two-bit-grey": _raw_png(grey >> 6, 2, 0),
        "trns-in-a-mode-1": _before_idat(encode(rgb, mode="1"), (b"tRNS", b"\x00\x01")),
        "stored-in-three-idats": stored_png(rgb, pieces=3),
        "tall": encode(gradient(700, 90)),
        "one-pixel": encode(np.zeros((1, 1, 3), np.uint8)),
        "every-allowed-chunk": _before_idat(
            png, (b"gAMA", struct.pack(">I", 45455)), (b"cHRM", struct.pack(">8I", *range(8))),
            (b"sRGB", b"\x00"), (b"pHYs", struct.pack(">IIB", 2835, 2835, 1)), (b"sBIT", b"\x08\x08\x08"),
            (b"bKGD", b"\x00\x01\x00\x02\x00\x03"), (b"tIME", struct.pack(">HBBBBB", 2024, 1, 2, 3, 4, 5))),
        "pixels-cut-in-their-idat": png[: png.index(b"IDAT") + 30],  # refused as check_pixel_data refuses
        "idat-checksum-wrong": _flip_crc(png, b"IDAT"),
    }
    not_plain = {
        "exif-orientation-6": _exif_png(6),
        "exif-orientation-1": _exif_png(1),
        "raw-profile-exif-text-6": raw_profile_exif_png(6),
        "xmp-itxt-orientation-8": xmp_png(8),
        "plain-text": encode(rgb, pnginfo=_text_info()),
        "icc-profile": encode(rgb, icc_profile=b"not really a profile, only bytes" * 4),
        "apng": _apng(),
        "ihdr-checksum-wrong": _flip_crc(png, b"IHDR"),
        "plte-checksum-wrong": _flip_crc(encode(rgb, mode="P"), b"PLTE"),
        "gama-checksum-wrong": _flip_crc(_before_idat(png, (b"gAMA", struct.pack(">I", 45455))), b"gAMA"),
        "depth-16-palette": _with_ihdr(encode(rgb, mode="P"), depth=16),
        "depth-3-grey": _with_ihdr(encode(rgb, mode="L"), depth=3),
        "colour-type-5": _with_ihdr(png, colour=5),
        "zero-width": _with_ihdr(png, width=0),
        "zero-height": _with_ihdr(png, height=0),
        "width-above-the-standard": _with_ihdr(png, width=2**31),
        "bomb": _with_ihdr(png, width=20000, height=20000),
        "above-twice-pillows-cap": _with_ihdr(png, width=20000, height=10000),
        "ihdr-14-bytes": _with_ihdr(png, body=_chunks(png)[0][1] + b"\x00"),
        "ihdr-12-bytes": _with_ihdr(png, body=_chunks(png)[0][1][:12]),
        "filter-method-1": _with_ihdr(png, filter=1),
        "compression-method-1": _with_ihdr(png, compression=1),
        "interlace-method-2": _with_ihdr(png, interlace=2),
        "trns-short-for-rgb": _before_idat(png, (b"tRNS", b"\x00\x01")),
        "trns-short-for-grey": _before_idat(encode(rgb, mode="L"), (b"tRNS", b"\x00")),
        "gama-short": _before_idat(png, (b"gAMA", b"\x00\x01")),
        "gama-long": _before_idat(png, (b"gAMA", b"\x00\x01\x00\x00\x00")),
        "chrm-33-bytes": _before_idat(png, (b"cHRM", bytes(33))),
        "chrm-36-bytes": _before_idat(png, (b"cHRM", bytes(36))),
        "srgb-empty": _before_idat(png, (b"sRGB", b"")),
        "phys-short": _before_idat(png, (b"pHYs", bytes(8))),
        "unknown-ancillary-chunk": _before_idat(png, (b"prVt", b"private")),
        "unknown-critical-chunk": _before_idat(png, (b"CRIT", b"")),
        "bad-chunk-name": _before_idat(png, (b"a b!", b"")),
        "second-ihdr": _before_idat(png, _chunks(png)[0]),
        "iend-before-idat": _before_idat(png, (b"IEND", b"")),
        "no-idat": _rebuilt(png, lambda chunks: [c for c in chunks if c[0] != b"IDAT"]),
        "cut-after-ihdr": png[:33],
        "cut-inside-ihdr": png[:30],
        "cut-inside-a-chunk-before-idat": _before_idat(png, (b"gAMA", bytes(4)))[:40],
        "signature-only": _SIGNATURE,
        "not-a-png": b"<html>404</html>" * 20,
        "empty": b"",
        "jpeg": encode(rgb, "JPEG"),
        "gif": encode(rgb, "GIF"),
    }
    return plain, not_plain


def _text_info() -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", "a paint program")
    return info


def _race_pngs() -> dict[str, bytes]:
    """Every PNG of the race's shards where they are cached (785 tuxpaint stamps), else the
    photographs the test assets ship with their wheels."""
    import tarfile

    shards = sorted(_RACE_PAIRS.glob("*.tar"))
    if not shards:
        return {relative: real_file(package, relative).read_bytes() for package, relative in REAL_PNGS}
    found = {}
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".png"):
                    found[f"{shard.name}/{member.name}"] = tar.extractfile(member).read()
    return found


PLAIN, NOT_PLAIN = _corpus()


def _verdict(data: bytes, spec: ImageSpec):
    try:
        return probe_image(data, spec)
    except ImageDecodeError as exc:
        return exc.reason, exc.detail


def _pillows_verdict(data: bytes, spec: ImageSpec, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(_image, "_plain_png_size", lambda data, spec: None)
        return _verdict(data, spec)


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
@pytest.mark.parametrize("name", list(PLAIN) + list(NOT_PLAIN))
def test_the_plain_path_gives_every_image_pillows_verdict(name, spec, monkeypatch):
    data = PLAIN.get(name, NOT_PLAIN.get(name))
    assert _verdict(data, spec) == _pillows_verdict(data, spec, monkeypatch)


@pytest.mark.parametrize("name", list(PLAIN) + list(NOT_PLAIN))
def test_only_the_plain_pngs_are_read_without_pillow(name):
    data = PLAIN.get(name, NOT_PLAIN.get(name))
    plain = _image._plain_png_size(data, ImageSpec())
    assert (plain is not None) == (name in PLAIN)
    if plain is not None:
        assert plain == Image.open(io.BytesIO(data)).size


def test_every_race_png_gets_pillows_verdict_and_the_plain_ones_are_read_without_pillow(monkeypatch):
    pngs = _race_pngs()
    assert pngs
    read_plain = 0
    for spec in SPECS.values():
        for name, data in pngs.items():
            assert _verdict(data, spec) == _pillows_verdict(data, spec, monkeypatch), name
            read_plain += _image._plain_png_size(data, spec) is not None
    assert read_plain > 0, "no race PNG was read without Pillow"


@pytest.mark.parametrize("spec", [SPECS["default"], SPECS["pixtral"]], ids=["default", "pixtral"])
def test_a_plain_png_decodes_to_the_grid_its_header_gave(spec):
    """`DeferredImage.decode` refuses an image whose pixels differ from the probed grid: never a
    plain PNG's."""
    for name, data in PLAIN.items():
        grid = _verdict(data, spec)
        if isinstance(grid[0], str):
            continue  # refused at the probe, by Pillow's path as well
        pixels = decode_image(data, spec)
        assert pixels.shape == (grid[0] * spec.patch_size, grid[1] * spec.patch_size, 3), name


def test_a_plain_png_is_probed_without_opening_it_in_pillow(monkeypatch):
    opened = []
    open_ = Image.open
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append(1) or open_(*args, **kwargs))
    assert probe_image(PLAIN["mode-RGB"], ImageSpec()) == (6, 10)
    assert not opened
    assert probe_image(NOT_PLAIN["exif-orientation-6"], ImageSpec()) == (10, 6)
    assert opened


def test_an_exif_orientation_before_the_pixels_turns_the_grid():
    """What a plain path that let eXIf by would get wrong: Pillow's path turns the grid."""
    assert probe_image(NOT_PLAIN["exif-orientation-6"], ImageSpec()) == (10, 6)
    assert probe_image(PLAIN["mode-RGB"], ImageSpec()) == (6, 10)


@pytest.mark.parametrize("cap", [None, 96 * 160, 96 * 160 - 1, 96 * 160 // 2 - 1],
                         ids=["none", "at-the-size", "warns", "refuses"])
def test_pillows_own_pixel_cap_is_pillows_to_apply(cap, monkeypatch):
    """Above `Image.MAX_IMAGE_PIXELS` Pillow warns, above twice it refuses: the plain path leaves
    such an image to Pillow, so the warning, the refusal and its detail are Pillow's."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", cap)
    data, spec = PLAIN["mode-RGB"], ImageSpec()
    plain = _image._plain_png_size(data, spec)
    assert (plain is not None) == (cap is None or cap >= 96 * 160)
    def verdict_and_warnings(probe):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            verdict = probe()
        return verdict, [(w.category, str(w.message)) for w in caught]

    verdict, warned = verdict_and_warnings(lambda: _verdict(data, spec))
    assert (verdict, warned) == verdict_and_warnings(lambda: _pillows_verdict(data, spec, monkeypatch))
    assert [category for category, _ in warned] == ([Image.DecompressionBombWarning] if cap == 96 * 160 - 1 else [])
    if cap == 96 * 160 // 2 - 1:
        assert verdict[0] == "decompression_bomb" and "Pillow's own cap" in verdict[1]


def test_load_truncated_images_is_refused_before_the_plain_path(monkeypatch):
    from PIL import ImageFile

    from zephon._errors import ConfigurationError

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(ConfigurationError, match="LOAD_TRUNCATED_IMAGES"):
        probe_image(PLAIN["mode-RGB"], ImageSpec())
