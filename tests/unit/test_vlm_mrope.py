"""Qwen2-VL's multimodal rotary positions (`pack_multimodal(mrope=True)`), checked against the models.

The oracle is transformers' own `get_rope_index` (Qwen2-VL, Qwen2.5-VL and Qwen3-VL), called with a
stub in place of the model (it reads only the vision config's merge size and its own position
helper): every document of every packed row must get, token for token, the positions the model
computes for that document's `input_ids` and image grids alone. The rows come from the shipped demo
pairs through the real pipeline, from decoded videos, and from interleaved documents packed by
hand, each sized as its model sizes images: 14 px patches for Qwen2-VL and Qwen2.5-VL, 16 px for
Qwen3-VL, merged 2x2 by all three.
"""

from __future__ import annotations

import io
import tarfile
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.reliability.harness import global_batch, run_epoch
from tests.unit.test_vlm_assets import make_video
from vlm import ImageSpec, PixtralPlaceholders, QwenPlaceholders, VideoSpec
from vlm._assets import pair_shards, tekken_tokenizer
from vlm._packing import MultimodalPacker, PackMultimodal
from zephon import ConfigurationError, Pipeline
from zephon._records import RecordAddress
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

# Tekken control ids that no caption encodes to, standing in for Qwen's vision tokens.
PLACEHOLDERS = QwenPlaceholders(14, 15, 16, merge_size=2)
SPEC = ImageSpec.qwen2_vl(min_pixels=56 * 56, max_pixels=224 * 224)  # up to 16x16 patches: 64 cells
QWEN3_SPEC = ImageSpec(patch_size=16, merge_size=2, min_pixels=64 * 64, max_pixels=256 * 256)  # likewise
MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SPECS = {"qwen2_vl": SPEC, "qwen2_5_vl": SPEC, "qwen3_vl": QWEN3_SPEC}


def model_positions(model: str, input_ids: np.ndarray, grids: list[tuple[int, int]], *,
                    videos: list[tuple[int, int, int]] = (), video_pad: int | None = None,
                    seconds: list[float] | None = None, tokens_per_second: int = 2,
                    image_pad: int = PLACEHOLDERS.image_pad) -> np.ndarray:
    """(3, len(input_ids)) positions transformers' `get_rope_index` gives one document alone,
    its images (rows, cols) in patches, each an image of one temporal step (placeholders
    `image_pad`), and its videos in Qwen's layout (temporal patches, rows, cols; placeholders
    `video_pad`). Qwen2.5-VL spaces a video's temporal patches by `tokens_per_second` times its
    `seconds` (`second_per_grid_ts`), 0.5 s by default: one position a temporal patch, as Qwen2-VL."""
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    cls = {"qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2_5_VLModel, "qwen3_vl": Qwen3VLModel}[model]
    vision = SimpleNamespace(spatial_merge_size=PLACEHOLDERS.merge_size, tokens_per_second=tokens_per_second)
    stub = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    stub.get_vision_position_ids = partial(cls.get_vision_position_ids, stub)
    ids = torch.tensor(np.asarray(input_ids, dtype=np.int64))[None]
    types = (ids == image_pad).int()
    kwargs = {"image_grid_thw": torch.tensor([(1, rows, cols) for rows, cols in grids]) if grids else None}
    if videos:
        types = types + 2 * (ids == video_pad).int()
        kwargs["video_grid_thw"] = torch.tensor(list(videos))
        if model == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.tensor(seconds or [0.5] * len(videos), dtype=torch.float32)
    positions, _ = cls.get_rope_index(stub, ids, types, **kwargs)
    return positions[:, 0].numpy()


def check_rows_against_the_model(model: str, tokens: dict, grids: np.ndarray, offsets: np.ndarray,
                                 images_per_row: np.ndarray) -> tuple[int, int]:
    """Every document of every row has the model's positions, padding 0; returns (documents,
    images) checked."""
    row_of_image = np.repeat(np.arange(len(images_per_row)), images_per_row)
    documents = images = 0
    for i, (input_ids, document_ids, mrope) in enumerate(zip(tokens["input_ids"], tokens["document_ids"],
                                                              tokens["mrope_position_ids"])):
        assert mrope.shape == (3, len(input_ids)) and mrope.dtype == np.int32
        assert not mrope[:, document_ids == -1].any(), "padding is position 0"
        row_grids, row_offsets = grids[row_of_image == i], offsets[row_of_image == i]
        for number in range(document_ids.max() + 1):
            where = np.flatnonzero(document_ids == number)
            start, end = int(where[0]), int(where[-1]) + 1
            inside = (row_offsets >= start) & (row_offsets < end)
            doc_grids = [(int(r), int(c)) for r, c in row_grids[inside]]
            np.testing.assert_array_equal(mrope[:, start:end],
                                          model_positions(model, input_ids[start:end], doc_grids),
                                          err_msg=f"row {i}, document {number}")
            documents += 1
            images += len(doc_grids)
    return documents, images


def check_batches(model: str, batches: list) -> tuple[int, int]:
    documents = images = 0
    for batch in batches:
        d, n = check_rows_against_the_model(model, batch.tokens, batch.ragged["image_grid"],
                                            batch.ragged["image_token_offset"], batch.ragged_counts["image_grid"])
        documents, images = documents + d, images + n
    return documents, images


# -- the positions themselves -------------------------------------------------------------------

def _packer(max_length: int = 32, spec: ImageSpec = SPEC) -> MultimodalPacker:
    return MultimodalPacker(None, max_length=max_length, placeholders=PLACEHOLDERS, spec=spec, pad_id=0,
                            mrope=True)


def _image(rows: int, cols: int, spec: ImageSpec = SPEC) -> np.ndarray:
    return np.zeros((rows * spec.patch_size, cols * spec.patch_size, 3), np.uint8)


def test_mrope_positions_spread_an_image_over_its_merged_grid_and_restart_per_document():
    """Two text tokens, a 4x6-patch image (2x3 merged cells), one more token; then a document of a
    2x2-patch image and a token. Text advances all three positions; the cells take (t, h, w) from
    where the text got to; the text after resumes one past the largest (3 + 3 columns)."""
    pack = _packer(16)
    assert not pack.push((RecordAddress("d", "s", 0), {"input_ids": np.array([40, 41, 42], np.int32),
                                                       "pixels": [_image(4, 6)], "image_offsets": [2]}))
    assert not pack.push((RecordAddress("d", "s", 1), {"input_ids": np.array([43], np.int32),
                                                       "pixels": [_image(2, 2)]}))
    [row] = pack.flush()
    assert row.tokens["input_ids"].tolist() == [40, 41, 14] + [15] * 6 + [16, 42] + [14, 15, 16, 43] + [0]
    assert row.tokens["mrope_position_ids"].tolist() == [
        # 40 41 <vs> six cells (t = 0)  <ve> 42 | <vs> cell <ve> 43 | padding
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 0, 1, 2, 3, 0],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 0, 1, 2, 3, 0],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0],
    ]


def test_rows_carry_no_mrope_positions_unless_asked_and_the_default_fingerprint_is_unchanged():
    plain = MultimodalPacker(None, max_length=32, placeholders=PLACEHOLDERS, spec=SPEC, pad_id=0)
    plain.push((RecordAddress("d", "s", 0), {"input_ids": np.arange(40, 60, dtype=np.int32), "pixels": [_image(2, 2)]}))
    [row] = plain.flush()
    assert set(row.tokens) == {"input_ids", "labels", "position_ids", "document_ids"}
    default = PackMultimodal(32, PLACEHOLDERS, SPEC)
    assert "mrope" not in default.fingerprint(0), "recipes made before the option keep their fingerprint"
    # Turned on, the recipe differs, so a checkpoint made without it is not resumed with it.
    turned_on = PackMultimodal(32, PLACEHOLDERS, SPEC, mrope=True)
    assert turned_on.fingerprint(0) == {**default.fingerprint(0), "mrope": True}


@pytest.mark.parametrize("spec", [ImageSpec.pixtral(), SPEC], ids=["pixtral-spec", "qwen-spec"])
def test_mrope_positions_are_refused_for_a_convention_other_than_qwens(spec):
    """With a Qwen spec the refusal of its 2x2 merge, unlike Pixtral's placeholders, came first and
    advised to change the spec, where what was wrong is asking Pixtral's tokens for Qwen's positions."""
    with pytest.raises(ConfigurationError, match="mrope=True gives Qwen2-VL's rotary positions and needs "
                                                 "QwenPlaceholders, got PixtralPlaceholders"):
        PackMultimodal(32, PixtralPlaceholders(3, 4, 5), spec, mrope=True)
    with pytest.raises(ConfigurationError, match="mrope must be True or False, got 'yes'"):
        PackMultimodal(32, PLACEHOLDERS, SPEC, mrope="yes")


@requires_torch
@pytest.mark.parametrize("model", MODELS)
def test_interleaved_documents_get_the_models_mrope_positions(model):
    """Documents of several images at given offsets (two in a row, one at the very end), a
    document of images alone, text alone, and one whose text is cut to fit."""
    rng = np.random.default_rng(3)
    spec = SPECS[model]
    pack = _packer(96, spec)
    rows, cases = [], set()
    for i in range(40):
        grids = [tuple(int(s) for s in rng.choice([2, 4, 6], 2)) for _ in range((i + 1) % 4)]
        length = [0, 5, 17, 120][i % 4] if i % 3 else int(rng.integers(1, 30))
        offsets = sorted(int(o) for o in rng.integers(0, length + 1, len(grids)))
        if i % 5 == 1 and len(grids) > 1:
            offsets[1], offsets[-1] = offsets[0], length
            cases.update({"two images in a row", "ends on an image"})
        cases.update({"images alone"} if not length else {"text alone"} if not grids else set())
        record = {"input_ids": np.arange(100, 100 + length, dtype=np.int32),
                  "pixels": [_image(*g, spec) for g in grids], "image_offsets": offsets}
        rows += pack.push((RecordAddress("d", "s", i), record))
    rows += pack.flush()
    assert cases == {"two images in a row", "ends on an image", "images alone", "text alone"}
    tokens = {name: np.stack([row.tokens[name] for row in rows]) for name in rows[0].tokens}
    documents, images = check_rows_against_the_model(
        model, tokens, np.concatenate([row.ragged["image_grid"] for row in rows]),
        np.concatenate([row.ragged["image_token_offset"] for row in rows]),
        np.array([len(row.ragged["image_grid"]) for row in rows]))
    assert pack.drain_truncations(), "one document's text was cut to fit"
    assert documents > len(rows) and images > 20


# -- through the pipeline -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_pipeline():
    """The demo's stamp pairs, tokenized with its Tekken tokenizer, sized (Qwen2-VL's way unless
    told) and packed the Qwen way, decoded after packing."""
    pairs, tokenizer = pair_shards(4, 64), tekken_tokenizer()

    def make(mrope: bool = True, runner: str = "inline", spec: ImageSpec = SPEC) -> Pipeline:
        source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(pairs.directory), format="webdataset")],
                                         seed=3, records_per_chunk=8, num_epochs=1)
        return (
            Pipeline(source).options(num_lanes=2, runner=runner, flush_every_chunks=4)
            .tokenize(str(tokenizer), field="txt", bos="<s>", eos="</s>")
            .decode_images(field=("png", "jpg"), spec=spec, defer=True)
            .pack_multimodal(256, PLACEHOLDERS, image_position="after_bos", mrope=mrope)
            .batch(2)
        )

    return make


@pytest.fixture(scope="module")
def demo_rows(demo_pipeline):
    """Every rank's microbatches of one epoch of the demo pairs."""
    return run_epoch(demo_pipeline()).batches


@requires_torch
@pytest.mark.parametrize("model", MODELS)
def test_demo_rows_get_the_models_mrope_positions_per_document(demo_pipeline, demo_rows, model):
    batches = demo_rows if SPECS[model] == SPEC else run_epoch(demo_pipeline(spec=SPECS[model])).batches
    documents, images = check_batches(model, batches)
    rows = sum(len(batch.tokens["input_ids"]) for batch in batches)
    assert images == documents > 4 * rows, "each pair is a document of one image, several a row"
    patch = SPECS[model].patch_size
    assert all(batch.ragged["pixel_values"].shape[1] == patch * patch * 3 for batch in batches), "sized for the model"


@pytest.mark.parametrize("runner", ["thread", "process"])
def test_mrope_rows_are_the_same_bytes_on_every_runner_and_on_two_ranks(demo_pipeline, demo_rows, runner):
    reference = [batch.digest() for batch in sorted(demo_rows, key=lambda b: (b.step, b.lane, b.index))]
    digests = run_epoch(demo_pipeline(runner=runner), world_size=2).digests
    assert [digests[key] for key in sorted(digests)] == reference
    assert all("mrope_position_ids" in batch.tokens for batch in demo_rows)


@requires_torch
def test_mrope_positions_reach_training_as_int64_rows_of_three(demo_rows):
    import torch

    batch = demo_rows[0]
    out = batch.to_training()["mrope_position_ids"]
    assert out.dtype == torch.int64 and tuple(out.shape) == (2, 3, 256)
    assert out.tolist() == batch.tokens["mrope_position_ids"].tolist()


@requires_torch
@pytest.mark.parametrize("model", MODELS)
def test_video_frames_get_the_positions_the_model_gives_them_as_images(tmp_path, model):
    """`decode_video` frames are packed as consecutive images, so the model positions each frame's
    placeholders as an image of one temporal step, after the frame before it (not as its own
    video layout: Qwen2.5-VL's `<|video_pad|>` grids with a temporal index scaled by time, or
    Qwen3-VL's frames each after a `<t seconds>` timestamp in text)."""
    payloads = [make_video(tmp_path / f"v{j}.mp4", frames=8, size=(112 + 28 * j, 84)).read_bytes() for j in range(2)]
    with tarfile.open(tmp_path / "clips-000.tar", "w") as tar:
        for k in range(6):
            for ext, payload in (("txt", (f"clip {k} " * (1 + k % 3)).encode()), ("mp4", payloads[k % 2])):
                info = tarfile.TarInfo(f"k{k:03d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    for j in range(2):
        (tmp_path / f"v{j}.mp4").unlink()  # the shard alone is the dataset
    source = StaticMixtureWorkSource([Dataset.from_path("clips", str(tmp_path))], seed=1, records_per_chunk=2,
                                     num_epochs=1)
    pipeline = (
        Pipeline(source).options(num_lanes=1, runner="inline")
        .tokenize(str(tekken_tokenizer()), field="txt", bos="<s>", eos="</s>")
        .decode_video(field="mp4", spec=VideoSpec(num_frames=3, image=SPECS[model]))
        .pack_multimodal(256, PLACEHOLDERS, image_position="after_bos", mrope=True)
        .batch(1)
    )
    batches = run_epoch(pipeline).batches
    documents, images = check_batches(model, batches)
    assert documents == 6 and images == 18


TEXT_MODELS = {
    # Qwen2-VL rotates each axis on its own contiguous band of frequencies; Qwen3-VL interleaves
    # the bands (t, h, w, t, h, w, ...). Both read the same (3, L) positions.
    "qwen2_vl": ("Qwen2VLConfig", "qwen2_vl.modeling_qwen2_vl", "Qwen2VLTextModel", {"mrope_section": [1, 1, 2]}),
    "qwen3_vl": ("Qwen3VLConfig", "qwen3_vl.modeling_qwen3_vl", "Qwen3VLTextModel",
                 {"mrope_section": [2, 1, 1]}),
}


@requires_torch
@pytest.mark.parametrize("model", TEXT_MODELS)
def test_a_packed_row_given_to_the_text_model_with_its_text_positions_first_equals_each_document_alone(model):
    """What the README tells a trainer to pass: `position_ids` stacked on top of the transposed
    `mrope_position_ids`, (4, B, L), and no attention mask. The text model (Qwen2-VL's, and
    Qwen3-VL's with its interleaved M-RoPE) then masks attention per document (it finds the
    documents where the first row restarts), so each document's hidden states are what the
    document alone gives (a tiny model, random weights)."""
    import importlib

    import torch
    import transformers

    config_name, module, model_name, rope = TEXT_MODELS[model]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(text_config={
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": None, "eos_token_id": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **rope},
    })
    text_model = getattr(importlib.import_module(f"transformers.models.{module}"), model_name)
    text_model = text_model._from_config(config.text_config, attn_implementation="sdpa").eval()
    spec = SPECS[model]
    pack = _packer(40, spec)
    pack.push((RecordAddress("d", "s", 0), {"input_ids": np.arange(30, 36, dtype=np.int32),
                                            "pixels": [_image(4, 6, spec)], "image_offsets": [2]}))
    pack.push((RecordAddress("d", "s", 1), {"input_ids": np.arange(40, 47, dtype=np.int32),
                                            "pixels": [_image(6, 2, spec)], "image_offsets": [3]}))
    [row] = pack.flush()
    ids = torch.from_numpy(row.tokens["input_ids"]).long()[None]
    mrope = torch.from_numpy(row.tokens["mrope_position_ids"]).long()[None].transpose(0, 1)  # (3, 1, L)
    four = torch.cat([torch.from_numpy(row.tokens["position_ids"]).long()[None, None], mrope])
    with torch.no_grad():
        packed = text_model(input_ids=ids, position_ids=four, use_cache=False).last_hidden_state[0]
        for number in range(2):
            where = np.flatnonzero(row.tokens["document_ids"] == number)
            start, end = int(where[0]), int(where[-1]) + 1
            alone = text_model(input_ids=ids[:, start:end], position_ids=mrope[:, :, start:end],
                               use_cache=False).last_hidden_state[0]
            torch.testing.assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-5)


def test_the_memory_budget_counts_the_three_positions_a_row_carries_with_mrope(demo_pipeline):
    from zephon._memory import memory_budget

    def budget(mrope: bool) -> tuple[int, int]:
        """(bytes of rows in the budget, rows it counts per lane and over the lanes)."""
        pipeline = demo_pipeline(mrope)
        with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
            return memory_budget(loader).rows, len(loader.lanes) * (16 + loader.microbatch_size)

    (off, rows), (on, _) = budget(False), budget(True)  # 16 open rows and a microbatch per lane, no shuffle
    assert on - off == rows * 256 * 3 * 4
