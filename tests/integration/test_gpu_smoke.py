"""The GPU smoke test (`zephon demo gpu`, SPEC §4): its whole path on the CPU with `--device cpu`,
and its clean skip where no CUDA device exists."""

from __future__ import annotations

import argparse
import re

import pytest

from zephon.demo._gpu import SKIP_NO_CUDA, add_gpu_parser, run_gpu_demo

pytestmark = pytest.mark.requires_torch


def gpu_demo(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="zephon demo")
    add_gpu_parser(parser.add_subparsers(dest="demo", required=True))
    return run_gpu_demo(parser.parse_args(["gpu", *argv]))


def test_without_cuda_the_demo_skips_with_exit_code_zero(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine that has one
    assert gpu_demo() == 0
    assert capsys.readouterr().out.strip() == SKIP_NO_CUDA


def test_on_cpu_training_resumed_on_another_rank_count_sees_identical_batches(capsys):
    code = gpu_demo(
        "--device", "cpu", "--steps", "5", "--checkpoint-step", "2", "--from-world-size", "2",
        "--to-world-sizes", "1", "--global-batch-size", "16", "--max-length", "64", "--dim", "32", "--layers", "1",
    )
    out = capsys.readouterr().out
    assert code == 0, out
    verdict = re.search(r"^2 → 1 +1 +2–4 +(\d+) +(\S+)  (\S+)$", out, re.MULTILINE)
    assert verdict, out
    mismatches, delta, word = int(verdict[1]), float(verdict[2]), verdict[3]
    assert (mismatches, word) == (0, "IDENTICAL")
    assert delta < 1e-3, "model and optimizer state did not survive the checkpoint"
    assert "RESULT: every resumed global batch is bit-identical" in out
    losses = [float(m) for m in re.findall(r"^ +\d+ +(\d+\.\d+)", out, re.MULTILINE)]
    assert len(losses) == 5 and losses[-1] < losses[0], out
