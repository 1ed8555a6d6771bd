"""Qwen2-VL's multimodal rotary positions (`pack_multimodal(mrope=True)`), checked against the model.

The oracle is transformers' own `get_rope_index` (Qwen2-VL and Qwen2.5-VL), called with a stub in
place of the model (it reads only the vision config's merge size and its own position helper):
every document of every packed row must get, token for token, the positions the model computes
for that document's `input_ids` and image grids alone. The rows come from the shipped demo pairs
through the real pipeline, from decoded videos, and from interleaved documents packed by hand.
"""

from __future__ import annotations

import io
import tarfile
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.reliability.harness import run_epoch
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
MODELS = ("qwen2_vl", "qwen2_5_vl")


def model_positions(model: str, input_ids: np.ndarray, grids: list[tuple[int, int]]) -> np.ndarray:
    """(3, len(input_ids)) positions transformers' `get_rope_index` gives one document alone,
    its images (rows, cols) in patches, each an image of one temporal step."""
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    cls = {"qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2_5_VLModel}[model]
    vision = SimpleNamespace(spatial_merge_size=PLACEHOLDERS.merge_size, tokens_per_second=2)
    stub = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    stub.get_vision_position_ids = partial(cls.get_vision_position_ids, stub)
    ids = torch.tensor(np.asarray(input_ids, dtype=np.int64))[None]
    image_grid_thw = torch.tensor([(1, rows, cols) for rows, cols in grids]) if grids else None
    positions, _ = cls.get_rope_index(stub, ids, (ids == PLACEHOLDERS.image_pad).int(), image_grid_thw=image_grid_thw)
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

def _packer(max_length: int = 32, **kwargs) -> MultimodalPacker:
    return MultimodalPacker(None, max_length=max_length, placeholders=PLACEHOLDERS, spec=SPEC, pad_id=0,
                            mrope=True, **kwargs)


def _image(rows: int, cols: int) -> np.ndarray:
    return np.zeros((rows * SPEC.patch_size, cols * SPEC.patch_size, 3), np.uint8)


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
    assert PackMultimodal(32, PLACEHOLDERS, SPEC, mrope=True).fingerprint(0) == {**default.fingerprint(0), "mrope": True}


def test_mrope_positions_are_refused_for_a_convention_other_than_qwens():
    with pytest.raises(ConfigurationError, match="mrope=True gives Qwen2-VL's rotary positions and needs "
                                                 "QwenPlaceholders, got PixtralPlaceholders"):
        PackMultimodal(32, PixtralPlaceholders(3, 4, 5), ImageSpec.pixtral(), mrope=True)
    with pytest.raises(ConfigurationError, match="mrope must be True or False, got 'yes'"):
        PackMultimodal(32, PLACEHOLDERS, SPEC, mrope="yes")


@requires_torch
@pytest.mark.parametrize("model", MODELS)
def test_interleaved_documents_get_the_models_mrope_positions(model):
    """Documents of several images at given offsets (two in a row, one at the very end), a
    document of images alone, text alone, and one whose text is cut to fit."""
    rng = np.random.default_rng(3)
    pack = _packer(96)
    rows = []
    for i in range(40):
        grids = [tuple(int(s) for s in rng.choice([2, 4, 6], 2)) for _ in range(i % 4)]
        length = [0, 5, 17, 120][i % 4] if i % 3 else int(rng.integers(1, 30))
        offsets = sorted(int(o) for o in rng.integers(0, length + 1, len(grids)))
        if i % 5 == 0 and grids:
            offsets[-1] = length  # the document ends on an image
        record = {"input_ids": np.arange(100, 100 + length, dtype=np.int32),
                  "pixels": [_image(*g) for g in grids], "image_offsets": offsets}
        if not grids and not length:
            continue
        rows += pack.push((RecordAddress("d", "s", i), record))
    rows += pack.flush()
    tokens = {name: np.stack([row.tokens[name] for row in rows]) for name in rows[0].tokens}
    documents, images = check_rows_against_the_model(
        model, tokens, np.concatenate([row.ragged["image_grid"] for row in rows]),
        np.concatenate([row.ragged["image_token_offset"] for row in rows]),
        np.array([len(row.ragged["image_grid"]) for row in rows]))
    assert pack.drain_truncations(), "one document's text was cut to fit"
    assert documents > len(rows) and images > 20


# -- through the pipeline -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_rows():
    """The demo's stamp pairs, tokenized with its Tekken tokenizer, sized and packed the Qwen way,
    decoded after packing, every rank's microbatches of one epoch."""
    pairs, tokenizer = pair_shards(4, 64), tekken_tokenizer()
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(pairs.directory), format="webdataset")],
                                     seed=3, records_per_chunk=8, num_epochs=1)
    pipeline = (
        Pipeline(source).options(num_lanes=2, runner="inline", flush_every_chunks=4)
        .tokenize(str(tokenizer), field="txt", bos="<s>", eos="</s>")
        .decode_images(field=("png", "jpg"), spec=SPEC, defer=True)
        .pack_multimodal(256, PLACEHOLDERS, image_position="after_bos", mrope=True)
        .batch(2)
    )
    return run_epoch(pipeline).batches


@requires_torch
@pytest.mark.parametrize("model", MODELS)
def test_demo_rows_get_the_models_mrope_positions_per_document(demo_rows, model):
    documents, images = check_batches(model, demo_rows)
    rows = sum(len(batch.tokens["input_ids"]) for batch in demo_rows)
    assert images == documents > 4 * rows, "each pair is a document of one image, several a row"


@requires_torch
def test_mrope_positions_reach_training_as_int64_rows_of_three(demo_rows):
    import torch

    batch = demo_rows[0]
    out = batch.to_training()["mrope_position_ids"]
    assert out.dtype == torch.int64 and tuple(out.shape) == (2, 3, 256)
    assert out.tolist() == batch.tokens["mrope_position_ids"].tolist()


@requires_torch
def test_video_frames_get_the_positions_the_model_gives_them_as_images(tmp_path):
    """`decode_video` frames are packed as consecutive images, so the model positions each frame's
    placeholders as an image of one temporal step, after the frame before it."""
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
        .decode_video(field="mp4", spec=VideoSpec(num_frames=3, image=SPEC))
        .pack_multimodal(256, PLACEHOLDERS, image_position="after_bos", mrope=True)
        .batch(1)
    )
    batches = run_epoch(pipeline).batches
    documents, images = check_batches("qwen2_vl", batches)
    assert documents == 6 and images == 18
