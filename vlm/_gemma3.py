"""A microbatch of packed rows as Gemma 3's forward arguments, with the attention masks packing
needs (`vlm._gemma_masks`: a picture's tokens attend to each other both ways, in every layer).
"""

from __future__ import annotations

from ._gemma_masks import document_masks
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
    input_ids = batch["input_ids"]
    masks = document_masks(input_ids, batch["document_ids"], vision_token_ids=(image_token_id,),
                           sliding_window=sliding_window, images_in_full_layers=True,
                           attn_implementation=attn_implementation, caller="gemma3_model_inputs")
    out = {"input_ids": input_ids, "position_ids": batch["position_ids"], "attention_mask": masks}
    if len(batch["image_grid"]):
        out["pixel_values"] = image_tensors(batch["pixel_values"], batch["image_grid"], mean=GEMMA3_MEAN_STD,
                                            std=GEMMA3_MEAN_STD)
    return out
