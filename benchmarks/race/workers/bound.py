"""Race worker: the compute bound, the bare stateless work in a tight loop on one core.

Pinned to one CPU before NumPy is imported (so OpenBLAS starts no thread pool and the process
keeps one thread, unless the race's "idle thread" variant asks for a second), tokenizers' own
thread pool off. For every record of one epoch, in order:
text: read the shards and parse each JSON line, tokenize (+EOS) and pack/assemble the wrap-packed
rows; VLM: read the tar shards, tokenize the caption (+BOS/EOS), decode + resize, and pack/assemble
the rows (the packer's decisions are included: they are a small part of the assembly; ours and
the peers' rows alike are kept, pixels too, until the next pass: see `pack` below). Each part
is timed separately; a pass is one epoch of every part, one untimed pass then `repeats` timed ones,
and a part costs its mean pass (`_passes`: why the mean and not the fastest). `functions` says
whose code runs: "ours" (zephon's `assemble_row`, `vlm.decode_image`, `vlm.MultimodalPacker`, and
for VLM its tar reader, `zephon.io.Dataset`)
and/or "work" (the peers' plain equivalents in `_work`). For tokenizing, a per-document loop of
`_work.encode_text` (what the peers do: `encode_batch_fast` of one document; until the twenty-first
session `encode`, which computes offsets and holds the GIL) and `encode_batch_fast` per chunk
(what Zephon does) are timed and the cheaper counts (the bound is the cheapest way to do the work;
`encode_batch`, never cheaper than `encode_batch_fast`, is no longer timed).

ideal tokens/s on N cores = bound tokens/s x N.
"""

from __future__ import annotations

import os

import _runtime

cfg = _runtime.config()
os.sched_setaffinity(0, {cfg.get("cpu", 0)})
if cfg.get("idle_thread"):  # the race's "idle thread" variant (loaders.VARIANTS): glibc malloc in threaded mode
    import threading

    threading.Thread(target=threading.Event().wait, daemon=True).start()

import _work
import numpy as np
import PIL
from _passes import Passes, time_passes

data = cfg["data"]
repeats = cfg.get("repeats", 4)


def text_bound(functions: str) -> tuple[dict, Passes]:
    t = cfg["text"]
    shards = _work.text_shards(data["text_dir"])
    eos = data["text_eos_id"]
    length = t["max_length"]
    tok = _work.load_tokenizer(data["text_tokenizer"])
    chunk = t["records_per_chunk"]

    def read_parse(_):
        return [text for shard in shards for text in _work.read_text_shard(shard)]

    def encode_loop(out):
        return [_work.encode_text(tok, text, None, eos) for text in out["read_parse_s"]]

    def batched(encode):
        def run(out):
            texts, docs = out["read_parse_s"], []
            for i in range(0, len(texts), chunk):
                for e in encode(texts[i:i + chunk], add_special_tokens=False):
                    docs.append(_work.ids_array(e.ids, None, eos))
            return docs
        return run

    if functions == "ours":
        from zephon._packing import Piece, assemble_row
        from zephon._records import RecordAddress

        address = RecordAddress("text", "x", 0)

        def pack(out):
            plan, pieces, filled = [], [], 0
            for tokens in out["tokenize_document_s"]:
                start = 0
                while start < len(tokens):
                    take = min(len(tokens) - start, length - filled)
                    pieces.append(Piece(tokens, start, start + take, address))
                    filled += take
                    start += take
                    if filled == length:
                        plan.append(pieces)
                        pieces, filled = [], 0
            return [assemble_row(p, length, 0).tokens for p in plan]
    else:
        def pack(out):
            packer = _work.WrapPacker(length, 0)
            return [row for tokens in out["tokenize_document_s"] for row in packer.push(tokens)]

    tokenizers = ("tokenize_document_s", "tokenize_encode_batch_fast_s")
    passes = time_passes([("read_parse_s", read_parse), ("tokenize_document_s", encode_loop),
                          ("tokenize_encode_batch_fast_s", batched(tok.encode_batch_fast)), ("assemble_s", pack)],
                         repeats)
    rows = passes.outputs["assemble_s"]
    usable = sum(int(np.count_nonzero(r["document_ids"] >= 0)) for r in rows)

    def seconds(parts: dict) -> float:
        return parts["read_parse_s"] + min(parts[k] for k in tokenizers) + parts["assemble_s"]

    parts, fastest = passes.means(), passes.fastests()
    return {"records": len(passes.outputs["read_parse_s"]), "rows": len(rows), "usable_tokens": usable,
            "seconds": seconds(parts), "usable_tokens_per_s": usable / seconds(parts), "images_per_s": 0.0,
            "parts": parts, "fastest_pass_usable_tokens_per_s": usable / seconds(fastest)}, passes


def vlm_bound(functions: str) -> tuple[dict, Passes]:
    v = cfg["vlm"]
    ids = data["vlm_ids"]
    tok = _work.load_tokenizer(data["vlm_tokenizer"])
    max_side, patch, length = v["max_side"], 16, v["max_length"]

    def tokenize(out):
        return [_work.encode_text(tok, c, ids["bos"], ids["eos"]) for _, c in out["read_s"]]

    if functions == "ours":
        from vlm import ImageSpec, MultimodalPacker, PixtralPlaceholders, decode_image
        from zephon._records import RecordAddress
        from zephon.io import Dataset

        # Zephon's own tar reader, in the recipe's chunks (since the forty-first session, when it
        # came to read a record in half the time tarfile takes, which the peers' reader still uses:
        # held to a bound reading with tarfile, Zephon's efficiency would count that as its own).
        pairs = Dataset.from_path("pairs", data["pairs_dir"])
        chunks = pairs.chunks(v["records_per_chunk"])

        def read(_):
            records = [r for chunk in chunks for r in pairs.read_chunk(chunk).records]
            return [(r.get("png") or r.get("jpg"), r["txt"]) for r in records]

        spec = ImageSpec.pixtral(max_side=max_side)
        placeholders = PixtralPlaceholders(ids["img"], ids["img_break"], ids["img_end"])
        address = RecordAddress("pairs", "x", 0)

        def decode(out):
            return [decode_image(b, spec) for b, _ in out["read_s"]]

        def pack(out):
            # Every row whole, as the peers' `pack` returns its rows: until 2026-12 only the
            # tokens were kept, so each row's pixels were freed as soon as made, and glibc gave
            # the next row fresh pages: 13-24 k page faults a pass here, none with the rows kept.
            packer = MultimodalPacker(None, max_length=length, placeholders=placeholders, spec=spec,
                                      pad_id=ids["pad"], image_position="after_bos")
            records = [{"input_ids": t, "pixels": p} for t, p in zip(out["tokenize_s"], out["decode_resize_s"])]
            rows = [row for r in records for row in packer.push((address, r))]
            return [row.tokens | row.ragged for row in rows + packer.flush()]
    else:
        shards = _work.pair_shards(data["pairs_dir"])
        placeholders = _work.Placeholders(ids["img"], ids["img_break"], ids["img_end"])

        def read(_):
            return [pair for shard in shards for pair in _work.read_pair_shard(shard)]

        def decode(out):
            return [_work.decode_image(b, max_side, patch) for b, _ in out["read_s"]]

        def pack(out):
            packer = _work.FirstFitPacker(length, ids["pad"], patch, placeholders)
            docs = [{"pixels": p, "text": t} for t, p in zip(out["tokenize_s"], out["decode_resize_s"])]
            rows = [row for d in docs for row in packer.push(d)]
            return rows + [packer._emit(0) for _ in range(len(packer._rows))]

    passes = time_passes([("read_s", read), ("tokenize_s", tokenize), ("decode_resize_s", decode),
                          ("pack_assemble_s", pack)], repeats)
    rows, images = passes.outputs["pack_assemble_s"], len(passes.outputs["read_s"])
    usable = sum(int(np.count_nonzero(r["document_ids"] >= 0)) for r in rows)
    parts, fastest = passes.means(), passes.fastests()
    seconds = sum(parts.values())
    return {"records": images, "rows": len(rows), "usable_tokens": usable, "images": images,
            "seconds": seconds, "usable_tokens_per_s": usable / seconds, "images_per_s": images / seconds,
            "parts": parts, "fastest_pass_usable_tokens_per_s": usable / sum(fastest.values())}, passes


_runtime.start()
result = {"pipeline": cfg["pipeline"], "functions": cfg["functions"]}
measured, passes = (text_bound if cfg["pipeline"] == "text" else vlm_bound)(cfg["functions"])
result.update(measured, pass_cpu_s=passes.cpu, pass_wall_s=passes.wall)
result["build"] = _runtime.build_facts(["zephon", "numpy", "pillow", "Pillow-SIMD", "tokenizers"])
result["build"]["pil_version"] = PIL.__version__
_runtime.finish(result)
