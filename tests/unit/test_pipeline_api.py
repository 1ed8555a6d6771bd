"""The Pipeline API: the SPEC §2 program shape, misconfiguration errors, training tensors."""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from runners import ThreadRunner
from tests.harness import RowsHandedOnAs
from zephon import Batch, ConfigurationError, IGNORE_INDEX, PackedSequence, Pipeline, PADDING_DOCUMENT, global_batch_digest
from zephon._record_ops import RecordOperator
from zephon.io import Dataset
from zephon.work import ScheduledMixtureWorkSource, StaticMixtureWorkSource, TokenEstimation


@pytest.fixture
def spec_pipeline(demo_data_dir, demo_tokenizer_path):
    """The exact program shape of SPEC §2, on local data and the shipped tokenizer."""
    source = StaticMixtureWorkSource(
        datasets=[
            Dataset.from_path("wiki", str(demo_data_dir / "kjv")),
            Dataset.from_path("news", str(demo_data_dir / "jargon")),
        ],
        mixture={"wiki": 0.5, "news": 0.5},
        token_estimation=TokenEstimation(),
        seed=42,
    )
    return (
        Pipeline(source)
        .options(io_options={"cache": {"enabled": True}})
        .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text", parallelism=4)
        .pack_flat(max_length=256, algorithm="wrap")
        .shuffle(buffer_size=16, seed=42)
        .batch(microbatch_size=8)
    )


def test_the_spec_program_shape_runs_and_yields_full_rows(spec_pipeline):
    seen = 0
    for batch in spec_pipeline:
        assert batch.tokens["input_ids"].shape == (8, 256)
        assert batch.tokens["input_ids"].dtype == np.int32
        seen += 1
        if seen == 10:
            break
    assert seen == 10


@pytest.mark.requires_torch
def test_to_training_gives_the_tensors_a_training_step_consumes(spec_pipeline):
    import torch

    batch = next(iter(spec_pipeline))
    tensors = batch.to_training()
    assert set(tensors) >= {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(isinstance(t, torch.Tensor) and t.shape == (8, 256) for t in tensors.values())
    assert tensors["input_ids"].dtype == torch.int64
    np.testing.assert_array_equal(tensors["labels"].numpy(), batch.tokens["labels"])


def test_to_training_without_torch_names_the_extra_that_brings_it(spec_pipeline, monkeypatch):
    batch = next(iter(spec_pipeline))
    monkeypatch.setitem(sys.modules, "torch", None)  # what an environment without torch gives
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'zephon[torch]'")):
        batch.to_training()


def test_position_ids_restart_per_document_and_labels_are_masked_at_padding(spec_pipeline):
    batch = next(iter(spec_pipeline))
    docs, positions, labels = (batch.tokens[k] for k in ("document_ids", "position_ids", "labels"))
    starts = np.ones_like(docs, dtype=bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    assert (positions[starts & (docs != PADDING_DOCUMENT)] == 0).all()
    assert (labels[docs == PADDING_DOCUMENT] == IGNORE_INDEX).all()


@pytest.mark.parametrize("algorithm", ["wrap", "first_fit"])
def test_the_rows_padding_a_finished_lanes_microbatch_use_the_packers_pad_id(tmp_path, demo_tokenizer_path, algorithm):
    """The padding rows after a finite plan ran out used the tokenizer's pad id (2 here) whatever
    `pack_flat(pad_id=...)` said, so one batch held two pad ids."""
    (tmp_path / "a.jsonl").write_text("".join(f'{{"text": "hello world {i}"}}\n' for i in range(3)))
    source = StaticMixtureWorkSource([Dataset.from_path("a", str(tmp_path))], num_epochs=1, records_per_chunk=1)
    pipeline = (
        Pipeline(source).options(num_lanes=1, runner="inline")
        .tokenize(tokenizer_id=str(demo_tokenizer_path), eos="<|eos|>")
        .pack_flat(max_length=8, algorithm=algorithm, pad_id=7)
        .batch(microbatch_size=4)
    )
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        (batch,) = list(loader)
    ids, docs = batch.tokens["input_ids"], batch.tokens["document_ids"]
    assert (docs == PADDING_DOCUMENT).all(axis=1).any(), "the plan should end inside the microbatch"
    assert set(ids[docs == PADDING_DOCUMENT].tolist()) == {7}


@pytest.mark.parametrize(
    "lanes,world,global_batch,micro,message",
    [
        (8, 3, 16, 2, "num_lanes=8 is not divisible by world_size=3"),
        (8, 2, 12, 2, "global_batch_size=12 is not divisible by num_lanes=8"),
        (8, 2, 24, 2, "= 3 rows per lane per step is not divisible by microbatch_size=2"),
        (8, 2, 0, 2, "global_batch_size must be an integer >= 1, got 0"),
        (8, 2, -16, 2, "global_batch_size must be an integer >= 1, got -16"),
        (8, 2, 16.0, 2, "global_batch_size must be an integer >= 1, got 16.0"),
        (8, 0, 16, 2, "world_size must be an integer >= 1, got 0"),
        (8, 2, 16, 2, None),
    ],
)
def test_misconfigured_layouts_fail_at_construction_naming_the_numbers(
    spec_pipeline, lanes, world, global_batch, micro, message
):
    pipeline = spec_pipeline.options(num_lanes=lanes)
    pipeline = Pipeline(pipeline.source, operators=pipeline.operators[:-1], options=pipeline.settings).batch(micro)
    if message is None:
        pipeline.shard(1, world, global_batch_size=global_batch).close()
        return
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace("=", "=")):
        pipeline.shard(0, world, global_batch_size=global_batch)


@pytest.mark.parametrize("rank,world", [(-1, 2), (2, 2), ("0", 2), (True, 2), (0.0, 2)])
def test_a_rank_outside_the_world_or_not_an_integer_is_refused(spec_pipeline, rank, world):
    with pytest.raises(ConfigurationError, match="rank"):
        spec_pipeline.shard(rank, world)


@pytest.mark.parametrize("rank,world", [(None, 2), (1, None)])
def test_rank_and_world_size_come_together_without_a_process_group(spec_pipeline, rank, world):
    """A world size alone would make every process rank 0, all reading the same lanes."""
    with pytest.raises(ConfigurationError, match="give both, or neither"):
        spec_pipeline.shard(rank, world)


def test_numpy_integers_for_the_layout_give_plain_ints_in_the_state(spec_pipeline):
    import json

    with spec_pipeline.options(num_lanes=2).shard(np.int64(0), np.int64(2), global_batch_size=np.int64(16)) as loader:
        next(iter(loader))
        assert (loader.rank, loader.world_size, loader.global_batch_size) == (0, 2, 16)
        json.dumps(loader.state_dict())


def test_bad_options_and_operator_order_are_rejected_immediately(spec_pipeline, demo_tokenizer_path):
    with pytest.raises(ConfigurationError, match="unknown pipeline options"):
        spec_pipeline.options(num_lane=8)
    with pytest.raises(ConfigurationError, match=r"cannot add shuffle after batch: .* add shuffle before \.batch"):
        spec_pipeline.shuffle(4)
    with pytest.raises(ConfigurationError, match="parallelism must be an integer >= 1"):
        Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path), parallelism=0)
    with pytest.raises(ConfigurationError, match="not in the vocabulary"):
        Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path), eos="<|nope|>")
    with pytest.raises(ConfigurationError, match="packing operator"):
        Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path)).batch(2).shard(0, 1)
    tokenized = Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path))
    with pytest.raises(ConfigurationError, match=r"pack_flat\(field='ids'\) packs a field no operator writes"):
        tokenized.pack_flat(64, field="ids").batch(2).shard(0, 1)
    with pytest.raises(ConfigurationError, match="one packing operator per pipeline"):
        tokenized.pack_flat(64).pack_flat(32).batch(2).shard(0, 1)
    for unbatched in (tokenized.pack_flat(64), tokenized.pack_flat(64).shuffle(4)):
        with pytest.raises(ConfigurationError, match=re.escape("the pipeline must end with .batch(microbatch_size)")):
            unbatched.shard(0, 1)
        with pytest.raises(ConfigurationError, match=re.escape("the pipeline must end with .batch(microbatch_size)")):
            unbatched.shard(0, 1, global_batch_size=16)
    with pytest.raises(ConfigurationError, match="is neither a record nor an accumulator operator"):
        tokenized.apply(object())


@pytest.mark.parametrize("runner,message", [("bogus", "unknown runner 'bogus'"), (None, "neither a runner's name"),
                                            (3, "neither a runner's name")])
def test_a_runner_that_is_not_one_is_refused_naming_it_before_any_data_is_read(spec_pipeline, runner, message,
                                                                               monkeypatch):
    reads = []
    read_chunk = Dataset.read_chunk

    def counted_read(self, *args, **kwargs):
        reads.append(args[0])
        return read_chunk(self, *args, **kwargs)

    monkeypatch.setattr(Dataset, "read_chunk", counted_read)
    with pytest.raises(ConfigurationError, match=message):
        spec_pipeline.options(runner=runner, num_lanes=2).shard(0, 1, global_batch_size=16)
    assert reads == []
    with spec_pipeline.options(runner="inline", num_lanes=2).shard(0, 1, global_batch_size=16):
        assert reads, "the token estimate reads chunks while shard() builds a loader, so the check above can fail"


def test_a_loader_looks_its_runner_up_among_the_entry_points_once(spec_pipeline, monkeypatch):
    """Reading the installed packages' entry points costs milliseconds; the check before any read
    and the start at the first batch share one lookup."""
    import zephon._runner

    lookups = []
    find = zephon._runner.find
    monkeypatch.setattr(zephon._runner, "find", lambda *args: lookups.append(1) or find(*args))
    with spec_pipeline.options(runner="thread", num_lanes=2).shard(0, 1, global_batch_size=16) as loader:
        next(iter(loader))
    assert len(lookups) == 1


def test_builder_methods_and_runners_of_other_packages_read_the_installed_entry_points_once(spec_pipeline, monkeypatch):
    """Each read walks every installed package's metadata (10-20 ms on 3.14t): a VLM pipeline read
    them for `decode_images`, for `pack_multimodal` and for its runner before its first batch."""
    import importlib.metadata

    import zephon._entry_points

    reads = []
    distributions = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: reads.append(1) or distributions(**kw))
    zephon._entry_points._installed.cache_clear()
    spec_pipeline.decode_images, spec_pipeline.pack_multimodal  # noqa: B018 - contributed by vlm
    with spec_pipeline.options(runner="thread", num_lanes=2).shard(0, 1, global_batch_size=16):
        pass
    assert len(reads) == 1


def test_a_name_no_package_registers_is_missed_without_reading_the_entry_points_again(spec_pipeline, monkeypatch):
    """A miss read every installed package's metadata again (about 10 ms), in case one had been
    installed since: `hasattr(pipeline, "keys")`, as libraries probe objects, paid it each time.
    With nothing installed since the last read, a miss reads nothing."""
    import importlib.metadata

    import zephon._entry_points

    zephon._entry_points.registered("zephon.pipeline")
    reads = []
    distributions = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: reads.append(1) or distributions(**kw))
    for _ in range(3):
        assert not hasattr(spec_pipeline, "keys")
    assert reads == []


def _install_after_the_entry_points_were_read(tmp_path, monkeypatch, group: str, name: str, value: str) -> None:
    """A distribution registering `name` in `group`, put on sys.path once this process has read
    the installed entry points, as `pip install` in a running notebook does."""
    import zephon._entry_points

    zephon._entry_points.registered(group)
    dist_info = tmp_path / "zephon_late_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: zephon-late-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def entry_points_read_anew_after():
    """The next test reads the entry points installed then, not the late plugin's."""
    import zephon._entry_points

    yield
    zephon._entry_points._installed.cache_clear()


def test_a_runner_of_a_package_installed_after_the_entry_points_were_read_is_found(
    tmp_path, monkeypatch, entry_points_read_anew_after
):
    """Reading the entry points once per process (f9322d4) kept the first read for good: a runner
    installed later was an "unknown runner", its package installed."""
    from zephon import make_runner

    _install_after_the_entry_points_were_read(tmp_path, monkeypatch, "zephon.runners", "late", "runners.inline:InlineRunner")
    runner = make_runner("late")
    runner.close()
    assert type(runner).__name__ == "InlineRunner"


def test_a_builder_method_of_a_package_installed_after_the_entry_points_were_read_is_found(
    spec_pipeline, tmp_path, monkeypatch, entry_points_read_anew_after
):
    """As for runners: `Pipeline` has no operator named by a package installed after the read."""
    _install_after_the_entry_points_were_read(
        tmp_path, monkeypatch, "zephon.pipeline", "late_options", "zephon._pipeline:Pipeline.options"
    )
    assert isinstance(spec_pipeline.late_options(num_lanes=2), Pipeline)


@pytest.mark.parametrize("name", ["state_dict", "load_state_dict", "stats", "close", "runner_info"])
def test_a_loaders_method_asked_of_the_pipeline_points_to_the_loader(spec_pipeline, name):
    """`pipeline.state_dict()` (a checkpoint taken from the recipe, not from the rank's loader)
    said "Pipeline has no operator 'state_dict'", as if an operator were missing, and never where
    the method is."""
    said = rf"a Pipeline is the recipe: {name} is its loader's, loader = pipeline\.shard\(\.\.\.\)"
    with pytest.raises(AttributeError, match=said):
        getattr(spec_pipeline, name)
    assert not hasattr(spec_pipeline, name), "hasattr must still say no"
    with pytest.raises(AttributeError, match="Pipeline has no operator 'unknown_operator'"):
        spec_pipeline.unknown_operator


@pytest.mark.parametrize("name", ["__getstate__", "__deepcopy__", "__array__", "_repr_html_", "_ipython_display_"])
def test_a_private_name_probed_on_a_pipeline_is_a_miss_that_reads_no_entry_points_and_imports_nothing(
        spec_pipeline, monkeypatch, name):
    """pickle, copy, numpy and notebooks probe such names with hasattr; a miss of a public name
    re-reads the installed packages' entry points (10-20 ms) and looks the name up on RankLoader
    to word its error, which a probe must not pay for, nor import anything for."""
    import zephon._pipeline

    def no_read(*args):
        raise AssertionError(f"a probe of {name!r} read the entry points")

    monkeypatch.setattr(zephon._pipeline, "find", no_read)
    monkeypatch.setattr(zephon._pipeline, "_no_such_operator", no_read)
    imported = set(sys.modules)
    with pytest.raises(AttributeError) as missed:
        getattr(spec_pipeline, name) if name not in dir(object) else spec_pipeline.__getattr__(name)
    assert str(missed.value) == name
    assert set(sys.modules) == imported


def test_a_runner_instance_given_to_a_second_loader_is_a_configuration_error_saying_to_pass_a_factory(spec_pipeline):
    """`.options(runner=ThreadRunner())` is one runner for one loader; a second loader of that
    pipeline (a resume in the same process, another `for batch in pipeline`) failed with a bare
    RuntimeError, "start() may be called once", which it never called, and not with the
    ConfigurationError a training script catches for setup mistakes."""
    pipeline = spec_pipeline.options(runner=ThreadRunner(), num_lanes=2)
    with pipeline.shard(0, 1, global_batch_size=16) as loader:
        next(iter(loader))
    with pipeline.shard(0, 1, global_batch_size=16) as loader:
        with pytest.raises(ConfigurationError) as refused:
            next(iter(loader))
    assert isinstance(refused.value, RuntimeError), "a caller catching RuntimeError, as it had to, no longer did"
    assert "a runner instance serves one loader" in str(refused.value)
    assert "runner='thread', or for runner options functools.partial(ThreadRunner, ...)" in str(refused.value)


def test_the_runner_choice_is_said_at_info_by_rank_0_alone_naming_the_runner_and_why(
    spec_pipeline, monkeypatch, caplog
):
    """The runner `auto` picks follows the interpreter, the same on every rank: every rank said it
    at INFO, twice (the auto runner's line and the loader's), 2,000 lines for 1,000 GPUs."""
    monkeypatch.delenv("RANK", raising=False)
    pipeline = spec_pipeline.options(runner="auto", num_lanes=8)
    said = {}
    for rank in (0, 3):
        caplog.clear()
        with caplog.at_level(logging.INFO), pipeline.shard(rank, 8, global_batch_size=64) as loader:
            info = loader.runner_info
        said[rank] = [m for r in caplog.records if r.levelno >= logging.INFO and "runner" in (m := r.getMessage())]
    assert said[0] == [f"zephon rank 0/8: runner {info['name']} ({info['reason']})"]
    assert said[3] == []


@pytest.mark.parametrize("factory", [ThreadRunner, functools.partial(ThreadRunner), lambda: ThreadRunner()],
                         ids=["class", "partial", "function"])
def test_a_runner_factory_in_the_options_makes_a_runner_for_every_loader(spec_pipeline, factory):
    pipeline = spec_pipeline.options(runner=factory, num_lanes=2)
    digests = []
    for _ in range(2):  # a resume in the same process builds a second loader from the same pipeline
        with pipeline.shard(0, 1, global_batch_size=16) as loader:
            digests.append(next(iter(loader)).digest())
            assert loader.runner_info["name"] == "thread"
    assert digests[0] == digests[1]


class _BareRunner:
    """A runner as the refusals describe one, "an object with start, submit and close", without the
    `name` and `reason` attributes of the Runner protocol."""

    def start(self, stages) -> None:
        self.stages = stages

    def submit(self, stage_index: int, item):
        from concurrent.futures import Future

        future = Future()
        future.set_result(self.stages[stage_index].fn(item))
        return future

    def close(self) -> None:
        pass


def test_a_runner_with_only_start_submit_and_close_runs_and_says_what_it_is(spec_pipeline):
    """Such a runner passed the check of what a runner is and then failed the first batch with
    `AttributeError: '_BareRunner' object has no attribute 'name'` (the loader logs and reports the
    runner it uses): it runs, named by its class, with the same batches as the inline runner."""
    with spec_pipeline.options(runner="inline", num_lanes=2).shard(0, 1, global_batch_size=16) as loader:
        expected = next(iter(loader)).digest()
    with spec_pipeline.options(runner=_BareRunner, num_lanes=2).shard(0, 1, global_batch_size=16) as loader:
        assert next(iter(loader)).digest() == expected
        assert loader.runner_info == {"name": "_BareRunner", "reason": "requested explicitly"}


def test_a_runner_factory_that_makes_something_else_is_refused_naming_both(spec_pipeline):
    with spec_pipeline.options(runner=dict, num_lanes=2).shard(0, 1, global_batch_size=16) as loader:
        with pytest.raises(ConfigurationError, match=r"runner=<class 'dict'> made \{\}, which is not a runner"):
            next(iter(loader))


WRONG_OPTIONS = {
    "prefetch": (lambda p, tok: p.options(prefetch="4"), "prefetch must be an integer >= 1, got '4'"),
    "read_parallelism": (lambda p, tok: p.options(read_parallelism=0), "read_parallelism must be an integer >= 1, got 0"),
    "num_lanes": (lambda p, tok: p.options(num_lanes=True), "num_lanes must be an integer >= 1, got True"),
    "on_error": (lambda p, tok: p.options(on_error="rasie"), "on_error must be one of ('skip', 'raise'), got 'rasie'"),
    "io_options": (lambda p, tok: p.options(io_options="cache"), "io_options must be a dict"),
    "io_options key": (lambda p, tok: p.options(io_options={"retry": 2}), "io options ['retry'] are unknown"),
    "io_options cache": (lambda p, tok: p.options(io_options={"cache": {"dri": "/x"}}), "cache options ['dri']"),
    "io_options retries": (lambda p, tok: p.options(io_options={"retries": 0}), "retries=0 must be an int >= 1"),
    "io_options retry_delay": (lambda p, tok: p.options(io_options={"retry_delay": "1"}),
                               "retry_delay must be a finite number, got '1'"),
    "max_length": (lambda p, tok: tok.pack_flat(64.5), "pack_flat: max_length must be an integer >= 1, got 64.5"),
    "algorithm": (lambda p, tok: tok.pack_flat(64, algorithm="first-fit"),
                  "pack_flat: algorithm must be one of ('wrap', 'first_fit', 'pad'), got 'first-fit'"),
    "pad_id": (lambda p, tok: tok.pack_flat(64, pad_id=10**12), "does not fit the int32 token arrays"),
    # None read no field: every record skipped as missing_field, the field check having let it by.
    "pack_flat field": (lambda p, tok: p.pack_flat(64, field=None),
                        "pack_flat: field must be a record field's name (a non-empty str), got None"),
    "pack_flat field with tokenize": (lambda p, tok: tok.pack_flat(64, field=("input_ids",)),
                                      "pack_flat: field must be a record field's name (a non-empty str), got ('input_ids',)"),
    "buffer_size": (lambda p, tok: tok.pack_flat(64).shuffle(None), "shuffle: buffer_size must be an integer >= 1"),
    "microbatch_size": (lambda p, tok: tok.pack_flat(64).batch(2.0), "batch: microbatch_size must be an integer >= 1"),
    "shuffle seed": (lambda p, tok: tok.pack_flat(64).shuffle(8, seed=None), "shuffle: seed must be an integer, got None"),
    "tokenize keep_field": (lambda p, tok: p.tokenize(tok.operators[-1].tokenizer_id, keep_field="no"),
                            "tokenize: keep_field must be True or False, got 'no'"),
    "tokenize field": (lambda p, tok: p.tokenize(tok.operators[-1].tokenizer_id, field=3),
                       "tokenize: field must be a record field's name (a non-empty str), got 3"),
    "tokenize output_field": (lambda p, tok: p.tokenize(tok.operators[-1].tokenizer_id, output_field=""),
                              "tokenize: output_field must be a record field's name (a non-empty str), got ''"),
    "tokenize bos": (lambda p, tok: p.tokenize(tok.operators[-1].tokenizer_id, bos=0),
                     "tokenize: bos must be a token's string or None, got 0"),
    "tokenize eos": (lambda p, tok: p.tokenize(tok.operators[-1].tokenizer_id, eos=b"<|eos|>"),
                     "tokenize: eos must be a token's string or None, got b'<|eos|>'"),
    "map fn": (lambda p, tok: p.map(3), "map: fn must be callable, got 3"),
    "filter fn": (lambda p, tok: p.filter("len"), "filter: fn must be callable, got 'len'"),
}


@pytest.mark.parametrize("option", sorted(WRONG_OPTIONS))
def test_an_option_of_the_wrong_type_or_range_is_refused_naming_it(spec_pipeline, demo_tokenizer_path, option):
    """Rounded or coerced, 2.0 or "4" would enter fingerprints and shapes as something else."""
    make, message = WRONG_OPTIONS[option]
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        make(Pipeline(spec_pipeline.source), Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path)))


def test_options_keep_their_own_copy_of_io_options(spec_pipeline):
    """The settings are frozen: the caller's dict, changed after `options()`, must not reach them."""
    io_options = {"cache": {"enabled": False}, "retries": 2}
    pipeline = Pipeline(spec_pipeline.source).options(io_options=io_options)
    io_options["retries"] = 5
    io_options["cache"]["enabled"] = True
    assert pipeline.settings.io_options == {"cache": {"enabled": False}, "retries": 2}


WRONG_SOURCES = {
    "a path for the datasets": (lambda ds: StaticMixtureWorkSource(str(ds.shards[0].url)), "a sequence of zephon.io.Dataset"),
    "a list for the mixture": (lambda ds: StaticMixtureWorkSource([ds], mixture=[1.0]), "mixture maps dataset names"),
    "a weight that is not a number": (lambda ds: StaticMixtureWorkSource([ds], mixture={ds.name: None}), "weights must be numbers"),
    "a weight past float's range": (lambda ds: StaticMixtureWorkSource([ds], mixture={ds.name: 10**400}), "weights must be finite"),
    "a phase without its start": (lambda ds: ScheduledMixtureWorkSource([ds], schedule=[{ds.name: 1}]), "a mixture phase is"),
    "a start that is a string": (lambda ds: ScheduledMixtureWorkSource([ds], schedule=[("0", {ds.name: 1})]), "starts at a token count"),
    "the estimation class": (lambda ds: StaticMixtureWorkSource([ds], token_estimation=TokenEstimation), "a TokenEstimation instance"),
    "an empty estimation": (lambda ds: TokenEstimation(sample_records=0), "sample_records must be an integer >= 1, got 0"),
    "a fractional chunk": (lambda ds: StaticMixtureWorkSource([ds], records_per_chunk=1.5), "records_per_chunk must be an integer"),
    "cache options as a word": (lambda ds: Dataset.from_path("x", str(ds.shards[0].url), cache="yes"), "cache options are a dict"),
    "no URL": (lambda ds: Dataset.from_path("x", None), "needs a URL or path as a str"),
    "a fractional seed": (lambda ds: StaticMixtureWorkSource([ds], seed=1.5), "seed must be an integer, got 1.5"),
    "a seed that is a bool": (lambda ds: TokenEstimation(seed=True), "TokenEstimation: seed must be an integer"),
}


@pytest.mark.parametrize("case", sorted(WRONG_SOURCES))
def test_a_work_source_or_dataset_given_the_wrong_things_is_refused_naming_them(demo_data_dir, case):
    dataset = Dataset.from_path("jargon", str(demo_data_dir / "jargon"))
    make, message = WRONG_SOURCES[case]
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        make(dataset)


def test_a_work_source_needs_a_sequence_of_datasets_and_of_phases(demo_data_dir):
    dataset = Dataset.from_path("jargon", str(demo_data_dir / "jargon"))
    for datasets in (None, (d for d in [dataset]), dataset):
        with pytest.raises(ConfigurationError, match="a sequence of zephon.io.Dataset"):
            StaticMixtureWorkSource(datasets)
    with pytest.raises(ConfigurationError, match="a list of"):
        ScheduledMixtureWorkSource([dataset], None)


def test_numpy_integers_are_counts_and_are_kept_as_plain_ints(spec_pipeline, demo_tokenizer_path):
    options = Pipeline(spec_pipeline.source).options(prefetch=np.int64(2), num_lanes=np.int32(4)).settings
    assert (options.prefetch, options.num_lanes) == (2, 4) and type(options.prefetch) is int
    estimation = TokenEstimation(sample_records=np.int64(64))
    assert type(estimation.sample_records) is int
    packing = Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path)).pack_flat(np.int64(64)).operators[-1]
    assert type(packing.max_length) is int


def test_an_operator_from_a_plugin_may_make_the_packed_field(spec_pipeline, demo_tokenizer_path):
    """The packed-field check stands aside when an operator it cannot read (a plugin's, applied)
    may write the field: a recipe that worked before the check keeps working."""
    def rename(batch):
        for record in batch.records:
            record["tokens"] = record.pop("input_ids")
        return batch

    @dataclass(frozen=True)
    class Rename(RecordOperator):
        parallelism: int = 1
        name: str = "rename"

        def build(self, on_error):
            return rename

        def fingerprint(self):
            return {"op": self.name}

    pipeline = (Pipeline(spec_pipeline.source).options(num_lanes=2, runner="inline").tokenize(str(demo_tokenizer_path))
                .apply(Rename()).pack_flat(64, field="tokens").batch(2))
    with pipeline.shard(0, 1) as loader:
        assert next(iter(loader)).tokens["input_ids"].shape == (2, 64)


@dataclass(frozen=True)
class _NoteDatasets(RecordOperator):
    """An operator of the user's own that lists the datasets of the chunks it sees in `seen`."""

    seen: list
    datasets: object = None
    dataset_scope: object = None
    parallelism: int = 1
    name: str = "note"

    def build(self, on_error):
        def note(batch):
            self.seen.append(batch.chunk.dataset)
            return batch

        return note

    def fingerprint(self):
        return {"op": self.name}


def _noting_pipeline(spec_pipeline, demo_tokenizer_path, op):
    return (Pipeline(spec_pipeline.source).options(num_lanes=2, runner="inline").tokenize(str(demo_tokenizer_path))
            .apply(op).pack_flat(64).batch(2))


@pytest.mark.parametrize("datasets", [
    {"wiki": "the Hugging Face dataset it looks words up in"}, 3, ["allenai/c4"],
], ids=["a dict", "a count", "other names"])
def test_an_operator_of_the_user_s_own_with_an_attribute_named_datasets_runs_unscoped(
        spec_pipeline, demo_tokenizer_path, datasets):
    """Only `dataset_scope` scopes an operator: an attribute of the user's named `datasets` (what
    vlm's decoders call their scope) was read as one and refused ("datasets must be None",
    "'allenai/c4' is no dataset of the work source")."""
    seen = []
    with _noting_pipeline(spec_pipeline, demo_tokenizer_path, _NoteDatasets(seen, datasets)).shard(0, 1) as loader:
        for _, _ in zip(range(8), loader):
            pass
    assert set(seen) == {"wiki", "news"}


@pytest.mark.parametrize("scope, message", [
    ("wikki", r"note\(datasets=\['wikki'\]\): 'wikki' is no dataset .*did you mean 'wiki'\?"),
    (3, r"note: dataset_scope must be None \(every dataset\), a dataset's name or a list of them, got 3"),
], ids=["a misnamed dataset", "a count"])
def test_an_operator_of_the_user_s_own_declaring_a_dataset_scope_has_it_checked(
        spec_pipeline, demo_tokenizer_path, scope, message):
    op = _NoteDatasets([], dataset_scope=scope)
    with pytest.raises(ConfigurationError, match=message):
        _noting_pipeline(spec_pipeline, demo_tokenizer_path, op).shard(0, 1)


class _HubSource:
    """A work source of the user's own that holds under `datasets` what it was made from (hub ids,
    a count), not the names of its plan's datasets, and binds the mixture it wraps."""

    def __init__(self, inner, datasets) -> None:
        self.inner, self.datasets = inner, datasets

    def bind(self, count_tokens, num_lanes):
        return self.inner.bind(count_tokens, num_lanes)


@pytest.mark.parametrize("datasets", [["allenai/c4", "org/news"], 3], ids=["hub ids", "a count"])
def test_a_work_source_of_the_user_s_own_is_checked_by_its_plan_not_by_a_datasets_it_holds(
        spec_pipeline, demo_tokenizer_path, datasets):
    """The scopes were checked against any work source's `datasets`: hub ids had an operator
    scoped to 'wiki', a dataset of the plan, refused as naming none, and a count failed every
    pipeline, scoped or not, with a bare TypeError when sharded. Only `dataset_names` (the
    mixture sources') is read before binding; another source's scopes are checked by its plan."""
    source = _HubSource(spec_pipeline.source, datasets)

    def pipeline(scope):
        return (Pipeline(source).options(num_lanes=2, runner="inline").tokenize(str(demo_tokenizer_path))
                .apply(_NoteDatasets([], dataset_scope=scope)).pack_flat(64).batch(2))

    for scope in (None, "wiki"):
        with pipeline(scope).shard(0, 1) as loader:
            assert next(iter(loader)).tokens["input_ids"].shape == (2, 64)
    with pytest.raises(ConfigurationError, match=r"'wikki' is no dataset .*did you mean 'wiki'\?"):
        pipeline("wikki").shard(0, 1)


def test_a_dataset_path_may_be_a_pathlib_path(demo_data_dir):
    assert Dataset.from_path("jargon", demo_data_dir / "jargon").fingerprint() == \
        Dataset.from_path("jargon", str(demo_data_dir / "jargon")).fingerprint()


def test_a_tokenizer_that_is_not_one_is_refused_naming_it(spec_pipeline, demo_tokenizer_path, tmp_path):
    not_json = tmp_path / "tokenizer.json"
    not_json.write_text("# a README, not a tokenizer")
    with pytest.raises(ConfigurationError, match="is not a tokenizers tokenizer.json"):
        Pipeline(spec_pipeline.source).tokenize(str(not_json))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigurationError, match="empty': a directory holding no tokenizer.json"):
        Pipeline(spec_pipeline.source).tokenize(str(tmp_path / "empty"))
    for wrong in (None, 123):
        with pytest.raises(ConfigurationError, match="a tokenizer is named by a str"):
            Pipeline(spec_pipeline.source).tokenize(wrong)
    as_path = Pipeline(spec_pipeline.source).tokenize(demo_tokenizer_path)  # a pathlib.Path works as its str
    assert as_path.operators[-1].tokenizer_id == str(demo_tokenizer_path)


def test_the_chosen_runner_and_the_reason_are_inspectable(spec_pipeline):
    with spec_pipeline.options(runner="thread").shard(0, 1) as loader:
        assert loader.runner_info == {"name": "thread", "reason": "requested explicitly"}
    with spec_pipeline.shard(0, 1) as loader:
        info = loader.runner_info
        import sys

        expected = "thread" if not getattr(sys, "_is_gil_enabled", lambda: True)() else "process"
        assert info["name"] == expected and "GIL" in info["reason"]


def test_user_map_errors_surface_with_the_record_address(spec_pipeline, demo_tokenizer_path):
    from zephon import UserFunctionError

    def explode(record):
        if "Psalm" in record.get("text", "")[:40]:
            raise KeyError("boom")
        return record

    p = Pipeline(spec_pipeline.source).options(runner="process").map(explode, parallelism=2)
    p = p.tokenize(str(demo_tokenizer_path), parallelism=2).pack_flat(128).batch(2)
    with pytest.raises(UserFunctionError) as info:
        for _ in p:
            pass
    assert "wiki:" in str(info.value) and "KeyError: 'boom'" in str(info.value)
    assert info.value.address.dataset == "wiki"


async def _async_keep(record):
    return False


def _generator_keep(record):
    yield False


async def _async_generator_keep(record):
    yield False


@pytest.mark.parametrize("fn", [_async_keep, _generator_keep, _async_generator_keep],
                         ids=["async", "generator", "async_generator"])
def test_a_filter_returning_a_coroutine_or_generator_fails_naming_the_record_instead_of_keeping_everything(fn):
    """A coroutine or a generator is true whatever it would say: an `async def` filter, or one that
    yields its verdict, kept every record, and the filter did nothing, unsaid."""
    import warnings

    from zephon import UserFunctionError
    from zephon._record_ops import FilterOp
    from zephon._records import Chunk, ChunkRecords, RecordAddress

    chunk = ChunkRecords(Chunk("d", 0, 0, 1), [{"text": "hello"}], [RecordAddress("d", "s", 0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the coroutine is closed, not left for a "never awaited" warning
        with pytest.raises(UserFunctionError, match="not a bool") as info:
            FilterOp(fn).build("skip")(chunk)
    assert info.value.address == RecordAddress("d", "s", 0)


def test_a_global_digest_needs_one_step(spec_pipeline):
    from zephon import ZephonError

    with spec_pipeline.shard(0, 1, global_batch_size=64) as loader:
        it = iter(loader)
        batches = [next(it) for _ in range(9)]
    with pytest.raises(ZephonError, match="different steps"):
        global_batch_digest(batches)


def test_a_global_digest_of_one_rank_s_part_of_a_step_is_refused_naming_the_other_s(spec_pipeline):
    """The loader's microbatches say their step's shape: a gather that left out rank 1's part is
    refused, naming its (lane, index), where it used to hash rank 0's part alone."""
    from zephon import PartialGlobalBatchError

    with spec_pipeline.shard(0, 2, global_batch_size=64) as loader:
        it = iter(loader)
        part = [next(it) for _ in range(len(loader.lanes))]
        lanes = loader.num_lanes
    assert {b.step for b in part} == {0}
    with pytest.raises(PartialGlobalBatchError) as info:
        global_batch_digest(part)
    assert info.value.missing == [(lane, 0) for lane in range(lanes // 2, lanes)]


def test_io_cache_option_keeps_remote_shards_on_local_disk(tmp_path, demo_tokenizer_path):
    import json

    import fsspec

    fs = fsspec.filesystem("memory")
    for shard in range(2):
        lines = [json.dumps({"text": f"record {shard} {i} " * 20}) for i in range(64)]
        fs.pipe(f"/cache-test/part-{shard}.jsonl", ("\n".join(lines) + "\n").encode())
    source = StaticMixtureWorkSource([Dataset.from_path("mem", "memory:///cache-test")], records_per_chunk=8)
    cache_dir = tmp_path / "cache"
    pipeline = (
        Pipeline(source)
        .options(io_options={"cache": {"enabled": True, "dir": str(cache_dir)}}, runner="inline")
        .tokenize(str(demo_tokenizer_path))
        .pack_flat(64)
        .batch(2)
    )
    batches = [b for _, b in zip(range(4), pipeline)]
    assert len(batches) == 4
    assert any(p.is_file() for p in cache_dir.rglob("*")), "remote shards should be cached on local disk"


def test_a_pipeline_whose_first_accumulator_is_not_its_packer_is_refused_naming_the_order(
    spec_pipeline, demo_tokenizer_path
):
    """The loader takes its row length, token counter and padding row from the packer: a shuffle
    placed before it (or alone) used to fail with a bare AttributeError on 'max_length'."""
    tokenized = Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path))
    with pytest.raises(ConfigurationError, match=r"shuffle comes before pack_flat"):
        tokenized.shuffle(4).pack_flat(64).batch(2).shard(0, 1)
    with pytest.raises(ConfigurationError, match="needs a packing operator"):
        tokenized.shuffle(4).batch(2).shard(0, 1)


def test_a_second_shuffle_with_the_first_ones_seed_is_refused_and_one_with_its_own_seed_runs(
    spec_pipeline, demo_tokenizer_path
):
    """Both buffers draw from (seed, lane, segment): with one seed the second repeats the first's
    draws instead of shuffling again, unsaid."""
    packed = Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path)).pack_flat(64)
    with pytest.raises(ConfigurationError, match="seed 0 is already another shuffle's"):
        packed.shuffle(4).shuffle(8)
    with pytest.raises(ConfigurationError, match="seed 7 is already another shuffle's"):
        packed.shuffle(4, seed=7).shuffle(8, seed=7)
    with packed.shuffle(4).shuffle(8, seed=1).batch(2).shard(0, 1) as loader:
        assert next(iter(loader)).tokens["input_ids"].shape == (2, 64)


@pytest.mark.parametrize("after_packing", ["map", "filter", "tokenize"])
def test_a_record_operator_placed_after_packing_is_refused(spec_pipeline, demo_tokenizer_path, after_packing):
    """Record operators run on records, before the packer: one written after pack_flat (meant for
    the packed rows, or a misplaced tokenize) would run on the records all the same, silently in
    another place than the pipeline shows."""
    packed = Pipeline(spec_pipeline.source).tokenize(str(demo_tokenizer_path)).pack_flat(64)
    misplaced = {"map": lambda p: p.map(lambda record: record), "filter": lambda p: p.filter(lambda record: True),
                 "tokenize": lambda p: p.tokenize(str(demo_tokenizer_path), field="title")}[after_packing](packed)
    with pytest.raises(ConfigurationError, match=r"stateless operators \(map, filter, tokenize, …\) must come "
                                                 r"before packing"):
        misplaced.batch(2).shard(0, 1)


def test_a_pipeline_given_no_work_source_or_no_options_object_is_refused_naming_it(demo_data_dir):
    """Pipeline(Dataset) used to be accepted and to fail at shard() with a bare AttributeError on 'bind'."""
    dataset = Dataset.from_path("jargon", str(demo_data_dir / "jargon"))
    for source in (dataset, [dataset], str(demo_data_dir)):
        with pytest.raises(ConfigurationError, match="needs a work source"):
            Pipeline(source)
    with pytest.raises(ConfigurationError, match="options must be a PipelineOptions"):
        Pipeline(StaticMixtureWorkSource([dataset]), options={"num_lanes": 2})


def _digests_of_a_pickled_pipeline(payload: bytes, steps: int, queue) -> None:
    """Runs in a spawned process: unpickle a pipeline and send back its per-step global digests."""
    import pickle

    from tests.harness import step_digests

    try:
        queue.put(step_digests(pickle.loads(payload), 2, steps))
    except BaseException as error:  # the parent asserts on it: a hang would say nothing
        queue.put(repr(error))


def test_a_pipeline_pickles_and_its_copy_in_a_spawned_process_yields_the_same_batches(make_jsonl_corpus,
                                                                                      demo_tokenizer_path):
    """spawn and forkserver (the Linux default from Python 3.14; torch workers given either) pickle
    what they hand a child. A work source kept a threading.Lock for its measurement cache, so any
    pipeline failed to pickle with "cannot pickle '_thread.lock' object"; the source now pickles its
    configuration and the copy makes its own lock and cache. A recipe planned by tokens pickles too,
    and its copy is refused by name where it binds (a Dataset's pickle leaves out record offsets)."""
    import multiprocessing
    import pickle

    from tests.harness import step_digests, text_pipeline

    corpus_a, corpus_b = make_jsonl_corpus(2, 40, 1), make_jsonl_corpus(2, 40, 2)
    pipeline = text_pipeline(corpus_a, corpus_b, demo_tokenizer_path, runner="thread", parallelism=2,
                             estimate_tokens=False)
    payload = pickle.dumps(pipeline)
    expected = step_digests(pipeline, 1, 3)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_digests_of_a_pickled_pipeline, args=(payload, 3, queue))
    child.start()
    try:
        assert queue.get(timeout=120) == expected
    finally:
        child.join(timeout=30)

    by_tokens = text_pipeline(corpus_a, corpus_b, demo_tokenizer_path)
    step_digests(by_tokens, 1, 1)  # measured and cached: the cache stays behind
    with pytest.raises(ConfigurationError, match="'a' was unpickled"):
        pickle.loads(pickle.dumps(by_tokens)).shard(0, 1)


class _RowPlanOfTheOldContract:
    """A plugin's row plan written before rows counted their tokens per dataset: no
    `tokens_by_dataset`, no `images_by_dataset`."""

    def __init__(self, row) -> None:
        self._row = row

    @property
    def num_real_tokens(self) -> int:
        return self._row.num_real_tokens

    @property
    def length(self) -> int:
        return self._row.length

    @property
    def sources(self):
        return self._row.sources

    def assemble(self):
        return self._row.assemble()


def test_a_plugin_row_plan_without_per_dataset_counts_is_refused_naming_its_type_and_what_it_lacks(
    demo_data_dir, demo_tokenizer_path
):
    """The ledger counts each row's tokens and images per dataset; a row plan of a plugin written
    to the older contract lacks them and failed deep in the loader with a bare AttributeError."""
    source = StaticMixtureWorkSource([Dataset.from_path("wiki", str(demo_data_dir / "kjv"))], seed=1)
    pipeline = (
        Pipeline(source).options(num_lanes=2, runner="inline")
        .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text")
        .pack_flat(max_length=64).apply(RowsHandedOnAs("old_contract_rows", _RowPlanOfTheOldContract)).batch(microbatch_size=2)
    )
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        with pytest.raises(ConfigurationError, match="_RowPlanOfTheOldContract.*tokens_by_dataset"):
            next(iter(loader))


class _RowsNamingSources:
    """A plugin that hands each packed row over as a `PackedSequence` naming the records of only
    its first `named` documents (`sources`; None: all of them)."""

    kind, name = "accumulator", "rows_naming_sources"

    def __init__(self, named: int | None) -> None:
        self.named = named

    def factory(self, default_pad_id: int):
        named = self.named

        class Rows:
            def push(self, plan):
                row = plan.assemble()
                return [PackedSequence(tokens=row.tokens, sources=row.sources[:named])]

            def flush(self):
                return []

        return lambda ctx: Rows()

    def fingerprint(self, default_pad_id: int) -> dict:
        return {"op": self.name, "named": self.named}


def _stats_of_rows_naming_sources(demo_data_dir, demo_tokenizer_path, named: int | None, microbatches: int) -> dict:
    source = StaticMixtureWorkSource([Dataset.from_path("wiki", str(demo_data_dir / "kjv"))], seed=1)
    pipeline = (
        Pipeline(source).options(num_lanes=2, runner="inline")
        .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text")
        .pack_flat(max_length=64).apply(_RowsNamingSources(named)).batch(microbatch_size=2)
    )
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        batches = iter(loader)
        for _ in range(microbatches):
            next(batches)
        return loader.stats()


@pytest.mark.parametrize("named", [0, 1], ids=["no_sources", "the_first_document_s_only"])
def test_a_plugin_row_naming_no_record_for_some_of_its_documents_is_refused_naming_what_it_lacks(
    demo_data_dir, demo_tokenizer_path, named
):
    """The ledger counts a row's tokens for the dataset of the record `sources` names for each of
    its documents: a plugin's PackedSequence made without them (`sources` defaults to none) had
    those tokens counted in its lane's `tokens` and under no dataset, so the realised mixture did
    not add up to the tokens handed over, silently."""
    with pytest.raises(ConfigurationError, match=r"PackedSequence holds documents 0 to \d+ and names the record "
                                                 rf"of {named}.*sources\[d\]"):
        _stats_of_rows_naming_sources(demo_data_dir, demo_tokenizer_path, named, microbatches=8)


def test_a_plugin_row_naming_every_documents_record_counts_all_its_tokens_for_their_datasets(
    demo_data_dir, demo_tokenizer_path
):
    stats = _stats_of_rows_naming_sources(demo_data_dir, demo_tokenizer_path, None, microbatches=8)
    for lane in stats["lanes"].values():
        assert sum(counts["tokens"] for counts in lane["datasets"].values()) == lane["tokens"] > 0


@pytest.mark.parametrize("method", [Pipeline.filter, Pipeline.batch, Batch.to_numpy, Batch.digest])
def test_every_method_a_training_script_calls_says_what_it_does(method):
    """`help(Pipeline.filter)`, `help(Pipeline.batch)`, `help(Batch.digest)` and
    `help(Batch.to_numpy)` said nothing: what a false verdict does, where the microbatch size
    meets the global batch size, and what a digest covers were in the README alone."""
    assert inspect.getdoc(method)

