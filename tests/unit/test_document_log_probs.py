"""`zephon.preference` on rows of single documents (KTO's unpaired completions): each document's
summed log-probability and end score, read off packed `pack_flat` rows, are those a model gives
the sequence alone, in the order of the batch's `document_values`; a KTO loss on them, each
document weighed by its record's label, trains.

The oracle is `tests.unit.test_preference_log_probs`'s: a small causal attention model run on each
document alone, against the same model on the rows with its attention kept to each document.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import requires_torch
from tests.unit.test_preference_log_probs import WORDS, TinyModel, _alone
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

pytestmark = requires_torch


@pytest.fixture(scope="module")
def batch(tmp_path_factory, demo_tokenizer_path):
    """A microbatch of 4 rows of 96 ids, several completions a row, each labelled desirable or not."""
    root = tmp_path_factory.mktemp("kto")
    rng = np.random.default_rng(5)
    records = [{"prompt": " ".join(rng.choice(WORDS, rng.integers(1, 6))) + "?\n",
                "completion": " ".join(rng.choice(WORDS, rng.integers(1, 12))), "label": bool(i % 3)}
               for i in range(40)]
    (root / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = StaticMixtureWorkSource([Dataset.from_path("kto", str(root / "kto.jsonl"))], seed=2,
                                     records_per_chunk=8, num_epochs=1)
    pipeline = (Pipeline(source).options(num_lanes=1, runner="inline")
                .tokenize(str(demo_tokenizer_path), field="completion", prompt_field="prompt", bos="<|bos|>",
                          eos="<|eos|>")
                .pack_flat(96, "first_fit", document_values=["label"]).batch(4))
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        first = next(iter(loader))
    assert all(len(sources) >= 3 for sources in first.sources), "rows of several documents"
    labels = first.ragged["label"].tolist()
    assert labels == [float(records[a.index]["label"]) for sources in first.sources for a in sources]
    assert 0 < sum(labels) < len(labels), "desirable and undesirable completions"
    return first


def _documents_alone(model, batch) -> tuple[list[float], list[int], list[float]]:
    """Each document's sum, token count and end score, row by row, the document given alone."""
    sums, counts, scores = [], [], []
    for row, sources in enumerate(batch.sources):
        for d in range(len(sources)):
            at = batch.tokens["document_ids"][row] == d
            total, tokens, score = _alone(model, batch.tokens["input_ids"][row][at], batch.tokens["labels"][row][at])
            sums.append(total)
            counts.append(tokens)
            scores.append(score)
    return sums, counts, scores


def test_each_documents_log_probability_and_score_are_the_sequence_s_alone(batch):
    import torch

    from zephon.attention import document_causal_mask
    from zephon.preference import document_log_probs, document_scores

    model = TinyModel()
    tensors = batch.to_training()
    document_ids, labels = tensors["document_ids"], tensors["labels"]
    mask = document_causal_mask(document_ids)
    logs = document_log_probs(model.token_log_probs(tensors["input_ids"], tensors["position_ids"], labels, mask),
                              labels, document_ids)
    scores = document_scores(model.token_scores(tensors["input_ids"], tensors["position_ids"], mask), document_ids)
    sums, counts, ends = _documents_alone(model, batch)
    assert len(sums) == len(tensors["label"]) == sum(len(s) for s in batch.sources)
    torch.testing.assert_close(logs.sums, torch.tensor(sums), rtol=1e-5, atol=1e-4)
    assert logs.tokens.tolist() == counts and min(counts) > 0
    torch.testing.assert_close(scores, torch.tensor(ends), rtol=1e-5, atol=1e-4)


def test_pairs_are_the_documents_taken_two_by_two():
    import torch

    from zephon.preference import document_log_probs, document_scores, pair_log_probs, pair_scores

    document_ids = torch.tensor([[0, 0, 1, 1, 1, 2, 3, 3], [0, 1, 1, 1, -1, -1, -1, -1]])
    labels = torch.tensor([[-100, 5, 6, -100, 7, 8, 9, 10], [11, 12, -100, 13, -100, -100, -100, -100]])
    values = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    logs = document_log_probs(values, labels, document_ids)
    assert logs.sums.tolist() == [1.0, 6.0, 5.0, 13.0, 8.0, 20.0] and logs.tokens.tolist() == [1, 2, 1, 2, 1, 2]
    pairs = pair_log_probs(values, labels, document_ids)
    assert (pairs.chosen.tolist(), pairs.rejected.tolist()) == ([1.0, 5.0, 8.0], [6.0, 13.0, 20.0])
    assert document_scores(values, document_ids).tolist() == [1.0, 4.0, 5.0, 7.0, 8.0, 11.0]
    assert pair_scores(values, document_ids).chosen.tolist() == [1.0, 5.0, 8.0]


def test_a_kto_loss_on_the_labelled_documents_trains_the_model(batch):
    """The desirable completions' log-ratios to the reference rise, the undesirable ones' fall (on
    the mean: the completions share their words, so one may move with the others)."""
    import torch

    from zephon.attention import document_causal_mask
    from zephon.preference import document_log_probs

    model = TinyModel()
    tensors = batch.to_training()
    mask = document_causal_mask(tensors["document_ids"])
    desirable = tensors["label"].bool()

    def sums():
        log_probs = model.token_log_probs(tensors["input_ids"], tensors["position_ids"], tensors["labels"], mask)
        return document_log_probs(log_probs, tensors["labels"], tensors["document_ids"]).sums

    def loss():
        ratio = sums() - reference
        return torch.where(desirable, 1 - torch.sigmoid(0.1 * ratio), 1 - torch.sigmoid(-0.1 * ratio)).mean()

    reference = sums().detach()
    before = float(loss().detach())
    optimizer = torch.optim.SGD([model.tokens], lr=0.5)
    for _ in range(5):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    ratio = sums().detach() - reference
    assert float(loss().detach()) < before
    assert float(ratio[desirable].mean()) > 0 > float(ratio[~desirable].mean())


def test_tensors_of_other_shapes_are_refused():
    import torch

    from zephon.preference import document_log_probs, document_scores

    document_ids = torch.tensor([[0, 0, 1, 2, -1]])
    with pytest.raises(ValueError, match="document_log_probs: labels must be a \\(rows, length\\) torch tensor"):
        document_log_probs(torch.zeros(1, 5), torch.zeros(1, 4), document_ids)
    with pytest.raises(ValueError, match="document_scores: document_ids must be a \\(rows, length\\) torch tensor"):
        document_scores(torch.zeros(1, 5), document_ids.numpy())
    assert document_log_probs(torch.zeros(1, 5), torch.zeros(1, 5), document_ids).sums.shape == (3,)
