"""From the race's raw runs to medians, efficiencies, the issue-6 target checks and a table."""

from __future__ import annotations

import statistics
from collections import defaultdict

from .loaders import LOADERS, variant_name

# Each loader's "same-library" bound: the stateless work it really runs, on its interpreter and
# Pillow build ("ours" = Zephon's functions, "work" = the peers' plain equivalents).
BOUND_OF = {
    "zephon thread 3.14t": ("3.14t Pillow", "ours"),
    "zephon process 3.11": ("3.11 Pillow", "ours"),
    "zephon thread 3.11": ("3.11 Pillow", "ours"),
    "zephon thread 3.14t simd": ("3.14t pillow-simd", "ours"),
    "zephon process 3.11 simd": ("3.11 pillow-simd", "ours"),
    "grain 3.11": ("3.11 Pillow", "work"),
    "grain-free-threading 3.14t": ("3.14t Pillow", "work"),
    "zephon 0.2.0 3.11": ("3.11 Pillow", "work"),
    "torch DataLoader 3.11": ("3.11 Pillow", "work"),
}
METRICS = ("usable_tokens_per_s", "images_per_s", "time_to_first_batch_s", "peak_pss_bytes", "peak_rss_bytes",
           "peak_shm_bytes", "cores_busy", "cpu_s_per_usable_token", "cpu_s_per_image", "others_cores")
MiB = 2**20


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _median_bounds(measured: list[dict]) -> dict[tuple, dict]:
    """Per (pipeline, stack, functions): the measurement of the median round, with how many rounds
    measured it and their lowest and highest usable tokens/s (the bound drifts with the machine).

    Its rates are the rounds' median, the statistic a loader's rate is: with an even number of
    rounds, the mean of the middle two. The lower middle round's alone (its parts are the record's)
    put every loader's median rate over a bound biased low (two rounds: the slower round's bound),
    which raised the efficiencies, by up to 11 % in the two-round checks."""
    grouped = defaultdict(list)
    for b in measured:
        if b.get("ok"):
            grouped[(b["pipeline"], b["name"], b["functions"])].append(b)
    out = {}
    for key, found in grouped.items():
        found.sort(key=lambda b: b["usable_tokens_per_s"])
        rates = [b["usable_tokens_per_s"] for b in found]
        medians = {k: statistics.median(b[k] for b in found) for k in ("usable_tokens_per_s", "images_per_s")
                   if all(b.get(k) is not None for b in found)}
        out[key] = dict(found[(len(found) - 1) // 2], **medians, rounds=len(found), spread=(rates[0], rates[-1]))
    return out


def cpu_per_unit(run: dict) -> dict:
    """A run's CPU seconds (its whole process tree, steady window) per usable token and per image;
    None where the run did not record its CPU (races before the fifteenth session)."""
    cpu = run.get("steady_cpu_s")
    tokens, images = run.get("steady_usable_tokens"), run.get("steady_images")
    return {"cpu_s_per_usable_token": cpu / tokens if cpu is not None and tokens else None,
            "cpu_s_per_image": cpu / images if cpu is not None and images else None}


def others_cores(run: dict) -> float | None:
    """Cores' worth of CPU the rest of the machine took in a run's steady window: other processes
    (the race's own monitor among them) and the hypervisor's steal. None for runs recorded before
    the thirty-sixth session, which did not measure it."""
    others, stolen = run.get("others_cores_busy"), run.get("stolen_cores")
    return None if others is None else others + (stolen or 0.0)


def summarise(results: dict) -> dict:
    cores = results["machine"]["affinity"]
    bounds = _median_bounds(results["bounds"])
    round_bounds = {(b["pipeline"], b["name"], b["functions"], b.get("round")): b["usable_tokens_per_s"]
                    for b in results["bounds"] if b.get("ok")}
    grouped = defaultdict(list)
    for run in results["runs"]:
        key = (run["pipeline"], run["loader"], tuple(sorted(run["config"].items())), run["parallelism"])
        grouped[key].append(run)
    configs = {}
    for (pipeline, loader, config, p), runs in grouped.items():
        ok = [r for r in runs if r.get("ok")]
        entry = {"pipeline": pipeline, "loader": loader, "config": dict(config), "parallelism": p,
                 "runs": len(runs), "ok": len(ok)}
        ok = [dict(r, **cpu_per_unit(r), others_cores=others_cores(r)) for r in ok]
        for metric in METRICS:
            entry[metric] = _median(r.get(metric) for r in ok)
        entry["round_rates"] = sorted((r["round"], r["usable_tokens_per_s"]) for r in ok
                                      if r.get("round") is not None and r.get("usable_tokens_per_s"))
        if ok:
            entry["build"] = ok[0].get("build")
        configs.setdefault((pipeline, loader, p), []).append(entry)

    best = {}
    for (pipeline, loader, p), entries in configs.items():
        scored = [e for e in entries if e["usable_tokens_per_s"]]
        if not scored:
            best[(pipeline, loader, p)] = dict(entries[0], failed=True)
            continue
        top = max(scored, key=lambda e: e["usable_tokens_per_s"])
        top = dict(top, all_configs=[{"config": e["config"], "usable_tokens_per_s": e["usable_tokens_per_s"]}
                                     for e in entries])
        ref = BOUND_OF.get(loader)
        bound = bounds.get((pipeline, *ref)) if ref else None
        if bound:
            ideal = bound["usable_tokens_per_s"] * cores
            top["bound"] = {"name": ref[0], "functions": ref[1], "one_core_usable_tokens_per_s": bound["usable_tokens_per_s"],
                            "ideal_usable_tokens_per_s": ideal}
            top["efficiency"] = top["usable_tokens_per_s"] / ideal
            at_once = bounds.get((pipeline, variant_name(ref[0], "at once", cores), ref[1]))
            if at_once:
                # What the machine gives with every core busy, against cores x one core alone: the
                # part of a loader's shortfall that no loader can make up.
                top["bound"]["machine_scaling"] = at_once["usable_tokens_per_s"] / ideal
                top["efficiency_at_once"] = top["usable_tokens_per_s"] / at_once["usable_tokens_per_s"]
            threaded = bounds.get((pipeline, variant_name(ref[0], "idle thread", cores), ref[1]))
            if threaded:
                # The same work in a process that has a second thread: what a threaded loader's
                # allocations cost at best, against the single-threaded bound's.
                top["bound"]["threaded_malloc"] = threaded["usable_tokens_per_s"] / bound["usable_tokens_per_s"]
            # Each round's rate against the bound measured in that same round, minutes before it.
            top["round_efficiencies"] = [rate / (round_bounds[(pipeline, *ref, round_)] * cores)
                                         for round_, rate in top["round_rates"] if (pipeline, *ref, round_) in round_bounds]
            if top.get("cpu_s_per_usable_token"):
                # efficiency = (bound's CPU per token / the loader's) x (cores busy / cores), per run
                top["cpu_efficiency"] = 1.0 / bound["usable_tokens_per_s"] / top["cpu_s_per_usable_token"]
                top["busy"] = top["cores_busy"] / cores
                if bound.get("images_per_s"):
                    top["bound"]["cpu_s_per_image"] = 1.0 / bound["images_per_s"]
        best[(pipeline, loader, p)] = top

    rows = sorted(best.values(), key=lambda e: (e["pipeline"], list(LOADERS).index(e["loader"]) if e["loader"] in LOADERS else 99,
                                                 e["parallelism"]))
    summary = {"cores": cores, "best": rows,
               "bounds": [{k: b.get(k) for k in ("pipeline", "name", "functions", "usable_tokens_per_s", "images_per_s",
                                                  "parts", "seconds", "records", "rounds", "spread",
                                                  "fastest_pass_usable_tokens_per_s", "variant")} for b in bounds.values()]}
    summary["targets"] = targets(best, results)
    summary["thread_vs_process"] = ratios(best, results)
    return summary


def _get(best, pipeline, loader, p, metric):
    e = best.get((pipeline, loader, p))
    return None if e is None or e.get("failed") else e.get(metric)


def targets(best: dict, results: dict, p: int = 2) -> list[dict]:
    """The issue-6 targets at parallelism `p`, each with the measured value and met / missed."""
    out = []
    pipelines = sorted({k[0] for k in best})
    peers = [name for name, spec in LOADERS.items() if spec["family"] == "peer"]
    for pipeline in pipelines:
        ours = best.get((pipeline, "zephon thread 3.14t", p))
        if ours and not ours.get("failed"):
            out.append(_efficiency_target(pipeline, "thread 3.14t >= 0.97 of the same-library bound", ours, 0.97))
            peer_best = max(((n, _get(best, pipeline, n, p, "usable_tokens_per_s") or 0) for n in peers),
                            key=lambda x: x[1], default=(None, 0))
            if peer_best[1]:  # a check that raced no peer has no verdict on this one
                value = ours["usable_tokens_per_s"] / peer_best[1]
                out.append({"pipeline": pipeline, "target": f"thread 3.14t beats every peer's best (best: {peer_best[0]})",
                            "value": value, "met": value > 1.0})
            ttfb = ours.get("time_to_first_batch_s")
            out.append({"pipeline": pipeline, "target": "thread 3.14t time to first batch <= 1 s", "value": ttfb,
                        "met": ttfb is not None and ttfb <= 1.0})
            mem = ours.get("peak_pss_bytes")
            z020 = _get(best, pipeline, "zephon 0.2.0 3.11", p, "peak_pss_bytes")
            grain = min([m for m in (_get(best, pipeline, "grain 3.11", p, "peak_pss_bytes"),
                                     _get(best, pipeline, "grain-free-threading 3.14t", p, "peak_pss_bytes")) if m] or [None],
                        key=lambda m: m or 0)
            if mem and z020:
                out.append({"pipeline": pipeline, "target": "thread 3.14t peak memory (PSS) <= half of zephon 0.2.0",
                            "value": mem / z020, "met": mem <= z020 / 2, "digits": 3})
            if mem and grain:
                out.append({"pipeline": pipeline, "target": "thread 3.14t peak memory (PSS) <= grain's",
                            "value": mem / grain, "met": mem <= grain, "digits": 3})
        proc = best.get((pipeline, "zephon process 3.11", p))
        if proc and not proc.get("failed") and proc.get("efficiency") is not None:
            out.append(_efficiency_target(pipeline, "process 3.11 >= 0.9 of the bound", proc, 0.9))
        simd = best.get((pipeline, "zephon thread 3.14t simd", p))
        if pipeline == "vlm" and simd and not simd.get("failed"):
            peer_best = max((_get(best, pipeline, n, p, "usable_tokens_per_s") or 0) for n in peers)
            value = simd["usable_tokens_per_s"] / peer_best if peer_best else None
            # The peers run stock Pillow, and pillow-simd is a drop-in for any Pillow user: what the
            # decode library alone buys is the ratio of the two same-stack bounds, which a peer on
            # pillow-simd would gain as well. Shown beside the verdict, so that the ratio is not
            # read as the loader's.
            plain = best.get((pipeline, "zephon thread 3.14t", p)) or {}
            simd_bound = (simd.get("bound") or {}).get("one_core_usable_tokens_per_s")
            plain_bound = (plain.get("bound") or {}).get("one_core_usable_tokens_per_s")
            out.append({"pipeline": pipeline,
                        "target": "thread 3.14t with pillow-simd >= 1.3x the best peer (VLM; the peers on stock Pillow)",
                        "value": value, "met": value is not None and value >= 1.3,
                        "stack_ratio": simd_bound / plain_bound if simd_bound and plain_bound else None})
    return out


def _efficiency_target(pipeline: str, target: str, entry: dict, least: float) -> dict:
    """An efficiency target, met only when both statistics reach it: the median rate against the
    median bound, and the median of each round's rate against its own round's bound. The two come
    apart when the machine's speed moves between rounds (a median rate from one round, the median
    bound from another), and a verdict that only one of them gives is not one."""
    eff, rounds = entry.get("efficiency"), entry.get("round_efficiencies") or []
    met = eff is not None and eff >= least and (not rounds or statistics.median(rounds) >= least)
    bound = entry.get("bound", {})
    return {"pipeline": pipeline, "target": target, "value": eff, "rounds": rounds, "met": met,
            "at_once": entry.get("efficiency_at_once"), "machine_scaling": bound.get("machine_scaling"),
            "threaded_malloc": bound.get("threaded_malloc")}


def ratios(best: dict, results: dict) -> list[dict]:
    out = []
    for (pipeline, loader, p), e in sorted(best.items()):
        if loader != "zephon thread 3.14t" or e.get("failed"):
            continue
        proc = best.get((pipeline, "zephon process 3.11", p))
        if not proc or proc.get("failed"):
            continue
        row = {"pipeline": pipeline, "parallelism": p}
        for metric in ("usable_tokens_per_s", "peak_pss_bytes", "time_to_first_batch_s"):
            a, b = e.get(metric), proc.get(metric)
            row[metric] = a / b if a and b else None
        out.append(row)
    return out


def _fmt(value, kind):
    if value is None:
        return "—"
    if kind == "tok":
        return f"{value / 1e3:,.0f} k"
    if kind == "img":
        return f"{value:,.0f}"
    if kind == "s":
        return f"{value:.2f}"
    if kind == "mib":
        return f"{value / MiB:,.0f}"
    if kind == "x":
        return f"{value:.2f}"
    if kind == "ms":
        return f"{value:.3f}"
    return str(value)


def _cpu_table(pipeline: str, entries: list[dict], cores: int) -> list[str]:
    """Where each loader's efficiency at p=2 goes: the CPU it spent per token against the bound's,
    and how busy it kept the cores (their product is the efficiency, run by run)."""
    entries = [e for e in entries if e.get("cpu_efficiency") is not None]
    if not entries:
        return []
    vlm = pipeline == "vlm"
    lines = [f"Where the efficiency goes at p=2: efficiency = CPU efficiency (the bound's CPU per usable token ÷ "
             f"the loader's, all its threads and processes over the steady window) × busy (cores busy ÷ {cores}). "
             "Medians of the rounds, so the product can differ from the efficiency in the last digit. "
             "'Others' cores' is what the rest of the machine took meanwhile (other processes, the race's monitor "
             "among them, and the hypervisor's steal), a run's own noise:", ""]
    head = ["loader", "efficiency", "CPU efficiency", "busy", "cores busy", "others' cores"]
    if vlm:
        head += ["CPU ms per image", "bound's ms per image"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---|" + "---:|" * (len(head) - 1))
    for e in entries:
        cells = [e["loader"], _fmt(e.get("efficiency"), "x"), _fmt(e["cpu_efficiency"], "x"), _fmt(e["busy"], "x"),
                 _fmt(e["cores_busy"], "x"), _fmt(e.get("others_cores"), "x")]
        if vlm:
            per_image, bound = e.get("cpu_s_per_image"), e["bound"].get("cpu_s_per_image")
            cells += [_fmt(per_image * 1e3 if per_image else None, "ms"), _fmt(bound * 1e3 if bound else None, "ms")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _checkout_line(checkout: dict | None) -> str:
    if not checkout or not checkout.get("commit"):
        return ""
    modified = ", with tracked files modified" if checkout.get("dirty") else ""
    return f" Commit: {checkout['commit'][:12]}{modified}."


# configure options that move an interpreter's speed, shown beside its build
CONFIGURE_FLAGS = ("--enable-optimizations", "--with-lto", "--enable-shared", "--disable-gil")


def _builds_table(best: list[dict]) -> list[str]:
    """Each loader's interpreter build and library versions, as its runs reported them."""
    builds = {}
    for e in best:
        if e.get("build") and e["loader"] not in builds:
            builds[e["loader"]] = e["build"]
    if not builds:
        return []
    lines = ["### Builds (as each loader's runs reported them)", "",
             "| loader | Python | build | libraries |", "|---|---|---|---|"]
    for loader, build in builds.items():
        kind = "free-threaded" if build.get("free_threaded") else "GIL"
        if "configure" in build:  # races since the twenty-fifth session: what the interpreter was built with
            kind += "; " + (", ".join(flag for flag in CONFIGURE_FLAGS if flag in build["configure"]) or "no PGO, no LTO")
        libraries = ", ".join(f"{name} {version}" for name, version in (build.get("versions") or {}).items()) or "—"
        lines.append(f"| {loader} | {build.get('python', '—')} | {kind} | {libraries} |")
    lines.append("")
    return lines


def markdown(results: dict) -> str:
    summary = results.get("summary") or summarise(results)
    ps = sorted({e["parallelism"] for e in summary["best"]})
    lines = []
    m = results["machine"]
    lines.append(f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), load average at start {m['load_average_at_start'][0]:.2f}; "
                 f"{results['settings']['repeats']} rounds, medians. Command: `{results['command']}`."
                 + _checkout_line(results.get("checkout")))
    lines.append("")
    for pipeline in sorted({e["pipeline"] for e in summary["best"]}):
        lines.append(f"### {pipeline}: usable tokens/s by parallelism (best configuration of each loader)")
        lines.append("")
        head = ["loader"] + [f"p={p}" for p in ps] + ["eff. @2", "img/s @2", "first batch s @2", "PSS MiB @2",
                                                       "RSS MiB @2", "shm MiB @2", "best config @2"]
        if pipeline != "vlm":
            head.remove("img/s @2")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + "|")
        loaders = []
        for e in summary["best"]:
            if e["pipeline"] == pipeline and e["loader"] not in loaders:
                loaders.append(e["loader"])
        by = {(e["loader"], e["parallelism"]): e for e in summary["best"] if e["pipeline"] == pipeline}
        for loader in loaders:
            at2 = by.get((loader, 2), {})
            cells = [loader] + [_fmt(by.get((loader, p), {}).get("usable_tokens_per_s"), "tok") for p in ps]
            cells.append(_fmt(at2.get("efficiency"), "x"))
            if pipeline == "vlm":
                cells.append(_fmt(at2.get("images_per_s"), "img"))
            cells += [_fmt(at2.get("time_to_first_batch_s"), "s"), _fmt(at2.get("peak_pss_bytes"), "mib"),
                      _fmt(at2.get("peak_rss_bytes"), "mib"), _fmt(at2.get("peak_shm_bytes"), "mib"),
                      ", ".join(f"{k}={v}" for k, v in at2.get("config", {}).items()) or "—"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        bound_rows = [b for b in summary["bounds"] if b["pipeline"] == pipeline]
        about = ("Compute bound (one core, tight loop, each part's mean pass, the median of the rounds' measurements; "
                 "ideal = × {0} cores; the fastest pass beside it, as races before the twelfth session counted)")
        if any(b.get("variant") for b in bound_rows):
            about += (". A row '×{0} at once' is {0} copies of the bound run together, one pinned to each core, their "
                      "rates added: what this machine gives with every core busy; a row 'idle thread beside it' is "
                      "one copy in a process that has started a second thread, which takes glibc's malloc off its "
                      "single-threaded fast path as in any threaded loader")
        lines.append(about.format(summary["cores"]) + ":")
        lines.append("")
        lines.append("| stack | functions | usable tokens/s (1 core) | rounds: lowest–highest | fastest pass | images/s (1 core) "
                     "| parts (s per epoch) |")
        lines.append("|---|---|---:|---:|---:|---:|---|")
        for b in bound_rows:
            parts = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in (b.get("parts") or {}).items())
            low, high = b.get("spread") or (b["usable_tokens_per_s"],) * 2
            lines.append(f"| {b['name']} | {b['functions']} | {_fmt(b['usable_tokens_per_s'], 'tok')} | "
                         f"{b.get('rounds', 1)}: {_fmt(low, 'tok')}–{_fmt(high, 'tok')} | "
                         f"{_fmt(b.get('fastest_pass_usable_tokens_per_s'), 'tok')} | "
                         f"{_fmt(b.get('images_per_s') or None, 'img')} | {parts} |")
        lines.append("")
        lines += _cpu_table(pipeline, [by[(loader, 2)] for loader in loaders if (loader, 2) in by], summary["cores"])
    if summary["thread_vs_process"]:
        lines.append("### Thread runner on 3.14t ÷ process runner on 3.11")
        lines.append("")
        lines.append("| pipeline | p | throughput | peak memory (PSS) | time to first batch |")
        lines.append("|---|---:|---:|---:|---:|")
        for r in summary["thread_vs_process"]:
            lines.append(f"| {r['pipeline']} | {r['parallelism']} | {_fmt(r['usable_tokens_per_s'], 'x')} | "
                         f"{_fmt(r['peak_pss_bytes'], 'x')} | {_fmt(r['time_to_first_batch_s'], 'x')} |")
        lines.append("")
    if summary["targets"]:
        lines.append("### Issue 6 targets at parallelism 2")
        lines.append("")
        lines.append("Efficiency targets are met only when the median rate against the median bound and the median of "
                     "the rounds' own ratios (each round's rate against that round's bound, given in brackets) both "
                     "reach them.")
        lines.append("")
        lines.append("| pipeline | target | measured | met |")
        lines.append("|---|---|---:|---|")
        for t in summary["targets"]:
            # memory ratios with a third digit: 0.504 of zephon 0.2.0's misses "half", which 0.50 hides
            measured = "—" if t["value"] is None else f"{t['value']:.{t.get('digits', 2)}f}"
            if t.get("rounds"):
                measured += " (rounds " + " / ".join(_fmt(r, "x") for r in t["rounds"]) + ")"
            if t.get("at_once") is not None:
                measured += (f"; {_fmt(t['at_once'], 'x')} of the bound run on every core at once, which is "
                             f"{_fmt(t['machine_scaling'], 'x')} of the ideal")
            if t.get("stack_ratio") is not None:
                measured += (f"; pillow-simd alone makes the bound {_fmt(t['stack_ratio'], 'x')}x as fast, "
                             "which a peer on pillow-simd would gain too")
            if t.get("threaded_malloc") is not None:
                measured += f"; the bound with an idle thread beside it runs at {_fmt(t['threaded_malloc'], 'x')}"
            lines.append(f"| {t['pipeline']} | {t['target']} | {measured} | {'yes' if t['met'] else '**no**'} |")
        lines.append("")
    lines += _builds_table(summary["best"])
    return "\n".join(lines)
