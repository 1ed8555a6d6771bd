"""A mixture of an image-caption, a video-caption and a text dataset, each decoder scoped to its
own (`decode_images(datasets=...)`, `decode_video(datasets=...)`), is as elastic as text (SPEC §3, §7).

The corpus and the recipe are tests/unit/test_vlm_mixed_media.py's: photos (one image misnamed,
skipped and counted), MPEG-4 clips whose 2 sampled frames pack as images, captions alone; weights
2 : 1 : 0.5, two epochs. Every global batch's SHA-256 (over its microbatches' digests, which cover
the pixels) is the uninterrupted inline run's on every runner and world size, eager and deferred,
and after a save on 2 ranks resumed on 1 and on 4.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tests.reliability.harness import checkpoint_after, run_epoch
from tests.unit.test_vlm_mixed_media import mixed_pipeline, write_mixed_corpus
from zephon import combine_digests

RUNNERS_AND_WORLDS = [(runner, world) for runner in ("inline", "thread", "process") for world in (1, 2, 4)
                      if (runner, world) != ("inline", 1)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_mixed_corpus(tmp_path_factory.mktemp("mixed"))


@pytest.fixture(scope="module")
def references(corpus):
    """The uninterrupted single-rank inline run, eager and deferred."""
    return {defer: run_epoch(mixed_pipeline(corpus, defer=defer), 1) for defer in (False, True)}


def global_digests(digests: dict) -> dict[int, str]:
    """{step: SHA-256 of its global batch}: its microbatches' digests in (lane, index) order."""
    by_step = defaultdict(list)
    for (step, lane, index), digest in digests.items():
        by_step[step].append(((lane, index), digest))
    return {step: combine_digests(d for _, d in sorted(parts)) for step, parts in by_step.items()}


@pytest.mark.parametrize("defer", [False, True], ids=["eager", "deferred"])
def test_the_reference_rows_hold_photos_beside_clip_frames(references, defer):
    run = references[defer]
    assert len(global_digests(run.digests)) > 2
    mixed_rows = 0
    for batch in run.batches:
        counts = batch.ragged_counts["image_grid"]
        for row, sources in enumerate(batch.sources):
            names = {address.dataset for address in sources}
            # a photo brings 1 image, a clip 2 frames, a note none
            expected = sum(1 if a.dataset == "photos" else 2 if a.dataset == "clips" else 0 for a in sources)
            assert int(counts[row]) == expected
            mixed_rows += {"photos", "clips"} <= names
    assert mixed_rows > 0
    assert run.skipped("photos") == {"missing_image": 2} and not run.skipped("clips")
    # the two are the same batches: deferring changes when photos decode, not what they are
    assert global_digests(references[True].digests) == global_digests(references[False].digests)


@pytest.mark.parametrize("defer", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("runner, world_size", RUNNERS_AND_WORLDS)
def test_a_mixed_media_recipe_gives_the_same_global_batches_on_every_runner_and_world_size(
    corpus, references, runner, world_size, defer
):
    run = run_epoch(mixed_pipeline(corpus, runner, 2, defer=defer), world_size, keep_batches=False)
    assert global_digests(run.digests) == global_digests(references[defer].digests)
    assert run.totals == references[defer].totals


@pytest.mark.parametrize("defer", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("target_world", [1, 4])
def test_a_mixed_media_recipe_saved_on_two_ranks_resumes_on_one_and_on_four(corpus, references, target_world, defer):
    """Saved on 2 ranks after two whole steps (2 microbatches each per step) on the process runner,
    resumed on `target_world`: the uninterrupted run's later global batches, once each."""
    reference = global_digests(references[defer].digests)
    state = json.loads(json.dumps(checkpoint_after(mixed_pipeline(corpus, "process", 2, defer=defer), 2, 4)))
    rest = run_epoch(mixed_pipeline(corpus, "process", 2, defer=defer), target_world, state=state,
                     keep_batches=False)
    resumed = global_digests(rest.digests)
    assert sorted(resumed) == sorted(set(reference) - {0, 1})
    assert resumed == {step: reference[step] for step in resumed}
    assert rest.totals == references[defer].totals
