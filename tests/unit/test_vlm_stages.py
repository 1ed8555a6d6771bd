"""Decode stages on chunks: every record decoded or skipped with its reason, the input untouched."""

from __future__ import annotations

import json
import pickle
import re
import sys

import numpy as np
import pytest

from tests.unit.test_vlm_assets import (
    cmyk_jpeg,
    encode,
    gradient,
    make_video,
    palette_alpha_png,
    png_header_only,
    real_file,
    sixteen_bit_png,
    truncated_jpeg,
)
from vlm import (
    DecodeImages,
    DecodeVideo,
    ImageSpec,
    PackMultimodal,
    QwenPlaceholders,
    VideoSpec,
    image_grid,
)
from zephon._accumulator import SegmentContext
from zephon._errors import BadRecordError, ConfigurationError
from zephon._records import Chunk, ChunkRecords, RecordAddress

CHUNK = Chunk("pairs", 0, 0, 10)


def chunk_of(records: list[dict]) -> ChunkRecords:
    addresses = [RecordAddress("pairs", "shard-0.tar", i) for i in range(len(records))]
    return ChunkRecords(CHUNK, records=records, addresses=addresses)


def dirty_records() -> list[dict]:
    """One record per documented case, in a fixed order."""
    china = real_file("sklearn", "datasets/images/china.jpg").read_bytes()
    return [
        {"__key__": "ok-real", "jpg": china, "txt": "a temple"},
        {"__key__": "no-image", "txt": "only text"},
        {"__key__": "garbage", "jpg": b"\x00garbage" * 20, "txt": "x"},
        {"__key__": "truncated", "jpg": truncated_jpeg(), "txt": "x"},
        {"__key__": "cmyk", "jpg": cmyk_jpeg(), "txt": "x"},
        {"__key__": "sixteen-bit", "png": sixteen_bit_png(), "txt": "x"},
        {"__key__": "palette-alpha", "png": palette_alpha_png(), "txt": "x"},
        {"__key__": "bomb", "png": png_header_only(20000, 20000), "txt": "x"},
        {"__key__": "path-not-bytes", "jpg": "/some/where.jpg", "txt": "x"},
    ]


def test_dirty_chunk_keeps_the_good_records_and_names_each_bad_one():
    records = dirty_records()
    batch = chunk_of(records)
    out = DecodeImages()(batch)
    assert [r["__key__"] for r in out.records] == ["ok-real", "cmyk", "sixteen-bit", "palette-alpha"]
    assert [a.index for a in out.addresses] == [0, 4, 5, 6]
    assert [(a.index, reason) for a, reason in out.skipped] == [
        (1, "missing_image"), (2, "corrupt_image"), (3, "truncated_image"), (7, "decompression_bomb"),
        (8, "not_media_bytes"),
    ]
    for record in out.records:
        pixels = record["pixels"]
        assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
        assert pixels.shape[0] % 16 == 0 and pixels.shape[1] % 16 == 0
        assert "jpg" not in record and "png" not in record and record["txt"]
    assert len(batch.records) == len(records) and batch.skipped == [], "the input chunk is not modified"
    assert "jpg" in records[0] and "pixels" not in records[0]


def test_fail_fast_names_the_record_address_and_reason():
    stage = DecodeImages(on_error="raise")
    with pytest.raises(BadRecordError) as caught:
        stage(chunk_of([{"jpg": encode(gradient(), "JPEG")}, {"jpg": truncated_jpeg()}]))
    assert caught.value.reason == "truncated_image" and caught.value.address.index == 1


def test_pipeline_policy_applies_unless_the_stage_sets_its_own():
    bad = chunk_of([{"jpg": b"nope"}])
    with pytest.raises(BadRecordError):
        DecodeImages().build("raise")(bad)
    assert DecodeImages(on_error="skip").build("raise")(bad).skipped[0][1] == "corrupt_image"


def test_the_token_estimate_skips_and_counts_a_bad_image_even_under_the_stage_s_own_raise_policy():
    """The estimate reads its sample while `shard()` plans (`estimate_stages`): a stage of its own
    `on_error="raise"` failed there, from planning, on the first bad image the sample held, not
    where training reaches one."""
    from zephon._record_ops import estimate_stages

    bad = chunk_of([{"jpg": b"nope"}])
    for stage in (DecodeImages(on_error="raise"), DecodeImages()):
        [decode] = estimate_stages([stage])
        assert decode(bad).skipped[0][1] == "corrupt_image"
    with pytest.raises(BadRecordError):
        DecodeImages(on_error="raise").build("skip")(bad)  # training keeps the stage's own policy


def test_candidate_fields_lists_and_hugging_face_image_structs():
    png, jpg = encode(gradient(), "PNG"), encode(gradient(), "JPEG")
    out = DecodeImages(field=["webp", "png"], keep_source=True)(chunk_of([
        {"png": png},
        {"png": [png, {"bytes": jpg, "path": "x.jpg"}]},
    ]))
    assert out.records[0]["pixels"].shape == (96, 160, 3) and "png" in out.records[0]
    assert isinstance(out.records[1]["pixels"], list) and len(out.records[1]["pixels"]) == 2


def test_a_decode_stage_keeps_the_first_skips_details_of_each_reason_with_those_before_it():
    """What `stats()["skipped_examples"]` shows: the detail a `BadRecordError` would carry, for the
    first few skips of each reason in the chunk, besides those an earlier stage kept."""
    records = [{"jpg": b"\x00garbage" * 20} for _ in range(5)] + [{"txt": "no image"}]
    batch = chunk_of(records)
    batch.skip_one(RecordAddress("pairs", "shard-0.tar", 99), "malformed_json", "an earlier stage's detail")
    out = DecodeImages()(batch)
    assert len(out.skipped) == 7
    corrupt = out.skip_details["corrupt_image"]
    assert [a.index for a in corrupt] == [0, 1, 2] and all(corrupt.values()), corrupt
    with pytest.raises(BadRecordError) as raised:
        DecodeImages(on_error="raise")(chunk_of(records[:1]))
    assert corrupt[RecordAddress("pairs", "shard-0.tar", 0)] == raised.value.detail
    [(address, detail)] = out.skip_details["missing_image"].items()
    assert address.index == 5 and detail.startswith("none of the fields ") and "'txt'" in detail
    assert out.skip_details["malformed_json"] == {RecordAddress("pairs", "shard-0.tar", 99): "an earlier stage's detail"}


def test_an_image_list_that_is_empty_gives_a_text_document_and_one_bad_item_skips_its_record():
    """A Hugging Face `Sequence(Image)` column holds a list per record. An empty list is a
    document with no image (interleaved web documents hold text-only ones), packed as its text
    alone, not `missing_image` as an empty video list is `missing_video`; a list holding one item
    that does not decode skips the whole record by that item's reason, as the README says."""
    from tests.unit.test_vlm_packing import packer, run, text

    png = encode(gradient(), "PNG")
    out = DecodeImages(field="images", spec=ImageSpec(patch_size=4, max_pixels=64 * 16))(chunk_of([
        {"images": []},
        {"images": [png, b"not an image"]},
        {"images": [png, None]},
    ]))
    assert [record["pixels"] for record in out.records] == [[]]
    assert [reason for _, reason in out.skipped] == ["corrupt_image", "not_media_bytes"]
    [row] = run(packer(16), [{"input_ids": text(5), "pixels": out.records[0]["pixels"]}])
    assert row.tokens["input_ids"][:5].tolist() == text(5).tolist()
    assert row.ragged["image_grid"].shape == (0, 2) and (row.tokens["document_ids"][:5] == 0).all()


def test_stage_pickles_and_fingerprints_as_json_that_tracks_the_spec():
    stage = DecodeImages(spec=ImageSpec(max_pixels=256 * 256), parallelism=4)
    assert pickle.loads(pickle.dumps(stage)) == stage
    fingerprint = stage.fingerprint()
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert fingerprint != DecodeImages(spec=ImageSpec(max_pixels=128 * 128)).fingerprint()
    assert stage.kind == "record" and stage.name == "decode_images"


class ResizingProcessor:
    """An image processor of the user's own (no transformers `to_json_string`), Qwen2-VL style."""

    merge_size = 1

    def __init__(self, side: int) -> None:
        self.side = side

    def __call__(self, images, return_tensors: str) -> dict:
        cells = self.side // 16
        return {"pixel_values": np.zeros((cells * cells, 768), np.float32), "image_grid_thw": [[1, cells, cells]]}


def test_a_processor_without_a_transformers_config_enters_the_fingerprint_by_its_settings():
    """Only its class entered, so a checkpoint of a run resizing to 224 resumed one resizing to
    448: other pixels from the same cursors, unsaid."""
    fingerprint = DecodeImages(processor=ResizingProcessor(224)).fingerprint()
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert fingerprint != DecodeImages(processor=ResizingProcessor(448)).fingerprint()


def test_decoding_after_packing_is_part_of_the_stages_fingerprint_and_its_parallelism_is_not():
    """vlm/README.md: `defer` enters the recipe (a bad JPEG is skipped before packing and masked
    after it, so the batches differ), and a checkpoint resumes only with the same choice; the
    workers decoding are a performance setting, free to change on resume."""
    eager, deferred = DecodeImages(), DecodeImages(defer=True)
    assert eager.fingerprint() != deferred.fingerprint()
    assert DecodeImages(defer=True, parallelism=4).fingerprint() == deferred.fingerprint()


@pytest.mark.parametrize("bad", [{"field": []}, {"on_error": "ignore"}, {"parallelism": 0}, {"field": 5},
                                 {"spec": {"patch_size": 16}}, {"parallelism": 2.0}])
def test_stage_refuses_settings_that_cannot_work(bad):
    with pytest.raises(ConfigurationError):
        DecodeImages(**bad)


@pytest.mark.parametrize("stage,bad", [
    (DecodeImages, {"defer": "no"}), (DecodeImages, {"keep_source": "no"}), (DecodeImages, {"defer": 0}),
    (DecodeImages, {"output_field": ""}), (DecodeImages, {"output_field": None}), (DecodeImages, {"grid_field": 3}),
    (DecodeVideo, {"keep_source": "no"}), (DecodeVideo, {"output_field": ""}),
], ids=lambda v: v.__name__ if isinstance(v, type) else repr(v))
def test_stage_refuses_flags_that_are_not_booleans_and_fields_that_are_not_names(stage, bad):
    """Like tokenize's: defer="no" deferred the decode and keep_source="no" kept the bytes, as True
    does; an empty or None output field was written as a key no packer reads."""
    with pytest.raises(ConfigurationError, match=next(iter(bad))):
        stage(**bad)


# -- a user's transformers image processor -----------------------------------------------------

@pytest.fixture(scope="module")
def transformers():
    import transformers

    return transformers


def _processor(transformers, name: str, **kwargs):
    cls = getattr(transformers, f"{name}ImageProcessorPil", None) or getattr(transformers, f"{name}ImageProcessor")
    return cls(**kwargs)


def test_qwen2_vl_processor_output_is_carried_with_its_grid_and_packs(transformers):
    processor = _processor(transformers, "Qwen2VL", min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    stage = DecodeImages(processor=processor)
    data = real_file("sklearn", "datasets/images/flower.jpg").read_bytes()
    out = stage(chunk_of([{"jpg": data, "input_ids": np.arange(5, dtype=np.int32) + 100}]))
    record = out.records[0]
    rows, cols = record["image_grid"][0].tolist()
    assert (rows, cols) == image_grid(427, 640, ImageSpec.qwen2_vl(max_pixels=28 * 28 * 64))
    assert record["pixels"].shape == (rows * cols, 1176) and record["pixels"].dtype == np.float32
    dim, dtype = stage.patch_layout()
    assert (dim, dtype) == (1176, np.float32)
    packer = PackMultimodal(max_length=128, placeholders=QwenPlaceholders(1, 2, 3), spec=ImageSpec.qwen2_vl(),
                            patch_dim=dim, patch_dtype=dtype.str).factory(0)(SegmentContext(0, 0))
    [plan] = packer.push((out.addresses[0], record)) + packer.flush()
    row = plan.assemble()
    assert (row.tokens["input_ids"] == 2).sum() == rows * cols // 4
    assert np.array_equal(row.ragged["pixel_values"], record["pixels"])


def test_pack_multimodal_refuses_placeholders_that_merge_unlike_the_image_processor(transformers, tmp_path):
    """Qwen2-VL's processor merges 2x2 patches per token: placeholders merging 1x1 (with the default
    ImageSpec, which merges 1x1 too) laid out 4x the image tokens the model expects, unsaid until
    the model found its features and tokens did not match."""
    from vlm._api import decode_images, pack_multimodal
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    processor = _processor(transformers, "Qwen2VL", min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    pipeline = decode_images(Pipeline(StaticMixtureWorkSource([Dataset.from_path("d", str(tmp_path / "d.jsonl"))])),
                             processor=processor)
    with pytest.raises(ConfigurationError, match="merge"):
        pack_multimodal(pipeline, 128, QwenPlaceholders(1, 2, 3, merge_size=1))
    pack_multimodal(pipeline, 128, QwenPlaceholders(1, 2, 3), spec=ImageSpec.qwen2_vl())


def test_pixtral_processor_output_is_cut_into_raster_patches(transformers):
    processor = _processor(transformers, "Pixtral", size={"longest_edge": 128}, patch_size=16)
    out = DecodeImages(processor=processor)(chunk_of([{"png": encode(gradient(60, 100), "PNG")}]))
    record = out.records[0]
    rows, cols = record["image_grid"][0].tolist()
    assert record["pixels"].shape == (rows * cols, 16 * 16 * 3)
    assert DecodeImages(processor=processor).patch_layout()[0] == 768


def test_image_the_processor_refuses_is_skipped_as_processor_error(transformers):
    processor = _processor(transformers, "Qwen2VL", min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    sliver = encode(np.zeros((4, 1200, 3), np.uint8), "PNG")  # Qwen2-VL refuses aspect ratios > 200
    out = DecodeImages(processor=processor)(chunk_of([{"png": sliver}]))
    assert out.skipped[0][1] == "processor_error"


# -- video ----------------------------------------------------------------------------------------

def test_video_stage_decodes_bytes_and_paths_and_names_bad_ones(tmp_path):
    path = make_video(tmp_path / "clip.mp4", frames=20)
    stage = DecodeVideo(spec=VideoSpec(num_frames=2, image=ImageSpec(patch_size=16)))
    out = stage(chunk_of([
        {"mp4": path.read_bytes()},
        {"mp4": str(path)},
        {"mp4": b"not a video at all" * 10},
        {"txt": "no video"},
        {"mp4": path.read_bytes(), "start": 0},
    ]))
    assert [a.index for a in out.addresses] == [0, 1, 4]
    assert all(r["pixels"].shape == (2, 96, 128, 3) for r in out.records)
    assert np.array_equal(out.records[0]["pixels"], out.records[1]["pixels"])
    assert [(a.index, reason) for a, reason in out.skipped] == [(2, "corrupt_video"), (3, "missing_video")]
    with pytest.raises(BadRecordError, match="video_too_short"):
        DecodeVideo(spec=VideoSpec(start_s=60), on_error="raise")(chunk_of([{"mp4": str(path)}]))


def test_a_still_picture_in_a_video_field_is_skipped_and_counted_as_not_a_video(tmp_path):
    """A JPEG in a video field was packed as `num_frames` copies of itself, unsaid."""
    from tests.unit.test_vlm_video import still_picture

    stage = DecodeVideo(spec=VideoSpec(num_frames=2, image=ImageSpec(patch_size=16)))
    out = stage(chunk_of([{"mp4": still_picture("JPEG")}, {"mp4": make_video(tmp_path / "clip.mp4").read_bytes()}]))
    assert [a.index for a in out.addresses] == [1]
    assert [(a.index, reason) for a, reason in out.skipped] == [(0, "not_a_video")]


def test_a_damaged_video_is_skipped_and_counted_as_corrupt_video(tmp_path):
    """FFmpeg's concealed frames were decoded and packed as if sound."""
    from tests.unit.test_vlm_video import damage_packets

    data = make_video(tmp_path / "clip.mp4", frames=30).read_bytes()
    stage = DecodeVideo(spec=VideoSpec(fps=10.0, image=ImageSpec(patch_size=16)))
    out = stage(chunk_of([{"mp4": data}, {"mp4": damage_packets(data)}]))
    assert [a.index for a in out.addresses] == [0] and len(out.records[0]["pixels"]) == 30
    assert [(a.index, reason) for a, reason in out.skipped] == [(1, "corrupt_video")]
    with pytest.raises(BadRecordError, match=r"#1.*corrupt_video.*damaged"):
        DecodeVideo(spec=stage.spec, on_error="raise")(chunk_of([{"mp4": data}, {"mp4": damage_packets(data)}]))


def test_a_video_with_a_packet_its_demuxer_marks_damaged_is_skipped_and_counted_as_corrupt_video():
    """A transport packet an MPEG-TS receiver flagged as in error: the frames decoded, unmarked,
    and were packed as sound."""
    from tests.unit.test_vlm_video import encode_grey_ramp, flag_a_transport_packet

    data = encode_grey_ramp("libx264", "mpegts", 0)
    stage = DecodeVideo(spec=VideoSpec(fps=10.0, image=ImageSpec(patch_size=16)))
    flagged = flag_a_transport_packet(data)
    out = stage(chunk_of([{"mp4": data}, {"mp4": flagged}]))
    assert [a.index for a in out.addresses] == [0] and len(out.records[0]["pixels"]) == 60
    assert [(a.index, reason) for a, reason in out.skipped] == [(1, "corrupt_video")]
    with pytest.raises(BadRecordError, match=r"#1.*corrupt_video.*demuxer reports the packet"):
        DecodeVideo(spec=stage.spec, on_error="raise")(chunk_of([{"mp4": data}, {"mp4": flagged}]))


def test_video_field_holding_a_list_of_one_video_decodes_it_and_other_lists_are_skipped_by_what_they_hold(tmp_path):
    """A Hugging Face `Sequence(Video)` column gives a list: one video in it was skipped as
    `corrupt_video` ("holds 1 videos; one is supported"), and so were several sound videos."""
    data = make_video(tmp_path / "clip.mp4", frames=20).read_bytes()
    stage = DecodeVideo(spec=VideoSpec(num_frames=2, image=ImageSpec(patch_size=16)))
    out = stage(chunk_of([{"mp4": data}, {"mp4": [data]}, {"mp4": [{"bytes": data}]}, {"mp4": [data, data]},
                          {"mp4": []}]))
    assert [a.index for a in out.addresses] == [0, 1, 2]
    assert all(np.array_equal(r["pixels"], out.records[0]["pixels"]) for r in out.records)
    assert [(a.index, reason) for a, reason in out.skipped] == [(3, "several_videos"), (4, "missing_video")]


def test_a_hugging_face_video_struct_holding_only_a_path_decodes_that_path_as_a_bare_path_does(tmp_path):
    """{"bytes": None, "path": ...} is what a Hugging Face Video column holds for a local file: the
    stage takes a bare path, but the struct was skipped as `not_media_bytes`."""
    path = make_video(tmp_path / "clip.mp4", frames=20)
    stage = DecodeVideo(spec=VideoSpec(num_frames=2, image=ImageSpec(patch_size=16)), on_error="raise")
    out = stage(chunk_of([{"mp4": str(path)}, {"mp4": {"bytes": None, "path": str(path)}},
                          {"mp4": [{"bytes": None, "path": str(path)}]}]))
    assert len(out.records) == 3 and not out.skipped
    assert all(np.array_equal(r["pixels"], out.records[0]["pixels"]) for r in out.records)


@pytest.mark.parametrize("shard", ["s3://bucket/clips-000.tar", "hf://datasets/org/clips/clips-000.tar",
                                   "clips-000.tar"], ids=["s3", "hf", "relative-shard-url"])
def test_a_relative_video_path_where_the_shard_is_not_a_local_file_is_skipped_as_unresolvable(tmp_path, monkeypatch,
                                                                                              shard):
    """A relative path resolves from its shard's directory, which a remote shard (or an address
    whose shard is no absolute local path) does not give. It was opened from the worker's working
    directory: whatever file had that name there, on that node, was packed."""
    monkeypatch.chdir(tmp_path)
    make_video(tmp_path / "clip.mp4", frames=20)
    absolute = str(tmp_path / "clip.mp4")
    records = [{"mp4": "clip.mp4"}, {"mp4": {"bytes": None, "path": "clip.mp4"}}, {"mp4": absolute}]
    addresses = [RecordAddress("clips", shard, i) for i in range(len(records))]
    stage = DecodeVideo(spec=VideoSpec(num_frames=2, image=ImageSpec(patch_size=16)))
    out = stage(ChunkRecords(CHUNK, records=records, addresses=addresses))
    assert [(a.index, reason) for a, reason in out.skipped] == [(0, "unresolvable_path"), (1, "unresolvable_path")]
    assert [a.index for a in out.addresses] == [2], "an absolute path is still opened as a local file"
    with pytest.raises(BadRecordError, match=r"unresolvable_path.*'clip.mp4'.*" + re.escape(shard)):
        DecodeVideo(on_error="raise")(ChunkRecords(CHUNK, records=records[:1], addresses=addresses[:1]))


def test_a_hugging_face_image_struct_holding_only_a_path_is_skipped_naming_the_path():
    """Images are read from bytes unless `paths=True` (vlm/README.md): the skip says why, not "got dict"."""
    with pytest.raises(BadRecordError, match=r"not_media_bytes.*holds no bytes, only the path 'x/y.jpg'"):
        DecodeImages(on_error="raise")(chunk_of([{"jpg": {"bytes": None, "path": "x/y.jpg"}}]))


@pytest.mark.parametrize("value", ["images/a.jpg", {"bytes": None, "path": "images/a.jpg"}], ids=["bare", "struct"])
def test_an_image_path_is_skipped_saying_images_are_read_from_bytes_and_how_to_get_them_there(value):
    """A LLaVA-style JSON line naming its image by file ({"image": "images/a.jpg"}) was skipped as
    `expected encoded bytes, got str`: not which path, nor that decode_images reads paths only when
    asked, so a user looked for a missing file that was there."""
    with pytest.raises(BadRecordError) as raised:
        DecodeImages("image", on_error="raise")(chunk_of([{"image": value}]))
    assert raised.value.reason == "not_media_bytes"
    assert "'images/a.jpg'" in raised.value.detail
    assert "decode_images reads encoded bytes unless given paths=True" in raised.value.detail
    assert "decode_images(paths=True) reads the file a path names" in raised.value.detail


@pytest.mark.parametrize("stage,module,package", [(DecodeImages, "PIL", "Pillow"), (DecodeVideo, "av", "PyAV")])
def test_a_decoding_stage_without_its_decoder_is_refused_when_the_pipeline_is_built(monkeypatch, stage, module,
                                                                                    package):
    """Workers import the decoder lazily: without this check the first image would fail there."""
    monkeypatch.setitem(sys.modules, module, None)  # what find_spec reports for a package that is not installed
    with pytest.raises(ConfigurationError, match=rf"needs {package}.*pip install 'zephon\[vlm\]'"):
        stage()
