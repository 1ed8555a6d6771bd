"""`zephon demo gpu`: a tiny transformer trains on the demo stream, is checkpointed on R ranks and
resumed on R′; every later global batch must be bit-identical to the uninterrupted run's.

Data-parallel ranks are simulated in one process, honestly: each rank has its own `RankLoader`
that yields only its lanes; each rank's forward/backward adds its gradient into the shared
parameters, which is what an all-reduce(sum) of per-rank gradients computes (in a different
floating-point order). The checkpoint holds the model, the optimizer and the merged loader state
(a small JSON file), written to disk and read back for every resume.

The verdict is on the data: the SHA-256 of every global batch after the resume must equal the
uninterrupted run's. Losses are printed beside it; they agree closely but need not be bit-equal
across rank counts (SPEC §1: Zephon guarantees the data, not the arithmetic).

Without a GPU the demo skips with exit code 0; `--device cpu` runs the whole path on the CPU.
Without torch it says what to install and exits 2, as a demo does on options it cannot run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from .. import IGNORE_INDEX, global_batch_digest, merge_states
from ..cli import check_checkpoint_step, check_resume_layout, positive_int, usage_error
from ._recipe import TOKENIZER, demo_pipeline

__all__ = ["add_gpu_parser", "run_gpu_demo"]

SKIP_NO_CUDA = "skipped: no CUDA device (torch.cuda.is_available() is False)"


def add_gpu_parser(subparsers) -> argparse.ArgumentParser:
    """Add `gpu` to the `zephon demo` subcommands (the subparsers object of `demo`)."""
    gpu = subparsers.add_parser(
        "gpu", help="train a tiny transformer on the stream, checkpoint on R ranks, resume on R′, compare every step",
        description="The GPU smoke test: a tiny transformer trains on the demo stream on simulated ranks, is "
                    "checkpointed (model, optimizer, loader state) and resumed on other rank counts, and every "
                    "resumed global batch's SHA-256 is compared with the uninterrupted run's (needs torch). "
                    "Exit codes: 0 when every resumed batch is identical (or skipped: no CUDA device), 1 on any "
                    "mismatch, 2 on options it cannot run or without torch.",
    )
    gpu.add_argument("--device", default="cuda", help="cuda (default; skips without one), cuda:N or cpu")
    gpu.add_argument("--steps", type=positive_int, default=16, help="global steps in the uninterrupted run (default 16)")
    gpu.add_argument("--checkpoint-step", type=positive_int, default=6, help="step at which to checkpoint (default 6)")
    gpu.add_argument("--from-world-size", type=positive_int, default=2, help="ranks before the checkpoint (default 2)")
    gpu.add_argument("--to-world-sizes", type=positive_int, nargs="+", default=[4, 1], help="ranks to resume on (default 4 1)")
    gpu.add_argument("--global-batch-size", type=positive_int, default=32, help="rows per global step (default 32)")
    gpu.add_argument("--max-length", type=positive_int, default=256, help="tokens per row (default 256)")
    gpu.add_argument("--layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    gpu.add_argument("--dim", type=positive_int, default=128, help="model width (default 128)")
    gpu.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    gpu.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    gpu.add_argument("--seed", type=int, default=0, help="model initialisation seed (default 0)")
    gpu.add_argument("--runner", default="thread", help="inline | thread (default) | process | auto")
    return gpu


def run_gpu_demo(args: argparse.Namespace) -> int:
    # The options are checked before the skip and before torch is looked for: on a machine without
    # CUDA the demo exited 0 ("skipped") whatever they were, so a CPU CI job passed options that
    # fail on a GPU.
    check_checkpoint_step(args)
    if args.dim % args.heads:
        usage_error("gpu", f"--dim={args.dim} must be divisible by --heads={args.heads}")
    if not (math.isfinite(args.lr) and args.lr >= 0):  # AdamW's refusal, but as a traceback and on a GPU only
        usage_error("gpu", f"--lr must be a finite number >= 0, got {args.lr}")
    pipeline = demo_pipeline(runner=args.runner, max_length=args.max_length)
    check_resume_layout("gpu", args, pipeline)
    try:
        import torch
    except ImportError:  # a missing extra, not a missing GPU: "skipped" (exit 0) read as a pass
        print("zephon demo gpu needs torch, which is not installed: pip install 'zephon[torch]'", file=sys.stderr)
        return 2
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:  # "gpu", "cuda0": a usage error, named, not a traceback
        usage_error("gpu", f"--device {args.device!r} is not a torch device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(SKIP_NO_CUDA)
        return 0
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()  # torch's refusal came later, as a traceback
        usage_error("gpu", f"--device {args.device!r} names CUDA device {device.index}, but this machine has "
                           f"{count} (cuda:0 to cuda:{count - 1})")

    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    vocab = _vocab_size()
    with tempfile.TemporaryDirectory(prefix="zephon-gpu-") as tmp:
        checkpoint = Path(tmp)
        trainer = _Trainer(args, device, vocab)
        print(f"device: {device} ({name}); model: {args.layers} layers × {args.dim} wide, "
              f"{trainer.num_parameters / 1e6:.2f} M parameters; {pipeline.settings.num_lanes} lanes; "
              f"global batch {args.global_batch_size} × {args.max_length} tokens")
        print(f"uninterrupted: {args.steps} steps on {args.from_world_size} ranks, "
              f"checkpoint of model + optimizer + loader state at step {args.checkpoint_step}…")
        reference = trainer.run(pipeline, args.from_world_size, 0, args.steps, save_at=args.checkpoint_step, checkpoint=checkpoint)
        loader_bytes = (checkpoint / "loader.json").stat().st_size
        print(f"  loader state: {loader_bytes} bytes of JSON; model + optimizer: "
              f"{(checkpoint / 'train.pt').stat().st_size / 1e6:.1f} MB")
        resumed = {}
        for world in args.to_world_sizes:
            print(f"resume: steps {args.checkpoint_step}–{args.steps - 1} on {world} ranks from the checkpoint…")
            fresh = _Trainer(args, device, vocab)
            resumed[world] = fresh.run(pipeline, world, args.checkpoint_step, args.steps, load=checkpoint)

    source = args.from_world_size
    header = f"{'step':>4s}  {f'loss ({source} ranks)':>16s}" + "".join(f"  {f'{source} → {w}':>10s}" for w in resumed)
    print("\nloss curve\n" + header)
    for step in range(args.steps):
        row = f"{step:4d}  {reference['loss'][step]:16.4f}"
        for world, run in resumed.items():
            row += f"  {run['loss'][step]:10.4f}" if step in run["loss"] else f"  {'':>10s}"
        print(row + ("   ← checkpoint" if step == args.checkpoint_step else ""))

    print(f"\n{'run':14s} {'ranks':>5s} {'steps':>7s} {'data mismatches':>15s} {'max |Δloss|':>11s}  verdict")
    print(f"{'uninterrupted':14s} {source:5d} {f'0–{args.steps - 1}':>7s} {0:15d} {'':>11s}  reference")
    failed = False
    for world, run in resumed.items():
        steps = range(args.checkpoint_step, args.steps)
        mismatches = [s for s in steps if run["digest"][s] != reference["digest"][s]]
        delta = max(abs(run["loss"][s] - reference["loss"][s]) for s in steps)
        failed |= bool(mismatches)
        verdict = "IDENTICAL" if not mismatches else f"DIFFERENT from step {mismatches[0]}"
        print(f"{f'{source} → {world}':14s} {world:5d} {f'{steps[0]}–{steps[-1]}':>7s} {len(mismatches):15d} "
              f"{delta:11.2e}  {verdict}")
    first, last = reference["loss"][0], reference["loss"][args.steps - 1]
    print(f"\nloss {first:.3f} → {last:.3f} over {args.steps} steps ({time.perf_counter() - t0:.1f} s); "
          "losses may differ in the last bits across rank counts: Zephon guarantees the data, not the arithmetic")
    print("RESULT:", "every resumed global batch is bit-identical" if not failed else "MISMATCH")
    return 1 if failed else 0


def _vocab_size() -> int:
    from .._tokenizer import load_tokenizer

    return load_tokenizer(str(TOKENIZER)).tokenizer.get_vocab_size()


class _Trainer:
    """A model, its optimizer, and the loop over simulated data-parallel ranks."""

    def __init__(self, args: argparse.Namespace, device, vocab: int) -> None:
        import torch

        torch.manual_seed(args.seed)
        self.args, self.device = args, device
        self.model = _tiny_transformer(vocab, args.dim, args.layers, args.heads, args.max_length).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())

    def run(self, pipeline, world_size: int, first: int, stop: int, *, save_at=None, checkpoint=None, load=None) -> dict:
        import torch

        loaders = [pipeline.shard(r, world_size, global_batch_size=self.args.global_batch_size) for r in range(world_size)]
        try:
            if load is not None:
                saved = torch.load(load / "train.pt", map_location=self.device, weights_only=True)
                assert saved["step"] == first, f"checkpoint is of step {saved['step']}, not {first}"
                self.model.load_state_dict(saved["model"])
                self.optimizer.load_state_dict(saved["optimizer"])
                state = json.loads((load / "loader.json").read_text())
                for loader in loaders:
                    loader.load_state_dict(state)
            iterators = [iter(loader) for loader in loaders]
            per_rank = [len(loader.lanes) * loader.rows_per_step // loader.microbatch_size for loader in loaders]
            out: dict = {"digest": {}, "loss": {}}
            for step in range(first, stop):
                if step == save_at:
                    torch.save({"step": step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                               checkpoint / "train.pt")
                    state = merge_states(loader.state_dict() for loader in loaders)
                    (checkpoint / "loader.json").write_text(json.dumps(state))
                ranks = [[next(it) for _ in range(n)] for it, n in zip(iterators, per_rank)]
                assert all(b.step == step for batches in ranks for b in batches)
                out["digest"][step] = global_batch_digest(b for batches in ranks for b in batches)
                out["loss"][step] = self._train_step(ranks)
            return out
        finally:
            for loader in loaders:
                loader.close()

    def _train_step(self, ranks) -> float:
        import torch
        import torch.nn.functional as F

        self.optimizer.zero_grad(set_to_none=True)
        valid = sum(int((b.tokens["labels"] != IGNORE_INDEX).sum()) for batches in ranks for b in batches)
        total = 0.0
        for batches in ranks:  # one simulated rank at a time; its gradient adds into the shared .grad
            parts = [b.to_training() for b in batches]
            t = {k: torch.cat([p[k] for p in parts]).to(self.device, non_blocking=True)
                 for k in ("input_ids", "labels", "position_ids", "document_ids")}
            logits = self.model(t["input_ids"], t["position_ids"], t["document_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), t["labels"].flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / max(valid, 1)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return total


def _tiny_transformer(vocab: int, dim: int, layers: int, heads: int, max_length: int):
    """A pre-norm decoder: token + learned position embeddings (positions restart per document),
    attention masked to earlier tokens of the same document."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if dim % heads:  # run_gpu_demo checks its options first; this guards other callers
        raise ValueError(f"dim={dim} must be divisible by heads={heads}")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x, mask):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.proj(attended.transpose(1, 2).reshape(b, n, dim))
            return x + self.mlp(self.norm2(x))

    class TinyTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(max_length, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, input_ids, position_ids, document_ids):
            n = input_ids.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
            # Padding (document -1) attends to earlier padding: never an empty row, and its
            # labels are IGNORE_INDEX, so it adds nothing to the loss.
            mask = (causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]
            x = self.tokens(input_ids) + self.positions(position_ids)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.norm(x))

    return TinyTransformer()
