"""The race's data, prepared once in the cache and handed to every loader as plain paths.

- text: the shipped corpus (`zephon/data`: KJV chapters and Jargon File entries, 3,496 records,
  1.4 M tokens) rewritten as plain JSON Lines shards, so every peer reads it with `json` alone;
  the shipped tokenizer (byte-level BPE, vocab 8,192), EOS `<|eos|>`.
- vlm: real image+caption pairs (Debian tuxpaint stamps, 785 PNG+caption pairs, fetched at run time
  by `vlm._assets.pair_shards`) as WebDataset tar shards; the Pixtral Tekken tokenizer
  (`vlm._assets.tekken_tokenizer`) and its control-token ids. Peers that cannot read tar (zephon
  0.2.0) get the same pairs as one Parquet file per shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEXT_SOURCES = REPO / "zephon" / "data"


def cache_dir() -> Path:
    base = os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zephon")
    path = Path(base) / "race"
    path.mkdir(parents=True, exist_ok=True)
    return path


def text_data() -> dict:
    import zstandard

    target = cache_dir() / "text-v1"
    if not (target / "DONE").exists():
        target.mkdir(parents=True, exist_ok=True)
        for path in sorted((TEXT_SOURCES / "kjv").glob("*.jsonl.zst")) + sorted((TEXT_SOURCES / "jargon").glob("*.jsonl")):
            raw = path.read_bytes()
            if path.suffix == ".zst":
                raw = zstandard.ZstdDecompressor().stream_reader(raw).read()
            name = path.name.removesuffix(".zst")
            (target / name).write_bytes(raw)
        (target / "DONE").write_text("ok")
    tokenizer = TEXT_SOURCES / "tokenizer.json"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    return {"text_dir": str(target), "text_tokenizer": str(tokenizer), "text_eos_id": tok.token_to_id("<|eos|>"),
            "text_pad_id": 0}


def vlm_data() -> dict:
    from tokenizers import Tokenizer

    from vlm._assets import pair_shards, tekken_tokenizer

    pairs = pair_shards(8)
    tokenizer = tekken_tokenizer()
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    ids = {name: tok.token_to_id(token) for name, token in
           (("bos", "<s>"), ("eos", "</s>"), ("img", "[IMG]"), ("img_break", "[IMG_BREAK]"),
            ("img_end", "[IMG_END]"), ("pad", "<pad>"))}
    parquet = cache_dir() / f"pairs-parquet-{pairs.directory.name}"
    if not (parquet / "DONE").exists():
        import sys

        import pyarrow as pa
        import pyarrow.parquet as pq
        sys.path.insert(0, str(Path(__file__).parent / "workers"))
        from _work import read_pair_shard

        parquet.mkdir(parents=True, exist_ok=True)
        for shard in pairs.shards:
            rows = read_pair_shard(str(shard))
            table = pa.table({"image": [r[0] for r in rows], "text": [r[1] for r in rows]})
            pq.write_table(table, parquet / (shard.stem + ".parquet"))
        (parquet / "DONE").write_text("ok")
    return {"pairs_dir": str(pairs.directory), "pairs_parquet_dir": str(parquet), "pairs_source": pairs.describe(),
            "vlm_tokenizer": str(tokenizer), "vlm_ids": ids}


def describe(data: dict) -> dict:
    out = dict(data)
    out["text_records"] = sum(1 for p in Path(data["text_dir"]).glob("*.jsonl") for line in p.open() if line.strip()) \
        if "text_dir" in data else None
    return json.loads(json.dumps(out))
