"""Walking a tar opened for reading with `tarfile`, at a fraction of its per-member cost, with its results.

`TarFile.next()` parses every header in Python (`calc_chksums` unpacks the 512 bytes twice into
tuples, `nti` decodes each number field through a str), and `extractfile` builds a file object and a
buffered reader for each payload: about 20 us a member, more than a WebDataset record's decoding
costs when the record is text. Most headers are plain: a regular file or a directory, with number
fields in the shapes tar writers use and a checksum that matches. `next_member` reads those itself
and hands every other header (links, PAX and GNU extension headers, a global PAX header met before,
devices, base-256 or odd number fields, a bad checksum, the end-of-archive zeros, a header cut
short) to `tar.next()`, with the file where tarfile left it, so tarfile's own members, errors and
end of walk stand wherever anything is unusual. A member it reads is the `TarInfo` tarfile would
have built (every field, `tar.offset` and the file's position after it, and `tar.members`).
"""

from __future__ import annotations

import re
import tarfile
from zlib import adler32

__all__ = ["member_payload", "next_member"]

BLOCKSIZE = tarfile.BLOCKSIZE


def _number_field(width: int) -> bytes:
    """A header number field (`width` bytes) in a shape whose value `tarfile.nti` reads as its digits:
    width-1 octal digits ended by NUL or space (Python, GNU tar), width-2 digits ended by space and
    NUL or NUL and space (bsdtar; every writer's checksum), or all NULs (0). The lookahead captures
    the digits; each shape ends the run of digits inside the field."""
    return rb"(?=([0-7]*))(?:[0-7]{%d}[\0 ]|[0-7]{%d}(?: \0|\0 )|\0{%d})" % (width - 1, width - 2, width)


# mode, uid, gid (8), size, mtime (12), chksum (8) at 100..156, the type at 156, devmajor and devminor
# (8 each) at 329..345: the fields `TarInfo._frombuf` reads with `nti`. Only a regular file (b"0",
# or b"\0" as v7 tars write it) or a directory takes this path.
_PLAIN_HEADER = re.compile(
    rb"[\x00-\xff]{100}" + _number_field(8) * 3 + _number_field(12) * 2 + _number_field(8)
    + rb"([05\0])" + rb"[\x00-\xff]{172}" + _number_field(8) * 2
)


def _unsigned_checksum(buf: bytes) -> int:
    """`calc_chksums(buf)[0]`: the sum of the header's bytes with the checksum field taken as spaces.
    Adler-32's low half is its data's byte sum modulo 65521, and no piece here sums past 65521
    (256 bytes at most: 65280), so three C calls give the exact sum."""
    return (256 + (adler32(buf[:148], 0) & 0xFFFF) + (adler32(buf[156:356], 0) & 0xFFFF)
            + (adler32(buf[356:], 0) & 0xFFFF))


def _text(buf: bytes, start: int, stop: int, encoding: str, errors: str) -> str:
    """`tarfile.nts(buf[start:stop], ...)`: the field up to its first NUL, decoded."""
    if not buf[start]:  # most often: an empty link name, prefix, user or group name
        return ""
    end = buf.find(0, start, stop)
    return buf[start:stop if end < 0 else end].decode(encoding, errors)


def _plain_member(buf: bytes, offset: int, encoding: str, errors: str) -> tarfile.TarInfo | None:
    """The TarInfo `_frombuf` and `_proc_builtin` build from `buf`, the header at `offset`, or None
    when it is not a plain one (tarfile decides what it is)."""
    fields = _PLAIN_HEADER.match(buf)
    if fields is None:
        return None
    mode, uid, gid, size, mtime, chksum, kind, devmajor, devminor = fields.groups()
    chksum = int(chksum, 8) if chksum else 0
    if chksum != _unsigned_checksum(buf):
        # The end-of-archive zeros land here too (a stored 0 against 256). A header summed with
        # signed bytes (old Sun tars) is tarfile's to accept.
        return None
    try:
        end = buf.find(0, 0, 100)  # decoded even when empty: an unknown encoding raises, as in tarfile
        name = buf[:100 if end < 0 else end].decode(encoding, errors)
        linkname = _text(buf, 157, 257, encoding, errors)
        uname = _text(buf, 265, 297, encoding, errors)
        gname = _text(buf, 297, 329, encoding, errors)
        prefix = _text(buf, 345, 500, encoding, errors)
    except (ValueError, LookupError):  # a name the encoding refuses: tarfile raises its own error
        return None
    if kind == tarfile.AREGTYPE and name.endswith("/"):
        kind = tarfile.DIRTYPE  # a v7 tar's directory
    if kind == tarfile.DIRTYPE:
        name = name.rstrip("/")
    if prefix:  # ustar keeps a long name's directories apart
        name = prefix + "/" + name
        if kind == tarfile.DIRTYPE:
            name = name.rstrip("/")  # as _proc_builtin strips it again
    member = tarfile.TarInfo(name)
    member.mode = int(mode, 8) if mode else 0
    member.uid = int(uid, 8) if uid else 0
    member.gid = int(gid, 8) if gid else 0
    member.size = int(size, 8) if size else 0
    member.mtime = int(mtime, 8) if mtime else 0
    member.chksum = chksum
    member.type = kind
    member.linkname = linkname
    member.uname = uname
    member.gname = gname
    member.devmajor = int(devmajor, 8) if devmajor else 0
    member.devminor = int(devminor, 8) if devminor else 0
    member.offset = offset
    member.offset_data = offset + BLOCKSIZE
    return member


def next_member(tar: tarfile.TarFile) -> tarfile.TarInfo | None:
    """`tar.next()`, reading a plain header without tarfile's Python parsing.

    The file is left where `tar.next()` would leave it (after the header), so a caller may read
    payloads from it between calls as with tarfile. Not thread-safe, as `TarFile` is not.
    """
    if (tar.firstmember is not None or tar.pax_headers or tar.offset == 0 or tar.closed
            or tar.mode != "r" or tar.tarinfo is not tarfile.TarInfo):
        # The first member is parsed already; a global PAX header patches later members; at
        # offset 0 `next()` ends a walk whose first header was the end; the rest raise or differ.
        return tar.next()
    f = tar.fileobj
    position = f.tell()
    offset = tar.offset
    if position != offset:
        f.seek(offset)
    buf = f.read(BLOCKSIZE)
    member = _plain_member(buf, offset, tar.encoding, tar.errors) if len(buf) == BLOCKSIZE else None
    if member is None:
        # Back where tarfile expects the file: `next()` tells a walk past the end of the file
        # (a member's data cut short: "unexpected end of data") by the position differing.
        f.seek(position)
        return tar.next()
    tar.offset = member.offset_data
    if member.isreg():
        tar.offset += -(-member.size // BLOCKSIZE) * BLOCKSIZE  # its data blocks
    if not getattr(tar, "stream", False):  # Python 3.14's streaming TarFile keeps no members
        tar.members.append(member)
    return member


def member_payload(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """`tar.extractfile(member).read()`, read straight from the file for a regular, non-sparse member
    (no file object and buffered reader per member). A payload cut short raises tarfile's
    `ReadError("unexpected end of data")`, as tarfile's reader does."""
    if not member.isreg() or member.sparse is not None:
        return tar.extractfile(member).read()
    f = tar.fileobj
    f.seek(member.offset_data)
    payload = f.read(member.size)
    if len(payload) != member.size:
        raise tarfile.ReadError("unexpected end of data")
    return payload
