"""Decoding after packing: the grid planned from a header is the grid decoded, and what a header
cannot vouch for fails with a named reason when its row is decoded."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from tests.unit.test_vlm_assets import (
    REAL_JPEGS,
    REAL_PNGS,
    cmyk_jpeg,
    encode,
    gradient,
    multi_picture_jpeg,
    palette_alpha_png,
    png_chunk,
    png_header_only,
    raw_profile_exif_png,
    real_file,
    rotated_jpeg,
    sixteen_bit_png,
    stored_png,
    truncated_jpeg,
    xmp_png,
)
from vlm import ImageDecodeError, ImageSpec, decode_image
from vlm._deferred import DeferredImage
from vlm._image import probe_image

SPECS = [ImageSpec(), ImageSpec.pixtral(max_side=128), ImageSpec.qwen2_vl(max_pixels=256 * 256)]


def _tiff(mode: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(gradient()).convert(mode).save(buffer, "TIFF")
    return buffer.getvalue()


IMAGES = {
    **{relative.rsplit("/", 1)[-1]: (package, relative) for package, relative in REAL_JPEGS + REAL_PNGS},
    "rotated-6.jpg": rotated_jpeg(6),
    "rotated-8.jpg": rotated_jpeg(8),
    "cmyk.jpg": cmyk_jpeg(),
    "multi-picture.mpo": multi_picture_jpeg()[0],
    "sixteen-bit.png": sixteen_bit_png(),
    "palette-alpha.png": palette_alpha_png(),
    "one-bit.tiff": _tiff("1"),
    "float.tiff": _tiff("F"),
    "tall.png": encode(gradient(700, 90)),
    "raw-profile-exif-6.png": raw_profile_exif_png(6),
    "xmp-orientation-8.png": xmp_png(8),
}


def _bytes(name: str) -> bytes:
    value = IMAGES[name]
    return real_file(*value).read_bytes() if isinstance(value, tuple) else value


@pytest.mark.parametrize("spec", SPECS, ids=["default", "pixtral", "qwen2-vl"])
@pytest.mark.parametrize("name", list(IMAGES))
def test_the_grid_read_from_the_header_is_the_grid_decoded(name, spec):
    data = _bytes(name)
    rows, cols = probe_image(data, spec)
    pixels = decode_image(data, spec)
    assert pixels.shape == (rows * spec.patch_size, cols * spec.patch_size, 3)
    deferred = DeferredImage(data, (rows, cols), spec)
    assert deferred.shape == pixels.shape
    assert np.array_equal(pickle.loads(pickle.dumps(deferred)).decode(), pixels)


def _reason(call) -> str:
    with pytest.raises(ImageDecodeError) as caught:
        call()
    return caught.value.reason


def _flip_a_byte_in_the_pixel_data(png: bytes) -> bytes:
    at = png.index(b"IDAT") + 4 + 40
    return png[:at] + bytes([png[at] ^ 0xFF]) + png[at + 1 :]


def test_what_the_header_shows_is_refused_before_packing():
    png = encode(gradient(480, 640))
    assert _reason(lambda: probe_image(b"<html>404</html>" * 20)) == "corrupt_image"
    assert _reason(lambda: probe_image(png_header_only(20000, 20000))) == "decompression_bomb"
    assert _reason(lambda: probe_image(png[: len(png) // 2])) == "truncated_image"
    assert _reason(lambda: probe_image(_flip_a_byte_in_the_pixel_data(png))) == "corrupt_image"


@pytest.mark.parametrize("options", [{"quality": 80}, {"lossless": True}], ids=["lossy", "lossless"])
def test_a_truncated_webp_is_refused_as_truncated_before_packing_as_when_decoded(options):
    """Pillow reads a WebP whole when it opens it, so the header check already finds the cut."""
    data = encode(gradient(480, 640), "WEBP", **options)
    cut = data[: len(data) // 2]
    assert _reason(lambda: probe_image(cut)) == _reason(lambda: decode_image(cut)) == "truncated_image"


def test_a_truncated_jpeg_passes_its_header_and_fails_when_decoded():
    data = truncated_jpeg()
    spec = ImageSpec()
    deferred = DeferredImage(data, probe_image(data, spec), spec)
    assert _reason(deferred.decode) == "truncated_image"


# -- a PNG gets one verdict, decoded before or after packing ---------------------------------------
# Both paths check its pixel chunks the same way (`vlm._png.check_pixel_data`); what follows
# the pixel data does not decide whether the picture is whole.

def _late_text_cut_short(png: bytes) -> bytes:
    """The PNG with a text chunk after its pixel data whose body the file ends inside."""
    end = png.rindex(b"IEND") - 4
    return png[:end] + png_chunk(b"tEXt", b"Comment\0" + b"x" * 100)[:20]


@pytest.mark.parametrize("lose", [lambda png: png[:-12], lambda png: png[:-6], _late_text_cut_short],
                         ids=["without-IEND", "IEND-cut-short", "late-text-cut-short"])
def test_a_png_that_lost_only_what_follows_its_pixels_decodes_whole_before_or_after_packing(lose):
    """Its deflate stream ends, so every pixel is there: Pillow's decoder reads it, and its
    `verify`, which wants every chunk through IEND, refused it before packing."""
    whole = encode(gradient(96, 160))
    data = lose(whole)
    spec = ImageSpec()
    expected = decode_image(whole, spec)
    assert np.array_equal(decode_image(data, spec), expected)
    assert np.array_equal(DeferredImage(data, probe_image(data, spec), spec).decode(), expected)


def test_a_png_whose_pixel_data_fails_its_checksum_is_corrupt_before_or_after_packing():
    """The changed byte still inflates, to one wrong pixel: Pillow's decoder skips the IDAT
    checksums, so decoding before packing trained on it while the header check refused it."""
    damaged = _flip_a_byte_in_the_pixel_data(stored_png(gradient(96, 160)))
    assert _reason(lambda: decode_image(damaged)) == "corrupt_image"
    assert _reason(lambda: probe_image(damaged)) == "corrupt_image"


def test_a_png_cut_between_its_pixel_chunks_passes_its_header_and_fails_when_decoded():
    """Only inflating tells that its deflate stream does not end, as for a truncated JPEG."""
    two = stored_png(gradient(96, 160), pieces=2)
    data = two[: two.rindex(b"IDAT") - 4]
    spec = ImageSpec()
    assert _reason(lambda: decode_image(data, spec)) == "truncated_image"
    assert _reason(DeferredImage(data, probe_image(data, spec), spec).decode) == "truncated_image"


def test_a_deferred_png_has_its_pixel_chunks_checked_once_at_its_header_not_again_when_decoded(monkeypatch):
    """The bytes a DeferredImage decodes are those probe_image checked: checking their checksums
    again after packing is work for nothing (7 µs of the ~1.5 ms a race image takes)."""
    from vlm import _png

    checked = []
    check = _png.check_pixel_data
    monkeypatch.setattr(_png, "check_pixel_data", lambda data: checked.append(len(data)) or check(data))
    data, spec = encode(gradient(96, 160)), ImageSpec()
    deferred = DeferredImage(data, probe_image(data, spec), spec)
    assert np.array_equal(deferred.decode(), decode_image(data, spec))
    assert checked == [len(data), len(data)]  # the probe's and the eager decode's, not the deferred decode's


def _png_with_late_orientation(orientation: int) -> bytes:
    """A PNG whose eXIf chunk (EXIF orientation) comes after its pixel data."""
    png = encode(gradient(96, 160))
    exif = Image.Exif()
    exif[0x0112] = orientation
    payload = exif.tobytes()[6:]  # eXIf holds the TIFF structure without the "Exif\0\0" prefix
    end = png.rindex(b"IEND") - 4
    return png[:end] + png_chunk(b"eXIf", payload) + png[end:]


def test_an_orientation_found_only_after_a_pngs_pixels_fails_instead_of_changing_the_row():
    data = _png_with_late_orientation(6)
    spec = ImageSpec()
    rows, cols = probe_image(data, spec)
    turned = decode_image(data, spec)
    assert turned.shape[:2] != (rows * spec.patch_size, cols * spec.patch_size), "the late EXIF turns it"
    assert _reason(DeferredImage(data, (rows, cols), spec).decode) == "corrupt_image"


@pytest.mark.parametrize("data", [raw_profile_exif_png(6), xmp_png(6)], ids=["raw-profile-exif", "xmp"])
def test_an_orientation_before_a_pngs_pixels_turns_the_planned_grid_without_decoding(data, monkeypatch):
    spec = ImageSpec()
    upright = decode_image(data, spec).shape[:2]
    assert upright == (160, 96), "decoding turns the 96x160 picture"

    def refuse(self):
        raise AssertionError("probe_image decoded the pixels")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", refuse)
    rows, cols = probe_image(data, spec)
    assert (rows * spec.patch_size, cols * spec.patch_size) == upright


def test_a_deferred_image_crosses_processes_through_shared_memory(tmp_path):
    """The process runner's transport moves its bytes out of band, like an array's."""
    from runners._transport import decode, encode

    data = _bytes("chelsea.png")
    spec = ImageSpec.pixtral(max_side=128)
    deferred = DeferredImage(data, probe_image(data, spec), spec)
    envelope = encode(deferred, str(tmp_path), threshold=16 * 1024)
    assert envelope.path is not None and envelope.shm_bytes == len(data) > 16 * 1024
    assert len(envelope.stream) < 1024, "the bytes are not in the pickle stream"
    assert np.array_equal(decode(envelope).decode(), decode_image(data, spec))


def test_a_masked_document_zeroes_only_the_image_that_failed_and_masks_all_its_labels():
    """What the docs say of a masked document, held to: every label -100, the failed image's
    patches zero, and its other image's patches the pixels that image decoded to (the docs said
    every patch of the document was zero)."""
    from vlm import MultimodalPacker, PixtralPlaceholders, assemble_row, patchify
    from vlm._deferred import decode_row
    from zephon._records import RecordAddress
    from zephon._sequence import IGNORE_INDEX

    spec = ImageSpec(max_pixels=96 * 96)
    good, bad = encode(gradient(48, 64)), truncated_jpeg()
    images = [DeferredImage(data, probe_image(data, spec), spec) for data in (good, bad)]
    packer = MultimodalPacker(None, max_length=256, placeholders=PixtralPlaceholders(10, 12, 13), spec=spec,
                              pad_id=0, assemble=False)
    address = RecordAddress("ds", "shard-0", 0)
    record = {"input_ids": np.arange(1000, 1005, dtype=np.int32), "pixels": images}
    [plan] = packer.push((address, record)) + packer.flush()
    decoded = decode_row(plan, on_error="skip")
    [(masked_address, reason, detail)] = decoded.masked_documents
    assert (masked_address, reason) == (address, "truncated_image")
    assert detail.startswith("image 2 of 2: "), "which of the document's images failed"
    row = assemble_row(decoded)
    first, second = (rows * cols for rows, cols in (image.grid for image in images))
    pixels = row.ragged["pixel_values"]
    assert len(pixels) == first + second
    assert np.array_equal(pixels[:first], patchify(decode_image(good, spec), spec.patch_size))
    assert not pixels[first:].any()
    assert (row.tokens["labels"] == IGNORE_INDEX).all()


def test_a_deferred_image_off_the_packers_patch_grid_is_refused_naming_its_record():
    """Images decoded with 14 px patches, deferred, given to a packer cutting 16 px ones (one made
    by hand, reading a field a map wrote): its refusal described the image by a `dtype` a
    DeferredImage lacked, so the run stopped with a bare AttributeError naming no record."""
    from vlm import MultimodalPacker, PixtralPlaceholders
    from zephon import ConfigurationError
    from zephon._records import RecordAddress

    spec = ImageSpec(patch_size=14, max_pixels=96 * 96)
    data = encode(gradient(48, 64))
    packer = MultimodalPacker(None, max_length=256, placeholders=PixtralPlaceholders(10, 12, 13),
                              spec=ImageSpec(max_pixels=96 * 96), pad_id=0, assemble=False)
    record = {"input_ids": np.arange(1000, 1005, dtype=np.int32),
              "pixels": DeferredImage(data, probe_image(data, spec), spec)}
    with pytest.raises(ConfigurationError, match=r"record ds:shard-0#0: image \(\d+, \d+, 3\) uint8 does not match"):
        packer.push((RecordAddress("ds", "shard-0", 0), record))
