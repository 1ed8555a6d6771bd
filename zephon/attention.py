"""Attention that keeps each document of a packed row to itself, for a model of your own.

A row holds several documents; attention over the whole row lets each attend to the ones packed
before it, which trains on text it was never given and, since the next row packs otherwise, makes
a document's loss depend on its neighbours. transformers' flash-attention path, and TorchTitan's
`flex` and `varlen` backends, find the documents themselves where `position_ids` restart; a model
calling torch's attention directly needs one of these, made from the batch's `document_ids`
((B, L) torch integers, `-1` on padding, as `Batch.to_training()` gives them):

- `document_causal_mask`: a boolean (B, 1, L, L) mask for `scaled_dot_product_attention`
  (True: may attend), B·L² bytes (32 MiB for 8 rows of 2,048);
- `varlen_sequences`: `cu_seqlens` and `max_seqlen` for flash-attn's `flash_attn_varlen_func`
  over the rows flattened to (B·L, heads, dim);
- `document_block_mask`: a FlexAttention `BlockMask` for `flex_attention`, the same mask in blocks.

All three say the same: a token attends to itself and the tokens before it in its row that have
its document id. A row's padding (a run at its end) is one more sequence of that kind, so no row
of the softmax is empty; its labels are IGNORE_INDEX, so what it computes trains nothing. torch is
imported by the functions, never by importing this module.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["VarlenSequences", "document_block_mask", "document_causal_mask", "varlen_sequences"]


class VarlenSequences(NamedTuple):
    """flash-attn's varlen arguments for rows flattened to (B·L, ...): `cu_seqlens` (sequences + 1,)
    int32, where each sequence starts and the last ends, and `max_seqlen`, the longest's length."""

    cu_seqlens: Any
    max_seqlen: int


def document_causal_mask(document_ids: Any) -> Any:
    """(B, 1, L, L) bool on `document_ids`' device: [b, 0, q, k] is True where token k is at or
    before token q in row b and both have one document id."""
    import torch

    _, length = _checked(document_ids)
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None]


def varlen_sequences(document_ids: Any) -> VarlenSequences:
    """Where each document (and each row's padding) begins in the rows flattened in order; a new
    row begins a new sequence even where its first document id repeats the last row's."""
    import torch

    rows, length = _checked(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    begin = torch.nonzero(starts.reshape(-1)).reshape(-1)
    end = torch.tensor([rows * length], dtype=begin.dtype, device=begin.device)
    cu_seqlens = torch.cat([begin, end]).to(torch.int32)
    return VarlenSequences(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if rows else 0)


def document_block_mask(document_ids: Any, block_size: int = 128) -> Any:
    """A FlexAttention `BlockMask` of `document_causal_mask`'s rule, for every head, on
    `document_ids`' device (`torch.nn.attention.flex_attention.create_block_mask`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, length = _checked(document_ids)

    def same_document_at_or_before(b, h, q, k):
        return (document_ids[b, q] == document_ids[b, k]) & (q >= k)

    return create_block_mask(same_document_at_or_before, rows, None, length, length, device=document_ids.device,
                             BLOCK_SIZE=block_size)


def _checked(document_ids: Any) -> tuple[int, int]:
    """(rows, length) of a (B, L) integer torch tensor; anything else is refused by name."""
    import torch

    if not isinstance(document_ids, torch.Tensor) or document_ids.ndim != 2 or document_ids.is_floating_point() \
            or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be a (rows, length) torch tensor of integers (Batch.to_training()'s "
                        f"'document_ids'), got {type(document_ids).__name__} "
                        f"{getattr(document_ids, 'shape', '')} {getattr(document_ids, 'dtype', '')}".rstrip())
    rows, length = document_ids.shape
    return int(rows), int(length)
