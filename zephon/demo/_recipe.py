"""The demo recipe: the shipped corpus (KJV chapters + Jargon File entries) and tokenizer."""

from __future__ import annotations

from pathlib import Path

from .. import Pipeline
from ..io import Dataset
from ..work import StaticMixtureWorkSource, TokenEstimation

DATA = Path(__file__).resolve().parent.parent / "data"
TOKENIZER = DATA / "tokenizer.json"


DEMO_MIXTURE = {"kjv": 0.7, "jargon": 0.3}
"""The demo's token weights, which its ledger's realised mixture approaches as the run goes on."""


def demo_pipeline(
    *,
    runner: str = "auto",
    parallelism: int = 1,
    num_lanes: int = 8,
    max_length: int = 512,
    microbatch_size: int = 2,
    seed: int = 42,
    records_per_chunk: int = 16,
    mixture: dict[str, float] | None = None,
    scan_cache: str | None = None,
) -> Pipeline:
    """The demo's pipeline; `scan_cache` as in `Dataset.from_path` (the data is the same with it)."""
    source = StaticMixtureWorkSource(
        datasets=[
            Dataset.from_path("kjv", str(DATA / "kjv"), scan_cache=scan_cache),
            Dataset.from_path("jargon", str(DATA / "jargon"), scan_cache=scan_cache),
        ],
        mixture=mixture or DEMO_MIXTURE,
        token_estimation=TokenEstimation(),
        seed=seed,
        records_per_chunk=records_per_chunk,
    )
    return (
        Pipeline(source)
        .options(num_lanes=num_lanes, runner=runner, flush_every_chunks=8)
        .tokenize(tokenizer_id=str(TOKENIZER), field="text", parallelism=parallelism, eos="<|eos|>")
        .pack_flat(max_length=max_length, algorithm="wrap")
        .shuffle(buffer_size=64, seed=seed)
        .batch(microbatch_size=microbatch_size)
    )
