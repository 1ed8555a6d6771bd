"""A `PackMultimodal` given to `Pipeline.apply` takes the settings `pack_multimodal` would choose.

The builder took the packer's spec, pixels and grid fields and patch layout from the last decoder
before it; a packer made by hand kept its own defaults, so the two routes packed alike only when
the user repeated the decoder's settings. After a 14 px decoder the hand-made packer cut its
default 16 px patches: a 224 px image became 14x14 patches of 16 px, 196 image tokens for its 256,
unsaid; after `ImageSpec.qwen2_vl()` with `QwenPlaceholders` it was refused with advice to decode
with the spec it decoded with. Both now bind the packer to the decoders (`PackMultimodal.bound_to`),
at the builder and where the loader binds the pipeline: the same recipe digests and batch SHA-256s,
a setting given against the decoder refused, and the builder's recipes fingerprinted as before.
"""

from __future__ import annotations

import pytest

from tests.unit.test_vlm_mixed_media import ROUTES, TOKENIZER, PatchRowsProcessor, mixed_source, refused_when_packed, \
    write_mixed_corpus
from vlm import DecodeImages, ImageSpec, PackMultimodal, PixtralPlaceholders, QwenPlaceholders, VideoSpec
from zephon import Pipeline
from zephon._checkpoint import recipe_digests
from zephon._memory import MemoryBudget, memory_budget

PIXTRAL = PixtralPlaceholders(3, 4, 5)
QWEN = QwenPlaceholders(3, 4, 5)
SPEC_14 = ImageSpec(patch_size=14, min_pixels=224 * 224, max_pixels=224 * 224)
"""Every image on 256 cells of 14 px (16x16 or 8x32 patches): its sides are multiples of 16 px
too, so a packer cutting 16 px patches takes it without a word, as a smaller grid."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_mixed_corpus(tmp_path_factory.mktemp("mixed"))


def _before_the_packer(corpus) -> Pipeline:
    return (Pipeline(mixed_source(corpus)).options(num_lanes=2, runner="inline")
            .tokenize(TOKENIZER, field="txt", bos="<|bos|>", eos="<|eos|>"))


# (decoders, placeholders, settings both routes give the packer)
CASES = {
    "14px-spec": (lambda p: p.decode_images(field="jpg", spec=SPEC_14, datasets="photos"), PIXTRAL, {}),
    "qwen2-vl-spec": (lambda p: p.decode_images(field="jpg", spec=ImageSpec.qwen2_vl(max_pixels=112 * 112),
                                                datasets="photos"), QWEN, {"mrope": True}),
    "deferred": (lambda p: p.decode_images(field="jpg", spec=SPEC_14, datasets="photos", defer=True), PIXTRAL, {}),
    "video-frames": (lambda p: p.decode_video(field="mp4", spec=VideoSpec(num_frames=2, image=SPEC_14),
                                              output_field="frames", datasets="clips"), PIXTRAL, {}),
    "image-processor": (lambda p: p.apply(DecodeImages(field="jpg", processor=PatchRowsProcessor(2),
                                                       grid_field="grids", datasets=("photos",))),
                        QWEN, {"spec": ImageSpec(merge_size=2)}),
}


def _packed(pipeline: Pipeline) -> tuple[dict, list[str], MemoryBudget]:
    """(recipe digests, the batches' SHA-256s over its epochs, memory budget) of `pipeline` ended
    by `.batch(1)`."""
    with pipeline.batch(1).shard(0, 1) as loader:
        return recipe_digests(loader.recipe), [b.digest() for b in loader], memory_budget(loader)


@pytest.mark.parametrize("case", CASES)
def test_a_packer_given_to_apply_packs_and_is_fingerprinted_as_pack_multimodal_s(corpus, case):
    decoders, placeholders, settings = CASES[case]
    before = decoders(_before_the_packer(corpus))
    built = _packed(before.pack_multimodal(1024, placeholders, **settings))
    applied = _packed(before.apply(PackMultimodal(1024, placeholders, **settings)))
    assert len(built[1]) > 1
    assert applied[0] == built[0], "the same recipe digests"
    assert applied[1] == built[1], "the same batch SHA-256s"
    assert applied[2] == built[2], "the same memory budget, from the spec followed"


@pytest.mark.parametrize("route", ROUTES)
def test_a_spec_given_against_the_decoder_is_refused_naming_both(corpus, route):
    """Neither followed nor overridden: the default spec after a 14 px decoder."""
    pipeline = _before_the_packer(corpus).decode_images(field="jpg", spec=SPEC_14, datasets="photos")
    refused_when_packed(pipeline, route, r"decode_images\(datasets=\['photos'\]\), whose images it packs: its spec "
                                         r"cuts 16px patches merged 1x1 where the decoder's cuts 14px patches merged "
                                         r"1x1.*unset \(None\)", spec=ImageSpec())


@pytest.mark.parametrize("settings, why", [
    ({"patch_dim": 768}, r"patch_dim/patch_dtype give 768 uint8 where the decoder's pixels make 588 uint8"),
    ({"grid_field": "image_grid"}, r"grid_field='image_grid' where the decoder writes its grids to 'grids'"),
    ({"patch_dtype": "uint8"}, r"patch_dim/patch_dtype give 768 uint8 where the decoder's image processor makes "
                               r"768 float32"),
], ids=["patch_dim", "grid_field", "patch_dtype"])
def test_a_field_or_patch_layout_given_against_the_decoder_is_refused(corpus, settings, why):
    """Settings `pack_multimodal` does not take, which a packer made by hand may be given."""
    before = _before_the_packer(corpus)
    if "patch_dim" in settings:
        before = before.decode_images(field="jpg", spec=SPEC_14, datasets="photos")
        placeholders = PIXTRAL
    else:
        before = before.apply(DecodeImages(field="jpg", processor=PatchRowsProcessor(2), grid_field="grids",
                                           datasets=("photos",)))
        placeholders, settings = QWEN, {"spec": ImageSpec(merge_size=2), **settings}
    refused_when_packed(before, "apply", why, placeholders, **settings)


def test_pack_multimodal_s_recipes_keep_their_fingerprints(corpus):
    """A checkpoint saved before the packer was bound to its decoders resumes: the packer's
    digests are those `pack_multimodal` gave then (computed before the change), where it takes
    its patch layout and grid field from an image processor and its pixels field from a video."""
    before = _before_the_packer(corpus)
    processed = before.apply(DecodeImages(field="jpg", processor=PatchRowsProcessor(2), grid_field="g",
                                          datasets=("photos",)))
    framed = before.decode_video(field="mp4", spec=VideoSpec(num_frames=2, image=ImageSpec(max_pixels=64 * 64)),
                                 datasets="clips", output_field="frames")
    for pipeline, placeholders, settings, pinned in (
        (processed, QWEN, {"spec": ImageSpec(merge_size=2)},
         {"fields": "7cd4844d5ba3b7cf", "patch_dim": "f7b856c054de7ccc", "patch_dtype": "72581fa9e420010c",
          "placeholders": "95c0885adfc0ab54", "spec": "15cfdb2ead8e3933"}),
        (framed, PIXTRAL, {},
         {"fields": "3837e1e282c1e75c", "patch_dim": "74234e98afe7498f", "patch_dtype": "74234e98afe7498f",
          "placeholders": "610e5179ad5c633d", "spec": "a575fe7bda1a3f97"}),
    ):
        with pipeline.pack_multimodal(160, placeholders, **settings).batch(1).shard(0, 1) as loader:
            digests = recipe_digests(loader.recipe)
        packer = {key.split(".", 2)[2]: value for key, value in digests.items() if ".pack_multimodal." in key}
        assert packer == {**pinned, "max_length": "a512db2741cd2069", "pad_id": "d4735e3a265e16ee",
                          "image_position": "d532cdd378be1086", "max_open_rows": "b17ef6d19c7a5b1e"}

