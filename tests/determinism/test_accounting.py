"""Within a finite epoch every record is used exactly once or reported as skipped (SPEC §5)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.harness import GLOBAL_BATCH, MICROBATCH, NUM_LANES, checkpoint_after, dataset_counts_in, text_pipeline
from zephon import Pipeline, RecordAddress
from zephon._sequence import IGNORE_INDEX
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource


def _expected_lengths(corpus: Path, name: str, tokenizer: Tokenizer) -> dict:
    """Token count (+1 EOS) of every usable record, and the records a reader must skip."""
    lengths, skipped = {}, {}
    for shard in sorted(corpus.glob("*.jsonl")):
        for index, line in enumerate(shard.read_text(encoding="utf-8", errors="replace").splitlines()):
            address = RecordAddress(name, str(shard), index)
            try:
                text = json.loads(line).get("text")
            except ValueError:
                skipped[address] = "malformed_json"
                continue
            if text is None:
                skipped[address] = "missing_field"
            elif not text.strip():
                skipped[address] = "empty_document"
            else:
                lengths[address] = len(tokenizer.encode(text, add_special_tokens=False).ids) + 1
    return lengths, skipped


def _tokens_by_record(batches) -> Counter:
    used = Counter()
    for batch in batches:
        doc_ids = batch.tokens["document_ids"]
        for row, sources in enumerate(batch.sources):
            for piece, address in enumerate(sources):
                used[address] += int(np.count_nonzero(doc_ids[row] == piece))
    return used


def _shard_key(address: RecordAddress):
    return (address.dataset, Path(address.shard).name, address.index)


@pytest.fixture(scope="module")
def dirty_corpora(make_jsonl_corpus, tmp_path_factory):
    """A clean corpus and one with a malformed line, a record without `text` and an empty document."""
    clean = make_jsonl_corpus(2, 40, 5)
    dirty = tmp_path_factory.mktemp("dirty")
    source = make_jsonl_corpus(2, 30, 6)
    for shard in sorted(source.glob("*.jsonl")):
        lines = shard.read_text().splitlines()
        lines[3] = '{"text": "unterminated'
        lines[7] = json.dumps({"title": "no text field"})
        lines[11] = json.dumps({"text": "   "})
        (dirty / shard.name).write_text("\n".join(lines) + "\n")
    return clean, dirty


def _epoch(pipeline, world_size, state=None):
    """Every rank's batches of the rest of the epoch, and the ledger totals summed over ranks."""
    batches, totals = [], {}
    for rank in range(world_size):
        with pipeline.shard(rank, world_size, global_batch_size=GLOBAL_BATCH) as loader:
            if state is not None:
                loader.load_state_dict(state)
            batches.extend(loader)
            _add_totals(totals, loader.stats())
    return batches, totals


def _add_totals(totals: dict, stats: dict) -> dict:
    """Add a loader's ledger totals per dataset to `totals` ({dataset: Counter}, skips as `skipped:<reason>`)."""
    for name, entry in stats["datasets"].items():
        total = totals.setdefault(name, Counter())
        for key, value in entry["total"].items():
            if key == "skipped":
                total.update({f"skipped:{k}": v for k, v in value.items()})
            else:
                total[key] += value
    return totals


@pytest.mark.parametrize("algorithm", ["wrap", "first_fit"])
@pytest.mark.parametrize("runner", ["inline", "process"])
def test_every_record_is_used_exactly_once_or_counted_as_skipped(dirty_corpora, demo_tokenizer_path, algorithm, runner):
    clean, dirty = dirty_corpora
    tokenizer = Tokenizer.from_file(str(demo_tokenizer_path))
    expected_a, skipped_a = _expected_lengths(clean, "a", tokenizer)
    expected_b, skipped_b = _expected_lengths(dirty, "b", tokenizer)
    pipeline = text_pipeline(clean, dirty, demo_tokenizer_path, num_epochs=1, algorithm=algorithm, runner=runner)
    with pipeline.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        batches = list(loader)
        stats = loader.stats()
    used = _tokens_by_record(batches)
    expected = {**expected_a, **expected_b}
    assert {_shard_key(a): n for a, n in used.items()} == {_shard_key(a): n for a, n in expected.items()}
    assert stats["datasets"]["b"]["total"]["skipped"] == Counter(skipped_b.values())
    assert stats["datasets"]["a"]["total"]["read"] == 80 and stats["datasets"]["b"]["total"]["read"] == 60
    assert not skipped_a


def test_a_resumed_finite_epoch_still_uses_every_record_exactly_once(dirty_corpora, demo_tokenizer_path):
    clean, dirty = dirty_corpora
    make = lambda: text_pipeline(clean, dirty, demo_tokenizer_path, num_epochs=1, runner="thread", parallelism=2)
    whole, whole_totals = _epoch(make(), 1)
    per_step = Counter(b.step for b in whole)
    full = [step for step, n in per_step.items() if n == per_step[0]]
    stop = max(full)  # near the end: the last step in which every lane still has data
    assert stop >= 3 and len(per_step) > stop + 1, "the epoch should end raggedly after the checkpoint"
    state = checkpoint_after(make(), 2, stop)
    before = [b for b in whole if b.step < stop]
    after, resumed_totals = _epoch(make(), 4, state)
    assert sorted(b.digest() for b in before + after) == sorted(b.digest() for b in whole)
    assert _tokens_by_record(before + after) == _tokens_by_record(whole)
    assert resumed_totals == whole_totals, "the ledger must carry across the resume, counting nothing twice"
    assert whole_totals["b"]["read"] == whole_totals["b"]["emitted"] + sum(
        v for k, v in whole_totals["b"].items() if k.startswith("skipped:")
    ) + whole_totals["b"]["filtered"]


def test_fail_fast_names_the_bad_record(dirty_corpora, demo_tokenizer_path):
    from zephon import BadRecordError

    clean, dirty = dirty_corpora
    pipeline = text_pipeline(clean, dirty, demo_tokenizer_path, num_epochs=1).options(on_error="raise")
    with pytest.raises(BadRecordError) as info:
        with pipeline.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
            list(loader)
    assert "b:" in str(info.value) and "part-0000" in str(info.value)


def test_a_new_iteration_of_the_same_loader_counts_nothing_twice(dirty_corpora, demo_tokenizer_path):
    """A new `iter(loader)` carries on from the cursors by replaying the lanes from their last
    flush; the records it reads again were counted already and must not be counted twice."""
    clean, dirty = dirty_corpora
    make = lambda: text_pipeline(clean, dirty, demo_tokenizer_path, num_epochs=1)
    whole, whole_totals = _epoch(make(), 1)
    with make().shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        first = iter(loader)
        parts = [next(first) for _ in range(len(whole) // 3)]
        parts += list(iter(loader))  # takes over from `first`
        stats = loader.stats()
    assert [b.digest() for b in parts] == [b.digest() for b in whole]
    assert _add_totals({}, stats) == whole_totals


def _rows_handed(batches) -> dict[int, dict]:
    """Per lane: rows, real tokens, padding tokens and learned tokens (labels a loss counts) in the
    microbatches themselves, and the tokens, images and learned tokens of each dataset in them."""
    counts: dict[int, Counter] = {}
    for batch in batches:
        rows, length = batch.tokens["input_ids"].shape
        real = batch.num_real_tokens
        learned = int(np.count_nonzero(batch.tokens["labels"] != IGNORE_INDEX))
        counts.setdefault(batch.lane, Counter()).update(
            rows=rows, tokens=real, padding=rows * length - real, learned=learned
        )
    datasets = dataset_counts_in(batches)
    return {lane: {**c, "datasets": datasets[lane]} for lane, c in sorted(counts.items())}


def test_the_ledgers_row_counts_are_what_the_trainer_was_handed_across_a_resume(dirty_corpora, demo_tokenizer_path):
    """stats()["lanes"] counts every row handed over, the padding rows of a lane whose finite plan
    ended inside a microbatch included, with each dataset's tokens in them, and a resume on another
    world size carries them on."""
    clean, dirty = dirty_corpora
    make = lambda: text_pipeline(clean, dirty, demo_tokenizer_path, num_epochs=1)
    with make().shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        whole = list(loader)
        counted = loader.stats()["lanes"]
    assert any(not sources for batch in whole for sources in batch.sources), "no padding row in the epoch"
    assert counted == _rows_handed(whole)
    state = checkpoint_after(make(), 2, 3)
    resumed = {}
    for rank in range(4):
        with make().shard(rank, 4, global_batch_size=GLOBAL_BATCH) as loader:
            loader.load_state_dict(state)
            list(loader)
            resumed.update(loader.stats()["lanes"])
    assert resumed == counted


def test_record_counts_are_taken_when_a_lane_takes_a_chunk_not_while_it_waits_in_the_prefetch_window(demo_data_dir,
                                                                                                  demo_tokenizer_path):
    """What `stats()` says: counts run ahead of the trainer by what a lane holds (its packer's
    open rows, its shuffle buffer), not by the prefetch window, whose chunks the inline runner
    has already read."""
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    per_chunk, prefetch = 4, 32
    source = StaticMixtureWorkSource([Dataset.from_path("jargon", str(demo_data_dir / "jargon"))], seed=0,
                                     records_per_chunk=per_chunk)
    pipeline = (Pipeline(source).options(num_lanes=1, runner="inline", prefetch=prefetch, flush_every_chunks=64)
                .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text")
                .pack_flat(max_length=256).shuffle(buffer_size=4, seed=0).batch(microbatch_size=2))
    handed, ahead = set(), []
    with pipeline.shard(0, 1) as loader:
        batches = iter(loader)
        for _ in range(3):
            handed.update(address for row in next(batches).sources for address in row)
            read = loader.stats()["datasets"]["jargon"]["lanes"][0]["read"]
            assert loader._streams[0]._in_flight == prefetch, "the window is full: its chunks were read"
            assert read % per_chunk == 0 and len(handed) <= read < prefetch * per_chunk
            ahead.append(read - len(handed))
    assert max(ahead) > 0, "the shuffle buffer's and the open row's records are counted before they are handed over"


ID_RANGES = {"a": range(1000, 2000), "b": range(5000, 6000)}
"""The token ids of each dataset of `id_corpora`: a batch's ids say which dataset each token is
from, whatever its `sources` and `document_ids` say (padding is id 0)."""

ID_DOCUMENTS = {"a": 60, "b": 40}
"""The documents `id_corpora` writes of each dataset, in two shards."""


@pytest.fixture(scope="module")
def id_corpora(tmp_path_factory):
    """Two datasets of token ids from the data, documents of 1 to 90 ids: many longer than a
    32-token row, so cut across rows."""
    root = tmp_path_factory.mktemp("ids")
    rng = np.random.default_rng(0)
    written = Counter()
    for name, ids in ID_RANGES.items():
        (root / name).mkdir()
        for shard in range(2):
            lines = []
            for _ in range(ID_DOCUMENTS[name] // 2):
                doc = rng.integers(ids.start, ids.stop, size=int(rng.integers(1, 91))).tolist()
                written[name] += len(doc)
                lines.append(json.dumps({"ids": doc}))
            (root / name / f"part-{shard}.jsonl").write_text("\n".join(lines) + "\n")
    return root, written


def _ids_pipeline(root: Path, algorithm: str = "wrap") -> Pipeline:
    source = StaticMixtureWorkSource(
        [Dataset.from_path(name, str(root / name)) for name in ID_RANGES],
        mixture={"a": 0.7, "b": 0.3}, seed=5, records_per_chunk=4, num_epochs=1,
    )
    return (
        Pipeline(source).options(num_lanes=NUM_LANES, runner="inline", flush_every_chunks=2)
        .pack_flat(max_length=32, algorithm=algorithm, field="ids")
        .shuffle(buffer_size=4, seed=1)
        .batch(microbatch_size=MICROBATCH)
    )


def _tokens_by_id_range(batches) -> dict[str, int]:
    return {name: sum(int(np.isin(b.tokens["input_ids"], ids).sum()) for b in batches) for name, ids in ID_RANGES.items()}


def _mixture_of_ranks(world_size: int, root: Path, state=None) -> tuple[dict, dict]:
    """The lanes' row counts of every rank, and the per-dataset totals summed over the ranks."""
    lanes, mixture = {}, {name: Counter() for name in ID_RANGES}
    for rank in range(world_size):
        with _ids_pipeline(root).shard(rank, world_size, global_batch_size=GLOBAL_BATCH) as loader:
            if state is not None:
                loader.load_state_dict(state)
            list(loader)
            stats = loader.stats()
        lanes.update(stats["lanes"])
        for name, counts in stats["mixture"].items():
            mixture[name].update(counts)
    return lanes, {name: dict(counts) for name, counts in mixture.items()}


@pytest.mark.parametrize("algorithm", ["wrap", "first_fit"])
def test_the_realised_mixture_is_each_dataset_s_tokens_in_the_rows_handed_over(id_corpora, algorithm):
    """stats()["mixture"] and each lane's "datasets" count the tokens of each dataset in the rows
    the trainer was handed (a document cut across rows in each row's share, padding in none), and
    add up to the lane's `tokens`; told apart here by the ids themselves. Every document is
    learned whole but for its last token, which has no next token to learn."""
    root, written = id_corpora
    with _ids_pipeline(root, algorithm).shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        batches = list(loader)
        stats = loader.stats()
    assert any(len(sources) > 1 for b in batches for sources in b.sources), "no row holds two documents"
    assert {name: stats["datasets"][name]["total"]["emitted"] for name in ID_DOCUMENTS} == ID_DOCUMENTS
    in_batches = _tokens_by_id_range(batches)
    assert in_batches == written, "every id of the epoch is in a batch once (the check below reads them all)"
    assert stats["mixture"] == {
        name: {"tokens": n, "images": 0, "learned": n - ID_DOCUMENTS[name]} for name, n in in_batches.items()
    }
    for lane, counts in stats["lanes"].items():
        assert sum(d["tokens"] for d in counts["datasets"].values()) == counts["tokens"] > 0, lane
        assert sum(d["learned"] for d in counts["datasets"].values()) == counts["learned"] > 0, lane
        assert counts["padding"] > 0, "padding counts for no dataset"
    assert {lane: counts["datasets"] for lane, counts in stats["lanes"].items()} == dataset_counts_in(batches)


@pytest.mark.parametrize("world_size", [1, 4])
def test_the_realised_mixture_carries_across_a_resume_on_another_rank_count(id_corpora, world_size):
    """Saved on 2 ranks after two steps and resumed on 1 or 4, the per-dataset counts at the end
    of the epoch are the uninterrupted run's: the rows replayed to rebuild the lanes are not
    counted again, and those handed over before the save are not lost."""
    root, written = id_corpora
    whole_lanes, whole_mixture = _mixture_of_ranks(1, root)
    assert whole_mixture == {
        name: {"tokens": n, "images": 0, "learned": n - ID_DOCUMENTS[name]} for name, n in written.items()
    }
    state = checkpoint_after(_ids_pipeline(root), 2, 2)
    assert any(counts["rows"]["rows"] for counts in state["ledger"].values()), "the state carries rows handed over"
    lanes, mixture = _mixture_of_ranks(world_size, root, state)
    assert mixture == whole_mixture
    assert lanes == whole_lanes
