"""`zephon demo …` refuses arguments it cannot run, naming them, before it does any work.

A count of zero steps used to end `demo text` and `demo vlm` in a TypeError after the run, and a
checkpoint step past the end (or a world size the demo's 8 lanes do not divide) ended `demo
elastic` in a KeyError or in failing rank processes after the reference run had been paid for.
"""

from __future__ import annotations

import re

import pytest

from zephon import cli
from zephon.demo import _elastic


def parse_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == 2, "argparse's usage error"
    return capsys.readouterr().err


def refused(capsys, *argv: str) -> str:
    """What a demo said on stderr when it refused its arguments, asserting it exited 2, the code of
    every usage error (argparse's, `barcode compare`'s): exit 1 is the demos' verdict "MISMATCH"."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == 2, f"a usage error must exit 2, not {exc.value.code!r} (1 reads as a mismatch)"
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ("demo", "text", "--steps", "0"),
        ("demo", "text", "--global-batch-size", "-8"),
        ("demo", "text", "--parallelism", "0"),
        ("demo", "elastic", "--steps", "0"),
        ("demo", "elastic", "--from-world-size", "0"),
        ("demo", "elastic", "--checkpoint-step", "0"),
        ("demo", "elastic", "--to-world-sizes", "4", "0"),
        ("demo", "gpu", "--steps", "0"),
        ("demo", "vlm", "--steps", "0"),
        ("demo", "vlm", "--pairs", "0"),
    ],
)
def test_a_count_below_one_is_a_usage_error_naming_the_option(capsys, argv):
    err = parse_error(capsys, *argv)
    option = next(a for a in argv if a.startswith("--"))
    assert f"argument {option}" in err and "must be an integer >= 1" in err


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if the demo starts any rank process."""
    def refuse(*args, **kwargs):
        raise AssertionError("the demo ran ranks before checking its arguments")

    monkeypatch.setattr(_elastic, "_run_ranks", refuse)


def test_elastic_barcode_dir_that_cannot_be_a_directory_is_refused_before_any_rank_runs(no_ranks, tmp_path, capsys):
    """A file in its place ended the demo in a traceback after every run had been paid for."""
    taken = tmp_path / "barcodes"
    taken.write_text("not a directory")
    assert re.search("--barcode-dir .* is no directory one can write", refused(capsys, "demo", "elastic", "--barcode-dir", str(taken)))


@pytest.mark.parametrize("checkpoint_step", ["24", "30"])
def test_elastic_checkpoint_step_outside_the_run_is_refused_before_any_rank_runs(no_ranks, checkpoint_step, capsys):
    """`--checkpoint-step 0` was argparse's usage error (exit 2) and `--checkpoint-step 30` exited 1,
    the code the demo gives a run whose resumed batches differ."""
    err = refused(capsys, "demo", "elastic", "--steps", "24", "--checkpoint-step", checkpoint_step)
    assert f"zephon demo elastic: --checkpoint-step must be in (0, --steps=24), got {checkpoint_step}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--to-world-sizes", "1", "3"], "num_lanes=8 is not divisible by world_size=3"),
        (["--from-world-size", "16"], "num_lanes=8 is not divisible by world_size=16"),
        (["--global-batch-size", "12"], "global_batch_size=12 is not divisible by num_lanes=8"),
    ],
)
def test_elastic_layout_that_cannot_split_is_refused_before_any_rank_runs(no_ranks, argv, message, capsys):
    assert message in refused(capsys, "demo", "elastic", *argv)


def test_elastic_demo_rewrites_the_barcodes_of_an_earlier_run_in_the_same_directory(monkeypatch, tmp_path, capsys):
    """BarcodeWriter appends (a resumed run continues its file); the demo's files are each a whole
    run, so a second demo into the same --barcode-dir must not append to the first one's."""
    from zephon.barcode import read_barcode

    def fake_ranks(workdir, tag, world_size, start, stop, state, args):
        return {"digests": {s: f"{args.global_batch_size:064x}" for s in range(start, stop)}, "state": {"num_lanes": 8}}

    monkeypatch.setattr(_elastic, "_run_ranks", fake_ranks)
    for batch in ("32", "64"):
        argv = ["demo", "elastic", "--steps", "4", "--checkpoint-step", "2", "--to-world-sizes", "4",
                "--global-batch-size", batch, "--barcode-dir", str(tmp_path)]
        assert cli.main(argv) == 0
    capsys.readouterr()
    for name in ("reference.jsonl", "resume-2-to-4.jsonl"):
        assert read_barcode(tmp_path / name) == {s: f"{64:064x}" for s in range(4)}
        assert len((tmp_path / name).read_text().splitlines()) == 4


def test_elastic_demo_exits_3_when_a_rank_process_crashes_not_1_which_means_a_mismatch(monkeypatch, capsys):
    """A crashed rank ended the demo with SystemExit(message), exit code 1: the code of its verdict
    "MISMATCH", so a script read a crash (an OOM kill, a missing extra) as a broken guarantee. It
    now exits 3, naming the run and the ranks that failed."""
    import subprocess
    import sys

    popen = subprocess.Popen

    def crashing_rank(argv, **kwargs):
        return popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(_elastic.subprocess, "Popen", crashing_rank)
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "elastic", "--steps", "4", "--checkpoint-step", "2", "--to-world-sizes", "4"])
    assert exc.value.code == 3
    assert "reference: ranks [0, 1] failed" in capsys.readouterr().err


def test_elastic_demo_exits_3_when_a_rank_hands_over_no_part_of_a_step_rather_than_comparing_the_rest(
        monkeypatch, capsys):
    """A rank process that exited 0 with its part of a step missing from its result: the digests
    of the other ranks' microbatches were combined unchecked and compared as that step's. The
    demo checks each step as global_batch_digest does and exits 3 (a rank failed), naming what
    the step lacks, not 1 (MISMATCH) nor 0."""
    import json
    import subprocess

    popen = subprocess.Popen

    class RankLosingItsFirstStep:
        def __init__(self, argv, **kwargs):
            self.job = json.loads(open(argv[-1]).read())
            self.process = popen(argv, **kwargs)

        def wait(self):
            code = self.process.wait()
            if self.job["rank"] == 1:
                with open(self.job["output"]) as f:
                    result = json.load(f)
                del result["digests"][str(self.job["start"])]
                with open(self.job["output"], "w") as f:
                    json.dump(result, f)
            return code

    monkeypatch.setattr(_elastic.subprocess, "Popen", RankLosingItsFirstStep)
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "elastic", "--steps", "2", "--checkpoint-step", "1", "--to-world-sizes", "4"])
    assert exc.value.code == 3
    assert re.search(r"reference: step 0 lacks microbatches \(lane, index\) \[\(4, 0\), ", capsys.readouterr().err)


@pytest.fixture
def no_demo_work(monkeypatch, no_ranks):
    """Fail the test if any demo starts its work: ranks, a training run, a loader, or the VLM assets."""
    import vlm._demo
    from zephon import Pipeline
    from zephon.demo import _gpu

    def refuse(*args, **kwargs):
        raise AssertionError("the demo started its work before checking its arguments")

    monkeypatch.setattr(_gpu, "_Trainer", refuse)
    monkeypatch.setattr(Pipeline, "shard", refuse)
    monkeypatch.setattr(vlm._demo, "pair_shards", refuse)


@pytest.mark.parametrize("demo", ["text", "elastic", pytest.param("gpu", marks=pytest.mark.requires_torch), "vlm"])
def test_a_batch_size_the_demos_lanes_refuse_is_named_with_what_the_demo_can_take(no_demo_work, demo, capsys):
    """The refusal advised choosing num_lanes, which no demo has an option for: the user learnt
    what was wrong but not which --global-batch-size the demo would take."""
    argv = ["--global-batch-size", "24"] + (["--device", "cpu"] if demo == "gpu" else [])
    err = " ".join(refused(capsys, "demo", demo, *argv).split())
    assert "this demo has 8 lanes taking microbatches of 2 rows" in err
    assert "--global-batch-size must be a multiple of 16" in err


@pytest.mark.parametrize("demo", ["elastic", pytest.param("gpu", marks=pytest.mark.requires_torch)])
def test_a_world_size_the_demos_lanes_refuse_is_named_with_what_the_demo_can_take(no_demo_work, demo, capsys):
    argv = ["--to-world-sizes", "3"] + (["--device", "cpu"] if demo == "gpu" else [])
    err = " ".join(refused(capsys, "demo", demo, *argv).split())
    assert "this demo has 8 lanes" in err and "world sizes must divide 8" in err
    assert "choose num_lanes" not in err, "advice the demo has no option for"


@pytest.mark.parametrize("demo", ["text", "elastic", pytest.param("gpu", marks=pytest.mark.requires_torch), "vlm"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--runner", "bogus"], "unknown runner 'bogus'"),
        (["--global-batch-size", "12"], "global_batch_size=12 is not divisible by num_lanes=8"),
    ],
)
def test_a_runner_or_batch_the_loaders_refuse_is_named_before_any_work(no_demo_work, demo, argv, message, capsys):
    """`--runner bogus` used to fail every rank process of `demo elastic` after it had started them,
    and `demo gpu --to-world-sizes 3` after the whole uninterrupted training run; the other demos
    ended in a traceback."""
    if demo == "gpu":
        argv = [*argv, "--device", "cpu"]
    assert f"zephon demo {demo}: {message}" in refused(capsys, "demo", demo, *argv)


@pytest.mark.requires_torch
def test_gpu_demo_refuses_a_world_size_the_lanes_do_not_divide_before_training(no_demo_work, capsys):
    err = refused(capsys, "demo", "gpu", "--device", "cpu", "--to-world-sizes", "4", "3")
    assert "zephon demo gpu: num_lanes=8 is not divisible by world_size=3" in err


@pytest.mark.requires_torch
def test_gpu_demo_names_a_device_that_is_not_a_torch_device(no_demo_work, capsys):
    """`--device gpu` ended in torch's RuntimeError traceback."""
    assert "zephon demo gpu: --device 'gpu' is not a torch device" in refused(capsys, "demo", "gpu", "--device", "gpu")


@pytest.mark.requires_torch
def test_gpu_demo_refuses_a_width_its_heads_do_not_divide_as_a_usage_error(capsys):
    err = refused(capsys, "demo", "gpu", "--device", "cpu", "--dim", "100", "--heads", "3", "--steps", "2",
                  "--checkpoint-step", "1")
    assert "zephon demo gpu: --dim=100 must be divisible by --heads=3" in err


@pytest.mark.parametrize("missing", ["cuda", "torch"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "4", "--checkpoint-step", "6"], "--checkpoint-step must be in (0, --steps=4), got 6"),
        (["--to-world-sizes", "3"], "num_lanes=8 is not divisible by world_size=3"),
        (["--dim", "100", "--heads", "3"], "--dim=100 must be divisible by --heads=3"),
        # AdamW refuses these with a traceback (exit 1, a mismatch's code), on a GPU machine only.
        (["--lr", "-0.1"], "--lr must be a finite number >= 0, got -0.1"),
        (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    ],
)
def test_gpu_demo_refuses_options_it_cannot_run_where_it_would_skip(monkeypatch, capsys, missing, argv, message):
    """Without CUDA (or torch) the demo said "skipped" and exited 0 before looking at its options:
    a CI job on a CPU machine passed with options that fail on the first GPU machine."""
    import sys

    if missing == "torch":
        monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    else:
        torch = pytest.importorskip("torch")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert f"zephon demo gpu: {message}" in refused(capsys, "demo", "gpu", *argv)


@pytest.mark.parametrize(
    ("demo", "codes"),
    [
        ("gpu", "Exit codes: 0 when every resumed batch is identical (or skipped: no CUDA device), 1 on "
                "any mismatch, 2 on options it cannot run or without torch."),
        ("text", "Exit codes: 0 after the run, 2 on options it cannot run."),
        ("vlm", "Exit codes: 0 after the run, 2 on options it cannot run, without Pillow, or when the "
                "demo's pairs or tokenizer cannot be fetched."),
    ],
)
def test_demo_help_says_what_the_demo_does_and_lists_its_exit_codes(capsys, demo, codes):
    """Only `zephon demo elastic --help` had a description: `demo gpu --help`, the smoke test a CI
    job runs, said neither that it skips without CUDA nor what its exit codes mean, and `demo text
    --help` and `demo vlm --help` only listed options."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", demo, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert codes in text


def test_gpu_demo_still_skips_without_cuda_when_its_options_are_sound(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from zephon.demo import _gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["demo", "gpu"]) == 0
    assert _gpu.SKIP_NO_CUDA in capsys.readouterr().out


@pytest.mark.parametrize("device", [[], ["--device", "cpu"]], ids=["default-device", "cpu"])
def test_gpu_demo_without_torch_says_what_to_install_and_exits_2_instead_of_passing_as_skipped(
    monkeypatch, capsys, device
):
    """Without torch the demo printed "skipped" and exited 0, even for `--device cpu`, which asks
    for the whole run on the CPU: a CI job meant to run the smoke test passed without running it.
    A missing extra is a setup error, as `zephon demo vlm` without Pillow says."""
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert cli.main(["demo", "gpu", *device]) == 2
    captured = capsys.readouterr()
    assert "skipped" not in captured.out
    assert "zephon demo gpu needs torch, which is not installed: pip install 'zephon[torch]'" in captured.err


def test_vlm_png_in_a_directory_that_is_not_there_is_refused_before_any_work(no_demo_work, tmp_path, capsys):
    """The picture was saved after the assets were fetched and the first step taken: a `--png` in
    a missing directory ended the demo there in a FileNotFoundError traceback."""
    png = tmp_path / "missing" / "batch.png"
    err = refused(capsys, "demo", "vlm", "--png", str(png))
    assert f"zephon demo vlm: --png {str(png)!r}: no directory {str(png.parent)!r} to write it in" in err


def test_vlm_png_that_names_a_directory_is_refused_before_any_work(no_demo_work, tmp_path, capsys):
    """`--png DIR` ran the demo and then ended in an IsADirectoryError traceback when the picture
    was saved: only a missing parent directory was checked."""
    err = refused(capsys, "demo", "vlm", "--png", str(tmp_path))
    assert f"zephon demo vlm: --png {str(tmp_path)!r} is a directory: name the picture's file" in err


@pytest.mark.parametrize("pairs", ["1", "7"])
def test_vlm_pairs_fewer_than_the_demos_lanes_are_refused_before_any_work(no_demo_work, pairs, capsys):
    """Every lane needs a share of the pairs: `--pairs 7` on the demo's 8 lanes fetched the
    assets, then ended in a ConfigurationError traceback (exit 1, the code of a mismatch) whose
    advice, fewer lanes, the demo has no option for."""
    err = refused(capsys, "demo", "vlm", "--pairs", pairs)
    assert f"zephon demo vlm: --pairs must be at least 8, one per lane of the demo, got {pairs}" in err


@pytest.mark.requires_torch
def test_gpu_demo_names_a_cuda_device_index_this_machine_does_not_have(no_demo_work, monkeypatch, capsys):
    """`--device cuda:3` on a machine with one GPU ended in torch's traceback (exit 1, the code of
    a mismatch) when the demo asked for the device's name."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = refused(capsys, "demo", "gpu", "--device", "cuda:3")
    assert "zephon demo gpu: --device 'cuda:3' names CUDA device 3, but this machine has 1 (cuda:0 to cuda:0)" in err
