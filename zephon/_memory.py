"""The peak-memory budget of one rank loader, derived from its settings (docs/RELIABILITY.md).

Memory a loader holds beyond the interpreter, the tokenizer and the plan is bounded by what its
settings let it buffer:

- rows:      every lane holds at most `shuffle buffer + open packer rows + one microbatch` packed
             rows, each `max_length` x (4 int32 fields, or the packer's `row_field_bytes` where it
             adds fields, + the pixel bytes an image token carries, or the packer's
             `pixel_bytes_per_token`);
- records:   every lane has at most `prefetch` chunks in flight, each the chunk's raw bytes as read,
             as text and as tokens (plus one read block per reading worker), and the token array
             of the largest document stays alive while rows are cut from it (a row cut from a
             document longer than a row holds a copy of its piece, not the document); with
             `tokenize(prompt_field=...)` or `segments=True` a token also carries its loss-mask
             flag in flight and its target where a packer holds it;
- tokenizer: every tokenizing worker may hold the `tokenizers` Encoding of the largest document,
             about TOKENIZER_BYTES_PER_TOKEN per token, while it encodes it;
- images:    every decoding worker may hold one image at its decoder's output size (JPEG draft
             mode decodes at 1/2, 1/4 or 1/8 scale), given by the caller as `image_decode_bytes`,
             and every in-flight chunk its records' decoded images (at most the spec's pixels);
- workers:   a fixed allowance per worker thread (allocator arenas, stacks touched); for a process
             runner, one for the parent's reader thread and the result buffers it maps.

Nothing here allocates or reads data beyond the plan's chunk sizes; it is arithmetic on settings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ._prefetch import records_per_chunk
from .io._compression import BLOCK_SIZE
from .work._chunk_table import ChunkTable

__all__ = [
    "READ_BLOCK_BYTES",
    "ROW_FIELD_BYTES",
    "TOKENIZER_BYTES_PER_TOKEN",
    "WORKER_OVERHEAD_BYTES",
    "MemoryBudget",
    "memory_budget",
]

ROW_FIELD_BYTES = 16
"""Bytes per position of a packed row: input_ids, labels, position_ids, document_ids as int32."""

TOKENIZER_BYTES_PER_TOKEN = 512
"""Transient bytes per token while `tokenizers` encodes one text (ids, type ids, token strings,
offsets, masks and word ids of its Encoding): about 420 measured with tokenizers 0.2x, rounded up."""

RECORD_COPIES = 3
"""A record's raw bytes are held as read, as decoded text and as the parsed record's string."""

READ_BLOCK_BYTES = BLOCK_SIZE
"""Line-format shards are read in blocks of this size: the reader's own, so the budget follows it."""

WORKER_OVERHEAD_BYTES = 4 << 20
"""Per worker thread: allocator arenas' touched pages and temporaries. A process worker's own
memory is its process's, not the loader's: the parent gets one allowance, for its reader thread."""


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes per term; `total` is their sum. See the module docstring for what each term bounds."""

    rows: int
    records: int
    tokenizer: int
    images: int
    workers: int

    @property
    def total(self) -> int:
        return self.rows + self.records + self.tokenizer + self.images + self.workers

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def memory_budget(
    loader,
    *,
    image_decode_bytes: int = 0,
    threads_in_process: bool = True,
) -> MemoryBudget:
    """The budget of `loader` (a RankLoader) for the data its plan can deliver.

    Tokens per byte are the plan's measured ratio when it has one, else 1.0 (a byte-level
    tokenizer never makes more tokens than bytes). `image_decode_bytes` is the decode
    workspace of the largest image (0 for text). `threads_in_process=False` for a process runner,
    whose workers' memory lives in their own processes.
    """
    settings = loader.pipeline.settings
    operators = loader.pipeline.operators
    lanes = len(loader.lanes)
    accumulators = [op for op in operators if op.kind == "accumulator"]
    packer = loader.packer  # as the loader bound it: a PackMultimodal takes its spec from its decoder there
    buffered = sum(getattr(op, "buffer_size", 0) for op in accumulators)
    open_rows = 1 if getattr(packer, "algorithm", None) in ("wrap", "pad") else getattr(packer, "max_open_rows", 1)
    field_bytes = getattr(packer, "row_field_bytes", ROW_FIELD_BYTES)  # a packer adding fields says so
    row_bytes = packer.max_length * (field_bytes + _pixel_bytes_per_token(packer))
    rows = lanes * (buffered + open_rows + loader.microbatch_size) * row_bytes

    largest_chunk = _largest_chunk_raw_bytes(loader.plan)
    measured = [s.tokens_per_byte for s in getattr(loader.plan, "stats", {}).values()]
    tokens_per_byte = max(measured) if measured and max(measured) > 0 else 1.0
    largest_tokens = int(largest_chunk * tokens_per_byte) + 1
    inline = getattr(settings.runner, "name", settings.runner) == "inline"
    readers = 1 if inline else loader.stages[0].parallelism
    # A recipe trained on part of each document carries a bool per id beside its ids in flight,
    # and the document a packer holds carries its targets beside them (`_loss_mask`).
    masked = any(getattr(op, "writes_loss_mask", False) for op in operators)
    records = (
        lanes * loader.prefetch * (RECORD_COPIES * largest_chunk + (4 + masked) * largest_tokens)
        + lanes * (8 if masked else 4) * largest_tokens
        + readers * READ_BLOCK_BYTES
    )
    workers = 1 if inline else max((s.parallelism for s in loader.stages), default=1)
    tokenizer = workers * largest_tokens * TOKENIZER_BYTES_PER_TOKEN
    decoded = _decoded_image_bytes(packer) * _records_per_chunk(loader.plan)
    images = workers * image_decode_bytes + lanes * loader.prefetch * decoded
    threads = sum(s.parallelism for s in loader.stages) if threads_in_process else 1  # else: the reader thread
    overhead = threads * WORKER_OVERHEAD_BYTES
    return MemoryBudget(rows, records, tokenizer, images, overhead)


def _pixel_bytes_per_token(packer) -> int:
    """A multimodal row carries one merged cell of patches (uint8 RGB) per image token, or what
    the packer says a token carries where it lays out more (a video token's cell in two frames)."""
    said = getattr(packer, "pixel_bytes_per_token", None)
    if said is not None:
        return said
    spec = getattr(packer, "spec", None)
    if spec is None:
        return 0
    return spec.patch_size**2 * spec.merge_size**2 * 3


def _decoded_image_bytes(packer) -> int:
    """A decoded image on its patch grid: at most the spec's pixels (its `max_decoded_pixels`,
    which knows each way of sizing), RGB uint8."""
    spec = getattr(packer, "spec", None)
    if spec is None:
        return 0
    return 3 * spec.max_decoded_pixels


def _records_per_chunk(plan) -> int:
    return records_per_chunk(plan) or 1


def _largest_chunk_raw_bytes(plan) -> int:
    per_chunk = records_per_chunk(plan)
    largest = 0
    for dataset in plan.datasets.values():
        if per_chunk is None:
            largest = max(largest, max((s.raw_bytes for s in dataset.shards), default=0))
            continue
        largest = max(largest, int(ChunkTable.of(dataset, per_chunk).raw_bytes(dataset).max(initial=0)))
    return largest
