"""Shared harnesses: build a text pipeline, run it on any layout, collect per-step global digests;
check that row plans collate like their rows; raise an interrupt (`Interrupt`); make an
accumulator's refusals' details; print what code gives under several PYTHONHASHSEEDs.

Determinism tests compare real SHA-256s of real batches from separately constructed pipelines;
every helper here builds a fresh Pipeline and fresh loaders on each call.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Hashable
from operator import attrgetter
from pathlib import Path

import numpy as np

from zephon import Pipeline, global_batch_digest, merge_states
from zephon._batch import collate
from zephon._records import RecordAddress
from zephon._sequence import IGNORE_INDEX
from zephon.io import Dataset, _compression, _resume_points
from zephon.work import StaticMixtureWorkSource, TokenEstimation

NUM_LANES = 8
MICROBATCH = 2
GLOBAL_BATCH = NUM_LANES * MICROBATCH * 2  # two microbatches per lane per step


class Interrupt(BaseException):
    """What a signal or preemption handler raises while the loader works or waits (like
    KeyboardInterrupt, but the test runner ignores it)."""


def text_pipeline(
    corpus_a: Path,
    corpus_b: Path,
    tokenizer: Path,
    *,
    runner: str = "inline",
    parallelism: int = 1,
    seed: int = 42,
    max_length: int = 64,
    num_epochs: int | None = None,
    algorithm: str = "wrap",
    flush_every_chunks: int = 2,
    mixture: dict | None = None,
    shuffle_buffer: int = 8,
    shuffle_seed: int | None = None,
    map_fn: Callable[[dict], dict | None] | None = None,
    estimate_tokens: bool = True,
    dataset_options: dict | None = None,
) -> Pipeline:
    """The text recipe of the determinism tests; `map_fn`, if given, is mapped before tokenize;
    `dataset_options` are both datasets' `Dataset.from_path` options."""
    options = dataset_options or {}
    source = StaticMixtureWorkSource(
        datasets=[Dataset.from_path("a", str(corpus_a), **options), Dataset.from_path("b", str(corpus_b), **options)],
        mixture=mixture or {"a": 0.5, "b": 0.5},
        token_estimation=TokenEstimation(sample_records=64) if estimate_tokens else None,
        seed=seed,
        records_per_chunk=8,
        num_epochs=num_epochs,
    )
    pipeline = Pipeline(source).options(num_lanes=NUM_LANES, runner=runner, flush_every_chunks=flush_every_chunks)
    if map_fn is not None:
        pipeline = pipeline.map(map_fn, parallelism=parallelism)
    return (
        pipeline.tokenize(tokenizer_id=str(tokenizer), field="text", parallelism=parallelism, eos="<|eos|>")
        .pack_flat(max_length=max_length, algorithm=algorithm)
        .shuffle(buffer_size=shuffle_buffer, seed=seed if shuffle_seed is None else shuffle_seed)
        .batch(microbatch_size=MICROBATCH)
    )


def microbatches_per_rank_step(loader) -> int:
    return len(loader.lanes) * loader.rows_per_step // loader.microbatch_size


def step_digests(
    pipeline: Pipeline, world_size: int, steps: int, *, state=None, start_step: int = 0, accept_changes=()
) -> list[str]:
    """Run `world_size` rank loaders side by side for `steps` global steps and return each step's
    global digest. With `state`, every rank first loads it (an elastic resume), accepting the
    recipe changes named in `accept_changes`."""
    loaders = [pipeline.shard(rank, world_size, global_batch_size=GLOBAL_BATCH) for rank in range(world_size)]
    try:
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state, accept_changes=accept_changes)
        iterators = [iter(loader) for loader in loaders]
        digests = []
        for step in range(start_step, start_step + steps):
            batches = []
            for loader, it in zip(loaders, iterators):
                for _ in range(microbatches_per_rank_step(loader)):
                    batch = next(it)
                    assert batch.step == step, (batch.step, step)
                    batches.append(batch)
            digests.append(global_batch_digest(batches))
        return digests
    finally:
        for loader in loaders:
            loader.close()


def checkpoint_after(pipeline: Pipeline, world_size: int, steps: int, extra_microbatches: int = 0) -> dict:
    """Consume `steps` global steps (plus `extra_microbatches` of the next step on every rank) on
    `world_size` ranks and return the merged state of all ranks."""
    loaders = [pipeline.shard(rank, world_size, global_batch_size=GLOBAL_BATCH) for rank in range(world_size)]
    try:
        for loader in loaders:
            it = iter(loader)
            for _ in range(steps * microbatches_per_rank_step(loader) + extra_microbatches):
                next(it)
        return merge_states(loader.state_dict() for loader in loaders)
    finally:
        for loader in loaders:
            loader.close()


def microbatch_digests(pipeline: Pipeline, world_size: int, until_step: int, *, state=None) -> dict:
    """{(step, lane, index): microbatch digest} for every microbatch before `until_step`, each
    rank iterated by its own loader (optionally resumed from `state`)."""
    out = {}
    for rank in range(world_size):
        with pipeline.shard(rank, world_size, global_batch_size=GLOBAL_BATCH) as loader:
            if state is not None:
                loader.load_state_dict(state)
            for batch in loader:
                if batch.step >= until_step:
                    break
                key = (batch.step, batch.lane, batch.index)
                assert key not in out, f"microbatch {key} delivered twice"
                out[key] = batch.digest()
    return out


def consumed_keys(pipeline: Pipeline, world_size: int, steps: int, extra_microbatches: int) -> set:
    """The (step, lane, index) keys a run of `checkpoint_after` consumed, from a 1-rank replay of
    the same layout order."""
    keys = set()
    for rank in range(world_size):
        with pipeline.shard(rank, world_size, global_batch_size=GLOBAL_BATCH) as loader:
            it = iter(loader)
            for _ in range(steps * microbatches_per_rank_step(loader) + extra_microbatches):
                batch = next(it)
                keys.add((batch.step, batch.lane, batch.index))
    return keys


def assert_plans_collate_like_their_rows(plans: list, microbatch: int) -> None:
    """Every microbatch of `plans`, collated from the plans themselves (straight into the batch
    arrays), has the digest, sources, real-token count and per-dataset counts (the ledger's
    realised mixture: tokens, images and learned tokens) of the same rows assembled one by one."""
    for start in range(0, len(plans), microbatch):
        group = plans[start : start + microbatch]
        direct = collate(group, lane=0, step=0, index=0)
        via_rows = collate([plan.assemble() for plan in group], lane=0, step=0, index=0)
        assert direct.digest() == via_rows.digest()
        assert direct.sources == via_rows.sources
        assert [p.num_real_tokens for p in group] == [p.assemble().num_real_tokens for p in group]
        for plan in group:
            assert plan.tokens_by_dataset == plan.assemble().tokens_by_dataset
            assert plan.images_by_dataset == plan.assemble().images_by_dataset
            assert plan.learned_by_dataset == plan.assemble().learned_by_dataset


def dataset_counts_in(batches, by: Callable[[RecordAddress], Hashable] = attrgetter("dataset")) -> dict:
    """{lane: {dataset: {"tokens", "images", "learned"}}} read from the microbatches themselves, as
    `stats()["lanes"][lane]["datasets"]` counts them: a document's tokens are where `document_ids`
    holds its number, `sources` names its dataset, an image is the document's at its first
    placeholder (`image_token_offset`), and it learns the tokens of those positions whose label is
    not IGNORE_INDEX. `by` keys the counts by something else of a document's address (its record)."""
    out: dict[int, dict[Hashable, dict[str, int]]] = {}
    for batch in batches:
        lane = out.setdefault(batch.lane, {})
        offsets = batch.ragged.get("image_token_offset", np.empty(0, np.int64))
        per_row = batch.ragged_counts.get("image_token_offset", np.zeros(len(batch.sources), np.int64))
        ends = np.cumsum(per_row)
        for row, sources in enumerate(batch.sources):
            documents = batch.tokens["document_ids"][row]
            images = documents[offsets[ends[row] - per_row[row] : ends[row]]]
            learned = documents[batch.tokens["labels"][row] != IGNORE_INDEX]
            for number, address in enumerate(sources):
                counts = lane.setdefault(by(address), {"tokens": 0, "images": 0, "learned": 0})
                counts["tokens"] += int(np.count_nonzero(documents == number))
                counts["images"] += int(np.count_nonzero(images == number))
                counts["learned"] += int(np.count_nonzero(learned == number))
    return {lane: dict(sorted(datasets.items())) for lane, datasets in sorted(out.items())}


def summed_over_lanes(counts_by_lane: dict) -> dict:
    """`dataset_counts_in`'s counts of every lane added up: {key: {"tokens", "images", "learned"}}."""
    out: dict = {}
    for counts in counts_by_lane.values():
        for key, kinds in counts.items():
            total = out.setdefault(key, dict.fromkeys(kinds, 0))
            for kind, n in kinds.items():
                total[kind] += n
    return out


def printed_in_processes(code: str, seeds=range(4)) -> set[str]:
    """What `code` prints, run from the repository root in one fresh process per PYTHONHASHSEED:
    one text where a fingerprint is the same in every process, as a resumed run needs of its
    checkpoint (string hashing, and so a set's order, is salted per process)."""
    root = Path(__file__).resolve().parent.parent
    return {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120, check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in seeds
    }


def refusals(skips: list) -> list[tuple]:
    """An accumulator's `drain_skips()` with each detail made (a detail may be a function, made
    only for the skips kept as examples), to compare whole."""
    return [(address, reason, detail if isinstance(detail, str) else detail()) for address, reason, detail in skips]


class RowsHandedOnAs:
    """A plugin accumulator that hands each row on as `wrap(row)`: a row plan written to another
    contract than the loader's, named `name` in the recipe."""

    kind = "accumulator"

    def __init__(self, name: str, wrap: Callable) -> None:
        self.name, self._wrap = name, wrap

    def factory(self, default_pad_id: int):
        wrap = self._wrap

        class Wrap:
            def push(self, row):
                return [wrap(row)]

            def flush(self):
                return []

        return lambda ctx: Wrap()

    def fingerprint(self, default_pad_id: int) -> dict:
        return {"op": self.name}


def space_resume_points(monkeypatch, spacing: int) -> _resume_points.ResumePoints:
    """This process's resume points `spacing` decompressed bytes apart, read in blocks of an
    eighth of that, for the test (`monkeypatch`): a gzip stream's reads then start from many."""
    points = _resume_points.ResumePoints(first_spacing=spacing)
    monkeypatch.setattr(_resume_points, "resume_points", points)
    monkeypatch.setattr(_compression, "_COMPRESSED_BLOCK_SIZE", spacing // 8)
    return points
