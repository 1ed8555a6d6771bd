"""A corpus saved by Hugging Face `datasets` (`save_to_disk`: Arrow streams beside its JSON files)
trains as the same records in JSON Lines do: the same global-batch SHA-256s, on every runner and
world size, and after a resume on another world size, read by chunks from the middle of its
record batches; and so do the same shards with their text dictionary-encoded, one dictionary a
shard or one replaced every two batches (a stream whose dictionary changes between batches)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pyarrow as pa
import pytest

from tests.harness import checkpoint_after, step_digests, text_pipeline

HF_JARGON = Path(__file__).resolve().parents[1] / "data" / "hf_datasets" / "jargon"  # tests/data/hf_datasets/make.py
STEPS = 6


@pytest.fixture(scope="module")
def jargon_as_json_lines(tmp_path_factory, demo_data_dir) -> Path:
    """The records `make.py` saved, as the lines they were loaded from, in two shards of 100 as
    `save_to_disk(num_shards=2)` cut them: the chunks of both datasets are the same."""
    root = tmp_path_factory.mktemp("jargon-jsonl")
    with open(demo_data_dir / "jargon" / "jargon-00000-of-00003.jsonl", encoding="utf-8") as source:
        lines = list(itertools.islice(source, 200))
    for shard in range(2):
        (root / f"data-{shard:05d}-of-00002.jsonl").write_text("".join(lines[shard * 100:(shard + 1) * 100]),
                                                               encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def reference(jargon_as_json_lines, demo_data_dir, demo_tokenizer_path) -> list[str]:
    return step_digests(text_pipeline(jargon_as_json_lines, demo_data_dir / "kjv", demo_tokenizer_path,
                                      estimate_tokens=False), 1, STEPS)


@pytest.mark.parametrize("runner, world_size", [("inline", 1), ("thread", 4), ("process", 2)])
def test_arrow_shards_give_the_global_batches_their_records_give_as_json_lines(
    reference, demo_data_dir, demo_tokenizer_path, runner, world_size
):
    pipeline = text_pipeline(HF_JARGON, demo_data_dir / "kjv", demo_tokenizer_path, runner=runner, parallelism=2,
                             estimate_tokens=False)
    assert step_digests(pipeline, world_size, STEPS) == reference


def test_a_run_reading_arrow_shards_resumes_on_another_world_size(demo_data_dir, demo_tokenizer_path):
    """With the token estimate, which weighs an Arrow shard's chunks by the bytes of its file; 2 ranks, then 4."""
    def pipeline(runner: str = "inline"):
        return text_pipeline(HF_JARGON, demo_data_dir / "kjv", demo_tokenizer_path, runner=runner, parallelism=2)

    uninterrupted = step_digests(pipeline(), 2, STEPS)
    state = checkpoint_after(pipeline("process"), 2, 3)
    assert step_digests(pipeline("thread"), 4, STEPS - 3, state=state, start_step=3) == uninterrupted[3:]


@pytest.fixture(scope="module", params=[None, 2])
def jargon_dictionary_encoded(request, tmp_path_factory) -> Path:
    """`make.py`'s shards with their text column dictionary-encoded, in its batches of 16: the
    dictionary of the whole shard before the first batch (None), or one for every 2 batches, each
    replacing the one before, so that a batch may need a dictionary written before the batch
    ahead of it (a stream may hold such; a read starts at the batch its dictionary was replaced
    before)."""
    root = tmp_path_factory.mktemp("jargon-dictionary")
    for shard in sorted(HF_JARGON.glob("*.arrow")):
        with pa.ipc.open_stream(str(shard)) as reader:
            batches = list(reader)
        column = batches[0].schema.get_field_index("text")
        group = request.param or len(batches)
        texts = []
        for first in range(0, len(batches), group):  # one dictionary for the group's batches
            encoded = pa.chunked_array([b.column(column) for b in batches[first:first + group]]).combine_chunks()
            encoded, start = encoded.dictionary_encode(), 0
            for batch in batches[first:first + group]:
                texts.append(encoded.slice(start, batch.num_rows))
                start += batch.num_rows
        encoded = [batch.set_column(column, "text", text) for batch, text in zip(batches, texts)]
        with pa.ipc.new_stream(str(root / shard.name), encoded[0].schema) as writer:
            for batch in encoded:
                writer.write_batch(batch)
    return root


@pytest.mark.parametrize("runner, world_size", [("inline", 1), ("thread", 4), ("process", 2)])
def test_arrow_shards_whose_text_is_dictionary_encoded_give_the_same_global_batches(
    reference, jargon_dictionary_encoded, demo_data_dir, demo_tokenizer_path, runner, world_size
):
    pipeline = text_pipeline(jargon_dictionary_encoded, demo_data_dir / "kjv", demo_tokenizer_path, runner=runner,
                             parallelism=2, estimate_tokens=False)
    assert step_digests(pipeline, world_size, STEPS) == reference
