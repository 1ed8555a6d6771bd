"""Datasets: named collections of shards behind any fsspec URL, planned cheaply and read by chunk.

See README.md in this directory for the package tree and the lifecycle of a record.
"""

from __future__ import annotations

from ._dataset import Dataset, ShardInfo
from ._errors import ShardUnavailableError, UnsizedShardError
from ._locate import FORMATS
from ._policy import (
    DUPLICATE_COLUMN,
    DUPLICATE_KEY,
    DUPLICATE_MEMBER,
    INVALID_UTF8,
    MALFORMED_JSON,
    NOT_A_FILE,
    NOT_AN_OBJECT,
    REASONS,
    TRUNCATED_SHARD,
    UNCONVERTIBLE_VALUE,
    ErrorPolicy,
)

__all__ = [
    "Dataset",
    "ShardInfo",
    "ErrorPolicy",
    "ShardUnavailableError",
    "UnsizedShardError",
    "FORMATS",
    "REASONS",
    "MALFORMED_JSON",
    "INVALID_UTF8",
    "NOT_AN_OBJECT",
    "TRUNCATED_SHARD",
    "UNCONVERTIBLE_VALUE",
    "DUPLICATE_MEMBER",
    "DUPLICATE_COLUMN",
    "DUPLICATE_KEY",
    "NOT_A_FILE",
]
