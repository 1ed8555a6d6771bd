"""The README's Python examples (and docs/RELIABILITY.md's and the package READMEs') run as
printed, on the shipped data or a small corpus of the dataset they name, and do what the text says.

The blocks are read from the markdown itself, so an example that drifts from the API fails here. The
names the text leaves to the reader are supplied: `rank`, `world_size`, a `train_step` that checks
what the comment promises, and `states_of_all_ranks`. Where a block names data or a model this
machine cannot have (a hub dataset, TorchTitan's Llama 3 registry, which imports triton), that one
name is swapped for the shipped data or a stand-in, and the test says which.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types

import pytest

from tests.conftest import DEMO_DATA_DIR, REPO_ROOT, requires_torch


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO_ROOT / markdown).read_text(encoding="utf-8"), re.S)


BLOCKS = python_blocks("README.md")


class Enough(Exception):
    """Ends the README's endless training loop."""


@requires_torch
def test_readme_pipeline_and_checkpoint_examples_run_as_printed(monkeypatch):
    import torch

    import zephon

    pipeline_block, checkpoint_block = BLOCKS  # the README shows exactly these two
    monkeypatch.chdir(REPO_ROOT)  # its paths are relative to the repository
    seen = []

    def train_step(batch):
        assert {"input_ids", "labels", "position_ids", "document_ids"} <= set(batch)
        assert all(isinstance(t, torch.Tensor) for t in batch.values())
        seen.append(tuple(batch["input_ids"].shape))
        if len(seen) == 3:
            raise Enough

    namespace = {"rank": 0, "world_size": 1, "train_step": train_step}
    with pytest.raises(Enough):
        exec(compile(pipeline_block, "README.md", "exec"), namespace)
    assert seen == [(8, 2048)] * 3, "microbatch_size=8 rows of max_length=2048"

    pipeline = namespace["pipeline"]
    with pipeline.shard(0, 2, global_batch_size=256) as first, pipeline.shard(1, 2, global_batch_size=256) as second:
        taken = [next(iter(first)), next(iter(second))]
        states = [first.state_dict(), second.state_dict()]
    with pipeline.shard(0, 1, global_batch_size=256) as loader:
        namespace.update(zephon=zephon, loader=loader, states_of_all_ranks=states)
        exec(compile(checkpoint_block, "README.md", "exec"), namespace)
        json.dumps(namespace["state"])  # "plain JSON"
        resumed = next(iter(loader))
    assert [(b.lane, b.step, b.index) for b in taken] == [(0, 0, 0), (4, 0, 0)]
    assert (resumed.lane, resumed.step, resumed.index) == (0, 0, 1), "resumed after the microbatch already taken"


RELIABILITY_BLOCKS = python_blocks("docs/RELIABILITY.md")


def test_reliability_stats_example_reads_the_keys_it_shows_and_its_ledger_balances(tmp_path):
    """docs/RELIABILITY.md's `loader.stats()` block, run on a dataset named `web` as printed,
    after a whole epoch of lines that are malformed, empty or filtered out."""
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    [stats_block] = RELIABILITY_BLOCKS  # the page shows exactly this one
    lines = [json.dumps({"text": f"document number {i} " * (i % 5 + 1)}) for i in range(40)]
    lines[3] = lines[17] = '{"text": "cut'  # malformed_json
    lines[8] = json.dumps({"text": "   "})  # empty_document
    (tmp_path / "web.jsonl").write_text("\n".join(lines) + "\n")
    source = StaticMixtureWorkSource([Dataset.from_path("web", str(tmp_path / "web.jsonl"))],
                                     records_per_chunk=5, num_epochs=1)
    pipeline = (
        Pipeline(source).options(num_lanes=2, runner="inline")
        .filter(lambda record: not record["text"].startswith("document number 2"))  # 2, 20..29
        .tokenize(str(REPO_ROOT / "zephon" / "data" / "tokenizer.json"))
        .pack_flat(max_length=16).batch(1)
    )
    with pipeline.shard(0, 1, global_batch_size=2) as loader:
        batches = list(loader)
        namespace = {"loader": loader}
        exec(compile(stats_block, "docs/RELIABILITY.md", "exec"), namespace)
    stats = namespace["stats"]
    total = stats["datasets"]["web"]["total"]
    assert total == {"read": 40, "emitted": 26, "filtered": 11,
                     "skipped": {"malformed_json": 2, "empty_document": 1}}
    lanes = stats["datasets"]["web"]["lanes"]
    assert set(lanes) == set(stats["lanes"]) == {0, 1}
    for lane in lanes.values():
        assert lane["read"] == lane["emitted"] + lane["filtered"] + sum(lane["skipped"].values())
    assert {key for lane in stats["lanes"].values() for key in lane} == {"rows", "tokens", "padding", "learned",
                                                                         "datasets"}
    assert sum(lane["rows"] for lane in stats["lanes"].values()) == sum(len(b.tokens["input_ids"]) for b in batches)
    for number, lane in stats["lanes"].items():
        learned = sum(int((b.tokens["labels"] >= 0).sum()) for b in batches if b.lane == number)
        assert lane["learned"] == learned > 0
        assert lane["datasets"] == {"web": {"tokens": lane["tokens"], "images": 0, "learned": learned}}
    lanes = stats["lanes"].values()
    assert stats["mixture"] == {"web": {"tokens": sum(lane["tokens"] for lane in lanes), "images": 0,
                                        "learned": sum(lane["learned"] for lane in lanes)}}


def test_io_readme_example_reads_a_datasets_chunks_as_printed(monkeypatch):
    """zephon/io/README.md's block, on the shipped Bible instead of the hub's wikitext (no hub here)."""
    [block] = python_blocks("zephon/io/README.md")
    hub = "hf://Salesforce/wikitext/wikitext-2-raw-v1/train"
    assert hub in block
    monkeypatch.chdir(REPO_ROOT)
    namespace = {}
    exec(compile(block.replace(hub, "zephon/data/kjv"), "zephon/io/README.md", "exec"), namespace)
    out = namespace["out"]  # the last chunk's records, as the comment lists them
    assert out.records and len(out.records) == len(out.addresses) and out.skipped == []
    assert out.chunk == namespace["chunk"] and out.chunk.num_records == len(out.records) <= 1024


@requires_torch
@pytest.mark.requires_torchtitan
def test_torchtitan_readme_job_config_builds_the_trainers_loader_and_its_plain_loop_runs(monkeypatch):
    """zephon/integrations/README.md: the job config function, then the trainer's `build` call, then
    the loop outside TorchTitan. Stand-ins: `llama3_debugmodel` and `Trainer` (the real modules
    import triton and tensorboard), the shipped corpus and tokenizer for the recipe's hub dataset,
    `/data` files and `./assets` tokenizer, and a loader class that stops the endless loop."""
    from torchtitan.components.dataloader import BaseDataLoader

    from zephon.integrations.torchtitan import ZephonDataLoader

    job_block, loop_block = python_blocks("zephon/integrations/README.md")

    @dataclasses.dataclass
    class TrainerConfig:
        training: object = None
        dataloader: object = None

    registry = types.ModuleType("torchtitan.models.llama3.config_registry")
    registry.llama3_debugmodel = TrainerConfig
    trainer = types.ModuleType("torchtitan.trainer")
    trainer.Trainer = types.SimpleNamespace(Config=TrainerConfig)
    monkeypatch.setitem(sys.modules, "torchtitan.models.llama3.config_registry", registry)
    monkeypatch.setitem(sys.modules, "torchtitan.trainer", trainer)
    namespace = {}
    exec(compile(job_block, "zephon/integrations/README.md", "exec"), namespace)
    config = namespace["llama3_debugmodel_zephon"]()

    assert isinstance(config.dataloader, BaseDataLoader.Config)
    recipe = config.dataloader.recipe
    assert recipe.max_length == config.training.seq_len, "the comment: must equal training.seq_len"
    assert config.dataloader.global_batch_size == config.training.global_batch_size
    assert config.training.local_batch_size % recipe.microbatch_size == 0

    shipped = dataclasses.replace(
        recipe, datasets=[("wiki", str(DEMO_DATA_DIR / "kjv")), ("news", str(DEMO_DATA_DIR / "jargon"))],
        tokenizer=str(DEMO_DATA_DIR / "tokenizer.json"), eos="<|eos|>",
        records_per_chunk=8,  # the shipped Bible has 12 chunks of the default 128 records, and 32 lanes
    )
    with dataclasses.replace(config.dataloader, recipe=shipped).build(
        dp_world_size=8, dp_rank=0, tokenizer=None, seq_len=config.training.seq_len,
        local_batch_size=config.training.local_batch_size, snapshot_every_n_steps=None,
    ) as built:
        inputs, labels = next(iter(built))
    assert set(inputs) == {"input", "positions"}
    assert inputs["input"].shape == labels.shape == (config.training.local_batch_size, config.training.seq_len)

    class FirstYield(ZephonDataLoader):
        def __iter__(self):
            yield next(super().__iter__())

    loop = {"ZephonDataLoader": FirstYield, "recipe": shipped, "dp_rank": 0, "dp_world_size": 8}
    exec(compile(loop_block, "zephon/integrations/README.md", "exec"), loop)
    loop["loader"].close()
    assert [len(digest) for digest in loop["digests"]] == [64] * (8 // shipped.microbatch_size)


@requires_torch
@pytest.mark.parametrize("named", ["tekken/tokenizer.json", "tekken"], ids=["file", "directory"])
def test_vlm_readme_recipe_for_ones_own_pairs_runs_as_printed_on_the_tokenizer_file_or_its_directory(
        tmp_path, monkeypatch, named):
    """vlm/README.md's "Your own image–caption pairs" block, in a directory holding `tekken/` and
    `pairs/` as it names them (Tekken's tokenizer.json and real pairs as WebDataset tars). Its
    comment offers the tokenizer's directory in place of its file, so the block runs with each:
    `Tokenizer.from_file` on the directory failed with "Is a directory (os error 21)"."""
    import shutil

    import torch

    from vlm._assets import pair_shards, tekken_tokenizer

    [block] = [b for b in python_blocks("vlm/README.md") if '"pairs/"' in b]
    printed = 'tokenizer = "tekken/tokenizer.json"'
    assert printed in block
    (tmp_path / "tekken").mkdir()
    shutil.copy(tekken_tokenizer() / "tokenizer.json", tmp_path / "tekken" / "tokenizer.json")
    shutil.copytree(pair_shards(2, 16).directory, tmp_path / "pairs")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(block.replace(printed, f'tokenizer = "{named}"'), "vlm/README.md", "exec"), namespace)
    batch = namespace["batch"]
    assert {"input_ids", "labels", "position_ids", "document_ids", "pixel_values", "image_grid"} <= set(batch)
    assert all(isinstance(t, torch.Tensor) for t in batch.values())
    assert tuple(batch["input_ids"].shape) == (1, 2048), "microbatch_size=1 row of 2048"
    assert len(batch["image_grid"]) >= 1, "the row holds images"


def run_vlm_block(needle: str) -> dict:
    """Run the vlm/README.md block holding `needle` as a reader who ran its pairs block first: with
    that block's Tekken `tokenizer` and `placeholders` and the names the blocks import defined.
    Returns the block's namespace (its `pipeline`, ...)."""
    from vlm import ImageSpec, PixtralPlaceholders, VideoSpec
    from vlm._assets import tekken_tokenizer
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    [block] = [b for b in python_blocks("vlm/README.md") if needle in b]
    tokenizer = str(tekken_tokenizer())
    namespace = {"tokenizer": tokenizer, "placeholders": PixtralPlaceholders.from_tokenizer(tokenizer),
                 "Dataset": Dataset, "Pipeline": Pipeline, "StaticMixtureWorkSource": StaticMixtureWorkSource,
                 "ImageSpec": ImageSpec, "VideoSpec": VideoSpec}
    exec(compile(block, "vlm/README.md", "exec"), namespace)
    return namespace


@requires_torch
def test_vlm_readme_recipe_mixing_photos_and_clips_runs_as_printed_and_packs_both(tmp_path, monkeypatch):
    """vlm/README.md's "Mixing image and video datasets" block, in a directory holding `photos/`
    and `clips/` as it names them, with the pairs block's Tekken tokenizer and placeholders: its
    rows hold photos and clip frames, each decoded by its own scoped decoder."""
    from tests.unit.test_vlm_mixed_media import write_mixed_corpus

    write_mixed_corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    namespace = run_vlm_block('datasets="photos"')
    documents = {"photos": 0, "clips": 0}
    with namespace["pipeline"].shard(0, 1) as loader:
        for _, batch in zip(range(12), loader):
            for sources in batch.sources:
                for address in sources:
                    documents[address.dataset] += 1
            assert int(batch.ragged_counts["image_grid"].sum()) > 0
        skipped = {name: entry["total"].get("skipped", {}) for name, entry in loader.stats()["datasets"].items()}
    assert documents["photos"] > 0 and documents["clips"] > 0, documents
    assert not skipped["clips"] and set(skipped["photos"]) <= {"missing_image"}, skipped


@requires_torch
def test_vlm_readme_recipe_for_images_named_by_path_runs_as_printed_and_reads_them_beside_the_shard(
        tmp_path, monkeypatch):
    """vlm/README.md's "Images named by path" block, in a directory holding `llava/` as it names it
    (JSON Lines naming their images, the images beside them), with the pairs block's Tekken
    tokenizer and placeholders, run from another directory: its rows hold the images, and the one
    record whose files are not there is counted as such."""
    from tests.unit.test_vlm_image_paths import write_corpus

    write_corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    namespace = run_vlm_block('"llava/"')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with namespace["pipeline"].shard(0, 1, global_batch_size=2) as loader:
        images = [int(batch.ragged_counts["image_grid"].sum()) for _, batch in zip(range(6), loader)]
        skipped = loader.stats()["datasets"]["llava"]["total"].get("skipped", {})
    assert all(images) and sum(images) >= 6, images
    assert set(skipped) <= {"missing_image_file"}, skipped


def test_vlm_readme_recipe_for_preference_pairs_runs_as_printed_and_packs_each_pair_in_one_row(
        tmp_path, monkeypatch):
    """vlm/README.md's "Preference pairs with pictures" block, in a directory holding `prefs/` as it
    names it (JSON Lines of a question, two answers and an image's path), with the pairs block's
    Tekken tokenizer and placeholders: each row holds pairs, each pair's two documents one record's,
    each with its image."""
    from tests.unit.test_vlm_image_paths import write_corpus

    images = write_corpus(tmp_path) / "images"
    (tmp_path / "prefs").mkdir()
    images.rename(tmp_path / "prefs" / "images")
    names = sorted(path.name for path in (tmp_path / "prefs" / "images").glob("*.jpg"))
    records = [{"image": f"images/{names[k % len(names)]}", "question": f"What is picture {k}?",
                "chosen": f"Picture {k}.", "rejected": f"Picture {k + 1}."} for k in range(24)]
    (tmp_path / "prefs" / "part-000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.chdir(tmp_path)
    namespace = run_vlm_block('"prefs/"')
    with namespace["pipeline"].shard(0, 1, global_batch_size=4) as loader:
        for _, batch in zip(range(4), loader):
            for row, sources in enumerate(batch.sources):
                assert len(sources) % 2 == 0 and all(sources[k] == sources[k + 1] for k in range(0, len(sources), 2))
            assert int(batch.ragged_counts["image_grid"].sum()) == sum(len(s) for s in batch.sources)
        assert loader.stats()["datasets"]["prefs"]["total"].get("skipped", {}) == {}


@requires_torch
def test_vlm_readme_recipe_for_image_markers_runs_as_printed_and_places_each_image_where_its_marker_was(
        tmp_path, monkeypatch):
    """vlm/README.md's "Images placed by markers in the text" block, in a directory holding
    `llava_mix/` as it names it (LLaVA-style JSON Lines, `<image>` in their texts), with the pairs
    block's Tekken tokenizer and placeholders: its rows hold the images, each image's placeholders
    where its marker was, and the record with a marker too many is counted as such."""
    from tests.unit.test_vlm_image_markers import text_and_images, texts_in, write_corpus

    write_corpus(tmp_path).rename(tmp_path / "llava_mix")
    monkeypatch.chdir(tmp_path)
    namespace = run_vlm_block('"llava_mix/"')
    tokenizer, placeholders = namespace["tokenizer"], namespace["placeholders"]
    wanted = {f"<s>{text}</s>" for text, _ in map(text_and_images, range(12))}
    with namespace["pipeline"].shard(0, 1, global_batch_size=2) as loader:
        texts, images = [], 0
        for _, batch in zip(range(8), loader):
            arrays = batch.to_numpy()
            images += len(arrays["image_token_offset"])
            texts += texts_in(arrays, tokenizer, placeholders)
        skipped = loader.stats()["datasets"]["llava"]["total"].get("skipped", {})
    assert images > 0 and len(set(texts)) >= 3, texts
    assert set(texts) <= wanted, "each image where its marker was, the marker's text gone"
    assert set(skipped) <= {"marker_count_mismatch"}, skipped
