"""`zephon.attention`: each document of a packed row attends to itself alone, causally.

The oracle is each document given to torch's causal attention on its own. Real rows come from the
shipped corpus through `pack_flat(algorithm="first_fit")` (documents of many lengths, rows ending
in padding), and attention through the dense mask, through flash-attn's varlen layout (each
sequence of `cu_seqlens` attended alone) and through FlexAttention's block mask must give every
document's tokens what the document alone gives them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tests.conftest import requires_torch
from zephon import PADDING_DOCUMENT, Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

pytestmark = requires_torch


@pytest.fixture(scope="module")
def document_ids(demo_data_dir, demo_tokenizer_path):
    """A microbatch's `document_ids` from `to_training()`: 4 rows of 256 holding several documents
    each, some rows ending in padding (first-fit leaves a row's tail empty when no document fits)."""
    source = StaticMixtureWorkSource([Dataset.from_path("jargon", str(demo_data_dir / "jargon"))], seed=1,
                                     records_per_chunk=16)
    pipeline = (Pipeline(source).options(num_lanes=1, runner="inline")
                .tokenize(tokenizer_id=str(demo_tokenizer_path), eos="<|eos|>")
                .pack_flat(max_length=256, algorithm="first_fit").batch(microbatch_size=4))
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        for batch in loader:
            ids = batch.to_training()["document_ids"]
            counts = [len(set(row.tolist()) - {PADDING_DOCUMENT}) for row in ids]
            if (ids == PADDING_DOCUMENT).any() and min(counts) > 1:
                return ids
    raise AssertionError("no microbatch of several documents a row with padding")


def _spans(document_ids) -> list[tuple[int, int, int]]:
    """(row, start, end) of every run of one document id, padding runs included."""
    out = []
    for row, ids in enumerate(document_ids.tolist()):
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[start]:
                out.append((row, start, i))
                start = i
    return out


def _alone(q, k, v, document_ids):
    """Each run attended alone, causally: the oracle."""
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(q)
    for row, start, end in _spans(document_ids):
        span = [t[row:row + 1, :, start:end] for t in (q, k, v)]
        out[row, :, start:end] = F.scaled_dot_product_attention(*span, is_causal=True)[0]
    return out


def _qkv(document_ids):
    import torch

    generator = torch.Generator().manual_seed(0)
    rows, length = document_ids.shape
    return [torch.randn(rows, 2, length, 16, generator=generator) for _ in range(3)]


def test_the_dense_mask_gives_each_document_what_it_gives_alone(document_ids):
    import torch
    import torch.nn.functional as F

    from zephon.attention import document_causal_mask

    q, k, v = _qkv(document_ids)
    mask = document_causal_mask(document_ids)
    assert mask.shape == (4, 1, 256, 256) and mask.dtype == torch.bool
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _alone(q, k, v, document_ids), rtol=0, atol=1e-5)
    causal_only = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    real = document_ids != PADDING_DOCUMENT
    assert (causal_only - out)[:, 0][real].abs().max() > 1e-2  # without it, documents attend to their neighbours


def test_varlen_sequences_are_the_documents_of_the_flattened_rows(document_ids):
    """Each sequence `cu_seqlens` marks out of the flattened rows, attended alone, gives what the
    document gives alone: the sequences are the documents and each row's padding, in order, a
    new row starting a new sequence; `max_seqlen` is the longest."""
    import torch
    import torch.nn.functional as F

    from zephon.attention import varlen_sequences

    q, k, v = _qkv(document_ids)
    cu_seqlens, max_seqlen = varlen_sequences(document_ids)
    assert cu_seqlens.dtype == torch.int32 and int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == document_ids.numel()
    flat = [t.permute(0, 2, 1, 3).reshape(-1, 2, 16) for t in (q, k, v)]  # (B·L, heads, dim), flash-attn's layout
    out = torch.empty_like(flat[0])
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        part = [t[start:end].transpose(0, 1)[None] for t in flat]
        out[start:end] = F.scaled_dot_product_attention(*part, is_causal=True)[0].transpose(0, 1)
    want = _alone(q, k, v, document_ids).permute(0, 2, 1, 3).reshape(-1, 2, 16)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    assert len(bounds) - 1 == len(_spans(document_ids))
    assert max_seqlen == int(np.diff(bounds).max())


def test_a_new_row_starts_a_new_sequence_though_its_document_id_repeats():
    import torch

    from zephon.attention import varlen_sequences

    ids = torch.tensor([[0, 0, 1], [0, 1, 1]])  # each row numbers its documents from 0
    assert varlen_sequences(ids).cu_seqlens.tolist() == [0, 2, 3, 4, 6]
    assert varlen_sequences(ids).max_seqlen == 2


def test_the_flex_block_mask_gives_each_document_what_it_gives_alone(document_ids):
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from zephon.attention import document_block_mask

    q, k, v = _qkv(document_ids)
    with warnings.catch_warnings():  # flex_attention without torch.compile warns that it runs unfused
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=document_block_mask(document_ids, block_size=64))
    torch.testing.assert_close(out, _alone(q, k, v, document_ids), rtol=0, atol=1e-5)


def test_anything_but_a_2d_integer_tensor_is_refused_by_name():
    import torch

    from zephon.attention import document_causal_mask, varlen_sequences

    for bad in (np.zeros((2, 3), np.int32), torch.zeros(3, dtype=torch.int64), torch.zeros(2, 3),
                torch.zeros(2, 3, dtype=torch.bool)):
        for helper in (document_causal_mask, varlen_sequences):
            with pytest.raises(TypeError, match="document_ids must be a \\(rows, length\\) torch tensor of integers"):
                helper(bad)
