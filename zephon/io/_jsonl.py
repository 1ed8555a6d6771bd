"""JSON Lines shards (.jsonl, .json, optionally .gz/.zst): one JSON object per line."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ._format import ShardFile, ShardScan
from .._errors import ConfigurationError
from ._lines import SEEK_STRIDE, UTF8_BOM, DecompressedFromFrames, read_lines, scan_lines
from ._policy import INVALID_UTF8, MALFORMED_JSON, NOT_AN_OBJECT, Bad, Slot, fill_truncated, parse_json

__all__ = ["JsonLines"]


@dataclass(frozen=True)
class JsonLines(DecompressedFromFrames):
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
        return f"jsonl stride={SEEK_STRIDE} entry-points"  # "jsonl stride=16": before compressed shards had them

    def scan(self, shard: ShardFile) -> ShardScan:
        return scan_lines(shard, functools.partial(_refuse_one_array, shard.url))

    def read(self, shard: ShardFile, seek: np.ndarray | None, start: int, stop: int) -> list[Slot]:
        lines, short_detail = read_lines(shard, seek, start, stop)
        return fill_truncated([_parse(line) for line in lines], stop - start, short_detail)

def _parse(line: bytes) -> Slot:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return Bad(INVALID_UTF8, str(error))
    if not text.strip():
        # Said as what it is: JSON's "Expecting value: line 1 column 1 (char 0)" (column 2 where a
        # CRLF file's blank line keeps its "\r") sent the reader after a broken record.
        return Bad(MALFORMED_JSON, "a blank line, which holds no record")
    value = parse_json(text)
    if isinstance(value, Bad):
        return value
    if not isinstance(value, dict):
        return Bad(NOT_AN_OBJECT, f"got {type(value).__name__}")
    return value


def _refuse_one_array(url: str, opening: bytes, num_lines: int) -> None:
    """Refuse a shard that is one JSON array of records (`json.dump(records, f, indent=2)`, an
    Alpaca-style `.json`), not JSON Lines: read line by line, a pretty-printed array's every line
    was dropped as `malformed_json` and a one-line array as one `not_an_object`, the records lost
    with nothing saying why. Only a whole-shard array is refused: a first line that is "[" alone
    (which no JSON Lines record is) or a one-line shard opening with "[" (spaces and a byte order
    mark aside); a JSON Lines shard whose first record is an array keeps its other records, that
    one skipped."""
    first_line = opening.removeprefix(UTF8_BOM).split(b"\n", 1)[0].strip(b" \t\r")
    if first_line == b"[" or (num_lines == 1 and first_line.startswith(b"[")):
        raise ConfigurationError(
            f"{url} is one JSON array, not JSON Lines (one object per line): write one record per line "
            "(`jq -c '.[]' FILE > FILE.jsonl`, or json.dumps of each record), and name that file"
        )
