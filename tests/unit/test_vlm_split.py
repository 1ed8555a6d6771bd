"""Idefics3's image splitting (Idefics3, SmolVLM, SmolVLM2): `ImageSpec(fit="split")`,
`Idefics3Placeholders` and the tile arrangement that travels beside the pixels.

The oracles are transformers' own: `Idefics3ImageProcessorPil` (and SmolVLM's, the same
arithmetic under another name) for the sizes and the pixels, `Idefics3Processor` for the text, and
a tiny randomly initialised `Idefics3ForConditionalGeneration` for what the rows do in a model.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.conftest import requires_torch
from tests.unit.test_vlm_fixed_size import _png, assert_each_packed_document_is_its_own
from tests.unit.test_vlm_mixed_media import TOKENIZER, _epoch, mixed_source, write_mixed_corpus
from vlm import (DecodeImages, Idefics3Placeholders, ImageSpec, VideoSpec, decode_image, decode_image_with_size,
                 image_grid, image_tensors, patchify)
from vlm._image import probe_image_with_size, split_arrangement
from vlm._packing import MultimodalPacker
from zephon import ConfigurationError, Pipeline
from zephon._records import RecordAddress

SMALL_SPLIT = ImageSpec.idefics3(size=(56, 56), longest_edge=224, draft=False)
"""Idefics3's rule at 56 px tiles, the longer side to 4 of them: 4x4-patch tiles (merge 2, so 4
`<image>` a tile) that the tests resize quickly; `draft=False` resizes from the full decode, as the
processor does."""

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


@pytest.fixture(scope="module")
def idefics3_tokenizer():
    """The shipped tokenizer with Idefics3's image tokens added as special tokens (no Idefics3
    or SmolVLM tokenizer ships offline)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tokenizer.add_tokens(IMAGE_TOKENS, special_tokens=True)
    return tokenizer


def _processor(spec: ImageSpec, smolvlm: bool = False):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    kind = SmolVLMImageProcessorPil if smolvlm else Idefics3ImageProcessorPil
    return kind(size={"longest_edge": spec.longest_edge}, max_image_size={"longest_edge": spec.size[0]})


def _pictures() -> list[bytes]:
    """Wide, tall, tiny, square, thin and a JPEG: every arrangement from 1x4 to 4x4."""
    rng = np.random.default_rng(8)
    jpeg = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (180, 240, 3), dtype=np.uint8)).save(jpeg, "JPEG", quality=90)
    return [_png(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in ((300, 451), (500, 120), (17, 29), (100, 100), (3, 400))] + [jpeg.getvalue()]


def _address(i: int = 0) -> RecordAddress:
    return RecordAddress("photos", "shard-0", i)


def turned_and_upright(orientation: int) -> tuple[bytes, bytes]:
    """A 150x60 gradient as a PNG stored turned, with the EXIF `orientation` (5, 6 or 8) that shows
    it upright, and as a PNG stored upright."""
    from tests.unit.test_vlm_assets import gradient

    upright = Image.fromarray(gradient(150, 60))
    inverse = {5: "TRANSPOSE", 6: "ROTATE_90", 8: "ROTATE_270"}[orientation]
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = io.BytesIO()
    upright.transpose(Image.Transpose[inverse]).save(stored, "PNG", exif=exif.tobytes())
    return stored.getvalue(), _png(np.asarray(upright))


def sized_record(rng: np.random.Generator, spec: ImageSpec, tokens: int, picture: tuple[int, int] | None = None,
                 **fields) -> dict:
    """A record of `tokens` random text ids and, given a (height, width), a random picture of that
    size decoded with `spec`, its size as shown beside it (what `decode_images` writes)."""
    out = {"input_ids": rng.integers(10, 90, tokens).astype(np.int32), **fields}
    if picture is not None:
        image = decode_image_with_size(_png(rng.integers(0, 256, (*picture, 3), dtype=np.uint8)), spec)
        out.update(pixels=image.pixels, pixels_sizes=np.array([image.size]))
    return out


# -- sizing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("longest_edge, tile", [(1456, 364), (2048, 512), (1536, 384), (224, 56), (300, 364)])
def test_the_arrangement_is_idefics3_s_for_every_size(longest_edge, tile):
    """The (rows, columns) of tiles equal those `Idefics3ImageProcessorPil` cuts (its two resizes'
    arithmetic, traced on shape-only arrays) for 400 random sizes up to 8000 px and the edges:
    squares, strips one pixel thick, sizes past 4096 and a longest_edge below one tile, which
    never cuts; the grid stacks that many tiles and, past one, the global image."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import (Idefics3ImageProcessorPil,
                                                                           get_resize_output_image_size)

    class Shapes(Idefics3ImageProcessorPil):
        def resize(self, image, size, resample=None, **kwargs):  # the sizes alone: no pixel is made
            return np.broadcast_to(np.uint8(0), (3, size.height, size.width))

    shapes = Shapes()
    spec = ImageSpec(patch_size=4, fit="split", size=(tile, tile), longest_edge=longest_edge)  # any tile's patches
    rng = np.random.default_rng(9)
    sizes = [tuple(int(n) for n in pair) for pair in rng.integers(1, 8000, (400, 2))] + [
        (1, 1), (1, 8000), (8000, 1), (tile, tile), (tile + 1, tile), (5000, 5000), (4097, 2), (2, 4097), (364, 365)]
    for height, width in sizes:
        first = get_resize_output_image_size(np.broadcast_to(np.uint8(0), (3, height, width)), longest_edge)
        canvas = shapes.resize_for_vision_encoder(np.broadcast_to(np.uint8(0), (3, *first)), tile)
        _, rows, columns = shapes.split_images(canvas, {"longest_edge": tile})
        want = (rows, columns) if rows else (1, 1)
        assert split_arrangement(height, width, spec) == want, (height, width)
        count = want[0] * want[1] + (want != (1, 1))
        assert image_grid(height, width, spec) == (count * tile // 4, tile // 4)
    if longest_edge <= tile:
        assert {split_arrangement(h, w, spec) for h, w in sizes} == {(1, 1)}


@pytest.mark.parametrize("smolvlm", [False, True])
def test_split_pixels_equal_the_processor_s_tile_for_tile(smolvlm):
    """Decoded with `fit="split"` (draft off) and cut apart by `image_tensors(..., tile=4)`, each
    picture's tiles and global image equal `Idefics3ImageProcessorPil`'s (and SmolVLM's)
    `pixel_values` value for value, as many, with its `rows` and `cols`; one that is not cut is
    its global image alone, as there."""
    pictures = _pictures()
    for spec in (SMALL_SPLIT, ImageSpec.idefics3(size=(56, 56), longest_edge=56, draft=False)):
        processor = _processor(spec, smolvlm)
        decoded = [decode_image_with_size(data, spec) for data in pictures]
        grids = np.array([(len(image.pixels) // 14, 4) for image in decoded])
        ours = image_tensors(np.concatenate([patchify(image.pixels, 14) for image in decoded]), grids,
                             mean=(0.5,) * 3, std=(0.5,) * 3, tile=4)
        want = processor(images=[[Image.open(io.BytesIO(data))] for data in pictures], return_row_col_info=True,
                         do_pad=False, return_tensors=None)
        assert [split_arrangement(*image.size, spec) for image in decoded] == [(r, c) if r else (1, 1)
                                                     for r, c in zip(*(sum(want[k], []) for k in ("rows", "cols")))]
        frames = np.concatenate([np.stack(each) for each in want["pixel_values"]])
        np.testing.assert_array_equal(ours, frames)
    assert {split_arrangement(*decode_image_with_size(data, SMALL_SPLIT).size, SMALL_SPLIT) for data in pictures} >= {
        (3, 4), (4, 1), (4, 4), (1, 4)}


@pytest.mark.parametrize("smolvlm", [False, True])
def test_pictures_not_split_equal_the_processor_s(smolvlm):
    """`ImageSpec.idefics3(split=False)` and `ImageSpec.smolvlm(split=False)` (draft off): each
    picture, wide, tall, tiny, thin or a JPEG, equals the processor's `pixel_values` under
    `do_image_splitting=False` value for value (the longer side to `longest_edge`, then the whole
    to one tile, each resize from the one before), one tile and no size beside it."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    preset = ImageSpec.smolvlm if smolvlm else ImageSpec.idefics3
    kind = SmolVLMImageProcessorPil if smolvlm else Idefics3ImageProcessorPil
    pictures = _pictures()
    tile = 64 if smolvlm else 56  # whole cells of 16 px patches merged 4x4, of 14 px merged 2x2
    for spec, longest in ((preset(split=False, draft=False), 2048 if smolvlm else 1456),
                          (preset(split=False, size=(tile, tile), longest_edge=4 * tile, draft=False), 4 * tile)):
        assert (spec.fit, spec.longest_edge) == ("fixed", longest)
        processor = kind(size={"longest_edge": spec.longest_edge}, max_image_size={"longest_edge": spec.size[0]},
                         do_image_splitting=False)
        want = processor(images=[[Image.open(io.BytesIO(data))] for data in pictures], do_pad=False,
                         do_rescale=False, do_normalize=False, return_tensors=None)["pixel_values"]
        for data, (expected,) in zip(pictures, want, strict=True):
            ours = decode_image(data, spec)
            assert ours.shape == (*spec.size, 3)
            np.testing.assert_array_equal(ours, np.rint(np.moveaxis(np.asarray(expected), 0, -1)).astype(np.uint8))
        once = decode_image(pictures[0], ImageSpec(patch_size=spec.patch_size, merge_size=spec.merge_size, fit="fixed",
                                                   size=spec.size, resample="lanczos", draft=False))
        assert not np.array_equal(once, decode_image(pictures[0], spec))  # the first resize is made, not skipped


@pytest.mark.parametrize("orientation", [5, 6, 8])
def test_a_picture_stored_turned_is_cut_as_shown(orientation):
    """A 150x60 picture stored turned, with the EXIF orientation that shows it upright: its tiles
    are those of the upright picture and so is their arrangement (4x2, not 2x4), and its header
    alone gives the same grid and arrangement (deferred decoding). The pixels are within one level
    of the upright picture's: resized as stored and turned after, as every fit does, Pillow's
    horizontal pass runs where the upright picture's vertical one ran, and Lanczos rounds between
    them."""
    spec = ImageSpec.idefics3(size=(56, 56), longest_edge=224, draft=False)
    stored, upright = turned_and_upright(orientation)
    want = decode_image_with_size(upright, spec)
    got = decode_image_with_size(stored, spec)
    assert want.size == got.size == (150, 60) and split_arrangement(*got.size, spec) == (4, 2)
    assert got.pixels.shape == want.pixels.shape
    assert np.abs(got.pixels.astype(int) - want.pixels).max() <= 1
    assert probe_image_with_size(stored, spec) == ((len(want.pixels) // 14, 4), (150, 60))
    whole = ImageSpec.idefics3(split=False, size=(56, 56), longest_edge=224, draft=False)
    not_split = decode_image(stored, whole)
    assert not_split.shape == (56, 56, 3) and np.abs(not_split.astype(int) - decode_image(upright, whole)).max() <= 1


def test_split_specs_are_refused_where_they_cannot_be_cut():
    for kwargs, words in (({"fit": "split", "size": (56, 112)}, "square tiles"),
                          ({"fit": "split", "size": (56, 56), "longest_edge": 5000}, "at most 4096"),
                          ({"fit": "split", "size": (56, 56), "longest_edge": 0}, "longest_edge"),
                          ({"fit": "crop", "size": (56, 56), "longest_edge": 224}, "fit='split''s and fit='fixed''s"),
                          ({"fit": "fixed", "size": (56, 56), "longest_edge": 5000}, "at most 4096")):
        with pytest.raises(ConfigurationError, match=words):
            ImageSpec(**{"patch_size": 14, "merge_size": 2, **kwargs})
    assert ImageSpec(patch_size=14, merge_size=2, fit="split", size=(56, 56)).longest_edge == 224  # 4 tiles
    for tiled in (ImageSpec.smolvlm(), ImageSpec.llava_next()):
        with pytest.raises(ConfigurationError, match="resized whole, not cut"):
            VideoSpec(image=tiled)
    with pytest.raises(ConfigurationError, match="resized once, straight to its size; longest_edge=2048"):
        VideoSpec(image=ImageSpec.smolvlm(split=False))
    assert VideoSpec(image=ImageSpec.smolvlm(split=False, longest_edge=None)).image.size == (512, 512)
    assert ImageSpec(patch_size=14, fit="fixed", size=(56, 56)).longest_edge is None  # one resize, as before
    assert ImageSpec.smolvlm().max_decoded_pixels == 512 * 512 * 17  # 4x4 tiles and the global image


def test_the_spec_s_fingerprint_holds_longest_edge_and_the_others_keep_theirs():
    from vlm._stages import _describe

    assert _describe(ImageSpec.smolvlm())["longest_edge"] == 2048
    assert _describe(ImageSpec.smolvlm(longest_edge=1024)) != _describe(ImageSpec.smolvlm())
    assert "longest_edge" not in _describe(ImageSpec.internvl())


# -- tokens --------------------------------------------------------------------------------------

def test_rows_are_idefics3_processor_s_input_ids_token_for_token(idefics3_tokenizer):
    """Two records, a picture before its caption and a caption with two pictures inside it
    (`image_offsets`), packed into one row: each document is `Idefics3Processor`'s `input_ids`
    for the same text with `<image>` where its pictures go (tiles named by row and column, `\\n`
    after each row, `\\n\\n` before the global image; a picture not cut as its global image
    alone), and the row's pixels its `pixel_values` in order."""
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tokenizer = idefics3_tokenizer
    placeholders = Idefics3Placeholders.from_tokenizer(tokenizer, merge_size=2)
    processor = Idefics3Processor(_processor(SMALL_SPLIT), tokenizer, image_seq_len=4)
    pictures = _pictures()
    tiny = _png(np.random.default_rng(3).integers(0, 256, (20, 20, 3), dtype=np.uint8))
    unsplit = ImageSpec.idefics3(size=(56, 56), longest_edge=56, draft=False)

    def ids(text: str) -> np.ndarray:
        return np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)

    def record(pieces: list[str], images: list[bytes], spec: ImageSpec) -> dict:
        """Text pieces with a picture before each but the first, as the processor reads
        `piece<image>piece<image>piece` (its special tokens split the text where ours are placed)."""
        decoded = [decode_image_with_size(data, spec) for data in images]
        encoded = [ids(piece) for piece in pieces]
        return {"input_ids": np.concatenate(encoded), "pixels": [image.pixels for image in decoded],
                "pixels_sizes": np.array([image.size for image in decoded], np.int32),
                "image_offsets": np.cumsum([len(each) for each in encoded[:-1]]).tolist()}

    not_split = ImageSpec.idefics3(split=False, size=(56, 56), longest_edge=224, draft=False)
    for spec, first in ((SMALL_SPLIT, pictures[0]), (unsplit, tiny), (not_split, pictures[0])):
        pieces = [["", "a photo of a cat"], ["left then", " right,", " below"]]
        records = [record(pieces[0], [first], spec), record(pieces[1], pictures[1:3], spec)]
        packer = MultimodalPacker(None, max_length=400, placeholders=placeholders, spec=spec, pad_id=0)
        assert [row for i, each in enumerate(records) for row in packer.push((_address(i), each))] == []
        [row] = packer.flush()
        texts = ["<image>".join(each) for each in pieces]
        images = [[Image.open(io.BytesIO(first))], [Image.open(io.BytesIO(data)) for data in pictures[1:3]]]
        want = processor(text=texts, images=images, add_special_tokens=False, return_tensors=None,
                         images_kwargs={"size": {"longest_edge": spec.longest_edge}, "do_pad": False,
                                        "do_image_splitting": spec.fit == "split"})
        documents = row.tokens["document_ids"]
        for number, expected in enumerate(want["input_ids"]):
            assert row.tokens["input_ids"][documents == number].tolist() == expected, number
        pixels = image_tensors(row.ragged["pixel_values"], row.ragged["image_grid"], mean=(0.5,) * 3, std=(0.5,) * 3,
                               tile=4)
        np.testing.assert_array_equal(pixels, np.concatenate([np.stack(each) for each in want["pixel_values"]]))


def test_idefics3_placeholders_refuse_what_would_confuse_the_model():
    names = ((10, 11), (12, 13))
    Idefics3Placeholders(3, 4, 5, names, merge_size=2, row_end=(7,), last_row_end=(7, 7))
    for kwargs, words in (({"tile_names": ((10, 11), (12,))}, "rows of <row_r_col_c> ids"),
                          ({"tile_names": ()}, "rows of <row_r_col_c> ids"),
                          ({"tile_names": ((10, 3), (12, 13))}, "distinct"),
                          ({"row_end": (4,)}, "holds a placeholder id"),
                          ({"last_row_end": "\n\n"}, "sequence of token ids")):
        with pytest.raises(ConfigurationError, match=words):
            Idefics3Placeholders(**{"image": 3, "fake_around": 4, "global_image": 5, "tile_names": names,
                                    "merge_size": 2, **kwargs})
    placeholders = Idefics3Placeholders(3, 4, 5, names, merge_size=2)
    with pytest.raises(ValueError, match="not 2x2 square tiles"):
        placeholders.tokens_for(16, 4, (2, 2))
    with pytest.raises(ValueError, match="names at most 2x2"):
        placeholders.tokens_for(4 * 10, 4, (3, 3))
    assert placeholders.num_tokens(20, 4, (2, 2)) == len(placeholders.tokens_for(20, 4, (2, 2))) == 4 * 6 + 7


def test_the_packer_refuses_a_split_image_without_its_size_or_the_wrong_spec():
    placeholders = Idefics3Placeholders(3, 4, 5, ((10, 11), (12, 13)), merge_size=2)
    spec = ImageSpec.idefics3(size=(56, 56), longest_edge=112)
    image = decode_image_with_size(_pictures()[0], spec)
    packer = MultimodalPacker(None, max_length=200, placeholders=placeholders, spec=spec, pad_id=0)
    text = np.array([20, 21], np.int32)
    for sizes, words in ((None, "need theirs in 'pixels_sizes'"), ([[1000, 10]], "is not 2x1 square tiles"),
                         ([[300, 451], [10, 10]], "need theirs"), ([[0, 451]], "need theirs")):
        record = {"input_ids": text, "pixels": image.pixels}
        if sizes is not None:
            record["pixels_sizes"] = np.array(sizes, np.int32)
        with pytest.raises(ConfigurationError, match=words):
            packer.push((_address(), record))
    assert image.size == (300, 451) and split_arrangement(*image.size, spec) == (2, 2)
    assert packer.push((_address(), {"input_ids": text, "pixels": image.pixels, "pixels_sizes": [[300, 451]]})) == []
    with pytest.raises(ConfigurationError, match="counts the tokens of fit='split' or 'fixed' images"):
        MultimodalPacker(None, max_length=200, placeholders=placeholders, spec=ImageSpec.internvl(size=(56, 56)),
                         pad_id=0)
    with pytest.raises(ConfigurationError, match=r"one square tile, got an ImageSpec of fit='fixed' and size=\(56, 112\)"):
        MultimodalPacker(None, max_length=200, placeholders=placeholders, pad_id=0,
                         spec=ImageSpec(patch_size=14, merge_size=2, fit="fixed", size=(56, 112)))
    whole = MultimodalPacker(None, max_length=200, placeholders=placeholders, pad_id=0,
                             spec=ImageSpec.idefics3(split=False, size=(56, 56), longest_edge=112))
    [row] = whole.push((_address(), {"input_ids": text, "pixels": decode_image(_pictures()[0], whole.spec)})) + \
        whole.flush()  # no size needed: a picture not split is one tile
    assert row.tokens["input_ids"][:7].tolist() == [4, 5, 3, 3, 3, 3, 4]
    with pytest.raises(ConfigurationError, match="cuts up to 4x4 tiles of 56 px, and Idefics3Placeholders names at "
                                                 "most 2x2"):
        MultimodalPacker(None, max_length=200, placeholders=placeholders, spec=SMALL_SPLIT, pad_id=0)


# -- through the pipeline ------------------------------------------------------------------------

TILE_NAMES = tuple(tuple(8176 + 4 * r + c for c in range(4)) for r in range(4))
"""Ids for <row_r_col_c> in the shipped tokenizer: its last merges, which no caption holds."""


def _split_pipeline(root, runner: str, *, defer: bool = False) -> Pipeline:
    names = TILE_NAMES
    return (
        Pipeline(mixed_source(root)).options(num_lanes=4, runner=runner, flush_every_chunks=2)
        .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>", parallelism=2)
        .decode_images(field="jpg", spec=ImageSpec.idefics3(size=(56, 56), longest_edge=224), datasets="photos",
                       parallelism=2, defer=defer)
        .pack_multimodal(400, Idefics3Placeholders(3, 4, 5, names, merge_size=2, row_end=(7,), last_row_end=(8,)))
        .shuffle(buffer_size=3, seed=2)
        .batch(2)
    )


def test_split_photos_are_the_same_bytes_on_every_runner_and_deferred(tmp_path):
    """Photos split as Idefics3 splits them (56 px tiles, the longer side to 4): each image's
    text names as many tiles as its stack holds, and the batches' SHA-256s are the same from
    separately built pipelines on the inline, thread and process runners, and deferred (the
    arrangement read from the headers) on the thread and process runners."""
    root = write_mixed_corpus(tmp_path)
    runs = {runner: _epoch(_split_pipeline(root, runner)) for runner in ("inline", "thread", "process")}
    for runner in ("thread", "process"):
        runs[f"{runner}, deferred"] = _epoch(_split_pipeline(root, runner, defer=True))
    batches, stats = runs["inline"]
    arrangements = set()
    for batch in batches:
        grids = batch.ragged["image_grid"]
        ids = batch.tokens["input_ids"]
        named = int(np.isin(ids, TILE_NAMES).sum())  # one <row_r_col_c> per tile
        assert (grids[:, 1] == 4).all()
        assert int((ids == 5).sum()) == len(grids)  # one global image each
        assert int((ids == 3).sum()) == 4 * int(grids[:, 0].sum() // 4)  # 4 <image> a tile and global image
        assert named == int(grids[:, 0].sum() // 4) - len(grids)  # every tile but the global images
        arrangements |= set((grids[:, 0] // 4).tolist())
    assert len(arrangements) > 1 and stats["mixture"]["photos"]["images"] > 0, arrangements
    digests = [batch.digest() for batch in batches]
    for runner, (other, _) in runs.items():
        assert [batch.digest() for batch in other] == digests, runner


def test_decode_images_writes_each_split_picture_s_size_beside_it():
    stage = DecodeImages(field="jpg", spec=SMALL_SPLIT)
    pictures = _pictures()
    record = stage._decode_record({"jpg": pictures[:2]}, _address())
    assert record["pixels_sizes"].tolist() == [[300, 451], [500, 120]] and record["pixels_sizes"].dtype == np.int32
    np.testing.assert_array_equal(record["pixels"][1], decode_image(pictures[1], SMALL_SPLIT))
    alone = stage._decode_record({"jpg": pictures[1]}, _address())
    assert alone["pixels_sizes"].tolist() == [[500, 120]]
    assert "pixels_sizes" not in DecodeImages(field="jpg", spec=ImageSpec.internvl(size=(56, 56)))._decode_record(
        {"jpg": pictures[1]}, _address())
    deferred = DecodeImages(field="jpg", spec=SMALL_SPLIT, defer=True)._decode_record({"jpg": pictures[1]}, _address())
    assert deferred["pixels"].size == (500, 120) and "pixels_sizes" not in deferred
    np.testing.assert_array_equal(deferred["pixels"].decode(), alone["pixels"])


# -- into the model ------------------------------------------------------------------------------

def tiny_idefics3(family: str, *, image_size: int, patch_size: int, vocab_size: int, image_token_id: int,
                  scale_factor: int):
    """A tiny randomly initialised `{family}ForConditionalGeneration` (Idefics3 or SmolVLM, whose
    configs take the same settings), seeded, in eval mode."""
    import torch
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=image_size, patch_size=patch_size),
        text_config=dict(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
        image_token_id=image_token_id, scale_factor=scale_factor)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()


@requires_torch
def test_a_tiny_idefics3_gives_each_packed_document_what_it_gives_the_document_alone():
    """Rows of a picture cut 2x2 then its caption, text alone, and text around a picture cut 2x1,
    given to a tiny randomly initialised `Idefics3ForConditionalGeneration` as vlm/README.md shows
    (`input_ids`, the rows' `position_ids`, the tiles by `image_tensors(..., tile=)` as one batch
    of images): every document's logits are the document's alone. Its text model masks each
    document from the one before it where the positions restart."""
    model = tiny_idefics3("Idefics3", image_size=56, patch_size=14, vocab_size=128, image_token_id=102, scale_factor=2)
    spec = ImageSpec.idefics3(size=(56, 56), longest_edge=112)
    placeholders = Idefics3Placeholders(102, 100, 101, ((110, 111), (112, 113)), merge_size=2, row_end=(7,),
                                        last_row_end=(7, 7))
    rng = np.random.default_rng(2)
    records = [sized_record(rng, spec, 5, (60, 100)), sized_record(rng, spec, 9),
               sized_record(rng, spec, 6, (100, 30), image_offsets=[2])]
    assert [split_arrangement(*r["pixels_sizes"][0], spec) if "pixels" in r else None for r in records] == [
        (2, 2), None, (2, 1)]

    assert_each_packed_document_is_its_own(  # the model takes (batch, images, 3, H, W)
        model, placeholders, spec, records, 120,
        lambda batch: {"pixel_values": image_tensors(batch["pixel_values"], batch["image_grid"], mean=(0.5,) * 3,
                                                     std=(0.5,) * 3, tile=4)[None]})
