"""Race worker: this repository's Zephon (thread or process runner), one rank, all lanes.

Text: tokenize (parallelism p) -> pack_flat wrap 2048 -> shuffle -> batch 8.
VLM: `vlm._demo.vlm_pipeline` (the demo's recipe: tokenize the caption and read the image's
header in one stage of parallelism p -> pack_multimodal 4096 -> shuffle -> batch, each row's
images decoded on the workers just before the loader takes it: `decode_images(defer=True)`).
"""

from __future__ import annotations

import _runtime

cfg = _runtime.config()

import PIL
import tokenizers  # noqa: F401

import zephon
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

_runtime.start()
p = cfg["parallelism"]
data = cfg["data"]
if cfg["pipeline"] == "text":
    t = cfg["text"]
    source = StaticMixtureWorkSource([Dataset.from_path("text", data["text_dir"])], seed=0,
                                     records_per_chunk=t["records_per_chunk"])
    pipeline = (
        Pipeline(source)
        .options(num_lanes=t["num_lanes"], runner=cfg["runner"], flush_every_chunks=t["flush_every_chunks"],
                 prefetch=cfg.get("prefetch"))
        .tokenize(tokenizer_id=data["text_tokenizer"], field="text", parallelism=p, eos=t["eos"])
        .pack_flat(max_length=t["max_length"], algorithm="wrap")
        .shuffle(buffer_size=t["shuffle_buffer"], seed=0)
        .batch(microbatch_size=t["microbatch"])
    )
else:
    from vlm import ImageSpec
    from vlm._demo import vlm_pipeline

    v = cfg["vlm"]
    pipeline = vlm_pipeline(data["pairs_dir"], data["vlm_tokenizer"], runner=cfg["runner"], parallelism=p,
                            spec=ImageSpec.pixtral(max_side=v["max_side"]), num_lanes=v["num_lanes"],
                            max_length=v["max_length"], microbatch_size=v["microbatch"],
                            records_per_chunk=v["records_per_chunk"], flush_every_chunks=v["flush_every_chunks"],
                            shuffle_buffer=v["shuffle_buffer"], seed=0, defer=v["defer"])
    if cfg.get("prefetch"):
        pipeline = pipeline.options(prefetch=cfg["prefetch"])

with pipeline.shard(0, 1) as loader:
    result = _runtime.measure(
        loader, cfg,
        usable=lambda b: b.num_real_tokens,
        images=lambda b: len(b.ragged["image_grid"]) if "image_grid" in b.ragged else 0,
    )
    result["runner"] = loader.runner_info
result["config"] = {"runner": cfg["runner"], "parallelism": p}
result["build"] = _runtime.build_facts(["zephon", "numpy", "pillow", "Pillow-SIMD", "tokenizers"])
result["build"]["pil_version"] = PIL.__version__
result["build"]["zephon_path"] = zephon.__file__
_runtime.finish(result)
