"""Plain text mixed with chats in one pipeline, each tokenized by the stages scoped to it
(`render_chat(datasets=...)`, `tokenize(datasets=...)`): the same global-batch SHA-256s on every
runner and world size and after a resume on another one; over an epoch every record of both is
packed, the text learned whole and the chats on their answers alone."""

from __future__ import annotations

import json

import pytest

from tests.harness import GLOBAL_BATCH, NUM_LANES, checkpoint_after, dataset_counts_in, step_digests, summed_over_lanes
from tests.unit.test_chat import CHATML, tokenizer_dir, write_chats
from zephon import ConfigurationError, Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation

STEPS = 6


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, demo_tokenizer_path):
    """(the ChatML tokenizer's directory, a dataset of 40 chats, a dataset of 40 texts)."""
    root = tmp_path_factory.mktemp("text_and_chats")
    texts = root / "web"
    texts.mkdir()
    shard = demo_tokenizer_path.parent / "jargon" / "jargon-00000-of-00003.jsonl"
    short = [text for text in (json.loads(line)["text"] for line in shard.read_text().splitlines()) if len(text) < 300]
    (texts / "web.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in short[:40]))
    return tokenizer_dir(root / "chatml", CHATML, demo_tokenizer_path), write_chats(root / "chats", 40), texts


def pipeline(corpora, *, runner: str = "inline", num_epochs: int | None = None, chats_scope="chats",
             text_scope="web") -> Pipeline:
    directory, chats, web = corpora
    source = StaticMixtureWorkSource([Dataset.from_path("chats", str(chats)), Dataset.from_path("web", str(web))],
                                     mixture={"chats": 0.5, "web": 0.5}, token_estimation=TokenEstimation(),
                                     seed=7, records_per_chunk=4, num_epochs=num_epochs)
    tokenizer = str(directory / "tokenizer.json")
    return (Pipeline(source).options(num_lanes=NUM_LANES, runner=runner, flush_every_chunks=2)
            .render_chat(directory, field="messages", parallelism=2, datasets=chats_scope)
            .tokenize(tokenizer, field="segments", segments=True, parallelism=2, datasets=chats_scope)
            .tokenize(tokenizer, field="text", eos="<|eos|>", parallelism=2, datasets=text_scope)
            .pack_flat(64, algorithm="first_fit")
            .shuffle(8, seed=7)
            .batch(2))


@pytest.fixture(scope="module")
def reference(corpora) -> list[str]:
    return step_digests(pipeline(corpora), 1, STEPS)


@pytest.mark.parametrize("runner, world_size", [("inline", 2), ("thread", 4), ("process", 2)])
def test_the_same_global_batches_on_every_runner_and_world_size(corpora, reference, runner, world_size):
    assert step_digests(pipeline(corpora, runner=runner), world_size, STEPS) == reference


def test_a_resume_on_another_world_size_gives_the_uninterrupted_batches(corpora, reference):
    state = json.loads(json.dumps(checkpoint_after(pipeline(corpora, runner="thread"), 2, 2)))
    assert step_digests(pipeline(corpora), 4, STEPS - 2, state=state, start_step=2) == reference[2:]


def test_an_epoch_packs_every_record_of_both_the_texts_whole_and_the_chats_on_their_answers(corpora):
    """Unscoped, each dataset's records would be skipped by the other's stages (`missing_field`)."""
    with pipeline(corpora, num_epochs=1).shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        counts = summed_over_lanes(dataset_counts_in(list(loader)))
        stats = loader.stats()
    positions = {name: c["tokens"] for name, c in counts.items()}
    learned = {name: c["learned"] for name, c in counts.items()}
    for name in ("chats", "web"):
        total = stats["datasets"][name]["total"]
        assert (total["read"], total["emitted"], total["skipped"]) == (40, 40, {}), name
    assert learned["web"] == positions["web"] - 40, "a text learns every id but its last"
    assert 0 < learned["chats"] < positions["chats"] / 2, "a chat learns its answers, not its questions"


def test_a_scope_enters_the_recipe_only_where_given_and_must_name_a_dataset(corpora):
    [render, chats, web] = pipeline(corpora).operators[:3]
    assert render.fingerprint()["datasets"] == chats.fingerprint()["datasets"] == ["chats"]
    assert web.fingerprint()["datasets"] == ["web"]
    [unscoped] = Pipeline(pipeline(corpora).source).tokenize(str(corpora[0] / "tokenizer.json")).operators
    assert "datasets" not in unscoped.fingerprint()
    with pytest.raises(ConfigurationError, match=r"'chat' is no dataset of the work source.*did you mean 'chats'"):
        pipeline(corpora, chats_scope="chat").shard(0, 1, global_batch_size=GLOBAL_BATCH)
    with pytest.raises(ConfigurationError, match="tokenize: datasets must be None"):
        pipeline(corpora, text_scope=3)
