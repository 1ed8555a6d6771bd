"""`zephon demo vlm`: the vision-language pipeline on real image+caption pairs.

    WebDataset pairs (png + txt) → tokenize the caption (Pixtral Tekken) → decode_images
    (header now, pixels after packing) → pack_multimodal (Pixtral [IMG]/[IMG_BREAK]/[IMG_END]) →
    shuffle → batch

It prints the runner and why it was chosen, throughput in usable (non-padding) tokens/s and
images/s, the ledger, and draws one packed global batch as a PNG: one band per row, one column
per position (sampled down to at most 1,024 columns), coloured text / image placeholder / padding (alternating shades per document).

`vlm_pipeline` is the recipe; the VLM tests and benchmarks build theirs with it too. The data and
tokenizer come from `vlm._assets` (fetched and cached at run time, never shipped). The `zephon`
command finds this demo through the `zephon.demos` entry point (`add_vlm_parser`), so `zephon`
never imports `vlm`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zephon import ConfigurationError, Pipeline
from zephon._tokenizer import load_tokenizer
from zephon.cli import check_demo_layout, describe_wait, positive_int, usage_error
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

from ._assets import pair_shards, tekken_tokenizer
from ._image import ImageSpec, import_decoder
from ._placeholders import PixtralPlaceholders
from ._stages import require_decoder

__all__ = ["add_vlm_parser", "draw_batch", "placeholders_for", "position_kinds", "run_vlm_demo", "vlm_pipeline"]

# RGB of each kind of position in the picture: two shades each, alternating per document.
TEXT_COLOURS = ((52, 101, 164), (114, 159, 207))
IMAGE_COLOURS = ((206, 92, 0), (252, 175, 62))
PADDING_COLOUR = (211, 215, 207)

# The demo's layout, checked against --global-batch-size before any asset is fetched.
DEMO_LANES, DEMO_MICROBATCH = 8, 2


def placeholders_for(tokenizer: str | Path):
    """Pixtral's placeholder ids, looked up by name in the tokenizer that tokenizes the captions."""
    return PixtralPlaceholders.from_tokenizer(load_tokenizer(str(tokenizer)).tokenizer)


def vlm_pipeline(
    shards: str | Path | Dataset,
    tokenizer: str | Path,
    *,
    runner: Any = "auto",
    parallelism: int = 1,
    spec: Any = None,
    num_lanes: int = 8,
    max_length: int = 2048,
    microbatch_size: int = 2,
    records_per_chunk: int = 16,
    flush_every_chunks: int = 4,
    shuffle_buffer: int = 8,
    seed: int = 0,
    num_epochs: int | None = None,
    on_error: str = "skip",
    image_fields: tuple[str, ...] = ("png", "jpg"),
    defer: bool = False,
) -> Pipeline:
    """The VLM recipe on a directory of WebDataset shards of {png|jpg, txt} pairs, or on a Dataset
of them planned with options of its own (`Dataset.from_path("pairs", ..., scan_cache=DIR)`).

    `tokenizer` is a tokenizer.json or its directory with Pixtral's control tokens (`<s>`, `</s>`,
    `[IMG]`, `[IMG_BREAK]`, `[IMG_END]`; see `vlm._assets.tekken_tokenizer`). `spec` defaults to
    Pixtral sizing with the longest side at most 256 px. Each document is
    `<s> [image placeholders] caption </s>`. `parallelism` applies to tokenize and decode alike;
    `defer` decodes each image after packing, just before its row is taken (`vlm._deferred`).

    A second thread parses the tokenizer while this one scans the shards and then imports Pillow
    (`import_decoder`): the parse is most of the time to the first batch (Tekken's 131k tokens:
    0.75 s of 1.3 s, 3.14t at p=2, the thirty-third session's machine) and needs neither. The scan
    stays on the calling thread, the one a signal interrupts: Ctrl-C during a listing that does not
    end (a remote store retrying) stops it, where on a second thread it waited for the listing to
    end; the parse, in `tokenizers` until it returns, is not interruptible on any thread. The
    scan's error comes first, as when it ran first, and the parse is waited for before it
    propagates. On 3.14t the import mostly waits for the parse to end all the same (free-threaded
    CPython stops every thread for steps of an import and for a garbage collection, and the parse
    holds its thread in `tokenizers` until it returns); what it saves there is the first chunk's
    decoding threads waiting together on that import. On a GIL build the parse holds the GIL and
    nothing overlaps (3.11, process runner: first batch unchanged, medians 1.78 and 1.80 s).
    """
    spec = spec or ImageSpec.pixtral(max_side=256)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlm-recipe") as pool:
        # The instance `tokenize` and `placeholders_for` take from the cache.
        parsed = pool.submit(load_tokenizer, str(tokenizer))
        dataset = _scan_pairs(shards)
        parsed.result()
    source = StaticMixtureWorkSource([dataset], seed=seed, records_per_chunk=records_per_chunk,
                                     num_epochs=num_epochs)
    return (
        Pipeline(source)
        .options(num_lanes=num_lanes, runner=runner, flush_every_chunks=flush_every_chunks, on_error=on_error)
        .tokenize(str(tokenizer), field="txt", parallelism=parallelism, bos="<s>", eos="</s>")
        .decode_images(field=image_fields, spec=spec, parallelism=parallelism, defer=defer)
        .pack_multimodal(max_length, placeholders_for(tokenizer), image_position="after_bos")
        .shuffle(buffer_size=shuffle_buffer, seed=seed)
        .batch(microbatch_size)
    )


def _scan_pairs(shards: str | Path | Dataset) -> Dataset:
    dataset = shards if isinstance(shards, Dataset) else Dataset.from_path("pairs", str(shards), format="webdataset")
    if importlib.util.find_spec("PIL") is not None:  # else decode_images refuses, naming the package
        import_decoder()
    return dataset


def position_kinds(batch, placeholders) -> Any:
    """(rows, length) int8 for one microbatch: 0 text, 1 image placeholder, 2 padding."""
    import numpy as np

    kinds = np.where(batch.tokens["document_ids"] < 0, 2, 0).astype(np.int8)
    counts = batch.ragged_counts["image_grid"]
    row_of_image = np.repeat(np.arange(len(counts)), counts)
    for row, (rows, cols), at in zip(row_of_image, batch.ragged["image_grid"], batch.ragged["image_token_offset"]):
        kinds[row, at : at + placeholders.num_tokens(int(rows), int(cols))] = 1
    return kinds


def draw_batch(batches: list, path: str | Path, placeholders, *, row_height: int = 10,
               max_width: int = 1024) -> Path:
    """Draw the rows of `batches` (one global batch, in canonical order) as a PNG at `path`:
    one band per row, positions left to right (sampled down to `max_width` columns)."""
    import numpy as np
    from PIL import Image, ImageDraw

    bands = []
    for batch in sorted(batches, key=lambda b: (b.lane, b.index)):
        kinds = position_kinds(batch, placeholders)
        shade = batch.tokens["document_ids"] % 2
        rgb = np.empty(kinds.shape + (3,), np.uint8)
        for kind, colours in ((0, TEXT_COLOURS), (1, IMAGE_COLOURS)):
            for s in (0, 1):
                rgb[(kinds == kind) & (shade == s)] = colours[s]
        rgb[kinds == 2] = PADDING_COLOUR
        bands.append(rgb)
    rows = np.concatenate(bands, axis=0)
    num_rows, length = rows.shape[:2]
    width = min(length, max_width)
    columns = rows[:, (np.arange(width) * length) // width]
    picture = np.full((num_rows, row_height + 1, width, 3), 255, np.uint8)
    picture[:, :row_height] = columns[:, None]
    picture = picture.reshape(-1, width, 3)
    legend_height = 18
    canvas = Image.new("RGB", (width, picture.shape[0] + legend_height), (255, 255, 255))
    canvas.paste(Image.fromarray(picture), (0, legend_height))
    draw = ImageDraw.Draw(canvas)
    x = 4
    for label, colour in (("text", TEXT_COLOURS[0]), ("image", IMAGE_COLOURS[0]), ("padding", PADDING_COLOUR)):
        draw.rectangle((x, 4, x + 10, 14), fill=colour)
        draw.text((x + 14, 3), label, fill=(0, 0, 0))
        x += 24 + 7 * len(label)
    draw.text((x + 8, 3), f"{num_rows} rows x {length} positions", fill=(0, 0, 0))
    path = Path(path)
    canvas.save(path, "PNG")
    return path


def add_vlm_parser(demo_subparsers) -> Any:
    """Register `zephon demo vlm` on the `demo` sub-parsers; returns the new parser."""
    vlm = demo_subparsers.add_parser(
        "vlm", help="the VLM pipeline on real image+caption pairs: tokenize → decode → pack → shuffle → batch",
        description="Run the VLM pipeline (tokenize → decode → pack → shuffle → batch) on real image+caption "
                    "pairs, fetched and cached at the first run, on one rank; print the runner, usable "
                    "tokens/s, images/s, padding and the records read per dataset, and save a picture of "
                    "the first global batch. Exit codes: 0 after the run, 2 on options it cannot run, "
                    "without Pillow, or when the demo's pairs or tokenizer cannot be fetched.",
    )
    vlm.add_argument("--steps", type=positive_int, default=20, help="global steps to run (default 20)")
    vlm.add_argument("--runner", default="auto", help="inline | thread | process | auto (default)")
    vlm.add_argument("--parallelism", type=positive_int, default=2, help="decode and tokenize workers (default 2)")
    vlm.add_argument("--global-batch-size", type=positive_int, default=16, help="rows per global step (default 16)")
    vlm.add_argument("--max-length", type=positive_int, default=2048, help="tokens per packed row (default 2048)")
    vlm.add_argument("--max-side", type=positive_int, default=256,
                     help="scale each image's longest side down to this many pixels, then each side is "
                          "rounded up to whole 16 px patches (Pixtral sizing; default 256)")
    vlm.add_argument("--pairs", type=positive_int, default=None,
                     help=f"use this many pairs, at least {DEMO_LANES} (default: all)")
    vlm.add_argument("--origin", default="auto", choices=("auto", "tuxpaint", "photos"),
                     help="tuxpaint stamps (Debian, via apt), wheel photos, or auto (default)")
    vlm.add_argument("--png", default="vlm-batch.png", help="picture of the first global batch (default ./vlm-batch.png)")
    vlm.add_argument("--decode-before-packing", action="store_true",
                     help="decode images before packing (default: hold them encoded and decode each row "
                          "just before it is taken; same batches, less memory)")
    vlm.set_defaults(run_demo=run_vlm_demo)
    return vlm


def run_vlm_demo(args) -> int:
    check_demo_layout("vlm", runner=args.runner, num_lanes=DEMO_LANES, microbatch_size=DEMO_MICROBATCH,
                      world_sizes=(1,), global_batch_size=args.global_batch_size)
    if args.pairs is not None and args.pairs < DEMO_LANES:
        # The plan gives every lane a share of the pairs (dealt round-robin over one shard per
        # lane); fewer failed after the assets were fetched, advising fewer lanes, which the demo
        # has no option for.
        usage_error("vlm", f"--pairs must be at least {DEMO_LANES}, one per lane of the demo, got {args.pairs}")
    # The picture is saved after the assets are fetched and the first step taken: a directory that
    # is not there, or a --png naming a directory, ended the demo then, in a traceback.
    if Path(args.png).is_dir():
        usage_error("vlm", f"--png {args.png!r} is a directory: name the picture's file")
    if not Path(args.png).parent.is_dir():
        usage_error("vlm", f"--png {args.png!r}: no directory {str(Path(args.png).parent)!r} to write it in")
    try:
        require_decoder("PIL", "zephon demo vlm")  # before fetching the assets, not after
    except ConfigurationError as exc:
        print(exc, file=sys.stderr)
        return 2
    prepared = time.perf_counter()
    try:  # fetched at run time: apt that cannot reach Debian, pip without an index, end here
        pairs = pair_shards(8, args.pairs, origin=args.origin)
        tokenizer = tekken_tokenizer()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        usage_error("vlm", f"cannot get the demo's data (--origin {args.origin}): {exc}")
    print(f"data: {pairs.describe()}\n      {pairs.directory}")
    print(f"tokenizer: Pixtral Tekken (mistral-common tekken_240911.json) as {tokenizer / 'tokenizer.json'}")
    print(f"assets ready in {time.perf_counter() - prepared:.1f} s (cached after the first run)")
    placeholders = placeholders_for(tokenizer)
    pipeline = vlm_pipeline(pairs.directory, tokenizer, runner=args.runner, parallelism=args.parallelism,
                            spec=ImageSpec.pixtral(max_side=args.max_side), max_length=args.max_length,
                            defer=not args.decode_before_packing, num_lanes=DEMO_LANES,
                            microbatch_size=DEMO_MICROBATCH)
    started = time.perf_counter()
    try:  # a row too short for any image drops every pair: the lane says so, with the options to change
        with pipeline.shard(0, 1, global_batch_size=args.global_batch_size) as loader:
            info = loader.runner_info
            print(f"runner: {info['name']} ({info['reason']}); parallelism {args.parallelism}; "
                  f"lanes: {loader.num_lanes}; global batch: {args.global_batch_size} rows of {loader.row_length} tokens")
            per_step = len(loader.lanes) * loader.rows_per_step // loader.microbatch_size
            iterator = iter(loader)
            first_batch_s = None
            real = total = images = 0
            for step in range(args.steps):
                batches = [next(iterator) for _ in range(per_step)]
                if first_batch_s is None:
                    first_batch_s = time.perf_counter() - started
                    drawn = draw_batch(batches, args.png, placeholders)
                real += sum(b.num_real_tokens for b in batches)
                total += sum(b.tokens["input_ids"].size for b in batches)
                images += sum(len(b.ragged["image_grid"]) for b in batches)
            elapsed = time.perf_counter() - started
            stats = loader.stats()
    except ConfigurationError as exc:
        usage_error("vlm", f"{exc} (--max-length {args.max_length}, --max-side {args.max_side})")
    print(f"\n{args.steps} steps in {elapsed:.2f} s "
          f"(first global batch after {first_batch_s:.2f} s, planning included): "
          f"{real / elapsed:,.0f} usable tokens/s, {images / elapsed:,.1f} images/s, "
          f"padding {100 * (1 - real / total):.2f} %")
    print(describe_wait(stats["wait"]))
    for name, entry in stats["datasets"].items():
        t = entry["total"]
        print(f"records ({name}): read {t['read']}  emitted {t['emitted']}  filtered {t['filtered']}  "
              f"skipped {t['skipped'] or 0}")
    print(f"picture of step 0 (text / image / padding per position): {drawn}")
    return 0
