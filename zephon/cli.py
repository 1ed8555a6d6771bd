"""The `zephon` command: demos and barcode tools."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from typing import NoReturn


def usage_error(demo: str, message: str) -> NoReturn:
    """Refuse a demo's arguments as argparse refuses them: the message on stderr and exit code 2.

    A `SystemExit(message)` exits 1, the code the demos give a run whose batches differ
    ("MISMATCH"), so a script could not tell a typo in `--checkpoint-step` from a broken guarantee;
    argparse's own refusals (a count below 1) and `barcode compare`'s already exit 2."""
    print(f"zephon demo {demo}: {message}", file=sys.stderr)
    raise SystemExit(2)


def positive_int(text: str) -> int:
    """argparse type of a count (steps, ranks, workers, rows): a usage error below 1, instead of a
    demo that runs and then fails on an empty or impossible run."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def check_checkpoint_step(args: argparse.Namespace) -> None:
    """A demo that checkpoints and resumes needs its checkpoint inside the run, with steps after it
    to compare: refused, naming the options, before any work."""
    if not 0 < args.checkpoint_step < args.steps:
        usage_error(args.demo, f"--checkpoint-step must be in (0, --steps={args.steps}), got {args.checkpoint_step}")


def check_demo_layout(
    demo: str, *, runner, num_lanes: int, microbatch_size: int, world_sizes, global_batch_size: int
) -> None:
    """Refuse, naming it, a runner or a layout that the demo's loaders would refuse: before the demo
    does any work (a reference run paid for and thrown away, assets fetched) and without a traceback.

    The layout checks are the loader's (`check_layout`), said in the demo's terms: its lanes and
    microbatch are fixed, so the loader's advice, to choose another `num_lanes`, is no option here;
    the refusal says which world sizes and --global-batch-size the demo takes instead."""
    from ._errors import ConfigurationError
    from ._runner import runner_factory

    try:
        runner_factory(runner)
    except ConfigurationError as exc:
        usage_error(demo, str(exc))
    step_rows = num_lanes * microbatch_size
    takes = (f"this demo has {num_lanes} lanes taking microbatches of {microbatch_size} rows: world sizes must "
             f"divide {num_lanes} and --global-batch-size must be a multiple of {step_rows}")
    for world in world_sizes:
        if num_lanes % world:
            usage_error(demo, f"num_lanes={num_lanes} is not divisible by world_size={world}; {takes}")
    if global_batch_size % num_lanes:
        usage_error(demo, f"global_batch_size={global_batch_size} is not divisible by num_lanes={num_lanes}; {takes}")
    if global_batch_size % step_rows:
        usage_error(demo, f"global_batch_size={global_batch_size} gives {global_batch_size // num_lanes} rows per "
                          f"lane per step, not whole microbatches of {microbatch_size}; {takes}")


def describe_wait(wait: dict) -> str:
    """A demo's line for `stats()["wait"]` once a batch was handed over: how long its loop waited
    for data inside the loader's `next()` (a demo saves no state on another thread, which would
    be counted apart)."""
    return (f"waited for batches: {wait['total_s']:.2f} s inside next() for {wait['batches']} microbatches "
            f"(first {wait['first_s']:.2f} s, longest {wait['longest_s']:.3f} s, last {wait['last_s']:.3f} s)")


def check_resume_layout(demo: str, args: argparse.Namespace, pipeline) -> None:
    """`check_demo_layout` for a demo that checkpoints on `--from-world-size` ranks and resumes on
    each of `--to-world-sizes`, with `pipeline`'s lanes and microbatch."""
    check_demo_layout(demo, runner=args.runner, num_lanes=pipeline.settings.num_lanes,
                      microbatch_size=pipeline.microbatch_size,
                      world_sizes=(args.from_world_size, *args.to_world_sizes),
                      global_batch_size=args.global_batch_size)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zephon", description="Zephon: elastically deterministic data loading.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a demo on the shipped data").add_subparsers(dest="demo", required=True)
    text = demo.add_parser(
        "text", help="the text pipeline: tokenize → pack → shuffle → batch, with throughput",
        description="Run the text pipeline (tokenize → pack → shuffle → batch) on the shipped corpus on one "
                    "rank and print the runner, a few global batches' SHA-256, usable tokens/s, padding, "
                    "the time spent waiting for batches, and per dataset the records read and its share "
                    "of the tokens in the batches beside its weight. Exit codes: 0 after the run, 2 on options it cannot run.",
    )
    text.add_argument("--steps", type=positive_int, default=50, help="global steps to run (default 50)")
    text.add_argument("--runner", default="auto", help="inline | thread | process | auto (default)")
    text.add_argument("--parallelism", type=positive_int, default=2, help="tokenizer workers (default 2)")
    text.add_argument("--global-batch-size", type=positive_int, default=32, help="rows per global step (default 32)")

    elastic = demo.add_parser(
        "elastic", help="checkpoint on R ranks, resume on several R′ as separate processes, compare every step",
        description="Checkpoint on R ranks, resume on several R′ as separate processes, compare every "
                    "global step's SHA-256 with the uninterrupted run. Exit codes: 0 when every resumed "
                    "batch is identical, 1 on any mismatch, 2 on options it cannot run, 3 when a rank "
                    "process failed.",
    )
    elastic.add_argument("--steps", type=positive_int, default=24, help="global steps in the reference run (default 24)")
    elastic.add_argument("--checkpoint-step", type=positive_int, default=10, help="step at which to checkpoint (default 10)")
    elastic.add_argument("--from-world-size", type=positive_int, default=2, help="ranks before the checkpoint (default 2)")
    elastic.add_argument("--to-world-sizes", type=positive_int, nargs="+", default=[1, 4, 8],
                         help="rank counts to resume on (default 1 4 8)")
    elastic.add_argument("--runner", default="auto", help="inline | thread | process | auto (default)")
    elastic.add_argument("--parallelism", type=positive_int, default=1, help="tokenizer workers per rank (default 1)")
    elastic.add_argument("--global-batch-size", type=positive_int, default=32, help="rows per global step (default 32)")
    elastic.add_argument("--barcode-dir", help="also write each run's barcode (JSON Lines) into this directory")

    from .demo._gpu import add_gpu_parser, run_gpu_demo

    add_gpu_parser(demo).set_defaults(run_demo=run_gpu_demo)
    for entry in entry_points(group="zephon.demos"):  # demos of other packages (vlm), found, not imported
        try:  # a broken optional package must not take the whole CLI (barcode compare too) down
            entry.load()(demo)
        except Exception as exc:  # noqa: BLE001 - an import, a name already taken, a bug: said, not raised
            print(f"zephon: demo {entry.name!r} unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)

    barcode = sub.add_parser("barcode", help="compare per-step global-batch digests of two runs")
    bsub = barcode.add_subparsers(dest="barcode", required=True)
    exit_codes = ("0 when every step matches, 1 on any difference (a step whose digests differ, or "
                  "a step only one run has), 2 on a file that is missing or not a barcode, two that hold no "
                  "step (or a --png without matplotlib or that cannot be written)")
    compare = bsub.add_parser(
        "compare",
        help=f"name the first differing step; exit {exit_codes}",
        # the subcommand's own --help shows its description, not the help line above
        description=f"Compare two runs' barcodes step by step and name the first step that differs. "
                    f"Exit codes: {exit_codes}.",
    )
    compare.add_argument("a", help="barcode file (JSON Lines of {step, digest})")
    compare.add_argument("b", help="barcode file to compare with")
    compare.add_argument("--png", help="also draw both runs as a barcode picture (needs matplotlib)")
    return parser


def _barcode_compare(args) -> int:
    from .barcode import compare_barcodes, draw_barcodes, read_barcode

    if args.png:
        try:  # before comparing: a missing extra is a usage error, not a difference (exit 1)
            import matplotlib  # noqa: F401
        except ImportError:
            print("zephon barcode compare: --png needs matplotlib: pip install 'zephon[plot]'", file=sys.stderr)
            return 2
    try:
        a, b = read_barcode(args.a), read_barcode(args.b)
    except (OSError, ValueError) as exc:  # a missing file or a line that is not a barcode's
        print(f"zephon barcode compare: {exc}", file=sys.stderr)
        return 2
    if not (a or b):  # no step compared is no evidence: two runs that wrote nothing are not "identical"
        print(f"zephon barcode compare: neither {args.a} nor {args.b} holds a step: nothing to compare", file=sys.stderr)
        return 2
    result = compare_barcodes(a, b)
    if args.png:
        try:
            draw_barcodes(a, b, args.png, labels=(args.a, args.b))
        except (OSError, ValueError) as exc:  # a folder that is not there, a format matplotlib lacks
            # A traceback exits 1, the code of two runs that differ: this is a usage error.
            print(f"zephon barcode compare: cannot write --png {args.png}: {exc}", file=sys.stderr)
            return 2
    print(f"{len(result.common_steps)} common steps, {len(result.mismatched_steps)} differ")
    if result.only_in_a or result.only_in_b:
        # Counts, said as such and with the files: "steps only in A: 0" read as step 0, and A and
        # B were named nowhere.
        print(f"{len(result.only_in_a)} steps only in A ({args.a}), {len(result.only_in_b)} only in B ({args.b})")
    if result.identical:
        print("identical")
        return 0
    if result.mismatched_steps:
        print(f"first differing step: {result.first_mismatch}")
    for name, only in (("A", result.only_in_a), ("B", result.only_in_b)):
        if only:
            print(f"first step only in {name}: {only[0]}")
    return 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "barcode":
        return _barcode_compare(args)
    if hasattr(args, "run_demo"):
        return args.run_demo(args)
    if args.demo == "text":
        from .demo._text import run_text_demo

        return run_text_demo(args.steps, args.runner, args.parallelism, args.global_batch_size)
    from .demo._elastic import run_elastic_demo

    return run_elastic_demo(args)


if __name__ == "__main__":
    sys.exit(main())
