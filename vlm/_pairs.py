"""Preference pairs with pictures (multimodal DPO): each record's chosen and rejected answers to a
prompt that shows images, packed side by side in one row.

A vision-language preference record (RLAIF-V's, VLFeedback's, TRL's vision DPO datasets) is a
prompt with its images and two answers. Each answer makes a document of its own, the images and
the prompt before it as the model is given them, and both go into one row as documents 2k and
2k+1, never split, as `pack_pairs` packs text pairs: `zephon.preference.pair_log_probs` reads them
back alike. The images are the record's, in each document, so the row's `pixel_values` hold them
twice, as a trainer that concatenates the chosen and the rejected sequence hands its vision tower
each (TRL's DPO does); decoded after packing (`decode_images(defer=True)`), each is decoded once
for both (`vlm._deferred`).

Each side's ids, loss mask and image offsets come from fields of its own: two `tokenize` stages
with their `output_field`, `loss_mask_field` and, with `marker=`, `offsets_field`. A pair whose
two documents together take more than a row is skipped (`pair_too_long`) by default; with
`overlong="truncate"` its images are kept and the row's room beside them is shared between the two
texts as `pack_pairs` shares a row (`row_shares`: the shorter whole where it takes at most half),
each keeping its first tokens, counted once as `truncated`, unless either then learns nothing.
Keeping the last tokens ("keep_end") is not offered: the pictures stand in the prompt, whose start
it would drop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zephon._accumulator import SegmentContext
from zephon._errors import ConfigurationError, check_field_name
from zephon._preference import PairFields, check_pair_tokenizers, row_shares
from zephon._records import RecordAddress

from ._packing import DocumentFields, MultimodalPacker, PackMultimodal, PlacedDocument

__all__ = ["MULTIMODAL_PAIR_OVERLONG", "MultimodalPairPacker", "PackMultimodalPairs"]

MULTIMODAL_PAIR_OVERLONG = ("skip", "truncate")


class MultimodalPairPacker(MultimodalPacker):
    """First-fit packer of a record's two documents as one item, the chosen (read from the
    packer's own fields) then the rejected (`rejected`'s). Thread-unsafe; one per lane segment."""

    def __init__(self, ctx: SegmentContext | None, *, rejected: DocumentFields, overlong: str = "skip",
                 **settings) -> None:
        super().__init__(ctx, **settings)
        self.rejected = rejected
        self.overlong = overlong

    def push(self, item: tuple[RecordAddress, dict]) -> list:
        pair = self.placed(*item)
        if pair is None:
            return []
        chosen, rejected = pair
        return [self._emit_rows(_documents(row)) for row in self._open.place(pair, chosen.length + rejected.length)]

    def flush(self) -> list:
        return [self._emit_rows(_documents(row)) for row in self._open.drain()]

    def placed(self, address: RecordAddress, record: dict) -> tuple[PlacedDocument, PlacedDocument] | None:
        """The record's (chosen, rejected) documents, or None where either is refused (its one skip
        reported, the first refused of the two) or the two take more than a row (`pair_too_long`)
        and `overlong` does not cut them to share it (module docstring)."""
        read = self._whole_pair(address, record)
        if read is None:
            return None
        pair, texts = read
        images = [doc.length - len(doc.text) for doc in pair]
        lengths = [image + text for image, text in zip(images, texts)]
        if sum(lengths) <= self.max_length:
            return pair
        detail = (f"{lengths[0]} + {lengths[1]} tokens (text and image placeholders), more than a row's "
                  f"max_length={self.max_length}")
        room = self.max_length - sum(images)
        if self.overlong == "skip" or room < 2:
            self._skips.append((address, "pair_too_long", detail))
            return None
        shares = row_shares(texts[0], texts[1], room)
        before = len(self._truncations)
        cut = (self._document(address, record, text_room=shares[0]),
               self._document(address, record, self.rejected, text_room=shares[1]))
        del self._truncations[before:]  # one for the pair, below
        if not all(doc.learned for doc in cut):
            self._skips.append((address, "pair_too_long", f"{detail}; cut to fit, one of the two would learn nothing"))
            return None
        self._truncations.append((address, sum(texts) - sum(len(doc.text) for doc in cut)))
        return cut

    def _whole_pair(self, address: RecordAddress,
                    record: dict) -> tuple[tuple[PlacedDocument, PlacedDocument], list[int]] | None:
        """The record's two documents and their texts' whole lengths, or None where either is
        refused; a document `_document` cut to fit a row alone is no truncation here."""
        before = len(self._truncations)
        chosen = self._document(address, record)
        between = len(self._truncations)
        rejected = None if chosen is None else self._document(address, record, self.rejected)
        dropped = [sum(n for _, n in self._truncations[start:stop])
                   for start, stop in ((before, between), (between, len(self._truncations)))]
        del self._truncations[before:]
        if rejected is None:
            return None
        return (chosen, rejected), [len(doc.text) + cut for doc, cut in zip((chosen, rejected), dropped)]


def _documents(pairs: list[tuple[PlacedDocument, PlacedDocument]]) -> list[PlacedDocument]:
    """A row's documents from its pairs, in order: each pair's chosen, then its rejected."""
    return [doc for pair in pairs for doc in pair]


@dataclass(frozen=True)
class PackMultimodalPairs(PackMultimodal):
    """Configuration of `pack_multimodal_pairs`: a `PackMultimodal` whose `field`,
    `loss_mask_field` and `offsets_field` are the chosen document's, with the rejected one's
    beside them; builds one `MultimodalPairPacker` per lane segment."""

    field: str = "chosen_ids"
    offsets_field: str = "chosen_image_offsets"
    loss_mask_field: str = "chosen_loss_mask"
    rejected_field: str = "rejected_ids"
    rejected_loss_mask_field: str = "rejected_loss_mask"
    rejected_offsets_field: str = "rejected_image_offsets"
    overlong: str = "skip"
    name: str = "pack_multimodal_pairs"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.overlong not in MULTIMODAL_PAIR_OVERLONG:
            raise ConfigurationError(
                f"{self.name}: overlong must be one of {MULTIMODAL_PAIR_OVERLONG}, got {self.overlong!r} (keeping a "
                "pair's last tokens would drop the start of its prompt, where its pictures stand)")
        names = ("field", "rejected_field", "loss_mask_field", "rejected_loss_mask_field", "offsets_field",
                 "rejected_offsets_field", "pixels_field")
        for name in names[1:6:2]:
            check_field_name(getattr(self, name), f"{self.name}: {name}")
        given = [getattr(self, name) for name in names if getattr(self, name) is not None]
        if len(set(given)) < len(given):
            raise ConfigurationError(
                f"{self.name}: {', '.join(f'{n}={getattr(self, n)!r}' for n in names)} must be fields of their own: "
                "a pair's two documents read from one field would be one document twice")

    @property
    def document_fields(self) -> tuple[str | None, ...]:
        """`PackMultimodal.document_fields` and the rejected document's."""
        return (*super().document_fields, *self.rejected_side)

    @property
    def rejected_side(self) -> DocumentFields:
        return DocumentFields(self.rejected_field, self.rejected_loss_mask_field, self.rejected_offsets_field)

    def bound_to(self, record_operators) -> PackMultimodalPairs:
        """`PackMultimodal.bound_to` for each side (the rejected one's ids, loss mask and offsets
        checked as the chosen one's are), and the tokenizers' loss masks as `pack_pairs` checks them."""
        bound = super().bound_to(record_operators)
        bound._as_one_document(bound.rejected_side).bound_to(record_operators)
        check_pair_tokenizers(PairFields(bound.field, bound.rejected_field, bound.loss_mask_field,
                                         bound.rejected_loss_mask_field), record_operators, self.name)
        return bound

    def _as_one_document(self, side: DocumentFields) -> PackMultimodal:
        """The `pack_multimodal` that packs one side's documents as this packs the pair's."""
        settings = {field.name: getattr(self, field.name) for field in dataclasses.fields(PackMultimodal)}
        return PackMultimodal(**{**settings, "field": side.text, "loss_mask_field": side.loss_mask,
                                 "offsets_field": side.offsets})

    def _packer(self, ctx: SegmentContext, pad: int) -> MultimodalPairPacker:
        return MultimodalPairPacker(ctx, rejected=self.rejected_side, overlong=self.overlong,
                                    **self._packer_settings(pad))

    def fingerprint(self, default_pad_id: int) -> dict:
        """`PackMultimodal`'s, named `pack_multimodal_pairs`, with the rejected document's fields, and
        `overlong` where it cuts."""
        out = super().fingerprint(default_pad_id)
        out["rejected_fields"] = list(self._settled().rejected_side)
        if self.overlong != "skip":
            out["overlong"] = self.overlong
        return out
