"""Peak memory of one rank loader over a whole epoch, measured in a fresh process.

    python -m tests.reliability.memory_probe SCENARIO CORPUS_DIR RUNNER PARALLELISM

prints one JSON object: the RSS before iterating (`baseline`, everything imported, the plan built
and the runner started), the peak RSS while iterating (`peak`, VmHWM after resetting it), the
children's peak (`children_peak`, process runner) and the budget of `zephon._memory` for the
same loader. Scenarios: `normal` (a text corpus that fills every buffer), `huge_document` (one
document of 1000 x max_length tokens among normal ones), `huge_images` (6000x4000 JPEGs).
Corpora are written by `write_corpus` beforehand, so the measured process only reads.
"""

from __future__ import annotations

import io
import json
import math
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from tests.reliability.harness import (
    REPO_ROOT,
    clean_records,
    global_batch,
    jsonl_lines,
    pair_tar,
    text_pipeline,
    vlm_pipeline,
    words,
    write_lines,
)

SCENARIOS = ("normal", "huge_document", "huge_images")
MAX_LENGTH = 256
SHUFFLE = 64
HUGE_IMAGE = (6000, 4000)
IMAGE_MAX_PIXELS = 256 * 256


def write_corpus(scenario: str, root: Path) -> Path:
    """The scenario's shards under `root` (written once; the same bytes on every call)."""
    if (root / "done").exists():
        return root
    if scenario == "normal":
        for shard in range(4):
            write_lines(root / f"part-{shard}.jsonl", jsonl_lines(clean_records(1200, f"normal/{shard}")))
    elif scenario == "huge_document":
        lines = jsonl_lines(clean_records(400, "huge"))
        text = words(random.Random("huge"), 1000 * MAX_LENGTH // 2 + 1000)  # about 2 tokens a word
        lines[37] = json.dumps({"id": "huge", "text": text}).encode()
        write_lines(root / "part-0.jsonl", lines)
    elif scenario == "huge_images":
        from PIL import Image

        channels = [Image.radial_gradient("L"), Image.linear_gradient("L"), Image.linear_gradient("L").rotate(90)]
        sink = io.BytesIO()
        Image.merge("RGB", [c.resize(HUGE_IMAGE) for c in channels]).save(sink, "JPEG", quality=85)
        for shard in range(2):  # one 24-megapixel JPEG (encoding one takes a while), four records
            pair_tar(root / f"pairs-{shard}.tar", [(f"s{shard}-{i}", "jpg", sink.getvalue()) for i in range(2)])
    else:
        raise ValueError(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
    (root / "done").touch()
    return root


def image_spec():
    from vlm import ImageSpec

    return ImageSpec(max_pixels=IMAGE_MAX_PIXELS)


def jpeg_decode_bytes(width: int, height: int, spec) -> int:
    """Workspace of decoding one JPEG: Pillow's draft picks the largest 1/2^k scale (k <= 3) that
    stays at least `draft_gap` x the target; the decoded image (4 bytes a pixel inside Pillow) and
    one converted or resized copy of it."""
    from vlm import image_grid

    rows, cols = image_grid(height, width, spec)
    wanted_w, wanted_h = cols * spec.patch_size * spec.draft_gap, rows * spec.patch_size * spec.draft_gap
    scale = 1
    while scale < 8 and width / (scale * 2) >= wanted_w and height / (scale * 2) >= wanted_h:
        scale *= 2
    return 2 * 4 * math.ceil(width / scale) * math.ceil(height / scale)


def build(scenario: str, root: Path, runner: str, parallelism: int):
    """(pipeline, image decode workspace) of a scenario."""
    from zephon.io import Dataset

    if scenario == "huge_images":
        dataset = Dataset.from_path("pairs", str(root))
        pipeline = vlm_pipeline(dataset, image_spec(), runner=runner, parallelism=parallelism, max_length=512,
                                num_lanes=2, shuffle_buffer=8, flush_every_chunks=16, records_per_chunk=2,
                                estimate_tokens=True)
        return pipeline, jpeg_decode_bytes(*HUGE_IMAGE, image_spec())
    dataset = Dataset.from_path("d", str(root))
    pipeline = text_pipeline(dataset, runner=runner, parallelism=parallelism, max_length=MAX_LENGTH,
                             shuffle_buffer=SHUFFLE, flush_every_chunks=16, records_per_chunk=16,
                             estimate_tokens=True)
    return pipeline, 0


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def measure(scenario: str, root: Path, runner: str, parallelism: int) -> dict:
    """Run the whole epoch in this process; see the module docstring for the fields."""
    from zephon._memory import memory_budget

    pipeline, decode_bytes = build(scenario, root, runner, parallelism)
    started = time.perf_counter()
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        loader.runner_info  # noqa: B018 - starts the runner's workers before the baseline
        budget = memory_budget(loader, image_decode_bytes=decode_bytes, threads_in_process=runner != "process")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        baseline = _status()["VmRSS"]
        batches = tokens = 0
        for batch in loader:
            batches += 1
            tokens += batch.num_real_tokens
        peak = _status()["VmHWM"]
    seconds = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"scenario": scenario, "runner": runner, "parallelism": parallelism, "baseline": baseline,
            "peak": peak, "children_peak": children, "budget": budget.as_dict(), "batches": batches,
            "tokens": tokens, "seconds": seconds}


def measure_in_subprocess(scenario: str, root: Path, runner: str, parallelism: int, timeout: float = 300) -> dict:
    command = [sys.executable, "-m", "tests.reliability.memory_probe", scenario, str(root), runner, str(parallelism)]
    done = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe {command} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    scenario, root, runner, parallelism = sys.argv[1:5]
    print(json.dumps(measure(scenario, Path(root), runner, int(parallelism))))
