"""Question-and-answer records trained on their answers (`tokenize(prompt_field=...)`), mixed with
plain text: the same global-batch SHA-256s on every runner and world size and after a resume on
another one, and every answer token and no prompt token learned over an epoch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.harness import GLOBAL_BATCH, NUM_LANES, checkpoint_after, step_digests
from zephon import IGNORE_INDEX, Pipeline
from zephon._tokenizer import load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

WORDS = "lane shard chunk token pack shuffle batch flush replay seed mixture rank epoch".split()
STEPS = 6


def write_corpora(root: Path) -> tuple[Path, Path]:
    """`qa/`: {"prompt", "text"} records; `web/`: {"text"} records, which have no prompt."""
    rng = random.Random(11)
    for name in ("qa", "web"):
        (root / name).mkdir(parents=True)
        for shard in range(3):
            lines = []
            for _ in range(20):
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
                record = {"text": text}
                if name == "qa":
                    record["prompt"] = "Question: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + "?\n"
                lines.append(json.dumps(record))
            (root / name / f"part-{shard:03d}.jsonl").write_text("".join(line + "\n" for line in lines))
    return root / "qa", root / "web"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    return write_corpora(tmp_path_factory.mktemp("loss_mask"))


def no_prompt_is_an_empty_one(record: dict) -> dict:
    """A plain-text record trains on all of itself: an empty prompt."""
    return record if "prompt" in record else {**record, "prompt": ""}


def pipeline(corpora, tokenizer, *, runner: str = "inline", num_epochs: int | None = None) -> Pipeline:
    qa, web = corpora
    source = StaticMixtureWorkSource([Dataset.from_path("qa", str(qa)), Dataset.from_path("web", str(web))],
                                     mixture={"qa": 0.5, "web": 0.5}, seed=3, records_per_chunk=4,
                                     num_epochs=num_epochs)
    return (Pipeline(source).options(num_lanes=NUM_LANES, runner=runner, flush_every_chunks=2)
            .map(no_prompt_is_an_empty_one, parallelism=2)
            .tokenize(str(tokenizer), bos="<|bos|>", eos="<|eos|>", prompt_field="prompt", parallelism=2)
            .pack_flat(48, algorithm="first_fit")
            .shuffle(8, seed=3)
            .batch(2))


@pytest.fixture(scope="module")
def reference(corpora, demo_tokenizer_path) -> list[str]:
    return step_digests(pipeline(corpora, demo_tokenizer_path), 1, STEPS)


@pytest.mark.parametrize("runner, world_size", [("inline", 2), ("thread", 4), ("process", 2)])
def test_the_same_global_batches_on_every_runner_and_world_size(corpora, demo_tokenizer_path, reference, runner,
                                                                world_size):
    assert step_digests(pipeline(corpora, demo_tokenizer_path, runner=runner), world_size, STEPS) == reference


@pytest.mark.parametrize("source_world, target_world", [(2, 4), (4, 1)])
def test_a_resume_on_another_world_size_gives_the_uninterrupted_batches(corpora, demo_tokenizer_path, reference,
                                                                        source_world, target_world):
    state = json.loads(json.dumps(checkpoint_after(pipeline(corpora, demo_tokenizer_path, runner="thread"),
                                                   source_world, 2)))
    resumed = step_digests(pipeline(corpora, demo_tokenizer_path), target_world, STEPS - 2, state=state, start_step=2)
    assert resumed == reference[2:]


def test_an_epoch_learns_every_answer_token_and_eos_and_no_prompt_token(corpora, demo_tokenizer_path):
    """Over one epoch the learned labels are, as a multiset, every record's text ids and EOS (a
    web record's first text id too: its empty prompt leaves only BOS out); no prompt id is learned.
    The ledger counts them, per dataset, in `stats()["mixture"][name]["learned"]`."""
    encode = load_tokenizer(str(demo_tokenizer_path)).tokenizer.encode
    expected: list[int] = []
    expected_by_dataset = {corpus.name: 0 for corpus in corpora}
    prompts = 0
    for corpus in corpora:
        for shard in sorted(corpus.glob("*.jsonl")):
            for line in shard.read_text().splitlines():
                record = json.loads(line)
                answer = encode(record["text"], add_special_tokens=False).ids + [1]
                expected += answer
                expected_by_dataset[corpus.name] += len(answer)
                prompts += len(encode(record.get("prompt", ""), add_special_tokens=False).ids)
    learned, positions = [], 0
    with pipeline(corpora, demo_tokenizer_path, num_epochs=1).shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        for batch in loader:
            arrays = batch.to_numpy()
            labels = arrays["labels"][arrays["document_ids"] >= 0]
            learned += labels[labels != IGNORE_INDEX].tolist()
            positions += len(labels)
        stats = loader.stats()
    assert sorted(learned) == sorted(expected)
    assert prompts > 0 and positions == len(expected) + prompts + 120, "every record's BOS, prompt, text and EOS"
    assert all(not totals["total"].get("skipped") for totals in stats["datasets"].values())
    assert {name: counts["learned"] for name, counts in stats["mixture"].items()} == expected_by_dataset
    assert sum(lane["learned"] for lane in stats["lanes"].values()) == len(expected)
