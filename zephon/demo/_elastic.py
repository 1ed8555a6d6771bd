"""`zephon demo elastic`: checkpoint on R ranks, resume on R′, compare every global step.

Each rank is a real, separate Python process. The reference run goes uninterrupted; a second run
stops at the checkpoint step; its ranks' states are merged into one small JSON file; then the
stream is resumed from that file on several other world sizes and every later global step's
SHA-256 is compared with the reference. Each step's digest is `global_batch_digest` of the
microbatch digests the ranks wrote, so a step missing a rank's part is refused (exit 3), never
compared.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import MicrobatchDigest, ZephonError, global_batch_digest, merge_states
from ..barcode import BarcodeWriter
from ..cli import check_checkpoint_step, check_resume_layout, usage_error
from ._recipe import demo_pipeline

RANK_FAILED = 3  # the exit code of a run whose rank process failed or lacks its part (1: batches differ, 2: usage)


def _run_ranks(workdir: Path, tag: str, world_size: int, start: int, stop: int, state: Path | None, args) -> dict:
    procs, outputs = [], []
    for rank in range(world_size):
        job = {
            "rank": rank, "world_size": world_size, "start": start, "stop": stop,
            "state": str(state) if state else None, "runner": args.runner, "parallelism": args.parallelism,
            "global_batch_size": args.global_batch_size, "output": str(workdir / f"{tag}-rank{rank}.json"),
        }
        job_path = workdir / f"{tag}-job{rank}.json"
        job_path.write_text(json.dumps(job))
        procs.append(subprocess.Popen([sys.executable, "-m", "zephon.demo._rank", str(job_path)]))
        outputs.append(Path(job["output"]))
    failed = [rank for rank, p in enumerate(procs) if p.wait() != 0]
    if failed:
        # Not SystemExit(message), which exits 1, the verdict "MISMATCH": a crash says nothing
        # about the batches, and a script must tell the two apart.
        print(f"zephon demo elastic: {tag}: ranks {failed} failed (their errors are above)", file=sys.stderr)
        raise SystemExit(RANK_FAILED)
    results = [json.loads(p.read_text()) for p in outputs]
    steps: dict[int, list] = {}
    for result in results:
        for step, entries in result["digests"].items():
            steps.setdefault(int(step), []).extend(entries)
    try:
        digests = {step: global_batch_digest(map(MicrobatchDigest.from_json, entries))
                   for step, entries in steps.items()}
    except ZephonError as exc:  # a step missing a rank's part (PartialGlobalBatchError), or holding one twice
        # A rank that exited 0 without its part of a step failed as surely as one that crashed, and
        # comparing the digest of the rest would report about the wrong batch: exit 3, not 1.
        print(f"zephon demo elastic: {tag}: {exc}", file=sys.stderr)
        raise SystemExit(RANK_FAILED) from None
    return {"digests": digests, "state": merge_states(r["state"] for r in results)}


def _write_barcode(path: Path, digests: list[str]) -> None:
    """One whole run per file: BarcodeWriter appends (a resumed run continues its barcode), so the
    file of an earlier demo into the same directory goes first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with BarcodeWriter(path) as writer:
        for step, digest in enumerate(digests):
            writer.write(step, digest)


def _check_arguments(args) -> None:
    """Refuse, naming it, what the rank processes would fail on only after the reference run."""
    check_checkpoint_step(args)
    if args.barcode_dir:  # made now: a file in its place ended the demo after every run was paid for
        try:
            Path(args.barcode_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            usage_error("elastic", f"--barcode-dir {args.barcode_dir!r} is no directory one can write: {exc}")
    pipeline = demo_pipeline(runner=args.runner, parallelism=args.parallelism)
    check_resume_layout("elastic", args, pipeline)


def run_elastic_demo(args) -> int:
    _check_arguments(args)
    source_world, targets = args.from_world_size, args.to_world_sizes
    total, at = args.steps, args.checkpoint_step
    with tempfile.TemporaryDirectory(prefix="zephon-elastic-") as tmp:
        workdir = Path(tmp)
        t0 = time.perf_counter()
        print(f"reference: {total} global steps on {source_world} ranks (uninterrupted)…")
        reference = _run_ranks(workdir, "reference", source_world, 0, total, None, args)["digests"]
        print(f"checkpoint: {at} steps on {source_world} ranks, then save the merged loader state…")
        partial = _run_ranks(workdir, "partial", source_world, 0, at, None, args)
        state_path = workdir / "state.json"
        state_path.write_text(json.dumps(partial["state"]))
        print(f"  state: {state_path.stat().st_size} bytes of JSON for {partial['state']['num_lanes']} lanes")
        rows = [("uninterrupted", source_world, 0, 0)]
        failed = False
        for world in targets:
            resumed = _run_ranks(workdir, f"resume{world}", world, at, total, state_path, args)["digests"]
            before = [s for s in range(at) if partial["digests"][s] != reference[s]]
            after = [s for s in range(at, total) if resumed[s] != reference[s]]
            rows.append((f"{source_world} → {world}", world, len(before), len(after)))
            failed |= bool(before or after)
            if args.barcode_dir:
                digests = [partial["digests"][s] if s < at else resumed[s] for s in range(total)]
                _write_barcode(Path(args.barcode_dir) / f"resume-{source_world}-to-{world}.jsonl", digests)
        if args.barcode_dir:
            _write_barcode(Path(args.barcode_dir) / "reference.jsonl", [reference[s] for s in range(total)])
    print(f"\n{'run':16s} {'ranks':>5s} {'steps':>11s} {'mismatches':>10s}  verdict")
    for name, world, before, after in rows:
        span = f"0–{total - 1}" if name == "uninterrupted" else f"{at}–{total - 1}"
        verdict = "reference" if name == "uninterrupted" else ("IDENTICAL" if before + after == 0 else "DIFFERENT")
        print(f"{name:16s} {world:5d} {span:>11s} {before + after:10d}  {verdict}")
    print(f"\nfirst/last reference digest: {reference[0][:16]}… / {reference[total - 1][:16]}…  "
          f"({time.perf_counter() - t0:.1f} s)")
    print("RESULT:", "every resumed global batch is bit-identical" if not failed else "MISMATCH")
    return 1 if failed else 0
