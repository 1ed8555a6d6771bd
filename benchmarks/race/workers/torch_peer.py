"""Race worker: the "quick loader", a torch DataLoader whose p worker processes each run the
whole pipeline (what a team writes in an afternoon).

An `IterableDataset` gives worker w the shards w, w+p, ... (repeated, reshuffled each epoch); each
worker tokenizes (and decodes), packs, shuffles rows in a buffer and collates microbatches;
`DataLoader(batch_size=None, num_workers=p)` ships them to the trainer as tensors. Two
configurations (the better one counts): the default, which takes the workers' batches in strict
turn, and `in_order=False` (torch >= 2.6), which takes whichever batch is ready first, so that a
worker whose shards cost more (the text shards are KJV or Jargon File; the VLM shards' images
differ in size) or that the machine delays does not hold the others' finished batches back.
"""

from __future__ import annotations

import _runtime

cfg = _runtime.config()

import random

import _work
import numpy as np  # noqa: F401
import PIL
import tokenizers  # noqa: F401
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Stream(IterableDataset):
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        cfg, data = self.cfg, self.cfg["data"]
        text = cfg["pipeline"] == "text"
        shards = _work.text_shards(data["text_dir"]) if text else _work.pair_shards(data["pairs_dir"])
        mine = shards[worker::workers] or shards[worker % len(shards)::len(shards)]
        rng = random.Random(worker)
        if text:
            t = cfg["text"]
            tok = _work.load_tokenizer(data["text_tokenizer"])
            packer = _work.WrapPacker(t["max_length"], data["text_pad_id"])
            size, microbatch = t["shuffle_buffer"], t["microbatch"]
        else:
            v, ids = cfg["vlm"], data["vlm_ids"]
            tok = _work.load_tokenizer(data["vlm_tokenizer"])
            packer = _work.FirstFitPacker(v["max_length"], ids["pad"], 16,
                                          _work.Placeholders(ids["img"], ids["img_break"], ids["img_end"]))
            size, microbatch = v["shuffle_buffer"], v["microbatch"]
        shuffle = _work.ShuffleBuffer(size, worker)
        pending = []
        while True:
            order = list(mine)
            rng.shuffle(order)
            for shard in order:
                if text:
                    records = _work.read_text_shard(shard)
                else:
                    records = _work.read_pair_shard(shard)
                rng.shuffle(records)
                for record in records:
                    if text:
                        rows = packer.push(_work.encode_text(tok, record, None, data["text_eos_id"]))
                    else:
                        image, caption = record
                        rows = packer.push(_work.vlm_document(tok, caption, image, v["max_side"], 16,
                                                              ids["bos"], ids["eos"]))
                    for row in rows:
                        pending.extend(shuffle.push(row))
                        if len(pending) >= microbatch:
                            yield _work.collate(pending[:microbatch])
                            del pending[:microbatch]


_runtime.start()
p = cfg["parallelism"]
loader = DataLoader(Stream(cfg), batch_size=None, num_workers=p, prefetch_factor=2, persistent_workers=False,
                    in_order=cfg.get("in_order", True))


def usable(batch) -> int:
    return int((batch["document_ids"] >= 0).sum())


def images(batch) -> int:
    grid = batch.get("image_grid")
    return 0 if grid is None else int(grid.shape[0])


result = _runtime.measure(iter(loader), cfg, usable=usable, images=images)
result["config"] = {"num_workers": p, "in_order": cfg.get("in_order", True)}
result["build"] = _runtime.build_facts(["torch", "numpy", "pillow", "tokenizers"])
result["build"]["pil_version"] = PIL.__version__
result["build"]["torch_threads"] = torch.get_num_threads()
_runtime.finish(result)
