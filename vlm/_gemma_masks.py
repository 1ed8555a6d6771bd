"""The attention masks of packed rows for the Gemma models whose picture tokens attend both ways.

Gemma 3, and Gemma 4's checkpoints that set `use_bidirectional_attention="vision"`, attend
causally except that the tokens of one picture attend to each other both ways (their processors
mark them with `token_type_ids` / `mm_token_type_ids`); Gemma 3 does so in every layer, Gemma 4 in
its sliding-window layers alone. A packed row must besides keep each document from seeing the
ones before it. transformers (5.25) builds the first from the type ids at each token's position
in its document rather than in the row (a document laid out unlike the row's first then attends
to its own later tokens: a tiny Gemma 3's logits for such a text document moved by 0.2), so the
masks are built here from the rows' `document_ids` and handed to the model ready-made.
"""

from __future__ import annotations

__all__ = ["document_masks"]

ATTENTIONS = ("sdpa", "eager")
"""The attention implementations the masks are built for."""


def document_masks(input_ids, document_ids, *, vision_token_ids: tuple[int, ...], sliding_window: int,
                   images_in_full_layers: bool, attn_implementation: str, caller: str) -> dict:
    """{"full_attention": ..., "sliding_attention": ...}, (B, 1, L, L) masks: a query attends to a
    key of its own document at or before it, or of the same picture (a run of `vision_token_ids`:
    a picture's pads, or a video frame's) anywhere, in the full layers only where
    `images_in_full_layers`; in sliding layers only to keys less than `sliding_window` before it.
    Padding (document -1) attends to itself. "sdpa" takes them boolean (True attends), "eager"
    additive in float32 (cast them with the model)."""
    import torch
    import torch.nn.functional as F

    if attn_implementation not in ATTENTIONS:
        raise ValueError(f"{caller}: builds masks for the 'sdpa' and 'eager' attention, not {attn_implementation!r}")
    length = input_ids.shape[-1]
    positions = torch.arange(length, device=input_ids.device)
    query, key = positions[:, None], positions[None, :]
    same_document = (document_ids[:, :, None] == document_ids[:, None, :]) & (document_ids[:, :, None] >= 0)
    image = torch.isin(input_ids, torch.tensor(vision_token_ids, device=input_ids.device))
    starts = image & ~F.pad(image, (1, 0))[:, :-1]
    image_number = torch.where(image, torch.cumsum(starts.int(), dim=-1), -1)
    same_image = (image_number[:, :, None] == image_number[:, None, :]) & (image_number[:, :, None] >= 0)
    padding_itself = (document_ids < 0)[:, :, None] & (query == key)
    both_ways = same_document & ((key <= query) | same_image)
    full = both_ways if images_in_full_layers else same_document & (key <= query)
    sliding = both_ways & (key > query - sliding_window)
    masks = {"full_attention": (full | padding_itself)[:, None], "sliding_attention": (sliding | padding_itself)[:, None]}
    if attn_implementation == "eager":
        lowest = torch.finfo(torch.float32).min
        masks = {name: torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, lowest)
                 for name, mask in masks.items()}
    return masks
