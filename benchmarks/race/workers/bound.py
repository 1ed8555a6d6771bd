"""Race worker: the compute bound, the bare stateless work in a tight loop on one core.

Pinned to one CPU, tokenizers' own thread pool off. For every record of one epoch, in order:
text: read the shards and parse each JSON line, tokenize (+EOS) and assemble the wrap-packed rows;
VLM: read the tar shards, decode + resize, tokenize the caption
(+BOS/EOS), and pack/assemble the rows (the packer's decisions are included: they are a small part
of the assembly). Each part is timed separately over the whole epoch; the best of `repeats` passes
is kept. `functions` says whose code runs: "ours" (zephon's TokenizeOp chunk function and
`assemble_row`, `vlm.decode_image`, `vlm.MultimodalPacker`) and/or "work" (the peers' plain
equivalents in `_work`). For tokenizing, both a per-document `encode` loop and `encode_batch` per
chunk are timed and the faster counts (the bound is the cheapest way to do the work).

ideal tokens/s on N cores = bound tokens/s x N.
"""

from __future__ import annotations

import os

import _runtime

cfg = _runtime.config()
os.sched_setaffinity(0, {cfg.get("cpu", 0)})

import time

import _work
import numpy as np
import PIL

data = cfg["data"]
repeats = cfg.get("repeats", 3)


WALL: dict[str, float] = {}


def best(fn, name: str = "") -> tuple[float, object]:
    """CPU seconds of the fastest of `repeats` passes (the thread's own CPU time: on one pinned
    core this is the work's cost, and other processes on a busy machine do not inflate it; the
    wall time of the same pass is kept in WALL for comparison)."""
    times, out = [], None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.thread_time()
        out = fn()
        times.append((time.thread_time() - c, time.perf_counter() - w))
    cpu, wall = min(times)
    WALL[name] = wall
    return cpu, out


def text_bound(functions: str) -> dict:
    t = cfg["text"]
    shards = _work.text_shards(data["text_dir"])
    t_read, texts = best(lambda: [text for shard in shards for text in _work.read_text_shard(shard)], "read_parse_s")
    eos = data["text_eos_id"]
    length = t["max_length"]
    tok = _work.load_tokenizer(data["text_tokenizer"])
    chunk = t["records_per_chunk"]

    def encode_loop():
        return [_work.encode_text(tok, text, None, eos) for text in texts]

    def encode_batched():
        out = []
        for i in range(0, len(texts), chunk):
            for e in tok.encode_batch(texts[i:i + chunk], add_special_tokens=False):
                out.append(np.array(e.ids + [eos], dtype=np.int32))
        return out

    def encode_batched_fast():
        out = []
        for i in range(0, len(texts), chunk):
            for e in tok.encode_batch_fast(texts[i:i + chunk], add_special_tokens=False):
                out.append(np.array(e.ids + [eos], dtype=np.int32))
        return out

    t_loop, docs = best(encode_loop, "tokenize_encode_s")
    t_batch, _ = best(encode_batched, "tokenize_encode_batch_s")
    t_fast, _ = best(encode_batched_fast, "tokenize_encode_batch_fast_s")
    t_batch = min(t_batch, t_fast)
    parts = {"tokenize_encode_s": t_loop, "tokenize_encode_batch_s": t_batch, "tokenize_encode_batch_fast_s": t_fast}
    if functions == "ours":
        from zephon._packing import Piece, assemble_row
        from zephon._records import RecordAddress

        address = RecordAddress("text", "x", 0)
        plan, pieces, filled = [], [], 0
        for tokens in docs:
            start = 0
            while start < len(tokens):
                take = min(len(tokens) - start, length - filled)
                pieces.append(Piece(tokens, start, start + take, address))
                filled += take
                start += take
                if filled == length:
                    plan.append(pieces)
                    pieces, filled = [], 0

        t_assemble, rows = best(lambda: [assemble_row(p, length, 0) for p in plan], "assemble_s")
        usable = sum(int(np.count_nonzero(r.tokens["document_ids"] >= 0)) for r in rows)
    else:
        def pack():
            packer = _work.WrapPacker(length, 0)
            return [row for tokens in docs for row in packer.push(tokens)]

        t_assemble, rows = best(pack, "assemble_s")
        usable = sum(int(np.count_nonzero(r["document_ids"] >= 0)) for r in rows)
    seconds = t_read + min(t_loop, t_batch) + t_assemble
    parts["assemble_s"] = t_assemble
    parts["read_parse_s"] = t_read
    return {"records": len(texts), "rows": len(rows), "usable_tokens": usable, "seconds": seconds,
            "usable_tokens_per_s": usable / seconds, "images_per_s": 0.0, "parts": parts}


def vlm_bound(functions: str) -> dict:
    v = cfg["vlm"]
    ids = data["vlm_ids"]
    shards = _work.pair_shards(data["pairs_dir"])
    t_read, pairs = best(lambda: [pair for shard in shards for pair in _work.read_pair_shard(shard)], "read_s")
    tok = _work.load_tokenizer(data["vlm_tokenizer"])
    max_side, patch, length = v["max_side"], 16, v["max_length"]
    captions = [c for _, c in pairs]

    def tokenize():
        return [_work.encode_text(tok, c, ids["bos"], ids["eos"]) for c in captions]

    t_tok, texts = best(tokenize, "tokenize_s")
    if functions == "ours":
        from vlm import ImageSpec, MultimodalPacker, PixtralPlaceholders, decode_image
        from zephon._records import RecordAddress

        spec = ImageSpec.pixtral(max_side=max_side)
        t_dec, pixels = best(lambda: [decode_image(b, spec) for b, _ in pairs], "decode_resize_s")
        placeholders = PixtralPlaceholders(ids["img"], ids["img_break"], ids["img_end"])
        address = RecordAddress("pairs", "x", 0)
        records = [{"input_ids": t, "pixels": p} for t, p in zip(texts, pixels)]

        def pack():
            packer = MultimodalPacker(None, max_length=length, placeholders=placeholders, spec=spec,
                                      pad_id=ids["pad"], image_position="after_bos")
            rows = [row for r in records for row in packer.push((address, r))]
            return rows + packer.flush()

        t_pack, rows = best(pack, "pack_assemble_s")
        usable = sum(int(np.count_nonzero(r.tokens["document_ids"] >= 0)) for r in rows)
    else:
        t_dec, pixels = best(lambda: [_work.decode_image(b, max_side, patch) for b, _ in pairs], "decode_resize_s")
        placeholders = _work.Placeholders(ids["img"], ids["img_break"], ids["img_end"])
        docs = [{"pixels": p, "text": t} for t, p in zip(texts, pixels)]

        def pack():
            packer = _work.FirstFitPacker(length, ids["pad"], patch, placeholders)
            rows = [row for d in docs for row in packer.push(d)]
            return rows + [packer._emit(0) for _ in range(len(packer._rows))]

        t_pack, rows = best(pack, "pack_assemble_s")
        usable = sum(int(np.count_nonzero(r["document_ids"] >= 0)) for r in rows)
    seconds = t_read + t_dec + t_tok + t_pack
    return {"records": len(pairs), "rows": len(rows), "usable_tokens": usable, "images": len(pairs),
            "seconds": seconds, "usable_tokens_per_s": usable / seconds, "images_per_s": len(pairs) / seconds,
            "parts": {"read_s": t_read, "decode_resize_s": t_dec, "tokenize_s": t_tok, "pack_assemble_s": t_pack}}


_runtime.start()
result = {"pipeline": cfg["pipeline"], "functions": cfg["functions"]}
result.update((text_bound if cfg["pipeline"] == "text" else vlm_bound)(cfg["functions"]))
result["wall_parts"] = WALL
result["build"] = _runtime.build_facts(["zephon", "numpy", "pillow", "Pillow-SIMD", "tokenizers"])
result["build"]["pil_version"] = PIL.__version__
_runtime.finish(result)
