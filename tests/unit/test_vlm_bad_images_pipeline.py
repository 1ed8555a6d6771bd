"""Bad images inside a real WebDataset shard, through the whole VLM pipeline.

The shard mixes real image+caption pairs with one record of each kind of trouble, each made from
a real photograph where a real one can carry the fault. Each gets its documented behaviour
(vlm/README.md, "Bad input"): odd modes are converted and packed, broken files and bombs are
skipped by reason, half-pairs are skipped by the stage that misses its half. The ledger counts every
record exactly once, and `on_error="raise"` stops on the first bad record, naming its address.
"""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from PIL import Image

from tests.harness import dataset_counts_in
from tests.unit.test_vlm_assets import png_header_only
from vlm import ImageSpec
from vlm._assets import pair_shards, photographs, tekken_tokenizer
from vlm._demo import vlm_pipeline
from zephon._errors import BadRecordError, ConfigurationError

SPEC = ImageSpec.pixtral(max_side=64)
NUM_GOOD = 12

# key -> (what the pipeline does with it, the skip reason or None when it is packed)
EXPECTED = {
    "bad-truncated-jpeg": "truncated_image",
    "bad-garbage-bytes": "corrupt_image",
    "bad-bomb-20000x20000": "decompression_bomb",
    "bad-image-without-caption": "missing_field",  # tokenize runs first and finds no caption
    "bad-caption-without-image": "missing_image",
    "odd-cmyk-jpeg": None,
    "odd-16-bit-png": None,
    "odd-palette-alpha-png": None,
    "odd-png-without-iend": None,  # every pixel is there: packed, decoded before or after packing
}


def _photo() -> Image.Image:
    """A real, colourful photograph from a wheel (scikit-learn's china.jpg, else scikit-image's
    rocket), 192 px on its long side."""
    paths = {p.name: p for p in photographs(origin="wheels").paths}
    path = paths.get("china.jpg") or paths.get("rocket.jpg") or next(p for p in paths.values() if p.suffix == ".jpg")
    with Image.open(path) as image:
        image = image.convert("RGB")
        image.thumbnail((192, 192))
        return image


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _bad_members() -> list[tuple[str, str, bytes | str]]:
    photo = _photo()
    jpeg = _save(photo, "JPEG", quality=90)
    grey16 = Image.fromarray(np.asarray(photo.convert("L"), dtype=np.uint16) * 257)
    adaptive = photo.convert("P", palette=Image.Palette.ADAPTIVE, colors=255)
    indices = np.asarray(adaptive).copy()
    indices[:, : indices.shape[1] // 3] = 255  # the left third becomes the transparent entry
    palette = Image.fromarray(indices, "P")
    palette.putpalette(adaptive.getpalette()[: 255 * 3] + [0, 0, 0])
    return [
        ("bad-truncated-jpeg", "jpg", jpeg[: len(jpeg) // 2]),
        ("bad-truncated-jpeg", "txt", "The first half of a photograph."),
        ("bad-garbage-bytes", "png", bytes(range(256)) * 16),
        ("bad-garbage-bytes", "txt", "Bytes that are no image."),
        ("bad-bomb-20000x20000", "png", png_header_only(20000, 20000)),
        ("bad-bomb-20000x20000", "txt", "A header announcing 400 million pixels."),
        ("bad-image-without-caption", "jpg", jpeg),
        ("bad-caption-without-image", "txt", "A caption whose image is missing."),
        ("odd-cmyk-jpeg", "jpg", _save(photo.convert("CMYK"), "JPEG", quality=95)),
        ("odd-cmyk-jpeg", "txt", "A photograph in printer colours."),
        ("odd-16-bit-png", "png", _save(grey16, "PNG")),
        ("odd-16-bit-png", "txt", "A photograph with sixteen bits per sample."),
        ("odd-palette-alpha-png", "png", _save(palette, "PNG", transparency=255)),
        ("odd-palette-alpha-png", "txt", "A palette photograph, its left third transparent."),
        ("odd-png-without-iend", "png", _save(photo, "PNG")[:-12]),
        ("odd-png-without-iend", "txt", "A photograph whose file lost its closing chunk."),
    ]


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """One tar: real pairs, with the bad and odd records spread between them. Returns
    (directory, keys in record order, the bad members by key)."""
    real = pair_shards(4, 64).shards[0]
    good = []
    with tarfile.open(real) as tar:
        for member in tar:
            good.append((member.name.rsplit(".", 1)[0].replace("/", "_"), member.name.rsplit(".", 1)[1],
                         tar.extractfile(member).read()))
    good = good[: 2 * NUM_GOOD]
    bad = _bad_members()
    members, keys = [], []
    bad_keys = list(dict.fromkeys(key for key, _, _ in bad))
    for i in range(0, len(good), 2):
        members += good[i : i + 2]
        keys.append(good[i][0])
        if i // 2 < len(bad_keys):
            key = bad_keys[i // 2]
            members += [m for m in bad if m[0] == key]
            keys.append(key)
    root = tmp_path_factory.mktemp("bad-pairs")
    with tarfile.open(root / "pairs-00000.tar", "w") as tar:
        for key, ext, payload in members:
            data = payload.encode() if isinstance(payload, str) else payload
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return root, keys, {key: {ext: p for k, ext, p in bad if k == key} for key in bad_keys}


def _pipeline(shard, runner: str = "inline", on_error: str = "skip", defer: bool = False):
    root, _, _ = shard
    return vlm_pipeline(root, tekken_tokenizer(), runner=runner, parallelism=2, spec=SPEC, num_lanes=2,
                        max_length=512, microbatch_size=1, records_per_chunk=4, num_epochs=1, on_error=on_error,
                        defer=defer)


def _run(shard, runner: str = "inline", defer: bool = False):
    with _pipeline(shard, runner, defer=defer).shard(0, 1) as loader:
        batches = list(loader)
        return batches, loader.stats()


def _images_by_key(batches, keys) -> dict[str, np.ndarray]:
    """Each packed record's image, rebuilt (H, W, 3) from its patches, by record key."""
    p = SPEC.patch_size
    out = {}
    for batch in batches:
        grids, patches = batch.ragged["image_grid"], batch.ragged["pixel_values"]
        image, start = 0, 0
        for sources in batch.sources:
            for address in sources:  # one image per record, in row order
                rows, cols = (int(x) for x in grids[image])
                block = patches[start : start + rows * cols].reshape(rows, cols, p, p, 3)
                out[keys[address.index]] = block.swapaxes(1, 2).reshape(rows * p, cols * p, 3)
                image, start = image + 1, start + rows * cols
    return out


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_each_bad_record_is_skipped_by_its_reason_and_odd_modes_are_packed(shard, runner):
    _, keys, _ = shard
    batches, stats = _run(shard, runner)
    total = stats["datasets"]["pairs"]["total"]
    expected_skips = {reason: 1 for reason in EXPECTED.values() if reason}
    assert total["skipped"] == expected_skips
    packed = {keys[a.index] for b in batches for sources in b.sources for a in sources}
    assert packed == set(keys) - {k for k, reason in EXPECTED.items() if reason}
    assert {k for k in EXPECTED if EXPECTED[k] is None} <= packed


def test_the_ledger_balances_on_every_lane(shard):
    _, keys, _ = shard
    batches, stats = _run(shard)
    entry = stats["datasets"]["pairs"]
    assert len(entry["lanes"]) > 1, "every lane: the loop below must have lanes to check"
    for name in ("read", "emitted", "filtered"):
        assert sum(counts[name] for counts in entry["lanes"].values()) == entry["total"][name], name
    for counts in [entry["total"], *entry["lanes"].values()]:
        assert counts["read"] == counts["emitted"] + counts["filtered"] + sum(counts["skipped"].values())
    assert entry["total"]["read"] == len(keys)
    assert entry["total"]["emitted"] == sum(len(sources) for b in batches for sources in b.sources)


def test_odd_modes_become_rgb_as_documented(shard):
    _, keys, bad = shard
    images = _images_by_key(_run(shard)[0], keys)
    grey = images["odd-16-bit-png"].astype(int)
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    assert grey.max() > 128, "16-bit samples are scaled by 1/257, not clipped to black"
    palette = images["odd-palette-alpha-png"]
    width = palette.shape[1]
    assert (palette[:, : width // 3 - 4] == 255).all(), "transparent pixels are composited on white"
    assert not (palette[:, width // 2 :] == 255).all()
    cmyk = images["odd-cmyk-jpeg"].astype(int)
    with Image.open(io.BytesIO(bad["odd-cmyk-jpeg"]["jpg"])) as image:
        assert image.mode == "CMYK"
        reference = np.asarray(image.convert("RGB").resize(cmyk.shape[1::-1], Image.Resampling.BICUBIC), dtype=int)
    assert np.abs(cmyk - reference).mean() < 8, "CMYK is converted to its RGB colours"


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_on_error_raise_fails_naming_the_bad_records_address(shard, runner):
    _, keys, _ = shard
    with _pipeline(shard, runner, on_error="raise").shard(0, 1) as loader, pytest.raises(BadRecordError) as raised:
        for _ in loader:
            pass
    error = raised.value
    assert error.address.shard.endswith("pairs-00000.tar")
    assert EXPECTED[keys[error.address.index]] == error.reason
    assert str(error.address) in str(error) and error.reason in str(error)


# -- decoded after packing (decode_images(defer=True)) ----------------------------------------
# The header is checked before packing: garbage and bombs are skipped as above. A truncated JPEG's
# header parses, so it is packed, and fails when its row is decoded: its document is masked.
MASKED_WHEN_DEFERRED = {"bad-truncated-jpeg": "truncated_image"}


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_deferred_decode_masks_an_image_that_fails_after_packing_and_counts_it(shard, runner):
    _, keys, _ = shard
    batches, stats = _run(shard, runner, defer=True)
    total = stats["datasets"]["pairs"]["total"]
    assert total["skipped"] == {reason: 1 for k, reason in EXPECTED.items() if reason and k not in MASKED_WHEN_DEFERRED}
    assert total["read"] == total["emitted"] + total["filtered"] + sum(total["skipped"].values())
    masked = {}
    for lane in stats["lanes"].values():
        for name, count in lane.items():
            if name.startswith("masked:"):
                masked[name] = masked.get(name, 0) + count
    assert masked == {f"masked:{reason}": 1 for reason in MASKED_WHEN_DEFERRED.values()}
    found = 0
    for batch in batches:
        for row, sources in enumerate(batch.sources):
            for number, address in enumerate(sources):
                if keys[address.index] not in MASKED_WHEN_DEFERRED:
                    continue
                found += 1
                in_document = batch.tokens["document_ids"][row] == number
                assert in_document.sum() > 0, "the masked document keeps its place in the row"
                assert (batch.tokens["labels"][row][in_document] == -100).all(), "and trains nothing"
    assert found == 1
    assert {lane: counts["datasets"] for lane, counts in stats["lanes"].items()} == dataset_counts_in(batches), \
        "the masked document's tokens and image are counted, its learned tokens none"
    images = _images_by_key(batches, keys)
    assert not images["bad-truncated-jpeg"].any(), "its image is zeros"
    eager = _images_by_key(_run(shard, runner)[0], keys)
    assert set(images) - set(MASKED_WHEN_DEFERRED) == set(eager)
    for key, pixels in eager.items():
        assert np.array_equal(images[key], pixels), f"{key}: deferred decode gives other pixels"


@pytest.mark.parametrize("runner", ["inline", "thread"])
def test_a_masked_document_is_named_in_skipped_examples_and_logged_once(shard, runner, caplog):
    """A truncated JPEG found only when its row is decoded: its document was counted per lane as
    `masked:truncated_image`, with no address anywhere and no log line, where every skip names its
    first records in `stats()["skipped_examples"]` and logs the first at WARNING; the user had to
    run again with on_error="raise" to learn which record it was."""
    _, keys, _ = shard
    with caplog.at_level("WARNING", logger="zephon"):
        _, stats = _run(shard, runner, defer=True)
    examples = stats["skipped_examples"]["pairs"]["masked:truncated_image"]
    assert [keys[example["index"]] for example in examples] == list(MASKED_WHEN_DEFERRED)
    assert examples[0]["address"].endswith("pairs-00000.tar#%d" % examples[0]["index"])
    logged = [r.getMessage() for r in caplog.records if "masked:truncated_image" in r.getMessage()]
    assert len(logged) == 1 and "masked a document" in logged[0] and "stats()['lanes']" in logged[0], logged


def test_a_masked_documents_example_and_log_line_say_what_the_decoder_found(shard, caplog):
    """A masked document's example had an empty detail and its log line none, where the same JPEG
    skipped before packing says how it failed: a user saw `masked:truncated_image` at an address
    and had to open the shard or run again with on_error="raise" to learn what was wrong with it."""
    with caplog.at_level("WARNING", logger="zephon"):
        _, stats = _run(shard, defer=True)
    [masked] = stats["skipped_examples"]["pairs"]["masked:truncated_image"]
    [skipped] = _run(shard)[1]["skipped_examples"]["pairs"]["truncated_image"]
    assert masked["address"] == skipped["address"]
    assert masked["detail"] and masked["detail"] == skipped["detail"]
    [logged] = [r.getMessage() for r in caplog.records if "masked:truncated_image" in r.getMessage()]
    assert masked["detail"] in logged


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_deferred_decode_with_on_error_raise_fails_naming_the_record(shard, runner):
    _, keys, _ = shard
    with _pipeline(shard, runner, on_error="raise", defer=True).shard(0, 1) as loader, \
            pytest.raises(BadRecordError) as raised:
        for _ in loader:
            pass
    error = raised.value
    assert EXPECTED[keys[error.address.index]] == error.reason
    assert str(error.address) in str(error)


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_a_program_that_sets_pillows_load_truncated_images_fails_naming_it_instead_of_packing_broken_images(
    shard, runner, defer, monkeypatch
):
    """With the switch on, the truncated photograph was packed with its lower part grey and the
    ledger counted no `truncated_image`."""
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(ConfigurationError, match="LOAD_TRUNCATED_IMAGES"):
        _run(shard, runner, defer=defer)
