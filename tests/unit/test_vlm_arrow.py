"""Pictures in an `Image()` column of a dataset saved by Hugging Face `datasets` (Arrow, each image
the struct `{"bytes": ..., "path": None}`; `tests/data/hf_datasets/make.py`) decode and pack as the
same rows in Parquet do: the same batches, the images decoded before or after packing."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlm import ImageSpec, PixtralPlaceholders
from vlm._api import decode_images, pack_multimodal
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

PICTURES = Path(__file__).resolve().parents[1] / "data" / "hf_datasets" / "pictures"
TOKENIZER = Path(__file__).resolve().parents[2] / "zephon" / "data" / "tokenizer.json"


def _digests(dataset: Dataset, *, defer: bool, runner: str) -> list[str]:
    source = StaticMixtureWorkSource([dataset], seed=1, records_per_chunk=2, num_epochs=1)
    pipeline = decode_images(Pipeline(source).options(num_lanes=2, runner=runner), field="image",
                             spec=ImageSpec(max_pixels=32 * 32), defer=defer)
    pipeline = pipeline.tokenize(str(TOKENIZER), field="caption", bos="<|bos|>", eos="<|eos|>")
    with pack_multimodal(pipeline, 64, PixtralPlaceholders(3, 4, 5), image_position="after_bos").batch(1).shard(
            0, 1) as loader:
        batches = list(loader)
        assert loader.stats()["datasets"]["pictures"]["total"]["emitted"] == 6
    return [batch.digest() for batch in batches]


@pytest.mark.parametrize("defer", [False, True], ids=["decoded first", "decoded after packing"])
def test_an_image_column_saved_by_datasets_packs_as_the_same_rows_in_parquet(tmp_path, defer):
    table = pa.ipc.open_stream(pa.memory_map(str(PICTURES / "data-00000-of-00001.arrow"))).read_all()
    pq.write_table(table, tmp_path / "pictures.parquet")
    as_parquet = _digests(Dataset.from_path("pictures", str(tmp_path)), defer=defer, runner="inline")
    as_arrow = Dataset.from_path("pictures", str(PICTURES))
    assert as_arrow.format == "arrow" and len(as_parquet) >= 2
    assert _digests(as_arrow, defer=defer, runner="inline") == as_parquet
    assert _digests(as_arrow, defer=defer, runner="process") == as_parquet
