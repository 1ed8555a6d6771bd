"""Checkpoint safety (SPEC §3.3): a damaged checkpoint fails with a clear CheckpointError, one from
another recipe is refused naming what changed, performance settings may change, and a checkpoint is
JSON that loading can never turn into code.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib.util
import itertools
import json
import os
import pickle
import random
import re
import subprocess
import sys
import threading
import typing
from pathlib import Path
from re import sub as substitute

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.reliability.harness import (
    REPO_ROOT,
    TOKENIZER,
    checkpoint_after,
    global_batch,
    jsonl_dataset,
    run_epoch,
    text_pipeline,
)
from zephon import CheckpointError, RecipeMismatchError
from zephon.io import Dataset

MICROBATCHES = 3  # per rank, on 2 ranks of 2 lanes: a checkpoint in the middle of step 1


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint")
    return jsonl_dataset(root / "a", name="a"), jsonl_dataset(root / "b", name="b")


def recipe(corpora, **changes):
    settings = {"mixture": {"a": 0.5, "b": 0.5}, **changes}
    return text_pipeline(list(corpora), **settings)


@pytest.fixture(scope="module")
def state(corpora):
    return checkpoint_after(recipe(corpora), 2, MICROBATCHES)


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _tampered(state: dict) -> dict:
    changed = json.loads(json.dumps(state))
    changed["lanes"]["1"][1] += 1  # one more row "consumed" on lane 1, checksum left as it was
    return changed


def _resealed(state: dict, **body) -> dict:
    """A state edited *and* given a matching checksum: what a careful forger would write."""
    from zephon._checkpoint import _checksum

    changed = {k: v for k, v in json.loads(json.dumps(state)).items() if k != "checksum"}
    changed.update(body)
    return {**changed, "checksum": _checksum(changed)}


def _resealed_without(state: dict, key: str) -> dict:
    """A state with `key` left out and a matching checksum."""
    return _resealed({k: v for k, v in state.items() if k != key})


def _tampered_ledger(state: dict) -> dict:
    changed = json.loads(json.dumps(state))
    changed["ledger"]["0"]["rows"]["rows"] += 1  # counts edited, checksum left as it was
    return changed


def _renamed(by_lane: dict, old: str, new: str) -> dict:
    """The same lanes with one key spelled differently (the entry moves, its value stays)."""
    return {new if key == old else key: value for key, value in by_lane.items()}


def _with_records(state: dict, records: dict) -> dict:
    """The state's ledger with lane 0's settled record counts replaced by `records`."""
    return {**state["ledger"], "0": {**state["ledger"]["0"], "records": records}}


DAMAGED = {
    "garbage_bytes": (lambda s, tmp: random.Random(0).randbytes(64) + b"\x00\xff", "not valid JSON"),
    "truncated_json": (lambda s, tmp: json.dumps(s)[: len(json.dumps(s)) * 2 // 3], "not valid JSON"),
    "empty_file": (lambda s, tmp: b"", "not valid JSON"),
    "json_nested_past_the_parsers_depth": (lambda s, tmp: "[" * 100_000 + "]" * 100_000, "not valid JSON"),
    "json_but_not_a_state": (lambda s, tmp: {"step": 10, "lanes": {}}, "not a Zephon loader state"),
    "json_list": (lambda s, tmp: "[1, 2, 3]", "not a Zephon loader state"),
    # Two mistakes of a first integration: the state's file name for the state, and the TorchTitan
    # adapter's state dict for a RankLoader's (both were called invalid JSON or no state, unsaid why).
    "a_file_name": (lambda s, tmp: str(tmp / "step-10" / "loader.json"), "not a file's name: load the file"),
    "torchtitan_adapters_state_dict": (lambda s, tmp: {"zephon_state": json.dumps(s)},
                                       "a ZephonDataLoader's state_dict() (TorchTitan's): the loader state is its 'zephon_state'"),
    "tampered_cursor": (lambda s, tmp: _tampered(s), "checksum does not match"),
    "tampered_ledger": (lambda s, tmp: _tampered_ledger(s), "checksum does not match"),
    "checksum_removed": (lambda s, tmp: {k: v for k, v in s.items() if k != "checksum"}, "checksum does not match"),
    "unknown_version": (lambda s, tmp: {**s, "version": 99}, "version 99 is not supported"),
    "malformed_cursor_resealed": (lambda s, tmp: _resealed(s, lanes={"0": ["x", 1, 2]}), "malformed lane cursors"),
    "negative_cursor_resealed": (lambda s, tmp: _resealed(s, lanes={**s["lanes"], "0": [0, -4, 0]}), "malformed lane cursors"),
    "missing_lanes_resealed": (lambda s, tmp: _resealed(s, lanes=None), "malformed lane cursors"),
    "recipe_not_an_object_resealed": (lambda s, tmp: _resealed(s, recipe="x"), "'recipe' must be an object"),
    "dataset_summaries_missing_resealed": (
        lambda s, tmp: _resealed_without(s, "datasets"), "'datasets' must be null or a list of dataset summaries"
    ),
    "dataset_summary_malformed_resealed": (
        lambda s, tmp: _resealed(s, datasets=[{**s["datasets"][0], "num_shards": -1}]),
        "'datasets' must be null or a list of dataset summaries",
    ),
    "malformed_ledger_resealed": (lambda s, tmp: _resealed(s, ledger={"0": {"records": 5}}), "malformed ledger"),
    "lane_key_not_a_number_resealed": (
        lambda s, tmp: _resealed(s, lanes={**s["lanes"], "x": [0, 0, 0]}),
        "malformed lane cursors in loader state: lane key 'x'",
    ),
    "lane_key_out_of_range_resealed": (
        lambda s, tmp: _resealed(s, lanes={**s["lanes"], "99": [0, 0, 0]}),
        "malformed lane cursors in loader state: lane key '99'",
    ),
    "lane_key_with_leading_zero_resealed": (
        lambda s, tmp: _resealed(s, lanes=_renamed(s["lanes"], "1", "01")),
        "malformed lane cursors in loader state: lane key '01'",
    ),
    "ledger_key_not_a_number_resealed": (
        lambda s, tmp: _resealed(s, ledger=_renamed(s["ledger"], "0", "x")),
        "malformed ledger in loader state: lane key 'x'",
    ),
    "ledger_key_out_of_range_resealed": (
        lambda s, tmp: _resealed(s, ledger={**s["ledger"], "99": s["ledger"]["0"]}),
        "malformed ledger in loader state: lane key '99'",
    ),
    "ledger_nested_record_counts_resealed": (
        lambda s, tmp: _resealed(s, ledger=_with_records(s, {"a": {"read": 2, "skipped": {"malformed_json": 1}}})),
        "malformed ledger in loader state: each lane needs {'records': {dataset: {name: count}}",
    ),
    "ledger_without_row_counts_resealed": (
        lambda s, tmp: _resealed(s, ledger={**s["ledger"], "0": {"records": {}}}),
        "malformed ledger in loader state",
    ),
    "ledger_missing_resealed": (lambda s, tmp: _resealed_without(s, "ledger"), "the 'ledger' key is missing"),
    "ledger_without_a_lane_resealed": (
        lambda s, tmp: _resealed(s, ledger={k: v for k, v in s["ledger"].items() if k != "1"}),
        "malformed ledger in loader state: its lanes [0, 2, 3] are not those of the lane cursors [0, 1, 2, 3]",
    ),
    "numpy_integers": (lambda s, tmp: {**s, "lanes": {k: list(np.array(v)) for k, v in s["lanes"].items()}},
                       "not plain JSON data"),
    "pickle_blob": (lambda s, tmp: pickle.dumps(_RunsCodeWhenUnpickled(tmp / "pwned")), "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(k for k in DAMAGED if k.endswith("_resealed")))
def test_merging_a_resealed_malformed_state_fails_with_a_clear_message(state, tmp_path, case):
    """merge_states (what gather_state runs) checks each state's shape too, not only load_state_dict."""
    from zephon import merge_states

    make, message = DAMAGED[case]
    with pytest.raises(CheckpointError, match=re.escape(message)):
        merge_states([make(state, tmp_path)])


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_checkpoint_fails_with_a_clear_message_and_changes_nothing(corpora, state, tmp_path, case):
    make, message = DAMAGED[case]
    damaged = make(state, tmp_path)
    pipeline = recipe(corpora)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(CheckpointError, match=re.escape(message)) as info:
            loader.load_state_dict(damaged)
        assert not isinstance(info.value, RecipeMismatchError)
        first = next(iter(loader)).digest()
    assert not (tmp_path / "pwned").exists(), "loading a pickle must not run its code"
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as fresh:
        assert first == next(iter(fresh)).digest(), "a refused checkpoint leaves the loader where it was"


def refused(pipeline, state) -> RecipeMismatchError:
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader, pytest.raises(
        RecipeMismatchError
    ) as info:
        loader.load_state_dict(state)
    return info.value


def _other_tokenizer(tmp_path: Path) -> Path:
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    tokenizer.add_special_tokens(["<|image|>"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


# change -> the names the refusal must give (one regular expression per name)
RECIPE_CHANGES = {
    "seed": (lambda tmp: {"seed": 8}, [r"plan\.seed", r"operators\[2\]\.shuffle\.seed"]),
    "mixture": (lambda tmp: {"mixture": {"a": 0.6, "b": 0.4}}, [r"plan\.(mixture|schedule)"]),
    "max_length": (lambda tmp: {"max_length": 96}, [r"operators\[1\]\.pack_flat\.max_length"]),
    "packing": (lambda tmp: {"algorithm": "first_fit"},  # first_fit's rows also depend on max_open_rows
                [r"operators\[1\]\.pack_flat\.algorithm", r"operators\[1\]\.pack_flat\.max_open_rows"]),
    "shuffle_buffer": (lambda tmp: {"shuffle_buffer": 16}, [r"operators\[2\]\.shuffle\.buffer_size"]),
    "tokenizer": (lambda tmp: {"tokenizer": _other_tokenizer(tmp)}, [r"operators\[0\]\.tokenize\.tokenizer"]),
    "text_field": (lambda tmp: {"field": "body"}, [r"operators\[0\]\.tokenize\.field"]),
    "epochs": (lambda tmp: {"num_epochs": 2}, [r"plan\.num_epochs"]),
    # Both cut the lanes' work differently (segments, chunks): other batches from the same cursors.
    "flush_every_chunks": (lambda tmp: {"flush_every_chunks": 3}, [r"flush_every_chunks"]),
    "records_per_chunk": (lambda tmp: {"records_per_chunk": 8}, [r"plan\.records_per_chunk"]),
    # The special tokens around each document and the pad id are in every row's ids.
    "bos": (lambda tmp: {"bos": "<|bos|>"}, [r"operators\[0\]\.tokenize\.bos"]),
    "eos": (lambda tmp: {"eos": None}, [r"operators\[0\]\.tokenize\.eos"]),
    "pad_id": (lambda tmp: {"pad_id": 0}, [r"operators\[1\]\.pack_flat\.pad_id"]),
    # Measured tokens per byte weigh the chunks instead of their records: another plan.
    "token_estimation": (lambda tmp: {"estimate_tokens": True}, [r"plan\.tokens_per_byte"]),
    "round_size": (lambda tmp: {"round_size": 8}, [r"plan\.round_size"]),
}


@pytest.mark.parametrize("case", sorted(RECIPE_CHANGES))
def test_checkpoint_of_another_recipe_is_refused_naming_what_changed(corpora, state, tmp_path, case):
    make, expected = RECIPE_CHANGES[case]
    refusal = refused(recipe(corpora, **make(tmp_path)), state)
    named = re.search(r"changed: (.*?)\. Performance", str(refusal)).group(1).split(", ")
    assert len(named) == len(expected), named
    assert all(any(re.fullmatch(pattern, name) for name in named) for pattern in expected), named
    assert "may change on resume" in str(refusal)


@pytest.mark.parametrize(
    ("case", "argument"),
    [("mixture", "mixture="), ("token_estimation", "TokenEstimation")],
)
def test_a_refusal_says_which_pipeline_argument_a_plan_key_stands_for(corpora, state, tmp_path, case, argument):
    """A plain Pipeline user changed the work source's `mixture=` and was told `changed:
    plan.schedule` alone, a name they never wrote; the key stays (it is the error's `changed`) and
    the refusal says what it stands for."""
    make, _ = RECIPE_CHANGES[case]
    refusal = str(refused(recipe(corpora, **make(tmp_path)), state))
    key = "plan.schedule" if case == "mixture" else "plan.tokens_per_byte"
    assert re.search(rf"{re.escape(key)} is [^.;]*{re.escape(argument)}", refusal), refusal


def test_checkpoint_taken_with_another_global_batch_size_is_refused_naming_it(corpora, state):
    """The global batch size is part of the recipe (SPEC §1): a lane's cursor counts rows, and
    which rows make up a step follows from it."""
    pipeline = recipe(corpora)
    with pipeline.shard(0, 1, global_batch_size=2 * global_batch(pipeline)) as loader, pytest.raises(
        RecipeMismatchError, match=r"changed: global_batch_size\. Performance"
    ):
        loader.load_state_dict(state)


def test_checkpoint_taken_with_another_microbatch_size_is_refused_naming_it(corpora, state):
    """The microbatch size is part of the recipe (README, "What may change on resume") even where
    the global batch size stays: it decides how a step's rows are cut into the microbatches that
    are hashed and handed over, and where a lane's cursor stands within a step."""
    pipeline = recipe(corpora, microbatch_size=1)
    with pipeline.shard(0, 1, global_batch_size=global_batch(recipe(corpora))) as loader, pytest.raises(
        RecipeMismatchError, match=r"changed: operators\[3\]\.batch\.microbatch_size\. Performance"
    ):
        loader.load_state_dict(state)


def _short_text(record: dict) -> bool:
    """A filter after tokenize that reads the text tokenize leaves only under keep_field=True."""
    return len(record.get("text", "").split()) <= 30


def _kept_text_recipe(corpora, keep_field: bool):
    from zephon import Pipeline
    from zephon.work import StaticMixtureWorkSource

    source = StaticMixtureWorkSource(list(corpora), seed=7, records_per_chunk=4, num_epochs=1)
    return (
        Pipeline(source).options(num_lanes=4, runner="inline", flush_every_chunks=2)
        .tokenize(str(TOKENIZER), eos="<|eos|>", keep_field=keep_field)
        .filter(_short_text)
        .pack_flat(max_length=64)
        .batch(microbatch_size=2)
    )


def test_checkpoint_taken_with_another_keep_field_is_refused_where_it_changes_the_batches(corpora):
    """`tokenize(keep_field=True)` leaves the text for the stages after it, which may read it (that
    is what it is for): there the setting decides which records survive, so a checkpoint taken with
    the other value must be refused, naming it, like any other recipe change. A recipe that leaves
    keep_field at its default keeps the digests it had, so its checkpoints still resume."""
    kept, dropped = _kept_text_recipe(corpora, True), _kept_text_recipe(corpora, False)
    assert run_epoch(kept).digests != run_epoch(dropped).digests
    for saved_with, resumed_with in ((kept, dropped), (dropped, kept)):
        saved = checkpoint_after(saved_with, 1, 2)
        with resumed_with.shard(0, 1, global_batch_size=8) as loader, pytest.raises(
            RecipeMismatchError, match=r"changed: operators\[0\]\.tokenize\.keep_field\. Performance"
        ):
            loader.load_state_dict(saved)
    with dropped.shard(0, 1, global_batch_size=8) as loader:
        assert "keep_field" not in json.dumps(loader.recipe), "the default adds nothing to the recipe"


def test_checkpoint_of_changed_data_is_refused_naming_the_datasets(tmp_path):
    """Shards are fingerprinted by URL, record count and size: a shard rewritten in place with
    other content of another size is another recipe. The refusal names the dataset and tells the
    shard list changed though its count did not, with the bytes before and now."""
    dataset = jsonl_dataset(tmp_path / "a", name="a")
    saved = checkpoint_after(text_pipeline(dataset), 1, 2)
    edited = jsonl_dataset(tmp_path / "a", {(0, 0): b'{"text": "one record edited"}'}, name="a")
    before, now = (sum(shard.nbytes for shard in ds.shards) for ds in (dataset, edited))
    assert before != now
    assert re.search(
        r"changed: plan\.datasets\. In plan\.datasets: dataset 0 \('a'\): shard list changed \(same count; "
        + re.escape(f"{before:,} bytes in the checkpoint, {now:,} now). Performance"),
        str(refused(text_pipeline(edited), saved)),
    )


def _with_shards(root: Path, name: str, count: int):
    """Dataset `name` listed again after its directory `root` was given `count` shards: the
    harness's files, the last ones removed or copies of the first written beside them."""
    files = sorted(root.glob("part-*.jsonl"))
    for extra in range(len(files), count):
        (root / f"part-{extra:05d}.jsonl").write_bytes(files[0].read_bytes())
    for surplus in files[count:]:
        surplus.unlink()
    return Dataset.from_path(name, str(root))


def _mixture_recipe(datasets: list):
    return text_pipeline(datasets, mixture={ds.name: 1.0 / len(datasets) for ds in datasets})


@pytest.mark.parametrize("shards_now", [1, 3])
def test_checkpoint_of_a_mixture_whose_dataset_gained_or_lost_a_shard_is_refused_naming_it_and_its_counts(
    tmp_path, shards_now
):
    """A mixture's one digest of its dataset list said only `plan.datasets`: which dataset, and
    how, was the user's guess. The refusal names the dataset by index and name, with its shard
    count in the checkpoint and now; the datasets that did not change go unnamed."""
    a, b, c = (jsonl_dataset(tmp_path / name, name=name) for name in "abc")
    saved = checkpoint_after(_mixture_recipe([a, b, c]), 1, 2)
    message = str(refused(_mixture_recipe([a, _with_shards(tmp_path / "b", "b", shards_now), c]), saved))
    assert re.search(
        r"changed: plan\.datasets\. In plan\.datasets: "
        + re.escape(f"dataset 1 ('b'): 2 shards in the checkpoint, {shards_now} now. Performance"),
        message,
    ), message


def test_checkpoint_of_a_mixture_with_a_dataset_added_and_one_removed_is_refused_naming_both(tmp_path):
    """Datasets are paired by name: one added and one removed are named as such, and a dataset
    that moved up an index because of them is not called changed."""
    a, b, c, d = (jsonl_dataset(tmp_path / name, name=name) for name in "abcd")
    saved = checkpoint_after(_mixture_recipe([a, b, c]), 1, 2)
    message = str(refused(_mixture_recipe([a, c, d]), saved))
    assert re.search(
        r"In plan\.datasets: "
        + re.escape("dataset 2 ('d'): not in the checkpoint; dataset 1 ('b') of the checkpoint: not in the recipe now. Perf"),
        message,
    ), message


def _written_before_dataset_summaries(state: dict) -> dict:
    """`state` as the Zephon before dataset summaries wrote it: version 5, no 'datasets', signed."""
    from zephon._checkpoint import _checksum

    old = {k: v for k, v in json.loads(json.dumps(state)).items() if k not in ("datasets", "checksum")}
    old["version"] = 5
    return {**old, "checksum": _checksum(old)}


def test_a_checkpoint_written_before_dataset_summaries_resumes_and_is_refused_as_before(tmp_path):
    """A version-5 state holds one digest of the whole dataset list, the same digest this Zephon
    takes: against the recipe it was saved with it resumes to the same batches as the state of
    today, and against changed data it is refused with the message of its day, naming only
    `plan.datasets` (it has no summaries to say more)."""
    from zephon._checkpoint import canonical_json
    from zephon._sha256 import sha256

    a, b = (jsonl_dataset(tmp_path / name, name=name) for name in "ab")
    pipeline = _mixture_recipe([a, b])
    state = checkpoint_after(pipeline, 1, 2)
    old = _written_before_dataset_summaries(state)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        whole_list = loader.recipe["plan"]["datasets"]
    assert old["recipe"]["plan.datasets"] == sha256(canonical_json(whole_list).encode()).hexdigest()[:16]

    assert run_epoch(pipeline, 1, state=old).digests == run_epoch(pipeline, 1, state=state).digests

    changed = _mixture_recipe([a, _with_shards(tmp_path / "b", "b", 3)])
    assert str(refused(changed, old)) == (
        "the checkpoint was taken with a different recipe; changed: plan.datasets. Performance settings "
        "(runner, parallelism, world size) may change on resume; the recipe may not."
    )


def test_checkpoint_with_another_lane_count_is_refused(corpora, state):
    assert "num_lanes" in str(refused(recipe(corpora, num_lanes=8), state))


def test_one_ranks_state_is_refused_where_it_lacks_the_lanes_naming_them(corpora):
    """A rank's own state_dict saved without merging (what merge_states and gather_state exist
    for) covers only its lanes: a rank it does not cover must refuse it by name, not start those
    lanes from nothing nor fail with a bare KeyError. The rank it covers takes it up."""
    pipeline = recipe(corpora)
    with pipeline.shard(0, 2, global_batch_size=global_batch(pipeline)) as loader:
        next(iter(loader))
        own = loader.state_dict()
    assert sorted(own["lanes"]) == ["0", "1"]
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader, pytest.raises(
        CheckpointError, match=re.escape("does not cover lanes [2, 3] of rank 0; merge every rank's state")
    ):
        loader.load_state_dict(own)
    with pipeline.shard(1, 2, global_batch_size=global_batch(pipeline)) as loader, pytest.raises(
        CheckpointError, match=re.escape("does not cover lanes [2, 3] of rank 1")
    ):
        loader.load_state_dict(own)
    with pipeline.shard(0, 2, global_batch_size=global_batch(pipeline)) as loader:
        loader.load_state_dict(own)
        assert loader.state_dict()["lanes"] == own["lanes"]


def test_performance_settings_may_change_on_resume(corpora, state):
    """Saved on 2 ranks with the inline runner, partway through step 1; resumed on 2 ranks of worker
    processes with parallelism 2, and on 1 rank of threads: the rest of the epoch is the
    uninterrupted one. (On 4 ranks the step's rest would fall unevenly to the ranks: refused, see
    test_elastic_resume.py.)"""
    reference = run_epoch(recipe(corpora), keep_batches=False).digests
    # (step, lane, index) taken before the checkpoint: rank 0 owns lanes 0-1, rank 1 lanes 2-3
    consumed = {(0, lane, 0) for lane in range(4)} | {(1, 0, 0), (1, 2, 0)}
    expected = {key: d for key, d in reference.items() if key not in consumed}
    on_processes = run_epoch(recipe(corpora, runner="process", parallelism=2), 2, state=state, keep_batches=False)
    on_threads = run_epoch(recipe(corpora, runner="thread", parallelism=2), 1, state=state, keep_batches=False)
    assert on_processes.digests == expected
    assert on_threads.digests == expected


def test_checkpoint_is_plain_json(state, corpora):
    def plain(value) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (str, int, float, bool))

    assert plain(state)
    text = json.dumps(state)
    assert json.loads(text) == state
    pipeline = recipe(corpora)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader.load_state_dict(text)  # a JSON string is accepted as it is
        loader.load_state_dict(text.encode())
    assert len(text) < 8 * 1024, "a checkpoint holds cursors, never payloads"


def test_a_state_edited_by_its_caller_leaves_the_loaders_next_states_as_they_were(tmp_path):
    """A state's dataset summaries were the loader's own list: a trainer editing the state it was
    handed (dropping or rewriting a field in place) edited every state the loader saved after it,
    sealed with a checksum of the edit, and the summaries a refusal is worded from."""
    pipeline = _mixture_recipe([jsonl_dataset(tmp_path / name, name=name) for name in "ab"])
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        first = loader.state_dict()
        untouched = json.loads(json.dumps(first))
        first["datasets"][0]["num_shards"] = 99
        first["datasets"][1]["settings"].clear()
        first["datasets"].append(None)
        assert loader.state_dict() == untouched


@pytest.mark.parametrize("module", ["_checkpoint.py", "_dataset_changes.py", "_recipe_keys.py", "_accepted_changes.py"])
def test_checkpoint_module_cannot_deserialise_code(module):
    """The state module, and those that read a state's dataset summaries or its changed keys to word
    a refusal or accept it, use json only: no pickle, marshal, shelve, eval or exec anywhere in them."""
    source = (REPO_ROOT / "zephon" / module).read_text()
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    allowed = {
        "__future__", "json", "dataclasses", "typing", "difflib",  # difflib: a misnamed key's close match
        "._errors", "._sha256", "._dataset_changes", "._recipe_keys", "._accepted_changes",
    }
    assert imported <= allowed, imported
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}, called


def _longer_than(limit: int, record: dict) -> bool:
    return len(record["text"]) > limit


@dataclasses.dataclass(frozen=True)
class _Suffix:
    """A configured callable object, as users pass transforms."""

    suffix: str

    def __call__(self, record: dict) -> dict:
        return {**record, "text": record["text"] + self.suffix}


def _configured_pipeline(root: Path, suffix: str = "!", limit: int = 3):
    return text_pipeline(jsonl_dataset(root), map_fn=_Suffix(suffix), filter_fn=functools.partial(_longer_than, limit))


def test_a_partial_or_a_callable_object_as_map_or_filter_resumes_in_another_process(tmp_path):
    """Their repr holds a memory address, which differs in every process: in the recipe it made
    every checkpoint of such a pipeline unloadable by the run meant to resume it."""
    state = checkpoint_after(_configured_pipeline(tmp_path), 1, MICROBATCHES)
    resumed = subprocess.run(
        [sys.executable, "-c", "import json, sys\n"
         "from pathlib import Path\n"
         "from tests.reliability.test_checkpoint_safety import _configured_pipeline, global_batch\n"
         "pipeline = _configured_pipeline(Path(sys.argv[1]))\n"
         "with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:\n"
         "    loader.load_state_dict(json.loads(sys.stdin.read()))\n"
         "    print(next(iter(loader)).digest())\n", str(tmp_path)],
        input=json.dumps(state), capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    pipeline = _configured_pipeline(tmp_path)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as uninterrupted:
        expected = list(itertools.islice(uninterrupted, MICROBATCHES + 1))[-1].digest()
    assert resumed.stdout.strip() == expected
    # and their configuration is part of the recipe
    for changed, name in (({"suffix": "?"}, "map"), ({"limit": 4}, "filter")):
        named = str(refused(_configured_pipeline(tmp_path, **changed), state))
        assert re.search(rf"changed: operators\[\d\]\.{name}\.fn\. Performance", named), named


def _fingerprints_in_processes(expression: str) -> set[str]:
    """`_fingerprint_callable(expression)` as six processes with six PYTHONHASHSEEDs print it:
    one fingerprint, or a resumed run refuses its own checkpoint as another recipe."""
    code = (
        "import functools\n"
        "from zephon._fingerprint import _fingerprint_callable\n"
        "from tests.reliability.test_checkpoint_safety import *\n"
        "from tests.reliability.test_checkpoint_safety import _longer_than\n"
        f"print(_fingerprint_callable({expression}))\n"
    )
    return {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in range(6)
    }


def test_a_partial_holding_a_set_fingerprints_the_same_in_every_process():
    """A set's repr lists its strings in an order that string hashing, salted per process, decides:
    a filter given stop words as a set entered the recipe differently in every process, so its
    checkpoints were refused as another recipe by the run meant to resume them."""
    prints = _fingerprints_in_processes(
        "functools.partial(_longer_than, {'alpha', 'beta', 'gamma', 'delta', 'epsilon'},"
        " stop=frozenset({'the', 'of', 'and', 'a', 'to'}))"
    )
    assert len(prints) == 1, prints


@dataclasses.dataclass(frozen=True)
class StopWords:
    """A callable object configured with a set, as a stop-word filter is."""

    words: frozenset
    field: str = "text"

    def __call__(self, record: dict) -> bool:
        return record[self.field] not in self.words


def test_a_callable_object_holding_a_set_fingerprints_the_same_in_every_process():
    """Its configuration enters the recipe through its repr, whose set is listed in the order
    per-process string hashing gives: the run meant to resume refused its checkpoint."""
    prints = _fingerprints_in_processes("StopWords(frozenset({'the', 'of', 'and', 'a', 'to', 'in', 'is'}))")
    assert len(prints) == 1, prints
    assert "StopWords(words=frozenset({'a', 'and', 'in', 'is', 'of', 'the', 'to'}), field='text')" in prints.pop()


class Cleaner:
    """A user's class whose method is passed as the filter: its settings are its attributes."""

    def __init__(self, min_length: int, stop: tuple = ()) -> None:
        self.min_length = min_length
        self.stop = frozenset(stop)
        self._seen = {}  # private state, filled as it runs

    def keep(self, record: dict) -> bool:
        self._seen[record["text"]] = True
        return len(record["text"]) >= self.min_length and record["text"] not in self.stop

    def __call__(self, record: dict) -> bool:
        return self.keep(record)


def test_a_bound_methods_or_callable_objects_attributes_are_part_of_the_recipe(tmp_path):
    """`Cleaner(5).keep` entered the recipe by its name and source only, and a callable object
    with Python's default repr as `<Cleaner object>`: a checkpoint of `Cleaner(5)` resumed a
    pipeline filtering with `Cleaner(50)`, other batches without a word. Their public attributes
    are the configuration; private ones (caches) are left out, so running does not change it."""
    from zephon._fingerprint import _fingerprint_callable

    data = tmp_path / "data"
    state = checkpoint_after(text_pipeline(jsonl_dataset(data), filter_fn=Cleaner(5).keep), 1, MICROBATCHES)
    named = str(refused(text_pipeline(jsonl_dataset(data), filter_fn=Cleaner(50).keep), state))
    assert re.search(r"changed: operators\[\d\]\.filter\.fn\. Performance", named), named
    assert _fingerprint_callable(Cleaner(5)) != _fingerprint_callable(Cleaner(50))
    stop = frozenset({"a", "the"})
    assert _fingerprint_callable(stop.__contains__) != _fingerprint_callable(frozenset({"an"}).__contains__)
    used = Cleaner(5)
    before = _fingerprint_callable(used.keep)
    used.keep({"text": "running fills the cache"})
    assert _fingerprint_callable(used.keep) == before
    prints = _fingerprints_in_processes("Cleaner(5, stop=('the', 'of', 'and', 'a', 'to', 'in', 'is')).keep")
    assert len(prints) == 1, prints
    assert "min_length=5" in prints.pop()


class Limits(typing.NamedTuple):
    """Settings passed to a partial as a namedtuple, one holding stop words."""

    stop: frozenset
    limit: int


def test_a_namedtuple_holding_a_set_in_a_partial_fingerprints_the_same_in_every_process():
    """A namedtuple is a tuple subclass: it was written by its repr, whose set lists its strings
    in the order per-process string hashing gives, so a resumed run refused its own checkpoint."""
    prints = _fingerprints_in_processes(
        "functools.partial(_longer_than, Limits(frozenset({'the', 'of', 'and', 'a', 'to', 'in', 'is'}), 3))"
    )
    assert len(prints) == 1, prints
    assert "Limits(stop=frozenset({'a', 'and', 'in', 'is', 'of', 'the', 'to'}), limit=3)" in prints.pop()


class SlottedCleaner:
    """A user's callable class with `__slots__` and Python's default repr: no `__dict__`."""

    __slots__ = ("min_length", "stop", "_seen")

    def __init__(self, min_length: int, stop: tuple = ()) -> None:
        self.min_length = min_length
        self.stop = frozenset(stop)
        self._seen = set()  # private state, filled as it runs

    def __call__(self, record: dict) -> bool:
        self._seen.add(record["text"])
        return len(record["text"]) >= self.min_length and record["text"] not in self.stop


def test_an_object_with_slots_enters_the_recipe_by_its_public_attributes():
    """Its public attributes were read from `__dict__`, which a slotted object lacks: it entered
    the recipe by its type only, so a checkpoint of `SlottedCleaner(5)` resumed a pipeline
    filtering with `SlottedCleaner(50)`. Its slots are its configuration; private ones are state."""
    from zephon._fingerprint import _fingerprint_callable

    assert _fingerprint_callable(SlottedCleaner(5)) != _fingerprint_callable(SlottedCleaner(50))
    assert _fingerprint_callable(SlottedCleaner(5, ("a",))) != _fingerprint_callable(SlottedCleaner(5, ("b",)))
    assert _fingerprint_callable(both(SlottedCleaner(5), SlottedCleaner(6))) != \
        _fingerprint_callable(both(SlottedCleaner(5), SlottedCleaner(7)))
    used = SlottedCleaner(5)
    before = _fingerprint_callable(used)
    used({"text": "running fills the cache"})
    assert _fingerprint_callable(used) == before
    prints = _fingerprints_in_processes("SlottedCleaner(5, stop=('the', 'of', 'and', 'a', 'to', 'in', 'is'))")
    assert len(prints) == 1, prints
    assert "SlottedCleaner(min_length=5, stop=frozenset({'a', 'and', 'in', 'is', 'of', 'the', 'to'}))" in prints.pop()


LONGER_THAN = [lambda record, n=n: len(record["text"]) > n for n in (3, 5)]
"""Filters made in a list comprehension, as a sweep over thresholds makes them."""


def _filters_made_in_comprehensions() -> list:
    by_name = {name: lambda record, name=name: name in record for name in ("text",)}
    return [*by_name.values(), *{(lambda record: True) for _ in range(1)}, [[lambda record: False][0]][0]]


def test_a_lambda_made_in_a_comprehension_is_named_alike_on_3_11_and_3_14t():
    """3.11 names a lambda made in a list, dict or set comprehension after the comprehension
    (`<listcomp>.<lambda>`), 3.12+ inlines those comprehensions (PEP 709) and names it without:
    a checkpoint of a filter made so, taken on 3.11, was refused as another recipe on 3.14t. It
    is named as 3.12+ names it, on every build (a generator expression is its own scope on both)."""
    from zephon._fingerprint import _fingerprint_callable

    assert _fingerprint_callable(LONGER_THAN[0]).startswith(f"{__name__}.<lambda> source:")
    assert _fingerprint_callable(LONGER_THAN[0]) != _fingerprint_callable(LONGER_THAN[1])
    local = f"{__name__}._filters_made_in_comprehensions.<locals>.<lambda> source:"
    for made in _filters_made_in_comprehensions():
        assert _fingerprint_callable(made).startswith(local), _fingerprint_callable(made)


def test_an_operator_module_callable_enters_the_recipe_by_its_repr_alone_on_every_interpreter():
    """`operator.itemgetter` is a C class named after the pure-Python one in operator.py: 3.11's
    `inspect` found that twin's source and hashed it, 3.13+ finds none, so a checkpoint of a map
    by `itemgetter("text")` taken on one build was refused as another recipe on the other. Its
    repr shows what it is configured with, so the key still tells two apart."""
    import operator

    from zephon._fingerprint import _fingerprint_callable

    assert _fingerprint_callable(operator.itemgetter("text")) == "operator.itemgetter operator.itemgetter('text')"
    assert _fingerprint_callable(operator.itemgetter("text")) != _fingerprint_callable(operator.itemgetter("label"))
    assert _fingerprint_callable(operator.attrgetter("a.b")) == "operator.attrgetter operator.attrgetter('a.b')"
    assert _fingerprint_callable(operator.methodcaller("get", "x", 1)) == \
        "operator.methodcaller operator.methodcaller('get', 'x', 1)"
    assert _fingerprint_callable(operator.methodcaller("get", "x", 1)) != \
        _fingerprint_callable(operator.methodcaller("get", "x", 2))
    assert " source:" in _fingerprint_callable(_longer_than)  # a function keeps its source's hash


@dataclasses.dataclass(frozen=True)
class Weights:
    """A callable object holding an array."""

    table: np.ndarray

    def __call__(self, record: dict) -> bool:
        return bool(self.table[len(record["text"]) % len(self.table)])


def test_an_array_in_a_partial_or_a_callable_object_enters_the_recipe_by_its_content():
    """An array's repr elides all but its ends past 1,000 items, and rounds floats to 8 digits:
    two arrays differing in the middle, or in the ninth digit, gave one fingerprint, so a changed
    recipe resumed the checkpoint of the old one."""
    from zephon._fingerprint import _fingerprint_callable

    table = np.arange(5000)
    edited = table.copy()
    edited[2500] = -1
    assert _fingerprint_callable(functools.partial(_longer_than, table)) != \
        _fingerprint_callable(functools.partial(_longer_than, edited))
    assert _fingerprint_callable(functools.partial(_longer_than, limit=np.array([0.1]))) != \
        _fingerprint_callable(functools.partial(_longer_than, limit=np.array([0.1 + 1e-12])))
    assert _fingerprint_callable(Weights(table)) != _fingerprint_callable(Weights(edited))
    assert _fingerprint_callable(Weights(table)) != _fingerprint_callable(Weights(table.astype(np.int32)))
    assert _fingerprint_callable(Weights(table)) != _fingerprint_callable(Weights(table.reshape(50, 100)))
    # the same values, however laid out in memory, are the same recipe
    assert _fingerprint_callable(Weights(table[::-1].copy()[::-1])) == _fingerprint_callable(Weights(table))


def test_a_large_array_is_fingerprinted_in_place_without_a_copy_of_it():
    """A map reading a module-level table (a lookup array of a GiB) had it copied whole to bytes
    to be hashed, twice per loader built (its token counter's key and its recipe): a second GiB
    held at once in the trainer's process. It is hashed where it lies, to the same digest."""
    import hashlib
    import tracemalloc

    from zephon._fingerprint import _fingerprint_callable

    table = np.arange(4 * 2**20, dtype=np.float64)  # 32 MiB
    tracemalloc.start()
    try:
        written = _fingerprint_callable(functools.partial(_longer_than, table))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < table.nbytes // 4, peak
    assert f"sha256:{hashlib.sha256(table.tobytes()).hexdigest()[:16]}" in written, written
    strided = np.arange(64, dtype=np.int16)[::2]
    written = _fingerprint_callable(functools.partial(_longer_than, strided))
    assert f"sha256:{hashlib.sha256(strided.tobytes()).hexdigest()[:16]}" in written, written


def test_a_torch_tensor_in_a_partial_or_a_closure_enters_the_recipe_by_its_content():
    """A tensor's repr elides past 1,000 items and rounds to 4 digits, as an array's does: a
    partial holding one edited in the middle resumed the old recipe's checkpoint, and a closure
    saw it by its type only."""
    torch = pytest.importorskip("torch")
    from zephon._fingerprint import _fingerprint_callable

    table = torch.arange(5000.0)
    edited = table.clone()
    edited[2500] = -1
    assert _fingerprint_callable(functools.partial(_longer_than, table)) != \
        _fingerprint_callable(functools.partial(_longer_than, edited))
    assert _fingerprint_callable(functools.partial(_longer_than, torch.tensor([0.1], dtype=torch.float64))) != \
        _fingerprint_callable(functools.partial(_longer_than, torch.tensor([0.1 + 1e-9], dtype=torch.float64)))
    assert _fingerprint_callable(Weights(table)) != _fingerprint_callable(Weights(table.to(torch.bfloat16)))
    grid = table.reshape(50, 100)
    assert _fingerprint_callable(Weights(grid)) == _fingerprint_callable(Weights(grid.t().contiguous().t()))
    assert _fingerprint_callable(both(min_length_filter(1), table)) != \
        _fingerprint_callable(both(min_length_filter(1), edited))


def min_length_filter(limit: int, stop: tuple = ()):
    """A filter configured through its closure, as a factory function makes one."""
    stop_words = frozenset(stop)
    weights = np.arange(5000)

    def keep(record: dict) -> bool:
        return len(record["text"]) >= limit and record["text"] not in stop_words and weights.size > 0

    return keep


def both(first, second, lock=None):
    """A closure holding functions (and, if given, what no text describes: a lock)."""

    def keep(record: dict) -> bool:
        return first(record) and second(record) and lock is not False

    return keep


def recursive_filter():
    """A closure that holds itself."""

    def keep(record: dict, depth: int = 0) -> bool:
        return depth > 1 or keep(record, depth + 1)

    return keep


def through_a_partial():
    """A closure that reaches itself through a partial it holds."""
    bound = None

    def keep(record: dict, limit: int) -> bool:
        return len(record["text"]) > limit or bound(record)

    bound = functools.partial(keep, limit=3)
    return bound


def test_a_closure_reaching_itself_through_a_partial_is_fingerprinted():
    """Only a function met again was stopped: a partial of it met again was written again, and
    building the loader ended in RecursionError."""
    from zephon._fingerprint import _fingerprint_callable

    written = _fingerprint_callable(through_a_partial())
    assert "captured:(bound=<itself>)" in written
    assert written == _fingerprint_callable(through_a_partial())


def test_values_a_closure_captured_are_part_of_the_recipe(tmp_path):
    """`min_length_filter(5)` and `min_length_filter(50)` have one name and one source: a
    checkpoint of the one resumed a pipeline filtering with the other, other batches without a
    word. Numbers, strings, arrays and containers of them are seen, functions through their own
    fingerprint; what has no stable text (a lock) only by its type, the same in every process."""
    import threading

    from zephon._fingerprint import _fingerprint_callable

    data = tmp_path / "data"
    state = checkpoint_after(text_pipeline(jsonl_dataset(data), filter_fn=min_length_filter(5)), 1, MICROBATCHES)
    named = str(refused(text_pipeline(jsonl_dataset(data), filter_fn=min_length_filter(50)), state))
    assert re.search(r"changed: operators\[\d\]\.filter\.fn\. Performance", named), named
    assert _fingerprint_callable(min_length_filter(5, ("a",))) != _fingerprint_callable(min_length_filter(5, ("b",)))
    assert _fingerprint_callable(both(min_length_filter(5), min_length_filter(6))) != \
        _fingerprint_callable(both(min_length_filter(5), min_length_filter(7)))
    assert _fingerprint_callable(both(recursive_filter(), min_length_filter(1), threading.Lock())) == \
        _fingerprint_callable(both(recursive_filter(), min_length_filter(1), threading.Lock()))
    prints = _fingerprints_in_processes(
        "both(min_length_filter(5, stop=('the', 'of', 'and', 'a', 'to', 'in')), recursive_filter(), "
        "__import__('threading').Lock())"
    )
    assert len(prints) == 1, prints


@dataclasses.dataclass
class LazyTable:
    """A callable dataclass whose table is loaded on first use, in the worker that runs it."""

    path: str
    table: dict = dataclasses.field(init=False)

    def __call__(self, record: dict) -> bool:
        if not hasattr(self, "table"):
            self.table = {}
        return record["text"] not in self.table


def test_a_dataclass_with_a_field_set_later_is_fingerprinted_by_the_fields_it_has():
    """The repr dataclasses generate reads every field, and one declared `init=False` and set on
    first use is not there yet: building the loader failed with a bare AttributeError (the
    callable object's repr), or (a closure holding one) did once closures were seen."""
    from zephon._fingerprint import _fingerprint_callable

    written = _fingerprint_callable(LazyTable("stop.txt"))
    assert "LazyTable(path='stop.txt')" in written
    assert written != _fingerprint_callable(LazyTable("other.txt"))
    table = LazyTable("stop.txt")
    assert "captured:(first=LazyTable(path='stop.txt')" in _fingerprint_callable(both(table, table))


@dataclasses.dataclass
class RememberingCleaner:
    """A callable dataclass keeping what it has seen in a private field, as the docs advise for
    state that running changes."""

    min_length: int
    _seen: set = dataclasses.field(default_factory=set)

    def __call__(self, record: dict) -> bool:
        self._seen.add(record["text"])
        return len(record["text"]) >= self.min_length


def test_a_dataclass_s_private_fields_are_state_left_out_of_its_fingerprint(tmp_path):
    """A dataclass was written by every field its generated repr shows, private ones included,
    though an object's private attributes are left out as state that running changes (and the
    docs say to keep such state there): a loader built after the filter had run (a rebuilt
    loader, an evaluation pass) refused the checkpoint of the same recipe as another one."""
    from zephon._fingerprint import _fingerprint_callable

    used = RememberingCleaner(5)
    before = _fingerprint_callable(used)
    assert before != _fingerprint_callable(RememberingCleaner(50))
    data = tmp_path / "data"
    state = checkpoint_after(text_pipeline(jsonl_dataset(data), filter_fn=used), 1, MICROBATCHES)
    assert used._seen  # the filter ran
    assert _fingerprint_callable(used) == before
    again = text_pipeline(jsonl_dataset(data), filter_fn=used)
    with again.shard(0, 1, global_batch_size=global_batch(again)) as loader:
        loader.load_state_dict(state)


def user_module(directory: Path, source: str):
    """A user's module `user_fns` with `source`, imported from its own file in `directory`, as a
    run and the run resuming it each import the user's code."""
    path = directory / "user_fns.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("user_fns", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_user_function_edited_under_the_same_name_is_another_recipe(tmp_path):
    """Its name alone would let a changed map resume a checkpoint of the old one."""

    def load_map(body: str, version: int):
        return user_module(tmp_path / f"v{version}", f"def clean(record):\n    return {body}\n").clean

    dataset = jsonl_dataset(tmp_path / "data")  # one plan: writing the files again would make them another version
    old = text_pipeline(dataset, map_fn=load_map("record", 1))
    new = text_pipeline(dataset, map_fn=load_map("{**record, 'text': record['text'].lower()}", 2))
    named = str(refused(new, checkpoint_after(old, 1, MICROBATCHES)))
    assert re.search(r"changed: operators\[0\]\.map\.fn\. Performance", named), named


def limit_by_default(limit: int):
    """A filter configured through a default argument value, as `lambda r, n=n: ...` in a loop is."""

    def keep(record: dict, min_length: int = limit) -> bool:
        return len(record["text"]) >= min_length

    return keep


def limit_by_keyword_default(limit: int, stop: tuple = ()):
    """A filter configured through keyword-only default argument values."""

    def keep(record: dict, *, min_length: int = limit, stop_words: frozenset = frozenset(stop)) -> bool:
        return len(record["text"]) >= min_length and record["text"] not in stop_words

    return keep


def test_default_argument_values_are_part_of_the_recipe(tmp_path):
    """A default is evaluated where the function is defined: `def keep(r, min_length=MIN_LENGTH)`
    keeps its source when `MIN_LENGTH` changes, and `limit_by_default(5)` and `(50)` have one name,
    one source and no closure. A checkpoint of the one resumed a pipeline filtering with the other,
    other batches without a word."""
    from zephon._fingerprint import _fingerprint_callable

    data = tmp_path / "data"
    state = checkpoint_after(text_pipeline(jsonl_dataset(data), filter_fn=limit_by_default(5)), 1, MICROBATCHES)
    named = str(refused(text_pipeline(jsonl_dataset(data), filter_fn=limit_by_default(50)), state))
    assert re.search(r"changed: operators\[\d\]\.filter\.fn\. Performance", named), named

    def user_filter(version: int, min_length: int):
        source = f"MIN_LENGTH = {min_length}\n\n\ndef keep(record, min_length=MIN_LENGTH):\n" \
                 "    return len(record['text']) >= min_length\n"
        return user_module(tmp_path / f"v{version}", source).keep

    state = checkpoint_after(text_pipeline(jsonl_dataset(data), filter_fn=user_filter(1, 5)), 1, MICROBATCHES)
    named = str(refused(text_pipeline(jsonl_dataset(data), filter_fn=user_filter(2, 50)), state))
    assert re.search(r"changed: operators\[\d\]\.filter\.fn\. Performance", named), named
    assert _fingerprint_callable(limit_by_keyword_default(5)) != _fingerprint_callable(limit_by_keyword_default(6))
    assert _fingerprint_callable(limit_by_keyword_default(5, ("a",))) != \
        _fingerprint_callable(limit_by_keyword_default(5, ("b",)))
    assert _fingerprint_callable(limit_by_default(5)) == _fingerprint_callable(limit_by_default(5))
    prints = _fingerprints_in_processes("limit_by_keyword_default(5, ('the', 'of', 'and', 'a', 'to', 'in'))")
    assert len(prints) == 1, prints
    assert "stop_words=frozenset({'a', 'and', 'in', 'of', 'the', 'to'})" in prints.pop()


MIN_WORDS = 3  # module-level settings the filters below read
LONG_WORD = 30
WORD_UNIT = 1


def counted_words(text: str) -> int:
    """A helper a filter calls through a global, reading a global itself."""
    return len(text.split()) // WORD_UNIT


def has_min_words(record: dict) -> bool:
    """A filter configured by the module globals it reads, one inside a generator expression."""
    words = record["text"].split()
    return counted_words(record["text"]) >= MIN_WORDS and not any(len(word) > LONG_WORD for word in words)


def test_module_globals_a_function_reads_are_part_of_the_recipe(tmp_path, monkeypatch):
    """`MAX_LEN = 2048` changed to 4096 at module level leaves the filter's name and source as they
    were: a checkpoint of the one resumed a pipeline filtering with the other, other batches under
    the old recipe's name, without a word. The globals its code reads (in nested code and the
    helpers it calls too) enter the recipe by value."""
    from zephon._fingerprint import _fingerprint_callable

    data = tmp_path / "data"
    state = checkpoint_after(text_pipeline(jsonl_dataset(data), filter_fn=has_min_words), 1, MICROBATCHES)
    module = sys.modules[has_min_words.__module__]
    for name, changed in (("MIN_WORDS", 4), ("LONG_WORD", 31), ("WORD_UNIT", 2)):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, changed)
            named = str(refused(text_pipeline(jsonl_dataset(data), filter_fn=has_min_words), state))
            assert re.search(r"changed: operators\[\d\]\.filter\.fn\. Performance", named), (name, named)
    assert _fingerprint_callable(lambda record: len(record["text"]) > LONG_WORD) != \
        _fingerprint_callable(lambda record: len(record["text"]) > MIN_WORDS)

    def user_filter(version: int, max_len: int):
        source = f"MAX_LEN = {max_len}\n\n\ndef limit():\n    return MAX_LEN\n\n\n" \
                 "def keep(record):\n    return len(record['text']) < limit()\n"
        return user_module(tmp_path / f"v{version}", source).keep

    state = checkpoint_after(text_pipeline(jsonl_dataset(data), filter_fn=user_filter(1, 2048)), 1, MICROBATCHES)
    named = str(refused(text_pipeline(jsonl_dataset(data), filter_fn=user_filter(2, 4096)), state))
    assert re.search(r"changed: operators\[\d\]\.filter\.fn\. Performance", named), named
    again = text_pipeline(jsonl_dataset(data), filter_fn=user_filter(3, 2048))
    with again.shard(0, 1, global_batch_size=global_batch(again)) as loader:
        loader.load_state_dict(state)  # the same code and values, imported again, resume


STOP_WORDS = frozenset({"the", "of", "and", "a", "to", "in", "is"})


def is_even(n: int) -> bool:
    return n == 0 or is_odd(n - 1)


def is_odd(n: int) -> bool:
    return n != 0 and is_even(n - 1)


def keeps_even_texts(record: dict) -> bool:
    """Reads a set, a module, a library's function, itself and two mutually recursive functions."""
    text = substitute(r"\s+", " ", record["text"])
    return is_even(len(text) % 8) and text not in STOP_WORDS and np.size(text) == 1 and keeps_even_texts is not None


def test_globals_a_function_reads_fingerprint_the_same_in_every_process():
    """A set is listed sorted, a module by its name, a library's function by its name (its module's
    globals hold its caches: `re` keeps the patterns programs compiled), and a function reaching
    itself, directly or through another, is written `<itself>` there instead of without end."""
    from zephon._fingerprint import _fingerprint_callable

    prints = _fingerprints_in_processes("keeps_even_texts")
    assert len(prints) == 1, prints
    written = prints.pop()
    assert "STOP_WORDS=frozenset({'a', 'and', 'in', 'is', 'of', 'the', 'to'})" in written, written
    assert "np=<module numpy>" in written and "substitute=re.sub)" in written, written
    assert "keeps_even_texts=<itself>" in written and "is_even=<itself>" in written, written
    assert "len=" not in written, written  # a builtin
    before = _fingerprint_callable(keeps_even_texts)
    assert written == before + "\n"  # this process, where `re` compiled other patterns, agrees
    import re as regular_expressions

    regular_expressions.purge()
    regular_expressions.compile("a pattern compiled after the loader was built")
    assert _fingerprint_callable(keeps_even_texts) == before


def test_a_librarys_function_is_named_and_the_users_own_installed_package_followed(tmp_path, monkeypatch):
    """A library's function reached through a global is written by its name: its globals are the
    library's state (here a cache it fills as it runs), which would change the fingerprint as the
    program runs. The user's own package is followed even where it is installed as a library."""
    from zephon import _code_reads
    from zephon._fingerprint import _fingerprint_callable

    installed = tmp_path / "site-packages"
    for path, source in {
        "userpkg/__init__.py": "",
        "userpkg/helpers.py": "LIMIT = 5\n\n\ndef limit():\n    return LIMIT\n",
        "userpkg/filters.py": "from otherlib import count\nfrom userpkg.helpers import limit\n\n\n"
                              "def keep(record):\n    return count(record) > limit()\n",
        "otherlib/__init__.py": "CACHE = {}\n\n\ndef count(record):\n"
                                "    CACHE[record['text']] = len(record['text'])\n    return CACHE[record['text']]\n",
    }.items():
        (installed / path).parent.mkdir(parents=True, exist_ok=True)
        (installed / path).write_text(source)
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.setattr(_code_reads, "_library_roots", lambda: (os.path.join(os.path.realpath(installed), ""),))
    try:
        import otherlib
        import userpkg.filters
        import userpkg.helpers

        written = _fingerprint_callable(userpkg.filters.keep)
        assert "count=otherlib.count," in written and "globals:(LIMIT=5)" in written, written
        otherlib.count({"text": "running fills the library's cache"})
        assert _fingerprint_callable(userpkg.filters.keep) == written
        monkeypatch.setattr(userpkg.helpers, "LIMIT", 6)
        assert _fingerprint_callable(userpkg.filters.keep) != written
    finally:
        for name in ("userpkg.filters", "userpkg.helpers", "userpkg", "otherlib"):
            sys.modules.pop(name, None)


def test_a_helper_reached_along_many_paths_is_written_once(tmp_path):
    """Helpers calling shared helpers (`level_3` calls `left_2` and `right_2`, which both call
    `level_1`, ...) were written again along every path: 2**n writings for n levels, a loader
    that took minutes to build, or never did. A function written already in this fingerprint is
    written by its name; a change to it still shows where it was written first."""
    from zephon._fingerprint import _fingerprint_callable

    levels = 14

    def helpers(limit: int) -> str:
        lines = [f"LIMIT = {limit}\n\n\ndef level_0(text):\n    return len(text) > LIMIT\n"]
        for n in range(1, levels + 1):
            lines.append(f"\ndef left_{n}(text):\n    return level_{n - 1}(text)\n")
            lines.append(f"\ndef right_{n}(text):\n    return level_{n - 1}(text[1:])\n")
            lines.append(f"\ndef level_{n}(text):\n    return left_{n}(text) and right_{n}(text)\n")
        lines.append(f"\ndef keep(record):\n    return level_{levels}(record['text'])\n")
        return "".join(lines)

    written = _fingerprint_callable(user_module(tmp_path / "v1", helpers(5)).keep)
    assert len(written) < 200 * 3 * levels, len(written)
    assert written.count("as above>") == levels, written
    assert written == _fingerprint_callable(user_module(tmp_path / "v2", helpers(5)).keep)
    assert written != _fingerprint_callable(user_module(tmp_path / "v3", helpers(6)).keep)


def assert_a_change_is_refused_and_the_same_resumes(tmp_path: Path, user_filter, original, changes) -> None:
    """A checkpoint of a pipeline filtering with `user_filter(1, original)` is refused, naming the
    filter, by a separately built pipeline filtering with `user_filter(version, changed)` for each
    of `changes`, and resumed by one built again from `original` (its code imported anew)."""
    dataset = jsonl_dataset(tmp_path / "data")  # one plan for all: the recipe is all that changes
    state = checkpoint_after(text_pipeline(dataset, filter_fn=user_filter(1, original)), 1, MICROBATCHES)
    for version, changed in enumerate(changes, start=2):
        named = str(refused(text_pipeline(dataset, filter_fn=user_filter(version, changed)), state))
        assert re.search(r"changed: operators\[\d\]\.filter\.fn\. Performance", named), (changed, named)
    again = text_pipeline(dataset, filter_fn=user_filter(len(changes) + 2, original))
    with again.shard(0, 1, global_batch_size=global_batch(again)) as loader:
        loader.load_state_dict(state)


def test_a_compiled_pattern_enters_the_recipe_by_its_pattern_and_flags(tmp_path):
    """A compiled `re` pattern held in a global, a default or a closure was written by its type
    alone: a filter whose `WORD = re.compile(...)` was edited, or given another flag, resumed a
    checkpoint of the old one, filtering other records under its name."""
    from zephon._fingerprint import _fingerprint_callable

    def user_filter(version: int, compiled: str):
        source = f"import re\n\nWORD = {compiled}\n\n\n" \
                 "def keep(record):\n    return WORD.search(record['text']) is not None\n"
        return user_module(tmp_path / f"v{version}", source).keep

    assert_a_change_is_refused_and_the_same_resumes(
        tmp_path, user_filter, r're.compile(r"[a-z]+")', (r're.compile(r"[a-z]{2,}")', r're.compile(r"[a-z]+", re.I)')
    )
    held = _fingerprint_callable(has_any_pattern(re.compile("the"), [re.compile("of")]))
    assert held == _fingerprint_callable(has_any_pattern(re.compile("the"), [re.compile("of")]))
    for first, other in (("a", re.compile("of")), ("the", re.compile("of", re.I))):
        assert _fingerprint_callable(has_any_pattern(re.compile(first), [other])) != held
    long_pattern = "x" * 300  # a pattern's repr is cut at 200 characters
    assert _fingerprint_callable(functools.partial(_longer_than, re.compile(long_pattern + "a"))) != \
        _fingerprint_callable(functools.partial(_longer_than, re.compile(long_pattern + "b")))


def has_any_pattern(first: re.Pattern, others: list):
    """A filter holding one pattern in its closure and a list of them in a default."""

    def keep(record: dict, others: list = others) -> bool:
        return any(pattern.search(record["text"]) for pattern in (first, *others))

    return keep


def test_an_enum_member_enters_the_recipe_by_its_class_name_and_value(tmp_path):
    """An enum member held in a global, a default or a closure was written by its class alone:
    a filter reading `LIMIT = Length.SHORT` resumed a checkpoint taken while `SHORT` was another
    value, or while `LIMIT` was another member."""
    from zephon._fingerprint import _fingerprint_callable

    def user_filter(version: int, setting: tuple[str, int]):
        member, short = setting
        source = f"import enum\n\n\nclass Length(enum.Enum):\n    SHORT = {short}\n    LONG = 50\n\n\n" \
                 f"LIMIT = Length.{member}\n\n\ndef keep(record):\n    return len(record['text']) >= LIMIT.value\n"
        return user_module(tmp_path / f"v{version}", source).keep

    assert_a_change_is_refused_and_the_same_resumes(tmp_path, user_filter, ("SHORT", 10), (("SHORT", 11), ("LONG", 10)))
    written = _fingerprint_callable(limit_by_default(Sizes.SMALL))  # an int too: its repr left its module out
    assert f"min_length={__name__}.Sizes.SMALL(3)" in written, written
    assert written != _fingerprint_callable(limit_by_default(Sizes.LARGE))


class Sizes(enum.IntEnum):
    SMALL = 3
    LARGE = 30


DECORATED = '''import functools


@functools.lru_cache(maxsize=None)
def words(text):
    return {words}


def doubled(fn):
    @functools.wraps(fn)
    def wrapper(text):
        return {doubled}
    return wrapper


@doubled
def half(text):
    return len(text) // 2


class Traced:
    """A decorator class: its instance wraps the function."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)

    def __call__(self, text):
        return self.__wrapped__(text)


@Traced
def third(text):
    return {third}


@functools.cache
def depth(n):
    return 0 if n <= 0 else 1 + depth(n - 1)


def keep(record):
    text = record["text"]
    return words(text) + half(text) + third(text) + depth(3) > 0
'''


def test_a_function_a_decorator_wraps_is_followed_into_its_code(tmp_path):
    """`functools.lru_cache`/`cache` and a decorator class made a helper an object with the
    function in `__wrapped__`, written by its type alone; a `functools.wraps` decorator's wrapper
    was written by the source of the function it wraps (`inspect` unwraps), not its own. Editing the
    cached helper, the class-decorated one or the decorator resumed a checkpoint of the old code.
    A recursive cached helper reaches itself through its wrapper: written `<itself>` there."""
    from zephon._fingerprint import _fingerprint_callable

    def user_filter(version: int, bodies: tuple[str, str, str]):
        words, doubled, third = bodies
        return user_module(tmp_path / f"v{version}", DECORATED.format(words=words, doubled=doubled, third=third)).keep

    original = ("len(text.split())", "fn(text) * 2", "len(text) // 3")
    changes = (
        ("len(text.split()) + 1", "fn(text) * 2", "len(text) // 3"),
        ("len(text.split())", "fn(text) * 3", "len(text) // 3"),
        ("len(text.split())", "fn(text) * 2", "len(text) // 4"),
    )
    assert_a_change_is_refused_and_the_same_resumes(tmp_path, user_filter, original, changes)
    cached = user_filter(len(changes) + 3, original)
    written = _fingerprint_callable(cached.__globals__["words"])
    assert written.startswith("functools._lru_cache_wrapper(user_fns.words)") and "source:" in written, written
    assert "depth=<itself>" in _fingerprint_callable(cached), _fingerprint_callable(cached)


METHODS = '''UNIT = {unit}


class Counter:
    def words(self, text):
        return {words}


class Cleaner(Counter):
    def __init__(self, limit):
        self.limit = limit

    def longest(self, text):
        return {longest}

    def depth(self, n):
        return 0 if n <= 0 else 1 + self.depth(n - 1)

    def keep(self, record):
        text = record["text"]
        return self.words(text) >= self.limit and self.longest(text) < 40 and self.depth(2) == 2

    def __call__(self, record):
        return self.keep(record)
'''


@pytest.mark.parametrize("handed", ["bound method", "callable object"])
def test_the_methods_a_method_calls_on_self_are_part_of_the_recipe(tmp_path, handed):
    """`Cleaner(3).keep` was hashed by `keep`'s source alone, and `Cleaner(3)` by its class's:
    `self.words(text)`, defined in a base class, edited or reading a changed module global, and
    `self.longest(text)` edited, resumed a checkpoint of the old code. The methods a method calls on
    its first argument, found through the class's MRO, are followed like the functions it reads."""
    from zephon._fingerprint import _fingerprint_callable

    def user_filter(version: int, bodies: tuple[int, str, str]):
        unit, words, longest = bodies
        module = user_module(tmp_path / f"v{version}", METHODS.format(unit=unit, words=words, longest=longest))
        return module.Cleaner(3).keep if handed == "bound method" else module.Cleaner(3)

    original = (1, "len(text.split()) // UNIT", "max(len(word) for word in text.split())")
    changes = (
        (2, "len(text.split()) // UNIT", "max(len(word) for word in text.split())"),
        (1, "len(text.split()) // UNIT + 1", "max(len(word) for word in text.split())"),
        (1, "len(text.split()) // UNIT", "max(len(word) for word in text.split()) + 1"),
    )
    assert_a_change_is_refused_and_the_same_resumes(tmp_path, user_filter, original, changes)
    written = _fingerprint_callable(user_filter(len(changes) + 3, original))
    assert "depth=<itself>" in written and "words=user_fns.Counter.words" in written, written


class Thresholds:
    """Reaches its helpers on `self` as a property, a classmethod and a staticmethod."""

    stop = frozenset({"the", "of", "and", "a", "to", "in", "is"})

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum

    @property
    def floor(self) -> int:
        return self.minimum + self.margin()

    @classmethod
    def margin(cls) -> int:
        return len(cls.stop) // 7

    @staticmethod
    def words(text: str) -> list[str]:
        return [word for word in text.split() if word not in STOP_WORDS]

    def keep(self, record: dict) -> bool:
        return len(self.words(record["text"])) >= self.floor


def test_methods_reached_on_self_fingerprint_the_same_in_every_process():
    """Each is written once, by name, in the same order in every process; a staticmethod's globals
    and a class constant a classmethod reads on `cls` (sets) are listed sorted."""
    prints = _fingerprints_in_processes("Thresholds(3).keep")
    assert len(prints) == 1, prints
    written = prints.pop()
    listed = "frozenset({'a', 'and', 'in', 'is', 'of', 'the', 'to'})"
    for reached in ("floor=", "margin=", "words=", f"STOP_WORDS={listed}", f"stop={listed}"):
        assert reached in written, (reached, written)


CONSTANTS = '''class Cleaner:
    MIN_WORDS = {min_words}
    _seen = {{}}  # private, filled as it runs

    def keep(self, record):
        self._seen[record["text"]] = True
        return len(record["text"].split()) >= self.MIN_WORDS
'''


def test_a_class_constant_a_method_reads_on_self_is_part_of_the_recipe(tmp_path):
    """`Cleaner().keep` reading `self.MIN_WORDS`, set in the class body, kept its source when the
    constant changed from 3 to 4, and its instance holds no such attribute: a checkpoint of the one
    resumed a pipeline filtering with the other. A public class attribute it reads on `self` that is
    no function enters by value; a private one, state filled as it runs, does not."""
    from zephon._fingerprint import _fingerprint_callable

    def user_filter(version: int, min_words: int):
        return user_module(tmp_path / f"v{version}", CONSTANTS.format(min_words=min_words)).Cleaner().keep

    assert_a_change_is_refused_and_the_same_resumes(tmp_path, user_filter, 3, (4,))
    keep = user_filter(4, 3)
    before = _fingerprint_callable(keep)
    keep({"text": "running fills the private cache"})
    assert _fingerprint_callable(keep) == before and "MIN_WORDS=3" in before, before


GETATTR = '''class Cleaner:
    MIN_WORDS = {min_words}

    def words(self, text):
        return {words}

    def keep(self, record):
        counts = [getattr(self, "words")(text) for text in (record["text"],)]
        return counts[0] >= getattr(self, "MIN_WORDS", 0)
'''


def test_what_a_method_reads_by_getattr_with_the_name_written_in_the_call_is_part_of_the_recipe(tmp_path):
    """`getattr(self, "words")(text)` reads what `self.words(text)` does, but only the latter was
    followed: `words` edited, or `MIN_WORDS` read as `getattr(self, "MIN_WORDS", 0)` changed,
    resumed a checkpoint of the old code. A name written in the call is followed as `self.name` is
    (in a comprehension too); one held in a variable is not (Known limits), nor is a `getattr` the
    module defines itself, which need not read anything on `self`."""
    from zephon._fingerprint import _fingerprint_callable

    def user_filter(version: int, settings: tuple[int, str]):
        min_words, words = settings
        return user_module(tmp_path / f"v{version}", GETATTR.format(min_words=min_words, words=words)).Cleaner().keep

    original = (3, "len(text.split())")
    changes = ((4, original[1]), (3, "len(text)"))
    assert_a_change_is_refused_and_the_same_resumes(tmp_path, user_filter, original, changes)
    written = _fingerprint_callable(user_filter(5, original))
    assert "words=user_fns.Cleaner.words" in written and "MIN_WORDS=3" in written, written
    shadowed = user_module(tmp_path / "v6", "def getattr(obj, name, default=None):\n    return default\n\n\n"
                           + GETATTR.format(min_words=3, words="len(text.split())"))
    written = _fingerprint_callable(shadowed.Cleaner().keep)
    assert "MIN_WORDS=" not in written and "user_fns.Cleaner.words" not in written, written


SUPER = '''class Base:
    MINIMUM = {minimum}

    def words(self, text):
        return {base_words}


class Counter(Base):
    def words(self, text):
        return {counter_words}


class Cleaner(Counter):
    MINIMUM = 1

    def words(self, text):
        return 0  # overridden here, but `keep` reaches the parents' through super()

    def keep(self, record):
        return {cleaner_super}.words(record["text"]) >= {cleaner_super}.MINIMUM
'''


@pytest.mark.parametrize("form", ["super()", "super(Class, self)"])
def test_the_methods_a_method_reaches_through_super_are_part_of_the_recipe(tmp_path, form):
    """`Cleaner().keep` calling `super().words(...)` (or `super(Cleaner, self).words(...)`) was
    hashed without the parent's `words`: the parent's body edited (or its own parent's, which it
    reaches through `super()` in turn), or a class constant read as `super().MINIMUM` changed,
    resumed a checkpoint of the old code. What a method reads on `super()` is found in its
    instance's MRO after the class defining the method (or the class named), and written as what
    it reads on `self` is."""
    from zephon._fingerprint import _fingerprint_callable

    def made_in(cls: str) -> str:
        return "super()" if form == "super()" else f"super({cls}, self)"

    def user_filter(version: int, bodies: tuple[int, str, str]):
        minimum, base_words, counter_words = bodies
        source = SUPER.format(
            minimum=minimum, base_words=base_words, counter_words=counter_words.replace("super()", made_in("Counter")),
            cleaner_super=made_in("Cleaner"),
        )
        return user_module(tmp_path / f"v{version}", source).Cleaner().keep

    original = (1, "len(text.split())", "super().words(text) + 0")
    changes = (
        (2, "len(text.split())", "super().words(text) + 0"),
        (1, "len(text.split()) + 1", "super().words(text) + 0"),
        (1, "len(text.split())", "super().words(text) - 1"),
    )
    assert_a_change_is_refused_and_the_same_resumes(tmp_path, user_filter, original, changes)
    written = _fingerprint_callable(user_filter(len(changes) + 3, original))
    assert "words=user_fns.Counter.words" in written and "words=user_fns.Base.words" in written, written
    assert "MINIMUM=1" in written and "user_fns.Cleaner.words" not in written, written


class Tokens:
    """A parent whose method a child's method reaches through `super()`."""

    def words(self, text: str) -> list[str]:
        return [word for word in text.split() if word not in STOP_WORDS]


class ShortTokens(Tokens):
    """Overrides `words`, calling the parent's through `super()`."""

    def words(self, text: str) -> list[str]:
        return [word for word in super().words(text) if len(word) < 12]

    def keep(self, record: dict) -> bool:
        return len(self.words(record["text"])) >= 2


def test_methods_reached_through_super_fingerprint_the_same_in_every_process():
    """The parent's method is written, with the global set it reads listed sorted, alike in every
    process."""
    prints = _fingerprints_in_processes("ShortTokens().keep")
    assert len(prints) == 1, prints
    written = prints.pop()
    assert "super:(words=tests.reliability.test_checkpoint_safety.Tokens.words" in written, written
    assert "STOP_WORDS=frozenset({'a', 'and', 'in', 'is', 'of', 'the', 'to'})" in written, written


def _states_saved_on_another_thread(save, take, times: int) -> list[dict]:
    """`save()` called over and over on another thread while this one calls `take()` `times`
    times; what it returned. The switch interval is 1 us meanwhile: with the GIL, the threads then
    switch inside a save too."""
    saved, failures, done = [], [], threading.Event()

    def checkpointer() -> None:
        while not done.is_set():
            try:
                saved.append(save())
            except Exception as error:  # noqa: BLE001 - named by the assertion
                failures.append(repr(error))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=checkpointer)
    try:
        thread.start()
        for _ in range(times):
            take()
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert failures == []
    assert saved
    return saved


def test_a_state_saved_on_another_thread_while_the_trainer_iterates_is_one_saved_between_two_microbatches(tmp_path):
    """An asynchronous checkpointer or a watchdog calls state_dict() on its own thread while the
    trainer's thread takes microbatches. The save read the cursors and settled the ledger while the
    loader's thread moved and counted them: it failed with "dictionary changed size during
    iteration", or gave a state whose ledger had lost records. Every state saved on the other thread
    must be one the trainer's thread saves between two microbatches."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", num_epochs=None, flush_every_chunks=1)
    microbatches = 1500
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        batches = iter(loader)
        between = {json.dumps(loader.state_dict(), sort_keys=True)}
        for _ in range(microbatches):
            next(batches)
            between.add(json.dumps(loader.state_dict(), sort_keys=True))
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        batches = iter(loader)
        saved = _states_saved_on_another_thread(loader.state_dict, lambda: next(batches), microbatches)
    strays = [state for state in saved if json.dumps(state, sort_keys=True) not in between]
    assert not strays, f"{len(strays)} of {len(saved)} states saved on the other thread are no state between two microbatches"


def test_a_titan_state_saved_on_another_thread_is_one_saved_between_two_local_batches(tmp_path, monkeypatch):
    """ZephonDataLoader takes a local batch's microbatches from its rank loader one by one, and
    hands them back (`RankLoader._take_up`) if an interrupt comes before the batch is yielded. A
    save on another thread waited only for the microbatch in progress: it saved states partway
    through a local batch, which resume on the rest of that batch, so that every later yield
    straddled two of the uninterrupted run's and the optimizer steps differed; and a save landing
    in a hand-back read the ledger before it and the cursors after it. Every state saved on the
    other thread must be one the trainer's thread saves between two local batches."""
    from zephon.integrations.torchtitan import ZephonDataLoader

    monkeypatch.setattr(ZephonDataLoader, "_collate", lambda self, group: group)  # no torch needed
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", num_epochs=None, flush_every_chunks=1)
    size = global_batch(pipeline)
    assert size // pipeline.microbatch_size > 1  # a local batch of several microbatches
    yields = 400
    with ZephonDataLoader(pipeline, 0, 1, size, local_batch_size=size) as loader:
        batches = iter(loader)
        between = {json.dumps(loader.local_state_dict(), sort_keys=True)}
        for _ in range(yields):
            next(batches)
            between.add(json.dumps(loader.local_state_dict(), sort_keys=True))
    with ZephonDataLoader(pipeline, 0, 1, size, local_batch_size=size) as loader:
        batches = iter(loader)
        saved = _states_saved_on_another_thread(loader.local_state_dict, lambda: next(batches), yields)
    strays = [state for state in saved if json.dumps(state, sort_keys=True) not in between]
    assert not strays, f"{len(strays)} of {len(saved)} states saved on the other thread are no state between two local batches"


def test_a_state_loaded_on_another_thread_as_the_trainer_begins_iterating_is_the_one_it_iterates_from(
    tmp_path, monkeypatch
):
    """load_state_dict() on another thread waits for the microbatch in progress. The first next()
    opened the lanes under `_moving` and let it go before taking the first microbatch: a load
    landing there swapped the lanes out from under it, and the trainer's thread failed with a bare
    KeyError naming a lane. The hook loads the state at that point, on a thread of its own."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", num_epochs=None)
    size = global_batch(pipeline)
    with pipeline.shard(0, 1, global_batch_size=size) as loader:
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        state = loader.state_dict()
        after = [next(batches).digest() for _ in range(4)]
    with pipeline.shard(0, 1, global_batch_size=size) as loader:
        handed_over, failures = loader._handed_over, []

        def load_then_hand_over(microbatches, asked):
            def load() -> None:
                try:
                    loader.load_state_dict(state)
                except Exception as error:  # noqa: BLE001 - named by the assertion
                    failures.append(repr(error))

            thread = threading.Thread(target=load)
            thread.start()
            thread.join()
            return handed_over(microbatches, asked)

        monkeypatch.setattr(loader, "_handed_over", load_then_hand_over)
        batches = iter(loader)
        assert [next(batches).digest() for _ in range(4)] == after
        assert failures == []


def test_a_state_loaded_on_another_thread_ends_the_iteration_it_lands_in_and_a_new_one_starts_from_it(tmp_path):
    """The trainer's iteration, suspended between two microbatches when another thread loads a
    state, ends (its next() raises StopIteration) rather than going on from cursors it no longer
    has; a new iter() hands over the loaded state's microbatches."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), runner="inline", num_epochs=None)
    size = global_batch(pipeline)
    with pipeline.shard(0, 1, global_batch_size=size) as loader:
        batches = iter(loader)
        next(batches)
        state = loader.state_dict()
        after = [next(batches).digest() for _ in range(4)]
    with pipeline.shard(0, 1, global_batch_size=size) as loader:
        batches = iter(loader)
        for _ in range(6):
            next(batches)
        thread = threading.Thread(target=loader.load_state_dict, args=(state,))
        thread.start()
        thread.join()
        with pytest.raises(StopIteration):
            next(batches)
        batches = iter(loader)
        assert [next(batches).digest() for _ in range(4)] == after
