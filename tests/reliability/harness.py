"""Shared harness of the reliability tests: dirty corpora, a one-dataset pipeline, whole-epoch runs.

Every helper builds real shards on disk (or in a real fsspec filesystem) and runs the real
Pipeline -> shard -> iterate path; nothing here stubs a reader, a runner or the ledger. A full
shared-memory filesystem, which a test cannot make without mounting one, is met at the one write
that would meet it (`fill_the_shm_directory`).
"""

from __future__ import annotations

import errno
import io
import json
import os
import random
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runners import _transport
from zephon import ConfigurationError, Pipeline, RecordAddress, merge_states
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = REPO_ROOT / "zephon" / "data" / "tokenizer.json"
NUM_LANES = 4
MICROBATCH = 2
RECORDS_PER_CHUNK = 4

_WORDS = [
    "river", "stone", "lantern", "harbor", "meadow", "signal", "copper", "orchard", "falcon",
    "ember", "quarry", "tide", "compass", "ledger", "anchor", "willow", "granite", "beacon",
    "thistle", "cinder", "the", "of", "and", "a", "to", "in",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def clean_records(n: int, seed: int | str, prefix: str = "r") -> list[dict]:
    """`n` records {"id", "text"} of 3–60 words, a pure function of the arguments."""
    rng = random.Random(f"reliability:{prefix}:{seed}")
    return [{"id": f"{prefix}{i}", "text": words(rng, rng.randint(3, 60))} for i in range(n)]


def jsonl_lines(records: list[dict]) -> list[bytes]:
    return [json.dumps(r).encode() for r in records]


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


SHARDS, PER_SHARD = 2, 16


def jsonl_dataset(
    root: Path, replace: dict[tuple[int, int], bytes] | None = None, *, name: str = "d", **options
) -> Dataset:
    """SHARDS x PER_SHARD clean JSON lines under `root`, with `replace[(shard, index)]` put in
    place of some lines; `options` go to `Dataset.from_path`. Record i of every shard has id `r<i>`."""
    for shard in range(SHARDS):
        lines = jsonl_lines(clean_records(PER_SHARD, shard if name == "d" else f"{name}/{shard}"))
        for (s, index), line in (replace or {}).items():
            if s == shard:
                lines[index] = line
        write_lines(root / f"part-{shard:05d}.jsonl", lines)
    return Dataset.from_path(name, str(root), **options)


def sharded_datasets(tmp_path_factory, shard_sizes: dict[str, list[int]]) -> list[Dataset]:
    """One dataset of clean records per name, its shards holding the given numbers of records."""
    out = []
    for name, sizes in shard_sizes.items():
        root = tmp_path_factory.mktemp(name)
        for shard, size in enumerate(sizes):
            write_lines(root / f"part-{shard:05d}.jsonl", jsonl_lines(clean_records(size, f"{name}/{shard}", name)))
        out.append(Dataset.from_path(name, str(root)))
    return out


def address(dataset: Dataset, shard: int, index: int) -> RecordAddress:
    return RecordAddress(dataset.name, dataset.shards[shard].url, index)


def tar_bytes(records: list[list[tuple[str, bytes]]]) -> bytes:
    """A WebDataset tar: each record is a list of (member name, payload)."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for members in records:
            for name, payload in members:
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return sink.getvalue()


def text_pipeline(
    dataset: Dataset | list[Dataset],
    *,
    runner=None,
    field: str = "text",
    max_length: int = 64,
    algorithm: str = "wrap",
    on_error: str = "skip",
    estimate_tokens: bool = False,
    num_epochs: int | None = 1,
    seed: int = 7,
    shuffle_buffer: int = 8,
    map_fn=None,
    filter_fn=None,
    num_lanes: int = NUM_LANES,
    parallelism: int = 1,
    mixture: dict | None = None,
    tokenizer: Path = TOKENIZER,
    flush_every_chunks: int = 2,
    records_per_chunk: int = RECORDS_PER_CHUNK,
    bos: str | None = None,
    eos: str | None = "<|eos|>",
    pad_id: int | None = None,
    microbatch_size: int = MICROBATCH,
    round_size: int = 1024,
) -> Pipeline:
    """dataset(s) -> [map] -> [filter] -> tokenize -> pack_flat -> shuffle -> batch, on `num_lanes` lanes.

    Without `estimate_tokens` the mixture is by records, so building a loader reads nothing: every
    read (and every fault) happens while iterating, on the runner's workers.
    """
    datasets = dataset if isinstance(dataset, list) else [dataset]
    source = StaticMixtureWorkSource(
        datasets,
        mixture=mixture,
        token_estimation=TokenEstimation(sample_records=32) if estimate_tokens else None,
        seed=seed,
        records_per_chunk=records_per_chunk,
        num_epochs=num_epochs,
        round_size=round_size,
    )
    pipeline = Pipeline(source).options(
        num_lanes=num_lanes, runner=runner or "inline", flush_every_chunks=flush_every_chunks, on_error=on_error
    )
    if map_fn is not None:
        pipeline = pipeline.map(map_fn, parallelism=parallelism)
    if filter_fn is not None:
        pipeline = pipeline.filter(filter_fn, parallelism=parallelism)
    return (
        pipeline.tokenize(str(tokenizer), field=field, bos=bos, eos=eos, parallelism=parallelism)
        .pack_flat(max_length=max_length, algorithm=algorithm, pad_id=pad_id)
        .shuffle(buffer_size=shuffle_buffer, seed=seed)
        .batch(microbatch_size=microbatch_size)
    )


def global_batch(pipeline: Pipeline) -> int:
    """One microbatch per lane per step."""
    return pipeline.settings.num_lanes * pipeline.microbatch_size


@dataclass
class EpochRun:
    """What a whole finite epoch delivered, over every rank of one layout."""

    digests: dict[tuple[int, int, int], str] = field(default_factory=dict)
    totals: dict[str, Counter] = field(default_factory=dict)
    per_lane: dict[tuple[str, int], Counter] = field(default_factory=dict)
    batches: list = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # ranks' refusals of a run that made no row

    def skipped(self, dataset: str) -> Counter:
        return Counter({k.split(":", 1)[1]: v for k, v in self.totals[dataset].items() if k.startswith("skipped:")})


def run_epoch(
    pipeline: Pipeline, world_size: int = 1, *, keep_batches: bool = True, state=None, may_make_no_row: bool = False
) -> EpochRun:
    """Iterate every rank of `world_size` to the end of the plan; sum the ranks' ledgers.

    A plan whose every record is dropped fails at its end (`zephon._barren`); with
    `may_make_no_row` (a random corpus may hold no good record) that refusal is kept in
    `run.refused` and the ledgers are still summed, for the caller to check it against them."""
    run = EpochRun()
    for rank in range(world_size):
        with pipeline.shard(rank, world_size, global_batch_size=global_batch(pipeline)) as loader:
            if state is not None:
                loader.load_state_dict(state)
            try:
                for batch in loader:
                    key = (batch.step, batch.lane, batch.index)
                    assert key not in run.digests, f"microbatch {key} delivered twice"
                    run.digests[key] = batch.digest()
                    if keep_batches:
                        run.batches.append(batch)
            except ConfigurationError as error:
                if not (may_make_no_row and "handed over no row" in str(error)):
                    raise
                run.refused.append(str(error))
            for name, entry in loader.stats()["datasets"].items():
                _add(run.totals.setdefault(name, Counter()), entry["total"])
                for lane, counts in entry["lanes"].items():
                    _add(run.per_lane.setdefault((name, int(lane)), Counter()), counts)
    return run


def _add(into: Counter, counts: dict) -> None:
    for key, value in counts.items():
        if key == "skipped":
            into.update({f"skipped:{k}": v for k, v in value.items()})
        else:
            into[key] += value


def checkpoint_after(pipeline: Pipeline, world_size: int, microbatches_per_rank: int) -> dict:
    """Take `microbatches_per_rank` microbatches on every rank, then merge the ranks' states."""
    states = []
    for rank in range(world_size):
        with pipeline.shard(rank, world_size, global_batch_size=global_batch(pipeline)) as loader:
            iterator = iter(loader)
            for _ in range(microbatches_per_rank):
                next(iterator)
            states.append(loader.state_dict())
    return merge_states(states)


def assert_ledger_balances(run: EpochRun, expected_read: dict[str, int] | None = None) -> None:
    """read == emitted + filtered + skipped for every dataset and every lane, and (given
    `expected_read`) every planned slot of every dataset was read. The lanes' counts of a dataset
    must add up to its total: with no per-lane counts at all, "every lane" balanced vacuously."""
    for name, total in run.totals.items():
        lanes = [counts for (dataset, _), counts in run.per_lane.items() if dataset == name]
        assert sum(lanes, Counter()) == total, (name, "per-lane counts do not add up to the total", lanes)
    for where, counts in [*run.totals.items(), *run.per_lane.items()]:
        skipped = sum(v for k, v in counts.items() if k.startswith("skipped:"))
        assert counts["read"] == counts["emitted"] + counts["filtered"] + skipped, (where, dict(counts))
    if expected_read is not None:
        assert {name: counts["read"] for name, counts in run.totals.items()} == expected_read


def tokens_by_record(batches) -> Counter:
    """Real tokens each record contributed, over every row of every batch."""
    used: Counter = Counter()
    for batch in batches:
        document_ids = batch.tokens["document_ids"]
        for row, sources in enumerate(batch.sources):
            for piece, address in enumerate(sources):
                used[address] += int(np.count_nonzero(document_ids[row] == piece))
    return used


def token_values_of(batches, address: RecordAddress) -> Counter:
    """Multiset of the token ids `address` contributed (rows are shuffled, so order is not kept)."""
    values: Counter = Counter()
    for batch in batches:
        for row, sources in enumerate(batch.sources):
            for piece, source in enumerate(sources):
                if source == address:
                    mask = batch.tokens["document_ids"][row] == piece
                    values.update(batch.tokens["input_ids"][row][mask].tolist())
    return values


# -- vision-language -------------------------------------------------------------------------
def vlm_pipeline(dataset: Dataset, spec, *, runner=None, on_error: str = "skip", num_lanes: int = 2,
                 max_length: int = 256, parallelism: int = 1, shuffle_buffer: int = 0,
                 flush_every_chunks: int = 2, records_per_chunk: int = RECORDS_PER_CHUNK,
                 estimate_tokens: bool = False) -> Pipeline:
    """pairs -> decode_images -> tokenize(txt) -> pack_multimodal -> [shuffle] -> batch."""
    from vlm import PixtralPlaceholders

    estimation = TokenEstimation(sample_records=8) if estimate_tokens else None
    source = StaticMixtureWorkSource([dataset], token_estimation=estimation, seed=3,
                                     records_per_chunk=records_per_chunk, num_epochs=1)
    pipeline = (
        Pipeline(source)
        .options(num_lanes=num_lanes, runner=runner or "inline", flush_every_chunks=flush_every_chunks,
                 on_error=on_error)
        .decode_images(spec=spec, parallelism=parallelism)
        .tokenize(str(TOKENIZER), field="txt", eos="<|eos|>", parallelism=parallelism)
        .pack_multimodal(max_length, PixtralPlaceholders(3, 4, 5))
    )
    if shuffle_buffer:
        pipeline = pipeline.shuffle(buffer_size=shuffle_buffer, seed=3)
    return pipeline.batch(microbatch_size=MICROBATCH)


def pair_tar(path: Path, pairs: list[tuple[str, str | None, bytes | None]]) -> Path:
    """A WebDataset shard of (key, image extension or None, image bytes) with a caption each."""
    records = []
    for key, extension, image in pairs:
        members = [(f"{key}.txt", f"a picture called {key}".encode())]
        if extension is not None:
            members.append((f"{key}.{extension}", image))
        records.append(members)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tar_bytes(records))
    return path


def pixels_by_address(batches) -> dict[RecordAddress, np.ndarray]:
    """The patch rows of each record's image (every record here carries at most one image)."""
    out = {}
    for batch in batches:
        arrays = batch.to_numpy()
        grids = arrays["image_grid"]
        patches_per_image = (grids[:, 0] * grids[:, 1]).astype(int)
        starts = np.concatenate([[0], np.cumsum(patches_per_image)])
        image = 0
        for row, sources in enumerate(batch.sources):
            assert int(arrays["image_grid_counts"][row]) == len(sources), "every packed record has one image"
            for address in sources:
                out[address] = arrays["pixel_values"][starts[image] : starts[image + 1]]
                image += 1
    return out


def fill_the_shm_directory(monkeypatch, error: int = errno.ENOSPC) -> None:
    """Every buffer file from now on, in this process and the workers forked after, finds its
    filesystem full halfway through its first buffer (`error`), as a container's 64 MiB /dev/shm
    does once replies that did not fit their arena fill it."""

    def half_then_full(fd: int, buffer: memoryview, offset: int) -> None:
        os.pwrite(fd, buffer[: buffer.nbytes // 2], offset)
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(_transport, "_pwrite_all", half_then_full)
