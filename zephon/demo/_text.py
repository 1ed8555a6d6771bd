"""`zephon demo text`: the text pipeline on the shipped data, with throughput and the ledger."""

from __future__ import annotations

import time

from .. import global_batch_digest
from ..cli import check_demo_layout, describe_wait
from ._recipe import DEMO_MIXTURE, demo_pipeline


def run_text_demo(steps: int, runner: str, parallelism: int, global_batch_size: int) -> int:
    pipeline = demo_pipeline(runner=runner, parallelism=parallelism)
    check_demo_layout("text", runner=runner, num_lanes=pipeline.settings.num_lanes,
                      microbatch_size=pipeline.microbatch_size, world_sizes=(1,), global_batch_size=global_batch_size)
    started = time.perf_counter()
    with pipeline.shard(0, 1, global_batch_size=global_batch_size) as loader:
        info = loader.runner_info
        print(f"runner: {info['name']} ({info['reason']}); lanes: {loader.num_lanes}; "
              f"global batch: {global_batch_size} rows of {loader.row_length} tokens")
        per_step = len(loader.lanes) * loader.rows_per_step // loader.microbatch_size
        iterator = iter(loader)
        first_batch_s = None
        real = total = 0
        for step in range(steps):
            batches = [next(iterator) for _ in range(per_step)]
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - started
            real += sum(b.num_real_tokens for b in batches)
            total += sum(b.tokens["input_ids"].size for b in batches)
            if step < 3 or step == steps - 1:
                print(f"step {step:4d}  sha256 {global_batch_digest(batches)}")
            elif step == 3:
                print("  …")
        elapsed = time.perf_counter() - started
        stats = loader.stats()
    print(f"\n{steps} steps in {elapsed:.2f} s (first global batch after {first_batch_s:.2f} s, planning included): "
          f"{real / elapsed:,.0f} usable tokens/s, padding {100 * (1 - real / total):.2f} %")
    print(describe_wait(stats["wait"]))
    print("records by dataset, and its tokens in the batches (the realised mixture):")
    handed = sum(entry["tokens"] for entry in stats["mixture"].values())
    for name, entry in stats["datasets"].items():
        t = entry["total"]
        tokens = stats["mixture"].get(name, {}).get("tokens", 0)
        print(f"  {name:8s} read {t['read']:6d}  emitted {t['emitted']:6d}  filtered {t['filtered']}  skipped {t['skipped'] or 0}"
              f"  tokens {tokens:9,d} ({100 * tokens / handed:.1f} %, weight {100 * DEMO_MIXTURE[name]:.0f} %)")
    return 0
