"""Unpaired preference data (KTO) as users bring it: prompts and completions, each labelled
desirable or not, mixed with a dataset of scored answers. `document_values` carries the label (and
a weight) into the rows: the same global-batch SHA-256s on every runner and world size and after a
resume on another one; the values are in those digests; over an epoch on two ranks of the process
runner, each document holds its record's values."""

from __future__ import annotations

import json
import random

import pytest

from tests.harness import GLOBAL_BATCH, NUM_LANES, checkpoint_after, step_digests
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation

STEPS = 6
WORDS = "lane shard chunk token pack shuffle batch flush replay seed mixture rank epoch".split()


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _write(directory, shards: int, records_per_shard: int, rng: random.Random, flipped: bool) -> None:
    directory.mkdir()
    for shard in range(shards):
        records = []
        for _ in range(records_per_shard):
            label = rng.random() < 0.6
            records.append({"prompt": f"Question: {_words(rng, 1, 8)}?\n", "completion": _words(rng, 1, 30),
                            "label": label != flipped, "weight": round(rng.uniform(0.5, 2.0), 3)})
        (directory / f"part-{shard}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """{"as given": root, "flipped": root}: two datasets ("kto": 3 shards, "scored": 1), the second
    root the same records with every label flipped."""
    out = {}
    for name, flipped in (("as given", False), ("flipped", True)):
        root = tmp_path_factory.mktemp("kto")
        rng = random.Random(21)
        _write(root / "kto", 3, 30, rng, flipped)
        _write(root / "scored", 1, 40, rng, flipped)
        out[name] = root
    return out


def pipeline(root, tokenizer, *, runner: str = "inline", algorithm: str = "first_fit",
             num_epochs: int | None = None) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path(name, str(root / name)) for name in ("kto", "scored")],
                                     mixture={"kto": 0.7, "scored": 0.3}, token_estimation=TokenEstimation(),
                                     seed=5, records_per_chunk=4, num_epochs=num_epochs)
    return (Pipeline(source).options(num_lanes=NUM_LANES, runner=runner, flush_every_chunks=2)
            .tokenize(str(tokenizer), field="completion", prompt_field="prompt", bos="<|bos|>", eos="<|eos|>",
                      parallelism=2)
            .pack_flat(48, algorithm, overlong="truncate", document_values=["label", "weight"])
            .shuffle(8, seed=5).batch(2))


@pytest.fixture(scope="module")
def reference(corpora, demo_tokenizer_path) -> list[str]:
    return step_digests(pipeline(corpora["as given"], demo_tokenizer_path), 1, STEPS)


@pytest.mark.parametrize("runner, world_size", [("inline", 2), ("thread", 4), ("process", 2)])
def test_the_same_global_batches_on_every_runner_and_world_size(corpora, demo_tokenizer_path, reference, runner,
                                                                  world_size):
    digests = step_digests(pipeline(corpora["as given"], demo_tokenizer_path, runner=runner), world_size, STEPS)
    assert digests == reference


def test_wrap_packing_carries_them_alike_on_every_runner(corpora, demo_tokenizer_path):
    wrap = step_digests(pipeline(corpora["as given"], demo_tokenizer_path, algorithm="wrap"), 1, STEPS)
    assert step_digests(pipeline(corpora["as given"], demo_tokenizer_path, algorithm="wrap", runner="process"),
                        4, STEPS) == wrap


def test_a_resume_on_another_world_size_gives_the_uninterrupted_batches(corpora, demo_tokenizer_path, reference):
    state = json.loads(json.dumps(checkpoint_after(pipeline(corpora["as given"], demo_tokenizer_path,
                                                            runner="thread"), 2, 2)))
    resumed = step_digests(pipeline(corpora["as given"], demo_tokenizer_path), 4, STEPS - 2, state=state,
                           start_step=2)
    assert resumed == reference[2:]


def test_the_values_are_in_the_digests(corpora, demo_tokenizer_path, reference):
    """The same ids, labels flipped: every step whose rows hold a document differs."""
    flipped = step_digests(pipeline(corpora["flipped"], demo_tokenizer_path), 1, STEPS)
    assert all(a != b for a, b in zip(flipped, reference))


def test_an_epoch_on_two_process_ranks_gives_each_document_its_records_values(corpora, demo_tokenizer_path):
    root = corpora["as given"]
    records = {}
    for name in ("kto", "scored"):
        for shard in sorted((root / name).glob("*.jsonl")):
            for index, line in enumerate(shard.read_text().splitlines()):
                records[name, shard.name, index] = json.loads(line)
    seen = {}
    for rank in range(2):
        with pipeline(root, demo_tokenizer_path, runner="process", num_epochs=1).shard(
                rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            for batch in loader:
                arrays = batch.to_numpy()
                values = iter(zip(arrays["label"].tolist(), arrays["weight"].tolist()))
                assert arrays["label_counts"].tolist() == [len(sources) for sources in batch.sources]
                for sources in batch.sources:
                    for address in sources:
                        key = address.dataset, address.shard.rsplit("/", 1)[-1], address.index
                        assert key not in seen, "first_fit places each document once, whole or truncated"
                        seen[key] = next(values)
    assert seen == {key: (float(r["label"]), r["weight"]) for key, r in records.items()}
