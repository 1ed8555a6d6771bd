"""`qwen_pixel_values`: the ImageSpec's uint8 patches turned, on the trainer's side, into the rows
Qwen2-VL's and Qwen3-VL's vision towers take, checked against transformers' own image processor
given the same resized pixels (so no resize kernel differs)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import requires_torch
from vlm import ImageSpec, QwenPlaceholders, VideoSpec, patchify, qwen_pixel_values

# (patch size, image mean and std) of Qwen2-VL's processor and of the Qwen3-VL checkpoints'.
MODELS = {"qwen2_vl": (14, None), "qwen3_vl": (16, (0.5, 0.5, 0.5))}


def processor_rows(pictures: list[np.ndarray], patch: int, norm) -> tuple[np.ndarray, np.ndarray]:
    """transformers' Qwen2VLImageProcessor rows and grids for pictures already on whole cells and
    within its pixel bounds: it resizes each to the size it has, a copy."""
    import transformers

    processor_class = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    extra = {} if norm is None else {"image_mean": list(norm), "image_std": list(norm)}
    processor = processor_class(patch_size=patch, merge_size=2, min_pixels=(2 * patch) ** 2,
                                max_pixels=(2 * patch) ** 2 * 64, **extra)
    out = [processor(images=picture, return_tensors="np") for picture in pictures]
    return (np.concatenate([o["pixel_values"] for o in out]),
            np.concatenate([o["image_grid_thw"] for o in out])[:, 1:])


def pictures(patch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    cell = 2 * patch
    return [rng.integers(0, 256, (rows * cell, cols * cell, 3), dtype=np.uint8)
            for rows, cols in [(1, 1), (2, 3), (4, 1), (3, 5)]]


@pytest.mark.parametrize("model", MODELS)
def test_the_spec_patches_turn_into_the_qwen_processors_rows_for_the_same_pixels(model):
    """A Qwen2-VL recipe decoding with an ImageSpec carries raster-order uint8 patches, which its
    vision tower cannot take; `decode_images(processor=...)` was the only way to its rows, and a
    video decoder has none, so images and clips could not be mixed for that model."""
    patch, norm = MODELS[model]
    images = pictures(patch)
    want, grids = processor_rows(images, patch, norm)
    ours = np.concatenate([patchify(image, patch) for image in images])
    kwargs = {} if norm is None else {"mean": norm, "std": norm}
    got = qwen_pixel_values(ours, grids, **kwargs)
    assert got.dtype == np.float32 and got.shape == want.shape == (len(ours), 3 * 2 * patch * patch)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def torch_devices() -> list[str]:
    """cpu, and cuda where this machine has a GPU (the device tool's runs): the rows are made where
    the trainer's tensor already is."""
    try:
        import torch
    except ImportError:
        return ["cpu"]  # the test skips for lack of torch
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@requires_torch
@pytest.mark.parametrize("device", torch_devices())
def test_a_torch_batch_gives_the_same_rows_as_a_tensor_on_its_device(device):
    import torch

    images = pictures(14)
    ours = np.concatenate([patchify(image, 14) for image in images])
    grids = np.array([(image.shape[0] // 14, image.shape[1] // 14) for image in images], np.int32)
    got = qwen_pixel_values(torch.from_numpy(ours).to(device), torch.from_numpy(grids).to(device))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.device.type == device
    want = qwen_pixel_values(ours, grids)
    if device == "cpu":  # the same float32 operations as NumPy's, in the same order
        assert np.array_equal(got.numpy(), want)
    else:  # a GPU's division may round the last bit otherwise
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=0, atol=1e-6)


def test_a_mixed_image_and_video_batch_for_qwen_converts_every_image_and_frame(tmp_path):
    """The recipe the refusal of two patch layouts left no way to: Qwen images (deferred) and clips
    decoded with one ImageSpec, each microbatch's rows converted for the model, every image's and
    frame's rows its processor's."""
    from tests.unit.test_vlm_mixed_media import TOKENIZER, mixed_source, write_mixed_corpus
    from zephon import Pipeline

    spec = ImageSpec.qwen2_vl(max_pixels=56 * 56 * 4)
    pipeline = (
        Pipeline(mixed_source(write_mixed_corpus(tmp_path))).options(num_lanes=4, runner="inline")
        .tokenize(TOKENIZER, field="txt", eos="<|eos|>")
        .decode_images(field="jpg", spec=spec, defer=True, datasets="photos")
        .decode_video(field="mp4", spec=VideoSpec(num_frames=2, image=spec), datasets="clips")
        .pack_multimodal(160, QwenPlaceholders(3, 4, 5), mrope=True)
        .batch(2)
    )
    datasets = set()
    with pipeline.shard(0, 1) as loader:
        for batch in loader:
            datasets |= {address.dataset for sources in batch.sources for address in sources}
            rows, grids = batch.ragged["pixel_values"], batch.ragged["image_grid"]
            got, start = qwen_pixel_values(rows, grids), 0
            for r, c in grids.tolist():
                picture = rows[start:start + r * c].reshape(r, c, 14, 14, 3).swapaxes(1, 2).reshape(r * 14, c * 14, 3)
                want, _ = processor_rows([picture], 14, None)
                np.testing.assert_allclose(got[start:start + r * c], want, rtol=0, atol=1e-6)
                start += r * c
    assert {"photos", "clips"} <= datasets


def test_a_processors_rows_or_another_batchs_grid_are_refused_naming_what_to_give():
    ours = patchify(pictures(14)[1], 14)
    with pytest.raises(ValueError, match="not RGB patches"):
        qwen_pixel_values(np.zeros((6, 1176), np.float32), np.array([[2, 3]]))
    with pytest.raises(ValueError, match="same batch's pixel_values and image_grid"):
        qwen_pixel_values(ours, np.array([[2, 2]]))
    with pytest.raises(ValueError, match="not whole 2x2 merged cells"):
        qwen_pixel_values(ours[:3], np.array([[1, 3]]))
