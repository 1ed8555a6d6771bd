"""Documents longer than a row, truncated or skipped (`pack_flat(overlong=...)`), packed or one a
row (`algorithm="pad"`): the same global-batch SHA-256s on every runner and world size and after a
resume on another one; over an epoch every long document is placed once, its first `max_length`
ids (its last, "keep_end"), or not at all, and the ledger counts it, per dataset, as `truncated`
(with the ids dropped) or `skipped:document_too_long`."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.determinism.test_loss_mask_elastic import no_prompt_is_an_empty_one, write_corpora
from tests.harness import GLOBAL_BATCH, NUM_LANES, checkpoint_after, dataset_counts_in, step_digests, summed_over_lanes
from zephon import Pipeline
from zephon._packing import ALGORITHMS
from zephon._tokenizer import load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

MAX_LENGTH = 48
STEPS = 6


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Question-and-answer records beside plain text, a third of them longer than a row."""
    return write_corpora(tmp_path_factory.mktemp("overlong"))


def pipeline(corpora, tokenizer, overlong: str, *, algorithm: str = "first_fit", runner: str = "inline",
             num_epochs: int | None = None) -> Pipeline:
    qa, web = corpora
    source = StaticMixtureWorkSource([Dataset.from_path("qa", str(qa)), Dataset.from_path("web", str(web))],
                                     mixture={"qa": 0.5, "web": 0.5}, seed=5, records_per_chunk=4,
                                     num_epochs=num_epochs)
    return (Pipeline(source).options(num_lanes=NUM_LANES, runner=runner, flush_every_chunks=2)
            .map(no_prompt_is_an_empty_one, parallelism=2)
            .tokenize(str(tokenizer), bos="<|bos|>", eos="<|eos|>", prompt_field="prompt", parallelism=2)
            .pack_flat(MAX_LENGTH, algorithm=algorithm, overlong=overlong)
            .shuffle(8, seed=5)
            .batch(2))


@pytest.fixture(scope="module")
def references(corpora, demo_tokenizer_path) -> dict[str, list[str]]:
    return {overlong: step_digests(pipeline(corpora, demo_tokenizer_path, overlong), 1, STEPS)
            for overlong in ("truncate", "keep_end", "skip")}


@pytest.mark.parametrize("overlong", ["truncate", "keep_end", "skip"])
@pytest.mark.parametrize("runner, world_size", [("inline", 2), ("thread", 4), ("process", 2)])
def test_the_same_global_batches_on_every_runner_and_world_size(corpora, demo_tokenizer_path, references, overlong,
                                                                runner, world_size):
    digests = step_digests(pipeline(corpora, demo_tokenizer_path, overlong, runner=runner), world_size, STEPS)
    assert digests == references[overlong]


def test_unpacked_rows_are_the_same_on_every_runner_and_world_size(corpora, demo_tokenizer_path):
    """`algorithm="pad"`: one document a row, the rows dealt and shuffled as packed ones are."""
    reference = step_digests(pipeline(corpora, demo_tokenizer_path, "truncate", algorithm="pad"), 1, STEPS)
    for runner, world_size in [("thread", 4), ("process", 2)]:
        unpacked = pipeline(corpora, demo_tokenizer_path, "truncate", algorithm="pad", runner=runner)
        assert step_digests(unpacked, world_size, STEPS) == reference


@pytest.mark.parametrize("overlong", ["truncate", "skip"])
def test_a_resume_on_another_world_size_gives_the_uninterrupted_batches(corpora, demo_tokenizer_path, references,
                                                                        overlong):
    state = json.loads(json.dumps(checkpoint_after(pipeline(corpora, demo_tokenizer_path, overlong, runner="thread"),
                                                   2, 2)))
    resumed = step_digests(pipeline(corpora, demo_tokenizer_path, overlong), 4, STEPS - 2, state=state, start_step=2)
    assert resumed == references[overlong][2:]
    assert len({tuple(digests) for digests in references.values()}) == 3
    split = step_digests(pipeline(corpora, demo_tokenizer_path, "split"), 1, STEPS)
    assert split not in references.values(), "the corpus holds documents longer than a row"


def _records(corpora, tokenizer) -> dict[tuple[str, str, int], tuple[int, int]]:
    """(ids, prompt ids) of each record by (dataset, shard's file name, index), as tokenize writes
    them: BOS, the prompt's, the text's, EOS; the first 1 + prompt ids are not learned."""
    encode = load_tokenizer(str(tokenizer)).tokenizer.encode
    out = {}
    for corpus in corpora:
        for shard in sorted(corpus.glob("*.jsonl")):
            for index, line in enumerate(shard.read_text().splitlines()):
                record = json.loads(line)
                prompt = len(encode(record.get("prompt", ""), add_special_tokens=False).ids)
                out[corpus.name, shard.name, index] = (
                    prompt + len(encode(record["text"], add_special_tokens=False).ids) + 2, prompt)
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("overlong", ["truncate", "keep_end", "skip"])
def test_an_epoch_holds_each_long_document_cut_to_a_row_or_not_at_all_and_counts_it(corpora, demo_tokenizer_path,
                                                                                    overlong, algorithm):
    """Each document placed is placed once: whole, or its first max_length ids, whose last one
    learns nothing (the document ends there); a long one skipped is nowhere. The ledger counts them."""
    records = _records(corpora, demo_tokenizer_path)
    long = Counter(name for (name, _, _), (ids, _) in records.items() if ids > MAX_LENGTH)
    assert set(long) == {"qa", "web"} and sum(long.values()) < len(records) / 2
    with pipeline(corpora, demo_tokenizer_path, overlong, algorithm=algorithm,
                  num_epochs=1).shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        by_record = summed_over_lanes(dataset_counts_in(
            list(loader), by=lambda address: (address.dataset, address.shard.rsplit("/", 1)[-1], address.index)))
        stats = loader.stats()
    placed = {key: counts["tokens"] for key, counts in by_record.items()}
    learned = {key: counts["learned"] for key, counts in by_record.items()}
    kept = {key: min(ids, MAX_LENGTH) for key, (ids, _) in records.items() if overlong != "skip" or ids <= MAX_LENGTH}
    assert placed == kept
    # The ids learned are those after BOS and the prompt, of the ids kept after the first kept.
    first_learned = {key: 1 + prompt for key, (_, prompt) in records.items()}
    first_kept = {key: records[key][0] - ids if overlong == "keep_end" else 0 for key, ids in kept.items()}
    assert learned == {key: max(0, first_kept[key] + ids - max(first_learned[key], first_kept[key] + 1))
                       for key, ids in kept.items()}, "every id after the prompt learned but the first kept"
    for name, count in long.items():
        total = stats["datasets"][name]["total"]
        if overlong != "skip":
            dropped = sum(ids - MAX_LENGTH for (dataset, _, _), (ids, _) in records.items()
                          if dataset == name and ids > MAX_LENGTH)
            assert (total["truncated"], total["truncated_tokens"]) == (count, dropped)
            assert not total["skipped"]
        else:
            assert total["skipped"] == {"document_too_long": count} and not total.get("truncated")
        assert total["read"] == total["emitted"] + total["filtered"] + sum(total["skipped"].values())
