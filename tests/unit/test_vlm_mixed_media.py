"""An image-caption dataset and a video-caption dataset mixed in one pipeline (vlm/README.md,
"Mixing image and video datasets"): `decode_images(datasets=...)` and `decode_video(datasets=...)` each
decode their own datasets' records, a dataset neither covers is packed as text, and the names,
an empty scope and decoders cutting different patches are refused when the pipeline is built.

The corpus (`write_mixed_corpus`) is shared with tests/determinism/test_vlm_mixed_media_elastic.py.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_vlm_assets import encode, gradient, make_video, package_dir
from vlm import ImageSpec, PixtralPlaceholders, QwenPlaceholders, VideoSpec
from vlm._packing import PackMultimodal
from vlm._stages import DecodeImages
from vlm._video import decode_video
from zephon import ConfigurationError, Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation

SPEC = ImageSpec(max_pixels=64 * 64)
VIDEO_SPEC = VideoSpec(num_frames=2, image=SPEC)
PLACEHOLDERS = PixtralPlaceholders(3, 4, 5)
TOKENIZER = str(package_dir("zephon") / "data" / "tokenizer.json")
PHOTO_SHARDS = [6, 5]
CLIP_SHARDS = [4, 3]
MISNAMED_PHOTO = 4
"""The photo record (of the first shard) whose image member is misnamed `jgp`."""


def _tar(path: Path, records: list[list[tuple[str, bytes]]]) -> None:
    with tarfile.open(path, "w") as tar:
        for members in records:
            for name, payload in members:
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def write_mixed_corpus(root: Path) -> Path:
    """root/photos (JPEG + caption, one image member misnamed), root/clips (MPEG-4 of 6, 9 or 12
    frames + caption), root/notes (captions alone), all WebDataset shards."""
    for name in ("photos", "clips", "notes"):
        (root / name).mkdir(parents=True)
    for shard, size in enumerate(PHOTO_SHARDS):
        records = []
        for i in range(size):
            k = shard * 10 + i
            image = encode(gradient(30 + 5 * (k % 7), 60 - 3 * (k % 5)), "JPEG")
            extension = "jgp" if (shard, i) == (0, MISNAMED_PHOTO) else "jpg"
            records.append([(f"p{k:03d}.txt", f"photo {k} ".encode() * (1 + k % 3)), (f"p{k:03d}.{extension}", image)])
        _tar(root / "photos" / f"photos-{shard:03d}.tar", records)
    payloads = []
    for j in range(3):
        video = make_video(root / f"v{j}.mp4", frames=6 + 3 * j, size=(64, 48))
        payloads.append(video.read_bytes())
        video.unlink()
    for shard, size in enumerate(CLIP_SHARDS):
        records = [[(f"c{shard}{i}.txt", f"clip {shard}{i} ".encode() * (1 + i % 4)),
                    (f"c{shard}{i}.mp4", payloads[(shard + i) % 3])] for i in range(size)]
        _tar(root / "clips" / f"clips-{shard:03d}.tar", records)
    _tar(root / "notes" / "notes-000.tar", [[(f"n{i}.txt", f"a note {i} ".encode() * 3)] for i in range(4)])
    return root


def mixed_source(root: Path, *, estimation: TokenEstimation | None = None) -> StaticMixtureWorkSource:
    datasets = [Dataset.from_path(name, str(root / name)) for name in ("photos", "clips", "notes")]
    return StaticMixtureWorkSource(datasets, {"photos": 2.0, "clips": 1.0, "notes": 0.5},
                                   token_estimation=estimation, seed=5, records_per_chunk=1, num_epochs=2)


def photos_and_clips(root: Path, runner: str, photos: ImageSpec, clips: VideoSpec, *,
                     video_last: bool = True, defer: bool = False) -> Pipeline:
    """The corpus's records tokenized, its photos decoded with `photos` (after packing with
    `defer`) and its clips with `clips` (two workers each), the video decoded after the photos
    unless told otherwise: a pipeline to pack (rows of several layouts, whichever decoder stands
    last)."""
    decoders = [lambda p: p.decode_images(field="jpg", spec=photos, datasets="photos", defer=defer, parallelism=2),
                lambda p: p.decode_video(field="mp4", spec=clips, datasets="clips", parallelism=2)]
    pipeline = (Pipeline(mixed_source(root)).options(num_lanes=4, runner=runner, flush_every_chunks=2)
                .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>", parallelism=2))
    for decoder in decoders if video_last else decoders[::-1]:
        pipeline = decoder(pipeline)
    return pipeline


def mixed_pipeline(root: Path, runner: str = "inline", parallelism: int = 1, *, defer: bool = False,
                   estimation: TokenEstimation | None = None) -> Pipeline:
    """photos decoded as images, clips as 2 frames each, notes packed as text, in rows of 160."""
    return (
        Pipeline(mixed_source(root, estimation=estimation))
        .options(num_lanes=4, runner=runner, flush_every_chunks=2)
        .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>", parallelism=parallelism)
        .decode_images(field="jpg", spec=SPEC, defer=defer, parallelism=parallelism, datasets="photos")
        .decode_video(field="mp4", spec=VIDEO_SPEC, parallelism=parallelism, datasets=["clips"])
        .pack_multimodal(160, PLACEHOLDERS)
        .shuffle(buffer_size=3, seed=2)
        .batch(1)
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_mixed_corpus(tmp_path_factory.mktemp("mixed"))


def _epoch(pipeline: Pipeline):
    with pipeline.shard(0, 1) as loader:
        batches = list(loader)
        return batches, loader.stats()


@pytest.mark.parametrize("defer", [False, True], ids=["eager", "deferred"])
def test_a_mixture_packs_photos_as_images_clips_as_frames_and_notes_as_text(corpus, defer):
    batches, stats = _epoch(mixed_pipeline(corpus, defer=defer))
    pixels = np.concatenate([b.ragged["pixel_values"] for b in batches])
    frame_values = set()
    rows_with_both = 0
    for batch in batches:
        grids = batch.ragged["image_grid"]
        counts = batch.ragged_counts["image_grid"]
        starts = np.concatenate([[0], np.cumsum((grids[:, 0] * grids[:, 1]).astype(int))])
        image = 0
        patches = batch.ragged["pixel_values"]
        for row, sources in enumerate(batch.sources):
            kinds = set()
            for _ in range(int(counts[row])):
                picture = patches[starts[image]:starts[image + 1]]
                image += 1
                # make_video fills a frame with one grey level; a photo is a colour gradient.
                if np.ptp(picture) < 32:
                    kinds.add("frame")
                    frame_values.add(int(picture.mean()))
                else:
                    kinds.add("photo")
            rows_with_both += kinds == {"frame", "photo"}
    datasets = stats["datasets"]
    assert rows_with_both > 0, "some row holds a photo and a clip's frames together"
    assert len(frame_values) > 1, "the frames are the clips' own (different grey levels), not zeros"
    assert pixels.shape[1] == SPEC.patch_dim
    assert datasets["clips"]["total"]["emitted"] == 2 * sum(CLIP_SHARDS)
    assert datasets["notes"]["total"]["emitted"] == 2 * 4, "the notes no decoder covers are packed as text"
    # The misnamed image is still the photo decoder's to skip, and counted: nothing passes silently.
    assert datasets["photos"]["total"]["skipped"] == {"missing_image": 2}
    assert datasets["photos"]["total"]["emitted"] == 2 * (sum(PHOTO_SHARDS) - 1)
    assert not datasets["clips"]["total"].get("skipped") and not datasets["notes"]["total"].get("skipped")


def test_a_decoder_passes_the_chunks_of_other_datasets_through_unchanged(corpus):
    stage = DecodeImages(field="jpg", spec=SPEC, datasets=("photos",))
    with mixed_pipeline(corpus).shard(0, 1) as loader:
        plan = loader.plan
    chunk = next(chunk for lane in range(4) for slot in range(plan.num_slots(lane))
                 if (chunk := plan.slot(lane, slot)) is not None and chunk.dataset == "clips")
    records = plan.datasets["clips"].read_chunk(chunk, on_error="skip")
    out = stage(records)
    assert out is records and not out.skipped and all("mp4" in record for record in out.records)


def test_the_token_estimate_runs_each_decoder_on_its_own_datasets_only(corpus):
    with mixed_pipeline(corpus, estimation=TokenEstimation(sample_records=8)).shard(0, 1) as loader:
        stats = loader.plan.stats
    frames = decode_video(_first_clip(corpus), VIDEO_SPEC)
    frame_tokens = PLACEHOLDERS.num_tokens(frames.shape[1] // SPEC.patch_size, frames.shape[2] // SPEC.patch_size)
    assert dict(stats["clips"].dropped) == {} and dict(stats["notes"].dropped) == {}
    assert dict(stats["photos"].dropped) == {"missing_image": 1}, "the misnamed photo, in the photo sample only"
    assert stats["clips"].tokens > stats["clips"].sampled_records * len(frames) * frame_tokens
    assert stats["notes"].tokens > 0


def test_a_mixture_of_learned_tokens_counts_the_captions_alone(corpus):
    """`TokenEstimation(count="learned")`: the learned tokens are the captions' (each token's label
    but a document's last), never a placeholder's, and they are in the recipe."""
    estimation = TokenEstimation(sample_records=8, count="learned")
    with mixed_pipeline(corpus, estimation=estimation).shard(0, 1) as loader:
        stats, fingerprint = loader.plan.stats, loader.plan.fingerprint()
    assert set(fingerprint["learned_per_byte"]) == {"photos", "clips", "notes"}
    for name in ("photos", "clips"):  # most of their tokens are their images' placeholders
        assert 0 < stats[name].learned_per_byte < stats[name].tokens_per_byte / 2, name
    notes = stats["notes"]  # text alone: every token learned but each document's last
    assert notes.learned_per_byte == pytest.approx(notes.tokens_per_byte * (1 - notes.sampled_records / notes.tokens))


def _first_clip(root: Path) -> bytes:
    with tarfile.open(root / "clips" / "clips-000.tar") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".mp4"))
        return tar.extractfile(member).read()


def test_a_misnamed_dataset_is_refused_with_the_datasets_there_are(corpus):
    pipeline = Pipeline(mixed_source(corpus)).tokenize(TOKENIZER, field="txt")
    with pytest.raises(ConfigurationError, match=r"'clip' is no dataset .*\['photos', 'clips', 'notes'\]; "
                                                 r"did you mean 'clips'\?"):
        pipeline.decode_video(field="mp4", spec=VIDEO_SPEC, datasets="clip")
    with pytest.raises(ConfigurationError, match="names no dataset"):
        pipeline.decode_images(field="jpg", spec=SPEC, datasets=[])
    with pytest.raises(ConfigurationError, match="datasets must be None"):
        pipeline.decode_images(field="jpg", spec=SPEC, datasets=[3])


def test_a_misnamed_dataset_given_to_apply_is_refused_when_the_pipeline_is_sharded(corpus):
    pipeline = (Pipeline(mixed_source(corpus)).options(num_lanes=4).tokenize(TOKENIZER, field="txt")
                .apply(DecodeImages(field="jpg", spec=SPEC, datasets=("fotos",)))
                .pack_multimodal(160, PLACEHOLDERS).batch(1))
    with pytest.raises(ConfigurationError, match=r"'fotos' is no dataset .*did you mean 'photos'"):
        pipeline.shard(0, 1)


def test_an_operator_of_the_user_s_own_scoped_by_one_name_as_a_string_is_checked_by_that_name(corpus):
    """`check_dataset_names` normalises the stages Zephon ships; an operator of the user's own may
    hold the string as given, which was checked letter by letter ("'f' is no dataset")."""
    decoder = DecodeImages(field="jpg", spec=SPEC)
    object.__setattr__(decoder, "datasets", "fotos")  # as a plugin's own dataclass would hold it
    pipeline = (Pipeline(mixed_source(corpus)).options(num_lanes=4).tokenize(TOKENIZER, field="txt")
                .apply(decoder).pack_multimodal(160, PLACEHOLDERS).batch(1))
    with pytest.raises(ConfigurationError, match=r"\(datasets=\['fotos'\]\): 'fotos' is no dataset"):
        pipeline.shard(0, 1)


ROUTES = ("pack_multimodal", "apply")
"""The two ways a multimodal packer enters a pipeline: built by `pack_multimodal`, or made by the
user and given to `Pipeline.apply`, which skipped the builder's checks."""


def refused_when_packed(pipeline: Pipeline, route: str, message: str, placeholders=PLACEHOLDERS,
                        **pack_options) -> None:
    """`pipeline` (what comes before the packer) refused by `pack_multimodal(160, placeholders,
    **pack_options)` as it builds the packer, or, for the `PackMultimodal` of those settings
    given to `Pipeline.apply`, when the pipeline is sharded, before any record is read."""
    if route == "pack_multimodal":
        with pytest.raises(ConfigurationError, match=message):
            pipeline.pack_multimodal(160, placeholders, **pack_options)
        return
    packer = PackMultimodal(160, placeholders, **pack_options)
    applied = pipeline.options(num_lanes=4, runner="inline").apply(packer).batch(1)
    with pytest.raises(ConfigurationError, match=message):
        applied.shard(0, 1)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("image_scope, video_scope, shared", [
    (None, "clips", "the records of 'clips'"),
    (["photos", "clips"], ["clips"], "the records of 'clips'"),
    (None, None, "every dataset's records"),
])
def test_decoders_running_on_one_dataset_are_refused(corpus, image_scope, video_scope, shared, route):
    """The later decoder would find the earlier's arrays, or no field of its own, and drop every
    record they share as bad media."""
    pipeline = (Pipeline(mixed_source(corpus)).tokenize(TOKENIZER, field="txt")
                .decode_images(field="jpg", spec=SPEC, datasets=image_scope)
                .decode_video(field="mp4", spec=VIDEO_SPEC, datasets=video_scope))
    refused_when_packed(pipeline, route, rf"decode_images\(.*\) and decode_video\(.*\) both decode {shared} "
                                          r"into 'pixels'.*give each decoder its own datasets")


@pytest.mark.parametrize("route", ROUTES)
def test_decoders_cutting_different_patches_into_one_field_are_refused(corpus, route):
    pipeline = (Pipeline(mixed_source(corpus)).tokenize(TOKENIZER, field="txt")
                .decode_images(field="jpg", spec=SPEC, datasets="photos")
                .decode_video(field="mp4", spec=VideoSpec(num_frames=2, image=ImageSpec(patch_size=14)),
                              datasets="clips"))
    refused_when_packed(pipeline, route, r"different patches.*16px patches merged 1x1.*14px patches")


@pytest.mark.parametrize("route", ROUTES)
def test_an_image_processor_beside_a_video_decoder_is_refused_pointing_to_qwen_pixel_values(corpus, route):
    """decode_video takes no processor, so 'give the decoders the same merge_size' could not be
    followed: one ImageSpec for both and the processor's rows made on the trainer's side can."""
    pipeline = (Pipeline(mixed_source(corpus)).tokenize(TOKENIZER, field="txt")
                .decode_images(field="jpg", processor=PatchRowsProcessor(2), datasets="photos")
                .decode_video(field="mp4", spec=VideoSpec(num_frames=2, image=ImageSpec(merge_size=2)),
                              datasets="clips"))
    refused_when_packed(pipeline, route, r"different patches.*decode_video takes no image processor.*"
                                          r"vlm\.qwen_pixel_values", QwenPlaceholders(3, 4, 5, merge_size=2),
                        spec=ImageSpec(merge_size=2))


class PatchRowsProcessor:
    """An image processor of the user's own, Qwen2-VL style: 768-wide float32 patch rows on a 4x4
    grid, merging `merge_size` x `merge_size` patches per token."""

    def __init__(self, merge_size: int) -> None:
        self.merge_size = merge_size

    def __call__(self, images, return_tensors: str) -> dict:
        return {"pixel_values": np.zeros((16, 768), np.float32), "image_grid_thw": [[1, 4, 4]]}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("second, why", [
    ({"processor": PatchRowsProcessor(1)}, r"merged 2x2.*merged 1x1"),
    ({"processor": PatchRowsProcessor(2), "grid_field": "clip_grid"}, r"grids in 'image_grid'.*grids in 'clip_grid'"),
], ids=["merge", "grid_field"])
def test_image_processors_merging_or_placing_their_grids_differently_are_refused(corpus, second, why, route):
    """Two scoped decoders with image processors of one patch width: the packer checked the last
    one's merge against the placeholders and read the last one's grid field only, so the first
    one's images had the wrong number of placeholder tokens for the model (merging unlike it) or
    failed when their first record was packed (their grids in another field)."""
    pipeline = (Pipeline(mixed_source(corpus)).tokenize(TOKENIZER, field="txt")
                .decode_images(field="jpg", processor=PatchRowsProcessor(2), datasets="photos")
                .apply(DecodeImages(field="jpg", datasets=("clips",), **second)))
    merge = second["processor"].merge_size  # the last decoder's, which the placeholders and spec follow
    refused_when_packed(pipeline, route, "different patches.*" + why, QwenPlaceholders(3, 4, 5, merge_size=merge),
                        spec=ImageSpec(merge_size=merge))
    alike = (Pipeline(mixed_source(corpus)).tokenize(TOKENIZER, field="txt")
             .decode_images(field="jpg", processor=PatchRowsProcessor(2), datasets="photos")
             .decode_images(field="jpg", processor=PatchRowsProcessor(2), datasets="clips"))
    alike.pack_multimodal(160, QwenPlaceholders(3, 4, 5, merge_size=2), spec=ImageSpec(merge_size=2))


@pytest.mark.parametrize("route", ROUTES)
def test_placeholders_merging_unlike_the_image_processor_are_refused(corpus, route):
    """A processor merging 2x2 patches per token with placeholders merging 1x1: each image had 4x
    the placeholder tokens the model expects. Only `pack_multimodal` refused it; a `PackMultimodal`
    given to `Pipeline.apply` was taken."""
    pipeline = (Pipeline(mixed_source(corpus)).tokenize(TOKENIZER, field="txt")
                .decode_images(field="jpg", processor=PatchRowsProcessor(2), datasets="photos"))
    refused_when_packed(pipeline, route, r"image processor merges 2x2 patches per token but the placeholders merge 1x1",
                        QwenPlaceholders(3, 4, 5, merge_size=1))


def test_a_scope_is_in_the_fingerprint_sorted():
    listed = DecodeImages(field="jpg", datasets=["b", "a", "b"]).fingerprint()
    assert listed["datasets"] == ["a", "b"]
    assert listed == DecodeImages(field="jpg", datasets=("a", "b")).fingerprint()


def test_a_decoder_without_a_scope_is_fingerprinted_as_before_scopes_were_taken():
    """A checkpoint saved before `datasets=` existed resumes: a decoder given none writes the keys
    it always wrote and no other, so the recipe's digests are the ones that checkpoint holds."""
    from vlm._stages import DecodeVideo

    images = DecodeImages(field="jpg").fingerprint()
    assert sorted(images) == ["defer", "field", "grid_field", "keep_source", "op", "output_field", "processor", "spec"]
    assert sorted(DecodeVideo(field="mp4").fingerprint()) == ["field", "keep_source", "op", "output_field", "spec"]
    assert DecodeImages(field="jpg", datasets=None).fingerprint() == images
