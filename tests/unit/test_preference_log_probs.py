"""`zephon.preference`: the log-probabilities a model gives each pair's chosen and rejected answers,
and a reward model's scores of them, read off packed `pack_pairs` rows, are those it gives each
sequence alone.

The oracle: a small causal attention model run on each record's chosen and rejected ids alone,
its log-probabilities of their learned tokens summed. The same model on the packed rows, its
attention kept to each document (`zephon.attention.document_causal_mask`) and its positions the
rows' `position_ids`, must give the same sums and scores, pair by pair, and a DPO loss on them must
train.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import requires_torch
from zephon import IGNORE_INDEX, Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

pytestmark = requires_torch

WORDS = "lane shard chunk token pack shuffle batch flush replay seed mixture rank epoch".split()


@pytest.fixture(scope="module")
def batch(tmp_path_factory, demo_tokenizer_path):
    """A microbatch of 4 rows of 96 ids, several pairs a row, and each record's ids and targets."""
    root = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(3)
    records = [{"prompt": " ".join(rng.choice(WORDS, rng.integers(1, 6))) + "?\n",
                "chosen": " ".join(rng.choice(WORDS, rng.integers(1, 9))),
                "rejected": " ".join(rng.choice(WORDS, rng.integers(1, 9)))} for _ in range(24)]
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = StaticMixtureWorkSource([Dataset.from_path("prefs", str(root / "prefs.jsonl"))], seed=2,
                                     records_per_chunk=8, num_epochs=1)
    tokenizer = str(demo_tokenizer_path)
    pipeline = Pipeline(source).options(num_lanes=1, runner="inline")
    for side in ("chosen", "rejected"):
        pipeline = pipeline.tokenize(tokenizer, field=side, prompt_field="prompt", keep_field=side == "chosen",
                                     bos="<|bos|>", eos="<|eos|>", output_field=f"{side}_ids",
                                     loss_mask_field=f"{side}_loss_mask")
    with pipeline.pack_pairs(96).batch(4).shard(0, 1, global_batch_size=4) as loader:
        first = next(iter(loader))
    assert all(len(sources) >= 4 for sources in first.sources), "rows of several pairs"
    return first


class TinyModel:
    """Embeddings of ids and positions, one causal attention head, a projection to the vocabulary."""

    def __init__(self, vocab: int = 8192, width: int = 16, positions: int = 128):
        import torch

        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.nn.Parameter(torch.randn(vocab, width, generator=generator))
        self.positions = torch.randn(positions, width, generator=generator)
        self.qkv = torch.randn(width, 3 * width, generator=generator) / width**0.5
        self.out = torch.randn(width, vocab, generator=generator) / width**0.5
        self.value = torch.randn(width, generator=generator)

    def features(self, input_ids, position_ids, mask):
        import torch

        hidden = self.tokens[input_ids] + self.positions[position_ids]
        q, k, v = (hidden @ self.qkv).chunk(3, dim=-1)
        return hidden + torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None],
                                                                         attn_mask=mask)[:, 0]

    def token_log_probs(self, input_ids, position_ids, labels, mask):
        """(B, L): position i's log-probability of labels[:, i] (IGNORE_INDEX read as id 0)."""
        log_probs = (self.features(input_ids, position_ids, mask) @ self.out).log_softmax(-1)
        return log_probs.gather(-1, labels.clamp(min=0)[..., None])[..., 0]

    def token_scores(self, input_ids, position_ids, mask):
        """(B, L): a value head's score at each position, as a reward model's."""
        return self.features(input_ids, position_ids, mask) @ self.value


def _alone(model, ids: np.ndarray, labels: np.ndarray) -> tuple[float, int, float]:
    """The model's summed log-probability of a sequence's learned labels, given it alone, how many
    they are, and its score at the sequence's last position."""
    import torch

    input_ids = torch.from_numpy(ids.astype(np.int64))[None]
    labels = torch.from_numpy(labels.astype(np.int64))[None]
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[None, None]
    positions = torch.arange(len(ids))[None]
    log_probs = model.token_log_probs(input_ids, positions, labels, causal)
    learned = labels != IGNORE_INDEX
    score = model.token_scores(input_ids, positions, causal)[0, -1]
    return float(log_probs[learned].sum().detach()), int(learned.sum()), float(score.detach())


def _pairs_alone(model, batch) -> dict[str, list]:
    """Each pair's sums, token counts and scores as the rows hold the pairs, each document given
    alone: its ids and labels read back from the row (those of `document_ids == d`)."""
    out = {name: [] for name in ("chosen", "rejected", "chosen_tokens", "rejected_tokens", "chosen_score",
                                 "rejected_score")}
    for row, sources in enumerate(batch.sources):
        for d in range(len(sources)):
            at = batch.tokens["document_ids"][row] == d
            total, tokens, score = _alone(model, batch.tokens["input_ids"][row][at], batch.tokens["labels"][row][at])
            side = "chosen" if d % 2 == 0 else "rejected"
            out[side].append(total)
            out[f"{side}_tokens"].append(tokens)
            out[f"{side}_score"].append(score)
    return out


def test_the_packed_pairs_log_probabilities_are_each_sequence_s_alone(batch):
    import torch

    from zephon.attention import document_causal_mask
    from zephon.preference import pair_log_probs

    model = TinyModel()
    tensors = batch.to_training()
    document_ids, labels = tensors["document_ids"], tensors["labels"]
    packed = model.token_log_probs(tensors["input_ids"], tensors["position_ids"], labels,
                                   document_causal_mask(document_ids))
    pairs = pair_log_probs(packed, labels, document_ids)
    alone = _pairs_alone(model, batch)
    assert len(alone["chosen"]) == sum(len(s) for s in batch.sources) // 2
    torch.testing.assert_close(pairs.chosen, torch.tensor(alone["chosen"]), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(pairs.rejected, torch.tensor(alone["rejected"]), rtol=1e-5, atol=1e-4)
    assert pairs.chosen_tokens.tolist() == alone["chosen_tokens"]
    assert pairs.rejected_tokens.tolist() == alone["rejected_tokens"]
    assert min(alone["chosen_tokens"] + alone["rejected_tokens"]) > 0

    # Attention over the whole row conditions each answer on the documents before it: other sums.
    length = document_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    leaky = pair_log_probs(model.token_log_probs(tensors["input_ids"], tensors["position_ids"], labels, causal),
                           labels, document_ids)
    assert not torch.allclose(leaky.rejected, pairs.rejected, rtol=1e-5, atol=1e-4)


def test_the_packed_pairs_scores_are_each_sequence_s_alone_at_its_end(batch):
    """A reward model's value head read at each document's last position (`pair_scores`)."""
    import torch

    from zephon.attention import document_causal_mask
    from zephon.preference import pair_scores

    model = TinyModel()
    tensors = batch.to_training()
    document_ids = tensors["document_ids"]
    scores = pair_scores(model.token_scores(tensors["input_ids"], tensors["position_ids"],
                                            document_causal_mask(document_ids)), document_ids)
    alone = _pairs_alone(model, batch)
    torch.testing.assert_close(scores.chosen, torch.tensor(alone["chosen_score"]), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(scores.rejected, torch.tensor(alone["rejected_score"]), rtol=1e-5, atol=1e-4)


def test_a_dpo_loss_on_the_pairs_trains_the_model(batch):
    import torch

    from zephon.attention import document_causal_mask
    from zephon.preference import pair_log_probs

    model = TinyModel()
    tensors = batch.to_training()
    mask = document_causal_mask(tensors["document_ids"])

    def margins():
        log_probs = model.token_log_probs(tensors["input_ids"], tensors["position_ids"], tensors["labels"], mask)
        pairs = pair_log_probs(log_probs, tensors["labels"], tensors["document_ids"])
        return pairs.chosen - pairs.rejected

    before = margins().detach()
    optimizer = torch.optim.SGD([model.tokens], lr=0.5)
    for _ in range(5):
        optimizer.zero_grad()
        loss = -torch.nn.functional.logsigmoid(0.1 * (margins() - before)).mean()
        loss.backward()
        optimizer.step()
    assert bool((margins().detach() > before).all()), "every pair's chosen answer gained on its rejected one"


def test_rows_that_are_not_pairs_and_tensors_of_other_shapes_are_refused():
    import torch

    from zephon.preference import pair_log_probs, pair_scores

    document_ids = torch.tensor([[0, 0, 1, 1, -1], [0, 0, 1, 2, 2]])
    labels = torch.zeros_like(document_ids)
    with pytest.raises(ValueError, match="pair_log_probs: row 1 holds 3 documents, not pairs"):
        pair_log_probs(torch.zeros(2, 5), labels, document_ids)
    with pytest.raises(ValueError, match="pair_scores: row 1 holds 3 documents, not pairs"):
        pair_scores(torch.zeros(2, 5), document_ids)
    with pytest.raises(ValueError, match="document_ids must be a \\(rows, length\\) torch tensor"):
        pair_scores(torch.zeros(2, 5), document_ids.numpy())
    with pytest.raises(ValueError, match="token_log_probs must be a \\(rows, length\\) torch tensor"):
        pair_log_probs(torch.zeros(2, 4), labels, document_ids)
    empty = pair_log_probs(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.long), torch.full((1, 3), -1))
    assert [len(part) for part in empty] == [0, 0, 0, 0], "a row of padding holds no pair"
