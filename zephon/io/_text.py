"""Plain-text shards (.txt, optionally .gz/.zst): a record per line, or a record per file."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._errors import ConfigurationError
from ._compression import decompressed_blocks
from ._format import STREAM_READ_AHEAD, ShardFile, ShardScan
from ._lines import SEEK_STRIDE, UTF8_BOM, DecompressedFromFrames, read_lines, scan_lines
from ._policy import INVALID_UTF8, Bad, Slot, fill_truncated

__all__ = ["Text", "TEXT_UNITS"]

TEXT_UNITS = ("line", "file")


@dataclass(frozen=True)
class Text(DecompressedFromFrames):
    """Records are {"text": str}. With `unit="line"` empty lines stay records (a trailing b"\\r" is
    dropped), so that later stages count them as empty documents instead of losing them unseen.
    With `unit="file"` a non-empty file is one record holding its whole content. A UTF-8 byte order
    mark opening a shard is not part of its text.
    """

    unit: str = "line"
    name: str = "text"

    def __post_init__(self) -> None:
        if self.unit not in TEXT_UNITS:
            raise ConfigurationError(f"text_unit={self.unit!r} is not one of {TEXT_UNITS}")

    @property
    def scan_key(self) -> str:
        return f"text unit={self.unit} stride={SEEK_STRIDE} entry-points"  # without: before compressed shards had them

    def scan(self, shard: ShardFile) -> ShardScan:
        if self.unit == "line":
            return scan_lines(shard)
        if shard.compression is None:
            return ShardScan(1)  # the Dataset never scans a zero-length shard
        return ShardScan(1, raw_bytes=_decompressed_size(shard))

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        if self.unit == "line":
            lines, short_detail = read_lines(shard, seek, start, stop)
            slots = [_decode(line[:-1] if line.endswith(b"\r") else line) for line in lines]
            return fill_truncated(slots, stop - start, short_detail)
        # A plain file is read in reads of BLOCK_SIZE, each fetched as it is; a compressed one in smaller ones.
        with shard.open(read_ahead=0 if shard.compression is None else STREAM_READ_AHEAD) as f:
            try:
                content = b"".join(decompressed_blocks(f, shard.compression))
            except EOFError as error:
                return fill_truncated([], stop - start, str(error))
            stored = f.tell()  # read to its end: the file's size now
        if _cut_after_planning(shard, stored):
            return fill_truncated([], stop - start, f"shard is {stored} bytes, {shard.planned_nbytes} when planned")
        return [_decode(content.removeprefix(UTF8_BOM))]


def _cut_after_planning(shard: ShardFile, stored: int) -> bool:
    """Whether a file read whole, now `stored` bytes, lost part of its record after planning. Its
    one record is the whole file, so a plain file cut or emptied after planning no longer holds
    it: handed out, it was a shorter text (or an empty one) with no word. A compressed file cut
    short is known by its stream instead (its stored size says nothing of its text's), but an
    emptied one holds no stream to be found cut."""
    if shard.planned_nbytes is None:
        return False
    return stored < shard.planned_nbytes if shard.compression is None else stored == 0


def _decompressed_size(shard: ShardFile) -> int:
    """The size of a compressed file's text. Prefetching, the memory budget and token estimation
    take `raw_bytes` as the decompressed size; the stored size understates it several times over.
    A stream cut short counts what it holds: reading it reports the record as truncated."""
    size = 0
    with shard.open() as f:
        try:
            for block in decompressed_blocks(f, shard.compression):
                size += len(block)
        except EOFError:
            pass
    return size


def _decode(data: bytes) -> Slot:
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError as error:
        return Bad(INVALID_UTF8, str(error))
