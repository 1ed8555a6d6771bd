"""Qwen2-VL's own video layout (`QwenPlaceholders(video_pad=...)`): a decoded video packed as one
block of `<|video_pad|>` over its temporal patches (frame pairs), its frames in the rows' `video_*`
fields, and its M-RoPE positions.

The oracles are transformers' own code: the video processor's patchify (its frame pairing, the
odd last frame repeated, and its row layout) for `qwen_video_pixel_values`, and the models'
`get_rope_index` for the positions, wherever transformers' rule for the text after a video is
the rule of Qwen's own training code (see `vlm._mrope`); where they part, the positions are
written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_mixed_media import TOKENIZER, _epoch, mixed_source, write_mixed_corpus
from tests.unit.test_vlm_mrope import model_positions
from vlm import ImageSpec, QwenPlaceholders, VideoSpec, qwen_video_pixel_values
from vlm._packing import MultimodalPacker, PackMultimodal
from zephon import ConfigurationError, Pipeline
from zephon._records import RecordAddress
from zephon._sequence import IGNORE_INDEX

VIDEO_PAD = 17
PLACEHOLDERS = QwenPlaceholders(14, 15, 16, merge_size=2, video_pad=VIDEO_PAD)
SPEC = ImageSpec.qwen2_vl(min_pixels=56 * 56, max_pixels=224 * 224)


def _packer(max_length: int = 64, *, mrope: bool = False, placeholders=PLACEHOLDERS) -> MultimodalPacker:
    return MultimodalPacker(None, max_length=max_length, placeholders=placeholders, spec=SPEC, pad_id=0, mrope=mrope)


def _video(frames: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(frames, rows·14, cols·14, 3) random uint8 frames, on the Qwen2-VL spec's patch grid."""
    return np.random.default_rng(seed).integers(0, 256, (frames, rows * 14, cols * 14, 3), dtype=np.uint8)


def _image(rows: int, cols: int) -> np.ndarray:
    return np.full((rows * 14, cols * 14, 3), 9, np.uint8)


def _text(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("clips", "shard-0", i)


FRAME_INTERVAL = 0.25
"""Seconds between sampled frames, as `decode_video` writes them beside the frames."""


def _push(packer: MultimodalPacker, i: int, record: dict) -> list:
    return packer.push((_address(i), {"pixels_frame_interval_s": FRAME_INTERVAL, **record}))


def _one_row(packer: MultimodalPacker, *records: dict):
    for i, record in enumerate(records):
        assert _push(packer, i, record) == []
    [row] = packer.flush()
    return row


# -- the layout ----------------------------------------------------------------------------------

def test_a_video_is_one_block_of_video_pads_over_its_frame_pairs_and_learns_nothing_but_the_text_after():
    """3 frames of 4x6 patches: 2 temporal patches (the third frame repeated) of 2x3 merged cells,
    12 `<|video_pad|>` between one start and one end token; the image beside it keeps its own
    layout and fields."""
    row = _one_row(_packer(), {"input_ids": _text(40, 41), "pixels": _video(3, 4, 6),
                               "image_offsets": [1]},
                   {"input_ids": _text(50), "pixels": [_image(2, 2)]})
    ids = row.tokens["input_ids"]
    video_block = [14] + [VIDEO_PAD] * 12 + [16]
    assert ids[:16].tolist() == [40] + video_block + [41]
    assert ids[16:20].tolist() == [14, 15, 16, 50], "the image is laid out as before"
    assert row.ragged["video_grid"].tolist() == [[2, 4, 6]]
    assert row.ragged["video_token_offset"].tolist() == [1]
    assert row.ragged["video_pixel_values"].shape == (2 * 2 * 4 * 6, 14 * 14 * 3)
    assert row.ragged["image_grid"].tolist() == [[2, 2]] and row.ragged["image_token_offset"].tolist() == [16]
    assert row.ragged["pixel_values"].shape == (4, 14 * 14 * 3)
    labels = row.tokens["labels"]
    assert labels[:15].tolist() == [IGNORE_INDEX] * 14 + [41], "only the video's end token predicts the text after"
    assert row.num_real_tokens == 20
    # Counted by the frames the row holds (4 for the 3-frame video) and the image, as its plan counts.
    assert row.images_by_dataset == {"clips": 5}
    planner = MultimodalPacker(None, max_length=64, placeholders=PLACEHOLDERS, spec=SPEC, pad_id=0, assemble=False)
    plan = _one_row(planner, {"input_ids": _text(40, 41), "pixels": _video(3, 4, 6), "image_offsets": [1]},
                    {"input_ids": _text(50), "pixels": [_image(2, 2)]})
    assert plan.images_by_dataset == {"clips": 5}


def video_processor_patchify():
    """transformers' `Qwen2VLVideoProcessor.patchify`, its own code, compiled from its module's
    source: the module imports torchvision, which the test environment lacks (its wheels are
    built against the CUDA torch), while the method needs torch alone."""
    import ast
    import importlib.util

    import torch

    path = importlib.util.find_spec("transformers.models.qwen2_vl").submodule_search_locations[0]
    tree = ast.parse(open(f"{path}/video_processing_qwen2_vl.py", encoding="utf-8").read())
    [cls] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Qwen2VLVideoProcessor"]
    [method] = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "patchify"]
    namespace = {"torch": torch}
    exec(compile(ast.Module([method], []), path, "exec"), namespace)  # noqa: S102 - transformers' own source
    return namespace["patchify"]


def test_a_video_s_frames_become_the_qwen_video_processors_rows_the_odd_last_one_repeated():
    """`qwen_video_pixel_values` of the row's uint8 frames equals transformers' Qwen2-VL video
    processor's patchify of the same frames, normalised alike: its pairing of frames (an odd
    count's last frame twice), its merged-cell order and its (channel, frame, row, col) rows."""
    torch = pytest.importorskip("torch")
    from vlm import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    patchify = video_processor_patchify()

    videos = [_video(3, 4, 6, seed=1), _video(4, 2, 2, seed=2)]
    row = _one_row(_packer(96), *({"input_ids": _text(40 + i), "pixels": video} for i, video in enumerate(videos)))
    got = qwen_video_pixel_values(row.ragged["video_pixel_values"], row.ragged["video_grid"])
    mean = torch.tensor(OPENAI_CLIP_MEAN).reshape(1, 1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).reshape(1, 1, 3, 1, 1)
    wants, grids = [], []
    for video in videos:
        frames = torch.from_numpy(video).permute(0, 3, 1, 2)[None].to(torch.float32)
        frames = (frames / 255 - mean) / std
        patches, t, h, w = patchify(None, frames, patch_size=14, merge_size=2, temporal_patch_size=2)
        wants.append(patches[0].numpy())
        grids.append([t, h, w])
    assert row.ragged["video_grid"].tolist() == grids == [[2, 4, 6], [2, 2, 2]]
    want = np.concatenate(wants)
    assert got.shape == want.shape == (2 * 4 * 6 + 2 * 2 * 2, 3 * 2 * 14 * 14)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # The processor's token count for a video: its grid's product over the merged cell.
    assert [row.tokens["input_ids"].tolist().count(VIDEO_PAD)] == [sum(t * h * w // 4 for t, h, w in grids)]


def test_without_video_pad_a_video_is_packed_as_images_and_the_fingerprint_is_unchanged():
    """The layout is opt-in: recipes made before it keep their rows and their fingerprint."""
    frames_as_images = QwenPlaceholders(14, 15, 16, merge_size=2)
    row = _one_row(_packer(placeholders=frames_as_images), {"input_ids": _text(40), "pixels": _video(3, 2, 2)})
    assert row.ragged["image_grid"].tolist() == [[2, 2]] * 3 and "video_grid" not in row.ragged
    assert PackMultimodal(64, frames_as_images, SPEC).fingerprint(0)["placeholders"] == {
        "class": "vlm._placeholders.QwenPlaceholders", "vision_start": 14, "image_pad": 15, "vision_end": 16,
        "merge_size": 2}
    assert PackMultimodal(64, PLACEHOLDERS, SPEC).fingerprint(0)["placeholders"]["video_pad"] == VIDEO_PAD


def test_video_pad_is_a_placeholder_id_text_and_padding_may_not_hold():
    packer = _packer()
    assert _push(packer, 0, {"input_ids": _text(40, VIDEO_PAD), "pixels": _video(2, 2, 2)}) == []
    assert [reason for _, reason, _ in packer.drain_skips()] == ["placeholder_in_text"]
    with pytest.raises(ConfigurationError, match="pad_id=17 is an image placeholder id"):
        MultimodalPacker(None, max_length=64, placeholders=PLACEHOLDERS, spec=SPEC, pad_id=VIDEO_PAD)
    with pytest.raises(ConfigurationError, match="must be distinct"):
        QwenPlaceholders(14, 15, 16, video_pad=15)


def test_a_video_too_long_for_a_row_is_skipped_by_name():
    packer = _packer(32)
    assert _push(packer, 0, {"input_ids": _text(40), "pixels": _video(16, 4, 4)}) == []
    [(_, reason, detail)] = packer.drain_skips()
    assert reason == "images_exceed_length" and "take 34 tokens (patch grids 8 temporal x 4x4)" in detail


def test_a_text_s_markers_place_a_whole_video_once():
    from zephon._markers import MarkerOffsets

    packer = _packer()
    per_frame = {"input_ids": _text(40, 41), "pixels": _video(2, 2, 2), "image_offsets": MarkerOffsets([1, 1], "<v>")}
    assert _push(packer, 0, per_frame) == []
    [(_, reason, detail)] = packer.drain_skips()
    assert reason == "marker_count_mismatch" and "one marker per image (a video: one)" in detail
    row = _one_row(packer, {"input_ids": _text(40, 41), "pixels": _video(2, 2, 2),
                            "image_offsets": MarkerOffsets([1], "<v>")})
    assert row.tokens["input_ids"][:5].tolist() == [40, 14, VIDEO_PAD, 16, 41]


# -- M-RoPE ----------------------------------------------------------------------------------------

@requires_torch
@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl"])
def test_video_positions_are_the_models_for_documents_of_videos_images_and_text(model):
    """Documents of text, a video (temporal patches no more than its merged rows or columns, where
    transformers' rule and Qwen's agree) and an image, several to a row: each document gets,
    token for token, the positions the model computes for it alone."""
    documents = [  # (record, its images' grids, its videos' grids)
        ({"input_ids": _text(40, 41, 42), "pixels": _video(4, 4, 6), "image_offsets": [1]}, [], [(2, 4, 6)]),
        ({"input_ids": _text(43), "pixels": _video(3, 6, 4)}, [], [(2, 6, 4)]),
        ({"input_ids": _text(44, 45), "pixels": _video(2, 2, 2), "image_offsets": [2]}, [], [(1, 2, 2)]),
    ]
    packer = _packer(128, mrope=True)
    row = _one_row(packer, *(record for record, _, _ in documents))
    mixed = {"input_ids": _text(46, 47), "pixels": [_image(4, 2)], "image_offsets": [1]}
    _push(packer, 9, mixed)
    _push(packer, 10, {"input_ids": _text(48), "pixels": _video(5, 6, 4), "image_offsets": [1]})
    [second] = packer.flush()
    cases = [(row, documents), (second, [(mixed, [(4, 2)], []), (None, [], [(3, 6, 4)])])]
    checked = 0
    for packed, docs in cases:
        mrope, doc_ids, ids = packed.tokens["mrope_position_ids"], packed.tokens["document_ids"], packed.tokens["input_ids"]
        assert not mrope[:, doc_ids == -1].any(), "padding is position 0"
        for number, (_, images, videos) in enumerate(docs):
            where = np.flatnonzero(doc_ids == number)
            want = model_positions(model, ids[where], images, videos=videos, video_pad=VIDEO_PAD)
            np.testing.assert_array_equal(mrope[:, where], want, err_msg=f"document {number}")
            checked += 1
    assert checked == 5


def test_the_text_after_a_video_longer_than_its_grid_resumes_past_its_last_temporal_position():
    """Qwen's rule, written out: text, a video of 3 temporal patches of one merged cell, text. Its
    cells sit at t = 2, 3, 4 (h = w = 2); the end token and the text after take one past the
    largest position of the block, 5 and 6. (transformers' `get_rope_index` from 5.3 resumes one
    past the spatial grid instead, at 3 and 4, below the block's own temporal positions.)"""
    row = _one_row(_packer(16, mrope=True), {"input_ids": _text(40, 41), "pixels": _video(6, 2, 2),
                                             "image_offsets": [1]})
    assert row.tokens["input_ids"][:7].tolist() == [40, 14, VIDEO_PAD, VIDEO_PAD, VIDEO_PAD, 16, 41]
    assert row.tokens["mrope_position_ids"][:, :7].tolist() == [
        [0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 5, 6],
    ]


# -- through the pipeline ------------------------------------------------------------------------

def _mixed_pipeline(root, runner: str, placeholders=QwenPlaceholders(3, 4, 5, video_pad=6), *,
                    tokens_per_second: int | None = 2, defer: bool = False):
    """Photos and 3-frame clips (`test_vlm_mixed_media`'s corpus) in rows of 256 with M-RoPE, in
    Qwen2.5-VL's layout (time-spaced) unless told otherwise; `defer` decodes the photos after
    packing."""
    spec = ImageSpec.qwen2_vl(max_pixels=56 * 56 * 4)
    return (
        Pipeline(mixed_source(root)).options(num_lanes=4, runner=runner, flush_every_chunks=2)
        .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>", parallelism=2)
        .decode_images(field="jpg", spec=spec, datasets="photos", parallelism=2, defer=defer)
        .decode_video(field="mp4", spec=VideoSpec(num_frames=3, image=spec), datasets="clips", parallelism=2)
        .pack_multimodal(256, placeholders, mrope=True, mrope_tokens_per_second=tokens_per_second)
        .shuffle(buffer_size=3, seed=2)
        .batch(2)
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_mixed_corpus(tmp_path_factory.mktemp("mixed"))


def test_photos_and_clips_in_qwen_s_layouts_are_the_same_bytes_on_every_runner(corpus):
    """Photos and 3-frame clips mixed: every microbatch carries both layouts' fields (maybe
    empty), clips only in the video fields, each counted by the frames its rows hold (two
    temporal patches, 4 frames), and the batches' SHA-256s are the same from separately built
    pipelines on the inline, thread and process runners."""
    runs = {runner: _epoch(_mixed_pipeline(corpus, runner)) for runner in ("inline", "thread", "process")}
    batches, stats = runs["inline"]
    mixture = stats["mixture"]
    videos = images = 0
    for batch in batches:
        assert {"video_pixel_values", "video_grid", "video_token_offset", "pixel_values", "image_grid"} <= set(batch.ragged)
        for sources, offsets in (("video_token_offset", "video_grid"), ("image_token_offset", "image_grid")):
            assert len(batch.ragged[sources]) == len(batch.ragged[offsets])
        assert (batch.ragged["video_grid"][:, 0] == 2).all()
        assert (batch.ragged["video_second_per_grid"] > 0).all()
        assert len(batch.ragged["video_second_per_grid"]) == len(batch.ragged["video_grid"])
        videos += len(batch.ragged["video_grid"])
        images += len(batch.ragged["image_grid"])
        assert int((batch.tokens["input_ids"] == 6).sum()) == int(
            (batch.ragged["video_grid"].prod(axis=1) // 4).sum())
    assert videos > 0 and images > 0
    assert mixture["clips"]["images"] == 4 * videos and mixture["photos"]["images"] == images
    digests = [batch.digest() for batch in batches]
    for runner, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, runner


def test_photos_and_clips_in_qwen_s_layouts_saved_on_two_ranks_resume_on_four_with_the_same_global_batches(corpus):
    """Saved after two microbatches on each of 2 ranks (thread runner), resumed on 4 (process
    runner): every later global batch is the uninterrupted single-rank run's, by SHA-256."""
    import json

    from tests.determinism.test_vlm_mixed_media_elastic import global_digests
    from tests.reliability.harness import checkpoint_after, run_epoch

    reference = global_digests(run_epoch(_mixed_pipeline(corpus, "inline"), 1, keep_batches=False).digests)
    state = json.loads(json.dumps(checkpoint_after(_mixed_pipeline(corpus, "thread"), 2, 2)))
    rest = run_epoch(_mixed_pipeline(corpus, "process"), 4, state=state, keep_batches=False)
    resumed = global_digests(rest.digests)
    assert resumed and sorted(resumed) == sorted(set(reference) - {0})
    assert resumed == {step: reference[step] for step in resumed}


# -- Qwen2.5-VL's time-spaced positions: pack_multimodal(mrope_tokens_per_second=...) ---------------

@requires_torch
@pytest.mark.parametrize("interval", [0.5, 0.3, 0.125])
def test_qwen2_5_vl_video_positions_are_spaced_by_time_as_the_model_spaces_them(interval):
    """At 2 tokens a second, frames `interval` s apart: each temporal patch spans 2 x interval s,
    its t the patch's index times 4 x interval, rounded down as the model rounds its float32
    product (0.3 s: 0, 1, 2); the rows carry those seconds as `video_second_per_grid`. Videos
    whose temporal positions stay within their merged grid, where transformers' rule for the
    text after is Qwen's."""
    packer = MultimodalPacker(None, max_length=128, placeholders=PLACEHOLDERS, spec=SPEC, pad_id=0, mrope=True,
                              mrope_tokens_per_second=2)
    records = [
        {"input_ids": _text(40, 41), "pixels": _video(4, 8, 6), "image_offsets": [1], "pixels_frame_interval_s": interval},
        {"input_ids": _text(42), "pixels": _video(3, 8, 8), "pixels_frame_interval_s": interval},
    ]
    row = _one_row(packer, *records)
    seconds = row.ragged["video_second_per_grid"]
    assert seconds.dtype == np.float32 and seconds.tolist() == pytest.approx([2 * interval] * 2)
    ids, doc_ids, mrope = row.tokens["input_ids"], row.tokens["document_ids"], row.tokens["mrope_position_ids"]
    for number, grid in enumerate([(2, 8, 6), (2, 8, 8)]):
        where = np.flatnonzero(doc_ids == number)
        want = model_positions("qwen2_5_vl", ids[where], [], videos=[grid], video_pad=VIDEO_PAD,
                               seconds=[float(seconds[number])])
        np.testing.assert_array_equal(mrope[:, where], want, err_msg=f"document {number}")
    # The first document's temporal patches (12 merged cells each) after its text token and start token.
    steps = (np.arange(2, dtype=np.float32) * (np.float32(2) * np.float32(2 * interval))).astype(int)
    assert mrope[0, 2:2 + 24:12].tolist() == (2 + steps).tolist() == {0.5: [2, 4], 0.3: [2, 3], 0.125: [2, 2]}[interval]


def test_a_video_spaced_far_in_time_moves_the_text_after_it_past_the_row_s_length():
    """Qwen's rule at 25 tokens a second and 1 s a temporal patch (0.5 s between frames): one
    merged cell, 3 temporal patches at t = 0, 25, 50 past the start token (2, 27, 52); the end
    token at 53 and the text after from 54, though the row is 12 tokens long."""
    packer = MultimodalPacker(None, max_length=12, placeholders=PLACEHOLDERS, spec=SPEC, pad_id=0, mrope=True,
                              mrope_tokens_per_second=25)
    row = _one_row(packer, {"input_ids": _text(40, 41, 42), "pixels": _video(6, 2, 2), "image_offsets": [1],
                            "pixels_frame_interval_s": 0.5})
    assert row.tokens["mrope_position_ids"][:, :8].tolist() == [
        [0, 1, 2, 27, 52, 53, 54, 55],
        [0, 1, 2, 2, 2, 53, 54, 55],
        [0, 1, 2, 2, 2, 53, 54, 55],
    ]
    assert row.tokens["position_ids"][:8].tolist() == list(range(8)), "the 1-D positions are the tokens' own"


def test_time_spacing_is_refused_where_it_would_space_nothing_and_a_video_must_say_its_interval():
    with pytest.raises(ConfigurationError, match="needs mrope=True and QwenPlaceholders"):
        PackMultimodal(64, PLACEHOLDERS, SPEC, mrope_tokens_per_second=2)
    with pytest.raises(ConfigurationError, match="needs mrope=True and QwenPlaceholders"):
        PackMultimodal(64, QwenPlaceholders(14, 15, 16), SPEC, mrope=True, mrope_tokens_per_second=2)
    for bad in (0, -1, float("nan"), True, "2"):
        with pytest.raises(ConfigurationError, match="must be a positive number"):
            PackMultimodal(64, PLACEHOLDERS, SPEC, mrope=True, mrope_tokens_per_second=bad)
    spaced = PackMultimodal(64, PLACEHOLDERS, SPEC, mrope=True, mrope_tokens_per_second=2)
    plain = PackMultimodal(64, PLACEHOLDERS, SPEC, mrope=True)
    assert "mrope_tokens_per_second" not in plain.fingerprint(0)
    assert spaced.fingerprint(0) == {**plain.fingerprint(0), "mrope_tokens_per_second": 2.0}
    packer = _packer(mrope=True)
    with pytest.raises(ConfigurationError, match="needs the seconds between its frames.*'pixels_frame_interval_s'"):
        packer.push((_address(), {"input_ids": _text(40), "pixels": _video(2, 2, 2)}))


def test_decode_video_writes_the_seconds_between_the_frames_it_sampled(tmp_path):
    """A 0.6 s clip (6 frames at 10 fps): 3 frames at the centres of thirds are 0.2 s apart, and so
    are frames taken at 5 fps."""
    from tests.unit.test_vlm_assets import make_video
    from vlm._stages import DecodeVideo

    payload = make_video(tmp_path / "clip.mp4", frames=6, fps=10, size=(56, 56)).read_bytes()
    for spec in (VideoSpec(num_frames=3, image=SPEC), VideoSpec(fps=5, image=SPEC)):
        record = DecodeVideo(field="mp4", spec=spec).build("raise")._decode_record({"mp4": payload}, _address())
        assert record["pixels"].shape[0] == 3
        assert record["pixels_frame_interval_s"] == pytest.approx(0.2)


@requires_torch
def test_a_tiny_qwen2_5_vl_takes_every_batch_of_photos_and_clips(corpus):
    """End to end: each microbatch of the mixed recipe, turned into the model's arguments by
    `qwen_model_inputs` (image and video arguments only where the microbatch holds some), goes
    into a tiny randomly initialised `Qwen2_5_VLForConditionalGeneration` as vlm/README.md shows.
    The model itself checks that each layout's placeholders are as many as its vision tower's
    features for the grids given (a video grid one temporal patch too long is refused so)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from vlm import qwen_model_inputs

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2,
                           window_size=112, fullatt_block_indexes=[0]),
        image_token_id=4, video_token_id=6, vision_start_token_id=3, vision_end_token_id=5,
        bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    both = 0
    with _mixed_pipeline(corpus, "inline").shard(0, 1) as loader:
        for microbatch in loader:
            batch = microbatch.to_training()
            inputs = qwen_model_inputs(batch)
            images, videos = len(batch["image_grid"]), len(batch["video_grid"])
            assert ("pixel_values" in inputs) == bool(images) and ("pixel_values_videos" in inputs) == bool(videos)
            if videos:
                with_videos = inputs
            with torch.no_grad():
                logits = model(**inputs, use_cache=False).logits
            assert logits.shape == (*batch["input_ids"].shape, 8192) and torch.isfinite(logits).all()
            both += bool(images) and bool(videos)
    assert both > 0
    assert_a_video_one_temporal_patch_too_long_is_refused(model, with_videos)


def assert_a_video_one_temporal_patch_too_long_is_refused(model, inputs: dict) -> None:
    """The model checks that a video's placeholders are as many as its vision tower's features:
    `inputs` (a microbatch's, holding videos) with every video grid one temporal patch longer,
    and rows enough for it, are refused."""
    import torch

    longer = inputs["video_grid_thw"].clone()
    longer[:, 0] += 1
    rows = torch.cat([inputs["pixel_values_videos"]] * 2)[: int(longer.prod(dim=1).sum())]
    with torch.no_grad(), pytest.raises(ValueError, match="Video features and video tokens do not match"):
        model(**{**inputs, "video_grid_thw": longer, "pixel_values_videos": rows}, use_cache=False)


def test_the_memory_budget_counts_two_frames_of_pixels_a_video_token_may_carry(corpus):
    """A `<|video_pad|>` stands for a merged cell in both frames of a temporal patch: a row of
    video tokens holds twice the pixels of a row of image tokens, and the budget says so."""
    from tests.reliability.harness import global_batch
    from zephon._memory import memory_budget

    def rows_budget(placeholders) -> tuple[int, int]:
        spec = ImageSpec.qwen2_vl(max_pixels=56 * 56 * 4)
        pipeline = (Pipeline(mixed_source(corpus)).options(num_lanes=4, runner="inline")
                    .tokenize(TOKENIZER, field="txt").decode_video(field="mp4", spec=VideoSpec(2, image=spec))
                    .pack_multimodal(256, placeholders).batch(1))
        with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
            return memory_budget(loader).rows, len(loader.lanes) * (16 + loader.microbatch_size)

    (frames_as_images, rows), (videos, _) = rows_budget(QwenPlaceholders(3, 4, 5)), rows_budget(PLACEHOLDERS)
    cell = 14 * 14 * 4 * 3
    assert videos - frames_as_images == rows * 256 * cell


@requires_torch
def test_model_inputs_carry_each_layout_only_where_present_and_refuse_rows_without_mrope():
    """A microbatch of images alone: the 1-D positions on top of the M-RoPE rows, (4, B, L), the
    uint8 patches turned into rows and no video argument; an image processor's float rows are
    passed as they are. Rows packed without M-RoPE are refused: the model given their (B, L)
    positions would let each document attend to the one before it."""
    import torch

    from vlm import qwen_model_inputs, qwen_pixel_values

    def microbatch(packer) -> dict:
        row = _one_row(packer, {"input_ids": _text(40), "pixels": [_image(2, 4)]})
        return {name: torch.from_numpy(np.ascontiguousarray(array))[None] if name in row.tokens
                else torch.from_numpy(array) for name, array in {**row.tokens, **row.ragged}.items()}

    with pytest.raises(ValueError, match=r"mrope=True"):
        qwen_model_inputs(microbatch(_packer()))
    batch = microbatch(_packer(mrope=True))
    inputs = qwen_model_inputs(batch)
    assert set(inputs) == {"input_ids", "position_ids", "pixel_values", "image_grid_thw"}
    assert inputs["position_ids"].shape == (4, 1, 64)
    assert torch.equal(inputs["position_ids"][0], batch["position_ids"])
    assert torch.equal(inputs["position_ids"][1:], batch["mrope_position_ids"].transpose(0, 1))
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert torch.equal(inputs["pixel_values"], qwen_pixel_values(batch["pixel_values"], batch["image_grid"]))
    processed = {**batch, "pixel_values": torch.rand(8, 1176)}
    assert qwen_model_inputs(processed)["pixel_values"] is processed["pixel_values"]
