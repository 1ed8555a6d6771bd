"""A LLaVA-style corpus (JSON lines naming their images by file, the images beside them) gives the
batches its images give as bytes, on every runner and world size (SPEC §3, §7).

`decode_images(paths=True)` reads each file beside the record's shard; the reference reads the same
files with a map that knows the corpus root, the way users did before, and hands decode_images
their bytes. Same digests means the same tokens and pixels: the path was resolved to the file the
map read, and the deferred image crossing to the row decode holds those bytes. Shards hold 7, 5
and 1 records; some name two images (a list), one an absolute path, and one a file that is not
there, which both pipelines drop.
"""

from __future__ import annotations

import pytest

from tests.reliability.harness import run_epoch
from tests.unit.test_vlm_image_paths import llava_pipeline, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("paths"))


@pytest.fixture(scope="module")
def references(corpus):
    """The files read by the map, on one rank inline, eager and deferred."""
    return {defer: run_epoch(llava_pipeline(corpus, defer=defer, paths=False), 1) for defer in (False, True)}


def test_the_reference_packs_every_image_the_corpus_holds(references):
    for run in references.values():
        assert len(run.digests) > 4
        assert sum(int(n) for batch in run.batches for n in batch.ragged_counts["image_grid"]) == 2 * (13 - 1 + 4 - 1)
        assert run.totals["llava"]["skipped:missing_image"] == 2


@pytest.mark.parametrize("defer", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("runner", ["thread", "process"])
def test_image_paths_give_the_batches_of_the_same_images_as_bytes_on_every_runner_and_world_size(
    corpus, references, runner, world_size, defer
):
    run = run_epoch(llava_pipeline(corpus, runner, defer), world_size, keep_batches=False)
    assert run.digests == references[defer].digests
    expected = references[defer].totals["llava"].copy()
    expected["skipped:missing_image_file"] = expected.pop("skipped:missing_image")
    assert run.totals["llava"] == expected
