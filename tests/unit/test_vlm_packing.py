"""Multimodal packing: nothing lost or duplicated, images never split, loss masked on image tokens."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import assert_plans_collate_like_their_rows, printed_in_processes, refusals
from vlm import (
    DecodeImages,
    ImageSpec,
    MultimodalPacker,
    PackMultimodal,
    PixtralPlaceholders,
    QwenPlaceholders,
    RowPlan,
    assemble_row,
    patchify,
)
from vlm._packing import _SHORT_TEXT
from zephon._accumulator import Accumulator, SegmentContext
from zephon._errors import ConfigurationError
from zephon._markers import MarkerOffsets
from zephon._records import RecordAddress
from zephon._sequence import IGNORE_INDEX, PADDING_DOCUMENT

P = 4  # a small patch keeps the arrays tiny; the packer does not care about the size
SPEC = ImageSpec(patch_size=P, min_pixels=P * P, max_pixels=64 * P * P)
PIXTRAL = PixtralPlaceholders(10, 12, 13)
PAD = 0
CTX = SegmentContext(lane=0, segment=0)


def address(i: int) -> RecordAddress:
    return RecordAddress("ds", "shard-0", i)


def picture(rows: int, cols: int, seed: int, patch: int = P) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows * patch, cols * patch, 3), dtype=np.uint8)


def text(n: int, start: int = 1000) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def packer(max_length: int, **kwargs) -> MultimodalPacker:
    kwargs.setdefault("placeholders", PIXTRAL)
    kwargs.setdefault("spec", SPEC)
    return MultimodalPacker(CTX, max_length=max_length, pad_id=PAD, **kwargs)


def run(pack: MultimodalPacker, records: list[dict]) -> list:
    rows = []
    for i, record in enumerate(records):
        rows.extend(pack.push((address(i), record)))
    rows.extend(pack.flush())
    return rows


def test_packer_satisfies_the_accumulator_protocol():
    assert isinstance(packer(8), Accumulator)


def test_one_image_then_text_lays_out_placeholders_labels_and_pixels():
    image = picture(2, 3, seed=1)
    [row] = run(packer(32), [{"input_ids": text(5), "pixels": image}])
    ids = row.tokens["input_ids"]
    placeholder = [10, 10, 10, 12, 10, 10, 10, 13]
    assert ids[:13].tolist() == placeholder + list(range(1000, 1005)) and (ids[13:] == PAD).all()
    labels = row.tokens["labels"]
    assert (labels[:7] == IGNORE_INDEX).all(), "positions whose next token is an image token learn nothing"
    assert labels[7] == 1000, "the image's last token predicts the first text token"
    assert labels[8:12].tolist() == [1001, 1002, 1003, 1004]
    assert (labels[12:] == IGNORE_INDEX).all(), "document end and padding are masked"
    assert row.tokens["position_ids"][:13].tolist() == list(range(13))
    assert (row.tokens["document_ids"][:13] == 0).all() and (row.tokens["document_ids"][13:] == PADDING_DOCUMENT).all()
    assert np.array_equal(row.ragged["pixel_values"], patchify(image, P))
    assert row.ragged["image_grid"].tolist() == [[2, 3]] and row.ragged["image_grid"].dtype == np.int32
    assert row.ragged["image_token_offset"].tolist() == [0]
    assert row.sources == (address(0),)
    assert all(a.dtype == np.int32 and a.shape == (32,) for a in row.tokens.values())


def test_pixels_that_are_a_strided_view_are_laid_out_as_their_copy():
    """Patches are copied a patch row at a time as blocks of bytes; pixels whose samples are not
    adjacent (every other channel of a wider array) must give the patches of their values."""
    wide = np.random.default_rng(3).integers(0, 256, (2 * P, 3 * P, 6), dtype=np.uint8)
    image = wide[..., ::2]
    [row] = run(packer(32), [{"input_ids": text(2), "pixels": image}])
    assert np.array_equal(row.ragged["pixel_values"], patchify(np.ascontiguousarray(image), P))


def test_a_hand_built_plan_whose_pixels_are_not_the_rows_dtype_has_them_converted():
    image = np.arange(2 * P * P * 3, dtype=np.int64).reshape(P, 2 * P, 3) % 256
    plans = run(packer(16, assemble=False), [{"input_ids": text(2), "pixels": image.astype(np.uint8)}])
    doc = plans[0].documents[0]
    plan = dataclasses.replace(plans[0], documents=(dataclasses.replace(doc, images=(image,)),))
    assert np.array_equal(assemble_row(plan).ragged["pixel_values"], patchify(image.astype(np.uint8), P))


def test_pixels_of_python_objects_are_laid_out_as_their_values_as_before():
    """Patch rows are copied as blocks of bytes, which NumPy refuses for an array of references
    (TypeError: every such record failed the run since the copy was changed); an object patch
    dtype (patch_dtype=object) is copied a value at a time, as it was."""
    image = picture(1, 2, 4).astype(object)
    [row] = run(packer(16, patch_dtype=object), [{"input_ids": text(2), "pixels": image}])
    pixels = row.ragged["pixel_values"]
    assert pixels.dtype == object and pixels.tolist() == patchify(picture(1, 2, 4), P).tolist()


@pytest.mark.parametrize("position,expected", [
    ("after_text", [1000, 1001, 1002, 10, 13]),
    ("after_bos", [1000, 10, 13, 1001, 1002]),
])
def test_image_position_places_the_image_after_the_text_or_after_bos(position, expected):
    [row] = run(packer(8, image_position=position), [{"input_ids": text(3), "pixels": picture(1, 1, 0)}])
    assert row.tokens["input_ids"][:5].tolist() == expected
    assert row.ragged["image_token_offset"].tolist() == [expected.index(10)]


def test_explicit_offsets_interleave_images_with_text():
    record = {"input_ids": text(4), "pixels": [picture(1, 1, 0), picture(1, 2, 1)], "image_offsets": [1, 3]}
    [row] = run(packer(16), [record])
    assert row.tokens["input_ids"][:10].tolist() == [1000, 10, 13, 1001, 1002, 10, 10, 13, 1003, PAD]
    assert row.ragged["image_token_offset"].tolist() == [1, 5]
    I = IGNORE_INDEX
    assert row.tokens["labels"][:9].tolist() == [I, I, 1001, 1002, I, I, I, 1003, I]


@pytest.mark.parametrize("offsets", [[3, 1], [1], [1, 2, 3], [-1, 2], [1, 5]],
                         ids=["decreasing", "too_few", "too_many", "before_the_text", "past_the_text"])
def test_explicit_offsets_that_do_not_place_each_image_in_the_text_are_refused_naming_the_record(offsets):
    """Offsets out of order laid the text between them out twice, and one offset for two images
    dropped the second image, both without a word."""
    record = {"input_ids": text(4), "pixels": [picture(1, 1, 0), picture(1, 2, 1)], "image_offsets": offsets}
    with pytest.raises(ConfigurationError, match=rf"record ds:shard-0#0: image_offsets=\[.*\] must give one "
                                                 rf"non-decreasing offset in \[0, 4\] per image \(2\)"):
        run(packer(16), [record])


@pytest.mark.parametrize("offsets", [["1", 3], [1.9, 3], [1.0, 3], [True, 3], 3, "13", {1: 0, 3: 0}],
                         ids=["string", "fraction", "float", "bool", "bare_number", "string_of_digits", "mapping"])
def test_explicit_offsets_that_are_not_whole_numbers_are_refused_naming_the_record_not_converted(offsets):
    """`int(o)` read "1" as 1 and truncated 1.9 to 1 (its image placed silently one token early),
    and a bare number failed as a bare TypeError naming no record."""
    record = {"input_ids": text(4), "pixels": [picture(1, 1, 0), picture(1, 2, 1)], "image_offsets": offsets}
    with pytest.raises(ConfigurationError, match=r"record ds:shard-0#0: image_offsets=.* must give one non-decreasing "
                                                 r"offset in \[0, 4\] per image \(2\), each a whole number"):
        run(packer(16), [record])
    whole = {**record, "image_offsets": np.array([1, 3], dtype=np.int64)}  # whole numbers in any integer form
    [row] = run(packer(16), [whole])
    assert row.ragged["image_token_offset"].tolist() == [1, 5]


def test_offsets_from_markers_place_the_images_as_offsets_from_the_data_do():
    record = {"input_ids": text(4), "pixels": [picture(1, 1, 0), picture(1, 2, 1)]}
    [marked] = run(packer(16), [{**record, "image_offsets": MarkerOffsets([1, 3], "<image>")}])
    [given] = run(packer(16), [{**record, "image_offsets": [1, 3]}])
    assert marked.tokens["input_ids"].tolist() == given.tokens["input_ids"].tolist()
    assert marked.ragged["image_token_offset"].tolist() == [1, 5]


@pytest.mark.parametrize("markers,images", [(1, 2), (3, 2), (0, 1), (1, 0)],
                         ids=["fewer_markers", "more_markers", "no_marker", "no_image"])
def test_markers_not_as_many_as_the_images_skip_the_record_counted_by_name(markers, images):
    """A LLaVA caption with two `<image>` and one image (or none where it has one) is that
    record's fault, not the pipeline's: skipped and counted, where offsets from the data that do not
    place each image stay a configuration error (above)."""
    pack = packer(16)
    mismatched = {"input_ids": text(4), "pixels": [picture(1, 1, k) for k in range(images)],
                  "image_offsets": MarkerOffsets([1] * markers, "<image>")}
    rows = run(pack, [mismatched, {"input_ids": text(3), "image_offsets": MarkerOffsets([], "<image>")}])
    assert [r.sources for r in rows] == [(address(1),)]
    assert refusals(pack.drain_skips()) == [(
        address(0), "marker_count_mismatch", f"its text held {markers} '<image>' marker(s) ('image_offsets') but "
        f"it has {images} image(s) in 'pixels': one marker per image (a video: per frame)")]
    counter = PackMultimodal(max_length=16, placeholders=PIXTRAL, spec=SPEC).token_counter()
    assert counter(address(0), mismatched) == 0
    assert [reason for _, reason, _ in counter.drain_skips()] == ["marker_count_mismatch"]


def test_sample_whose_images_alone_exceed_the_length_is_skipped_and_reported_once():
    pack = packer(8)
    big = {"input_ids": text(2), "pixels": picture(3, 3, 0)}  # 3 * (3 + 1) = 12 > 8 image tokens
    rows = run(pack, [big, {"input_ids": text(3)}])
    assert [r.sources for r in rows] == [(address(1),)]
    assert refusals(pack.drain_skips()) == [
        (address(0), "images_exceed_length", "its 1 image(s) take 12 tokens (patch grids 3x3); a row holds 8")]
    assert pack.drain_skips() == []


def test_document_longer_than_a_row_is_cut_on_the_text_side_and_counted():
    pack = packer(10)
    out = pack.push((address(0), {"input_ids": text(20), "pixels": picture(1, 2, 0)}))
    assert len(out) == 1, "a full row is emitted at once"
    ids = out[0].tokens["input_ids"]
    assert ids[:3].tolist() == [10, 10, 13] and ids[3:].tolist() == list(range(1000, 1007))
    assert pack.drain_truncations() == [(address(0), 13)]
    assert pack.flush() == []


def test_a_document_cut_to_fit_keeps_only_the_text_its_row_holds():
    """A row plan waiting in a shuffle buffer holds its documents; one cut on the text side must
    hold the text its row takes, not the whole text it was cut from (a view of it kept a long
    caption or interleaved document whole for as long as the row waited)."""
    pack = packer(10, assemble=False)
    long_text = text(100_000)
    (plan,) = pack.push((address(0), {"input_ids": long_text, "pixels": picture(1, 2, 0)}))
    del long_text
    (document,) = plan.documents
    held = document.text if document.text.base is None else document.text.base
    assert held.nbytes == len(document.text) * 4 == 7 * 4
    assert plan.assemble().tokens["input_ids"][3:].tolist() == list(range(1000, 1007))


def test_empty_and_textless_documents():
    pack = packer(8)
    rows = run(pack, [{"input_ids": text(0)}, {"input_ids": text(0), "pixels": picture(1, 1, 0)}, {}])
    assert [r.sources for r in rows] == [(address(1),)]
    assert refusals(pack.drain_skips()) == [
        (address(0), "empty_document", "'input_ids' holds no token ids and it has no image"),
        (address(2), "missing_text", "it lacks 'input_ids': it has no fields"),
    ]


@pytest.mark.parametrize("ids", ["a caption, not its ids", [1.5, 2.5], [-1, 5], [5, 2**31], [[1, 2], [3, 4]], [[1], [2, 3]],
                                 [1000, True], (False, 1000)])
def test_ids_from_the_data_that_are_not_token_ids_are_skipped_as_not_tokens(ids):
    """Without a tokenizer the ids come from the data as stored: text used to fail inside the
    packer with a bare ValueError, and -1, 2**31 or 1.5 were wrapped or truncated into a row; a
    bool among ints (a JSON `true`) was read as id 1."""
    pack = packer(8)
    rows = run(pack, [{"input_ids": ids, "pixels": picture(1, 1, 0)}, {"input_ids": [7, 8, 9]}])
    assert [r.sources for r in rows] == [(address(1),)]
    assert rows[0].tokens["input_ids"][:3].tolist() == [7, 8, 9]
    [(where, reason, detail)] = refusals(pack.drain_skips())
    assert (where, reason) == (address(0), "not_tokens")
    assert detail.startswith("'input_ids' holds ") and detail.endswith(", not a flat list of token ids in [0, 2**31)")


@pytest.mark.parametrize("placeholders", [PIXTRAL, QwenPlaceholders(20, 21, 22, merge_size=1)], ids=["pixtral", "qwen"])
@pytest.mark.parametrize("images", [0, 1], ids=["text-only", "with-image"])
@pytest.mark.parametrize("before", [1, _SHORT_TEXT - 2, _SHORT_TEXT - 1, 4 * _SHORT_TEXT],
                         ids=lambda n: f"{n + 2}-tokens")
def test_text_that_holds_a_placeholder_id_is_skipped_instead_of_faking_an_image_slot(placeholders, images, before):
    """A caption that spells `[IMG]` or `<|image_pad|>` through a tokenizer that does not split it
    (split_special_tokens=False, an added token that is not special) or ids from the data gave a
    row with more image tokens than image patches: the model, which finds image slots by these
    ids, then fails on the count or puts an image's embeddings on the caption. Short and long
    texts are searched two ways (a set, NumPy): both find the id, at the end too."""
    for token_id in placeholders.token_ids:
        pack = packer(16, placeholders=placeholders)
        caption = np.concatenate([text(before), np.array([1000 + before, token_id], dtype=np.int32)])
        record = {"input_ids": caption, **({"pixels": picture(1, 1, 0)} if images else {})}
        rows = run(pack, [record, {"input_ids": text(3)}])
        assert [r.sources for r in rows] == [(address(1),)]
        assert refusals(pack.drain_skips()) == [(address(0), "placeholder_in_text", (
            f"'input_ids' holds the placeholder id {token_id} at token {before + 1} (1 in all): a tokenizer that "
            "does not split special tokens, or ids stored in the data"))]
    assert sorted(placeholders.token_ids) == sorted(set(placeholders.tokens_for(2, 1).tolist()))


def test_first_fit_fills_earlier_rows_and_evicts_the_oldest_when_too_many_are_open():
    pack = packer(10, max_open_rows=2)
    assert pack.push((address(0), {"input_ids": text(6)})) == []
    assert pack.push((address(1), {"input_ids": text(6)})) == []  # does not fit row 0: opens row 1
    evicted = pack.push((address(2), {"input_ids": text(7)}))  # a third row: the oldest goes
    assert [r.sources for r in evicted] == [(address(0),)]
    full = pack.push((address(3), {"input_ids": text(4)}))  # fills row 1 exactly
    assert [r.sources for r in full] == [(address(1), address(3))]
    assert [r.sources for r in pack.flush()] == [(address(2),)]
    assert full[0].tokens["document_ids"].tolist() == [0] * 6 + [1] * 4
    assert full[0].tokens["position_ids"].tolist() == list(range(6)) + list(range(4))


def test_video_frames_are_packed_as_consecutive_images():
    frames = np.stack([picture(1, 2, s) for s in range(3)])
    [row] = run(packer(16), [{"input_ids": text(2), "pixels": frames}])
    assert row.ragged["image_grid"].tolist() == [[1, 2]] * 3
    assert row.ragged["image_token_offset"].tolist() == [0, 3, 6]
    assert np.array_equal(row.ragged["pixel_values"], np.concatenate([patchify(f, P) for f in frames]))


def test_processor_patch_rows_travel_with_their_given_grid():
    rows = np.random.default_rng(0).random((2 * 4, 12), dtype=np.float32)
    pack = packer(32, placeholders=QwenPlaceholders(1, 2, 3, merge_size=2), spec=ImageSpec(patch_size=14, merge_size=2),
                  patch_dim=12, patch_dtype=np.float32)
    [row] = run(pack, [{"input_ids": text(3), "pixels": rows, "image_grid": np.array([[2, 4]], np.int32)}])
    assert row.tokens["input_ids"][:7].tolist() == [1, 2, 2, 3, 1000, 1001, 1002]
    assert np.array_equal(row.ragged["pixel_values"], rows)
    assert row.ragged["image_grid"].tolist() == [[2, 4]]


@pytest.mark.parametrize("grid", [(3, 4), (2, 0)])
def test_a_given_grid_the_placeholders_cannot_merge_is_a_configuration_error_naming_the_record(grid):
    """A processor's grid that is not whole merged cells (or is empty) used to escape as a bare
    ValueError from the placeholder convention, with no record named."""
    rows = np.zeros((grid[0] * grid[1], 12), np.float32)
    pack = packer(32, placeholders=QwenPlaceholders(1, 2, 3, merge_size=2), spec=ImageSpec(patch_size=14, merge_size=2),
                  patch_dim=12, patch_dtype=np.float32)
    with pytest.raises(ConfigurationError, match=r"record .*shard-0.*2x2"):
        run(pack, [{"input_ids": text(3), "pixels": rows, "image_grid": np.array([grid], np.int32)}])


@pytest.mark.parametrize("grid", [[2, 4, 2], np.array([2, 4, 2], np.int32), np.array([[2, 4, 1]], np.int32), 8,
                                  [["2", "4"]], [[2.9, 4]], [[2, 4.0]], [[2, 4, 1]], [[2, 4], 3]],
                         ids=["odd_count", "odd_array", "triple_array", "bare_number", "strings", "fraction", "float",
                              "triple", "pair_and_number"])
def test_a_given_grid_that_is_not_whole_number_pairs_is_a_configuration_error_naming_the_record(grid):
    """The grid comes from the data: an odd count failed in reshape as a bare ValueError naming no
    record, and "2" or 2.9 were converted to 2 silently."""
    rows = np.zeros((2 * 4, 12), np.float32)
    pack = packer(32, placeholders=QwenPlaceholders(1, 2, 3, merge_size=2), spec=ImageSpec(patch_size=14, merge_size=2),
                  patch_dim=12, patch_dtype=np.float32)
    with pytest.raises(ConfigurationError, match=r"record ds:shard-0#0: image_grid=.* is not a \(rows, cols\) pair "
                                                 r"of whole numbers per image"):
        run(pack, [{"input_ids": text(3), "pixels": rows, "image_grid": grid}])
    for whole in ([2, 4], [[2, 4]], ((2, 4),), [np.array([2, 4])], np.array([[2, 4]], np.uint8)):
        [row] = run(pack, [{"input_ids": text(3), "pixels": rows, "image_grid": whole}])
        assert row.ragged["image_grid"].tolist() == [[2, 4]]


def test_images_that_do_not_match_the_spec_are_a_configuration_error():
    with pytest.raises(ConfigurationError, match="grid"):
        run(packer(32), [{"input_ids": text(2), "pixels": np.zeros((5, 8, 3), np.uint8)}])
    with pytest.raises(ConfigurationError, match="merge"):
        packer(32, placeholders=QwenPlaceholders(1, 2, 3, merge_size=2))
    with pytest.raises(ConfigurationError, match="image_position"):
        packer(32, image_position="middle")


@pytest.mark.parametrize("pad_id", [-1, 2**31, 1.5, "0"])
def test_a_pad_id_that_is_no_token_id_is_a_configuration_error_like_pack_flats(pad_id):
    """pack_flat checks its pad_id; pack_multimodal took any value, and a negative pad id reached
    the batches as an id no embedding has (2**31 and "0" failed only inside the first batch)."""
    with pytest.raises(ConfigurationError, match="pad_id"):
        PackMultimodal(max_length=16, placeholders=PIXTRAL, spec=SPEC, pad_id=pad_id)
    with pytest.raises(ConfigurationError, match="pad_id"):
        MultimodalPacker(CTX, max_length=16, placeholders=PIXTRAL, spec=SPEC, pad_id=pad_id)


@pytest.mark.parametrize("placeholder", PIXTRAL.token_ids)
def test_a_pad_id_that_is_a_placeholder_id_is_a_configuration_error(placeholder):
    """Padding that holds a placeholder id is taken by the model for image slots that have no
    patches (Qwen's `<|image_pad|>` reads like a pad token), so the row's image-token count is
    wrong; refused whether the pad id is given or is the pipeline's default."""
    with pytest.raises(ConfigurationError, match="placeholder"):
        PackMultimodal(max_length=16, placeholders=PIXTRAL, spec=SPEC, pad_id=placeholder)
    op = PackMultimodal(max_length=16, placeholders=PIXTRAL, spec=SPEC)
    with pytest.raises(ConfigurationError, match="placeholder"):
        op.padding_row(default_pad_id=placeholder)
    with pytest.raises(ConfigurationError, match="placeholder"):
        op.factory(default_pad_id=placeholder)(CTX)
    # Counting tokens for the mixture builds a packer too, with a pad id of its own choosing.
    zero = PackMultimodal(max_length=16, placeholders=PixtralPlaceholders(0, 1, 2), spec=SPEC)
    assert zero.token_counter()(address(0), {"input_ids": text(3)}) == 3


@pytest.mark.parametrize("setting", ["max_length", "max_open_rows"])
def test_sizes_are_checked_like_pack_flats_a_numpy_integer_taken_and_a_bool_refused(setting):
    """`isinstance(value, int)` took True as a row of one token (or one open row) and refused
    numpy.int64(64), a size computed with NumPy, as not "a positive integer"; pack_flat takes the
    one and refuses the other. A NumPy size is kept as a plain int, so the fingerprint holds 64."""
    sizes = {"max_length": 64, "max_open_rows": 4}
    for make in (lambda **kw: PackMultimodal(placeholders=PIXTRAL, spec=SPEC, **kw),
                 lambda **kw: MultimodalPacker(CTX, placeholders=PIXTRAL, spec=SPEC, pad_id=PAD, **kw)):
        with pytest.raises(ConfigurationError, match=setting):
            make(**{**sizes, setting: True})
        made = make(**{**sizes, setting: np.int64(sizes[setting])})
        assert type(getattr(made, setting)) is int and getattr(made, setting) == sizes[setting]
    fingerprint = PackMultimodal(placeholders=PIXTRAL, spec=SPEC, **{**sizes, setting: np.int64(3)}).fingerprint(0)
    assert fingerprint[setting] == 3


@pytest.mark.parametrize("setting", ["field", "pixels_field", "grid_field", "offsets_field"])
@pytest.mark.parametrize("value", [None, "", 3])
def test_a_field_name_that_is_not_a_non_empty_str_is_refused_like_pack_flats(setting, value):
    """A field of None or 3 is read from no record: `field=None` skipped every document as
    missing_text and `pixels_field=3` packed every caption without its images, unsaid, where a
    pipeline with a map (which might write any field) is not checked against its decoders. The
    pixels and grid fields left None follow the decoder's (`PackMultimodal.bound_to`)."""
    if value is None and setting in ("pixels_field", "grid_field"):
        packer = PackMultimodal(max_length=64, placeholders=PIXTRAL, spec=SPEC, **{setting: value})
        assert getattr(packer.bound_to([DecodeImages(spec=SPEC, output_field="image", grid_field="grid")]), setting) \
            == {"pixels_field": "image", "grid_field": "grid"}[setting]
        return
    with pytest.raises(ConfigurationError, match=re.escape(
            f"pack_multimodal: {setting} must be a record field's name (a non-empty str), got {value!r}")):
        PackMultimodal(max_length=64, placeholders=PIXTRAL, spec=SPEC, **{setting: value})


def test_a_spec_that_is_not_an_image_spec_is_refused_naming_it():
    """It failed as a bare `AttributeError: 'str' object has no attribute 'merge_size'`."""
    with pytest.raises(ConfigurationError, match=re.escape("pack_multimodal: spec must be an ImageSpec, got 'pixtral'")):
        PackMultimodal(max_length=64, placeholders=PIXTRAL, spec="pixtral")


def test_unassembled_plans_assemble_to_the_same_rows_elsewhere():
    records = [{"input_ids": text(n, 1000 + 100 * n), "pixels": picture(1, n % 3 + 1, n)} for n in range(1, 9)]
    rows = run(packer(16), records)
    plans = run(packer(16, assemble=False), records)
    assert all(isinstance(p, RowPlan) for p in plans)
    for row, plan in zip(rows, plans, strict=True):
        again = assemble_row(plan)
        assert again.sources == row.sources
        for group in ("tokens", "ragged"):
            for name, array in getattr(row, group).items():
                assert np.array_equal(array, getattr(again, group)[name]), name


def test_padding_row_has_empty_ragged_fields_that_concatenate_with_real_ones():
    pack = packer(8)
    empty = pack.empty_row()
    [real] = run(pack, [{"input_ids": text(2), "pixels": picture(1, 1, 0)}])
    assert (empty.tokens["document_ids"] == PADDING_DOCUMENT).all()
    for name in real.ragged:
        assert empty.ragged[name].shape[0] == 0
        joined = np.concatenate([empty.ragged[name], real.ragged[name]])
        assert joined.dtype == real.ragged[name].dtype


def test_operator_builds_packers_per_segment_and_fingerprints_as_json():
    op = PackMultimodal(max_length=16, placeholders=PIXTRAL, spec=SPEC)
    make = op.factory(default_pad_id=7)
    pack = make(SegmentContext(lane=3, segment=1))
    [plan] = run(pack, [{"input_ids": text(2)}])
    assert isinstance(plan, RowPlan)  # the loader assembles it when it takes the row
    assert plan.assemble().tokens["input_ids"][2:].tolist() == [7] * 14
    padding = op.padding_row(default_pad_id=7)
    assert (padding.tokens["input_ids"] == 7).all() and padding.ragged["pixel_values"].shape == (0, SPEC.patch_dim)
    fingerprint = op.fingerprint(default_pad_id=7)
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert fingerprint["pad_id"] == 7 and fingerprint["placeholders"]["img_id"] == 10
    assert op.fingerprint(7) != PackMultimodal(max_length=16, placeholders=PixtralPlaceholders(10, 12, 14),
                                               spec=SPEC).fingerprint(7)


class FixedPlaceholders:
    """A convention of the user's own (the `Placeholders` protocol is public), not a dataclass:
    `count` copies of one id per image, whatever its grid."""

    merge_size = 1

    def __init__(self, image_id: int, count: int) -> None:
        self.image_id, self.count = image_id, count

    @property
    def token_ids(self) -> tuple[int, ...]:
        return (self.image_id,)

    def tokens_for(self, rows: int, cols: int) -> np.ndarray:
        return np.full(self.count, self.image_id, np.int32)

    def num_tokens(self, rows: int, cols: int) -> int:
        return self.count


def test_a_placeholders_convention_that_is_not_a_dataclass_fingerprints_by_its_settings():
    """pack_multimodal accepted it (it meets the protocol), then building a loader failed in the
    fingerprint with a bare `TypeError: must be called with a dataclass type or instance`."""
    fingerprint = PackMultimodal(max_length=16, placeholders=FixedPlaceholders(10, 4), spec=SPEC).fingerprint(7)
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert "image_id=10" in fingerprint["placeholders"]["settings"]
    assert fingerprint != PackMultimodal(max_length=16, placeholders=FixedPlaceholders(10, 5), spec=SPEC).fingerprint(7)


@dataclasses.dataclass(frozen=True, eq=False)
class TaggedPlaceholders:
    """A convention of the user's own written as a dataclass, holding a set and an array."""

    image_id: int
    tags: frozenset
    table: np.ndarray
    merge_size: int = 1

    @property
    def token_ids(self) -> tuple[int, ...]:
        return (self.image_id,)

    def tokens_for(self, rows: int, cols: int) -> np.ndarray:
        return np.full(rows * cols, self.image_id, np.int32)

    def num_tokens(self, rows: int, cols: int) -> int:
        return rows * cols


def test_a_dataclass_placeholders_convention_fingerprints_the_same_in_every_process_and_by_its_content():
    """Its fields were written by `json.dumps(default=str)`: a set in the order per-process string
    hashing gives (a resumed run refused its own checkpoint as another recipe), an array by its
    elided str (one edited in the middle resumed the old recipe's checkpoint)."""
    code = (
        "import numpy as np\n"
        "from tests.unit.test_vlm_packing import SPEC, TaggedPlaceholders\n"
        "from vlm import PackMultimodal\n"
        "tags = frozenset({'photo', 'scan', 'chart', 'diagram', 'screenshot', 'map'})\n"
        "op = PackMultimodal(max_length=16, placeholders=TaggedPlaceholders(10, tags, np.arange(5000)), spec=SPEC)\n"
        "print(op.fingerprint(7))\n"
    )
    prints = printed_in_processes(code)
    assert len(prints) == 1, prints
    assert "'chart', 'diagram', 'map', 'photo', 'scan', 'screenshot'" in prints.pop()

    def fingerprint(table: np.ndarray) -> dict:
        placeholders = TaggedPlaceholders(10, frozenset({"photo"}), table)
        return PackMultimodal(max_length=16, placeholders=placeholders, spec=SPEC).fingerprint(7)

    table = np.arange(5000)
    edited = table.copy()
    edited[2500] = -1
    assert fingerprint(table) != fingerprint(edited)
    assert json.loads(json.dumps(fingerprint(table))) == fingerprint(table)


# -- the property: every token, image and label accounted for -----------------------------------

@st.composite
def documents(draw):
    count = draw(st.integers(0, 12))
    docs = []
    for i in range(count):
        n_text = draw(st.integers(0, 30))
        grids = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), max_size=3))
        record = {"input_ids": text(n_text, 1000 + 100 * i)}
        if grids:
            record["pixels"] = [picture(r, c, seed=i * 10 + k) for k, (r, c) in enumerate(grids)]
            if draw(st.booleans()):
                record["image_offsets"] = sorted(draw(st.lists(st.integers(0, n_text), min_size=len(grids),
                                                               max_size=len(grids))))
        docs.append(record)
    return docs


def expected_document(record: dict, max_length: int, position: str):
    """The tokens and text mask a document should occupy, built independently of the packer."""
    tokens = record["input_ids"].tolist()
    images = record.get("pixels", [])
    expansions = [PIXTRAL.tokens_for(im.shape[0] // P, im.shape[1] // P).tolist() for im in images]
    image_tokens = sum(map(len, expansions))
    if image_tokens > max_length or image_tokens + len(tokens) == 0:
        return None
    offsets = record.get("image_offsets") or [{"before_text": 0, "after_bos": min(1, len(tokens)),
                                               "after_text": len(tokens)}[position]] * len(images)
    tokens = tokens[: max_length - image_tokens]
    out, is_text, starts, cut = [], [], [], 0
    for expansion, offset in zip(expansions, offsets):
        offset = min(offset, len(tokens))
        out += tokens[cut:offset]
        is_text += [True] * (offset - cut)
        starts.append(len(out))
        out += expansion
        is_text += [False] * len(expansion)
        cut = offset
    out += tokens[cut:]
    is_text += [True] * (len(tokens) - cut)
    return out, is_text, starts


@settings(max_examples=60)
@given(docs=documents(), max_length=st.integers(8, 48), open_rows=st.integers(1, 4),
       position=st.sampled_from(["before_text", "after_bos", "after_text"]))
def test_every_document_lands_whole_in_exactly_one_row(docs, max_length, open_rows, position):
    pack = packer(max_length, max_open_rows=open_rows, image_position=position)
    rows = run(pack, docs)
    assert pack.flush() == []
    expected = {address(i): expected_document(d, max_length, position) for i, d in enumerate(docs)}
    skipped = {a for a, *_ in pack.drain_skips()}
    assert skipped == {a for a, e in expected.items() if e is None}
    placed = [a for row in rows for a in row.sources]
    assert sorted(placed) == sorted(a for a, e in expected.items() if e is not None), "each document once"
    for row in rows:
        ids, labels = row.tokens["input_ids"], row.tokens["labels"]
        doc_ids = row.tokens["document_ids"]
        assert all(a.shape == (max_length,) for a in row.tokens.values())
        patches, grids, image_at = [], [], []
        for number, source in enumerate(row.sources):
            tokens, is_text, starts = expected[source]
            span = np.flatnonzero(doc_ids == number)
            assert span.tolist() == list(range(span[0], span[0] + len(tokens))), "a document is contiguous"
            assert ids[span].tolist() == tokens
            assert row.tokens["position_ids"][span].tolist() == list(range(len(tokens)))
            want = [tokens[k + 1] if k + 1 < len(tokens) and is_text[k + 1] else IGNORE_INDEX
                    for k in range(len(tokens))]
            assert labels[span].tolist() == want
            images = docs[source.index].get("pixels", [])
            patches += [patchify(im, P) for im in images]
            grids += [[im.shape[0] // P, im.shape[1] // P] for im in images]
            image_at += [int(span[0]) + s for s in starts]
        end = max((int(np.flatnonzero(doc_ids == n)[-1]) + 1 for n in range(len(row.sources))), default=0)
        assert (doc_ids[end:] == PADDING_DOCUMENT).all() and (ids[end:] == PAD).all()
        assert (labels[end:] == IGNORE_INDEX).all()
        assert row.ragged["image_grid"].tolist() == grids
        assert row.ragged["image_token_offset"].tolist() == image_at
        assert np.array_equal(row.ragged["pixel_values"],
                              np.concatenate(patches) if patches else np.empty((0, SPEC.patch_dim), np.uint8))


@settings(max_examples=40)
@given(docs=documents(), max_length=st.integers(8, 48), microbatch=st.integers(1, 4))
def test_a_microbatch_assembled_from_plans_equals_its_rows_collated(docs, max_length, microbatch):
    plans = run(packer(max_length, assemble=False), docs) + [packer(max_length)._plan([])]
    assert_plans_collate_like_their_rows(plans, microbatch)
