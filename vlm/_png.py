"""A PNG's chunks checked from its own bytes: what Pillow's reader lets by or misnames.

A PNG is a signature and a run of chunks (length, type, data, CRC-32). Pillow checks the chunks
before the pixel data when it opens one, and refuses a header chunk whose checksum fails as bytes
no format knows; past them its decoder skips the checksums of the pixel data (the IDAT chunks).
Read here without decoding, so `vlm._image` names a damaged header chunk for what it is and gives
a PNG one verdict on its pixel data whether it is decoded before or after packing.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

from ._errors import ImageDecodeError

__all__ = ["check_pixel_data", "header_chunk_fault"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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


def _chunks(view: memoryview) -> Iterator[tuple[int, bytes, int]]:
    """(where it starts, its type, where its CRC-32 starts) of each chunk a PNG's bytes hold whole
    headers of, from the one after the signature on; the last may be cut short."""
    position = len(_SIGNATURE)
    while position + 8 <= len(view):
        length, kind = struct.unpack_from(">I4s", view, position)
        end = position + 8 + length
        yield position, kind, end
        position = end + 4


def _checksum_holds(view: memoryview, position: int, end: int) -> bool:
    """Whether the CRC-32 at `end` is that of the chunk at `position` (its type and data)."""
    return zlib.crc32(view[position + 4 : end]) == struct.unpack_from(">I", view, end)[0]
