"""A microbatch of packed rows as PaliGemma's forward arguments: its prefix attending both ways.

PaliGemma reads a document as a prefix (its picture, BOS, the task's prompt and a newline) and a
suffix (the answer and EOS): the prefix's tokens attend to each other both ways, the suffix's
causally, and only the suffix is trained. Its processor says which is which by `token_type_ids`
(0 prefix, 1 suffix). Packed with `tokenize(prompt_field=...)` (the prompt ending in its newline)
and `image_position="before_text"`, a row's documents are the processor's ids and its labels
leave the prefix out; the suffix of a document starts at the token after its first learned
position, which is what `paligemma_model_inputs` reads back.

transformers' PaliGemma forward finds packed documents itself where it is given no attention mask:
positions that restart (PaliGemma's count from 1) begin a document, and it lets a prefix attend
both ways within its own document only. So the arguments are the ids, the positions plus one,
the token types and the pictures; no mask is built here.
"""

from __future__ import annotations

from zephon._sequence import IGNORE_INDEX

from ._image_tensors import image_tensors

__all__ = ["PALIGEMMA_MEAN_STD", "paligemma_model_inputs", "prefix_token_types"]

PALIGEMMA_MEAN_STD = (0.5, 0.5, 0.5)
"""PaliGemma's image processor's `image_mean` and `image_std` (SigLIP's)."""


def paligemma_model_inputs(batch: dict) -> dict:
    """The keyword arguments of a `PaliGemmaForConditionalGeneration` forward for one microbatch
    (`Batch.to_training()`'s torch tensors, rows packed with `ImageSpec.paligemma()`,
    `PadPlaceholders.paligemma(tokenizer)` and a prompt): `input_ids`, `position_ids` (restarting
    at 1 for each document, as the model counts), `token_type_ids` (`prefix_token_types`) and,
    where the microbatch holds pictures, `pixel_values` (`image_tensors`, normalised as its
    processor does). No `attention_mask`: the model then tells the packed documents apart by their
    positions. Labels are not among them: the rows' are already shifted (vlm/README.md)."""
    out = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"] + 1,
           "token_type_ids": prefix_token_types(batch["labels"], batch["document_ids"])}
    if len(batch["image_grid"]):
        out["pixel_values"] = image_tensors(batch["pixel_values"], batch["image_grid"], mean=PALIGEMMA_MEAN_STD,
                                            std=PALIGEMMA_MEAN_STD)
    return out


def prefix_token_types(labels, document_ids):
    """(B, L) int64 torch tensor, PaliGemma's `token_type_ids` of packed rows: 1 on a document's
    suffix, the tokens from the one its first learned position predicts on, 0 on the rest (its
    prefix, and padding). A document that learns nothing is all prefix."""
    import torch

    learned = labels != IGNORE_INDEX
    # Position j opens the suffix when j-1 of the same document is learned (it predicts token j);
    # a suffix runs to its document's end, so it is a running count since the document's start.
    after_learned = torch.zeros_like(learned)
    after_learned[:, 1:] = learned[:, :-1] & (document_ids[:, 1:] == document_ids[:, :-1])
    counts = torch.cumsum(after_learned.long(), dim=-1)
    positions = torch.arange(labels.shape[-1], device=labels.device).expand_as(labels)
    starts = torch.ones_like(learned)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_of = torch.cummax(torch.where(starts, positions, 0), dim=-1).values
    before = (counts - after_learned.long()).gather(-1, start_of)
    return ((counts - before) > 0).long()
