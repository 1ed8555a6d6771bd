"""The record operators before a multimodal packer, checked and read before any record is read.

`PackMultimodal.bound_to` takes from them the settings the packer was not given
(`followed_settings`: the last decoder's spec, fields and patch layout) and refuses what it could
not pack as meant (`check_operators_before`); the loader calls it as it binds a pipeline (for a
packer given to `Pipeline.apply`, which no builder saw), and `pack_multimodal` calls it as it
builds, so both ways pack alike and fail alike and as early. `deferred_policy` reads from the same
operators whether the packer's rows carry images `decode_images(defer=True)` left encoded, which
the packer's `row_work` then decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from zephon._errors import ConfigurationError
from zephon._record_ops import TokenizeOp

from ._image import DEFAULT_SPEC, ImageSpec
from ._placeholders import video_layout
from ._stages import DecodeImages, DecodeVideo

if TYPE_CHECKING:
    from ._packing import PackMultimodal

__all__ = ["check_operators_before", "deferred_policy", "followed_settings"]

# Operators that write no field but their own `output_field` (a filter writes none): a pipeline of
# only these holds no pixels but a decoder's and no token ids but a tokenize's. A map or a plugin's
# operator may write any field.
_WRITE_ONLY_THEIR_OUTPUT = frozenset({"decode_images", "decode_video", "tokenize", "filter"})


def followed_settings(packer: PackMultimodal, operators: Sequence[object]) -> dict[str, object]:
    """{setting: value} for the settings `packer` left None, from the last decoder among the record
    `operators` (in pipeline order): its spec (a clip's `VideoSpec.image`) and output field, and an
    image processor's grid field and patch layout. Without a decoder: `ImageSpec()`, "pixels",
    "image_grid"; without a processor the patch layout stays None, the spec's uint8 patches. What
    `pack_multimodal` always took, so its recipes keep their fingerprints."""
    decoder = _last_decoder(operators)
    out: dict[str, object] = {}
    if packer.spec is None:
        out["spec"] = DEFAULT_SPEC if decoder is None else _image_spec(_spec_decoder(packer, operators, decoder))
    if packer.pixels_field is None:
        out["pixels_field"] = "pixels" if decoder is None else decoder.output_field
    if packer.grid_field is None:
        out["grid_field"] = decoder.grid_field if isinstance(decoder, DecodeImages) else "image_grid"
    if _processor_of(decoder) is not None and (packer.patch_dim is None or packer.patch_dtype is None):
        dim, dtype = decoder.patch_layout()
        if packer.patch_dim is None:
            out["patch_dim"] = dim
        if packer.patch_dtype is None:
            out["patch_dtype"] = dtype.str
    return out


def check_operators_before(packer: PackMultimodal, operators: Sequence[object]) -> None:
    """Refuse the record `operators` (in pipeline order) that `packer` (bound: its settings given
    or followed) could not pack as meant: a pixels field no decoder writes, decoders writing it
    that share a dataset or cut different patches or whose processor merges unlike the
    placeholders, `after_bos` without a BOS, a tokenize's marker offsets written where the packer
    does not read them, a setting given against the decoder it follows, and deferred decoders
    with different error policies."""
    if packer.image_position == "after_bos":
        _check_bos(operators, packer.field)
    _check_marker_offsets_read(operators, packer)
    _check_pixels_field_written(operators, packer.pixels_field)
    writers = [op for op in operators
               if isinstance(op, (DecodeImages, DecodeVideo)) and op.output_field == packer.pixels_field]
    _check_one_decoder_per_dataset(writers, packer.pixels_field)
    _check_one_patch_layout(writers, packer.pixels_field)
    _check_frames_countable(writers, packer.placeholders)
    decoders = [op for op in operators if isinstance(op, (DecodeImages, DecodeVideo))]
    if decoders:
        _check_processor_merge(decoders[-1], packer.placeholders)
        _check_given_settings(packer, decoders[-1])
    deferred_policy(operators)


def deferred_policy(operators: Sequence[object]) -> tuple[bool, str | None]:
    """(whether `operators` hold `decode_images(defer=True)` stages, their error policy; None:
    the pipeline's own).

    Any such stage, not only the last decoder, gives the packer its row work: a `decode_video`
    after it left its images to be decoded while the loader assembled batches, on its own thread
    and failing fast whatever the policy. The row work has one policy, so stages that set
    different ones are refused rather than one of them silently followed."""
    policies = {op.on_error for op in operators if isinstance(op, DecodeImages) and op.defer}
    if len(policies) > 1:
        raise ConfigurationError(
            "pack_multimodal: the decode_images(defer=True) stages set different on_error policies "
            f"{sorted(policies, key=str)}; their images are decoded after packing under one: give them the same"
        )
    return bool(policies), next(iter(policies), None)


def _check_pixels_field_written(operators: Sequence[object], pixels_field: str) -> None:
    """Refuse a pixels field no decoder writes, in a pipeline of decoders, tokenizers and filters
    only: no record would hold it, so every document would be packed as its text alone, unsaid.
    A map (or a plugin's operator) may write it: only decided without one."""
    written = {op.output_field: op.name for op in operators if isinstance(op, (DecodeImages, DecodeVideo))}
    if not written or pixels_field in written:
        return
    if all(getattr(op, "name", None) in _WRITE_ONLY_THEIR_OUTPUT for op in operators):
        raise ConfigurationError(
            f"pack_multimodal(pixels_field={pixels_field!r}) reads a field no operator writes: "
            + ", ".join(f"{name} writes {field!r}" for field, name in written.items())
        )


def _check_bos(operators: Sequence[object], field: str) -> None:
    """Refuse `image_position="after_bos"` where the `tokenize` that writes `field` adds no BOS.

    The packer puts the images after a document's first token. `tokenize` encodes without the
    tokenizer's own special tokens, so it starts a document with a BOS only when given `bos=`;
    without one the images split every caption after its first word, unsaid. Ids read from the
    data, or a `map` after the tokenize (it may add a BOS), are not decided here: their first
    token is taken as the BOS, whatever it is."""
    for op in reversed(operators):
        if isinstance(op, TokenizeOp) and op.output_field == field:
            if op.bos is None:
                raise ConfigurationError(
                    f"pack_multimodal(image_position='after_bos') puts each document's images after its first "
                    f"token, but the tokenize that writes {field!r} adds no BOS (bos=None): the images would "
                    "split every caption after its first word; give tokenize(bos=...) or another image_position"
                )
            return
        if getattr(op, "name", None) not in _WRITE_ONLY_THEIR_OUTPUT:  # it may write the ids
            return


def _check_marker_offsets_read(operators: Sequence[object], packer: PackMultimodal) -> None:
    """Refuse a `tokenize(marker=...)` of the packer's ids that writes the markers' offsets to
    another field than the packer's `offsets_field`: the packer would place every image by its
    `image_position`, the markers dropped from the text and their places lost, unsaid."""
    for op in operators:
        if isinstance(op, TokenizeOp) and op.marker is not None and op.output_field == packer.field \
                and op.offsets_field != packer.offsets_field:
            raise ConfigurationError(
                f"pack_multimodal reads image offsets from {packer.offsets_field!r}, but tokenize(marker="
                f"{op.marker!r}) writes them to {op.offsets_field!r}: the images would not go where the markers "
                "were; give both the same offsets_field"
            )


def _check_processor_merge(decoder: DecodeImages | DecodeVideo, placeholders) -> None:
    """Refuse placeholders that merge unlike the image processor of `decoder`, the last decoder
    (whose patch layout `pack_multimodal` takes; those writing the pixels field cut alike): the
    grids are the processor's, so each image's token count must follow its merge (Qwen2-VL's 2x2),
    else the model finds 4x the image tokens it expects."""
    processor = _processor_of(decoder)
    if processor is None:
        return
    merge = getattr(processor, "merge_size", None)  # Qwen2-VL's; Pixtral's processor has none
    if isinstance(merge, int) and merge != getattr(placeholders, "merge_size", merge):
        raise ConfigurationError(
            f"pack_multimodal: the image processor merges {merge}x{merge} patches per token but the "
            f"placeholders merge {placeholders.merge_size}x{placeholders.merge_size}"
        )


def _check_one_decoder_per_dataset(decoders: list[DecodeImages | DecodeVideo], pixels_field: str) -> None:
    """Refuse two of `decoders` (those writing `pixels_field`, in pipeline order) that both run on
    some dataset (one of them on every dataset, or both scoped to one): the later finds the
    earlier's arrays where it expects encoded bytes, or no field of its own, and drops every record
    of that dataset as bad media, counted but not what was meant. Scoping each decoder to its own
    datasets is the remedy."""
    for i, earlier in enumerate(decoders):
        for later in decoders[i + 1:]:
            if earlier.datasets is None and later.datasets is None:
                shared = "every dataset's records"
            else:  # None stands for every dataset: the other's scope is what they share
                both = set(earlier.datasets or later.datasets) & set(later.datasets or earlier.datasets)
                if not both:
                    continue
                shared = "the records of " + ", ".join(map(repr, sorted(both)))
            raise ConfigurationError(
                f"pack_multimodal: {_scoped_name(earlier)} and {_scoped_name(later)} both decode {shared} into "
                f"{pixels_field!r}, so the later would drop those records as bad media: give each decoder its "
                "own datasets (datasets=...)"
            )


def _scoped_name(decoder: DecodeImages | DecodeVideo) -> str:
    """A decoder's stage name and the datasets it runs on, as a refusal names it."""
    scope = "every dataset" if decoder.datasets is None else f"datasets={list(decoder.datasets)!r}"
    return f"{decoder.name}({scope})"


def _check_one_patch_layout(decoders: list[DecodeImages | DecodeVideo], pixels_field: str) -> None:
    """Refuse `decoders` (those writing `pixels_field`) in different patch layouts (an image dataset's
    ImageSpec and a video dataset's VideoSpec with different patch sizes or merges, an image
    processor's patch rows beside frames, image processors merging differently or writing their
    grids to different fields): the packer cuts every image of a row with one patch size into one
    `pixel_values` array, reads one grid field and checks the last decoder's merge against the
    placeholders, so the records of one of them would fail as data flows, or be given placeholder
    tokens for another merge than their processor's."""
    if len(decoders) < 2:
        return
    layouts = [(op, _patch_layout(op)) for op in decoders]  # a list: a stage holding a processor may not hash
    if len({layout for _, layout in layouts}) > 1:
        raise ConfigurationError(
            f"pack_multimodal: the decoders writing {pixels_field!r} cut images into different patches, but a row "
            "holds one patch layout: " + "; ".join(
                f"{_scoped_name(op)} gives {layout}" for op, layout in layouts
            ) + ": give the decoders the same patch_size and merge_size (image processors: the same merge_size "
            "and grid_field)" + _without_a_processor(decoders)
        )


def _without_a_processor(decoders) -> str:
    """Advice for an image processor's rows beside a video decoder, which takes no processor: the
    advice above cannot be followed there, while one ImageSpec for both and the rows made on the
    trainer's side (`qwen_pixel_values`) can."""
    processed = any(_processor_of(op) is not None for op in decoders)
    if not processed or not any(isinstance(op, DecodeVideo) for op in decoders):
        return ""
    return (". decode_video takes no image processor: decode the images with the clips' ImageSpec "
            "(ImageSpec.qwen2_vl() or qwen3_vl() for a Qwen model) and turn each batch's patches into the "
            "processor's rows on the trainer's side with vlm.qwen_pixel_values")


def _patch_layout(decoder: DecodeImages | DecodeVideo) -> str:
    """How a decoder's images are cut into patches, in words that compare equal when they agree."""
    processor = _processor_of(decoder)
    if processor is not None:
        dim, dtype = decoder.patch_layout()
        merge = getattr(processor, "merge_size", None)  # Qwen2-VL's; Pixtral's processor has none
        merged = f" merged {merge}x{merge}" if isinstance(merge, int) else ""
        return f"its image processor's patch rows of {dim} {dtype}{merged}, grids in {decoder.grid_field!r}"
    return _cut(_image_spec(decoder))


def _check_frames_countable(writers: Sequence[object], placeholders) -> None:
    """Refuse a `decode_video` before placeholders that count a picture's features from its size
    as shown and cannot count a frame's taken as an image (LLaVA-NeXT's: a frame has no canvas to
    unpad), unless they lay a video out as one block of its own (LLaVA-OneVision's)."""
    if getattr(placeholders, "image_detail", None) not in (None, "tiles") and not video_layout(placeholders) and any(
            isinstance(op, DecodeVideo) for op in writers):
        raise ConfigurationError(f"pack_multimodal: {type(placeholders).__name__} counts a picture's features from "
                                 f"its canvas of tiles, and a decode_video's frames have none; a video is one block "
                                 f"of its own with video_pad (LlavaNextPlaceholders.llava_onevision(tokenizer))")


def _last_decoder(operators: Sequence[object]) -> DecodeImages | DecodeVideo | None:
    """The decoder whose settings the packer follows: the last, as `pack_multimodal` always took."""
    return next((op for op in reversed(operators) if isinstance(op, (DecodeImages, DecodeVideo))), None)


def _spec_decoder(packer: PackMultimodal, operators: Sequence[object],
                  last: DecodeImages | DecodeVideo) -> DecodeImages | DecodeVideo:
    """The decoder whose spec the packer follows: the last, but where the placeholders count a
    picture from its size as shown (Idefics3's, LLaVA-NeXT's) and a `decode_video` comes after the
    pictures' decoder, that decoder, whose spec says how its pictures were cut (a video's frames
    are uncut whatever the spec, and counted by their frames)."""
    if getattr(packer.placeholders, "image_detail", None) is None or not isinstance(last, DecodeVideo):
        return last
    return next((op for op in reversed(operators) if isinstance(op, DecodeImages)), last)


def _image_spec(decoder: DecodeImages | DecodeVideo) -> ImageSpec:
    return decoder.spec if isinstance(decoder, DecodeImages) else decoder.spec.image


def _processor_of(decoder: DecodeImages | DecodeVideo | None):
    return decoder.processor if isinstance(decoder, DecodeImages) else None


def _check_given_settings(packer: PackMultimodal, decoder: DecodeImages | DecodeVideo) -> None:
    """Refuse a spec, grid field or patch layout of `packer` that contradicts `decoder`, the last,
    whose settings it follows where it was given none: one given is not overridden, since the user
    meant it, nor followed, since the batches would be wrong unsaid (a 16 px spec after a 14 px
    decoder read a 224 px image as 14x14 patches of 16 px, 196 image tokens for its 256). Decided
    only where the decoder writes the packer's pixels field (a map may write another, from
    anything); a spec is not compared where an image processor cuts the patches."""
    if decoder.output_field != packer.pixels_field:
        return
    given = (packer.spec.patch_dim if packer.patch_dim is None else packer.patch_dim,
             np.dtype(np.uint8 if packer.patch_dtype is None else packer.patch_dtype))
    wrong = []
    if _processor_of(decoder) is None:
        spec, theirs = packer.spec, _image_spec(decoder)
        layout = theirs.patch_dim, np.dtype(np.uint8)
        if (spec.patch_size, spec.merge_size) != (theirs.patch_size, theirs.merge_size):
            wrong.append(f"its spec cuts {_cut(spec)} where the decoder's cuts {_cut(theirs)}")
        elif given != layout:
            wrong.append(f"its patch_dim/patch_dtype give {given[0]} {given[1]} where the decoder's pixels "
                         f"make {layout[0]} {layout[1]}")
    else:
        layout = decoder.patch_layout()
        if packer.grid_field != decoder.grid_field:
            wrong.append(f"it reads grid_field={packer.grid_field!r} where the decoder writes its grids to "
                         f"{decoder.grid_field!r}")
        if given != layout:
            wrong.append(f"its patch_dim/patch_dtype give {given[0]} {given[1]} where the decoder's image "
                         f"processor makes {layout[0]} {layout[1]}")
    if wrong:
        raise ConfigurationError(
            f"{packer.name} was given settings against {_scoped_name(decoder)}, whose images it packs: "
            f"{'; '.join(wrong)}. It would read those images otherwise than they were cut: as another grid "
            "of patches, with the wrong number of image tokens, unsaid, or failing as the data flows. Leave the "
            "packer's spec, grid_field, patch_dim and patch_dtype unset (None) and it follows the decoder's, as "
            "pack_multimodal does, or give the decoder the same"
        )


def _cut(spec: ImageSpec) -> str:
    return f"{spec.patch_size}px patches merged {spec.merge_size}x{spec.merge_size}"
