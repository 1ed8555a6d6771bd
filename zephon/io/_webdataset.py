"""WebDataset shards (.tar): consecutive members sharing a key form one record.

The key of a member is its path up to the first dot of its basename (the directory part included),
and the rest is its extension: `imgs/0001.seg.png` has key `imgs/0001` and extension `seg.png`.
A record is {"__key__": key, ext: payload, ...}. The extension names its field in lower case, as
the WebDataset library's grouping has it: camera dumps and Windows tools write `0001.JPG`, which
read as a field "JPG" made its sample `missing_image` (and `0001.TXT`, `missing_field`) while the
tar held both. So `0001.jpg` and `0001.JPG` in one record name one field twice: `duplicate_member`.
The key keeps its case: `A.jpg` and `a.jpg` are two samples, as their writer named them.
Payloads stay raw bytes, except an extension whose last part is `txt` (decoded as UTF-8 str) or
`json` (parsed), the two that text pipelines read. A UTF-8 byte order mark opening such a member
is not part of its text, as it is not of a text or JSON Lines shard's: `json.loads` refuses a str
that starts with one, so a caption file saved by a Windows editor made its whole sample
`malformed_json`.
Members without an extension and directories are not part of any record, nor is a member whose
extension is a field the reader sets itself (`0001.__key__`, in any case): its payload would
overwrite the record's key. Nor is a hidden member, whose basename starts with a dot (as the
WebDataset library's own key split has it): tars made on macOS hold an AppleDouble companion
`._0001.jpg` beside each `0001.jpg`, and a companion read as a member of key `imgs/` (an empty
stem) cut every sample into two half-records between junk ones, each of them then skipped. Planning
and reading skip the same members, so they count the same records.
A member that is a link (hard or symbolic), a FIFO or a device holds no payload in the tar; `tar`
stores a hard link for a file it met before under another name. Its record is skipped as
`not_a_file` (left out, the member was lost unsaid: a record of links alone was missing from the
plan, and a record with one among its files was handed out without it).

Record counting walks the tar headers only (seeking over member data), remembering the header
offset of every SEEK_STRIDE-th record so that a chunk read starts near its first record. Plain
headers (regular files and directories) are read by `_tar_walk` and payloads straight from the
file, with the members and errors `tarfile` gives; every other header is `tarfile`'s to read.

A tar compressed whole (`.tar.gz`, `.tgz`, `.tar.zst`, `.tzst`, as the WebDataset library reads
them too) is walked the same way over its decompressed stream (`_decompressed_view`): its
offsets are the decompressed stream's, and beside each seek point planning keeps where a decoder
may start before it (the start of its gzip member or zstd frame). A chunk read decompresses from
there, or from a resume point this process noted in a gzip stream, up to its chunk's end:
planning warns of shards whose reads decompress much more than their chunks
(`_decode_units`), as of compressed JSON Lines; a tar in one stream planned with a seekable copy
(`_seekable_copy`, written from the view as planning decompresses it) is read from the copy's
frames instead. Decompressed, the tar is the plain tar's bytes, so a compressed shard plans and
reads as its plain tar does, batch for batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

import numpy as np

from . import _resume_points
from ._decompressed_view import DecompressedView
from ._format import STREAM_READ_AHEAD, ShardFile, ShardScan
from ._lines import UTF8_BOM
from ._policy import DUPLICATE_MEMBER, INVALID_UTF8, NOT_A_FILE, Bad, Slot, fill_truncated, parse_json
from ._resume_points import single_stream_units
from ._seekable_copy import FramedCopy

if TYPE_CHECKING:
    import tarfile

__all__ = ["WebDataset", "split_member_name"]

SEEK_STRIDE = 16  # walking tar headers is slow in Python; a record is large, so its seek point is cheap
KEY = "__key__"  # the field holding a record's key; no member extension may take its place


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, extension in lower case: the field it fills) of a tar member, or None when the basename
    has no dot or starts with one."""
    directory, slash, basename = name.rpartition("/")
    stem, dot, extension = basename.partition(".")
    if not dot or not stem:
        return None
    return directory + slash + stem, extension.lower()


# Member names that are not PAX's (always UTF-8) are bytes; tarfile decodes them with the machine's
# file-system encoding unless told, so a `__key__` (and a record's fields) would depend on the locale
# of the machine reading the shard. Names are read as UTF-8, as tar writers on every platform write them.
NAME_ENCODING = "utf-8"


@dataclass(frozen=True)
class WebDataset:
    name: str = "webdataset"
    copies_streams: ClassVar[bool] = True  # its scans copy one stream where asked (`_seekable_copy`)
    decode_units: ClassVar[str] = "gzip members, zstd frames or stretches of a gzip stream between resume points"
    stops_at_chunk_end: ClassVar[bool] = True
    how_to_rewrite: ClassVar[str] = (
        "stored as plain tars (gunzip, zstd -d: a read seeks into those; images gain little from compression "
        "anyway) or compressed in small members or frames, a read entering at the last before its chunk (bgzip "
        "writes gzip members of 64 KiB, pzstd -1 zstd frames of 2 MiB), or planned with Dataset.from_path(..., "
        "scan_cache=DIR, seekable_copies=True) (a copy of each shard in one stream kept in such frames in DIR)"
    )

    @property
    def scan_key(self) -> str:
        return f"webdataset stride={SEEK_STRIDE}"

    @staticmethod
    def seek_ndim(compression: str | None) -> int:
        """A plain tar's seek is one row, each seek point's offset; a compressed one's three:
        that offset in the decompressed stream, and where a decoder may start before it, in the
        shard and in the decompressed stream (`_with_entries`)."""
        return 1 if compression is None else 2

    @staticmethod
    def indexes(table: np.ndarray, num_records: int) -> bool:
        """A compressed tar's three rows: a point every SEEK_STRIDE records, each at or after the
        decompressed start of its entry's member, those starts ascending."""
        rows, points = table.shape
        return (rows == 3 and points == -(-num_records // SEEK_STRIDE) and not np.any(table[2] < 0)
                and not np.any(table[2] > table[0]) and not np.any(np.diff(table[2]) < 0))

    def unit_bounds(self, seek: np.ndarray | None, num_records: int, compression: str | None, raw_bytes: int,
                    read_together: int) -> np.ndarray | None:
        """For planning's warning (`_decode_units`): a compressed tar's reads decompress from the
        entry before their chunk, or in one gzip stream from about the resume point before it."""
        if compression is None or seek is None or num_records == 0:
            return None
        entries = seek[2]
        if entries[-1] > 0:  # several members or frames: a unit runs from the first seek point of each
            firsts = np.flatnonzero(np.diff(entries, prepend=-1)) * SEEK_STRIDE
            return np.append(firsts, num_records)
        return single_stream_units(num_records, compression, raw_bytes, read_together)

    def scan(self, shard: ShardFile) -> ShardScan:
        copy = FramedCopy(shard.copy_to) if shard.copy_to is not None and shard.compression is not None else None
        try:
            return self._scan(shard, copy)
        except BaseException:
            if copy is not None:
                copy.abandon()
            raise

    def _scan(self, shard: ShardFile, copy: FramedCopy | None) -> ShardScan:
        import tarfile  # here, not at the top: it brings shutil and four codecs to every process that reads no tar

        count, seek = 0, []
        frame_starts = array("q")
        with shard.open() as raw:
            f = raw if shard.compression is None else DecompressedView(raw, shard.compression,
                                                                        frame_starts=frame_starts, copy=copy)
            try:
                tar = tarfile.TarFile(fileobj=f, mode="r", encoding=NAME_ENCODING)
            except tarfile.ReadError as error:
                if f is not raw and f.cut:  # cut before its first header ended: not "empty file"
                    cut = f"truncated header: {shard.compression} stream ends inside a frame"
                    raise tarfile.ReadError(cut) from error
                raise
            previous = None
            try:
                for member, key, _ in _members(tar):
                    if key != previous:
                        if count % SEEK_STRIDE == 0:
                            seek.append(member.offset)
                        count, previous = count + 1, key
            except (tarfile.ReadError, EOFError):
                # Cut short: the keys seen are the shard's records; reading reports the damaged ones.
                pass
            else:
                _check_archive_end(f, tar.offset)
            if shard.compression is None:
                return ShardScan(count, np.asarray(seek, dtype=np.int64))
            # The tar's size, as a plain tar's file size counts (`Dataset` weighs chunks by it).
            decompressed = f.decompressed_length()
        points = np.asarray(seek, dtype=np.int64)
        if copy is not None and copy.kept(whole_stream=len(frame_starts) == 2 and not f.cut):
            return ShardScan(count, _with_entries(points, copy.frame_starts), raw_bytes=decompressed, copy=copy.path)
        return ShardScan(count, _with_entries(points, frame_starts), raw_bytes=decompressed)

    @staticmethod
    def stream_seek(seek: np.ndarray) -> np.ndarray:
        """The seek of a tar in one stream from its copy's: the same points, each entered at the start."""
        return np.stack([seek[0], np.zeros_like(seek[0]), np.zeros_like(seek[0])])

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        assert seek is not None, "a webdataset shard is always scanned with seek points"
        import tarfile

        from ._tar_walk import member_payload
        point = start // SEEK_STRIDE
        index = point * SEEK_STRIDE - 1
        slots: list[Slot] = []
        record: dict[str, Any] | None = None
        current = None  # the key of `record`, kept apart from the payloads the record collects
        duplicate = None  # why `record` holds one field twice: its first member naming a field already held
        not_a_file = None  # what the first member of `record` that holds no payload is
        detail = "shard has fewer records than when it was planned"
        with shard.open(read_ahead=_read_ahead(shard, seek, point, stop)) as raw:
            f = _positioned(raw, shard, seek, point)
            try:
                tar = tarfile.TarFile(fileobj=f, mode="r", encoding=NAME_ENCODING)
                for member, key, extension in _members(tar):
                    if key != current:
                        if record is not None and index >= start:
                            slots.append(_decode(record, duplicate, not_a_file))
                        index += 1
                        if index >= stop:
                            record = None
                            break
                        current, record, duplicate, not_a_file = key, {KEY: key}, None, None
                    if index >= start:
                        if extension in record and duplicate is None:
                            duplicate = f"{member.name} is its record's second member for field {extension!r}"
                        if not member.isfile():
                            not_a_file = not_a_file or _what_it_is(member)
                            record[extension] = b""
                            continue
                        record[extension] = member_payload(tar, member)
                if record is not None and index >= start:
                    if _ends_cut(f, tar.offset):
                        detail = "tar cut short: its last record may lack members"
                    else:
                        slots.append(_decode(record, duplicate, not_a_file))
            except (tarfile.ReadError, EOFError) as error:
                detail = f"tar cut short: {error}"
        return fill_truncated(slots, stop - start, detail)


# Read past a chunk's planned bytes: the header of the record after it (which ends the chunk's
# walk), a PAX or GNU long-name header before it included, or the end-of-archive blocks.
_NEXT_HEADERS = 4096


def _with_entries(seek: np.ndarray, frame_starts: array) -> np.ndarray:
    """A compressed tar's seek (`WebDataset.seek_ndim`) from its seek points' decompressed offsets
    and where its members or frames begin (`decompressed_blocks`' pairs): for each point, the last
    one beginning at or before it."""
    starts = np.frombuffer(frame_starts, dtype=np.int64).reshape(-1, 2) if frame_starts else np.zeros((1, 2), np.int64)
    entry = np.searchsorted(starts[:, 1], seek, side="right") - 1
    return np.stack([seek, starts[entry, 0], starts[entry, 1]])


def _positioned(raw: BinaryIO, shard: ShardFile, seek: np.ndarray, point: int) -> BinaryIO | DecompressedView:
    """The tar of `raw` at seek point `point`: the file itself, or a compressed shard's stream
    entered at the point's entry (or a resume point after it) and decompressed up to it."""
    if shard.compression is None:
        raw.seek(int(seek[point]))
        return raw
    entry = (int(seek[1, point]), int(seek[2, point]))
    f = DecompressedView(raw, shard.compression, entry=entry, resume_key=_resume_points.key_of(shard))
    f.seek(int(seek[0, point]))
    return f


def _read_ahead(shard: ShardFile, seek: np.ndarray, point: int, stop: int) -> int:
    """What a chunk read of records up to `stop` from seek point `point` has a remote file fetch
    beyond its first read (a 512-byte header): the chunk's records up to the seek point at or after
    `stop` (the end of the shard after the last), and the headers after them, so that the walk
    reads the chunk in one request; STREAM_READ_AHEAD where the shard's size is not known, or where
    it is compressed (its chunk's compressed bytes are not known)."""
    if shard.compression is not None:
        return STREAM_READ_AHEAD
    end_point = -(-stop // SEEK_STRIDE)
    end = int(seek[end_point]) if end_point < len(seek) else shard.planned_nbytes
    return STREAM_READ_AHEAD if end is None else max(0, end - int(seek[point])) + _NEXT_HEADERS


def _ends_cut(f, offset: int) -> bool:
    """Whether a walk that ended at `offset` ended at a cut, not at the end-of-archive blocks.

    `tarfile` ends its walk without an error at the end of the file or at a header cut short, as
    at the end-of-archive blocks, so a tar cut before the header of a record's next member (before
    or after planning) handed that record out without the member. A walk that ends anywhere but in
    zeros (the end-of-archive blocks, whole or cut) may have lost members of its last record; a
    cut exactly between two records cannot be told from that and also counts it.
    """
    import tarfile

    f.seek(offset)
    block = f.read(tarfile.BLOCKSIZE)
    return not block or block.count(0) != len(block)


def _check_archive_end(f, offset: int) -> None:
    """Refuse a tar whose walk stopped at a damaged header rather than at its end.

    `tarfile` ends the walk, as if the archive ended, at any header past the first that does not
    parse, so one flipped byte in a header would drop every later record from the plan unseen.
    The walk ended properly where the next 512-byte block is the end-of-archive zero block, or is
    missing or short: a tar cut between records or inside a header, which planning cannot tell
    from a shorter one.
    """
    import tarfile

    f.seek(offset)
    block = f.read(tarfile.BLOCKSIZE)
    if len(block) == tarfile.BLOCKSIZE and block.count(0) != tarfile.BLOCKSIZE:
        raise tarfile.ReadError(f"damaged tar header at byte {offset}: the members after it cannot be found")


def _members(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str, str]]:
    """Members that belong to a record, with their key and extension, in tar order: every one but
    directories, whose names are no record's (`imgs.v2/` holds records, it is none)."""
    from ._tar_walk import next_member  # imports tarfile: only where a tar is read

    while (member := next_member(tar)) is not None:
        # TarFile keeps every header it has read; a shard can hold millions, and we never look back.
        tar.members.clear()
        split = None if member.isdir() else split_member_name(member.name)
        if split is not None and split[1] != KEY:
            yield member, *split


_NOT_A_FILE_KINDS = {"islnk": "a hard link to", "issym": "a symbolic link to", "isfifo": "a FIFO",
                     "ischr": "a character device", "isblk": "a block device"}


def _what_it_is(member: tarfile.TarInfo) -> str:
    """Why a member holds no payload, in words: `imgs/1.jpg is a hard link to imgs/0.jpg`."""
    for test, kind in _NOT_A_FILE_KINDS.items():
        if getattr(member, test)():
            target = f" {member.linkname}" if member.issym() or member.islnk() else ""
            return f"{member.name} is {kind}{target}, not a file"
    return f"{member.name} is a member of tar type {member.type!r}, not a file"


def _decode(record: dict[str, Any], duplicate: str | None, not_a_file: str | None) -> Slot:
    if duplicate is not None:  # the tar holds two payloads for one field; keeping either would be a guess
        return Bad(DUPLICATE_MEMBER, duplicate)
    if not_a_file is not None:  # the record's member is elsewhere, or nowhere: its payload is not here
        return Bad(NOT_A_FILE, not_a_file)
    for extension, payload in record.items():
        last = extension.rpartition(".")[2]
        if extension == KEY or last not in ("txt", "json"):
            continue
        try:
            text = payload.removeprefix(UTF8_BOM).decode("utf-8")
        except UnicodeDecodeError as error:
            return Bad(INVALID_UTF8, f"{extension}: {error}")
        if last == "txt":
            record[extension] = text
            continue
        value = parse_json(text, f"{extension}: ")
        if isinstance(value, Bad):
            return value
        record[extension] = value
    return record

