"""`zephon.integrations.torchtitan` against TorchTitan 0.3.0's data-loader contract (SPEC §4).

The checks against TorchTitan itself (the real `BaseDataLoader`, the trainer's build call read
from its source) are `requires_torchtitan`: the nox session on 3.11 installs 0.3.0 (--no-deps,
with torchdata, tyro and spmd_types; `noxfile.TORCHTITAN`), so CI runs them. The torchrun test
checkpoints through TorchTitan's own CheckpointManager where torchtitan imports, else through
torch.distributed.checkpoint under the same `dataloader` key, and checks which one it used.

Every loader here is built from its own pipeline, separately constructed from the reference's:
a pipeline caches its work plan's token estimate, so sharing one would hide a difference between
two constructions of the same recipe.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import logging
import re
import sys
import threading
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.harness import GLOBAL_BATCH, Interrupt, step_digests, text_pipeline
from tests.integration._torchrun_worker import launch
from tests.unit.conftest_io import CountingStore, put, registered
from zephon import _lane
from zephon import (
    IGNORE_INDEX,
    CheckpointError,
    ConfigurationError,
    Pipeline,
    RecipeMismatchError,
    global_batch_digest,
    merge_states,
)
from zephon.demo._recipe import DATA, TOKENIZER, demo_pipeline
from zephon.io import Dataset
from zephon.integrations.torchtitan import (
    STATE_KEY,
    TORCHTITAN_VERSION,
    DataRecipe,
    ZephonDataLoader,
    build_zephon_dataloader,
)
from zephon.work import StaticMixtureWorkSource

pytestmark = pytest.mark.requires_torch

LOCAL_BATCH = 4
STEPS = 5
RESUME_AT = 2


@pytest.fixture(scope="module")
def corpora(make_jsonl_corpus):
    return make_jsonl_corpus(3, 40, 21), make_jsonl_corpus(2, 40, 22)


@pytest.fixture(scope="module")
def make_pipeline(corpora, demo_tokenizer_path):
    """A new, separately constructed pipeline of the recipe at every call."""
    return lambda: text_pipeline(*corpora, demo_tokenizer_path)


@pytest.fixture
def pipeline(make_pipeline):
    return make_pipeline()


@pytest.fixture(scope="module")
def reference(make_pipeline) -> list[str]:
    return step_digests(make_pipeline(), 1, STEPS)


def titan_run(pipeline, world_size: int, steps: int, *, state=None, first_step: int = 0) -> tuple[list[str], list]:
    """Replicas side by side in one process, each `next()`-ed as TorchTitan's train_step does
    (gradient_accumulation_steps times per step). Returns per-step global digests and the
    local states of every replica at the end."""
    loaders = [ZephonDataLoader(pipeline, r, world_size, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) for r in range(world_size)]
    try:
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        iterators = [iter(loader) for loader in loaders]
        digests = []
        for step in range(first_step, first_step + steps):
            microbatches = []
            for loader, it in zip(loaders, iterators):
                for _ in range(loader.gradient_accumulation_steps):
                    next(it)
                    assert {b.step for b in loader.last_microbatches} == {step}
                    microbatches.extend(loader.last_microbatches)
            digests.append(global_batch_digest(microbatches))
        return digests, [loader.local_state_dict() for loader in loaders]
    finally:
        for loader in loaders:
            loader.close()


def test_loader_is_a_stateful_iterable_as_dcp_expects():
    from torch.distributed.checkpoint.stateful import Stateful

    for name in ("__iter__", "state_dict", "load_state_dict"):
        assert callable(getattr(ZephonDataLoader, name))
    assert issubclass(ZephonDataLoader, Stateful)  # what DCP checks before calling state_dict()


@pytest.mark.requires_torchtitan
def test_loader_is_a_torchtitan_base_dataloader_of_the_pinned_version():
    import torchtitan
    from torchtitan.components.dataloader import BaseDataLoader

    assert issubclass(ZephonDataLoader, BaseDataLoader)
    assert issubclass(ZephonDataLoader.Config, BaseDataLoader.Config)
    assert ZephonDataLoader.Config._owner is ZephonDataLoader
    assert getattr(torchtitan, "__version__", TORCHTITAN_VERSION).startswith(TORCHTITAN_VERSION[:3])


@pytest.mark.requires_torchtitan
def test_builder_accepts_every_argument_the_trainer_passes():
    """The keywords of TorchTitan's `config.dataloader.build(...)` call, read from trainer.py."""
    source = Path(importlib.util.find_spec("torchtitan").submodule_search_locations[0], "trainer.py").read_text()
    calls = [
        node for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "build"
        and ast.unparse(node.func.value) == "config.dataloader"
    ]
    assert calls, "TorchTitan's trainer no longer calls config.dataloader.build(...)"
    passed = {kw.arg for kw in calls[0].keywords}
    accepted = set(inspect.signature(build_zephon_dataloader).parameters) - {"config", "other"}
    assert passed <= accepted, f"the trainer passes {sorted(passed - accepted)} that the builder does not name"


def test_config_build_makes_a_loader_like_the_trainer_does(corpora, demo_tokenizer_path):
    recipe = DataRecipe(
        datasets={"a": str(corpora[0]), "b": str(corpora[1])}, tokenizer=str(demo_tokenizer_path), eos="<|eos|>",
        max_length=64, num_lanes=8, microbatch_size=2, shuffle_buffer=8, records_per_chunk=8, runner="inline",
    )
    config = ZephonDataLoader.Config(recipe=recipe, global_batch_size=GLOBAL_BATCH)
    kwargs = {"dp_world_size": 2, "dp_rank": 1, "tokenizer": None, "local_batch_size": LOCAL_BATCH,
              "snapshot_every_n_steps": 10}
    with config.build(seq_len=64, **kwargs) as loader:
        assert loader.lanes == [4, 5, 6, 7]
        assert loader.gradient_accumulation_steps == GLOBAL_BATCH // (LOCAL_BATCH * 2)
        inputs, _ = next(iter(loader))
        assert set(inputs) == {"input", "positions"}
    with pytest.raises(ConfigurationError, match="seq_len=128 differs from the data recipe's max_length=64"):
        config.build(seq_len=128, **kwargs)


def test_config_build_refuses_a_seq_len_other_than_a_ready_pipelines_row_length(pipeline):
    """A Pipeline given as the recipe was built whatever training.seq_len said: the model then got
    rows of the pipeline's max_length, not the sequence length it was configured for."""
    config = ZephonDataLoader.Config(recipe=pipeline, global_batch_size=GLOBAL_BATCH)
    kwargs = {"dp_world_size": 2, "dp_rank": 0, "tokenizer": None, "local_batch_size": LOCAL_BATCH}
    with pytest.raises(ConfigurationError, match="seq_len=128 differs from the data recipe's max_length=64"):
        config.build(seq_len=128, **kwargs)
    with config.build(seq_len=64, **kwargs) as loader:
        assert next(iter(loader))[0]["input"].shape == (LOCAL_BATCH, 64)


@pytest.mark.parametrize("field", [{"dataset": "c4"}, {"dataset_path": "/data/c4"}])
def test_config_build_refuses_a_torchtitan_dataset_it_would_not_read(pipeline, field):
    """`--dataloader.dataset c4` (TorchTitan's own field, inherited by the Config) was ignored: the
    job trained on the recipe's datasets while its config said c4."""
    config = ZephonDataLoader.Config(recipe=pipeline, global_batch_size=GLOBAL_BATCH, **field)
    (name, value), = field.items()
    with pytest.raises(ConfigurationError, match=f"dataloader.{name}={value!r} is not read by ZephonDataLoader"):
        config.build(dp_world_size=2, dp_rank=0, tokenizer=None, local_batch_size=LOCAL_BATCH, seq_len=64)


def test_a_loader_built_on_rank_3_of_8_does_not_repeat_rank_0s_configuration_warnings(pipeline, monkeypatch, caplog):
    """Unknown build arguments and an unset global_batch_size are the job's configuration, the same
    on every rank: each of a thousand ranks warned, a thousand identical lines. Rank 0 warns once;
    the others say it at DEBUG only."""
    monkeypatch.delenv("RANK", raising=False)  # no launcher: the data-parallel rank decides
    config = ZephonDataLoader.Config(recipe=pipeline)
    warned = {}
    for dp_rank in (0, 3):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zephon.integrations.torchtitan"):
            config.build(dp_world_size=8, dp_rank=dp_rank, local_batch_size=LOCAL_BATCH, seq_len=64,
                         job_config=None).close()
        warned[dp_rank] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned[0]) == 2, warned[0]
    assert "ignores unknown build arguments ['job_config']" in warned[0][0]
    assert "global_batch_size is not set" in warned[0][1]
    assert warned[3] == []


def test_yields_input_positions_and_next_token_labels(pipeline):
    import torch

    with ZephonDataLoader(pipeline, 0, 2, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        inputs, labels = next(iter(loader))
    tokens, positions = inputs["input"], inputs["positions"]
    assert tokens.shape == positions.shape == labels.shape == (LOCAL_BATCH, 64)
    assert tokens.dtype == positions.dtype == labels.dtype == torch.int64
    same_document = positions[:, 1:] == positions[:, :-1] + 1
    assert torch.equal(labels[:, :-1][same_document], tokens[:, 1:][same_document])
    assert (labels[:, :-1][~same_document] == IGNORE_INDEX).all()
    rows = np.concatenate([b.tokens["input_ids"] for b in loader.last_microbatches])
    assert torch.equal(tokens, torch.from_numpy(rows).long())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_replicas_yield_the_uninterrupted_global_batches(make_pipeline, reference, world_size):
    digests, _ = titan_run(make_pipeline(), world_size, STEPS)
    assert digests == reference


@pytest.mark.parametrize("source,target", [(2, 4), (4, 1), (1, 8)])
def test_state_from_one_dp_size_resumes_on_another(make_pipeline, reference, source, target):
    before, states = titan_run(make_pipeline(), source, RESUME_AT)
    state = {STATE_KEY: json.dumps(merge_states(states))}  # what state_dict() gathers over a process group
    after, _ = titan_run(make_pipeline(), target, STEPS - RESUME_AT, state=state, first_step=RESUME_AT)
    assert before + after == reference


@pytest.mark.parametrize("form", ["merged_state", "json_text", "json_bytes"])
def test_a_merge_of_local_states_resumes_as_it_is_or_as_its_json(make_pipeline, reference, form):
    """A plain loop saves each replica's `local_state_dict()` and merges them with `merge_states`,
    as the docstrings say; `load_state_dict` refused that merge ('load what is under
    zephon_state') and failed on its JSON text with a bare AttributeError ('str' has no 'get'),
    so the resume needed `{STATE_KEY: json.dumps(merged)}`, written nowhere."""
    before, states = titan_run(make_pipeline(), 2, RESUME_AT)
    merged = merge_states(states)
    state = {"merged_state": merged, "json_text": json.dumps(merged), "json_bytes": json.dumps(merged).encode()}[form]
    after, _ = titan_run(make_pipeline(), 4, STEPS - RESUME_AT, state=state, first_step=RESUME_AT)
    assert before + after == reference


@pytest.mark.parametrize("state", [None, ["zephon_state"], 3])
def test_a_state_that_is_no_mapping_nor_json_is_refused_not_taken_for_nothing_saved(pipeline, state):
    """`load_state_dict(None)` (a checkpoint's missing key, `ckpt.get("dataloader")`) returned as
    if nothing had been saved: the run started again from its first batch, unsaid."""
    with ZephonDataLoader(pipeline, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        with pytest.raises(CheckpointError, match=f"not a loader state: got {type(state).__name__}"):
            loader.load_state_dict(state)


def test_a_save_partway_through_a_step_warns_once_that_the_trainers_global_batch_size_differs(pipeline, caplog):
    """TorchTitan's `training.global_batch_size` and the loader's are set apart and nothing compared
    them: with the trainer's smaller, its checkpoints fell partway through Zephon's steps, unsaid
    until a resume on another data-parallel size refused the state without naming the cause."""
    with ZephonDataLoader(pipeline, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        batches = iter(loader)
        for _ in range(loader.gradient_accumulation_steps):
            next(batches)
        with caplog.at_level(logging.WARNING, logger="zephon.integrations.torchtitan"):
            loader.state_dict()  # at a step's end, as TorchTitan saves with the sizes alike
            assert not caplog.records
            next(batches)
            loader.state_dict()
            loader.state_dict()
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert re.search(
        rf"partway through Zephon step 1 \({LOCAL_BATCH} of its {GLOBAL_BATCH} rows taken\).*"
        rf"global_batch_size={GLOBAL_BATCH}; set training.global_batch_size to it",
        caplog.records[0].getMessage(),
    )


def test_gather_state_refuses_a_zephon_data_loader_by_name(pipeline):
    """Given the TorchTitan wrapper instead of a rank's loader, gather_state says so: without a
    process group it used to hand the wrapper's own state back as if it were a merged one."""
    from zephon.distributed import gather_state

    with ZephonDataLoader(pipeline, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        with pytest.raises(ConfigurationError, match="got a ZephonDataLoader"):
            gather_state(loader)


def test_state_dict_without_a_process_group_is_the_local_state(pipeline):
    with ZephonDataLoader(pipeline, 1, 2, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        state = loader.state_dict()
        assert list(state) == [STATE_KEY]
        assert json.loads(state[STATE_KEY]) == loader.local_state_dict()
        assert sorted(map(int, loader.local_state_dict()["lanes"])) == [4, 5, 6, 7]


def test_a_replica_s_own_state_dict_is_warned_of_at_the_save_and_refused_on_another_dp_size_naming_the_way(
    make_pipeline, reference, caplog
):
    """Without a process group each replica's `state_dict()` holds its own lanes. Loaded on another
    data-parallel size, the refusal said to merge with `zephon.merge_states` or
    `zephon.distributed.gather_state`, which refuse a `state_dict()` and a ZephonDataLoader in
    turn: a second try before the one that works. It names this loader's ways now, the save warns
    of it, and the way it names resumes the uninterrupted run."""
    loaders = [ZephonDataLoader(make_pipeline(), r, 2, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) for r in range(2)]
    try:
        for loader in loaders:
            batches = iter(loader)
            for _ in range(RESUME_AT * loader.gradient_accumulation_steps):
                next(batches)
        with caplog.at_level(logging.WARNING, logger="zephon.integrations.torchtitan"):
            saved = [loader.state_dict() for loader in loaders]
            loaders[0].state_dict()
        locals_ = [loader.local_state_dict() for loader in loaders]
    finally:
        for loader in loaders:
            loader.close()
    assert [r.getMessage() for r in caplog.records] == [  # once, by replica 0, which speaks for the job
        "state_dict() of replica 0 of 2 holds its own lanes only (4 of 8): no torch.distributed process group is "
        "initialised to gather the others' over. To resume on another data-parallel size, initialise one before "
        "saving, or save every replica's local_state_dict() and load zephon.merge_states of them"
    ]
    with ZephonDataLoader(make_pipeline(), 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        with pytest.raises(CheckpointError, match=r"lacks lanes \[4, 5, 6, 7\] of this replica \(dp_rank 0 of 1\)"
                                                  r".*local_state_dict\(\) and give each replica zephon.merge_states"):
            loader.load_state_dict(saved[0])
    after, _ = titan_run(make_pipeline(), 1, STEPS - RESUME_AT, state=merge_states(locals_), first_step=RESUME_AT)
    assert after == reference[RESUME_AT:]


def test_pickling_a_zephon_data_loader_says_to_send_its_recipe_not_to_call_pipeline_shard(pipeline):
    """Pickled (a spawn or forkserver process), the loader failed with its rank loader's refusal,
    which says to call pipeline.shard(...) there: a loader a TorchTitan trainer cannot use."""
    import pickle

    with ZephonDataLoader(pipeline, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        with pytest.raises(ConfigurationError) as refused:
            pickle.dumps(loader)
    message = str(refused.value)
    assert "a ZephonDataLoader cannot be pickled" in message and "build a ZephonDataLoader" in message
    assert "pipeline.shard" not in message


def _local_batch_digests(loader, yields: int = 6) -> list[str]:
    """The digests of the microbatches of the next `yields` local batches."""
    out = []
    for _ in islice(loader, yields):
        out += [b.digest() for b in loader.last_microbatches]
    return out


def _check_the_interrupted_local_batch_comes_again(make_pipeline, reference, per_yield, then, mended=lambda: None):
    """Iterate until the Interrupt a test set up, which must come after the first local batch;
    then (once `mended` took the fault away) a new iteration, or a loader resumed from a
    checkpoint taken then, must go on from the interrupted local batch's first microbatch."""
    with ZephonDataLoader(make_pipeline(), 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        seen = []
        with pytest.raises(Interrupt):
            for _ in loader:
                seen += [b.digest() for b in loader.last_microbatches]
        assert seen == reference[:per_yield]
        mended()
        if then == "iterate_again":
            assert seen + _local_batch_digests(loader, 5) == reference
            return
        state = loader.state_dict()
    with ZephonDataLoader(make_pipeline(), 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        loader.load_state_dict(state)
        assert seen + _local_batch_digests(loader, 5) == reference


@pytest.mark.parametrize("then", ["checkpoint", "iterate_again"])
def test_an_interrupt_inside_a_local_batch_loses_none_of_its_microbatches(make_pipeline, monkeypatch, then):
    """A local batch of two microbatches interrupted while its second is taken: its first was taken
    from the rank loader but never yielded, so a checkpoint taken then (or a new iteration) must
    start again with it. It used to be counted as handed over, and was skipped on resume."""
    with ZephonDataLoader(make_pipeline(), 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        reference = _local_batch_digests(loader)
    per_yield = LOCAL_BATCH // loader.loader.microbatch_size
    assert per_yield == 2
    rows = {"taken": 0}
    original = _lane.LaneStream.next

    def next_row(stream):
        rows["taken"] += 1
        if rows["taken"] == LOCAL_BATCH + LOCAL_BATCH // 2 + 1:  # the second yield's second microbatch
            raise Interrupt
        return original(stream)

    monkeypatch.setattr(_lane.LaneStream, "next", next_row)
    _check_the_interrupted_local_batch_comes_again(
        make_pipeline, reference, per_yield, then, mended=lambda: monkeypatch.setattr(_lane.LaneStream, "next", original)
    )


@pytest.mark.parametrize("then", ["checkpoint", "iterate_again"])
def test_an_interrupt_while_a_local_batch_is_collated_loses_none_of_its_microbatches(make_pipeline, monkeypatch, then):
    """Every microbatch of the second local batch was taken from the rank loader, and the
    interrupt came while they were stacked into tensors: the local batch was never yielded, so a
    checkpoint taken then (or a new iteration) must start again with its first microbatch. They
    used to be counted as handed over already, and were skipped on resume."""
    with ZephonDataLoader(make_pipeline(), 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        reference = _local_batch_digests(loader)
    per_yield = LOCAL_BATCH // loader.loader.microbatch_size
    original, calls = ZephonDataLoader._collate, {"n": 0}

    def collate(self, group):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Interrupt
        return original(self, group)

    monkeypatch.setattr(ZephonDataLoader, "_collate", collate)
    _check_the_interrupted_local_batch_comes_again(make_pipeline, reference, per_yield, then)


def test_an_interrupt_between_a_local_batch_s_collate_and_its_yield_holds_no_lock_and_loses_none_of_it(
    make_pipeline, monkeypatch
):
    """Ctrl-C, or a preemption handler raising, lands at the next Python function called: here at
    any call between the second local batch's collate and its yield. The adapter took the local
    batch inside a generator context manager, whose `__exit__` is such a call: the interrupt there
    left the rank loader's lock held by the suspended generator, and the local batch counted as
    handed over, until the traceback was freed. A checkpoint taken in the trainer's handler then
    skipped the local batch, and a save on another thread (an asynchronous checkpointer) waited for
    the handler to end. Wherever it lands, or if no call is left for it to land on, the save taken
    then resumes with every local batch not yielded, and no other thread is held off."""
    with ZephonDataLoader(make_pipeline(), 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        reference = _local_batch_digests(loader)
    original, collated, armed = ZephonDataLoader._collate, {"n": 0}, {"on": False}

    def collate(self, group):
        batch = original(self, group)
        collated["n"] += 1
        armed["on"] = collated["n"] == 2
        return batch

    def interrupt_the_next_call(frame, event, arg):
        if event == "call" and armed["on"]:
            armed["on"] = False
            raise Interrupt
        return None

    def held_off_on_another_thread(rank_loader) -> bool:
        """Whether a save on another thread would wait: the rank loader's lock is held."""
        got = []

        def probe():
            got.append(rank_loader._moving.acquire(blocking=False))
            if got[0]:
                rank_loader._moving.release()

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        return not got[0]

    def checkpoint(loader) -> tuple[bool, dict]:
        sys.settrace(None)
        return held_off_on_another_thread(loader.loader), loader.state_dict()

    monkeypatch.setattr(ZephonDataLoader, "_collate", collate)
    with ZephonDataLoader(make_pipeline(), 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        per_yield, seen = LOCAL_BATCH // loader.loader.microbatch_size, []
        sys.settrace(interrupt_the_next_call)
        try:
            for _ in loader:
                armed["on"] = False  # the local batch was yielded: nothing left to interrupt
                seen += [b.digest() for b in loader.last_microbatches]
                if len(seen) == 2 * per_yield:
                    break
            held_off, state = checkpoint(loader)
        except Interrupt:  # a trainer's handler: it checkpoints with the exception alive
            held_off, state = checkpoint(loader)
        finally:
            sys.settrace(None)
    assert not held_off
    with ZephonDataLoader(make_pipeline(), 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        loader.load_state_dict(state)
        assert seen + _local_batch_digests(loader, 6 - len(seen) // per_yield) == reference


def test_a_checkpoint_after_an_interrupt_in_the_ragged_end_still_says_which_lanes_are_finished(
    corpora, demo_tokenizer_path, monkeypatch
):
    """In a finite epoch, a local batch interrupted after a lane has finished hands its
    microbatches back (see above); the checkpoint taken then must be the one of the local
    batches yielded. It used to forget that the lane was finished: the rank loader had not yet
    written it into the cursor it handed back, so the merged state looked saved partway through
    a step and was refused on 4 replicas, while the same checkpoint uninterrupted resumes there."""
    make = lambda: text_pipeline(*corpora, demo_tokenizer_path, num_epochs=1)
    world = 2
    states = []  # per replica: its local state after each local batch yielded
    for rank in range(world):
        with ZephonDataLoader(make(), rank, world, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
            states.append([loader.local_state_dict() for _ in loader])
    yields = min(
        k + 1 for per_rank in states for k, state in enumerate(per_rank)
        if state["finished"] and state["steps_begun"] is not None
    )
    original, rows = _lane.LaneStream.next, {"taken": None}

    def next_row(stream):
        if rows["taken"] is not None:
            rows["taken"] += 1
            if rows["taken"] == LOCAL_BATCH // 2 + 1:  # the next local batch's second microbatch
                raise Interrupt
        return original(stream)

    monkeypatch.setattr(_lane.LaneStream, "next", next_row)
    interrupted = []
    for rank in range(world):
        with ZephonDataLoader(make(), rank, world, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
            batches = iter(loader)
            rows["taken"] = None
            for _ in range(yields):
                next(batches)
            rows["taken"] = 0
            with pytest.raises(Interrupt):
                next(batches)
            interrupted.append(loader.local_state_dict())
    monkeypatch.setattr(_lane.LaneStream, "next", original)
    assert interrupted == [per_rank[yields - 1] for per_rank in states]
    merged = merge_states(interrupted)
    for target in (1, 4):
        for rank in range(target):
            with ZephonDataLoader(make(), rank, target, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
                loader.load_state_dict({STATE_KEY: json.dumps(merged)})


def test_stats_wait_counts_the_microbatches_behind_each_yield_and_stays_out_of_the_state(pipeline):
    with ZephonDataLoader(pipeline, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        list(islice(loader, 3))
        wait = loader.stats()["wait"]
        state = json.loads(loader.state_dict()[STATE_KEY])
    assert wait["batches"] == 3 * LOCAL_BATCH // loader.loader.microbatch_size
    assert wait["total_s"] >= wait["first_s"] > 0
    assert "wait" not in json.dumps(state)


def test_numpy_batch_sizes_give_plain_ints_to_the_trainer(pipeline):
    with ZephonDataLoader(pipeline, np.int64(0), np.int64(1), np.int64(GLOBAL_BATCH),
                          local_batch_size=np.int64(LOCAL_BATCH)) as loader:
        facts = (loader.global_batch_size, loader.local_batch_size, loader.gradient_accumulation_steps)
    assert all(type(value) is int for value in facts), [type(value) for value in facts]


def test_foreign_and_changed_states_are_refused(pipeline, corpora, demo_tokenizer_path):
    with ZephonDataLoader(pipeline, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        loader.load_state_dict({})  # TorchTitan's "nothing saved"
        with pytest.raises(CheckpointError, match="dp_rank_0"):
            loader.load_state_dict({"dp_rank_0": b"\x80\x04N.", "world_size": 1})
        other = text_pipeline(*corpora, demo_tokenizer_path, seed=7)
        with (
            ZephonDataLoader(other, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as changed,
            pytest.raises(RecipeMismatchError, match="operators"),
        ):
            loader.load_state_dict(changed.state_dict())


@pytest.mark.parametrize(
    "world,global_batch,local_batch,message",
    [
        (3, 32, None, "num_lanes=8 is not divisible by world_size=3"),
        (2, 36, 2, "global_batch_size=36 is not divisible by num_lanes=8"),
        (2, 24, 4, r"global_batch_size/num_lanes = 24/8 = 3 rows per lane per step is not divisible by microbatch_size=2"),
        (2, 32, 6, "local_batch_size=6 does not divide the 16 rows"),
        (2, 32, 1, "local_batch_size=1 is not a multiple of the recipe's microbatch_size=2"),
        (2, 32, "8", "local_batch_size must be an integer >= 1, got '8'"),
        (2, 32, 8.0, "local_batch_size must be an integer >= 1, got 8.0"),
        (2, 32.0, None, "global_batch_size must be an integer >= 1, got 32.0"),
    ],
)
def test_layout_errors_fail_at_construction_naming_the_numbers(pipeline, world, global_batch, local_batch, message):
    with pytest.raises(ConfigurationError, match=message):
        ZephonDataLoader(pipeline, 0, world, global_batch, local_batch_size=local_batch)


@pytest.mark.parametrize("mrope", [False, True], ids=["pixtral", "qwen_mrope"])
def test_a_multimodal_pipeline_is_refused_at_construction_not_stripped_of_its_images(corpora, demo_tokenizer_path, mrope):
    """TorchTitan's batch has no place for image patches: it yielded the placeholder tokens and
    dropped the pixels, with nothing raised or counted. With `mrope=True` the rows' (3, L)
    `mrope_position_ids` would go too, leaving the model the 1-D `positions` of a text row."""
    from vlm import DecodeImages, ImageSpec, PackMultimodal, PixtralPlaceholders, QwenPlaceholders

    if mrope:
        spec, placeholders = ImageSpec.qwen3_vl(min_pixels=64 * 64, max_pixels=128 * 128), QwenPlaceholders(3, 4, 5)
    else:
        spec, placeholders = ImageSpec(max_pixels=64 * 64), PixtralPlaceholders(3, 4, 5)
    pipeline = (Pipeline(StaticMixtureWorkSource([Dataset.from_path("pairs", str(corpora[0]))]))
                .apply(DecodeImages(spec=spec)).tokenize(str(demo_tokenizer_path), field="text")
                .apply(PackMultimodal(max_length=64, placeholders=placeholders, spec=spec, mrope=mrope)).batch(2))
    with pytest.raises(ConfigurationError, match="this pipeline packs with pack_multimodal"):
        ZephonDataLoader(pipeline, 0, 1, 16)


def test_a_data_recipe_mixing_learned_tokens_is_named_where_a_checkpoint_of_a_token_mixture_is_refused():
    """`mixture_count="learned"`: `TokenEstimation(count="learned")`, its measured rates in the
    recipe; named where a checkpoint of a mixture of every token is refused. Without
    `token_estimation` there is nothing to count by: refused."""
    settings = {**_RECIPE, "token_estimation": True}
    with ZephonDataLoader(DataRecipe(**settings), 0, 1, 16) as saved:
        state = saved.state_dict()
    learned = DataRecipe(**settings, mixture_count="learned")
    assert learned.pipeline().source.token_estimation.count == "learned"
    with ZephonDataLoader(learned, 0, 1, 16) as changed:
        with pytest.raises(RecipeMismatchError, match=re.escape("DataRecipe fields that changed: mixture_count.")):
            changed.load_state_dict(state)
    with pytest.raises(ConfigurationError, match="DataRecipe.mixture_count='learned' is measured by token_estimation"):
        DataRecipe(**_RECIPE, mixture_count="learned")


@pytest.mark.parametrize("mixture", [{"kjv": "much"}, {"kjv": None}, ["kjv"], 5])
def test_a_data_recipe_mixture_that_is_not_shares_by_name_is_refused_naming_the_field(mixture):
    """It raised float()'s or unpacking's bare TypeError / ValueError, naming neither the field
    nor the recipe."""
    with pytest.raises(ConfigurationError, match="DataRecipe.mixture must map dataset names to token shares"):
        DataRecipe(datasets=[("kjv", str(DATA / "kjv"))], tokenizer=str(TOKENIZER), mixture=mixture)


@pytest.mark.parametrize("num_epochs", [["kjv"], [("kjv", 1, 2)], ("kjv", 2)])
def test_a_data_recipe_num_epochs_that_is_neither_a_count_nor_counts_by_name_is_refused_naming_the_field(num_epochs):
    with pytest.raises(ConfigurationError, match="DataRecipe.num_epochs must be a count, or map dataset names to"):
        DataRecipe(datasets=[("kjv", str(DATA / "kjv"))], tokenizer=str(TOKENIZER), num_epochs=num_epochs)


def test_a_data_recipe_gives_each_dataset_the_passes_it_names():
    recipe = DataRecipe(**{**_RECIPE, "num_epochs": {"jargon": 1, "kjv": 2}})
    assert recipe.num_epochs == (("jargon", 1), ("kjv", 2)), "kept as pairs, like the mixture"
    assert recipe.pipeline().source.epochs_of("kjv") == 2 and recipe.pipeline().source.epochs_of("jargon") == 1


@pytest.mark.parametrize("flag", ["token_estimation", "cache"])
@pytest.mark.parametrize("value", ["no", "false", 0, None])
def test_a_data_recipe_switch_that_is_not_true_or_false_is_refused_naming_it(flag, value):
    """`token_estimation="no"` is true: the recipe planned by measured tokens, as with True, unsaid
    (tokenize refuses `keep_field="no"` for the same reason)."""
    with pytest.raises(ConfigurationError, match=re.escape(f"DataRecipe.{flag} must be True or False, got {value!r}")):
        DataRecipe(datasets=[("kjv", str(DATA / "kjv"))], tokenizer=str(TOKENIZER), **{flag: value})


def test_data_recipe_builds_the_same_stream_as_the_equivalent_pipeline():
    recipe = DataRecipe(
        datasets=[("kjv", str(DATA / "kjv")), ("jargon", str(DATA / "jargon"))], tokenizer=str(TOKENIZER),
        mixture={"kjv": 0.7, "jargon": 0.3}, eos="<|eos|>", max_length=128, shuffle_buffer=64, seed=42,
        num_lanes=8, microbatch_size=2, flush_every_chunks=8, records_per_chunk=16, runner="inline",
    )
    assert recipe.datasets == (("kjv", str(DATA / "kjv")), ("jargon", str(DATA / "jargon")))
    expected = demo_pipeline(runner="inline", max_length=128)
    with ZephonDataLoader(recipe, 0, 1, 16) as ours, expected.shard(0, 1, global_batch_size=16) as theirs:
        next(iter(ours))
        mine = ours.last_microbatches
        it = iter(theirs)
        assert [b.digest() for b in mine] == [next(it).digest() for _ in mine]


_RECIPE = dict(
    datasets=[("kjv", str(DATA / "kjv")), ("jargon", str(DATA / "jargon"))], tokenizer=str(TOKENIZER),
    mixture={"kjv": 0.7, "jargon": 0.3}, eos="<|eos|>", max_length=64, shuffle_buffer=8, seed=1, num_lanes=4,
    microbatch_size=2, records_per_chunk=16, token_estimation=False, runner="inline",
)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"mixture": {"kjv": 0.5, "jargon": 0.5}}, "mixture"),
        ({"seed": 2}, "seed"),
        ({"shuffle_buffer": 16}, "shuffle_buffer"),
        ({"text_field": "body"}, "text_field"),
        ({"packing": "first_fit"}, "packing"),
        ({"overlong": "truncate"}, "overlong"),
        ({"datasets": [("kjv", str(DATA / "kjv")), ("jargon", str(DATA / "jargon" / "jargon-0000[01]-*"))]}, "datasets"),
        ({"token_estimation": True}, "token_estimation (or the text it measured)"),
        ({"num_lanes": 8}, "num_lanes"),
        ({"num_epochs": {"kjv": 2, "jargon": 1}}, "num_epochs"),
        ({"global_batch_size": 32}, "global_batch_size (the loader's)"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_a_data_recipe_checkpoint_refused_by_another_recipe_names_the_data_recipe_field(change, field):
    """The refusal named the pipeline's recipe keys alone: a changed mixture was `plan.schedule`, a
    seed `operators[2].shuffle.seed, plan.seed`, settings a DataRecipe user never wrote."""
    settings = {**_RECIPE, "global_batch_size": 16}
    with ZephonDataLoader(DataRecipe(**{k: v for k, v in settings.items() if k != "global_batch_size"}), 0, 1,
                          settings["global_batch_size"]) as saved:
        state = saved.state_dict()
    settings.update(change)
    batch = settings.pop("global_batch_size")
    with ZephonDataLoader(DataRecipe(**settings), 0, 1, batch) as changed:
        with pytest.raises(RecipeMismatchError, match=re.escape(f"DataRecipe fields that changed: {field}.")):
            changed.load_state_dict(state)


def _first_local_batch_as(recipe: DataRecipe, expected: Pipeline, global_batch: int) -> tuple[list, dict]:
    """The microbatches of the recipe's first local batch on one replica, checked to be the
    equivalent pipeline's (digests compared), and the state saved after them."""
    with ZephonDataLoader(recipe, 0, 1, global_batch) as ours, \
            expected.shard(0, 1, global_batch_size=global_batch) as theirs:
        next(iter(ours))
        mine = ours.last_microbatches
        it = iter(theirs)
        assert [b.digest() for b in mine] == [next(it).digest() for _ in mine]
        return mine, ours.state_dict()


def test_a_chat_data_recipe_is_render_chat_then_segments_and_a_change_of_its_field_is_named(
    tmp_path, demo_tokenizer_path
):
    """`chat_field`: the chats rendered with the template beside the tokenizer (its
    tokenizer_config.json), the answers learned and the rest -100, the stream the equivalent
    pipeline gives; a checkpoint of it is refused by a recipe of another chat field, naming it."""
    from tests.unit.test_chat import CHATML, tokenizer_dir, write_chats

    directory = tokenizer_dir(tmp_path / "chatml", CHATML, demo_tokenizer_path)
    corpus = write_chats(tmp_path / "chats", 40)
    settings = dict(datasets=[("chats", str(corpus))], tokenizer=str(directory / "tokenizer.json"),
                    chat_field="messages", max_length=64, shuffle_buffer=4, seed=3, num_lanes=2, microbatch_size=2,
                    records_per_chunk=4, token_estimation=False, runner="inline")
    source = StaticMixtureWorkSource([Dataset.from_path("chats", str(corpus))], seed=3, records_per_chunk=4)
    expected = (Pipeline(source).options(num_lanes=2, runner="inline")
                .render_chat(directory, field="messages")
                .tokenize(str(directory / "tokenizer.json"), field="segments", segments=True)
                .pack_flat(64).shuffle(buffer_size=4, seed=3).batch(2))
    mine, state = _first_local_batch_as(DataRecipe(**settings), expected, 8)
    questions = sum(int((b.tokens["labels"][:, :-1] == -100).sum()) for b in mine)
    assert questions > sum(len(b.sources[0]) for b in mine), "the questions are -100, not only the documents' ends"
    retemplated = tokenizer_dir(tmp_path / "other", CHATML.replace("\n{% if", "\n\n{% if"), demo_tokenizer_path)
    for change, field in [({"chat_field": "chat"}, "chat_field"), ({"chat_field": None}, "chat_field"),
                          ({"tokenizer": str(retemplated / "tokenizer.json")}, "tokenizer")]:
        with ZephonDataLoader(DataRecipe(**{**settings, **change}), 0, 1, 8) as changed:
            with pytest.raises(RecipeMismatchError, match=re.escape(f"DataRecipe fields that changed: {field}.")):
                changed.load_state_dict(state)
    with pytest.raises(ConfigurationError, match="DataRecipe.chat_field must be a record field's name"):
        DataRecipe(**{**settings, "chat_field": ""})


def test_a_chat_data_recipe_writes_its_chat_today_and_a_change_of_it_is_named(tmp_path, demo_tokenizer_path):
    """A template that reads the clock writes `chat_today`; without one the recipe is refused as its
    pipeline is built, and a checkpoint is refused by a recipe of another day, naming the field."""
    from tests.unit.test_chat import CLOCK, tokenizer_dir, write_chats

    directory = tokenizer_dir(tmp_path / "clock", CLOCK, demo_tokenizer_path)
    settings = dict(datasets=[("chats", str(write_chats(tmp_path / "chats", 8)))],
                    tokenizer=str(directory / "tokenizer.json"), chat_field="messages", chat_today="2021-12-06",
                    max_length=64, num_lanes=2, records_per_chunk=4, token_estimation=False, runner="inline")
    with pytest.raises(ConfigurationError, match="reads today's date"):
        DataRecipe(**{**settings, "chat_today": None}).pipeline()
    with ZephonDataLoader(DataRecipe(**settings), 0, 1, 2) as ours:
        next(iter(ours))
        [ids] = ours.last_microbatches[0].tokens["input_ids"].tolist()
        state = ours.state_dict()
    assert "Today: 06 Dec 2021" in Tokenizer.from_file(str(directory / "tokenizer.json")).decode(ids)
    with ZephonDataLoader(DataRecipe(**{**settings, "chat_today": "2024-07-26"}), 0, 1, 2) as changed:
        with pytest.raises(RecipeMismatchError, match=re.escape("DataRecipe fields that changed: chat_today.")):
            changed.load_state_dict(state)


def test_a_chat_data_recipe_hands_the_template_its_switches_and_a_change_of_them_is_named(
    tmp_path, demo_tokenizer_path
):
    """`chat_template_kwargs`, given as a mapping and kept as pairs: the template writes what they
    switch on, and a checkpoint is refused by a recipe switched otherwise, naming the field."""
    from tests.unit.test_chat import SWITCHED, tokenizer_dir, write_chats

    directory = tokenizer_dir(tmp_path / "switched", SWITCHED, demo_tokenizer_path)
    settings = dict(datasets=[("chats", str(write_chats(tmp_path / "chats", 8)))],
                    tokenizer=str(directory / "tokenizer.json"), chat_field="messages",
                    chat_template_kwargs={"enable_thinking": False}, max_length=64, num_lanes=2, records_per_chunk=4,
                    token_estimation=False, runner="inline")
    recipe = DataRecipe(**settings)
    assert recipe.chat_template_kwargs == (("enable_thinking", False),) and hash(recipe)
    with ZephonDataLoader(recipe, 0, 1, 2) as ours:
        next(iter(ours))
        [ids] = ours.last_microbatches[0].tokens["input_ids"].tolist()
        state = ours.state_dict()
    assert "/no_think" in Tokenizer.from_file(str(directory / "tokenizer.json")).decode(ids)
    with ZephonDataLoader(DataRecipe(**{**settings, "chat_template_kwargs": None}), 0, 1, 2) as changed:
        refusal = re.escape("DataRecipe fields that changed: chat_template_kwargs.")
        with pytest.raises(RecipeMismatchError, match=refusal):
            changed.load_state_dict(state)


def test_a_chat_data_recipe_hands_the_template_each_record_s_own_fields_and_a_change_of_them_is_named(
    tmp_path, demo_tokenizer_path
):
    """`chat_tools_field`, `chat_documents_field`, `chat_template_kwargs_field` and
    `chat_template_name`: the stream the equivalent render_chat gives (a chat with tools rendered
    with the directory's `tool_use` template), and a checkpoint refused by a recipe that changes one
    of them, naming that one alone (not the tokenizer, whose `tool_use` template comes and goes
    with `chat_tools_field`). They are refused without `chat_field`."""
    from tests.unit.test_chat import CHATML, TOOL_CHAT, TOOLS, WEATHER, tokenizer_dir, with_template

    directory = tokenizer_dir(tmp_path / "named", "", demo_tokenizer_path)
    with_template(directory, [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOLS}])
    corpus = tmp_path / "chats"
    corpus.mkdir()
    (corpus / "chats.jsonl").write_text("".join(json.dumps(
        {"messages": TOOL_CHAT, "tools": WEATHER, "docs": [{"title": "t", "text": str(k)}], "switches": {}}) + "\n"
        for k in range(8)))
    settings = dict(datasets=[("chats", str(corpus))], tokenizer=str(directory / "tokenizer.json"),
                    chat_field="messages", chat_tools_field="tools", max_length=128, num_lanes=2, records_per_chunk=4,
                    token_estimation=False, runner="inline")
    source = StaticMixtureWorkSource([Dataset.from_path("chats", str(corpus))], seed=0, records_per_chunk=4)
    expected = (Pipeline(source).options(num_lanes=2, runner="inline")
                .render_chat(directory, field="messages", tools_field="tools")
                .tokenize(str(directory / "tokenizer.json"), field="segments", segments=True)
                .pack_flat(128).shuffle(buffer_size=1024, seed=0).batch(1))
    mine, state = _first_local_batch_as(DataRecipe(**settings), expected, 2)
    written = Tokenizer.from_file(str(directory / "tokenizer.json")).decode(mine[0].tokens["input_ids"][0].tolist())
    assert "Tools:" in written, "the chat with tools is rendered with the tool_use template"
    for change, field in [({"chat_tools_field": None}, "chat_tools_field"),
                          ({"chat_template_name": "tool_use"}, "chat_template_name"),
                          ({"chat_documents_field": "docs"}, "chat_documents_field"),
                          ({"chat_template_kwargs_field": "switches"}, "chat_template_kwargs_field")]:
        with ZephonDataLoader(DataRecipe(**{**settings, **change}), 0, 1, 2) as changed:
            with pytest.raises(RecipeMismatchError, match=re.escape(f"DataRecipe fields that changed: {field}.")):
                changed.load_state_dict(state)
    with pytest.raises(ConfigurationError, match="DataRecipe.chat_tools_field is for chats: give chat_field"):
        DataRecipe(**{**settings, "chat_field": None})
    with pytest.raises(ConfigurationError, match="DataRecipe.chat_documents_field must be a record field's name"):
        DataRecipe(**{**settings, "chat_documents_field": ""})


def test_a_chat_data_recipe_reads_sharegpt_chats_by_their_keys_and_roles_and_a_change_of_them_is_named(
    tmp_path, demo_tokenizer_path
):
    """`chat_keys` and `chat_roles` (a mapping, kept as pairs) read ShareGPT's `{"from", "value"}`
    chats as the chats they are: the stream of the same chats stored as `{"role", "content"}`.
    A checkpoint is refused by a recipe changing them, `chat_learned_roles` or `chat_on_rewrite`,
    naming that field; `chat_keys` that are no pair of keys are refused by name."""
    from tests.unit.test_chat import CHATML, tokenizer_dir

    chatml = tokenizer_dir(tmp_path / "chatml", CHATML, demo_tokenizer_path)
    chats = [[{"role": "user", "content": f"Question {k}?"}, {"role": "assistant", "content": f"Answer {k}."}]
             for k in range(8)]
    names = {"user": "human", "assistant": "gpt"}
    for name, records in [("openai", [{"messages": chat} for chat in chats]),
                          ("sharegpt", [{"conversations": [{"from": names[m["role"]], "value": m["content"]}
                                                           for m in chat]} for chat in chats])]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "chats.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    common = dict(tokenizer=str(chatml / "tokenizer.json"), max_length=64, num_lanes=2, records_per_chunk=4,
                  token_estimation=False, runner="inline")
    settings = dict(datasets=[("chats", str(tmp_path / "sharegpt"))], chat_field="conversations",
                    chat_keys=["from", "value"], chat_roles={"human": "user", "gpt": "assistant"}, **common)
    recipe = DataRecipe(**settings)
    assert recipe.chat_keys == ("from", "value") and recipe.chat_roles == (("human", "user"), ("gpt", "assistant"))
    assert hash(recipe)
    plain = DataRecipe(datasets=[("chats", str(tmp_path / "openai"))], chat_field="messages", **common)
    with ZephonDataLoader(recipe, 0, 1, 2) as ours, ZephonDataLoader(plain, 0, 1, 2) as theirs:
        for _ in range(3):
            next(iter(ours)), next(iter(theirs))
            assert [b.digest() for b in ours.last_microbatches] == [b.digest() for b in theirs.last_microbatches]
        state = ours.state_dict()
    for change, field in [({"chat_keys": ("from", "text")}, "chat_keys"),
                          ({"chat_roles": {"human": "user", "gpt": "assistant", "system": "system"}}, "chat_roles"),
                          ({"chat_learned_roles": ["assistant", "user"]}, "chat_learned_roles"),
                          ({"chat_on_rewrite": "learn_last"}, "chat_on_rewrite")]:
        with ZephonDataLoader(DataRecipe(**{**settings, **change}), 0, 1, 2) as changed:
            with pytest.raises(RecipeMismatchError, match=re.escape(f"DataRecipe fields that changed: {field}.")):
                changed.load_state_dict(state)
    for keys in ("from", ("from",), ("from", "")):
        with pytest.raises(ConfigurationError, match=r"DataRecipe.chat_keys must be the messages' \(role key, content"):
            DataRecipe(**{**settings, "chat_keys": keys})
    with pytest.raises(ConfigurationError, match="DataRecipe.chat_roles is for chats: give chat_field"):
        DataRecipe(**{**settings, "chat_field": None, "chat_keys": None})


def test_a_data_recipe_mixing_text_and_chats_tokenizes_each_its_way_and_a_change_of_chat_datasets_is_named(
    tmp_path, demo_tokenizer_path
):
    """`chat_datasets`: the chats rendered and learned on their answers, the other datasets' texts
    learned whole, the stream of the equivalent scoped pipeline; a checkpoint is refused by a recipe
    that renders every dataset as chats, naming `chat_datasets` alone. Names no dataset of the
    recipe holds are refused."""
    from tests.unit.test_chat import CHATML, tokenizer_dir, write_chats

    directory = tokenizer_dir(tmp_path / "chatml", CHATML, demo_tokenizer_path)
    chats, web = write_chats(tmp_path / "chats", 16), tmp_path / "web"
    web.mkdir()
    lines = [json.dumps({"body": f"Lane {k} reads shard {k}."}) for k in range(16)]
    (web / "web.jsonl").write_text("".join(line + "\n" for line in lines))
    tokenizer = str(directory / "tokenizer.json")
    settings = dict(datasets=[("chats", str(chats)), ("web", str(web))], tokenizer=tokenizer, text_field="body",
                    chat_field="messages", chat_datasets=["chats"], eos="<|eos|>", max_length=64, num_lanes=2,
                    records_per_chunk=4, token_estimation=False, runner="inline")
    recipe = DataRecipe(**settings)
    assert recipe.chat_datasets == ("chats",)
    source = StaticMixtureWorkSource([Dataset.from_path("chats", str(chats)), Dataset.from_path("web", str(web))],
                                     seed=0, records_per_chunk=4)
    expected = (Pipeline(source).options(num_lanes=2, runner="inline")
                .render_chat(directory, field="messages", datasets="chats")
                .tokenize(tokenizer, field="segments", segments=True, eos="<|eos|>", datasets="chats")
                .tokenize(tokenizer, field="body", eos="<|eos|>", datasets="web")
                .pack_flat(64).shuffle(buffer_size=1024, seed=0).batch(1))
    with ZephonDataLoader(recipe, 0, 1, 2) as ours, expected.shard(0, 1, global_batch_size=2) as theirs:
        it = iter(theirs)
        for _ in range(4):
            next(iter(ours))
            assert [b.digest() for b in ours.last_microbatches] == [next(it).digest() for _ in ours.last_microbatches]
        assert {name: counts["total"]["skipped"] for name, counts in ours.stats()["datasets"].items()} == {
            "chats": {}, "web": {}}
        state = ours.state_dict()
    for change in ({"chat_datasets": None}, {"chat_datasets": ["chats", "web"]}):
        with ZephonDataLoader(DataRecipe(**{**settings, **change}), 0, 1, 2) as changed:
            with pytest.raises(RecipeMismatchError, match=re.escape("DataRecipe fields that changed: chat_datasets.")):
                changed.load_state_dict(state)
    with pytest.raises(ConfigurationError, match=r"DataRecipe.chat_datasets names \['chat'\], no dataset of the "
                                                 r"recipe's \['chats', 'web'\]"):
        DataRecipe(**{**settings, "chat_datasets": "chat"})
    with pytest.raises(ConfigurationError, match="DataRecipe.chat_datasets is for chats: give chat_field"):
        DataRecipe(**{**settings, "chat_field": None})


def test_a_data_recipe_of_prompt_completion_records_learns_the_completions_and_a_change_of_prompt_field_is_named(
    tmp_path, demo_tokenizer_path
):
    """`prompt_field`: TRL's prompt-completion records, the stream of `tokenize(prompt_field=...)`,
    each prompt's ids labelled -100; a checkpoint is refused by a recipe without it, naming it. With
    chat_field and no chat_datasets no record is text: refused."""
    corpus = tmp_path / "qa"
    corpus.mkdir()
    lines = [json.dumps({"prompt": f"Which lane reads shard {k}? ", "completion": f"Lane {k % 4}."}) for k in range(16)]
    (corpus / "qa.jsonl").write_text("".join(line + "\n" for line in lines))
    tokenizer = str(demo_tokenizer_path)
    settings = dict(datasets=[("qa", str(corpus))], tokenizer=tokenizer, text_field="completion",
                    prompt_field="prompt", eos="<|eos|>", max_length=64, packing="first_fit", num_lanes=2,
                    records_per_chunk=4, token_estimation=False, runner="inline")
    source = StaticMixtureWorkSource([Dataset.from_path("qa", str(corpus))], seed=0, records_per_chunk=4)
    expected = (Pipeline(source).options(num_lanes=2, runner="inline")
                .tokenize(tokenizer, field="completion", prompt_field="prompt", eos="<|eos|>")
                .pack_flat(64, algorithm="first_fit").shuffle(buffer_size=1024, seed=0).batch(1))
    mine, state = _first_local_batch_as(DataRecipe(**settings), expected, 2)
    labels, documents = mine[0].tokens["labels"][0], mine[0].tokens["document_ids"][0]
    assert (labels[documents >= 0] == -100).sum() > 2 * (documents.max() + 1), "the prompts are not learned"
    with ZephonDataLoader(DataRecipe(**{**settings, "prompt_field": None}), 0, 1, 2) as changed:
        with pytest.raises(RecipeMismatchError, match=re.escape("DataRecipe fields that changed: prompt_field.")):
            changed.load_state_dict(state)
    with pytest.raises(ConfigurationError, match="DataRecipe.prompt_field is for the records of text_field"):
        DataRecipe(**{**settings, "chat_field": "messages"})


def test_a_config_naming_a_changed_setting_in_accept_changes_resumes_the_checkpoint_with_it(caplog):
    """The trainer calls load_state_dict(state) alone: a deliberate change is named in the loader's
    config, and the loader resumes the checkpoint's cursors with the new recipe, as the rank
    loader given the same keys does. Unnamed, it is refused saying where to name it."""
    with ZephonDataLoader(DataRecipe(**_RECIPE), 0, 1, 16) as saved:
        next(iter(saved))
        state = saved.state_dict()
    changed = DataRecipe(**{**_RECIPE, "shuffle_buffer": 16})
    build = {"dp_world_size": 1, "dp_rank": 0, "local_batch_size": 8, "seq_len": 64}
    with ZephonDataLoader.Config(recipe=changed, global_batch_size=16).build(**build) as refused:
        with pytest.raises(RecipeMismatchError, match=re.escape("(ZephonDataLoader: accept_changes=)")):
            refused.load_state_dict(state)
    key = "operators[2].shuffle.buffer_size"
    config = ZephonDataLoader.Config(recipe=changed, global_batch_size=16, accept_changes=(key,))
    with caplog.at_level(logging.WARNING, logger="zephon"), config.build(**build) as loader:
        loader.load_state_dict(state)
        assert loader.local_state_dict()["lanes"] == json.loads(state[STATE_KEY])["lanes"]
        first = next(iter(loader))[0]["input"]
    assert f"accepting the changes named in accept_changes: {key}." in caplog.text
    pipeline = changed.pipeline()
    with pipeline.shard(0, 1, global_batch_size=16) as rank_loader:
        rank_loader.load_state_dict(json.loads(state[STATE_KEY]), accept_changes=[key])
        expected = next(iter(rank_loader)).tokens["input_ids"]
    assert first[: len(expected)].tolist() == expected.tolist()


def test_a_data_recipe_refusal_names_token_estimation_switched_beside_a_field_its_rate_does_not_read():
    """The measured rate's key changed beside any other field was put down to that field: with
    token_estimation and shuffle_buffer changed, the refusal named shuffle_buffer alone, and the
    run fixed as it said was refused again. Only datasets, tokenizer, text_field, bos and eos
    change what the estimate measures."""
    settings = {**_RECIPE, "token_estimation": True}
    with ZephonDataLoader(DataRecipe(**settings), 0, 1, 16) as saved:
        state = saved.state_dict()
    changed = {**settings, "token_estimation": False, "shuffle_buffer": 16}
    with ZephonDataLoader(DataRecipe(**changed), 0, 1, 16) as loader:
        with pytest.raises(RecipeMismatchError, match=re.escape(
            "DataRecipe fields that changed: shuffle_buffer, token_estimation (or the text it measured).")):
            loader.load_state_dict(state)


def test_a_pipeline_checkpoint_refused_by_another_recipe_names_no_data_recipe_field(pipeline, corpora, demo_tokenizer_path):
    with ZephonDataLoader(pipeline, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as loader:
        state = loader.state_dict()
    other = text_pipeline(*corpora, demo_tokenizer_path, seed=7)
    with ZephonDataLoader(other, 0, 1, GLOBAL_BATCH, local_batch_size=LOCAL_BATCH) as changed:
        with pytest.raises(RecipeMismatchError) as refusal:
            changed.load_state_dict(state)
    assert "DataRecipe" not in str(refusal.value)
    assert {"operators[2].shuffle.seed", "plan.seed"} <= set(refusal.value.changed)  # the keys, for other front ends


@pytest.fixture
def stored_recipe():
    """DataRecipe settings over the demo's Jargon shards copied to an object store that counts the
    opens it is asked for, and a count of those opens."""
    with registered(CountingStore):
        urls = [put(f"countstore://bucket/jargon/{path.name}", path.read_bytes())
                for path in sorted((DATA / "jargon").glob("*.jsonl"))]
        settings = dict(datasets=[("jargon", "countstore://bucket/jargon")], tokenizer=str(TOKENIZER),
                        eos="<|eos|>", max_length=128, shuffle_buffer=16, num_lanes=4, microbatch_size=2,
                        records_per_chunk=16, runner="inline")
        yield settings, lambda: CountingStore.asked_of("open", urls), len(urls)


def test_a_data_recipe_built_again_on_its_scan_cache_reads_no_shard_to_plan(stored_recipe, tmp_path):
    """`scan_cache` was no DataRecipe field: every rank of a TorchTitan job, at every start, read
    every shard through to count its records."""
    settings, opens, num_shards = stored_recipe
    recipe = DataRecipe(**settings, scan_cache=str(tmp_path / "scans"))
    for expected in (num_shards, 0):  # the first build scans each shard, the second none
        before = opens()
        recipe.pipeline()
        assert opens() - before == expected


def test_a_data_recipe_scan_cache_changes_no_batch_and_may_be_switched_on_at_a_resume(stored_recipe, tmp_path):
    settings, _, _ = stored_recipe
    plain = DataRecipe(**settings)
    cached = DataRecipe(**settings, scan_cache=str(tmp_path / "scans"))
    cached.pipeline()  # warm: the loader below plans from kept scans
    with ZephonDataLoader(plain, 0, 1, 16) as without, ZephonDataLoader(cached, 0, 1, 16) as with_cache:
        uninterrupted = _local_batch_digests(without, 4)
        assert _local_batch_digests(with_cache, 4) == uninterrupted
    with ZephonDataLoader(plain, 0, 1, 16) as before, ZephonDataLoader(cached, 0, 1, 16) as after:
        first_half = _local_batch_digests(before, 2)
        after.load_state_dict(before.state_dict())
        assert first_half + _local_batch_digests(after, 2) == uninterrupted


def test_a_data_recipe_with_seekable_copies_reads_its_shards_in_one_stream_from_them_alone(tmp_path):
    """The shipped KJV shards, each one zstd stream, on an object store: planning reads each once,
    writing its copy, and no chunk read opens one; the batches are those read from the shards."""
    with registered(CountingStore):
        urls = [put(f"countstore://bucket/kjv/{path.name}", path.read_bytes())
                for path in sorted((DATA / "kjv").glob("*.jsonl.zst"))]
        settings = dict(datasets=[("kjv", "countstore://bucket/kjv")], tokenizer=str(TOKENIZER), eos="<|eos|>",
                        max_length=128, shuffle_buffer=16, num_lanes=4, microbatch_size=2, records_per_chunk=16,
                        runner="inline")
        with ZephonDataLoader(DataRecipe(**settings), 0, 1, 16) as plain:
            expected = _local_batch_digests(plain, 4)
        before = CountingStore.asked_of("open", urls)
        copied = DataRecipe(**settings, scan_cache=str(tmp_path / "scans"), seekable_copies=True)
        with ZephonDataLoader(copied, 0, 1, 16) as loader:
            assert _local_batch_digests(loader, 4) == expected
        assert CountingStore.asked_of("open", urls) - before == len(urls)


def test_torchrun_checkpoint_on_two_ranks_resumes_on_four(corpora, demo_tokenizer_path, reference, tmp_path):
    """Real processes, gloo, a real distributed checkpoint of the `dataloader` state (through
    TorchTitan's CheckpointManager where torchtitan imports)."""
    args = ["--mode", "titan", "--corpus-a", str(corpora[0]), "--corpus-b", str(corpora[1]),
            "--tokenizer", str(demo_tokenizer_path), "--local-batch-size", str(LOCAL_BATCH)]
    folder = tmp_path / "checkpoint"
    before = launch(2, tmp_path / "before.json", *args, "--steps", str(RESUME_AT), "--save", str(folder))
    after = launch(4, tmp_path / "after.json", *args, "--load", str(folder),
                   "--first-step", str(RESUME_AT), "--steps", str(STEPS - RESUME_AT))
    from tests.conftest import torchtitan_available

    expected = (
        "torchtitan.components.checkpoint.CheckpointManager" if torchtitan_available() else "torch.distributed.checkpoint"
    )
    assert before["runtime"]["checkpointer"] == after["runtime"]["checkpointer"] == expected
    digests = {**before["digests"], **after["digests"]}
    assert [digests[str(s)] for s in range(STEPS)] == reference
