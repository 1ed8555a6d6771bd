"""Race worker: google `grain` (3.11) or `grain-free-threading` (3.14t), in grain's own idioms.

Records are a `MapDataset.source` over the shards' records, globally shuffled per epoch
(`shuffle`, `repeat`), mapped through the stateless work (`transforms.Map`), turned into an
`IterDataset`, packed, batched. Modes (each peer is run in all of its modes and the best counts):

- `threads`: the map runs on `ReadOptions(num_threads=p)`; packing and batching in the consumer.
- `mp`: the whole pipeline in each of p worker processes (`mp_prefetch`), batches shipped back.
- `mt`: the whole pipeline in each of p threads (`experimental.multithread_prefetch`), grain's
  recommendation for free-threaded Python.

Text packing is grain's `ConcatThenSplitIterDataset` (wrap), then labels from its segment ids;
multimodal packing has no grain operator, so it is the plain first-fit packer wrapped as an
`IterDataset` (grain's extension point).
"""

from __future__ import annotations

import logging

import _runtime

logging.getLogger("absl").setLevel(logging.ERROR)

import _work
import grain
import grain.experimental as ge
import numpy as np
import PIL
import tokenizers  # noqa: F401


class Tokenize(grain.transforms.Map):
    def __init__(self, path: str, bos, eos) -> None:
        self.path, self.bos, self.eos, self._tok = path, bos, eos, None

    def map(self, text):
        if self._tok is None:
            self._tok = _work.load_tokenizer(self.path)
        return {"input_ids": _work.encode_text(self._tok, text, self.bos, self.eos)}


class Labels(grain.transforms.Map):
    """labels / document_ids in Zephon's convention from ConcatThenSplit's segment ids."""

    def map(self, row):
        ids, seg = row["input_ids"], row["input_ids_segment_ids"]
        labels = np.full(len(ids), _work.IGNORE, dtype=np.int32)
        same = (seg[1:] == seg[:-1]) & (seg[1:] > 0)
        labels[:-1] = np.where(same, ids[1:], _work.IGNORE)
        return {"input_ids": ids, "labels": labels, "position_ids": row["input_ids_positions"],
                "document_ids": seg - 1}


class DecodeAndTokenize(grain.transforms.Map):
    def __init__(self, path: str, max_side: int, ids: dict) -> None:
        self.path, self.max_side, self.ids, self._tok = path, max_side, ids, None

    def map(self, pair):
        if self._tok is None:
            self._tok = _work.load_tokenizer(self.path)
        image, caption = pair
        return _work.vlm_document(self._tok, caption, image, self.max_side, 16, self.ids["bos"], self.ids["eos"])


class PackIterDataset(grain.IterDataset):
    """First-fit multimodal packing as a grain IterDataset."""

    def __init__(self, parent, length: int, ids: dict) -> None:
        super().__init__(parent)
        self.length, self.ids = length, ids

    def __iter__(self):
        return _PackIterator(self._parent.__iter__(), self.length, self.ids)


class _PackIterator(grain.DatasetIterator):
    def __init__(self, parent, length: int, ids: dict) -> None:
        super().__init__(parent)
        placeholders = _work.Placeholders(ids["img"], ids["img_break"], ids["img_end"])
        self._packer = _work.FirstFitPacker(length, ids["pad"], 16, placeholders)
        self._ready: list = []

    def __next__(self):
        while not self._ready:
            self._ready.extend(self._packer.push(next(self._parent)))
        return self._ready.pop(0)

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state):
        self._parent.set_state(state)


def main() -> None:
    cfg = _runtime.config()
    _runtime.start()
    p, mode, data = cfg["parallelism"], cfg["mode"], cfg["data"]
    inner_threads = p if mode == "threads" else 0
    read = grain.ReadOptions(num_threads=inner_threads, prefetch_buffer_size=max(16, 8 * p) if inner_threads else 0)

    if cfg["pipeline"] == "text":
        t = cfg["text"]
        texts = [text for shard in _work.text_shards(data["text_dir"]) for text in _work.read_text_shard(shard)]
        ds = grain.MapDataset.source(texts).shuffle(seed=0).repeat(None).map(Tokenize(data["text_tokenizer"], None, data["text_eos_id"]))
        rows = ge.ConcatThenSplitIterDataset(ds.to_iter_dataset(read), length_struct={"input_ids": t["max_length"]})
        batched = rows.map(Labels()).batch(t["microbatch"], drop_remainder=True)
    else:
        v = cfg["vlm"]
        pairs = [pair for shard in _work.pair_shards(data["pairs_dir"]) for pair in _work.read_pair_shard(shard)]
        ds = grain.MapDataset.source(pairs).shuffle(seed=0).repeat(None).map(
            DecodeAndTokenize(data["vlm_tokenizer"], v["max_side"], data["vlm_ids"]))
        rows = PackIterDataset(ds.to_iter_dataset(read), v["max_length"], data["vlm_ids"])
        batched = rows.batch(v["microbatch"], drop_remainder=True, batch_fn=_work.collate)

    if mode == "mp":
        batched = batched.mp_prefetch(grain.MultiprocessingOptions(num_workers=p, per_worker_buffer_size=2))
    elif mode == "mt":
        batched = ge.multithread_prefetch(batched, num_threads=p, buffer_size=2)

    result = _runtime.measure(iter(batched), cfg, usable=_work.usable_tokens, images=_work.num_images)
    result["config"] = {"mode": mode, "parallelism": p}
    result["build"] = _runtime.build_facts(["grain", "grain-free-threading", "numpy", "pillow", "tokenizers"])
    result["build"]["pil_version"] = PIL.__version__
    _runtime.finish(result)


if __name__ == "__main__":
    main()
