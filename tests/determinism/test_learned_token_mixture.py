"""A mixture of the tokens a loss learns (`TokenEstimation(count="learned")`): question-and-answer
records, whose long questions are not learned, mixed with plain text, which is learned whole. By
every token, each dataset gets its weight of the rows and the answers a small part of the training
signal; by learned tokens, each gets its weight of the labels a loss counts."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tests.harness import GLOBAL_BATCH, NUM_LANES, dataset_counts_in, step_digests, summed_over_lanes
from zephon import ConfigurationError, Pipeline
from zephon.io import Dataset
from zephon.work import ScheduledMixtureWorkSource, StaticMixtureWorkSource, TokenEstimation

WORDS = "the of and a to in lane shard chunk token pack shuffle batch flush replay seed".split()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """`qa/`: questions of 40-80 words and answers of 4-12; `web/`: texts of 20-60 words."""
    rng = random.Random("learned")
    root = tmp_path_factory.mktemp("learned_mixture")

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    for name, make in (("qa", lambda: {"prompt": words(40, 80) + "?", "text": words(4, 12)}),
                       ("web", lambda: {"text": words(20, 60)})):
        (root / name).mkdir()
        for shard in range(2):
            (root / name / f"part-{shard}.jsonl").write_text("".join(json.dumps(make()) + "\n" for _ in range(200)))
    return root / "qa", root / "web"


def _prompt_or_none(record: dict) -> dict:
    return record if "prompt" in record else {**record, "prompt": ""}


def pipeline(corpora, count: str, *, runner: str = "inline", then=lambda tokenized: tokenized) -> Pipeline:
    """The mixture, `then` given the pipeline up to `tokenize` to add stages after it."""
    qa, web = corpora
    source = StaticMixtureWorkSource([Dataset.from_path("qa", str(qa)), Dataset.from_path("web", str(web))],
                                     mixture={"qa": 0.5, "web": 0.5},
                                     token_estimation=TokenEstimation(sample_records=128, count=count),
                                     seed=4, records_per_chunk=4)
    tokenized = (Pipeline(source).options(num_lanes=NUM_LANES, runner=runner, flush_every_chunks=2)
                 .map(_prompt_or_none).tokenize(str(_tokenizer()), eos="<|eos|>", prompt_field="prompt", parallelism=2))
    return then(tokenized).pack_flat(256, algorithm="first_fit").shuffle(8, seed=4).batch(2)


def _tokenizer():
    from tests.conftest import DEMO_DATA_DIR

    return DEMO_DATA_DIR / "tokenizer.json"


def realised(pipeline, min_tokens: int) -> tuple[dict[str, float], dict[str, float]]:
    """(each dataset's share of the tokens packed, its share of the labels learned)."""
    batches = []
    with pipeline.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        for batch in loader:
            batches.append(batch)
            if sum(b.num_real_tokens for b in batches) >= min_tokens:
                break
    counts = summed_over_lanes(dataset_counts_in(batches))
    shares = {kind: {name: c[kind] / sum(d[kind] for d in counts.values()) for name, c in counts.items()}
              for kind in ("tokens", "learned")}
    return shares["tokens"], shares["learned"]


def test_a_mixture_of_learned_tokens_gives_each_dataset_its_weight_of_the_labels_a_loss_counts(corpora):
    by_tokens, learned_by_tokens = realised(pipeline(corpora, "tokens"), 400_000)
    assert abs(by_tokens["qa"] - 0.5) < 0.02, by_tokens
    assert learned_by_tokens["qa"] < 0.3, ("by every token, the answers are a small part of the signal",
                                           learned_by_tokens)
    tokens_by_learned, by_learned = realised(pipeline(corpora, "learned"), 400_000)
    assert abs(by_learned["qa"] - 0.5) < 0.02, by_learned
    assert tokens_by_learned["qa"] > 0.7, ("its questions take the rows' room", tokens_by_learned)


def test_the_same_global_batches_on_every_runner_and_world_size_and_the_count_enters_the_recipe(corpora):
    reference = step_digests(pipeline(corpora, "learned"), 1, 4)
    assert step_digests(pipeline(corpora, "learned", runner="thread"), 4, 4) == reference
    assert step_digests(pipeline(corpora, "learned", runner="process"), 2, 4) == reference
    assert step_digests(pipeline(corpora, "tokens"), 1, 4) != reference
    with pipeline(corpora, "learned").shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        measured = loader.plan.fingerprint()
    assert measured["learned_per_byte"]["qa"] < measured["tokens_per_byte"]["qa"] / 3
    assert measured["learned_per_byte"]["web"] < measured["tokens_per_byte"]["web"]
    with pipeline(corpora, "tokens").shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        assert "learned_per_byte" not in loader.plan.fingerprint()


@pytest.mark.parametrize("count", ["tokens", "learned"])
def test_a_schedule_of_learned_tokens_switches_after_as_many_learned_tokens(corpora, count):
    """Question-and-answer records alone until 20,000 tokens, plain text after: the answers hand
    out 20,000 of what the plan counts, learned tokens or every token, to within what the estimate
    from 128 records misses by (4 % here, learned tokens per byte varying more than tokens) and a
    chunk a lane."""
    qa, web = corpora
    source = ScheduledMixtureWorkSource(
        [Dataset.from_path("qa", str(qa)), Dataset.from_path("web", str(web))],
        schedule=[(0, {"qa": 1, "web": 0}), (20_000, {"qa": 0, "web": 1})],
        token_estimation=TokenEstimation(sample_records=128, count=count), seed=4, records_per_chunk=4)
    scheduled = (Pipeline(source).options(num_lanes=NUM_LANES, runner="inline", flush_every_chunks=2)
                 .map(_prompt_or_none).tokenize(str(_tokenizer()), eos="<|eos|>", prompt_field="prompt")
                 .pack_flat(256, algorithm="first_fit").batch(2))
    with scheduled.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        batches = iter(loader)
        while sum(counts["tokens"] for counts in loader.stats()["mixture"].values()) < 400_000:
            next(batches)  # well past the switch on every lane: 160,000 tokens of answers and questions
        qa_counts = loader.stats()["mixture"]["qa"]
    qa_tokens, qa_learned = qa_counts["tokens"], qa_counts["learned"]
    chunk_a_lane = NUM_LANES * 4 * (120 if count == "tokens" else 14)  # 4 records of at most so many
    assert abs((qa_learned if count == "learned" else qa_tokens) - 20_000) < 0.05 * 20_000 + chunk_a_lane, qa_counts
    assert qa_learned < 0.25 * qa_tokens


def _learns_nothing(record: dict) -> dict:
    """A record none of whose labels a loss counts."""
    return {**record, "loss_mask": np.zeros(len(record["input_ids"]), dtype=bool)}


def test_a_dataset_whose_sample_learns_nothing_is_refused_by_a_mixture_of_learned_tokens(corpora):
    """Planned by every token, it would take its weight of the rows and teach nothing; a counter
    that does not count learned tokens cannot plan by them; the count is one of two."""
    web_learns_nothing = pipeline(corpora, "learned", then=lambda p: p.map(_learns_nothing, datasets="web"))
    with pytest.raises(ConfigurationError, match=r"dataset 'web': the token estimation sample of 128 records "
                                                 r"\(of 400\) yielded no token a loss learns"):
        web_learns_nothing.shard(0, 1, global_batch_size=GLOBAL_BATCH)
    qa = pipeline(corpora, "learned").source.datasets[0]
    assert TokenEstimation().measure(qa, lambda batch: 3).learned_per_byte is None, "an int counts no learned token"
    refusal = r"count='learned'.*does not count \(pack_flat's and pack_multimodal's do"
    with pytest.raises(ConfigurationError, match=refusal):
        TokenEstimation(count="learned").measure(qa, lambda batch: 3)
    with pytest.raises(ConfigurationError, match=r"TokenEstimation: count must be one of \('tokens', 'learned'\)"):
        TokenEstimation(count="labels")
