"""Race worker: `zephon` 0.2.0 from PyPI (datologyai/zephon), in its own venv, in its own idioms.

Text: JSONL dataset -> `decode_text` -> `tokenize` (its HF-tokenizer operator, EOS appended by
the operator, parallelism p) -> `pack_flat(2048, algorithm="wrap")` -> `shuffle` -> `batch`, with
the race's shuffle buffer and microbatch (`TEXT` and `VLM` in `benchmarks/race/__main__.py`).
VLM: it has no image decoder and no WebDataset reader, so the same pairs are read from Parquet
and decoded + tokenized by a `map_transform` (parallelism p); first-fit packing is its
`pack_sequences` with a `length_fn` (image placeholders + text) and the row assembly as
`pack_payloads` (run on its workers) -> `shuffle` -> `batch`.
Runner: "threads" or "process" (`options(runner=..., max_workers=p)`); the best one counts.
"""

from __future__ import annotations

import logging
import os
import warnings

import _runtime

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import _work
import numpy as np
import PIL
from transformers import PreTrainedTokenizerFast

from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import MixtureSpec, StaticMixtureWorkSource


def _row(payload: dict) -> dict:
    """pack_sequences puts what pack_payloads returned under "packed_samples"."""
    return payload.get("packed_samples", payload)


def main() -> None:
    cfg = _runtime.config()
    _runtime.start()
    p, data = cfg["parallelism"], cfg["data"]
    options = {"runner": cfg["runner"], "max_workers": p}

    if cfg["pipeline"] == "text":
        t = cfg["text"]
        tok = PreTrainedTokenizerFast(tokenizer_file=data["text_tokenizer"], eos_token=t["eos"], pad_token=t["eos"])
        source = StaticMixtureWorkSource([Dataset.from_path("text", data["text_dir"])], mixture=MixtureSpec({"text": 1.0}),
                                         seed=0, chunk_size=256, exhausted_policy="repeat")
        pipeline = (
            Pipeline(source).decode_text(parallelism=p)
            .tokenize(tokenizer=tok, field="text", special_tokens="eos", parallelism=p)
            .pack_flat(t["max_length"], algorithm="wrap", tokens_field="input_ids")
            .shuffle(t["shuffle_buffer"], seed=0)
            .batch(t["microbatch"])
            .options(**options)
        )

        def usable(batch) -> int:
            return sum(int(np.asarray(r.payload["input_ids"]).size) - int(getattr(r.meta, "padding_length", 0) or 0)
                       for r in batch.records)
    else:
        v, ids = cfg["vlm"], data["vlm_ids"]
        length, max_side = v["max_length"], v["max_side"]
        tokenizer_path = data["vlm_tokenizer"]
        _state = {}

        def decode(payload: dict) -> dict:
            tok = _state.get("tok")
            if tok is None:
                tok = _state["tok"] = _work.load_tokenizer(tokenizer_path)
            return _work.vlm_document(tok, payload["text"], payload["image"], max_side, 16, ids["bos"], ids["eos"])

        placeholders = _work.Placeholders(ids["img"], ids["img_break"], ids["img_end"])

        def doc_length(record) -> int:
            h, w = record.payload["pixels"].shape[:2]
            return (h // 16) * (w // 16 + 1) + len(record.payload["text"])

        def assemble(payloads: list) -> dict:
            return _work.assemble_vlm_row(list(payloads), length, ids["pad"], 16, placeholders)

        source = StaticMixtureWorkSource([Dataset.from_path("pairs", data["pairs_parquet_dir"])],
                                         mixture=MixtureSpec({"pairs": 1.0}), seed=0, chunk_size=64,
                                         exhausted_policy="repeat")
        pipeline = (
            Pipeline(source)
            .map_transform(decode, parallelism=p)
            .pack_sequences(length, num_bins=16, algorithm="first_fit", length_fn=doc_length, pack_payloads=assemble,
                            parallelism=p)
            .shuffle(v["shuffle_buffer"], seed=0)
            .batch(v["microbatch"])
            .options(**options)
        )

        def usable(batch) -> int:
            return sum(_work.usable_tokens(_row(r.payload)) for r in batch.records)

    def images(batch) -> int:
        return sum(_work.num_images(_row(r.payload)) for r in batch.records)


    result = _runtime.measure(iter(pipeline), cfg, usable=usable, images=images)
    result["config"] = {"runner": cfg["runner"], "parallelism": p}
    result["build"] = _runtime.build_facts(["zephon", "numpy", "pillow", "tokenizers", "transformers"])
    result["build"]["pil_version"] = PIL.__version__
    _runtime.finish(result)


if __name__ == "__main__":
    main()
