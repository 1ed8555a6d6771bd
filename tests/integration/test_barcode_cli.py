"""The `zephon` command as a user runs it: `demo elastic` and `barcode compare` (SPEC §4).

Barcodes come from real runs: the elastic demo's separate rank processes (`--barcode-dir`), and
harness runs written with `BarcodeWriter`, one of them resumed from the wrong checkpoint (the
state of step 2 taken up as if it were step 3's) so that it diverges at a known step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import checkpoint_after, step_digests, text_pipeline
from zephon.barcode import BarcodeWriter, read_barcode

STEPS = 6
DIVERGES_AT = 3


def zephon_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "zephon", *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)


def write_barcode(path: Path, digests: list[str]) -> Path:
    with BarcodeWriter(path) as writer:
        for step, digest in enumerate(digests):
            writer.write(step, digest)
    return path


@pytest.fixture(scope="module")
def elastic_demo(tmp_path_factory):
    barcodes = tmp_path_factory.mktemp("elastic-barcodes")
    done = zephon_cli(
        "demo", "elastic", "--steps", "8", "--checkpoint-step", "3", "--to-world-sizes", "1", "4",
        "--runner", "thread", "--barcode-dir", str(barcodes),
    )
    return done, barcodes


@pytest.fixture(scope="module")
def harness_barcodes(make_jsonl_corpus, demo_tokenizer_path, tmp_path_factory):
    """(uninterrupted, rerun, off-by-one resume) barcode files of the same recipe, each run from its
    own, separately constructed pipeline."""
    corpora = make_jsonl_corpus(3, 40, 31), make_jsonl_corpus(2, 40, 32)

    def pipeline():
        return text_pipeline(*corpora, demo_tokenizer_path)

    reference = step_digests(pipeline(), 1, STEPS)
    rerun = step_digests(pipeline(), 2, STEPS)
    wrong_state = checkpoint_after(pipeline(), 2, DIVERGES_AT - 1)
    diverged = reference[:DIVERGES_AT] + step_digests(
        pipeline(), 4, STEPS - DIVERGES_AT, state=wrong_state, start_step=DIVERGES_AT - 1
    )
    tmp = tmp_path_factory.mktemp("harness-barcodes")
    return (
        write_barcode(tmp / "reference.jsonl", reference),
        write_barcode(tmp / "rerun.jsonl", rerun),
        write_barcode(tmp / "diverged.jsonl", diverged),
    )


def test_demo_elastic_resumes_on_one_and_four_ranks_identically(elastic_demo):
    done, _ = elastic_demo
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("2 → ")]
    assert len(verdicts) == 2 and all(line.split()[-1] == "IDENTICAL" for line in verdicts), done.stdout
    assert "DIFFERENT" not in done.stdout
    assert "RESULT: every resumed global batch is bit-identical" in done.stdout


def test_compare_demo_barcodes_from_separate_processes_is_identical(elastic_demo):
    _, barcodes = elastic_demo
    assert len(read_barcode(barcodes / "reference.jsonl")) == 8
    for resumed in ("resume-2-to-1.jsonl", "resume-2-to-4.jsonl"):
        done = zephon_cli("barcode", "compare", str(barcodes / "reference.jsonl"), str(barcodes / resumed))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "8 common steps, 0 differ" in done.stdout and "identical" in done.stdout


def test_compare_identical_runs_exits_zero(harness_barcodes):
    reference, rerun, _ = harness_barcodes
    done = zephon_cli("barcode", "compare", str(reference), str(rerun))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "identical"


def test_compare_names_the_first_differing_step_and_exits_one(harness_barcodes):
    reference, _, diverged = harness_barcodes
    done = zephon_cli("barcode", "compare", str(reference), str(diverged))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{STEPS} common steps, {STEPS - DIVERGES_AT} differ" in done.stdout
    assert f"first differing step: {DIVERGES_AT}" in done.stdout


def test_compare_reports_steps_only_one_run_has(harness_barcodes, tmp_path):
    """Counted as such, with each run's file: "steps only in A: 0" read as step 0, and nothing said
    which file A was."""
    reference, _, _ = harness_barcodes
    crashed = write_barcode(tmp_path / "crashed.jsonl", list(read_barcode(reference).values())[:2])
    done = zephon_cli("barcode", "compare", str(reference), str(crashed))
    assert f"{STEPS - 2} steps only in A ({reference}), 0 only in B ({crashed})" in done.stdout
    assert "first step only in A: 2" in done.stdout
    assert done.returncode == 1, "a run that stopped early is not identical"
    done = zephon_cli("barcode", "compare", str(crashed), str(reference))
    assert f"0 steps only in A ({crashed}), {STEPS - 2} only in B ({reference})" in done.stdout
    assert done.returncode == 1, "a run that stopped early is not identical, given second either"


def test_compare_png_draws_both_runs_and_marks_mismatches(harness_barcodes, tmp_path):
    from matplotlib import image
    reference, rerun, diverged = harness_barcodes
    red_pixels = {}
    for name, other, code in (("same", rerun, 0), ("differs", diverged, 1)):
        png = tmp_path / f"{name}.png"
        done = zephon_cli("barcode", "compare", str(reference), str(other), "--png", str(png))
        assert done.returncode == code, done.stdout + done.stderr
        assert "Warning" not in done.stderr  # the paths labelling the runs fit beside the stripes
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = image.imread(png)[..., :3]
        red_pixels[name] = int(((pixels[..., 0] > 0.9) & (pixels[..., 1] < 0.1) & (pixels[..., 2] < 0.1)).sum())
    assert red_pixels["same"] == 0
    assert red_pixels["differs"] > 0


def test_a_step_written_twice_with_different_digests_is_reported_not_overwritten(tmp_path):
    """A run resumed from an earlier checkpoint appends the replayed steps again; when they come
    out different, that is the nondeterminism the barcode exists to show, not a line to drop."""
    reference = write_barcode(tmp_path / "reference.jsonl", ["a" * 64, "b" * 64, "c" * 64])
    resumed = write_barcode(tmp_path / "resumed.jsonl", ["a" * 64, "b" * 64])
    with BarcodeWriter(resumed) as writer:  # resumed at step 1: step 1 again, then step 2
        writer.write(1, "d" * 64)
        writer.write(2, "c" * 64)
    with pytest.raises(ValueError, match=r"resumed.jsonl:3: step 1 again with another digest"):
        read_barcode(resumed)
    done = zephon_cli("barcode", "compare", str(reference), str(resumed))
    assert done.returncode != 0 and "step 1 again with another digest" in done.stderr
    same = write_barcode(tmp_path / "same.jsonl", ["a" * 64, "b" * 64])
    with BarcodeWriter(same) as writer:  # replayed identically: the same barcode
        writer.write(1, "b" * 64)
        writer.write(2, "c" * 64)
    assert read_barcode(same) == read_barcode(reference)


@pytest.mark.parametrize(
    "line", ['{"step": 0, "digest": null}', '{"step": 1.7, "digest": "%s"}' % ("a" * 64),
             '{"step": true, "digest": "%s"}' % ("a" * 64), '{"step": 0, "digest": "abc"}'],
)
def test_a_line_without_an_integer_step_and_a_sha256_digest_is_not_a_barcode_line(tmp_path, line):
    """`int()` and `str()` read a step 1.7 or true as step 1 and a digest null as "None", so two
    such broken files compared as identical runs."""
    path = tmp_path / "broken.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:1: not a barcode line"):
        read_barcode(path)


@pytest.mark.parametrize(
    ("step", "digest"),
    [(0, None), (1.7, "a" * 64), (True, "a" * 64), (-1, "a" * 64), (0, "abc"), (0, "A" * 64), (0, b"a" * 32)],
)
def test_the_writer_refuses_a_line_the_reader_would_not_take(tmp_path, step, digest):
    """The writer took any step and digest; the reader refused the line only at `compare`, after
    the run: its whole barcode was lost to one bad write (an upper-case digest, a float step)."""
    path = tmp_path / "run.jsonl"
    with BarcodeWriter(path) as writer:
        writer.write(0, "a" * 64)
        with pytest.raises(ValueError, match="not a barcode entry"):
            writer.write(step, digest)
    assert read_barcode(path) == {0: "a" * 64}


def test_the_writer_takes_a_numpy_integer_step_as_the_integer_it_is(tmp_path):
    path = tmp_path / "run.jsonl"
    with BarcodeWriter(path) as writer:
        writer.write(np.int64(3), "b" * 64)
    assert read_barcode(path) == {3: "b" * 64}


def test_compare_png_without_matplotlib_is_a_usage_error_naming_the_extra(harness_barcodes, tmp_path, monkeypatch, capsys):
    """It used to end in a ModuleNotFoundError traceback with exit code 1, the code of two runs
    that differ, and without the comparison."""
    from zephon import cli

    reference, rerun, _ = harness_barcodes
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    png = tmp_path / "same.png"
    assert cli.main(["barcode", "compare", str(reference), str(rerun), "--png", str(png)]) == 2
    assert "--png needs matplotlib: pip install 'zephon[plot]'" in capsys.readouterr().err
    assert not png.exists()


def test_compare_of_two_barcodes_without_a_step_is_a_usage_error_not_identical(tmp_path, capsys):
    """Two runs that crashed before their first step (a BarcodeWriter creates its file at once),
    or two wrong paths to empty files, compared as "0 common steps, 0 differ / identical", exit 0:
    a CI check on the exit code passed having compared nothing."""
    from zephon import cli

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    BarcodeWriter(a).close()
    b.write_text("\n")
    assert cli.main(["barcode", "compare", str(a), str(b)]) == 2
    assert "holds a step: nothing to compare" in capsys.readouterr().err


@pytest.mark.parametrize("png", ["missing-folder/out.png", "out.notapictureformat"])
def test_compare_png_that_cannot_be_written_is_a_usage_error_not_a_difference(harness_barcodes, tmp_path, png, capsys):
    """It ended in a traceback with exit code 1, the code of two runs that differ, for two
    identical runs."""
    from zephon import cli

    reference, rerun, _ = harness_barcodes
    assert cli.main(["barcode", "compare", str(reference), str(rerun), "--png", str(tmp_path / png)]) == 2
    assert "cannot write --png" in capsys.readouterr().err


def test_a_barcode_drawing_that_cannot_be_saved_leaves_no_figure_open(harness_barcodes, tmp_path):
    """pyplot keeps every figure it made until it is closed: a library call that failed to save
    left one behind for the life of the process."""
    from matplotlib import pyplot as plt

    from zephon.barcode import draw_barcodes

    reference, rerun, _ = harness_barcodes
    before = plt.get_fignums()
    with pytest.raises(OSError):
        draw_barcodes(read_barcode(reference), read_barcode(rerun), tmp_path / "missing-folder" / "out.png")
    assert plt.get_fignums() == before


def test_compare_help_lists_its_exit_codes(capsys):
    """Only `zephon barcode --help` listed them: `zephon barcode compare --help`, the one a user
    writing a CI check reads, said nothing of what 0, 1 and 2 mean (and then "Exit codes: exit 0")."""
    from zephon import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["barcode", "compare", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit codes: 0 when every step matches, 1 on any difference" in text
    assert "2 on a file that is missing or not a barcode, two that hold no step" in text


def test_a_demo_plugin_that_fails_to_register_leaves_the_rest_of_the_command_working(harness_barcodes, monkeypatch,
                                                                                      capsys):
    """Only an ImportError of a plugin was caught: one that raised anything else when it registered
    (a demo name already taken, a bug) took `barcode compare` down with it."""
    from zephon import cli

    class BrokenDemo:
        name = "broken"

        def load(self):
            def register(demo_parsers):
                raise ValueError("conflicting subparser: elastic")
            return register

    monkeypatch.setattr(cli, "entry_points", lambda group: [BrokenDemo()])
    reference, rerun, _ = harness_barcodes
    assert cli.main(["barcode", "compare", str(reference), str(rerun)]) == 0
    assert "demo 'broken' unavailable (ValueError: conflicting subparser: elastic)" in capsys.readouterr().err
