"""The race's pictures (matplotlib, PNG): throughput vs parallelism, and thread / process ratios."""

from __future__ import annotations

from pathlib import Path

STYLE = {
    "zephon thread 3.14t": ("#0b6e4f", "-", "o"),
    "zephon process 3.11": ("#0b6e4f", "--", "s"),
    "zephon thread 3.11": ("#0b6e4f", ":", "^"),
    "zephon thread 3.14t simd": ("#2ca02c", "-", "D"),
    "zephon process 3.11 simd": ("#2ca02c", "--", "d"),
    "grain 3.11": ("#1f77b4", "--", "s"),
    "grain-free-threading 3.14t": ("#1f77b4", "-", "o"),
    "zephon 0.2.0 3.11": ("#9467bd", "-", "v"),
    "torch DataLoader 3.11": ("#d62728", "-", "x"),
}


def plot_all(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    cores = summary["cores"]
    pipelines = sorted({e["pipeline"] for e in summary["best"]})
    paths = []

    fig, axes = plt.subplots(1, len(pipelines), figsize=(9 * len(pipelines), 4.8), squeeze=False)
    for ax, pipeline in zip(axes[0], pipelines):
        entries = [e for e in summary["best"] if e["pipeline"] == pipeline and e.get("usable_tokens_per_s")]
        loaders = []
        for e in entries:
            if e["loader"] not in loaders:
                loaders.append(e["loader"])
        for loader in loaders:
            pts = sorted((e["parallelism"], e["usable_tokens_per_s"]) for e in entries if e["loader"] == loader)
            colour, line, marker = STYLE.get(loader, ("grey", "-", "."))
            ax.plot([p for p, _ in pts], [v / 1e3 for _, v in pts], line, marker=marker, color=colour, label=loader)
        for b in summary["bounds"]:
            wanted = ("3.14t Pillow", "3.14t pillow-simd") if pipeline == "vlm" else ("3.14t Pillow",)
            if b["pipeline"] == pipeline and b["functions"] == "ours" and b["name"] in wanted:
                ax.axhline(b["usable_tokens_per_s"] * cores / 1e3, color="grey",
                           linestyle="-." if "simd" in b["name"] else ":", linewidth=1,
                           label=f"ideal, {b['name']} (bound × {cores} cores)")
        ax.set_title(f"{pipeline}: usable tokens/s per GPU-equivalent (one rank)")
        ax.set_xlabel("parallelism (workers per operator)")
        ax.set_ylabel("usable (non-padding) tokens/s, thousands")
        ax.set_xticks(sorted({e["parallelism"] for e in entries}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.05)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(f"Zephon vs peers, same data and work, {cores} CPUs ({results['date']})", fontsize=10)
    fig.tight_layout()
    path = out_dir / "race_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)

    ratios = summary["thread_vs_process"]
    if ratios:
        fig, axes = plt.subplots(1, len(pipelines), figsize=(6.5 * len(pipelines), 4.2), squeeze=False)
        for ax, pipeline in zip(axes[0], pipelines):
            rows = [r for r in ratios if r["pipeline"] == pipeline]
            ps = [r["parallelism"] for r in rows]
            width = 0.25
            for i, (metric, label) in enumerate((("usable_tokens_per_s", "throughput"),
                                                 ("peak_pss_bytes", "peak memory (PSS)"),
                                                 ("time_to_first_batch_s", "time to first batch"))):
                xs = [j + (i - 1) * width for j in range(len(rows))]
                ax.bar(xs, [r[metric] or 0 for r in rows], width, label=label)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(rows)), [f"p={p}" for p in ps])
            ax.set_title(f"{pipeline}: thread runner (3.14t) ÷ process runner (3.11)")
            ax.set_ylabel("ratio")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        path = out_dir / "race_thread_vs_process.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
