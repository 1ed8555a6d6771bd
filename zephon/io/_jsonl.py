"""JSON Lines shards (.jsonl, .json, optionally .gz/.zst): one JSON object per line."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._format import ShardFile, ShardScan
from ._lines import SEEK_STRIDE, read_lines, scan_lines
from ._policy import INVALID_UTF8, NOT_AN_OBJECT, Bad, Slot, fill_truncated, parse_json

__all__ = ["JsonLines"]


@dataclass(frozen=True)
class JsonLines:
    """Every line is a record slot, blank lines included, so that each bad line has an address.

    A line must decode as UTF-8 (else `invalid_utf8`), parse as JSON (else `malformed_json`; a blank
    line is malformed too, and so is JSON that Python cannot hold: an integer of over 4,300 digits,
    arrays and objects nested deeper than `MAX_JSON_DEPTH`, 200 levels) and be an object (else
    `not_an_object`), and no object in it may name a key twice (else `duplicate_key`). A UTF-8 byte
    order mark at the start of the shard is not part of its first line.
    """

    name: str = "jsonl"

    @property
    def scan_key(self) -> str:
        return f"jsonl stride={SEEK_STRIDE}"

    def scan(self, shard: ShardFile) -> ShardScan:
        return scan_lines(shard)

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        lines, short_detail = read_lines(shard, seek, start, stop)
        return fill_truncated([_parse(line) for line in lines], stop - start, short_detail)

def _parse(line: bytes) -> Slot:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return Bad(INVALID_UTF8, str(error))
    value = parse_json(text)
    if isinstance(value, Bad):
        return value
    if not isinstance(value, dict):
        return Bad(NOT_AN_OBJECT, f"got {type(value).__name__}")
    return value
