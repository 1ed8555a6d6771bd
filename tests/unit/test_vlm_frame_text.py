"""Text around a video's frames taken as images (`pack_multimodal(frame_text=FrameText...)`):
SmolVLM2's count, length and per-frame times, InternVL's frame numbers.

The oracles are transformers' own: `SmolVLMProcessor.replace_video_token` and
`InternVLProcessor.replace_video_token`, on stubs of the processors holding their tokens and
`image_seq_len`, their text encoded by the same tokenizer, for the rows' tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_vlm_assets import make_video
from tests.unit.test_vlm_fixed_size import assert_each_packed_document_is_its_own
from tests.unit.test_vlm_mixed_media import TOKENIZER, _epoch, mixed_source, photos_and_clips
from tests.unit.test_vlm_qwen_video import corpus  # noqa: F401 - the photos-and-clips corpus fixture
from tests.unit.test_vlm_split import IMAGE_TOKENS, TILE_NAMES, tiny_idefics3
from vlm import (FrameText, Idefics3Placeholders, ImageSpec, LlavaNextPlaceholders, PadPlaceholders, QwenPlaceholders,
                 VideoSpec, image_tensors)
from vlm._packing import MultimodalPacker, PackMultimodal
from vlm._stages import DecodeVideo
from zephon import ConfigurationError, Pipeline
from zephon._records import RecordAddress
from zephon._sequence import IGNORE_INDEX

SMOL_FRAMES = ImageSpec(patch_size=16, merge_size=4, fit="fixed", size=(128, 128), resample="lanczos")
"""SmolVLM's frames at a quarter of their side: 8x8 patches of 16 px merged 4x4, 4 `<image>` a frame."""

INTERNVL_FRAMES = ImageSpec(patch_size=14, merge_size=2, fit="fixed", size=(56, 56), resample="bicubic")
"""InternVL's frames, one tile each, at an eighth of their side: 4 `<IMG_CONTEXT>` a frame."""


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped tokenizer with Idefics3's and InternVL's image tokens added as special tokens
    (neither model's tokenizer ships offline)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens([*IMAGE_TOKENS, "<img>", "</img>", "<IMG_CONTEXT>"], special_tokens=True)
    return tokenizer


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("clips", "shard-0", i)


def _decoded(path, spec: VideoSpec) -> dict:
    return DecodeVideo(field="mp4", spec=spec).build("raise")._decode_record({"mp4": path.read_bytes()}, _address())


def _one_row(packer: MultimodalPacker, *records: dict):
    for i, record in enumerate(records):
        assert packer.push((_address(i), record)) == []
    [row] = packer.flush()
    return row


def smolvlm_video_text(times: list[float], duration: float | None, image_seq_len: int) -> str:
    """The text SmolVLM's processor puts in a prompt for a video of frames shown at `times`
    (its own `replace_video_token`, on a stub holding its tokens)."""
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

    stub = SimpleNamespace(image_seq_len=image_seq_len, image_token="<image>",
                           fake_image_token="<fake_token_around_image>", global_image_token="<global-img>")
    metadata = SimpleNamespace(fps=1.0, timestamps=list(times), duration=duration)
    return SmolVLMProcessor.replace_video_token(stub, {"video_metadata": [metadata]}, 0)


def internvl_video_text(frames: int, image_seq_length: int) -> str:
    """The text InternVL's processor puts in a prompt for a video of `frames` frames."""
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    stub = SimpleNamespace(start_image_token="<img>", end_image_token="</img>", image_token="<IMG_CONTEXT>",
                           image_seq_length=image_seq_length)
    return InternVLProcessor.replace_video_token(stub, {"pixel_values_videos": [np.zeros((frames, 1))]}, 0)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- the processors' text ------------------------------------------------------------------------

@pytest.mark.parametrize(("frames", "fps", "spec"), [
    (24, 2, VideoSpec(fps=1)),  # 12 s: twelve frames, 00:00 to 00:11
    (9, 4, VideoSpec(num_frames=3)),  # 2.25 s: three frames inside the seconds, a duration of 0:00:02
], ids=["by-fps", "short"])
def test_a_smolvlm2_video_is_token_for_token_the_processor_s_text(tmp_path, tokenizer, frames, fps, spec):
    """A real clip decoded by `decode_video` and packed before its caption with SmolVLM's frame
    text: the row's document is the tokenizer's encoding of SmolVLM's processor's video text
    (the count in words, the length, each frame's block after its time) and the caption. Every
    token of the video learns nothing but its last, which predicts the caption; each frame's
    image offset is its block's first token."""
    spec = VideoSpec(num_frames=spec.num_frames, fps=spec.fps, image=SMOL_FRAMES)
    record = _decoded(make_video(tmp_path / "clip.mp4", frames=frames, fps=fps, size=(64, 48)), spec)
    assert record["pixels_duration_s"] == pytest.approx(frames / fps)
    caption = "a clip of grey frames"
    caption_ids = np.array(_ids(tokenizer, caption), dtype=np.int32)
    placeholders = Idefics3Placeholders.from_tokenizer(tokenizer, merge_size=4)
    packer = MultimodalPacker(None, max_length=600, placeholders=placeholders, spec=SMOL_FRAMES, pad_id=0,
                              frame_text=FrameText.smolvlm(tokenizer))
    row = _one_row(packer, {**record, "input_ids": caption_ids})

    video = smolvlm_video_text(record["pixels_frame_times_s"].tolist(), frames / fps, image_seq_len=4)
    want = _ids(tokenizer, video + caption)
    length = int((row.tokens["document_ids"] == 0).sum())
    assert row.tokens["input_ids"][:length].tolist() == want
    assert f"series of {'twelve' if frames == 24 else 'three'} frames from a 0:00:{frames // fps:02d}" in video
    block = length - len(caption_ids)
    labels = row.tokens["labels"]
    assert (labels[: block - 1] == IGNORE_INDEX).all()
    assert labels[block - 1 : length - 1].tolist() == caption_ids.tolist()
    fake_around = tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    opening = np.flatnonzero(row.tokens["input_ids"][:block] == fake_around)[::2]  # each block opens and closes
    assert row.ragged["image_token_offset"].tolist() == opening.tolist()
    assert len(row.ragged["image_grid"]) == len(record["pixels"])


@pytest.fixture(scope="module")
def seam_tokenizer():
    """A byte-level BPE trained here on text full of blank lines, so that it encodes `\n\n` alone
    as one token and before a word as two `\n`, as GPT-2's and SmolLM2's do, with Idefics3's
    image tokens special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=IMAGE_TOKENS, show_progress=False)
    backend.train_from_iterator(["a clip of grey frames\n\nseries of frames from a video\n\n\n\nFrame from"] * 50,
                                trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_the_outro_is_encoded_with_the_caption_after_it_as_the_processor_encodes_them(tmp_path, seam_tokenizer):
    """With a tokenizer that encodes `\n\n` alone as one token and before a word as two, a clip
    packed before its caption is, token for token, the encoding of SmolVLM's processor's text
    and the caption as one text: SmolVLM2's closing `\n\n` is split as the caption after it
    splits it, not encoded on its own."""
    tokenizer = seam_tokenizer
    spec = VideoSpec(num_frames=2, image=SMOL_FRAMES)
    record = _decoded(make_video(tmp_path / "clip.mp4", frames=8, fps=4, size=(64, 48)), spec)
    caption = "a clip of grey frames"
    caption_ids = np.array(_ids(tokenizer, caption), dtype=np.int32)
    frame_text = FrameText.smolvlm(tokenizer)
    alone, before_caption = frame_text.pieces(2, record["pixels_frame_times_s"], 2.0)[-1], \
        frame_text.outro_before(caption_ids)
    assert len(alone) == 1 and len(before_caption) == 2  # the seam matters to this tokenizer
    packer = MultimodalPacker(None, max_length=300, placeholders=Idefics3Placeholders.from_tokenizer(tokenizer,
                              merge_size=4), spec=SMOL_FRAMES, pad_id=300, frame_text=frame_text)
    row = _one_row(packer, {**record, "input_ids": caption_ids})
    video = smolvlm_video_text(record["pixels_frame_times_s"].tolist(), 2.0, image_seq_len=4)
    length = int((row.tokens["document_ids"] == 0).sum())
    assert row.tokens["input_ids"][:length].tolist() == _ids(tokenizer, video + caption)
    video_only = _one_row(MultimodalPacker(None, max_length=300, placeholders=packer.placeholders, spec=SMOL_FRAMES,
                                           pad_id=300, frame_text=frame_text), {**record, "input_ids": []})
    ends = int((video_only.tokens["document_ids"] == 0).sum())
    assert video_only.tokens["input_ids"][:ends].tolist() == _ids(tokenizer, video)  # nothing after: alone


def test_the_smolvlm2_text_writes_minutes_and_hours_as_the_processor_does(tokenizer):
    """Past a minute, a frame's time is MM:SS and the length H:MM:SS, whole seconds rounded down,
    as `SmolVLMProcessor` writes them; the pieces are its text cut at the image blocks."""
    text = FrameText.smolvlm(tokenizer)
    times = np.array([0.0, 59.99, 65.6, 3725.2])
    pieces = text.pieces(4, times, 3726.9)
    block = "<fake_token_around_image><global-img><image><fake_token_around_image>"
    want = smolvlm_video_text(times.tolist(), 3726.9, image_seq_len=1).split(block)
    assert [tokenizer.decode(piece) for piece in pieces] == want
    assert "from a 1:02:06 [H:MM:SS] video" in want[0] and "Frame from 62:05:" in want[3]


def test_an_internvl_video_is_token_for_token_the_processor_s_text(tmp_path, tokenizer):
    """InternVL's frames, numbered from 1 with a newline between them: the document is the
    tokenizer's encoding of `InternVLProcessor`'s video text and the caption."""
    spec = VideoSpec(num_frames=4, image=INTERNVL_FRAMES)
    record = _decoded(make_video(tmp_path / "clip.mp4", frames=12, fps=4, size=(64, 48)), spec)
    caption = " four grey frames"
    caption_ids = np.array(_ids(tokenizer, caption), dtype=np.int32)
    placeholders = PadPlaceholders.from_tokenizer(tokenizer, pad="<IMG_CONTEXT>", start="<img>", end="</img>",
                                                  merge_size=2)
    packer = MultimodalPacker(None, max_length=200, placeholders=placeholders, spec=INTERNVL_FRAMES, pad_id=0,
                              frame_text=FrameText.internvl(tokenizer))
    row = _one_row(packer, {**record, "input_ids": caption_ids})
    want = _ids(tokenizer, internvl_video_text(4, image_seq_length=4) + caption)
    length = int((row.tokens["document_ids"] == 0).sum())
    assert row.tokens["input_ids"][:length].tolist() == want
    assert "Frame4: " in tokenizer.decode(want)


def test_images_beside_framed_videos_are_written_as_before(tokenizer):
    """A record of a picture is packed with the frame text on as without it: the text goes around
    a video's frames only."""
    placeholders = Idefics3Placeholders.from_tokenizer(tokenizer, merge_size=4)
    picture = {"input_ids": np.array([40, 41], np.int32), "pixels": np.zeros((128, 128, 3), np.uint8)}
    rows = [_one_row(MultimodalPacker(None, max_length=64, placeholders=placeholders, spec=SMOL_FRAMES, pad_id=0,
                                      frame_text=frame_text), picture)
            for frame_text in (None, FrameText.smolvlm(tokenizer))]
    assert rows[0].tokens["input_ids"].tolist() == rows[1].tokens["input_ids"].tolist()


# -- refusals ------------------------------------------------------------------------------------

def test_frame_text_is_refused_where_it_cannot_be_written(tokenizer):
    placeholders = Idefics3Placeholders.from_tokenizer(tokenizer, merge_size=4)
    smolvlm = FrameText.smolvlm(tokenizer)
    qwen = {"spec": ImageSpec.qwen2_vl()}
    for kwargs, words in (({"placeholders": QwenPlaceholders(3, 4, 5, video_pad=6), **qwen},
                           "lays a video out as one block"),
                          ({"placeholders": QwenPlaceholders(3, 4, 5), "mrope": True, **qwen}, "mrope=True"),
                          ({"frame_text": "Frame{number}: "}, "must be a FrameText")):
        settings = {"placeholders": placeholders, "frame_text": smolvlm, "spec": SMOL_FRAMES, **kwargs}
        with pytest.raises(ConfigurationError, match=words):
            PackMultimodal(64, settings.pop("placeholders"), **settings)
    for kwargs, words in (({"before_frame": "Frame {index}"}, r"may name \{number\}, \{time\}.*got \{index\}"),
                          ({"outro": "{frames}"}, r"may name no field.*got \{frames\}"),
                          ({"intro": "{frames:>3}"}, r"as they are, got \{frames:>3\}"),
                          ({"intro": "{"}, "no format template")):
        with pytest.raises(ConfigurationError, match=words):
            FrameText.from_tokenizer(tokenizer, **kwargs)
    with pytest.raises(ConfigurationError, match="make it with FrameText.from_tokenizer"):
        FrameText("0" * 64)
    with pytest.raises(ConfigurationError, match="name the frames' times or the video's duration"):
        smolvlm.pieces(2, np.array([0.0, 1.0]))


def test_a_video_without_the_times_or_length_its_text_names_is_refused_by_name(tokenizer):
    placeholders = Idefics3Placeholders.from_tokenizer(tokenizer, merge_size=4)
    packer = MultimodalPacker(None, max_length=200, placeholders=placeholders, spec=SMOL_FRAMES, pad_id=0,
                              frame_text=FrameText.smolvlm(tokenizer))
    clip = {"input_ids": np.array([40], np.int32), "pixels": np.zeros((2, 128, 128, 3), np.uint8),
            "pixels_frame_times_s": np.array([0.0, 1.0]), "pixels_duration_s": 2.0}
    for field, value, words in (("pixels_frame_times_s", None, "the time each of its 2 frames.*'pixels_frame_times_s'"),
                                ("pixels_frame_times_s", [0.0], "the time each of its 2 frames"),
                                ("pixels_frame_times_s", [0.0, -1.0], "none negative"),
                                ("pixels_duration_s", None, "its duration.*'pixels_duration_s'"),
                                ("pixels_duration_s", "2", "its duration")):
        with pytest.raises(ConfigurationError, match=words):
            packer.push((_address(), {**clip, field: value}))
    numbered = MultimodalPacker(None, max_length=200, placeholders=placeholders, spec=SMOL_FRAMES, pad_id=0,
                                frame_text=FrameText.internvl(tokenizer))
    assert numbered.push((_address(), {"input_ids": clip["input_ids"], "pixels": clip["pixels"]})) == []  # no times named


def test_the_fingerprint_holds_the_frame_text_where_it_is_on(tokenizer):
    placeholders = Idefics3Placeholders.from_tokenizer(tokenizer, merge_size=4)

    def fingerprint(frame_text):
        return PackMultimodal(64, placeholders, spec=SMOL_FRAMES, frame_text=frame_text).fingerprint(0)

    assert "frame_text" not in fingerprint(None)
    smolvlm = fingerprint(FrameText.smolvlm(tokenizer))["frame_text"]
    assert smolvlm["outro"] == "\n\n" and len(smolvlm["tokenizer_digest"]) == 64
    assert fingerprint(FrameText.internvl(tokenizer)) != fingerprint(FrameText.smolvlm(tokenizer))
    assert fingerprint(FrameText.internvl(TOKENIZER)) != fingerprint(FrameText.internvl(tokenizer))  # tokens added


# -- through the pipeline ------------------------------------------------------------------------

SPLIT_PHOTOS = ImageSpec.smolvlm(size=(128, 128), longest_edge=512)
"""SmolVLM's splitting at a quarter of its side: photos of up to 4x4 tiles of 128 px, 4 `<image>` a tile."""


def _framed_pipeline(root, runner: str, *, video_last: bool = True) -> Pipeline:
    """Photos split as SmolVLM splits them and 3-frame clips (`test_vlm_mixed_media`'s corpus),
    the clips' frames uncut after SmolVLM2's text, in rows of 512; the video decoded after the
    photos unless told otherwise."""
    pipeline = photos_and_clips(root, runner, SPLIT_PHOTOS, VideoSpec(num_frames=3, image=SMOL_FRAMES),
                                video_last=video_last)
    return (pipeline.pack_multimodal(512, Idefics3Placeholders(3, 4, 5, TILE_NAMES, merge_size=4),
                                     frame_text=FrameText.smolvlm(TOKENIZER))
            .shuffle(buffer_size=3, seed=2)
            .batch(2))


def test_split_photos_and_framed_clips_are_the_same_bytes_on_every_runner(corpus):  # noqa: F811
    """Photos cut into tiles named by row and column, and clips whose three frames follow
    SmolVLM2's intro ("three frames") and their times, each frame one tile: the batches' SHA-256s
    are the same from separately built pipelines on the inline, thread and process runners, and
    with the video decoded before the photos (the packer counts pictures by the photos' spec
    wherever the video's decoder stands)."""
    from tokenizers import Tokenizer

    runs = {runner: _epoch(_framed_pipeline(corpus, runner)) for runner in ("inline", "thread", "process")}
    runs["inline, video first"] = _epoch(_framed_pipeline(corpus, "inline", video_last=False))
    batches, stats = runs["inline"]
    decode = Tokenizer.from_file(TOKENIZER).decode
    intros = sum(decode(row.tolist(), skip_special_tokens=False).count("series of three frames")
                 for batch in batches for row in batch.tokens["input_ids"])
    assert intros > 0 and stats["mixture"]["clips"]["images"] == 3 * intros
    named = sum(int(np.isin(batch.tokens["input_ids"], TILE_NAMES).sum()) for batch in batches)
    assert named > 0  # photos cut into tiles
    digests = [batch.digest() for batch in batches]
    for runner, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, runner


def test_split_photos_and_framed_clips_saved_on_two_ranks_resume_on_four_with_the_same_global_batches(
        corpus):  # noqa: F811
    """Saved after two microbatches on each of 2 ranks (thread runner), resumed on 4 (process
    runner): every later global batch is the uninterrupted single-rank run's, by SHA-256."""
    import json

    from tests.determinism.test_vlm_mixed_media_elastic import global_digests
    from tests.reliability.harness import checkpoint_after, run_epoch

    reference = global_digests(run_epoch(_framed_pipeline(corpus, "inline"), 1, keep_batches=False).digests)
    state = json.loads(json.dumps(checkpoint_after(_framed_pipeline(corpus, "thread"), 2, 2)))
    resumed = global_digests(run_epoch(_framed_pipeline(corpus, "process"), 4, state=state, keep_batches=False).digests)
    assert resumed and sorted(resumed) == sorted(set(reference) - {0})
    assert resumed == {step: reference[step] for step in resumed}


def test_llava_next_s_placeholders_are_refused_before_a_decode_video(corpus):  # noqa: F811
    """LLaVA-NeXT's placeholders count a picture from its canvas of tiles, which a frame has not:
    refused as the pipeline is built, not at the first clip."""
    pipeline = (Pipeline(mixed_source(corpus)).tokenize(TOKENIZER, field="txt")
                .decode_video(field="mp4", spec=VideoSpec(num_frames=3, image=SMOL_FRAMES), datasets="clips"))
    with pytest.raises(ConfigurationError, match="LlavaNextPlaceholders counts a picture's features from its canvas"):
        pipeline.pack_multimodal(512, LlavaNextPlaceholders(3), spec=ImageSpec.llava_next())


# -- into the model ------------------------------------------------------------------------------

@requires_torch
def test_a_tiny_smolvlm_gives_each_packed_document_of_framed_clips_what_it_gives_it_alone():
    """Rows of a three-frame clip after SmolVLM2's text then its caption, text alone, and a
    picture before its caption, given to a tiny randomly initialised
    `SmolVLMForConditionalGeneration` as vlm/README.md shows (the frames and pictures as one batch
    of images): every document's logits are the document's alone, so the model takes every frame
    where its block is and nothing of the text around the frames leaks between documents."""
    model = tiny_idefics3("SmolVLM", image_size=128, patch_size=16, vocab_size=8256, image_token_id=8202, scale_factor=4)
    placeholders = Idefics3Placeholders(8202, 8200, 8201, ((8210,),), merge_size=4)  # past the shipped vocabulary
    frame_text = FrameText.from_tokenizer(TOKENIZER, intro="{frames} frames, {duration}\n",
                                          before_frame="\nat {time}:", outro="\n\n")
    rng = np.random.default_rng(4)

    def text(n: int) -> np.ndarray:
        return rng.integers(10, 90, n).astype(np.int32)

    clip = {"input_ids": text(5), "pixels": rng.integers(0, 256, (3, 128, 128, 3), dtype=np.uint8),
            "pixels_frame_times_s": np.array([0.0, 1.5, 3.0]), "pixels_duration_s": 4.0}
    picture = {"input_ids": text(4), "pixels": rng.integers(0, 256, (128, 128, 3), dtype=np.uint8)}

    assert_each_packed_document_is_its_own(
        model, placeholders, SMOL_FRAMES, [clip, {"input_ids": text(7)}, picture], 160,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                                     std=(0.5,) * 3)[None]},
        frame_text=frame_text)
