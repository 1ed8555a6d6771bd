"""A microbatch of packed rows as Gemma 3's forward arguments, with the attention masks packing needs.

Gemma 3 attends causally, except that the tokens of one image attend to each other both ways
(its processor marks them with `token_type_ids`), and half its layers see only a sliding window.
A packed row must besides keep each document from seeing the ones before it. transformers (5.25)
builds that from `position_ids` restarting per document, but where `token_type_ids` are given
its sliding-window layers look the image blocks up at each token's position in its document
rather than in the row: a document laid out unlike the row's first then attends to its own
later tokens (a tiny model's logits for such a text document moved by 0.2). So the masks are
built here, from the rows' `document_ids`, and handed to the model ready-made.
"""

from __future__ import annotations

from typing import Any

from ._image_tensors import image_tensors

__all__ = ["gemma3_model_inputs"]

GEMMA3_MEAN_STD = (0.5, 0.5, 0.5)
"""Gemma 3's image processor's `image_mean` and `image_std` (SigLIP's)."""


def gemma3_model_inputs(batch: dict, *, image_token_id: int, sliding_window: int,
                        attn_implementation: str = "sdpa") -> dict:
    """The keyword arguments of a `Gemma3ForConditionalGeneration` forward for one microbatch
    (`Batch.to_training()`'s torch tensors, rows packed with `ImageSpec.gemma3()` and
    `PadPlaceholders.gemma3`): `input_ids`, `position_ids` (restarting per document),
    `attention_mask` as the model's two masks ready-made, `{"full_attention": ...,
    "sliding_attention": ...}` (B, 1, L, L), which hold what its processor's `token_type_ids`
    say (the model builds no mask of its own from a ready-made one), and, where the microbatch
    holds images, `pixel_values` (`image_tensors`, normalised as Gemma 3's processor).

    `image_token_id` is the model's `config.image_token_id` (`<image_soft_token>`),
    `sliding_window` its `config.text_config.sliding_window`; `attn_implementation` the model's
    (`config._attn_implementation`): "sdpa" takes boolean masks (True attends), "eager" additive
    ones in the model's float dtype (float32 here; cast them with the model). Padding attends to
    itself alone. Labels are not among them: the rows' are already shifted (vlm/README.md).
    """
    import torch

    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"gemma3_model_inputs: builds masks for the 'sdpa' and 'eager' attention, "
                         f"not {attn_implementation!r}")
    input_ids = batch["input_ids"]
    masks = _document_masks(input_ids, batch["document_ids"], image_token_id, sliding_window)
    if attn_implementation == "eager":
        lowest = torch.finfo(torch.float32).min
        masks = {name: torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, lowest)
                 for name, mask in masks.items()}
    out = {"input_ids": input_ids, "position_ids": batch["position_ids"], "attention_mask": masks}
    if len(batch["image_grid"]):
        out["pixel_values"] = image_tensors(batch["pixel_values"], batch["image_grid"], mean=GEMMA3_MEAN_STD,
                                            std=GEMMA3_MEAN_STD)
    return out


def _document_masks(input_ids, document_ids, image_token_id: int, sliding_window: int) -> dict:
    """(B, 1, L, L) boolean masks: a query attends to a key of its own document at or before it,
    or of the same image (a run of image tokens) anywhere; in sliding layers only to keys less
    than `sliding_window` before it. Padding (document -1) attends to itself."""
    import torch
    import torch.nn.functional as F

    length = input_ids.shape[-1]
    positions = torch.arange(length, device=input_ids.device)
    query, key = positions[:, None], positions[None, :]
    same_document = (document_ids[:, :, None] == document_ids[:, None, :]) & (document_ids[:, :, None] >= 0)
    image = input_ids == image_token_id
    starts = image & ~F.pad(image, (1, 0))[:, :-1]
    image_number = torch.where(image, torch.cumsum(starts.int(), dim=-1), -1)
    same_image = (image_number[:, :, None] == image_number[:, None, :]) & (image_number[:, :, None] >= 0)
    padding_itself = (document_ids < 0)[:, :, None] & (query == key)
    full = same_document & ((key <= query) | same_image)
    sliding = full & (key > query - sliding_window)
    return {"full_attention": (full | padding_itself)[:, None], "sliding_attention": (sliding | padding_itself)[:, None]}
