"""A Hypothesis state machine over pipeline iteration: take microbatches on any rank, checkpoint,
resume on another world size (and runner) from the last checkpoint, in any order; on text, and on
captioned pictures decoded as their rows are taken.

Invariant: every microbatch ever delivered, at (step, lane, index), has the digest of the
uninterrupted single-rank run at the same (step, lane, index) — whatever was taken, saved and
resumed before it, and however often a resume re-delivers what came after the checkpoint.
A checkpoint of ranks that have taken different numbers of rows is refused by name, and the last
good checkpoint stays; so is a resume that would split a step's rest unevenly over the ranks, and
the run resumes on the world size it ran on instead.

The tests after it fuzz the ragged end of finite plans (1 or 2 epochs, filters that drop records
and whole last chunks of lanes, skipped bad lines, both text packers, or captioned pictures decoded
before packing or as their rows are taken, some failing to decode): every step-end save merges and
resumes on any world size, a save after as many microbatches per rank resumes the rest, and an
interrupt inside a microbatch leaves the state where the trainer is; the ledger always ends where
the uninterrupted run's does.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass
from functools import cache
from itertools import islice
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from tests.fuzz.conftest import fuzz_settings
from tests.harness import Interrupt
from tests.reliability.harness import (
    MICROBATCH, NUM_LANES, RECORDS_PER_CHUNK, TOKENIZER, clean_records, global_batch, jsonl_dataset, jsonl_lines,
    write_lines,
)
from tests.unit.test_vlm_assets import encode, gradient
from vlm import ImageSpec, PixtralPlaceholders
from zephon import CheckpointError, Pipeline, merge_states
from zephon.io import Dataset
from zephon.work import Flush, StaticMixtureWorkSource, lane_plan

STEPS = 8  # the horizon: microbatches of later steps are not taken
WORLD_SIZES = (1, 2, 4)
PICTURES = ImageSpec(max_pixels=48 * 48)  # 1 to 9 patches of 16 px a side


@cache
def _dataset(media: str) -> Dataset:
    if media != "text":  # two shards of 16 captioned pictures, two of which do not decode
        return _finite_dataset((16, 16), frozenset(), "d", True, frozenset({(0, 3), (1, 6)}))
    root = Path(tempfile.mkdtemp(prefix="zephon-fuzz-resume-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return jsonl_dataset(root)


def pipeline(runner: str = "inline", media: str = "text"):
    """An endless plan (num_epochs=None), a flush every 2 chunks, rows of 48, a shuffle buffer of 8 rows."""
    source = StaticMixtureWorkSource([_dataset(media)], seed=7, records_per_chunk=RECORDS_PER_CHUNK, num_epochs=None)
    p = Pipeline(source).options(num_lanes=NUM_LANES, runner=runner, flush_every_chunks=2)
    return _packed(p, media, 48).shuffle(buffer_size=8, seed=7).batch(MICROBATCH)


@cache
def reference(media: str) -> dict[tuple[int, int, int], str]:
    out = {}
    p = pipeline(media=media)
    with p.shard(0, 1, global_batch_size=global_batch(p)) as loader:
        for batch in loader:
            if batch.step >= STEPS:
                break
            out[(batch.step, batch.lane, batch.index)] = batch.digest()
    return out


class IterateCheckpointResume(RuleBasedStateMachine):
    media = "text"

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint = None
        self.delivered = 0
        self._open(1, "inline")

    def _open(self, world: int, runner: str) -> None:
        p = pipeline(runner, self.media)
        self.world = world
        self.loaders = [p.shard(rank, world, global_batch_size=global_batch(p)) for rank in range(world)]
        if self.checkpoint is not None:
            for loader in self.loaders:
                loader.load_state_dict(self.checkpoint)
        self.iterators = [iter(loader) for loader in self.loaders]
        self.at_horizon = [False] * world

    def _close(self) -> None:
        for loader in self.loaders:
            loader.close()

    @rule(rank=st.integers(0, max(WORLD_SIZES) - 1), n=st.integers(1, 6))
    def take(self, rank: int, n: int) -> None:
        rank %= self.world
        for _ in range(n):
            if self.at_horizon[rank]:
                return
            batch = next(self.iterators[rank])
            key = (batch.step, batch.lane, batch.index)
            if batch.step >= STEPS:
                self.at_horizon[rank] = True
                return
            assert batch.digest() == reference(self.media)[key], f"microbatch {key} differs from the uninterrupted run"
            self.delivered += 1

    @rule()
    def catch_up(self) -> None:
        """Every rank takes microbatches until it has taken as many as the furthest one: where the
        ranks of a trainer stand when it checkpoints."""
        target = max(map(_rows_taken, self.loaders))
        for rank, loader in enumerate(self.loaders):
            while not self.at_horizon[rank] and _rows_taken(loader) < target:
                self.take(rank, 1)

    @rule()
    def save(self) -> None:
        states = [loader.state_dict() for loader in self.loaders]
        if len({state["rows_taken"] for state in states}) > 1:  # an endless plan: no lane ever finishes
            with pytest.raises(CheckpointError, match="saved at different steps"):
                merge_states(states)
            return
        self.checkpoint = merge_states(states)

    @precondition(lambda self: self.checkpoint is not None)
    @rule(world=st.sampled_from(WORLD_SIZES), runner=st.sampled_from(["inline", "thread"]))
    def resume(self, world: int, runner: str) -> None:
        self._close()
        previous = self.world
        try:
            self._open(world, runner)
        except CheckpointError as exc:
            # A state saved partway through a step, on a world size that would split its rest
            # unevenly. The loaders resume on the world size that took it up, or saved it, before.
            assert "saved partway through step" in str(exc)
            self._close()
            self._open(previous, runner)

    def teardown(self) -> None:
        self._close()


def _rows_taken(loader) -> int:
    return loader.state_dict()["rows_taken"]


class IterateCheckpointResumeWithPictures(IterateCheckpointResume):
    """The same, on captioned pictures decoded as their rows are taken, two of which do not decode."""

    media = "deferred images"


IterateCheckpointResume.TestCase.settings = fuzz_settings(ci=25, stateful_step_count=15)
TestIterateCheckpointResume = IterateCheckpointResume.TestCase
IterateCheckpointResumeWithPictures.TestCase.settings = fuzz_settings(ci=15, stateful_step_count=15)
TestIterateCheckpointResumeWithPictures = IterateCheckpointResumeWithPictures.TestCase


# -- the ragged end of finite plans ------------------------------------------------------------
# Lanes of a finite plan end at different steps; later global batches hold only the lanes that
# still have data, and a rank whose lanes are all done stops. Every save a trainer takes there
# must merge and resume on any world size as the rest of the uninterrupted run, with the ledger
# carried on exactly; also where other datasets are mixed in and end their passes (whole or part
# of one) before or after the first, dropping out of the mixture.


@dataclass(frozen=True)
class FiniteRecipe:
    shard_sizes: tuple[int, ...]
    bad_lines: frozenset  # (shard, index): a malformed JSON line or a blank document, skipped
    num_lanes: int
    microbatch_size: int
    microbatches_per_lane_step: int
    num_epochs: int
    algorithm: str  # pack_flat's; pictures are packed by pack_multimodal, first fit
    max_length: int
    flush_every_chunks: int
    records_per_chunk: int
    shuffle_buffer: int
    seed: int
    drop_per_mille: int  # records a filter drops, by a hash of their text
    lanes_losing_last_chunk: frozenset  # lanes whose last chunk the filter drops whole
    worlds: tuple[int, int, int]  # saved on, resumed on, resumed on again
    # Datasets mixed in beside "d", as (shard sizes, weight, passes): "d" has weight 1 and
    # `num_epochs` passes; a dataset whose passes end before the others' drops out of the mixture.
    others: tuple[tuple[tuple[int, ...], float, float], ...] = ()
    # "text", or each record naming a picture beside its shard, decoded on the workers ("images") or
    # as its row is taken ("deferred images"), and packed with its caption (pack_multimodal).
    media: str = "text"
    bad_images: frozenset = frozenset()  # (shard, index) of "d" whose picture does not decode

    @property
    def global_batch_size(self) -> int:
        return self.num_lanes * self.microbatch_size * self.microbatches_per_lane_step

    @property
    def passes(self) -> dict[str, float]:
        return {"d": self.num_epochs, **{f"o{i}": passes for i, (_, _, passes) in enumerate(self.others)}}


@st.composite
def finite_recipes(draw) -> FiniteRecipe:
    shard_sizes = tuple(draw(st.lists(st.integers(20, 40), min_size=2, max_size=3)))
    bad = draw(st.sets(st.tuples(st.integers(0, len(shard_sizes) - 1), st.integers(0, 19)), max_size=4))
    bad_images = st.sets(st.tuples(st.integers(0, len(shard_sizes) - 1), st.integers(0, 19)), max_size=3)
    num_lanes = draw(st.sampled_from([1, 2, 4, 8]))
    records_per_chunk = draw(st.integers(2, 4))
    divisors = [d for d in range(1, num_lanes + 1) if num_lanes % d == 0]
    enough = num_lanes * records_per_chunk  # every lane needs a chunk of every dataset
    other_shards = st.tuples(st.integers(enough, enough + 20)) | st.tuples(st.integers(enough, enough + 20),
                                                                           st.integers(1, 30))
    return FiniteRecipe(
        shard_sizes=shard_sizes,
        bad_lines=frozenset(bad),
        num_lanes=num_lanes,
        microbatch_size=draw(st.integers(1, 3)),
        microbatches_per_lane_step=draw(st.integers(1, 2)),
        num_epochs=draw(st.integers(1, 2)),
        algorithm=draw(st.sampled_from(["wrap", "first_fit"])),
        max_length=draw(st.sampled_from([16, 32, 64])),
        flush_every_chunks=draw(st.integers(1, 3)),
        records_per_chunk=records_per_chunk,
        shuffle_buffer=draw(st.sampled_from([1, 4, 8])),
        seed=draw(st.integers(0, 99)),
        drop_per_mille=draw(st.sampled_from([0, 200, 600])),
        lanes_losing_last_chunk=frozenset(draw(st.sets(st.integers(0, num_lanes - 1)))),
        worlds=tuple(draw(st.sampled_from(divisors)) for _ in range(3)),
        others=tuple(draw(st.lists(
            st.tuples(other_shards, st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from([0.5, 1, 2])), max_size=2))),
        media=(media := draw(st.sampled_from(["text", "images", "deferred images"]))),
        bad_images=frozenset() if media == "text" else frozenset(draw(bad_images)),
    )


_FINITE_ROOT = Path(tempfile.mkdtemp(prefix="zephon-fuzz-ragged-"))
atexit.register(shutil.rmtree, _FINITE_ROOT, ignore_errors=True)


@cache
def _finite_dataset(shard_sizes: tuple[int, ...], bad_lines: frozenset, name: str = "d", pictures: bool = False,
                    bad_images: frozenset = frozenset()) -> Dataset:
    root = Path(tempfile.mkdtemp(dir=_FINITE_ROOT))
    for shard, size in enumerate(shard_sizes):
        records = clean_records(size, f"ragged/{shard}" if name == "d" else f"ragged/{name}/{shard}")
        for index, record in enumerate(records if pictures else ()):
            record["image"] = _write_picture(root, shard, index, bad=(shard, index) in bad_images)
        lines = jsonl_lines(records)
        for s, index in sorted(bad_lines):
            if s == shard:
                lines[index] = b"{not json" if index % 2 else json.dumps({"id": "blank", "text": " "}).encode()
        write_lines(root / f"part-{shard:05d}.jsonl", lines)
    return Dataset.from_path(name, str(root))


def _write_picture(root: Path, shard: int, index: int, bad: bool) -> str:
    """A PNG of 8-60 px a side beside the shards, its name as a record holds it. A `bad` one keeps
    half its compressed pixels: at an odd index in a well-formed chunk (the header and the chunks
    check, the pixels do not decode: a deferred picture fails as its row is taken), at an even one
    by the file cut in half (the checks refuse it before packing)."""
    data = encode(gradient(8 + (7 * index + 3 * shard) % 53, 8 + (11 * index + 5 * shard) % 53))
    if bad and index % 2:
        at = data.index(b"IDAT")
        pixels = data[at + 4 : at + 4 + int.from_bytes(data[at - 4 : at], "big") // 2]
        chunk = len(pixels).to_bytes(4, "big") + b"IDAT" + pixels + zlib.crc32(b"IDAT" + pixels).to_bytes(4, "big")
        data = data[: at - 4] + chunk + data[data.index(b"IEND") - 4 :]
    elif bad:
        data = data[: len(data) // 2]
    name = f"images/{shard}-{index}.png"
    (root / "images").mkdir(exist_ok=True)
    (root / name).write_bytes(data)
    return name


def finite_pipeline(recipe: FiniteRecipe, runner: str | None = "inline"):
    """The recipe's datasets, mixed -> filter -> packed (`_packed`) -> shuffle -> batch, on a finite
    plan (`runner=None`: without the filter)."""
    pictures = recipe.media != "text"
    datasets = [_finite_dataset(recipe.shard_sizes, recipe.bad_lines, "d", pictures, recipe.bad_images)] + [
        _finite_dataset(sizes, frozenset(), f"o{i}", pictures) for i, (sizes, _, _) in enumerate(recipe.others)]
    mixture = {"d": 1.0, **{f"o{i}": weight for i, (_, weight, _) in enumerate(recipe.others)}}
    source = StaticMixtureWorkSource(datasets, mixture=mixture, seed=recipe.seed,
                                     records_per_chunk=recipe.records_per_chunk,
                                     num_epochs=recipe.passes if recipe.others else recipe.num_epochs)
    pipeline = Pipeline(source).options(num_lanes=recipe.num_lanes, runner=runner or "inline",
                                        flush_every_chunks=recipe.flush_every_chunks)
    if runner is not None:  # without the filter: to find what it drops
        pipeline = pipeline.filter(_Keep(_last_chunks_texts(recipe), recipe.drop_per_mille))
    packed = _packed(pipeline, recipe.media, recipe.max_length, recipe.algorithm)
    return packed.shuffle(buffer_size=recipe.shuffle_buffer, seed=recipe.seed).batch(recipe.microbatch_size)


def _packed(pipeline: Pipeline, media: str, max_length: int, algorithm: str = "wrap") -> Pipeline:
    """tokenize -> pack_flat for text; for pictures decode_images (deferred or not) -> tokenize ->
    pack_multimodal."""
    if media == "text":
        return pipeline.tokenize(str(TOKENIZER), field="text", eos="<|eos|>").pack_flat(max_length, algorithm=algorithm)
    return (pipeline.decode_images(field="image", spec=PICTURES, defer=media == "deferred images", paths=True)
            .tokenize(str(TOKENIZER), field="text", bos="<|bos|>", eos="<|eos|>")
            .pack_multimodal(max_length, PixtralPlaceholders(3, 4, 5)))


@cache
def _last_chunks_texts(recipe: FiniteRecipe) -> frozenset[str]:
    """The texts of the last chunk of each lane of `recipe.lanes_losing_last_chunk`."""
    texts = set()
    with finite_pipeline(recipe, runner=None).shard(0, 1, global_batch_size=recipe.global_batch_size) as loader:
        for lane in sorted(recipe.lanes_losing_last_chunk):
            plan = lane_plan(loader.plan, lane, recipe.flush_every_chunks)
            chunks = [item for item in plan if not isinstance(item, Flush)]
            dataset = loader.plan.datasets[chunks[-1].dataset]
            texts.update(record.get("text") for record in dataset.read_chunk(chunks[-1], on_error="skip").records)
    return frozenset(texts)


@dataclass(frozen=True)
class _Keep:
    """Keeps a record unless its text is in `dropped` or falls in the `per_mille` its hash picks."""

    dropped: frozenset
    per_mille: int

    def __call__(self, record: dict) -> bool:
        text = record.get("text")
        picked = int(hashlib.sha256(str(text).encode()).hexdigest()[:8], 16) % 1000 < self.per_mille
        return text not in self.dropped and not picked


def _run(recipe: FiniteRecipe, world: int, state=None, runner: str = "inline") -> tuple[dict, Counter]:
    """Every rank of `world` (resumed from `state`) to the end: {(step, lane, index): digest} and
    the ranks' ledgers summed (records by dataset and by dataset and lane, rows by lane and the
    tokens and images of each dataset in them)."""
    digests, ledger = {}, Counter()
    pipeline = finite_pipeline(recipe, runner)
    for rank in range(world):
        with pipeline.shard(rank, world, global_batch_size=recipe.global_batch_size) as loader:
            if state is not None:
                loader.load_state_dict(state)
            for batch in loader:
                key = (batch.step, batch.lane, batch.index)
                assert key not in digests, f"microbatch {key} delivered twice"
                digests[key] = batch.digest()
            stats = loader.stats()
        for name, entry in stats["datasets"].items():
            by_lane = [(f"{name}/{lane}", counts) for lane, counts in entry["lanes"].items()]
            for where, counts in [(name, entry["total"]), *by_lane]:
                for key, value in counts.items():
                    if key == "skipped":
                        ledger.update({f"{where}:skipped:{reason}": n for reason, n in value.items()})
                    else:
                        ledger[f"{where}:{key}"] += value
        for lane, counts in stats["lanes"].items():
            ledger.update({f"lane {lane}:{key}": n for key, n in counts.items() if key != "datasets"})
            for name, by_kind in counts["datasets"].items():
                ledger.update({f"lane {lane}:{name}:{kind}": n for kind, n in by_kind.items()})
    return digests, ledger


@cache
def finite_reference(recipe: FiniteRecipe) -> tuple[dict, Counter]:
    digests, ledger = _run(recipe, 1)
    sizes = {"d": recipe.shard_sizes, **{f"o{i}": sizes for i, (sizes, _, _) in enumerate(recipe.others)}}
    for name, passes in recipe.passes.items():
        skipped = sum(n for key, n in ledger.items() if key.startswith(f"{name}:skipped:"))
        assert ledger[f"{name}:read"] == ledger[f"{name}:emitted"] + ledger[f"{name}:filtered"] + skipped, ledger
        if passes == int(passes):
            assert ledger[f"{name}:read"] == passes * sum(sizes[name]), (name, ledger)
        else:  # part of a pass: in each lane the nearest whole number of its chunks, at least one
            assert 0 < ledger[f"{name}:read"] <= sum(sizes[name]), (name, ledger)
    return digests, ledger


def _lanes_of(recipe: FiniteRecipe, rank: int, world: int) -> range:
    per_rank = recipe.num_lanes // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def _step_end_saves(recipe: FiniteRecipe, world: int, state=None, first_step: int = 0) -> dict[int, dict]:
    """{steps taken: merged state} of a trainer on `world` ranks taking each step whole from
    `first_step` on (resumed from `state`) and saving at every step's end; a rank with nothing
    from `first_step` on is asked once (it stops) and never again."""
    reference, _ = finite_reference(recipe)
    last = max((step for step, _, _ in reference), default=-1) + 1
    saves: list[dict[int, dict]] = []
    for rank in range(world):
        lanes = _lanes_of(recipe, rank, world)
        per_step = Counter(step for step, lane, _ in reference if lane in lanes and step >= first_step)
        with finite_pipeline(recipe).shard(rank, world, global_batch_size=recipe.global_batch_size) as loader:
            if state is not None:
                loader.load_state_dict(state)
            microbatches = iter(loader)
            if not per_step:
                assert next(microbatches, None) is None
            saves.append({})
            for step in range(first_step, last):
                for _ in range(per_step[step]):
                    batch = next(microbatches)
                    assert batch.digest() == reference[(batch.step, batch.lane, batch.index)]
                saves[rank][step + 1] = loader.state_dict()
    return {steps: merge_states([save[steps] for save in saves]) for steps in saves[0]}


def _rest(recipe: FiniteRecipe, taken=lambda key: False, from_step: int = 0) -> dict:
    reference, _ = finite_reference(recipe)
    return {key: digest for key, digest in reference.items() if key[0] >= from_step and not taken(key)}


@fuzz_settings(ci=20)
@given(recipe=finite_recipes(), rng=st.randoms(use_true_random=False))
def test_every_step_end_save_in_a_finite_plan_merges_and_resumes_on_any_world_size_with_its_ledger(recipe, rng):
    """Saved at every step's end on R ranks (merge_states never refuses one), resumed on R' (with
    threads or inline): every later global batch is the uninterrupted run's, and the ledger ends
    where the uninterrupted run's does. Resumed so, a trainer saving again at every step's end on
    R' gives states that resume on R'' as well."""
    saved_on, resumed_on, again_on = recipe.worlds
    _, ledger = finite_reference(recipe)
    merged = _step_end_saves(recipe, saved_on)
    for steps in rng.sample(sorted(merged), min(2, len(merged))):
        digests, resumed_ledger = _run(recipe, resumed_on, merged[steps], runner=rng.choice(["inline", "thread"]))
        assert digests == _rest(recipe, from_step=steps), (steps, recipe)
        assert resumed_ledger == ledger, (steps, recipe)
    steps = rng.choice(sorted(merged)[:-1] or [0])  # a save with steps left to take
    merged_again = _step_end_saves(recipe, resumed_on, merged.get(steps), first_step=steps)
    later = rng.choice(sorted(merged_again))
    digests, resumed_ledger = _run(recipe, again_on, merged_again[later])
    assert digests == _rest(recipe, from_step=later), (steps, later, recipe)
    assert resumed_ledger == ledger, (steps, later, recipe)


@fuzz_settings(ci=20)
@given(recipe=finite_recipes(), per_call=st.integers(1, 4), calls=st.integers(1, 12))
def test_a_save_after_as_many_microbatches_per_rank_in_a_finite_plan_resumes_the_rest(recipe, per_call, calls):
    """A trainer taking `per_call` microbatches from every rank per call (TorchTitan's local batch;
    a rank that has run out gives fewer, then none) saves after `calls` calls, partway through a
    step or in the ragged end. merge_states takes it; resumed on R' (or, where R' would split the
    step's rest unevenly, refused by name and resumed on R) every microbatch not yet taken comes
    once, as in the uninterrupted run, and the ledger ends where the uninterrupted run's does."""
    saved_on, resumed_on, _ = recipe.worlds
    _, ledger = finite_reference(recipe)
    taken, states = set(), []
    for rank in range(saved_on):
        with finite_pipeline(recipe).shard(rank, saved_on, global_batch_size=recipe.global_batch_size) as loader:
            for batch in islice(loader, per_call * calls):
                taken.add((batch.step, batch.lane, batch.index))
            states.append(loader.state_dict())
    merged = merge_states(states)
    try:
        digests, resumed_ledger = _run(recipe, resumed_on, merged)
    except CheckpointError as exc:
        assert "saved partway through step" in str(exc), recipe
        digests, resumed_ledger = _run(recipe, saved_on, merged)
    assert digests == _rest(recipe, taken=taken.__contains__), recipe
    assert resumed_ledger == ledger, recipe


@fuzz_settings(ci=20)
@given(recipe=finite_recipes(), where=st.sampled_from(["ask", "row", "decode", "collate", "count"]), data=st.data())
def test_an_interrupted_microbatch_in_a_finite_plan_leaves_the_state_where_the_trainer_is(recipe, where, data):
    """An interrupt while a rank's microbatch is taken (waiting while the loader asks a lane
    whether it has more, its own or, looking past it, a later one; waiting for one of its rows;
    decoding a deferred row's pictures or putting their pixels in the row, inline), stacked into
    arrays or counted, a lane's last one included, inline or with the thread runner: the state
    saved then is the state saved before that microbatch, its ledger too (the rows counted before
    an interrupt in the counting stayed counted), and iterating again hands over the rest of the
    rank's uninterrupted microbatches."""
    from vlm._deferred import DecodeDeferred
    from zephon import _lane, _ledger, _loader

    world = recipe.worlds[0]
    rank = data.draw(st.integers(0, world - 1))
    reference, _ = finite_reference(recipe)
    lanes = _lanes_of(recipe, rank, world)
    mine = sorted((*key, digest) for key, digest in reference.items() if key[1] in lanes)
    if not mine:
        return
    lasts = sorted({lane: i for i, (_, lane, _, _) in enumerate(mine)}.values())  # where a lane finds its end
    before = data.draw(st.sampled_from(lasts) | st.integers(0, len(mine) - 1))
    if where == "decode":
        target, name = DecodeDeferred, data.draw(st.sampled_from(["run", "apply"]))
    else:
        target, name = {"ask": (_lane.LaneStream, "has_more"), "row": (_lane.LaneStream, "next"),
                        "collate": (_loader, "collate"), "count": (_ledger.Ledger, "count_rows")}[where]
    original, calls = getattr(target, name), Counter()

    def watched(*args):
        """Counts the calls while `calls["on"]`; raises at call number `calls["at"]` (0: at none)."""
        calls["n"] += calls["on"]
        if calls["on"] and calls["n"] == calls["at"]:
            raise Interrupt
        return original(*args)

    # Threads run the decode itself, and call `apply` as they finish it: not where a signal lands.
    runner = "inline" if where == "decode" else data.draw(st.sampled_from(["inline", "thread"]))
    pipeline = finite_pipeline(recipe, runner)
    with pytest.MonkeyPatch.context() as patch:  # before the loaders: a runner's stages hold the row work's `run`
        patch.setattr(target, name, staticmethod(watched) if name == "run" else watched)
        with pipeline.shard(rank, world, global_batch_size=recipe.global_batch_size) as loader:
            calls["on"] = 1  # the calls up to the next microbatch, then its own
            taken = iter(loader)
            for _ in islice(taken, before):
                pass
            calls_before, calls["on"] = calls["n"], 0
            expected = loader.state_dict()  # its asks, on streams of its own, are not the iteration's
            calls["on"] = 1
            next(taken)
        if calls["n"] == calls_before:  # none while that microbatch was taken (text, or its rows decoded before)
            return
        calls["at"], calls["n"] = data.draw(st.integers(calls_before + 1, calls["n"])), 0
        with pipeline.shard(rank, world, global_batch_size=recipe.global_batch_size) as loader:
            seen = []
            with pytest.raises(Interrupt):
                for batch in loader:
                    seen.append((batch.step, batch.lane, batch.index, batch.digest()))
            calls["on"] = 0
            assert len(seen) == before
            state = loader.state_dict()
            assert state == expected, recipe
            seen += [(batch.step, batch.lane, batch.index, batch.digest()) for batch in loader]
    assert sorted(seen) == mine, recipe
