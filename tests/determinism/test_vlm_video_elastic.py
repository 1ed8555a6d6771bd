"""Images and video frames packed together are as elastic as text on the process runner (SPEC §3, §7).

test_vlm_elastic.py runs image+caption pairs; the video decoder, the frames it samples and a
map that puts them beside the record's image in the packer's field were checked on one rank only.
Here WebDataset records carry a JPEG (one in seven truncated), a caption and an MPEG-4 clip (one
of three, of different lengths) whose 2 sampled frames pack as images after the record's own;
shards hold 9, 7, 1 and 1 records, read for two epochs. The digests cover the pixels.
"""

from __future__ import annotations

import io
import json
import tarfile
from itertools import islice

import pytest

from tests.reliability.harness import checkpoint_after, run_epoch
from tests.unit.test_vlm_assets import encode, gradient, make_video, package_dir, truncated_jpeg
from vlm import ImageSpec, PixtralPlaceholders, VideoSpec
from zephon import CheckpointError, Pipeline
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

SPEC = ImageSpec(max_pixels=64 * 64)
PLACEHOLDERS = PixtralPlaceholders(3, 4, 5)
SHARD_SIZES = [9, 7, 1, 1]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    videos = [make_video(root / f"v{j}.mp4", frames=6 + 3 * j, size=(64, 48)) for j in range(3)]
    payloads = [video.read_bytes() for video in videos]
    for video in videos:
        video.unlink()  # the shards alone are the dataset
    for shard, size in enumerate(SHARD_SIZES):
        with tarfile.open(root / f"clips-{shard:03d}.tar", "w") as tar:
            for i in range(size):
                k = shard * 10 + i
                image = truncated_jpeg() if k % 7 == 3 else encode(gradient(30 + 5 * (k % 9), 60 - 3 * (k % 5)), "JPEG")
                members = [("jpg", image), ("txt", f"clip {k} " * (1 + k % 5)), ("mp4", payloads[k % 3])]
                for ext, payload in members:
                    payload = payload.encode() if isinstance(payload, str) else payload
                    info = tarfile.TarInfo(f"k{k:03d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return root


class ImageThenFrames:
    """The record's image, then its video's frames, in the one field the packer reads."""

    def __call__(self, record: dict) -> dict:
        out = dict(record)
        out["pixels"] = [out["pixels"], *out.pop("frames")]
        return out


@pytest.fixture(scope="module")
def make(clips):
    def make(runner: str = "inline", parallelism: int = 1, defer: bool = False) -> Pipeline:
        source = StaticMixtureWorkSource([Dataset.from_path("clips", str(clips))], seed=1, records_per_chunk=1,
                                         num_epochs=2)
        return (
            Pipeline(source).options(num_lanes=4, runner=runner, flush_every_chunks=2)
            .tokenize(str(package_dir("zephon") / "data" / "tokenizer.json"), field="txt", bos="<|bos|>",
                      eos="<|eos|>", parallelism=parallelism)
            .decode_images(field="jpg", spec=SPEC, defer=defer, parallelism=parallelism)
            .decode_video(field="mp4", output_field="frames", spec=VideoSpec(num_frames=2, image=SPEC),
                          parallelism=parallelism)
            .map(ImageThenFrames(), parallelism=parallelism)
            .pack_multimodal(160, PLACEHOLDERS, pixels_field="pixels")
            .shuffle(buffer_size=3, seed=2)
            .batch(1)
        )

    return make


@pytest.fixture(scope="module")
def references(make):
    """The uninterrupted single-rank inline run, eager and deferred (a truncated JPEG is skipped
    in one and masked in the other, so their batches differ by design)."""
    return {defer: run_epoch(make(defer=defer), 1) for defer in (False, True)}


def test_the_reference_packs_video_frames_after_images_and_masks_a_cut_jpeg_when_deferred(references):
    eager, deferred = references[False], references[True]
    assert len({step for step, _, _ in eager.digests}) > 2
    images_per_row = [int(n) for batch in eager.batches for n in batch.ragged_counts["image_grid"]]
    assert min(images_per_row) >= 3, "every row holds a record's image and its video's 2 frames"
    assert eager.skipped("clips")["truncated_image"] > 0, "the cut JPEGs are skipped before packing"
    assert not deferred.skipped("clips") and deferred.totals["clips"]["emitted"] > eager.totals["clips"]["emitted"]


@pytest.mark.parametrize("defer", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("runner", ["thread", "process"])
def test_images_and_video_frames_give_the_same_batches_on_every_runner_and_world_size(
    make, references, runner, world_size, defer
):
    run = run_epoch(make(runner, 2, defer), world_size, keep_batches=False)
    assert run.digests == references[defer].digests
    assert run.totals == references[defer].totals


@pytest.mark.parametrize("defer", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("microbatches_per_rank, target_world", [(2, 4), (2, 1), (3, 1)])
def test_images_and_video_frames_resume_on_another_world_size_on_the_process_runner(
    make, references, microbatches_per_rank, target_world, defer
):
    """Saved on 2 ranks after a step (2 microbatches each) or partway through one (3), resumed on 4
    or 1 with the process runner: what the uninterrupted run handed over after the save, once."""
    reference = references[defer]
    state = json.loads(json.dumps(checkpoint_after(make("process", 2, defer), 2, microbatches_per_rank)))
    taken = set()
    for rank in range(2):
        with make(defer=defer).shard(rank, 2, global_batch_size=4) as loader:
            taken |= {(b.step, b.lane, b.index) for b in islice(loader, microbatches_per_rank)}
    rest = run_epoch(make("process", 2, defer), target_world, state=state, keep_batches=False)
    assert set(rest.digests) == set(reference.digests) - taken
    assert rest.digests == {key: reference.digests[key] for key in rest.digests}
    assert rest.totals == reference.totals


def test_a_save_partway_through_a_step_is_refused_on_more_ranks(make):
    state = checkpoint_after(make(), 2, 1)
    with make().shard(0, 4, global_batch_size=4) as loader:
        with pytest.raises(CheckpointError, match="saved partway through step 0"):
            loader.load_state_dict(state)
