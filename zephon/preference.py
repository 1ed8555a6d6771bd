"""Each preference pair's, or each document's, log-probabilities or rewards, from a batch of packed rows.

`pack_pairs` puts a record's chosen document at `document_ids == 2k` of a row and its rejected one
at `2k + 1`. A preference loss needs, per pair, the log-probability the model gives each document's
learned tokens (its answer), summed: `pair_log_probs` sums a (B, L) tensor of per-position
log-probabilities of the labels over each document's positions whose label is not IGNORE_INDEX,
and returns them pair by pair, in the order of the rows and of the pairs in each row, with the
number of tokens each sum holds (for the losses that average, as SimPO's and IPO's do):

    logits = model(input_ids, position_ids=position_ids, ...)         # (B, L, V), documents apart
    token_log_probs = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    pairs = pair_log_probs(token_log_probs, labels, document_ids)
    # with the reference model's `ref` alike:
    loss = -F.logsigmoid(beta * ((pairs.chosen - ref.chosen) - (pairs.rejected - ref.rejected))).mean()

A reward model is trained on the same rows: `pair_scores` takes a (B, L) tensor of per-position
scores (its value head's) and returns each document's at its last position, the end of its answer,
pair by pair, for a Bradley-Terry loss, `-F.logsigmoid(scores.chosen - scores.rejected).mean()`.

Unpaired preference data (KTO: each completion labelled desirable or not) packs with
`pack_flat(document_values=("label",))`: `document_log_probs` gives every document's sum, row by
row and document by document, the order of the batch's ragged `label` (one value a document):

    logs = document_log_probs(token_log_probs, labels, document_ids)   # the reference model's `ref` alike
    ratio, desirable = logs.sums - ref.sums, batch["label"].bool()      # (documents,) each
    loss = torch.where(desirable, 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))).mean()

`document_scores` gives every document's score at its last position alike, for a reward model
regressed on a per-document reward (`document_values=("reward",)`).

The model must keep the row's documents apart (`zephon.attention`), or each is conditioned on
those packed before it (the rejected answer on the chosen). torch is imported by the functions,
never by importing this module.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._sequence import IGNORE_INDEX

__all__ = ["DocumentLogProbs", "PairLogProbs", "PairScores", "document_log_probs", "document_scores",
           "pair_log_probs", "pair_scores"]


class DocumentLogProbs(NamedTuple):
    """Per document (D,), row by row: the summed log-probabilities of its learned tokens, and how
    many tokens each sum holds."""

    sums: Any
    tokens: Any


class PairLogProbs(NamedTuple):
    """Per pair (P,): the summed log-probabilities of the chosen and of the rejected document's
    learned tokens, and how many tokens each sum holds."""

    chosen: Any
    rejected: Any
    chosen_tokens: Any
    rejected_tokens: Any


class PairScores(NamedTuple):
    """Per pair (P,): the chosen and the rejected document's score at its last position."""

    chosen: Any
    rejected: Any


def pair_log_probs(token_log_probs: Any, labels: Any, document_ids: Any) -> PairLogProbs:
    """Sum `token_log_probs` (B, L float: position i's log-probability of `labels[:, i]`; any value
    where the label is IGNORE_INDEX) over each document's learned positions, per pair. Gradients
    flow to `token_log_probs`. A row whose documents are not pairs (an odd count: rows of another
    packer) is refused with ValueError, as are tensors of other shapes."""
    documents_in_row = _pairs_checked("pair_log_probs", document_ids, token_log_probs=token_log_probs, labels=labels)
    sums, counts = _document_sums(token_log_probs, labels, document_ids, documents_in_row)
    return PairLogProbs(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


def pair_scores(token_scores: Any, document_ids: Any) -> PairScores:
    """Each document's score in `token_scores` (B, L float) at its last position, per pair, in the
    order `pair_log_probs` gives them. Gradients flow to `token_scores`. Rows that are not pairs and
    tensors of other shapes are refused with ValueError."""
    _pairs_checked("pair_scores", document_ids, token_scores=token_scores)
    scores = _last_scores(token_scores, document_ids)
    return PairScores(scores[0::2], scores[1::2])


def document_log_probs(token_log_probs: Any, labels: Any, document_ids: Any) -> DocumentLogProbs:
    """Sum `token_log_probs` (B, L float: position i's log-probability of `labels[:, i]`; any value
    where the label is IGNORE_INDEX) over each document's learned positions: row by row, each row's
    documents in order, as the batch's `document_values` stand. Gradients flow to
    `token_log_probs`. Tensors of other shapes are refused with ValueError."""
    documents_in_row = _documents_checked("document_log_probs", document_ids, token_log_probs=token_log_probs,
                                          labels=labels)
    return _document_sums(token_log_probs, labels, document_ids, documents_in_row)


def document_scores(token_scores: Any, document_ids: Any) -> Any:
    """Each document's score in `token_scores` (B, L float) at its last position, (D,) in the
    order `document_log_probs` gives them. Gradients flow to `token_scores`. Tensors of other
    shapes are refused with ValueError."""
    _documents_checked("document_scores", document_ids, token_scores=token_scores)
    return _last_scores(token_scores, document_ids)


def _document_sums(token_log_probs: Any, labels: Any, document_ids: Any, documents_in_row: Any) -> DocumentLogProbs:
    """Each document's sum of `token_log_probs` over its learned positions and their count, row by row."""
    import torch

    rows, _ = document_ids.shape
    width = max(int(documents_in_row.max()), 0) if rows else 0
    learned = (labels != IGNORE_INDEX) & (document_ids >= 0)
    # Each learned position's document, numbered across the rows: row b's document d is b·width + d.
    slot = (torch.arange(rows, device=document_ids.device)[:, None] * width + document_ids)[learned]
    sums = torch.zeros(rows * width, dtype=token_log_probs.dtype, device=token_log_probs.device)
    sums = sums.index_add(0, slot, token_log_probs[learned])
    counts = torch.zeros(rows * width, dtype=torch.int64, device=document_ids.device)
    counts = counts.index_add(0, slot, torch.ones_like(slot))
    present = (torch.arange(width, device=document_ids.device)[None, :] < documents_in_row[:, None]).reshape(-1)
    return DocumentLogProbs(sums[present], counts[present])


def _last_scores(token_scores: Any, document_ids: Any) -> Any:
    """`token_scores` at each document's last position, row by row, each row's documents in order."""
    import torch

    following = torch.full_like(document_ids[:, :1], -1)
    last = (document_ids >= 0) & (document_ids != torch.cat([document_ids[:, 1:], following], dim=1))
    return token_scores[last]


def _pairs_checked(caller: str, document_ids: Any, **tensors: Any) -> Any:
    """The number of documents in each row of `document_ids`, after refusing tensors not shaped as it
    and rows whose documents are not pairs (an odd count)."""
    import torch

    documents_in_row = _documents_checked(caller, document_ids, **tensors)
    odd = torch.nonzero(documents_in_row % 2).reshape(-1)  # padding is -1: a row of padding holds none
    if len(odd):
        raise ValueError(f"{caller}: row {int(odd[0])} holds {int(documents_in_row[odd[0]])} documents, not "
                         "pairs: its rows were not packed by pack_pairs")
    return documents_in_row


def _documents_checked(caller: str, document_ids: Any, **tensors: Any) -> Any:
    """The number of documents in each row of `document_ids`, after refusing tensors not shaped as it."""
    import torch

    for name, tensor in (("document_ids", document_ids), *tensors.items()):
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2 or tensor.shape != document_ids.shape:
            raise ValueError(f"{caller}: {name} must be a (rows, length) torch tensor shaped as document_ids "
                             f"{tuple(getattr(document_ids, 'shape', ()))}, got {type(tensor).__name__} "
                             f"{tuple(getattr(tensor, 'shape', ()))}")
    return document_ids.max(dim=1).values + 1 if len(document_ids) else document_ids.new_zeros(0)
