"""A PNG's chunks checked from its own bytes: what Pillow's reader lets by or misnames.

A PNG is a signature and a run of chunks (length, type, data, CRC-32). Pillow checks the chunks
before the pixel data when it opens one, and refuses a header chunk whose checksum fails as bytes
no format knows; past them its decoder skips the checksums of the pixel data (the IDAT chunks).
Read here without decoding, so `vlm._image` names a damaged header chunk for what it is and gives
a PNG one verdict on its pixel data whether it is decoded before or after packing; and reads a
plain PNG's size from its IHDR chunk (`plain_size`), so probing it needs no `Image.open`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Mapping

from ._errors import ImageDecodeError

__all__ = ["check_pixel_data", "header_chunk_fault", "plain_size"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The signature, then the IHDR chunk: length, type, width, height, bit depth, colour type,
# compression, filter and interlace bytes, CRC-32.
_IHDR = struct.Struct(">I4sIIBBBBB")
_IHDR_END = len(_SIGNATURE) + _IHDR.size  # where IHDR's CRC-32 starts
_LARGEST_SIDE = 2**31 - 1  # the PNG standard's; Pillow reads the four bytes unsigned

# The chunks `plain_size` lets stand between IHDR and the first IDAT, with the length each must
# have (None: any). Pillow's PNG reader (Pillow 13, Pillow-SIMD 12.1, alike here) handles each
# without a way to fail on whole, checksummed data of that length, and none sets the size or the
# mode or holds an orientation: PLTE and tRNS are stored, gAMA, cHRM, sRGB and pHYs parsed into
# `info` (Pillow 13 refuses them shorter than these lengths, 12.1 fails unpacking them, and
# 12.1's cHRM any length not a multiple of 4: the standard's lengths are safe in both), bKGD,
# sBIT and tIME have no handler and are skipped.
_PLAIN_CHUNK_LENGTHS: dict[bytes, int | None] = {
    b"PLTE": None, b"bKGD": None, b"sBIT": None, b"tIME": None,
    b"gAMA": 4, b"cHRM": 32, b"sRGB": 1, b"pHYs": 9,
}
# tRNS: the least length Pillow's reader unpacks for each mode it gives (2 bytes of a grey level,
# 6 of an RGB colour; a palette's alpha bytes are stored as they are, and LA and RGBA ignore it).
# Pillow 13 refuses a shorter one, 12.1 fails unpacking it. A mode not named: not plain.
_TRNS_LEAST_LENGTH = {"P": 0, "LA": 0, "RGBA": 0, "1": 2, "L": 2, "I;16": 2, "RGB": 6}


def plain_size(data: bytes, modes: Mapping[tuple[int, int], tuple[str, ...]]) -> tuple[int, int] | None:
    """(width, height) of a plain PNG, read from its IHDR chunk; None for any other bytes.

    `modes` is Pillow's own table of the (bit depth, colour type) pairs its PNG reader opens
    (`PngImagePlugin._MODES`), so the pairs accepted here are those of the Pillow installed.
    Plain: the signature; IHDR first, 13 bytes, checksum right, both sides positive, compression
    and filter 0, interlace 0 or 1, a pair in `modes`; then up to the first IDAT only chunks in
    `_PLAIN_CHUNK_LENGTHS` (or tRNS) of the lengths allowed there, whole, checksums right. Those
    are the bytes `Image.open` opens as a PNG of this size with no orientation in its metadata,
    so `probe_image` reads their grid without it. None means only "ask Pillow", never a fault:
    whatever is not plain is refused or accepted by Pillow exactly as before. The pixel count is
    for the caller to hold against its limits and Pillow's.
    """
    if len(data) < _IHDR_END + 4 or not data.startswith(_SIGNATURE):
        return None
    length, kind, width, height, depth, colour, compression, filter_method, interlace = _IHDR.unpack_from(
        data, len(_SIGNATURE))
    if (length != 13 or kind != b"IHDR" or compression or filter_method or interlace > 1
            or not (0 < width <= _LARGEST_SIDE and 0 < height <= _LARGEST_SIDE)):
        return None
    opened_as = modes.get((depth, colour))  # (mode, rawmode)
    view = memoryview(data)
    if opened_as is None or not _checksum_holds(view, len(_SIGNATURE), _IHDR_END):
        return None
    for position, kind, end in _chunks(view, _IHDR_END + 4):
        if kind == b"IDAT":
            return width, height
        length = end - position - 8
        if kind == b"tRNS":
            least = _TRNS_LEAST_LENGTH.get(opened_as[0])
            if least is None or length < least:
                return None
        elif kind not in _PLAIN_CHUNK_LENGTHS or _PLAIN_CHUNK_LENGTHS[kind] not in (None, length):
            return None
        if end + 4 > len(view) or not _checksum_holds(view, position, end):
            return None
    return None


def header_chunk_fault(data: bytes) -> str | None:
    """The chunk before a PNG's pixel data whose CRC-32 is wrong, which Pillow's PNG reader refuses
    and `Image.open` then reports as bytes no format knows; None for anything else.

    A bit flipped in transit in a header chunk (IHDR, a palette, text) is a damaged PNG, not an
    unknown format: the detail names the chunk as `check_pixel_data` names a damaged IDAT."""
    if not data.startswith(_SIGNATURE):
        return None
    view = memoryview(data)
    for position, kind, end in _chunks(view):
        if kind == b"IDAT" or end + 4 > len(view):
            return None
        if not _checksum_holds(view, position, end):
            return f"the PNG's {kind.decode('ascii', 'backslashreplace')} chunk at byte {position} fails its checksum"
    return None


def check_pixel_data(data: bytes | memoryview) -> None:
    """Refuse a PNG whose pixel data, its run of IDAT chunks, is cut short or fails a checksum.

    `decode_image` and `probe_image` both make this check, so a PNG gets one verdict whether it
    is decoded before or after packing. Pillow checks the chunks before the pixel data when it
    opens a PNG; past them its decoder and its `verify` disagree. The decoder skips the IDAT
    checksums, so a damaged chunk whose deflate data still inflates gave wrong pixels; `verify`
    wants every chunk through IEND, so it refused a PNG whose pixels are all there but whose
    trailer (IEND, or metadata after the pixels) was lost, which the decoder reads as it should.
    What follows the pixel data is ignored here as in the decoder. Whether the deflate stream ends
    properly, i.e. every pixel is present, only inflating can tell: a PNG cut exactly between two
    IDAT chunks passes here and fails in the decoder as truncated.
    """
    view = memoryview(data)
    in_pixels = False  # Pillow's open found the signature and the first IDAT
    for position, kind, end in _chunks(view):
        if kind != b"IDAT":
            if in_pixels:
                return
            continue
        in_pixels = True
        if end + 4 > len(view):
            raise ImageDecodeError("truncated_image", f"the PNG ends inside the IDAT chunk at byte {position}")
        if not _checksum_holds(view, position, end):
            raise ImageDecodeError("corrupt_image", f"the PNG's IDAT chunk at byte {position} fails its checksum")


def _chunks(view: memoryview, position: int = len(_SIGNATURE)) -> Iterator[tuple[int, bytes, int]]:
    """(where it starts, its type, where its CRC-32 starts) of each chunk a PNG's bytes hold whole
    headers of, from the one at `position` (by default the one after the signature) on; the last
    may be cut short."""
    while position + 8 <= len(view):
        length, kind = struct.unpack_from(">I4s", view, position)
        end = position + 8 + length
        yield position, kind, end
        position = end + 4


def _checksum_holds(view: memoryview, position: int, end: int) -> bool:
    """Whether the CRC-32 at `end` is that of the chunk at `position` (its type and data)."""
    return zlib.crc32(view[position + 4 : end]) == struct.unpack_from(">I", view, end)[0]
