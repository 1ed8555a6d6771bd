"""Fuzzing image decode: random bytes and mutated valid images.

For any bytes, `decode_image` returns a uint8 (H, W, 3) array on the patch grid that `image_grid`
gives for the image's size, or raises ImageDecodeError with one of IMAGE_REASONS; nothing else
escapes (MemoryError aside, which is never swallowed). Decoding is a pure function of the bytes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from PIL import Image

from tests.fuzz.conftest import fuzz_settings
from vlm import IMAGE_REASONS, ImageDecodeError, ImageSpec, decode_image, image_grid

# Pillow warns about the broken metadata a mutation makes; the test is about what decode returns.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::PIL.Image.DecompressionBombWarning")

# A small refusal size keeps a mutated header from making the fuzzer allocate gigabytes.
SPEC = ImageSpec(max_pixels=64 * 64, max_image_pixels=1024 * 1024)
FORMATS = {"PNG": {}, "JPEG": {"quality": 80}, "GIF": {}, "BMP": {}, "WEBP": {"quality": 70}, "TIFF": {},
           "PPM": {}}
MODES = ["RGB", "L", "RGBA", "P", "LA", "CMYK", "1", "I;16"]


def _make_valid(width: int, height: int, mode: str, fmt: str, seed: int) -> bytes | None:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    image = rgb.convert("I;16") if mode == "I;16" else rgb.convert(mode)
    sink = io.BytesIO()
    try:
        image.save(sink, fmt, **FORMATS[fmt])
    except (OSError, ValueError, KeyError):  # this format cannot hold this mode
        return None
    return sink.getvalue()


def _check(data: bytes, *, intact: bool = False) -> None:
    """`intact`: the encoder's own bytes, which must decode (any known reason passed for them too,
    so a decoder refusing every image passed the mutation fuzzing)."""
    try:
        pixels = decode_image(data, SPEC)
    except ImageDecodeError as error:
        assert not intact, f"an intact image was refused: {error.reason}"
        assert error.reason in IMAGE_REASONS, error.reason
        return
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
    height, width = Image.open(io.BytesIO(data)).size[::-1]
    expected = {tuple(n * SPEC.patch_size for n in image_grid(h, w, SPEC)) for h, w in ((height, width), (width, height))}
    assert pixels.shape[:2] in expected, (pixels.shape, height, width)  # either way up (EXIF rotation)
    assert np.array_equal(decode_image(data, SPEC), pixels), "decoding is deterministic"


@fuzz_settings(ci=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=2048))
def test_random_bytes_decode_or_fail_with_a_known_reason(data):
    _check(data)


@st.composite
def mutated_images(draw) -> tuple[bytes, bool]:
    """A valid image's bytes after 0-6 mutations, and whether they are still the encoder's own."""
    data = None
    while data is None:
        data = _make_valid(draw(st.integers(1, 96)), draw(st.integers(1, 96)), draw(st.sampled_from(MODES)),
                           draw(st.sampled_from(sorted(FORMATS))), draw(st.integers(0, 2**16)))
    mutated = bytearray(data)
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        at = draw(st.integers(0, max(len(mutated) - 1, 0)))
        if kind == "flip" and mutated:
            mutated[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del mutated[at:]
        elif kind == "insert":
            mutated[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif mutated:
            del mutated[at : at + draw(st.integers(1, 16))]
    return bytes(mutated), bytes(mutated) == data


@fuzz_settings(ci=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated_images())
def test_mutated_images_decode_to_the_grid_or_fail_with_a_known_reason(data):
    data, intact = data
    _check(data, intact=intact)


@fuzz_settings(ci=30, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 200), height=st.integers(1, 200), mode=st.sampled_from(MODES),
       fmt=st.sampled_from(sorted(FORMATS)), seed=st.integers(0, 2**16))
def test_valid_images_of_any_mode_decode_to_rgb_on_the_grid(width, height, mode, fmt, seed):
    data = _make_valid(width, height, mode, fmt, seed)
    if data is None:
        return
    pixels = decode_image(data, SPEC)
    rows, cols = image_grid(height, width, SPEC)
    assert pixels.shape == (rows * SPEC.patch_size, cols * SPEC.patch_size, 3) and pixels.dtype == np.uint8
