"""The race: every loader on the same data and the same work, side by side on this machine.

    python -m benchmarks.race --parallelism 1 2 4 --pipelines text vlm --out benchmarks/results/

Each (loader, configuration, parallelism) runs as its own process in the loader's own virtual
environment (`workers/<script>.py`, working directory outside the repository), one at a time, in
an interleaved order over `--repeats` rounds, so that slow drifts of a shared machine hit every
loader alike; each round starts each pipeline with a different loader (`round_order`), so that
what a position in the sequence does to a run (following the previous pipeline's heaviest runs,
say) does not fall on the same loader every round. Each round measures a pipeline's compute
bounds again right before that pipeline's runs, so that the bound sees the machine of the runs
it judges and not the one of ten minutes earlier.
The parent samples the memory of the process tree. Results go to `race.json` (every run, the
medians, the bounds, the machine, the checkout's commit) and the plots to PNG files beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import _data
from . import loaders as race_loaders
from ._monitor import TreeMemory
from ._report import others_cores
from .loaders import BOUNDS, LOADERS, VARIANTS, compile_sources, python_for, variant_name, worker_env

WORKERS = Path(__file__).resolve().parent / "workers"
# Every bound runs with tokenizers' own thread pool off: one core's work, as the bound defines it.
BOUND_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}


def round_order(plan: list[tuple], round_: int) -> list[tuple]:
    """`plan` ((pipeline, loader, config, p) runs) with each pipeline's loaders rotated by `round_`.

    A loader's runs stay together and pipelines keep their order; only which loader goes first
    changes from round to round.
    """
    ordered = []
    for pipeline in dict.fromkeys(run[0] for run in plan):
        runs = [run for run in plan if run[0] == pipeline]
        loaders = list(dict.fromkeys(run[1] for run in runs))
        shift = round_ % len(loaders)
        for loader in loaders[shift:] + loaders[:shift]:
            ordered.extend(run for run in runs if run[1] == loader)
    return ordered


# The recipe every loader follows. Zephon's lanes: 4 per rank (e.g. 32 lanes over 8 GPUs); the row
# shuffle buffers are per lane for Zephon and per worker for the torch DataLoader and zephon 0.2.0
# (grain shuffles records globally instead, its own idiom).
TEXT = {"max_length": 2048, "microbatch": 8, "num_lanes": 4, "records_per_chunk": 16, "flush_every_chunks": 16,
        "shuffle_buffer": 16, "eos": "<|eos|>"}
VLM = {"max_length": 4096, "microbatch": 4, "num_lanes": 4, "records_per_chunk": 16, "flush_every_chunks": 16,
       "shuffle_buffer": 4, "max_side": 448, "defer": True}
# "defer": Zephon decodes each row's images after packing (decode_images(defer=True)); the peers,
# which have no such stage, decode before packing as before.


def machine() -> dict:
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    mem = 0
    try:
        mem = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cpu_model": model,
            "avx2": " avx2" in flags, "memory_bytes": mem, "kernel": platform.release(),
            "platform": platform.platform(), "load_average_at_start": os.getloadavg()}


def checkout() -> dict:
    """The commit of the checkout whose code races (Zephon's workers and the bounds import it
    first), and whether its tracked files differ from that commit: what a result measured,
    recorded with it instead of recalled. `commit` and `dirty` are None outside a git checkout."""
    repo = race_loaders.REPO

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    try:
        return {"path": str(repo), "commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"path": str(repo), "commit": None, "dirty": None}


# Environment variables that change how a worker allocates or how many threads its libraries start:
# each run records the values it got (absent: unset), so that a result's parallelism and allocator
# are read from it, not assumed from this file.
RECORDED_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "LD_PRELOAD",
                "PYTHONMALLOC", "MIMALLOC_PURGE_DELAY", "PYTHON_GIL", "TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS",
                "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def run_worker(python: str, script: str, cfg: dict, timeout: float, env_extra: dict | None = None) -> dict:
    """Run one worker in its own session; returns its result plus the tree's peak memory."""
    with tempfile.TemporaryDirectory(prefix="zephon-race-") as tmp:
        cfg_path, out_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.update(worker_env(script))
        # glibc's dynamic mmap threshold makes big allocations slower in the main thread only
        # (shared ENVIRONMENT.md, "Allocator trap"); fixed thresholds for every loader alike.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "16777216")
        env.setdefault("MALLOC_TRIM_THRESHOLD_", "67108864")
        env.update(env_extra or {})
        recorded = {name: env[name] for name in RECORDED_ENV if name in env}
        # when the run began (UTC): a race's span, and which runs shared a stretch of the machine
        at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        started = time.perf_counter()
        proc = subprocess.Popen([python, str(WORKERS / script), str(cfg_path), str(out_path)], cwd=tmp, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        memory = TreeMemory(proc.pid)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            output, _ = proc.communicate()
        mem = memory.stop()
        _kill_group(proc.pid)  # workers a loader left behind
        wall = time.perf_counter() - started
        text = output.decode(errors="replace")[-4000:]
        if proc.returncode != 0 or not out_path.exists():
            return {"ok": False, "returncode": proc.returncode, "output": text, "wall_s": wall, "env": recorded,
                    "started_at": at, **mem}
        result = json.loads(out_path.read_text())
        result.update(ok=True, wall_s=wall, output=text[-1500:], env=recorded, started_at=at, **mem)
        return result


def run_at_once(python: str, script: str, cfg: dict, timeout: float, env_extra: dict | None = None) -> dict:
    """One copy of a bound worker per CPU of this process, all started together, each pinned to
    its own CPU: the bound with every core busy. Rates add up; `copies` keeps each copy's result."""
    from concurrent.futures import ThreadPoolExecutor

    cpus = sorted(os.sched_getaffinity(0))
    with ThreadPoolExecutor(len(cpus)) as pool:
        copies = list(pool.map(lambda cpu: run_worker(python, script, dict(cfg, cpu=cpu), timeout, env_extra), cpus))
    if not all(c.get("ok") for c in copies):
        return {"ok": False, "output": next(c["output"] for c in copies if not c.get("ok")), "copies": copies}
    total = {key: sum(c[key] for c in copies) for key in ("usable_tokens_per_s", "images_per_s")}
    return {"ok": True, **total, "at_once": len(cpus), "copies": copies, "build": copies[0].get("build"),
            "started_at": min((c["started_at"] for c in copies if c.get("started_at")), default=None)}


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.race", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallelism", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--pipelines", nargs="+", default=["text", "vlm"], choices=["text", "vlm"])
    parser.add_argument("--loaders", nargs="+", default=None, help=f"subset of: {', '.join(LOADERS)}")
    parser.add_argument("--out", default="benchmarks/results/")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--text-tokens", type=float, default=4e6, help="usable tokens per text run after the first batch")
    parser.add_argument("--vlm-images", type=int, default=16000,
                        help="images per VLM run after the first batch (20 epochs of the corpus: a rate over "
                             "fewer depends on which images the window holds)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is killed")
    parser.add_argument("--no-bound", action="store_true", help="skip the compute-bound measurements")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--reuse-runs", metavar="RACE_JSON", default=None,
                        help="take the loader runs (and, with --no-bound, the bounds) from an earlier race.json "
                             "instead of running them; re-summarise, redraw")
    args = parser.parse_args(argv)

    loaders = {name: LOADERS[name] for name in (args.loaders or LOADERS)}
    data = {}
    if "text" in args.pipelines:
        data.update(_data.text_data())
    if "vlm" in args.pipelines:
        data.update(_data.vlm_data())
    base = {"data": data, "text": TEXT, "vlm": VLM, "target_tokens": None, "target_images": None, "warmup": 0.3}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "command": "python -m benchmarks.race " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "checkout": checkout(),
        "settings": {"text": TEXT, "vlm": VLM, "text_tokens": args.text_tokens, "vlm_images": args.vlm_images,
                     "repeats": args.repeats, "parallelism": args.parallelism},
        "data": {k: v for k, v in data.items() if k != "vlm_ids"},
        "bounds": [],
        "runs": [],
    }

    earlier = json.loads(Path(args.reuse_runs).read_text()) if args.reuse_runs else None
    if earlier is not None:
        for key in ("command", "date", "machine", "settings"):
            results[key] = earlier[key]
        # the runs' checkout, not this one's (unknown for a race.json from before it was recorded)
        results["checkout"] = earlier.get("checkout")
        results["runs"] = earlier["runs"]
        results["reused_from"] = args.reuse_runs
        if args.no_bound:
            results["bounds"] = earlier["bounds"]
        else:
            results["bounds_date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    def record_bound(got: dict, round_: int, **fields) -> None:
        got.update(round=round_, **fields)
        results["bounds"].append(got)
        if got.get("ok"):
            print(f"        {got['usable_tokens_per_s']:,.0f} usable tokens/s", flush=True)
        else:
            print(f"        FAILED: {got['output'][-800:]}", flush=True)

    def measure_bounds(round_: int, pipelines: list[str]) -> None:
        cores = len(os.sched_getaffinity(0))
        for pipeline in pipelines:
            for name, spec in BOUNDS.items():
                python = python_for(spec["venv"])
                if python is None:
                    continue
                for functions in spec["functions"]:
                    cfg = dict(base, pipeline=pipeline, functions=functions, repeats=4)
                    fields = dict(stack=spec["stack"], pipeline=pipeline, functions=functions)
                    print(f"[bound {round_ + 1}] {pipeline} {name} {functions}, one core ...", flush=True)
                    record_bound(run_worker(python, "bound.py", cfg, args.timeout, BOUND_ENV), round_, name=name, **fields)
                    variants = VARIANTS if functions in spec.get("variants", ()) else ()
                    for variant in variants:
                        label = variant_name(name, variant, cores)
                        print(f"[bound {round_ + 1}] {pipeline} {label} {functions} ...", flush=True)
                        if variant == "at once":
                            got = run_at_once(python, "bound.py", cfg, args.timeout, BOUND_ENV)
                        else:
                            got = run_worker(python, "bound.py", dict(cfg, idle_thread=True), args.timeout, BOUND_ENV)
                        record_bound(got, round_, name=label, variant=variant, **fields)

    venvs = {spec["venv"] for spec in loaders.values()} | {spec["venv"] for spec in BOUNDS.values()}
    for python in sorted(filter(None, map(python_for, venvs))):
        compile_sources(python)
    if earlier is not None and not args.no_bound:
        measure_bounds(0, args.pipelines)

    plan = []
    for pipeline in args.pipelines:
        for name, spec in loaders.items():
            if pipeline not in spec["pipelines"]:
                continue
            for config in spec["configs"]:
                for p in args.parallelism:
                    plan.append((pipeline, name, config, p))
    for round_ in range(0 if earlier is not None else args.repeats):
        measured = set()
        for pipeline, name, config, p in round_order(plan, round_):
            if not args.no_bound and pipeline not in measured:
                measure_bounds(round_, [pipeline])  # every round: the bound drifts with the machine as the runs do
                measured.add(pipeline)
            spec = loaders[name]
            python = python_for(spec["venv"])
            if python is None:
                print(f"[skip] {name}: no interpreter for {spec['venv']}", flush=True)
                continue
            cfg = dict(base, pipeline=pipeline, parallelism=p, **config)
            if pipeline == "text":
                cfg["target_tokens"] = args.text_tokens
            else:
                cfg["target_images"] = args.vlm_images
            label = f"{name} {config} p={p}"
            print(f"[{round_ + 1}/{args.repeats}] {pipeline:4s} {label} ...", end=" ", flush=True)
            load = os.getloadavg()[0]
            got = run_worker(python, spec["script"], cfg, args.timeout, spec.get("env"))
            got.update(load_average_before=load, loader=name, pipeline=pipeline, parallelism=p, config=config, round=round_,
                       stack=spec["stack"], family=spec["family"])
            results["runs"].append(got)
            if got.get("ok"):
                print(f"{got['usable_tokens_per_s']:>12,.0f} tok/s {got['images_per_s']:8.1f} img/s "
                      f"ttfb {got['time_to_first_batch_s']:.2f}s pss {got['peak_pss_bytes'] / 2**20:,.0f} MiB "
                      f"busy {got['cores_busy']:.2f} others {others_cores(got):.2f}", flush=True)
            else:
                print(f"FAILED rc={got.get('returncode')}\n{got['output'][-1500:]}", flush=True)
        (out_dir / "race.json").write_text(json.dumps(results, indent=1, default=str))

    from ._report import summarise

    results["summary"] = summarise(results)
    (out_dir / "race.json").write_text(json.dumps(results, indent=1, default=str))
    table = (out_dir / "race.md")
    from ._report import markdown

    table.write_text(markdown(results))
    print(table.read_text())
    if not args.no_plots:
        from ._plot import plot_all

        for path in plot_all(results, out_dir):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
