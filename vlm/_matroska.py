"""A Matroska or WebM file cut short (a partial copy or download), told from its own bytes.

Matroska gives its streams no duration, so a video's length is where its last packet ends
(`vlm._video._duration`): a file cut short read as a shorter clip, its frames sampled over what
was left, with no error. Its length in time cannot tell: the duration its header announces may
rightly run past the streams (patched in afterwards by a recorder's tool), and timestamps may
start anywhere. Its length in bytes can: a file written to a seekable output declares the size
of its segment, the element holding everything after the EBML header, and a copy that ends
before that is cut. One written live (a browser's MediaRecorder, a stream) leaves the size
unknown, and is not judged.
"""

from __future__ import annotations

__all__ = ["HEAD_BYTES", "cut_short"]

_EBML_HEADER = b"\x1a\x45\xdf\xa3"
_SEGMENT = b"\x18\x53\x80\x67"

HEAD_BYTES = 4096
"""Bytes read from the file's start: an EBML header is a few dozen (its DocType, versions)."""


def cut_short(head: bytes, length: int) -> str | None:
    """Why a file of `length` bytes starting with `head` is cut short, or None: where it holds
    every byte of the segment it declares, declares none (written live), or is not Matroska."""
    if not head.startswith(_EBML_HEADER):
        return None
    size, at = _element_size(head, len(_EBML_HEADER))
    if size is None or head[at + size : at + size + len(_SEGMENT)] != _SEGMENT:
        return None
    size, at = _element_size(head, at + size + len(_SEGMENT))
    if size is None or length >= at + size:
        return None
    return f"cut short: the file ends at byte {length} of the {at + size} its Matroska segment declares " \
           "(a partial copy or download)"


def _element_size(head: bytes, at: int) -> tuple[int | None, int]:
    """The size of the element whose size field starts at `at` (an EBML variable-length integer:
    its first byte's leading zeros count the bytes after it) and where its data begins; None for
    the size when it is unknown (every value bit set) or lies past `head`."""
    if at >= len(head) or head[at] == 0:
        return None, at
    width = 9 - head[at].bit_length()
    if at + width > len(head):
        return None, at
    value = int.from_bytes(head[at : at + width], "big") & ((1 << (7 * width)) - 1)
    return (None if value == (1 << (7 * width)) - 1 else value), at + width
