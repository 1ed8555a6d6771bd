"""Preference pairs (`pack_pairs`) from a mixture of two datasets as users bring them: TRL's
prompt/chosen/rejected texts and its conversational pairs with the prompt inside each chat. The same
global-batch SHA-256s on every runner and world size and after a resume on another one; over an
epoch each record's pair is in one row as documents 2k and 2k+1, its ids those the tokenizer and
the chat template make of it, learning the answers alone, and the pairs longer than a row are
skipped or cut to share it (their first ids kept or their last), counted. A mixture of pairs by
learned tokens gives each dataset its weight of the answers."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tests.harness import GLOBAL_BATCH, NUM_LANES, checkpoint_after, step_digests
from tests.unit.test_chat import CHATML, reference, tokenizer_dir
from zephon import IGNORE_INDEX, Pipeline
from zephon._tokenizer import load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation

MAX_LENGTH = 64
STEPS = 6
WORDS = "lane shard chunk token pack shuffle batch flush replay seed mixture rank epoch".split()


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, demo_tokenizer_path):
    """(the ChatML tokenizer's directory, 40 text pairs in 2 shards, 30 chat pairs); about a
    fifth of the pairs longer than a row."""
    root = tmp_path_factory.mktemp("preference")
    rng = random.Random(13)
    (root / "texts").mkdir()
    for shard in range(2):
        records = [{"prompt": f"Question: {_words(rng, 1, 6)}?\n", "chosen": _words(rng, 1, 14),
                    "rejected": _words(rng, 1, 14)} for _ in range(20)]
        (root / "texts" / f"part-{shard}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "chats").mkdir()
    chats = []
    for _ in range(30):
        question = [{"role": "user", "content": _words(rng, 1, 6)}]
        chats.append({"chosen": question + [{"role": "assistant", "content": _words(rng, 1, 10)}],
                      "rejected": question + [{"role": "assistant", "content": _words(rng, 1, 10)}]})
    (root / "chats" / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    return tokenizer_dir(root / "chatml", CHATML, demo_tokenizer_path), root / "texts", root / "chats"


def pipeline(corpora, overlong: str = "skip", *, algorithm: str = "first_fit", runner: str = "inline",
             num_epochs: int | None = None) -> Pipeline:
    directory, texts, chats = corpora
    source = StaticMixtureWorkSource([Dataset.from_path("texts", str(texts)), Dataset.from_path("chats", str(chats))],
                                     mixture={"texts": 0.5, "chats": 0.5}, token_estimation=TokenEstimation(),
                                     seed=9, records_per_chunk=4, num_epochs=num_epochs)
    tokenizer = str(directory / "tokenizer.json")
    pipe = Pipeline(source).options(num_lanes=NUM_LANES, runner=runner, flush_every_chunks=2)
    for side in ("chosen", "rejected"):
        pipe = (pipe.render_chat(directory, field=side, output_field=f"{side}_segments", datasets="chats",
                                 parallelism=2)
                .tokenize(tokenizer, field=f"{side}_segments", segments=True, output_field=f"{side}_ids",
                          loss_mask_field=f"{side}_loss_mask", datasets="chats", parallelism=2)
                .tokenize(tokenizer, field=side, prompt_field="prompt", keep_field=side == "chosen",
                          bos="<|bos|>", eos="<|eos|>", output_field=f"{side}_ids", loss_mask_field=f"{side}_loss_mask",
                          datasets="texts", parallelism=2))
    return pipe.pack_pairs(MAX_LENGTH, algorithm, overlong=overlong).shuffle(8, seed=9).batch(2)


@pytest.fixture(scope="module")
def references(corpora) -> dict[str, list[str]]:
    return {overlong: step_digests(pipeline(corpora, overlong), 1, STEPS) for overlong in ("skip", "truncate")}


@pytest.mark.parametrize("overlong", ["skip", "truncate"])
@pytest.mark.parametrize("runner, world_size", [("inline", 2), ("thread", 4), ("process", 2)])
def test_the_same_global_batches_on_every_runner_and_world_size(corpora, references, overlong, runner, world_size):
    assert step_digests(pipeline(corpora, overlong, runner=runner), world_size, STEPS) == references[overlong]


def test_one_pair_a_row_is_the_same_on_every_runner_and_world_size(corpora):
    reference = step_digests(pipeline(corpora, algorithm="pad"), 1, STEPS)
    assert step_digests(pipeline(corpora, algorithm="pad", runner="process"), 4, STEPS) == reference


@pytest.mark.parametrize("overlong", ["skip", "truncate"])
def test_a_resume_on_another_world_size_gives_the_uninterrupted_batches(corpora, references, overlong):
    state = json.loads(json.dumps(checkpoint_after(pipeline(corpora, overlong, runner="thread"), 2, 2)))
    resumed = step_digests(pipeline(corpora, overlong), 4, STEPS - 2, state=state, start_step=2)
    assert resumed == references[overlong][2:]
    assert references["skip"] != references["truncate"], "the corpus holds pairs longer than a row"


def _expected(corpora) -> dict[tuple[str, str, int], tuple[tuple[np.ndarray, np.ndarray], ...]]:
    """Each record's (ids, targets) of chosen and of rejected, made here apart from the pipeline:
    the texts' as tokenize writes them (BOS, prompt, answer, EOS; the answer and EOS learned), the
    chats' as transformers' `apply_chat_template` makes them, learned where its assistant mask says."""
    directory, texts, chats = corpora
    tokenizer = load_tokenizer(str(directory / "tokenizer.json")).tokenizer
    out = {}
    for shard in sorted(texts.glob("*.jsonl")):
        for index, line in enumerate(shard.read_text().splitlines()):
            record = json.loads(line)
            prompt = tokenizer.encode(record["prompt"], add_special_tokens=False).ids
            out["texts", shard.name, index] = tuple(
                _with_targets([0, *prompt, *tokenizer.encode(record[side], add_special_tokens=False).ids, 1],
                              1 + len(prompt)) for side in ("chosen", "rejected"))
    for index, line in enumerate((chats / "part-0.jsonl").read_text().splitlines()):
        record = json.loads(line)
        out["chats", "part-0.jsonl", index] = tuple(_learned_where(*reference(directory, record[side]))
                                                    for side in ("chosen", "rejected"))
    return out


def _with_targets(ids: list[int], prompt: int) -> tuple[np.ndarray, np.ndarray]:
    return _learned_where(ids, [i >= prompt for i in range(len(ids))])


def _learned_where(ids: list[int], learned: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, targets): an id where it is learned (the label of the one before it), else IGNORE_INDEX."""
    ids = np.array(ids, dtype=np.int32)
    return ids, np.where(learned, ids, IGNORE_INDEX)


@pytest.mark.parametrize("algorithm", ["first_fit", "pad"])
@pytest.mark.parametrize("overlong", ["skip", "truncate", "keep_end"])
def test_an_epoch_holds_each_pair_once_in_one_row_learning_its_answers(corpora, overlong, algorithm):
    expected = _expected(corpora)
    long = {key for key, ((chosen, _), (rejected, _)) in expected.items() if len(chosen) + len(rejected) > MAX_LENGTH}
    assert {dataset for dataset, _, _ in long} == {"texts", "chats"} and len(long) < len(expected) / 3
    placed = {}
    with pipeline(corpora, overlong, algorithm=algorithm, num_epochs=1).shard(
            0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        for batch in loader:
            for row, sources in enumerate(batch.sources):
                documents = batch.tokens["document_ids"][row]
                for k in range(0, len(sources), 2):
                    address = sources[k]
                    assert sources[k + 1] == address, "a pair's documents are one record's, side by side"
                    key = address.dataset, address.shard.rsplit("/", 1)[-1], address.index
                    assert key not in placed, "each pair once"
                    placed[key] = tuple((batch.tokens["input_ids"][row][documents == d],
                                         batch.tokens["labels"][row][documents == d]) for d in (k, k + 1))
        stats = loader.stats()
    missing = set(expected) - set(placed)
    assert missing <= long and (overlong == "skip") == (missing == long)
    for key, pair in placed.items():
        lengths = [len(ids) for ids, _ in pair]
        for (ids, labels), (full, targets), length in zip(pair, expected[key], lengths):
            first = len(full) - length if overlong == "keep_end" else 0
            np.testing.assert_array_equal(ids, full[first : first + length])
            np.testing.assert_array_equal(labels[:-1], targets[first + 1 : first + length])
            assert labels[-1] == IGNORE_INDEX and (labels != IGNORE_INDEX).any(), "each learns, but not past its end"
        assert sum(lengths) <= MAX_LENGTH
    for name in ("texts", "chats"):
        total = stats["datasets"][name]["total"]
        assert total["read"] == total["emitted"] + sum(total["skipped"].values())
        cut = [key for key in placed if key in long and key[0] == name]
        skipped = sum(key[0] == name for key in missing)
        assert total["skipped"] == ({"pair_too_long": skipped} if skipped else {})
        if overlong != "skip":
            dropped = sum(sum(len(full) for full, _ in expected[key]) - MAX_LENGTH for key in cut)
            assert (total.get("truncated", 0), total.get("truncated_tokens", 0)) == (len(cut), dropped)
            assert cut, "some pairs were cut to fit"


def test_a_mixture_of_pairs_by_learned_tokens_gives_each_dataset_its_weight_of_the_answers(tmp_path,
                                                                                          demo_tokenizer_path):
    """Pairs under long questions mixed with pairs under short ones: by every token each dataset
    fills half the rows and the long questions' answers are a small part of what is learned; by
    learned tokens (`TokenEstimation(count="learned")`, the pair packer's counter) each gets half of
    the labels a loss counts."""
    from tests.determinism.test_learned_token_mixture import realised

    rng = random.Random("pairs")
    for name, prompt, answer in (("long", (40, 60), (2, 6)), ("short", (2, 6), (10, 20))):
        (tmp_path / name).mkdir()
        records = [{"prompt": _words(rng, *prompt) + "?\n", "chosen": _words(rng, *answer),
                    "rejected": _words(rng, *answer)} for _ in range(300)]
        (tmp_path / name / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def mixture(count: str) -> Pipeline:
        source = StaticMixtureWorkSource([Dataset.from_path(name, str(tmp_path / name)) for name in ("long", "short")],
                                         mixture={"long": 0.5, "short": 0.5}, seed=3, records_per_chunk=4,
                                         token_estimation=TokenEstimation(sample_records=128, count=count))
        pipe = Pipeline(source).options(num_lanes=NUM_LANES, flush_every_chunks=2)
        for side in ("chosen", "rejected"):
            pipe = pipe.tokenize(str(demo_tokenizer_path), field=side, prompt_field="prompt",
                                 keep_field=side == "chosen", bos="<|bos|>", eos="<|eos|>", output_field=f"{side}_ids",
                                 loss_mask_field=f"{side}_loss_mask")
        return pipe.pack_pairs(512).shuffle(8, seed=3).batch(2)

    tokens, learned = realised(mixture("tokens"), 200_000)
    assert abs(tokens["long"] - 0.5) < 0.03 and learned["long"] < 0.25, (tokens, learned)
    tokens, learned = realised(mixture("learned"), 200_000)
    assert abs(learned["long"] - 0.5) < 0.03 and tokens["long"] > 0.75, (tokens, learned)
