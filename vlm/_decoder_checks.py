"""The decoders that write a multimodal packer's pixels field, checked against each other before
any record is read: by `pack_multimodal` as it builds the packer, and by the loader, through
`PackMultimodal.check_record_operators`, for a packer given to `Pipeline.apply` (or a pipeline
built with its operators), which no builder saw.
"""

from __future__ import annotations

from collections.abc import Iterable

from zephon._errors import ConfigurationError

from ._stages import DecodeImages, DecodeVideo

__all__ = ["check_decoders_writing"]


def check_decoders_writing(pixels_field: str, operators: Iterable[object]) -> None:
    """Refuse the decoders among `operators` (in pipeline order) that write `pixels_field` where
    two run on one dataset or they cut images into different patches."""
    writers = [op for op in operators
               if isinstance(op, (DecodeImages, DecodeVideo)) and op.output_field == pixels_field]
    _check_one_decoder_per_dataset(writers, pixels_field)
    _check_one_patch_layout(writers, pixels_field)


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
            "and grid_field)"
        )


def _patch_layout(decoder: DecodeImages | DecodeVideo) -> str:
    """How a decoder's images are cut into patches, in words that compare equal when they agree."""
    if isinstance(decoder, DecodeImages) and decoder.processor is not None:
        dim, dtype = decoder.patch_layout()
        merge = getattr(decoder.processor, "merge_size", None)  # Qwen2-VL's; Pixtral's processor has none
        merged = f" merged {merge}x{merge}" if isinstance(merge, int) else ""
        return f"its image processor's patch rows of {dim} {dtype}{merged}, grids in {decoder.grid_field!r}"
    spec = decoder.spec if isinstance(decoder, DecodeImages) else decoder.spec.image
    return f"{spec.patch_size}px patches merged {spec.merge_size}x{spec.merge_size}"
