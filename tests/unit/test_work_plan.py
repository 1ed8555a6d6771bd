"""A lane's plan gives the same chunk for a slot however the slots are looked up.

Lanes read their slots in order and the plan remembers the round of the last lookup; a resume
starts anywhere, and tests or tools may look slots up in any order.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

DATA = Path(__file__).resolve().parents[2] / "zephon" / "data"


def _plan(num_epochs):
    source = StaticMixtureWorkSource(
        [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))],
        mixture={"kjv": 0.6, "jargon": 0.4},
        seed=3,
        records_per_chunk=16,
        num_epochs=num_epochs,
        round_size=8,
    )
    return source.bind(None, num_lanes=2)


@pytest.mark.parametrize("num_epochs", [None, 1])
def test_slots_looked_up_in_any_order_match_slots_read_in_order(num_epochs):
    lane, slots = 1, range(160)  # 20 rounds of 8 slots; one epoch (~110 slots) ends inside them
    in_order = [_plan(num_epochs).slot(lane, s) for s in slots]
    assert sum(chunk is not None for chunk in in_order) > 100
    assert num_epochs is None or in_order[-1] is None, "the epoch should end inside the slots looked up"
    shuffled = list(slots)
    random.Random(0).shuffle(shuffled)
    plan = _plan(num_epochs)
    assert {s: plan.slot(lane, s) for s in shuffled} == dict(zip(slots, in_order))
    assert [plan.slot(lane, s) for s in reversed(slots)] == in_order[::-1]


@pytest.mark.parametrize("first_epoch", [0, 10**3, 10**9, 10**12])
def test_each_epoch_of_an_endless_plan_reads_the_lanes_chunks_in_a_fresh_order(first_epoch):
    """num_epochs=None restarts each dataset with a fresh permutation per epoch: every epoch holds
    each of the lane's chunks once, in another order than the epoch before; also a week into a job
    and far past it, where epochs and slots are large numbers on the plan's float token axis."""
    kjv = Dataset.from_path("kjv", str(DATA / "kjv"))
    per_lane, odd = divmod(len(kjv.chunks(16)), 2)
    assert not odd
    plan = StaticMixtureWorkSource([kjv], seed=3, records_per_chunk=16, round_size=8).bind(None, num_lanes=2)
    for lane in range(2):
        first = first_epoch * per_lane
        slots = [plan.slot(lane, s) for s in range(first, first + 3 * per_lane)]
        epochs = [slots[i * per_lane : (i + 1) * per_lane] for i in range(3)]
        assert all(len(set(epoch)) == per_lane and set(epoch) == set(epochs[0]) for epoch in epochs)
        assert epochs[0] != epochs[1] and epochs[1] != epochs[2], "an epoch repeats the order of the one before"


def test_rounds_of_a_later_phase_on_smaller_chunks_hold_about_round_size_chunks():
    """A round spans a stretch of the lane's token axis that was sized once, for the first
    mixture phase: a later phase drawing on chunks 10,000 times smaller (short posts after long
    books) put 40,000 chunks in a round, all listed and held at once; with chunks of expected
    weight 1e-9 (the floor of a chunk of no raw bytes) a round never finished listing. Each
    phase now cuts its own stretch into rounds of about `round_size` chunks."""
    import numpy as np

    from zephon._records import Chunk
    from zephon.work._plan import TokenInterleave

    chunks = {n: [Chunk(n, 0, i, i + 1) for i in range(8)] for n in ("books", "posts")}
    weights = {"books": np.full(8, 1e5), "posts": np.full(8, 10.0)}
    phases = [(0.0, {"books": 1.0, "posts": 0.0}), (4e5, {"books": 0.0, "posts": 1.0})]
    lane = TokenInterleave(chunks, weights, phases, seed="s", round_size=8, num_epochs=None)
    slots = [lane.slot(s) for s in range(40)]
    assert [c.dataset for c in slots] == ["books"] * 4 + ["posts"] * 36
    assert all(set(slots[i : i + 8]) == set(chunks["posts"]) for i in range(4, 36, 8)), "an epoch of posts"
    for s in (4, 20, 39):
        index, _ = lane._round_of(s)
        assert len(lane._round(index)) <= 2 * 8, f"slot {s}'s round holds {len(lane._round(index))} chunks"


def test_a_phase_starting_past_floats_range_of_rounds_leaves_the_plan_in_the_phase_before():
    """Rounds of 1e-8 tokens (chunks of weight 1e-9) before a phase at 1e307 tokens number past
    float's range; the plan stays in the first phase, which it never leaves in any real run."""
    import numpy as np

    from zephon._records import Chunk
    from zephon.work._plan import TokenInterleave

    chunks = {n: [Chunk(n, 0, i, i + 1) for i in range(8)] for n in ("a", "b")}
    weights = {"a": np.full(8, 1e-9), "b": np.full(8, 10.0)}
    phases = [(0.0, {"a": 1.0, "b": 0.0}), (1e307, {"a": 0.0, "b": 1.0})]
    lane = TokenInterleave(chunks, weights, phases, seed="s", round_size=8, num_epochs=None)
    assert {lane.slot(s).dataset for s in range(40)} == {"a"}


class _SparsePlan:
    """A user's work plan of one lane whose slot s holds a one-record chunk where `has_chunk(s)`
    and is empty (None) elsewhere; endless unless `total` slots are given."""

    datasets: dict = {}
    num_lanes = 1

    def __init__(self, has_chunk, total=None) -> None:
        self.has_chunk, self.total = has_chunk, total

    def slot(self, lane, s):
        from zephon._records import Chunk

        return Chunk("d", 0, s, s + 1) if self.has_chunk(s) else None

    def num_slots(self, lane):
        return self.total

    def fingerprint(self) -> dict:
        return {}


def test_an_endless_plan_giving_a_lane_only_empty_slots_is_refused_naming_the_lane(monkeypatch):
    """Empty slots yield only flushes: a lane an endless plan gives no chunk for ever was read for
    ever (no row, no error). EMPTY_SLOTS_LIMIT empty slots in a row are now refused."""
    from itertools import islice

    from zephon import ConfigurationError
    from zephon.work import lane_plan

    monkeypatch.setattr("zephon.work._plan.EMPTY_SLOTS_LIMIT", 100)
    items = lane_plan(_SparsePlan(lambda s: s < 3), 0, flush_every=4)
    with pytest.raises(ConfigurationError, match=r"gave lane 0 no chunk in 100 slots in a row \(slots 3 to 102\)"):
        for _ in islice(items, 10_000):
            pass


def test_runs_of_empty_slots_shorter_than_the_limit_or_in_a_finite_plan_are_read_through(monkeypatch):
    from itertools import islice

    from zephon._records import Chunk
    from zephon.work import lane_plan

    monkeypatch.setattr("zephon.work._plan.EMPTY_SLOTS_LIMIT", 100)
    endless = lane_plan(_SparsePlan(lambda s: s % 100 == 99), 0, flush_every=4)  # 99 empty slots in a row
    starts = [item.start for item in islice(endless, 5_000) if isinstance(item, Chunk)]
    assert starts[:3] == [99, 199, 299] and len(starts) > 100
    finite = list(lane_plan(_SparsePlan(lambda s: s == 1_000, total=1_001), 0, flush_every=4))
    assert [item.start for item in finite if isinstance(item, Chunk)] == [1_000]


def test_a_lane_read_in_order_finds_each_slots_round_without_searching_from_round_zero(monkeypatch):
    """With many lanes a round holds a chunk or two (`round_size // num_lanes`: 1,024 lanes of
    the default 1,024 give one), so a lane read in order enters a new round at nearly every slot.
    Each new round was found by a binary search from round 0, which asks where about 2·log2(r)
    rounds start, each a search over every dataset: deep into a run (10 datasets, 256 lanes)
    the loader spent ~3 ms a chunk there. The round after the last one looked up is tried
    first, which takes one more round start per round entered."""
    from zephon.work._plan import TokenInterleave

    source = StaticMixtureWorkSource(
        [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))],
        seed=3, records_per_chunk=16, round_size=2,
    )
    slots = range(10**6, 10**6 + 200)
    looked_up_backwards = source.bind(None, num_lanes=2)
    expected = [looked_up_backwards.slot(1, s) for s in reversed(slots)][::-1]
    plan = source.bind(None, num_lanes=2)
    calls = {"n": 0}
    original = TokenInterleave._round_start

    def counted(self, round_index):
        calls["n"] += 1
        return original(self, round_index)

    monkeypatch.setattr(TokenInterleave, "_round_start", counted)
    assert [plan.slot(1, s) for s in slots] == expected
    assert calls["n"] <= 2 * len(slots) + 64


def test_the_demo_recipes_plan_deals_and_orders_the_chunks_it_did_at_recipe_version_9():
    """What every lane reads, slot by slot, for a token-weighted two-dataset recipe on 8 lanes,
    against the SHA-256 of the same slots listed at recipe version 9: how the plan holds its chunks
    (a table of arrays since, where every rank built an object per chunk of the corpus) must not
    change which chunk a slot reads."""
    from zephon._sha256 import sha256
    from zephon.work import TokenEstimation

    source = StaticMixtureWorkSource(
        [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))],
        mixture={"kjv": 0.7, "jargon": 0.3},
        token_estimation=TokenEstimation(sample_records=64),
        seed=11,
        records_per_chunk=8,
        round_size=64,
    )
    plan = source.bind(lambda batch: sum(len(r["text"]) // 4 for r in batch.records), num_lanes=8)
    slots = [[plan.slot(lane, s) for s in range(0, 3000, 7)] for lane in range(8)]
    listed = repr([[(c.dataset, c.shard, c.start, c.stop) for c in lane] for lane in slots]).encode()
    assert sha256(listed).hexdigest() == "797e1a5227317666a63e26bbc1b069ecef94ca018ef6eb1d8ddf23a7b670e5b9"


def test_an_endless_plans_barren_records_bound_makes_no_chunk_object_per_chunk(monkeypatch):
    """Each lane's bound on records read without a row sums its chunks' records when the loader
    opens it. Over the plan's table of arrays it made a `Chunk` for every chunk of the lane to
    read its `num_records` (~2 us each: 16 million chunks on one rank, half a minute before the
    first batch), what the table was made to avoid."""
    from zephon.work import _chunk_table

    plan = StaticMixtureWorkSource(
        [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))],
        seed=3, records_per_chunk=1,
    ).bind(None, num_lanes=2)
    made = {"n": 0}
    original = _chunk_table.Chunk

    def counted(*args):
        made["n"] += 1
        return original(*args)

    monkeypatch.setattr(_chunk_table, "Chunk", counted)
    assert [plan.barren_records(lane, flush_every=4) for lane in range(2)] == [4623, 4619]  # as at 386a370, when the plan held Chunk lists
    assert made["n"] == 0
