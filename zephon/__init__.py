"""Zephon: an elastically deterministic data loader for LLM and VLM pretraining.

For a fixed recipe every global batch is bit-identical whatever the number of ranks, workers or
the runner, including across a checkpoint taken on R ranks and resumed on R'.
"""

from ._accumulator import Accumulator, SegmentContext
from ._batch import Batch, MicrobatchDigest, StepShape, combine_digests, global_batch_digest
from ._checkpoint import merge_states
from ._errors import (
    BadRecordError,
    CheckpointError,
    ConfigurationError,
    PartialGlobalBatchError,
    RecipeMismatchError,
    UserFunctionError,
    ZephonError,
)
from ._loader import RankLoader
from ._pipeline import Pipeline, PipelineOptions
from ._records import Chunk, ChunkRecords, RecordAddress
from ._runner import Runner, Stage, available_runners, make_runner
from ._sequence import IGNORE_INDEX, PADDING_DOCUMENT, PackedSequence

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "BadRecordError",
    "Batch",
    "CheckpointError",
    "Chunk",
    "ChunkRecords",
    "ConfigurationError",
    "IGNORE_INDEX",
    "MicrobatchDigest",
    "PADDING_DOCUMENT",
    "PackedSequence",
    "PartialGlobalBatchError",
    "Pipeline",
    "PipelineOptions",
    "RankLoader",
    "RecipeMismatchError",
    "RecordAddress",
    "Runner",
    "SegmentContext",
    "Stage",
    "StepShape",
    "UserFunctionError",
    "ZephonError",
    "available_runners",
    "combine_digests",
    "global_batch_digest",
    "make_runner",
    "merge_states",
]
