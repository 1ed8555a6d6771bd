"""The vlm operators on the real lane core: WebDataset pairs -> decode -> tokenize -> pack -> batch.

Small on purpose (a few steps); the full determinism matrix lives with the core's tests.
"""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.harness import dataset_counts_in
from tests.unit.test_vlm_mixed_media import ROUTES, refused_when_packed
from tests.unit.test_vlm_assets import (
    REAL_JPEGS,
    cmyk_jpeg,
    encode,
    gradient,
    make_video,
    package_dir,
    png_header_only,
    truncated_jpeg,
)
from vlm import DecodeImages, ImageSpec, PackMultimodal, PixtralPlaceholders, VideoSpec, decode_video
from vlm._api import decode_images, pack_multimodal
from zephon import ConfigurationError, Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

SPEC = ImageSpec(max_pixels=96 * 96)
PLACEHOLDERS = PixtralPlaceholders(3, 4, 5)
STEPS = 3
BAD_REASONS = {"truncated_image", "corrupt_image", "decompression_bomb", "missing_image"}


def _pairs() -> list[tuple[str, bytes | None, str]]:
    pairs = []
    for package, relative in REAL_JPEGS:
        root = package_dir(package)
        if root is not None and (root / relative).is_file():
            pairs.append(("jpg", (root / relative).read_bytes(), f"a photograph, {relative.split('/')[-1]}"))
    for k in range(12 - len(pairs)):
        pairs.append(("png", encode(gradient(40 + 17 * k, 200 - 9 * k)), f"a gradient number {k}"))
    pairs += [("jpg", truncated_jpeg(), "cut short"), ("jpg", b"\xff\xd8 not really", "garbage"),
              ("png", png_header_only(20000, 20000), "a bomb"), ("jpg", cmyk_jpeg(), "printer colours"),
              (None, None, "a caption without its image")]
    return pairs


def _write_pair_shards(root, extension_case=str.lower):
    """Two tars of `_pairs()`, each member's extension written as `extension_case` spells it."""
    pairs = _pairs()
    for shard in range(2):
        with tarfile.open(root / f"pairs-{shard:03d}.tar", "w") as tar:
            for i, (ext, data, caption) in enumerate(pairs[shard::2]):
                members = [("txt", (caption + " ") * (i % 4 + 1))] + ([(ext, data)] if ext else [])
                for member_ext, payload in members:
                    payload = payload.encode() if isinstance(payload, str) else payload
                    info = tarfile.TarInfo(f"s{shard}-{i:03d}.{extension_case(member_ext)}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return root


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _write_pair_shards(tmp_path_factory.mktemp("pairs"))


def _pipeline(shards, runner: str, parallelism: int, *, via_api: bool = False) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(shards))], seed=3, records_per_chunk=3)
    pipeline = Pipeline(source).options(num_lanes=4, runner=runner)
    if via_api:
        pipeline = decode_images(pipeline, spec=SPEC, parallelism=parallelism)
    else:
        pipeline = pipeline.apply(DecodeImages(spec=SPEC, parallelism=parallelism))
    pipeline = pipeline.tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt",
                                 parallelism=parallelism, bos="<|bos|>", eos="<|eos|>")
    if via_api:
        pipeline = pack_multimodal(pipeline, 256, PLACEHOLDERS)
    else:
        pipeline = pipeline.apply(PackMultimodal(max_length=256, placeholders=PLACEHOLDERS, spec=SPEC))
    return pipeline.batch(2)


def _digests(pipeline: Pipeline, world_size: int) -> tuple[list, dict]:
    digests, skipped = [], {}
    for rank in range(world_size):
        with pipeline.shard(rank, world_size) as loader:
            for batch in loader:
                if batch.step >= STEPS:
                    break
                digests.append((batch.step, batch.lane, batch.index, batch.digest()))
            for reason, n in loader.stats()["datasets"]["pairs"]["total"]["skipped"].items():
                skipped[reason] = skipped.get(reason, 0) + n
    return sorted(digests), skipped


def test_vlm_batches_are_identical_across_runners_ranks_and_parallelism(shards):
    reference, skipped = _digests(_pipeline(shards, "inline", 1), world_size=1)
    assert len(reference) == STEPS * 4
    assert set(skipped) == BAD_REASONS, "every bad pair is skipped and counted by its reason"
    assert _digests(_pipeline(shards, "thread", 2), world_size=2)[0] == reference
    assert _digests(_pipeline(shards, "inline", 1, via_api=True), world_size=4)[0] == reference


@pytest.mark.parametrize("extension_case", [str.upper, str.title], ids=["JPG+TXT", "Jpg+Txt"])
def test_vlm_batches_from_shards_with_upper_case_extensions_equal_those_with_lower_case_ones(shards, tmp_path,
                                                                                            extension_case):
    """Shards written with `.JPG`/`.PNG` and `.TXT` members (camera dumps, Windows tools) are read
    as the same pairs: the image is decoded and the caption tokenized, where every record was
    counted `missing_image` because its fields were named "JPG" and "TXT"."""
    lower_case = _digests(_pipeline(shards, "inline", 1), world_size=1)
    assert len(lower_case[0]) == STEPS * 4 and set(lower_case[1]) == BAD_REASONS
    upper_case = _digests(_pipeline(_write_pair_shards(tmp_path, extension_case), "inline", 1), world_size=1)
    assert upper_case == lower_case, "the same batch SHA-256s, and the same records skipped for the same reasons"


def test_vlm_batch_carries_pixels_grids_and_offsets_for_training(shards):
    with _pipeline(shards, "inline", 1).shard(0, 1) as loader:
        batch = next(iter(loader))
    arrays = batch.to_numpy()
    assert arrays["input_ids"].shape == (2, 256)
    grids, offsets = arrays["image_grid"], arrays["image_token_offset"]
    assert arrays["pixel_values"].shape == (int((grids[:, 0] * grids[:, 1]).sum()), 16 * 16 * 3)
    assert arrays["image_grid_counts"].sum() == len(grids) == len(offsets) > 0
    row_of_image = np.repeat(np.arange(2), arrays["image_grid_counts"])
    for row, (rows, cols), at in zip(row_of_image, grids, offsets):
        expected = PLACEHOLDERS.tokens_for(int(rows), int(cols))
        assert arrays["input_ids"][row, at : at + len(expected)].tolist() == expected.tolist()
        assert (arrays["labels"][row, at : at + len(expected) - 1] == -100).all()


@pytest.mark.parametrize("defer", [False, True], ids=["decode-before-packing", "decode-after-packing"])
def test_vlm_stats_count_each_dataset_s_tokens_and_images_in_the_rows_handed_over(shards, defer):
    """Two datasets mixed: each lane's "datasets" and the rank's "mixture" in stats() hold the text
    and placeholder tokens and the images each dataset put in the rows the trainer was handed,
    their tokens adding up to the lane's; a document masked for an image that failed after
    packing keeps its place, so it counts too."""
    source = StaticMixtureWorkSource([Dataset.from_path(name, str(shards)) for name in ("pairs", "more")],
                                     mixture={"pairs": 0.6, "more": 0.4}, seed=3, records_per_chunk=3, num_epochs=1)
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline")
                .decode_images(spec=SPEC, defer=defer)
                .tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt", bos="<|bos|>",
                          eos="<|eos|>")
                .pack_multimodal(256, PLACEHOLDERS).batch(2))
    with pipeline.shard(0, 1) as loader:
        batches = list(loader)
        stats = loader.stats()
    masked = sum(n for lane in stats["lanes"].values() for key, n in lane.items() if key.startswith("masked:"))
    assert masked == (2 if defer else 0), "the truncated JPEG of each dataset is masked only when decoded late"
    assert {lane: counts["datasets"] for lane, counts in stats["lanes"].items()} == dataset_counts_in(batches)
    for lane, counts in stats["lanes"].items():
        assert sum(d["tokens"] for d in counts["datasets"].values()) == counts["tokens"], lane
    images = sum(len(b.ragged["image_grid"]) for b in batches)
    assert sum(d["images"] for d in stats["mixture"].values()) == images > 0
    assert set(stats["mixture"]) == {"pairs", "more"} and all(d["images"] for d in stats["mixture"].values())


def _long_caption_pipeline(root, num_lanes: int = 2) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(root))], seed=3, records_per_chunk=2,
                                     num_epochs=1)
    return (Pipeline(source).options(num_lanes=num_lanes, runner="inline", flush_every_chunks=1)
            .decode_images(spec=ImageSpec(max_pixels=32 * 32))
            .tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt", bos="<|bos|>",
                      eos="<|eos|>")
            .pack_multimodal(32, PLACEHOLDERS).batch(1))


def test_captions_cut_to_fit_their_row_are_counted_in_the_stats(tmp_path):
    """A document whose image fits but whose caption does not is cut on the text side; the cut is
    counted per dataset (documents and text tokens dropped), not lost silently, and the counts are
    the same after a resume on another world size."""
    with tarfile.open(tmp_path / "pairs-000.tar", "w") as tar:
        for i in range(8):
            caption = "word " * (50 if i % 2 else 3)  # 53 tokens with BOS/EOS; 6 with them
            for ext, payload in (("txt", caption.encode()), ("png", encode(gradient(32, 32)))):
                info = tarfile.TarInfo(f"s-{i:03d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    with _long_caption_pipeline(tmp_path).shard(0, 1) as loader:
        for _ in loader:
            pass
        total = loader.stats()["datasets"]["pairs"]["total"]
    assert total["read"] == total["emitted"] == 8 and total["truncated"] == 4
    assert total["truncated_tokens"] == 4 * (53 - (32 - 6)), "a 2x2-patch image is 6 Pixtral tokens"
    with _long_caption_pipeline(tmp_path).shard(0, 1) as loader:
        for _ in zip(range(2), loader):
            pass
        state = loader.state_dict()
    resumed_total = {}
    for rank in range(2):
        with _long_caption_pipeline(tmp_path).shard(rank, 2) as loader:
            loader.load_state_dict(state)
            for _ in loader:
                pass
            for name, n in loader.stats()["datasets"]["pairs"]["total"].items():
                if name.startswith("truncated"):
                    resumed_total[name] = resumed_total.get(name, 0) + n
    assert resumed_total == {"truncated": 4, "truncated_tokens": total["truncated_tokens"]}


def test_pack_multimodal_packs_the_field_decode_images_wrote(shards):
    """decode_images(output_field=...) and pack_multimodal without pixels_field: the packer reads
    the decoder's field (it used to read "pixels", find none and pack every caption without its image)."""
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(shards))], seed=3, records_per_chunk=3)
    pipeline = decode_images(Pipeline(source).options(num_lanes=1, runner="inline"), spec=SPEC,
                             output_field="image")
    pipeline = pipeline.tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt")
    with pack_multimodal(pipeline, 256, PLACEHOLDERS).batch(2).shard(0, 1) as loader:
        batch = next(iter(loader))
    assert len(batch.ragged["image_grid"]) > 0
    assert (batch.tokens["input_ids"] == PLACEHOLDERS.end_id).sum() == len(batch.ragged["image_grid"])


def test_pack_multimodal_refuses_a_pixels_field_no_operator_writes(shards):
    """pack_multimodal(pixels_field="image") after a decode_images that writes "pixels" found no
    image in any record and packed every caption alone, silently; a map may write the field, so
    only a pipeline of decoders, tokenizers and filters is decided."""
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(shards))], seed=3, records_per_chunk=3)
    pipeline = decode_images(Pipeline(source).options(num_lanes=1, runner="inline"), spec=SPEC)
    pipeline = pipeline.tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt")
    with pytest.raises(ConfigurationError, match=r"pixels_field='image'.*decode_images writes 'pixels'"):
        pack_multimodal(pipeline, 256, PLACEHOLDERS, pixels_field="image")
    renamed = pipeline.map(lambda record: {**record, "image": record["pixels"]})
    pack_multimodal(renamed, 256, PLACEHOLDERS, pixels_field="image")  # a map may write it: not decided
    pack_multimodal(pipeline, 256, PLACEHOLDERS, pixels_field="pixels")


def _digests_with_offsets_in(shards, field: str, **pack_options) -> list:
    """Digests of a pipeline whose map puts every record's one image before its third text token,
    writing that offset in `field`."""
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(shards))], seed=3, records_per_chunk=3)
    pipeline = decode_images(Pipeline(source).options(num_lanes=1, runner="inline"), spec=SPEC)
    pipeline = pipeline.tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt")
    pipeline = pipeline.map(lambda record: {**record, field: [2]})
    with pack_multimodal(pipeline, 256, PLACEHOLDERS, **pack_options).batch(2).shard(0, 1) as loader:
        return [batch.digest() for batch, _ in zip(loader, range(3))]


def test_pack_multimodal_reads_image_offsets_from_the_field_its_offsets_field_names(shards):
    """docs/RELIABILITY.md names `pack_multimodal(offsets_field=…)` as what changes where a
    record's images go, but the builder method took no such argument (a TypeError): only the
    `PackMultimodal` dataclass did."""
    default = _digests_with_offsets_in(shards, "image_offsets")
    assert _digests_with_offsets_in(shards, "where", offsets_field="where") == default
    assert _digests_with_offsets_in(shards, "where") != default, "an unnamed field is no offsets"


def test_pack_multimodal_after_bos_refuses_a_tokenize_that_adds_no_bos(shards):
    """image_position="after_bos" puts the images after a document's first token: without
    tokenize(bos=...) that was the caption's first word, and the images split it from the rest,
    unsaid. A map may add a BOS, so only a tokenize followed by decoders and filters is decided."""
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(shards))], seed=3, records_per_chunk=3)
    pipeline = Pipeline(source).options(num_lanes=1, runner="inline")
    tokenizer = str(package_dir("zephon") / "data" / "tokenizer.json")
    without = decode_images(pipeline.tokenize(tokenizer, field="txt"), spec=SPEC).filter(lambda record: True)
    with pytest.raises(ConfigurationError, match=r"image_position='after_bos'.*'input_ids' adds no BOS"):
        pack_multimodal(without, 256, PLACEHOLDERS, image_position="after_bos")
    with pytest.raises(ConfigurationError, match="adds no BOS"):
        without.pack_multimodal(256, PLACEHOLDERS, image_position="after_bos")  # the Pipeline method alike
    pack_multimodal(without, 256, PLACEHOLDERS)  # before the text: no BOS needed
    with_bos = decode_images(pipeline.tokenize(tokenizer, field="txt", bos="<|bos|>"), spec=SPEC)
    with pack_multimodal(with_bos, 256, PLACEHOLDERS, image_position="after_bos").batch(2).shard(0, 1) as loader:
        batch = next(iter(loader))
    ids = batch.tokens["input_ids"][0]
    assert ids[0] == Tokenizer.from_file(tokenizer).token_to_id("<|bos|>") and ids[1] == PLACEHOLDERS.img_id
    assert batch.ragged["image_token_offset"][0] == 1
    prefixed = without.map(lambda record: record)  # a map may put a BOS first: not decided
    pack_multimodal(prefixed, 256, PLACEHOLDERS, image_position="after_bos")


def _with_video_frames(record: dict) -> dict:
    """Each record's image, then its video's frames, in the one field the packer reads."""
    out = dict(record)
    out["pixels"] = [out["pixels"], *out.pop("frames")]
    return out


def _image_and_video_pipeline(root, *, defer: bool, route: str = "pack_multimodal") -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("clips", str(root))], seed=1, records_per_chunk=2,
                                     num_epochs=1)
    pipeline = (Pipeline(source).options(num_lanes=2, runner="thread", on_error="skip")
                .tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt", bos="<|bos|>",
                          eos="<|eos|>")
                .decode_images(field="jpg", spec=SPEC, defer=defer)
                .decode_video(field="mp4", output_field="frames", spec=VideoSpec(num_frames=2, image=SPEC))
                .map(_with_video_frames))
    if route == "apply":  # the packer pack_multimodal builds, made by hand
        return pipeline.apply(PackMultimodal(512, PLACEHOLDERS, SPEC, pixels_field="pixels")).batch(1)
    return pipeline.pack_multimodal(512, PLACEHOLDERS, pixels_field="pixels").batch(1)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """clips/good and clips/bad: six records of a JPEG, a video and a caption each, the fourth
    JPEG of clips/bad truncated (its header passes: it fails only when decoded)."""
    root = tmp_path_factory.mktemp("clips")
    video = make_video(root / "clip.mp4", frames=20).read_bytes()
    for name, bad in (("good", None), ("bad", 3)):
        (root / name).mkdir()
        with tarfile.open(root / name / "clips-000.tar", "w") as tar:
            for i in range(6):
                image = truncated_jpeg() if i == bad else encode(gradient(40 + 8 * i, 64), "JPEG", quality=90)
                for ext, payload in (("jpg", image), ("mp4", video), ("txt", f"clip number {i}".encode())):
                    info = tarfile.TarInfo(f"k{i:03d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return root


def _run_clips(root, *, defer: bool, route: str = "pack_multimodal") -> tuple[list[str], dict]:
    """The batches' SHA-256 digests and the stats of a run over `root`."""
    with _image_and_video_pipeline(root, defer=defer, route=route).shard(0, 1) as loader:
        return [batch.digest() for batch in loader], loader.stats()


def test_deferred_images_decode_after_packing_when_a_video_is_decoded_after_them(clips):
    """decode_images(defer=True) then decode_video: pack_multimodal took the last decoder, the
    video's, as the one that decides, so the deferred images lost their row work. The loader
    then decoded them itself while assembling, always failing fast: a truncated JPEG, which
    on_error="skip" masks and counts, stopped the run with BadRecordError."""
    pipeline = _image_and_video_pipeline(clips / "good", defer=True)
    assert pipeline.packers()[0].row_work("skip", pipeline.record_operators()) is not None
    eager, _ = _run_clips(clips / "good", defer=False)
    assert len(eager) > 1 and _run_clips(clips / "good", defer=True)[0] == eager, \
        "the same pixels, decoded after packing"
    _, stats = _run_clips(clips / "bad", defer=True)
    masked = sum(lane.get("masked:truncated_image", 0) for lane in stats["lanes"].values())
    assert masked == 1 and stats["datasets"]["clips"]["total"]["emitted"] == 6


def test_a_packer_given_to_apply_decodes_deferred_images_as_pack_multimodal_s_does(clips):
    """Only pack_multimodal told its packer that decode_images(defer=True) left the images
    encoded, so a PackMultimodal given to Pipeline.apply had no row work: the loader decoded the
    images on its own thread as it assembled each batch, failing fast, and a truncated JPEG that
    on_error="skip" masks stopped the run with BadRecordError. The packer now reads it from the
    decoders before it: both ways give the same batches and mask the same document."""
    for name in ("good", "bad"):
        built, built_stats = _run_clips(clips / name, defer=True)
        applied, applied_stats = _run_clips(clips / name, defer=True, route="apply")
        assert len(built) > 1 and applied == built, f"{name}: the same batch SHA-256s"
        assert applied_stats["lanes"] == built_stats["lanes"], f"{name}: the same rows and masked documents"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["pixels_field", "after_bos", "deferred_policies"])
def test_a_packer_given_to_apply_is_refused_what_pack_multimodal_refuses(shards, case, route):
    """`pack_multimodal` refused, as it built the packer, a pixels field no decoder writes, an
    `after_bos` after a tokenize adding no BOS, and deferred decoders with different error
    policies; a `PackMultimodal` given to `Pipeline.apply` was taken and packed every caption
    without its image, split every caption after its first word, or followed one of the policies.
    It is refused when the pipeline is sharded, before any record is read."""
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(shards))], seed=3, records_per_chunk=3)
    tokenizer = str(package_dir("zephon") / "data" / "tokenizer.json")
    pipeline = Pipeline(source)
    if case == "pixels_field":
        pipeline = pipeline.decode_images(spec=SPEC).tokenize(tokenizer, field="txt")
        refused_when_packed(pipeline, route, r"pixels_field='image'.*decode_images writes 'pixels'",
                            pixels_field="image")
    elif case == "after_bos":
        pipeline = pipeline.tokenize(tokenizer, field="txt").decode_images(spec=SPEC).filter(lambda record: True)
        refused_when_packed(pipeline, route, r"image_position='after_bos'.*'input_ids' adds no BOS",
                            image_position="after_bos")
    else:
        pipeline = (pipeline.decode_images(field="jpg", spec=SPEC, defer=True, on_error="raise")
                    .decode_images(field="png", spec=SPEC, output_field="more", defer=True, on_error="skip"))
        refused_when_packed(pipeline, route, r"decode_images\(defer=True\) stages set different on_error",
                            pixels_field="pixels")


def _video_paths_pipeline(shard, runner: str, on_error: str = "raise") -> Pipeline:
    """The JSON-lines shard's "video" paths decoded, their "txt" tokenized, packed two frames a video."""
    source = StaticMixtureWorkSource([Dataset.from_path("clips", str(shard))], seed=2, records_per_chunk=2,
                                     num_epochs=1)
    pipeline = (Pipeline(source).options(num_lanes=2, runner=runner, on_error=on_error)
                .tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt", bos="<|bos|>",
                          eos="<|eos|>")
                .decode_video(field="video", spec=VideoSpec(num_frames=2, image=SPEC)))
    return pipeline.pack_multimodal(512, PLACEHOLDERS).batch(1)


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_relative_video_paths_resolve_from_the_shard_directory_not_the_working_directory(tmp_path, monkeypatch,
                                                                                           runner):
    """A relative path in a local shard names a file beside the shard (as a Hugging Face dataset's
    metadata does). It was opened from the worker's working directory: started from another
    directory holding other files at those names, the run packed other frames, unsaid."""
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    for root, frames in ((data, 20), (elsewhere, 7)):
        (root / "clips").mkdir(parents=True)
        for i in range(3):
            make_video(root / "clips" / f"clip{i}.mp4", frames=frames + 5 * i, size=(64 + 32 * i, 48))

    def shard(name: str, where) -> str:
        rows = [{"video": where(f"clips/clip{i}.mp4"), "txt": f"clip number {i}"} for i in range(3)]
        rows.append({"video": {"bytes": None, "path": where("clips/clip1.mp4")}, "txt": "a struct"})
        path = data / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    absolute = shard("absolute.jsonl", lambda relative: str(data / relative))
    relative = shard("relative.jsonl", lambda relative: relative)
    with _video_paths_pipeline(absolute, "inline").shard(0, 1) as loader:
        expected = [batch.digest() for batch in loader]
    monkeypatch.chdir(elsewhere)
    with _video_paths_pipeline(relative, runner).shard(0, 1) as loader:
        assert [batch.digest() for batch in loader] == expected and len(expected) > 1


@pytest.mark.timeout(120)  # the failure this guards against is a worker waiting forever
def test_a_process_runner_decodes_videos_after_one_was_decoded_on_the_thread_that_starts_it(tmp_path):
    """PyAV 19 (the 3.14t suite's) resizes every frame of a thread with one swscale context kept
    for that thread, and FFmpeg 8 gives it a pool of slice threads. A forked worker inherits the
    forking thread's context but not its threads: resizing to another size there waited for
    ever on the pool. So after a video was decoded on the thread that then started a process
    runner, the loader hung at its first batch."""
    (tmp_path / "clips").mkdir()
    rows = []
    for i in range(3):
        path = make_video(tmp_path / "clips" / f"clip{i}.mp4", frames=20 + 5 * i, size=(64 + 32 * i, 48))
        rows.append({"video": str(path), "txt": f"clip number {i}"})
    shard = tmp_path / "clips.jsonl"
    shard.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with _video_paths_pipeline(shard, "thread").shard(0, 1) as loader:
        expected = [batch.digest() for batch in loader]
    decode_video(rows[0]["video"], VideoSpec(num_frames=1, image=ImageSpec(max_pixels=256 * 256)))  # on this thread
    with _video_paths_pipeline(shard, "process").shard(0, 1) as loader:
        assert [batch.digest() for batch in loader] == expected and len(expected) > 1
