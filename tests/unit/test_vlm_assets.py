"""Media for the vlm tests: real photographs and video from installed wheels, and hand-made bad
files. The helpers are imported by the other test_vlm_* modules; the tests here check that each
bad file really is what its name says, so a test that uses it proves what it claims.
"""

from __future__ import annotations

import importlib.util
import io
import struct
import zlib
from fractions import Fraction
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from PIL import Image, PngImagePlugin


def package_dir(name: str) -> Path | None:
    """Where an installed package lives, without importing it (some are slow or fragile to import)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def real_file(package: str, relative: str) -> Path:
    """A data file shipped inside an installed wheel, or a skip naming what to install."""
    root = package_dir(package)
    path = None if root is None else root / relative
    assert path is not None and path.is_file(), f"{relative} from the {package} wheel must be installed (test assets)"
    return path


REAL_JPEGS = [("skimage", "data/hubble_deep_field.jpg"), ("skimage", "data/rocket.jpg"),
              ("skimage", "data/retina.jpg"), ("sklearn", "datasets/images/china.jpg"),
              ("sklearn", "datasets/images/flower.jpg")]
REAL_PNGS = [("skimage", "data/astronaut.png"), ("skimage", "data/chelsea.png"),
             ("skimage", "data/coffee.png"), ("skimage", "data/camera.png"), ("skimage", "data/coins.png")]


def encode(array: np.ndarray, fmt: str = "PNG", mode: str | None = None, **save) -> bytes:
    buffer = io.BytesIO()
    image = Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


@cache
def gradient(height: int = 96, width: int = 160) -> np.ndarray:
    """A smooth synthetic RGB picture (distinct rows and columns, so flips and rotations show)."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                     (x + y) * 255 // max(width + height - 2, 1)], axis=-1).astype(np.uint8)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    """One PNG chunk: length, type, body and its checksum."""
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR announces width x height (8-bit RGB) and that holds no pixel data at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IEND", b"")


def stored_png(pixels: np.ndarray, pieces: int = 1) -> bytes:
    """An 8-bit RGB PNG whose deflate stream stores the rows as they are (no compression), split
    over `pieces` IDAT chunks: a byte changed in its pixel data is a pixel changed, whichever zlib
    wrote or reads it, and the file can be cut at a chunk boundary inside its pixel data."""
    height, width = pixels.shape[:2]
    stream = zlib.compress(b"".join(b"\x00" + row.tobytes() for row in pixels), 0)
    step = -(-len(stream) // pieces)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr)
            + b"".join(png_chunk(b"IDAT", stream[i : i + step]) for i in range(0, len(stream), step))
            + png_chunk(b"IEND", b""))


def cmyk_jpeg() -> bytes:
    return encode(gradient(), "JPEG", mode="CMYK", quality=95)


def sixteen_bit_png() -> bytes:
    """A 16-bit greyscale PNG whose values span the whole 0..65535 range."""
    ramp = (np.linspace(0, 65535, 96 * 160).reshape(96, 160)).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(ramp).save(buffer, "PNG")
    return buffer.getvalue()


def palette_alpha_png() -> bytes:
    """A palette PNG with a tRNS chunk: index 0 fully transparent, the rest opaque red/green."""
    indices = np.zeros((64, 96), np.uint8)
    indices[:, 32:64] = 1
    indices[:, 64:] = 2
    image = Image.fromarray(indices, "P")
    image.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * (253 * 3))
    buffer = io.BytesIO()
    image.save(buffer, "PNG", transparency=0)
    return buffer.getvalue()


def rgba_png() -> bytes:
    """Left half transparent black, right half opaque blue."""
    array = np.zeros((64, 96, 4), np.uint8)
    array[:, 48:] = (0, 0, 255, 255)
    return encode(array)


def truncated_jpeg() -> bytes:
    data = encode(gradient(480, 640), "JPEG", quality=90)
    return data[: len(data) // 2]


def multi_picture_jpeg() -> tuple[bytes, bytes]:
    """An MPO of two 1600x960 pictures, as phones and 3D cameras write, and the same bytes with
    the multi-picture marker renamed, which Pillow then opens as a JPEG of the first picture."""
    first = Image.fromarray(gradient()).resize((1600, 960), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    first.save(buffer, "MPO", save_all=True, append_images=[first.transpose(Image.Transpose.ROTATE_180)],
               quality=95)
    mpo = buffer.getvalue()
    at = mpo.index(b"MPF\0")
    return mpo, mpo[:at] + b"XXX\0" + mpo[at + 4 :]


def rotated_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(gradient(), "JPEG", quality=95, exif=exif.tobytes())


def raw_profile_exif_png(orientation: int) -> bytes:
    """A PNG whose orientation is in a "Raw profile type exif" text chunk before its pixel data,
    as ImageMagick 6 writes it (hex EXIF after a blank line, a name and a length)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    raw = exif.tobytes()
    hexed = raw.hex()
    text = f"\nexif\n{len(raw):8d}\n" + "\n".join(hexed[i : i + 72] for i in range(0, len(hexed), 72)) + "\n"
    info = PngImagePlugin.PngInfo()
    info.add_text("Raw profile type exif", text)
    return encode(gradient(96, 160), pnginfo=info)


def xmp_png(orientation: int) -> bytes:
    """A PNG whose orientation is only in its XMP packet, an iTXt chunk before its pixel data."""
    xmp = ('<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="{orientation}"/>'
           "</rdf:RDF></x:xmpmeta>")
    info = PngImagePlugin.PngInfo()
    info.add_itxt("XML:com.adobe.xmp", xmp)
    return encode(gradient(96, 160), pnginfo=info)


def make_video(path: Path, frames: int = 30, fps: int | Fraction = 10, size=(128, 96), codec: str = "mpeg4") -> Path:
    """A small video whose frame k is filled with grey level 8*k, so a frame's index reads back
    from its pixels (every frame a keyframe at gop_size=1, or a GOP of 10 otherwise)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = 10
        for k in range(frames):
            picture = np.full((size[1], size[0], 3), 8 * k, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# -- the bad files are what they claim to be --------------------------------------------------

def test_header_only_png_announces_twenty_thousand_squared_without_pixels():
    data = png_header_only(20000, 20000)
    assert len(data) < 100
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(data))


def test_bad_mode_fixtures_open_in_the_modes_they_are_named_for():
    assert Image.open(io.BytesIO(cmyk_jpeg())).mode == "CMYK"
    assert Image.open(io.BytesIO(sixteen_bit_png())).mode.startswith("I")
    palette = Image.open(io.BytesIO(palette_alpha_png()))
    assert palette.mode == "P" and "transparency" in palette.info
    assert Image.open(io.BytesIO(rgba_png())).mode == "RGBA"


def test_truncated_jpeg_fails_to_load_in_plain_pillow():
    image = Image.open(io.BytesIO(truncated_jpeg()))
    with pytest.raises(OSError, match="truncated"):
        image.load()
