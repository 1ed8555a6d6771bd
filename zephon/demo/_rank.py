"""One data-parallel rank of the elastic demo, run as its own process.

Reads a JSON job from argv[1], optionally loads a state, consumes global steps [start, stop) and
writes a JSON result: its microbatches' digests per step (`MicrobatchDigest.as_json()`, what the
parent checks each global batch by) and its final state.
"""

from __future__ import annotations

import json
import sys

from ._recipe import demo_pipeline


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    pipeline = demo_pipeline(runner=job["runner"], parallelism=job["parallelism"])
    with pipeline.shard(job["rank"], job["world_size"], global_batch_size=job["global_batch_size"]) as loader:
        if job.get("state"):
            with open(job["state"]) as f:
                loader.load_state_dict(json.load(f))
        per_step = len(loader.lanes) * loader.rows_per_step // loader.microbatch_size
        iterator = iter(loader)
        digests: dict[int, list] = {}
        for step in range(job["start"], job["stop"]):
            for _ in range(per_step):
                batch = next(iterator)
                assert batch.step == step, f"rank {job['rank']}: expected step {step}, got {batch.step}"
                digests.setdefault(step, []).append(batch.to_digest().as_json())
        result = {"digests": digests, "state": loader.state_dict()}
    with open(job["output"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
