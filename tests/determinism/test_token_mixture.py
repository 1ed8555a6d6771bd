"""A mixture is a *token* ratio: over a long run (4M tokens) each dataset's share is within 1 % of target."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from zephon.demo._recipe import demo_pipeline


def realised_shares(pipeline, min_tokens: int) -> dict[str, float]:
    tokens: Counter = Counter()
    with pipeline.shard(0, 1, global_batch_size=8) as loader:
        for batch in loader:
            doc_ids = batch.tokens["document_ids"]
            for row, sources in enumerate(batch.sources):
                for piece, address in enumerate(sources):
                    tokens[address.dataset] += int(np.count_nonzero(doc_ids[row] == piece))
            if sum(tokens.values()) >= min_tokens:
                break
    total = sum(tokens.values())
    return {name: n / total for name, n in tokens.items()}


@pytest.mark.parametrize("kjv_share,seed", [(0.7, 1), (0.3, 2)])
def test_realised_token_shares_are_within_one_percent_over_four_million_tokens(kjv_share, seed):
    # The shipped datasets differ ~5x in tokens per record, so a record-ratio plan would miss badly.
    # A lane's prefix is within about a chunk per dataset of its shares, and a chunk of 16 kjv
    # chapters is a tenth of a lane's tokens at 1M: over seeds 1-8 the kjv share missed by up to
    # 2.3 points at 1M tokens, 1.0 at 2M and 0.8 at 4M (the SPEC's "long run").
    mixture = {"kjv": kjv_share, "jargon": 1 - kjv_share}
    pipeline = demo_pipeline(
        runner="thread", parallelism=2, max_length=2048, microbatch_size=1, seed=seed, mixture=mixture
    )
    shares = realised_shares(pipeline, 4_000_000)
    assert abs(shares["kjv"] - kjv_share) < 0.01, shares
    assert abs(shares["jargon"] - (1 - kjv_share)) < 0.01, shares
