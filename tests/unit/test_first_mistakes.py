"""The mistakes a newcomer makes first are refused with a named error that says what to do.

Each case is the README's pipeline with one thing wrong, as someone who has not read the rest of
the documentation would get it wrong: a layout that cannot split, a mixture keyed by the wrong
names, a misnamed text field, a loader used after `close()`.
"""

from __future__ import annotations

import pytest

from zephon import ConfigurationError, Pipeline
from zephon.integrations.torchtitan import ZephonDataLoader
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation


@pytest.fixture
def datasets(demo_data_dir):
    return [Dataset.from_path("bible", str(demo_data_dir / "kjv")),
            Dataset.from_path("jargon", str(demo_data_dir / "jargon"))]


def readme_pipeline(source, tokenizer, field="text"):
    return (
        Pipeline(source).options(num_lanes=8, runner="inline")
        .tokenize(tokenizer_id=str(tokenizer), field=field, eos="<|eos|>")
        .pack_flat(max_length=256)
        .batch(microbatch_size=2)
    )


@pytest.mark.parametrize(
    "global_batch_size,advice",
    [
        (12, "a global_batch_size of 16 would split evenly (a multiple of num_lanes × microbatch_size = 8 × 2)"),
        (100, "a global_batch_size of 96 or 112 would split evenly"),
        (24, "a microbatch_size in [1, 3] would split it, or a global_batch_size of 16 or 32 would split evenly"),
    ],
    ids=["fewer rows than lanes", "not a multiple of the lanes", "lane rows not a multiple of the microbatch"],
)
def test_a_global_batch_that_cannot_split_names_the_sizes_that_would(
    datasets, demo_tokenizer_path, global_batch_size, advice
):
    pipeline = readme_pipeline(StaticMixtureWorkSource(datasets), demo_tokenizer_path)
    with pytest.raises(ConfigurationError) as refused:
        pipeline.shard(0, 1, global_batch_size=global_batch_size)
    assert advice in str(refused.value)


@pytest.mark.parametrize(
    "mixture,named",
    [
        ({"bibel": 0.7, "jargon": 0.3}, "['bibel'] name no dataset; ['bible'] have no weight"),
        ({"bible": 1.0}, ": ['jargon'] have no weight"),
    ],
    ids=["misspelt", "one left out"],
)
def test_a_mixture_keyed_by_other_names_says_which_and_how_to_key_it(datasets, mixture, named):
    with pytest.raises(ConfigurationError) as refused:
        StaticMixtureWorkSource(datasets, mixture=mixture)
    assert named in str(refused.value)
    assert "key the mixture by the names given to Dataset.from_path" in str(refused.value)


def test_a_misnamed_text_field_is_refused_at_planning_naming_why_the_sample_had_no_token(
    datasets, demo_tokenizer_path
):
    """The sample's records all lack the field, so token estimation has no rate to plan by: the
    refusal said to check the field names without saying that every record lacked one."""
    source = StaticMixtureWorkSource(datasets, mixture={"bible": 0.7, "jargon": 0.3},
                                     token_estimation=TokenEstimation(sample_records=64))
    pipeline = readme_pipeline(source, demo_tokenizer_path, field="txt")
    with pytest.raises(ConfigurationError, match=r"dataset 'bible': .* yielded no token \(records dropped: "
                                                 r"missing_field 64\).*check its field names"):
        pipeline.shard(0, 1, global_batch_size=16)


def test_a_closed_loader_says_how_to_go_on_and_the_state_it_still_gives_resumes_there(
    datasets, demo_tokenizer_path
):
    source = StaticMixtureWorkSource(datasets, mixture={"bible": 0.7, "jargon": 0.3}, records_per_chunk=8)
    pipeline = readme_pipeline(source, demo_tokenizer_path)
    with pipeline.shard(0, 1, global_batch_size=16) as uninterrupted:
        expected = [batch.digest() for _, batch in zip(range(4), uninterrupted)]
    loader = pipeline.shard(0, 1, global_batch_size=16)
    batches = iter(loader)
    taken = [next(batches).digest() for _ in range(3)]
    loader.close()
    for use in (lambda: next(batches), lambda: next(iter(loader))):
        with pytest.raises(ConfigurationError) as refused:
            use()
        assert "make a new loader with pipeline.shard(...)" in str(refused.value)
        assert "load_state_dict(state) of a state_dict() this loader gave" in str(refused.value)
    with pipeline.shard(0, 1, global_batch_size=16) as again:
        again.load_state_dict(loader.state_dict())
        resumed = next(iter(again)).digest()
    assert taken + [resumed] == expected


def test_a_closed_torchtitan_loader_says_to_build_a_new_one_and_load_its_state_not_to_shard_the_pipeline(
    datasets, demo_tokenizer_path
):
    """The adapter passed on the rank loader's refusal, "make a new loader with pipeline.shard(...)",
    which is no loader a TorchTitan trainer can use."""
    source = StaticMixtureWorkSource(datasets, mixture={"bible": 0.7, "jargon": 0.3}, records_per_chunk=8)
    pipeline = readme_pipeline(source, demo_tokenizer_path)
    loader = ZephonDataLoader(pipeline, 0, 1, global_batch_size=16)
    loader.close()
    with pytest.raises(ConfigurationError) as refused:
        next(iter(loader))
    assert str(refused.value) == (
        "this ZephonDataLoader is closed; build a new ZephonDataLoader and, to go on where this one stopped, "
        "give it load_state_dict(state) of a state_dict() this one gave (it still gives one once closed)"
    )
    with ZephonDataLoader(pipeline, 0, 1, global_batch_size=16) as again:
        again.load_state_dict(loader.state_dict())
