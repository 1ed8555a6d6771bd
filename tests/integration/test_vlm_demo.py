"""`zephon demo vlm` on real image+caption pairs: throughput, the runner and why, and a picture.

The demo is found by the `zephon` command through the `zephon.demos` entry point and run as
`python -m zephon demo vlm` in a separate process, so its runner and its output are the user's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm._demo import DEMO_MICROBATCH, IMAGE_COLOURS, PADDING_COLOUR, TEXT_COLOURS, run_vlm_demo

REPO = Path(__file__).resolve().parents[2]


def test_zephon_command_registers_the_vlm_demo_with_its_defaults():
    from zephon.cli import _parser

    args = _parser().parse_args(["demo", "vlm"])
    assert (args.demo, args.runner, args.png, args.steps) == ("vlm", "auto", "vlm-batch.png", 20)
    assert args.run_demo is run_vlm_demo


def test_vlm_demo_max_side_help_says_the_sides_are_rounded_up_to_whole_patches():
    """Pixtral sizing scales the longest side down to --max-side, then rounds each side up to
    whole 16 px patches: 100 gives 112 px. The help called it the longest side, a cap it is not."""
    from vlm import ImageSpec, image_grid
    from zephon.cli import _parser

    assert max(image_grid(256, 256, ImageSpec.pixtral(max_side=100))) * 16 == 112
    def subparser(parser, name):
        return next(a for a in parser._actions if a.choices and name in a.choices).choices[name]

    vlm = subparser(subparser(_parser(), "demo"), "vlm")
    [max_side] = [a for a in vlm._actions if a.dest == "max_side"]
    assert "rounded up to whole 16 px patches" in max_side.help


def test_vlm_demo_without_pillow_says_what_to_install_before_fetching_anything(monkeypatch, capsys):
    import vlm._demo

    def fetch(*args, **kwargs):
        raise AssertionError("the assets were fetched before the missing decoder was named")

    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setattr(vlm._demo, "pair_shards", fetch)
    assert run_vlm_demo(_parser_args(["demo", "vlm"])) == 2
    assert "zephon demo vlm needs Pillow (or pillow-simd), which is not installed: pip install 'zephon[vlm]'" \
        in capsys.readouterr().err


def test_vlm_demo_whose_rows_hold_no_image_says_so_as_a_usage_error_not_a_traceback(tmp_path, capsys):
    """`--max-length 16` holds no image of the demo's sizing, so every pair is skipped as
    `images_exceed_length` and the lane stops the endless plan: that ConfigurationError ended the
    demo in a traceback, exit 1."""
    argv = ["demo", "vlm", "--steps", "1", "--pairs", "16", "--max-length", "16", "--max-side", "64",
            "--runner", "inline", "--png", str(tmp_path / "batch.png")]
    with pytest.raises(SystemExit) as exc:
        run_vlm_demo(_parser_args(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "zephon demo vlm: lane " in err and "images_exceed_length" in err
    assert "--max-length 16" in err and "--max-side 64" in err
    assert not (tmp_path / "batch.png").exists()


def test_vlm_demo_whose_pairs_cannot_be_fetched_says_so_without_a_traceback(monkeypatch, tmp_path, capsys):
    """`--origin tuxpaint` where apt cannot fetch the package (not Debian, offline) ended the demo
    in a RuntimeError traceback, exit 1."""
    import vlm._assets

    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))  # nothing fetched before
    monkeypatch.setattr(vlm._assets, "_apt_download", lambda name, into: None)  # what apt gives offline
    with pytest.raises(SystemExit) as exc:
        run_vlm_demo(_parser_args(["demo", "vlm", "--origin", "tuxpaint", "--png", str(tmp_path / "b.png")]))
    assert exc.value.code == 2
    assert ("zephon demo vlm: cannot get the demo's data (--origin tuxpaint): cannot fetch Debian package "
            "tuxpaint-stamps-default with apt-get download") in capsys.readouterr().err


def _parser_args(argv):
    from zephon.cli import _parser

    return _parser().parse_args(argv)


def test_vlm_demo_prints_throughput_runner_and_time_waited_and_draws_a_packed_batch(tmp_path):
    png = tmp_path / "batch.png"
    done = subprocess.run(
        [sys.executable, "-m", "zephon", "demo", "vlm", "--steps", "4", "--pairs", "96", "--global-batch-size", "16",
         "--max-length", "1024", "--max-side", "128", "--png", str(png)],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"data: 96 image\+caption pairs in 8 shards from (Debian tuxpaint-stamps-default|scikit-image)", out)
    assert re.search(r"runner: (thread|process) \(auto: .+\)", out), "the runner and the reason it was chosen"
    speed = re.search(r"([\d,]+) usable tokens/s, ([\d,.]+) images/s, padding ([\d.]+) %", out)
    assert speed and float(speed[1].replace(",", "")) > 0 and float(speed[2].replace(",", "")) > 0
    waited = re.search(r"waited for batches: [\d.]+ s inside next\(\) for (\d+) microbatches \(first [\d.]+ s", out)
    assert waited and int(waited[1]) == 4 * 16 // DEMO_MICROBATCH, "every microbatch of the 4 steps, from stats()"
    ledger = re.search(r"read (\d+)  emitted (\d+)  filtered 0  skipped 0", out)
    assert ledger and int(ledger[1]) == int(ledger[2]) > 0

    assert png.is_file() and str(png) in out
    with Image.open(png) as picture:
        pixels = np.asarray(picture.convert("RGB"))
    assert pixels.shape[1] == 1024 and pixels.shape[0] >= 16 * 10
    colours = {tuple(c) for c in pixels.reshape(-1, 3)}
    assert IMAGE_COLOURS[0] in colours and TEXT_COLOURS[0] in colours and PADDING_COLOUR in colours


def test_the_recipe_runs_on_the_photograph_fallback_too():
    """Where apt cannot fetch the stamps, the wheels' photographs (cropped, captions generated)
    stand in, and the same recipe packs them."""
    from vlm._assets import pair_shards, tekken_tokenizer
    from vlm._demo import vlm_pipeline

    pairs = pair_shards(2, 12, origin="photos")
    assert pairs.source.startswith("scikit-image") and pairs.num_pairs == 12
    pipeline = vlm_pipeline(pairs.directory, tekken_tokenizer(), runner="inline", num_lanes=2, max_length=1024,
                            microbatch_size=1, records_per_chunk=3, num_epochs=1)
    with pipeline.shard(0, 1) as loader:
        batches = list(loader)
        total = loader.stats()["datasets"]["pairs"]["total"]
    assert total["read"] == total["emitted"] == 12 and not total["skipped"]
    assert sum(len(b.ragged["image_grid"]) for b in batches) == 12


@pytest.mark.parametrize("limit", [0, -3])
def test_pair_shards_refuses_a_limit_below_one_instead_of_caching_no_pairs_as_all_of_them(tmp_path, limit):
    """`limit or 'all'` names the cache: a limit of 0 kept no pair and cached that empty set as
    "all", which every later call without a limit (the demo's default) was then handed."""
    from vlm._assets import pair_shards

    with pytest.raises(ValueError, match="limit"):
        pair_shards(2, limit, origin="photos", cache=tmp_path)
    assert not (tmp_path / "pairs" / "photos-2xall").exists()


def test_two_first_fetches_of_the_tekken_wheel_at_once_both_read_it_whole(tmp_path, monkeypatch):
    """Without mistral-common installed the wheel is fetched with `pip download` into the cache: a
    second process that looked while the first one's download was being written read the half
    file (BadZipFile); the fetch is now made once, under the cache's lock."""
    import io
    import threading
    import time
    import zipfile

    import vlm._assets as assets

    payload = b'{"config": {}}'
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(f"mistral_common/data/{assets.TEKKEN_FILE}", payload)
    wheel = buffer.getvalue()
    downloads = []

    def pip_download(command, **kwargs):  # writes the wheel in two halves, as a download does
        downloads.append(command)
        path = tmp_path / "wheels" / "mistral_common-1.13.1-py3-none-any.whl"
        with open(path, "wb") as out:
            out.write(wheel[: len(wheel) // 2])
            out.flush()
            time.sleep(0.3)
            out.write(wheel[len(wheel) // 2 :])

    monkeypatch.setattr(assets, "_package_dir", lambda name: None)
    monkeypatch.setattr(assets.subprocess, "run", pip_download)
    results, errors = [], []

    def fetch():
        try:
            results.append(assets._tekken_json(tmp_path))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    first = threading.Thread(target=fetch)
    first.start()
    time.sleep(0.1)  # the first download is half written
    fetch()
    first.join()
    assert not errors and results == [payload, payload]
    assert len(downloads) == 1


def test_the_recipe_parses_its_tokenizer_once(tmp_path):
    """The placeholder ids are looked up in the instance the tokenize stage encodes with: a second
    parse of Tekken costs the first batch ~0.3 s and the process ~33 MiB."""
    import shutil

    from vlm._assets import pair_shards, tekken_tokenizer
    from vlm._demo import vlm_pipeline
    from zephon._tokenizer import _load_tokenizer

    pairs = pair_shards(2, 12, origin="photos")
    tokenizer = shutil.copytree(tekken_tokenizer(), tmp_path / "tekken")  # a path no test loaded yet
    before = _load_tokenizer.cache_info().misses
    vlm_pipeline(pairs.directory, tokenizer, runner="inline")
    assert _load_tokenizer.cache_info().misses - before == 1


def test_the_recipe_scans_its_shards_and_imports_pillow_while_it_parses_the_tokenizer(tmp_path, monkeypatch):
    """Tekken's parse is most of the recipe's time to the first batch and needs neither the
    shards' scan nor Pillow's import, which the first chunk's decoding threads otherwise waited on
    together: the parse waits for the scan and the import to have begun, the scan for the parse."""
    import shutil
    import threading

    import vlm._demo
    from vlm._assets import pair_shards, tekken_tokenizer
    from vlm._image import import_decoder

    pairs = pair_shards(2, 12, origin="photos")
    tokenizer = str(shutil.copytree(tekken_tokenizer(), tmp_path / "tekken"))  # a path no test loaded yet
    parsing, scanning, importing = threading.Event(), threading.Event(), threading.Event()
    seen = {}
    scan, load = vlm._demo.Dataset.from_path, vlm._demo.load_tokenizer

    def scan_seeing_the_parse(*args, **kwargs):
        scanning.set()
        seen["parse began during the scan"] = parsing.wait(timeout=10)
        return scan(*args, **kwargs)

    def load_seeing_the_scan(tokenizer_id, *args, **kwargs):
        if tokenizer_id == tokenizer:
            parsing.set()
            seen["scan began during the parse"] = scanning.wait(timeout=10)
            seen["Pillow's import began during the parse"] = importing.wait(timeout=10)
        return load(tokenizer_id, *args, **kwargs)

    def import_recorded():
        importing.set()
        import_decoder()

    monkeypatch.setattr(vlm._demo.Dataset, "from_path", scan_seeing_the_parse)
    monkeypatch.setattr(vlm._demo, "load_tokenizer", load_seeing_the_scan)
    monkeypatch.setattr(vlm._demo, "import_decoder", import_recorded, raising=False)  # none before it
    vlm._demo.vlm_pipeline(pairs.directory, tokenizer, runner="inline")
    assert all(seen.values()) and len(seen) == 3, seen


def test_an_interrupt_during_the_shards_scan_ends_the_scan_at_once(monkeypatch):
    """A signal interrupts the main thread alone: with the scan on a second thread, Ctrl-C during
    a listing that does not end (a remote store retrying) waited for it to end, at the recipe's
    exit and again at the interpreter's, where on the calling thread it stopped the scan."""
    import signal
    import threading
    import time

    import vlm._demo
    from vlm._assets import pair_shards, tekken_tokenizer

    pairs = pair_shards(2, 12, origin="photos")
    scanning, released = threading.Event(), threading.Event()
    interrupted = []

    def scan_that_hangs(*args, **kwargs):
        began = time.monotonic()
        try:
            scanning.set()
            for _ in range(200):  # short waits: an interrupt landing just before one begins is raised after it
                if released.wait(timeout=0.05):
                    break
        except KeyboardInterrupt:
            interrupted.append("the scan")
            raise
        raise AssertionError(f"the scan was not interrupted in {time.monotonic() - began:.1f} s")

    def interrupt_the_scan():
        if scanning.wait(timeout=10):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    monkeypatch.setattr(vlm._demo.Dataset, "from_path", scan_that_hangs)
    # Python turns SIGINT into KeyboardInterrupt unless it started with SIGINT ignored, as a suite
    # started in the background by a non-interactive shell (`pytest &`, nohup) does: the test
    # stands for an interactive run, whatever started the suite.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=interrupt_the_scan)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            vlm._demo.vlm_pipeline(pairs.directory, tekken_tokenizer(), runner="inline")
    finally:
        released.set()
        interrupter.join()
        signal.signal(signal.SIGINT, previous)
    assert interrupted == ["the scan"]
