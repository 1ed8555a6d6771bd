"""Write this directory's Arrow datasets with Hugging Face `datasets` itself (not a dependency of
Zephon or its tests): `python -m venv /tmp/hf && /tmp/hf/bin/pip install datasets pillow &&
/tmp/hf/bin/python tests/data/hf_datasets/make.py` from the repository's root. What it wrote with
datasets 5.2.0 is committed, so the tests read files written by the library users write them with.

- `jargon/`: the first 200 records of `zephon/data/jargon/jargon-00000-of-00003.jsonl`, loaded with
  `load_dataset("json")` and saved with `save_to_disk(num_shards=2)`, in record batches of 16 rows
  (datasets writes 1,000 a batch; 16 gives a small file many batches to seek among);
- `splits/`: a `DatasetDict` of two splits (`train`, `test`) of 6 and 4 of those records;
- `pictures/`: 6 generated pictures (PNG and JPEG) in an `Image()` column beside a caption, saved
  with `save_to_disk`, each image stored as datasets stores it: `{"bytes": ..., "path": ...}`.
"""

import io
import itertools
import json
import shutil
import sys
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
JARGON = HERE.parents[2] / "zephon" / "data" / "jargon" / "jargon-00000-of-00003.jsonl"


def main() -> None:
    datasets.config.DEFAULT_MAX_BATCH_SIZE = 16  # the record batches save_to_disk writes
    for name in ("jargon", "splits", "pictures"):
        shutil.rmtree(HERE / name, ignore_errors=True)
    lines = list(itertools.islice(JARGON.open(encoding="utf-8"), 200))
    source = HERE / "_jargon_200.jsonl"
    source.write_text("".join(lines), encoding="utf-8")
    try:
        jargon = datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(HERE / "_cache"))
        jargon.save_to_disk(str(HERE / "jargon"), num_shards=2)
        datasets.DatasetDict({"train": jargon.select(range(6)), "test": jargon.select(range(6, 10))}).save_to_disk(
            str(HERE / "splits"))
    finally:
        source.unlink()
        shutil.rmtree(HERE / "_cache", ignore_errors=True)
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")})
    pictures = datasets.Dataset.from_dict(
        {"image": [_picture(i) for i in range(6)], "caption": [f"picture {i}" for i in range(6)]}, features=features)
    pictures.save_to_disk(str(HERE / "pictures"))
    print(json.dumps({"datasets": datasets.__version__, "python": sys.version.split()[0]}))


def _picture(i: int) -> dict:
    """A small gradient, PNG for even i and JPEG for odd, as encoded bytes (what an Image() column holds)."""
    height, width = 20 + 4 * i, 28 + 2 * i
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * 9 + i * 20) % 256, (y * 11) % 256, (x + y + i * 31) % 256], axis=-1).astype(np.uint8)
    sink = io.BytesIO()
    Image.fromarray(pixels).save(sink, format="PNG" if i % 2 == 0 else "JPEG", quality=90)
    return {"bytes": sink.getvalue(), "path": None}


if __name__ == "__main__":
    main()
