"""Qwen3-VL's video layout (`QwenPlaceholders(video_pad=..., video_timestamps=...)`): each temporal
patch of a decoded video is a block of its own, after the text of its time stamp
(`<2.2 seconds>`), as Qwen3-VL's processor writes a video into its prompt.

The oracles are transformers' own code: `Qwen3VLProcessor.replace_video_token` (its stamps, from
the frames' indices and the video's frame rate, and its blocks), its text encoded by the same
tokenizer, for the rows' tokens; `Qwen3VLModel.get_rope_index` for the M-RoPE positions; and a
tiny randomly initialised `Qwen3VLForConditionalGeneration` for the rows as a whole.
"""

from __future__ import annotations

import re
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_assets import make_video
from tests.unit.test_vlm_mixed_media import TOKENIZER, _epoch
from tests.unit.test_vlm_mrope import QWEN3_SPEC, model_positions
from tests.unit.test_vlm_qwen_video import (  # noqa: F401 - the corpus fixture
    _mixed_pipeline,
    assert_a_video_one_temporal_patch_too_long_is_refused,
    corpus,
)
from vlm import QwenPlaceholders, VideoSpec
from vlm._packing import MultimodalPacker, PackMultimodal
from vlm._placeholders import TimestampText, temporal_patches
from vlm._stages import DecodeVideo
from zephon import ConfigurationError
from zephon._records import RecordAddress
from zephon._sequence import IGNORE_INDEX

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
STAMPED = QwenPlaceholders(3, 4, 5, video_pad=6, video_timestamps=TimestampText.from_tokenizer(TOKENIZER))
"""The mixed corpus's stamped layout: its tokenizer's `!"#$` stand for the vision tokens, as in
`test_vlm_qwen_video`."""


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """The shipped tokenizer with Qwen's vision tokens added as special tokens (no Qwen tokenizer
    ships offline): the processor's text and the packer's ids come from the same vocabulary."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    return tokenizer


def _stamped(tokenizer) -> QwenPlaceholders:
    return QwenPlaceholders.from_tokenizer(tokenizer, video_pad="<|video_pad|>", video_timestamps=True)


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("clips", "shard-0", i)


def _packer(placeholders: QwenPlaceholders, max_length: int = 512, *, mrope: bool = False) -> MultimodalPacker:
    return MultimodalPacker(None, max_length=max_length, placeholders=placeholders, spec=QWEN3_SPEC,
                            pad_id=2, mrope=mrope)


def _one_row(packer: MultimodalPacker, *records: dict):
    for i, record in enumerate(records):
        assert packer.push((_address(i), record)) == []
    [row] = packer.flush()
    return row


def processor_video_text(grid_thw: tuple[int, int, int], frames_indices: list[int], fps: float) -> str:
    """The text Qwen3-VL's processor puts in a prompt for a video of this grid whose frames are
    these indices of a video at `fps` (its own `replace_video_token`, on a stub of the processor
    with the checkpoints' merge and temporal patch sizes)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    stub = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           vision_start_token="<|vision_start|>", video_token="<|video_pad|>",
                           vision_end_token="<|vision_end|>")
    stub._calculate_timestamps = partial(Qwen3VLProcessor._calculate_timestamps, stub)
    inputs = {"video_grid_thw": np.array([grid_thw]),
              "video_metadata": [SimpleNamespace(fps=fps, frames_indices=list(frames_indices))]}
    return Qwen3VLProcessor.replace_video_token(stub, inputs, 0)


def _decoded(path, spec: VideoSpec) -> dict:
    return DecodeVideo(field="mp4", spec=spec).build("raise")._decode_record({"mp4": path.read_bytes()}, _address())


# -- the layout ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("frames", "fps", "spec"), [
    (6, 10, VideoSpec(num_frames=3)),  # 0.1, 0.3, 0.5 s: stamps 0.2, 0.5 (the odd last frame paired with itself)
    (24, 2, VideoSpec(num_frames=5)),  # 12 s: 1.0 and 3.5 s stamp 2.2 (2.25, rounded half to even), then 10.5
    (7, 4, VideoSpec(fps=3)),  # six frames at 0, 0.25, 0.5, 1.0, 1.25, 1.5 s
], ids=["thirds", "twelve-seconds", "by-fps"])
def test_a_stamped_video_is_token_for_token_the_qwen3_vl_processor_s_text(tmp_path, qwen_tokenizer, frames, fps,
                                                                          spec):
    """A real clip decoded by `decode_video`, packed before its caption: the row's document is the
    tokenizer's encoding of the processor's video text (stamps from the frames' indices at the
    clip's frame rate) followed by the caption. Every token of the block learns nothing but its
    last, which predicts the caption."""
    spec = VideoSpec(num_frames=spec.num_frames, fps=spec.fps, image=QWEN3_SPEC)
    record = _decoded(make_video(tmp_path / "clip.mp4", frames=frames, fps=fps, size=(64, 48)), spec)
    shown = record["pixels_frame_times_s"]
    indices = np.rint(shown * fps).astype(int)
    np.testing.assert_array_equal(indices / fps, shown)  # each time is a frame's: index / frame rate
    caption = "a clip of grey frames"
    caption_ids = np.array(qwen_tokenizer(caption, add_special_tokens=False)["input_ids"], dtype=np.int32)
    row = _one_row(_packer(_stamped(qwen_tokenizer)), {**record, "input_ids": caption_ids})

    pixels = record["pixels"]
    grid = (temporal_patches(len(pixels)), pixels.shape[1] // 16, pixels.shape[2] // 16)
    text = processor_video_text(grid, indices.tolist(), fps) + caption
    want = qwen_tokenizer(text, add_special_tokens=False)["input_ids"]
    length = int((row.tokens["document_ids"] == 0).sum())
    assert row.tokens["input_ids"][:length].tolist() == want
    assert row.tokens["document_ids"][length:].tolist() == [-1] * (len(row.tokens["document_ids"]) - length)
    assert re.findall(r"<[\d.]+ seconds>", text)  # the stamps are there to compare
    block = length - len(caption_ids)
    labels = row.tokens["labels"]
    assert (labels[: block - 1] == IGNORE_INDEX).all()
    assert labels[block - 1 : length - 1].tolist() == caption_ids.tolist()
    assert row.ragged["video_token_offset"].tolist() == [0]
    assert row.ragged["video_grid"].tolist() == [list(grid)]


def test_stamps_are_encoded_once_per_text_and_a_different_template_or_tokenizer_is_another_recipe(qwen_tokenizer):
    """The fingerprint holds the tokenizer's digest and the template where stamps are on, and
    nothing new where they are off; `from_tokenizer` takes a tokenizer_id too, with the digest of
    the same tokenizer."""
    stamps = TimestampText.from_tokenizer(TOKENIZER)
    assert stamps.ids(2.25) is stamps.ids(2.2)  # both "<2.2 seconds>"
    assert not stamps.ids(2.25).flags.writeable
    assert stamps == TimestampText.from_tokenizer(TOKENIZER)
    plain = QwenPlaceholders(3, 4, 5, video_pad=6)
    described = PackMultimodal(64, STAMPED, QWEN3_SPEC).fingerprint(0)["placeholders"]
    assert "video_timestamps" not in PackMultimodal(64, plain, QWEN3_SPEC).fingerprint(0)["placeholders"]
    assert stamps.tokenizer_digest in described["video_timestamps"] and "seconds" in described["video_timestamps"]
    other_template = QwenPlaceholders(3, 4, 5, video_pad=6,
                                      video_timestamps=TimestampText.from_tokenizer(TOKENIZER, template="<{seconds:.2f}s>"))
    with_added_tokens = _stamped(qwen_tokenizer)
    fingerprints = {str(PackMultimodal(64, each, QWEN3_SPEC).fingerprint(0)["placeholders"])
                    for each in (STAMPED, other_template, with_added_tokens, plain)}
    assert len(fingerprints) == 4
    assert other_template.video_timestamps.ids(0.5).tolist() != stamps.ids(0.5).tolist()


def test_stamps_need_the_video_layout_a_tokenizer_and_refuse_qwen2_5_vl_time_spacing():
    stamps = TimestampText.from_tokenizer(TOKENIZER)
    with pytest.raises(ConfigurationError, match="give video_pad"):
        QwenPlaceholders(3, 4, 5, video_timestamps=stamps)
    with pytest.raises(ConfigurationError, match="must be a TimestampText"):
        QwenPlaceholders(3, 4, 5, video_pad=6, video_timestamps=True)
    with pytest.raises(ConfigurationError, match="from_tokenizer"):
        TimestampText("0" * 64)
    with pytest.raises(ConfigurationError, match="one float named 'seconds'"):
        TimestampText.from_tokenizer(TOKENIZER, template="<{time} seconds>")
    with pytest.raises(ConfigurationError, match="fast tokenizer"):
        TimestampText.from_tokenizer(object())
    with pytest.raises(ConfigurationError, match="with video_timestamps"):
        MultimodalPacker(None, max_length=64, placeholders=STAMPED, spec=QWEN3_SPEC, pad_id=2, mrope=True,
                         mrope_tokens_per_second=2)


def test_a_video_without_its_frames_times_is_refused_by_name():
    """A video made by a map of the user's, without the times `decode_video` writes, or with times
    that are not one per frame, is refused naming the field; so is a record of two videos."""
    frames = np.zeros((3, 32, 32, 3), np.uint8)
    base = {"input_ids": np.array([40, 41], np.int32), "pixels": frames, "pixels_frame_interval_s": 0.5}
    for times in (None, [0.0, 0.5], [0.0, -0.5, 1.0], [0.0, float("nan"), 1.0], "0 0.5 1"):
        record = base if times is None else {**base, "pixels_frame_times_s": times}
        with pytest.raises(ConfigurationError, match="'pixels_frame_times_s'"):
            _packer(STAMPED).push((_address(), record))
    with pytest.raises(ConfigurationError, match="one video a record"):
        _packer(STAMPED).push((_address(), {**base, "pixels": [frames, frames], "pixels_frame_times_s": [0, 1, 2]}))


def test_decode_video_writes_the_time_each_frame_it_sampled_is_shown(tmp_path):
    """A 0.6 s clip (6 frames at 10 fps): the centres of thirds show the frames at 0.1, 0.3 and
    0.5 s; taken at 5 fps, the frames at 0, 0.2 and 0.4 s; a 2-frame clip asked for 4 frames shows
    each twice."""
    clip = make_video(tmp_path / "clip.mp4", frames=6, fps=10, size=(32, 32))
    for spec, want in ((VideoSpec(num_frames=3, image=QWEN3_SPEC), [0.1, 0.3, 0.5]),
                       (VideoSpec(fps=5, image=QWEN3_SPEC), [0.0, 0.2, 0.4])):
        record = _decoded(clip, spec)
        assert record["pixels_frame_times_s"].dtype == np.float64
        assert record["pixels_frame_times_s"].tolist() == want
    short = _decoded(make_video(tmp_path / "short.mp4", frames=2, fps=10, size=(32, 32)),
                     VideoSpec(num_frames=4, image=QWEN3_SPEC))
    assert short["pixels_frame_times_s"].tolist() == [0.0, 0.0, 0.1, 0.1]


# -- positions -----------------------------------------------------------------------------------

@requires_torch
def test_stamped_video_positions_are_qwen3_vl_s_for_documents_of_videos_images_and_text(qwen_tokenizer):
    """Three documents in a row: a 5-frame clip (3 stamped temporal patches) then its caption; an
    image, text, a 2-frame clip and more text; text alone. Each document's M-RoPE positions equal
    Qwen3-VL's `get_rope_index` of it alone, which positions each stamped patch as an image."""
    placeholders = _stamped(qwen_tokenizer)
    image_pad, video_pad = placeholders.image_pad, placeholders.video_pad
    rng = np.random.default_rng(3)

    def clip(frames: int, rows: int, cols: int, start: float) -> dict:
        pixels = rng.integers(0, 256, (frames, rows * 16, cols * 16, 3), dtype=np.uint8)
        times = start + 0.5 * np.arange(frames)
        return {"pixels": pixels, "pixels_frame_interval_s": 0.5, "pixels_frame_times_s": times}

    def text(n: int, first: int = 40) -> np.ndarray:
        return np.arange(first, first + n, dtype=np.int32)

    image = np.full((4 * 16, 6 * 16, 3), 7, np.uint8)
    records = [
        {**clip(5, 4, 2, 9.25), "input_ids": text(7)},
        {"input_ids": text(12), "pixels": [image, clip(2, 2, 4, 0.0)["pixels"]], "image_offsets": [0, 5],
         "pixels_frame_interval_s": 0.5, "pixels_frame_times_s": [0.0, 0.5]},
        {"input_ids": text(9)},
    ]
    row = _one_row(_packer(placeholders, mrope=True), *records)
    ids, documents, mrope = row.tokens["input_ids"], row.tokens["document_ids"], row.tokens["mrope_position_ids"]
    expected = [([], [(3, 4, 2)]), ([(4, 6)], [(1, 2, 4)]), ([], [])]
    for number, (images, videos) in enumerate(expected):
        where = documents == number
        want = model_positions("qwen3_vl", ids[where], images, videos=videos, video_pad=video_pad,
                               image_pad=image_pad)
        np.testing.assert_array_equal(mrope[:, where], want, err_msg=f"document {number}")
    assert not mrope[:, documents == -1].any()


# -- through the pipeline ------------------------------------------------------------------------

def _stamps_in(batch, tokenizer_json: str = TOKENIZER) -> list[list[float]]:
    """Each video's stamps, read back from its row's tokens: the text before each of its blocks."""
    from tokenizers import Tokenizer

    decode = Tokenizer.from_file(tokenizer_json).decode
    out = []
    offsets = batch.ragged["video_token_offset"]
    rows = np.repeat(np.arange(len(batch.ragged_counts["video_grid"])), batch.ragged_counts["video_grid"])
    for row, at, (temporal, h, w) in zip(rows, offsets, batch.ragged["video_grid"]):
        ids = batch.tokens["input_ids"][row]
        stamps, cursor = [], int(at)
        for _ in range(temporal):
            start = cursor + int(np.flatnonzero(ids[cursor:] == STAMPED.vision_start)[0])
            match = re.fullmatch(r"<(\d+\.\d) seconds>", decode(ids[cursor:start].tolist()))
            assert match, decode(ids[cursor:start].tolist())
            stamps.append(float(match.group(1)))
            cursor = start + 1 + h * w // 4 + 1
            assert ids[start + 1 : cursor - 1].tolist() == [STAMPED.video_pad] * (h * w // 4)
            assert ids[cursor - 1] == STAMPED.vision_end
        out.append(stamps)
    return out


def test_photos_and_stamped_clips_are_the_same_bytes_on_every_runner(corpus):  # noqa: F811
    """Photos and 3-frame clips in Qwen3-VL's layout: every clip's two temporal patches are stamped
    blocks in time order, and the batches' SHA-256s are the same from separately built pipelines on
    the inline, thread and process runners, and on the thread runner with the photos decoded after
    packing (`defer=True`)."""
    runs = {runner: _epoch(_mixed_pipeline(corpus, runner, STAMPED, tokens_per_second=None))
            for runner in ("inline", "thread", "process")}
    runs["thread, deferred"] = _epoch(_mixed_pipeline(corpus, "thread", STAMPED, tokens_per_second=None, defer=True))
    batches, stats = runs["inline"]
    stamped = 0
    for batch in batches:
        for stamps in _stamps_in(batch):
            assert len(stamps) == 2 and 0 <= stamps[0] < stamps[1]
            stamped += 1
    assert stamped > 0 and stats["mixture"]["clips"]["images"] == 4 * stamped
    digests = [batch.digest() for batch in batches]
    for runner, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, runner
    unstamped, _ = _epoch(_mixed_pipeline(corpus, "inline", QwenPlaceholders(3, 4, 5, video_pad=6),
                                          tokens_per_second=None))
    assert [batch.digest() for batch in unstamped] != digests


def test_photos_and_stamped_clips_saved_on_two_ranks_resume_on_four_with_the_same_global_batches(corpus):  # noqa: F811
    """Saved after two microbatches on each of 2 ranks (thread runner), resumed on 4 (process
    runner): every later global batch is the uninterrupted single-rank run's, by SHA-256."""
    import json

    from tests.determinism.test_vlm_mixed_media_elastic import global_digests
    from tests.reliability.harness import checkpoint_after, run_epoch

    def pipeline(runner: str):
        return _mixed_pipeline(corpus, runner, STAMPED, tokens_per_second=None)

    reference = global_digests(run_epoch(pipeline("inline"), 1, keep_batches=False).digests)
    state = json.loads(json.dumps(checkpoint_after(pipeline("thread"), 2, 2)))
    resumed = global_digests(run_epoch(pipeline("process"), 4, state=state, keep_batches=False).digests)
    assert resumed and sorted(resumed) == sorted(set(reference) - {0})
    assert resumed == {step: reference[step] for step in resumed}


@requires_torch
def test_a_tiny_qwen3_vl_takes_every_batch_of_photos_and_stamped_clips(corpus):  # noqa: F811
    """End to end: each microbatch, turned into the model's arguments by `qwen_model_inputs`, goes
    into a tiny randomly initialised `Qwen3VLForConditionalGeneration`, which checks that each
    layout's placeholders are as many as its vision tower's features."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from vlm import qwen_model_inputs

    config = Qwen3VLConfig(
        text_config=dict(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=4, video_token_id=6, vision_start_token_id=3, vision_end_token_id=5)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    videos = 0
    with _mixed_pipeline(corpus, "inline", STAMPED, tokens_per_second=None).shard(0, 1) as loader:
        for microbatch in loader:
            batch = microbatch.to_training()
            inputs = qwen_model_inputs(batch)
            with torch.no_grad():
                logits = model(**inputs, use_cache=False).logits
            assert logits.shape == (*batch["input_ids"].shape, 8192) and torch.isfinite(logits).all()
            if len(batch["video_grid"]):
                videos, with_videos = videos + len(batch["video_grid"]), inputs
    assert videos > 0
    assert_a_video_one_temporal_patch_too_long_is_refused(model, with_videos)


def test_a_tokenizer_that_pads_gives_stamps_and_text_around_images_unpadded():
    """A tokenizer.json may switch padding on (hub files saved for a fixed length): the stamps and
    `PadPlaceholders`' text around an image are the text's ids alone, as without it."""
    from tokenizers import Tokenizer

    from vlm import PadPlaceholders

    padding = Tokenizer.from_file(TOKENIZER)
    padding.enable_padding(pad_id=2, length=32)
    assert len(padding.encode("<2.5 seconds>").ids) == 32
    plain = TimestampText.from_tokenizer(TOKENIZER)
    assert TimestampText.from_tokenizer(padding).ids(2.5).tolist() == plain.ids(2.5).tolist()
    around = PadPlaceholders.from_tokenizer(padding, pad="!", text_before="\n\n", text_after=" seen")
    assert around.text_before == tuple(Tokenizer.from_file(TOKENIZER).encode("\n\n").ids)
    assert 0 < len(around.text_after) < 32
