"""A scheduled mixture switches weights at a global token count, the same on every layout."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.harness import GLOBAL_BATCH, step_digests
from zephon import ConfigurationError, Pipeline
from zephon.demo._recipe import DATA, TOKENIZER
from zephon.io import Dataset
from zephon.work import ScheduledMixtureWorkSource, TokenEstimation
from zephon.work._plan import Flush, lane_plan

SWITCH = 600_000


def scheduled_pipeline(runner="thread", parallelism=2):
    source = ScheduledMixtureWorkSource(
        datasets=[Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))],
        schedule=[(0, {"kjv": 0.8, "jargon": 0.2}), (SWITCH, {"kjv": 0.2, "jargon": 0.8})],
        token_estimation=TokenEstimation(),
        seed=3,
        records_per_chunk=8,
    )
    return (
        Pipeline(source)
        .options(num_lanes=8, runner=runner)
        .tokenize(str(TOKENIZER), parallelism=parallelism, eos="<|eos|>")
        .pack_flat(2048)
        .batch(1)
    )


def test_token_shares_follow_the_schedule_on_both_sides_of_the_switch():
    windows = {"before": (0, 550_000), "after": (650_000, 1_250_000)}
    tokens = {name: Counter() for name in windows}
    seen = 0
    with scheduled_pipeline().shard(0, 1, global_batch_size=8) as loader:
        for batch in loader:
            doc_ids = batch.tokens["document_ids"]
            for row, sources in enumerate(batch.sources):
                for piece, address in enumerate(sources):
                    n = int(np.count_nonzero(doc_ids[row] == piece))
                    for name, (lo, hi) in windows.items():
                        if lo <= seen < hi:
                            tokens[name][address.dataset] += n
                    seen += n
            if seen >= windows["after"][1]:
                break
    share = {name: c["kjv"] / sum(c.values()) for name, c in tokens.items()}
    assert abs(share["before"] - 0.8) < 0.02, share
    assert abs(share["after"] - 0.2) < 0.02, share


# Steps of 32 rows of 2048 tokens: the lanes pass the switch (75,000 expected tokens each) around
# step 9, so 16 steps hold both phases. At 6 steps the layouts were compared on the first phase
# only, a static mixture: nothing checked that the switch itself is the same on every layout.
LAYOUT_STEPS = 16


def test_a_scheduled_mixture_is_layout_independent():
    assert LAYOUT_STEPS * GLOBAL_BATCH * 2048 > 1.5 * SWITCH, "the compared steps must reach the second phase"
    assert step_digests(scheduled_pipeline(), 1, LAYOUT_STEPS) == step_digests(scheduled_pipeline("process", 1), 4,
                                                                              LAYOUT_STEPS)


@pytest.mark.parametrize(
    "schedule,message",
    [
        ([(5, {"kjv": 1.0})], "must start with a phase at token 0"),
        ([(0, {"kjv": 1.0}), (0, {"jargon": 1.0})], "increasing token counts"),
        ([(200, {"kjv": 1.0}), (0, {"jargon": 1.0})], r"increasing token counts: \[200, 0\]"),
        ([(0, {"nope": 1.0})], "not datasets of this source"),
        ([(0, {"kjv": -1.0, "jargon": 1.0})], "non-negative"),
    ],
)
def test_bad_schedules_are_rejected(schedule, message):
    datasets = [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))]
    with pytest.raises(ConfigurationError, match=message):
        ScheduledMixtureWorkSource(datasets, schedule)


def test_a_finite_schedule_must_draw_on_every_dataset_in_its_last_phase():
    datasets = [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))]
    starving = [(0, {"kjv": 0.5, "jargon": 0.5}), (200, {"kjv": 1.0, "jargon": 0.0})]
    with pytest.raises(ConfigurationError, match=r"last phase \(from token 200\).*\['jargon'\]"):
        ScheduledMixtureWorkSource(datasets, starving, num_epochs=1)
    ScheduledMixtureWorkSource(datasets, starving)  # endless: the switch simply stops drawing on jargon


def test_a_finite_schedule_delivers_every_chunk_once_per_epoch_and_ends():
    datasets = [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))]
    schedule = [(0, {"kjv": 0.9, "jargon": 0.1}), (200, {"kjv": 0.1, "jargon": 0.9})]
    source = ScheduledMixtureWorkSource(datasets, schedule, seed=3, records_per_chunk=16, num_epochs=2, round_size=8)
    plan = source.bind(None, num_lanes=2)
    chunks = Counter(
        (chunk.dataset, chunk.shard, chunk.start)
        for lane in range(2)
        for chunk in lane_plan(plan, lane, 4)
        if not isinstance(chunk, Flush)
    )
    every = {(ds.name, c.shard, c.start) for ds in datasets for c in ds.chunks(16)}
    assert set(chunks) == every and set(chunks.values()) == {2}


def test_without_token_estimation_a_phase_starts_at_a_record_count():
    """The docstring and README said phases start at global token counts; without a
    `token_estimation` the plan weighs chunks by records, so a start counts records (200 tokens
    per record would switch 200 times later than a reader of the docs expects). They say so now."""
    datasets = [Dataset.from_path("kjv", str(DATA / "kjv")), Dataset.from_path("jargon", str(DATA / "jargon"))]
    schedule = [(0, {"kjv": 1.0, "jargon": 0.0}), (320, {"kjv": 0.0, "jargon": 1.0})]
    plan = ScheduledMixtureWorkSource(datasets, schedule, records_per_chunk=16).bind(None, num_lanes=2)
    for lane in range(2):
        slots = [plan.slot(lane, s) for s in range(40)]
        first_jargon = next(i for i, c in enumerate(slots) if c.dataset == "jargon")
        assert all(c.dataset == "jargon" for c in slots[first_jargon:])
        assert abs(sum(c.num_records for c in slots[:first_jargon]) - 320 / 2) <= 16
    doc = " ".join(ScheduledMixtureWorkSource.__doc__.replace("`", "").split()).lower()
    assert "without a token_estimation" in doc and "start counts are global record counts" in doc
