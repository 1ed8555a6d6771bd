"""Decoding large photographs for fixed-size vision towers: Zephon's decode against the model's own
transformers image processor, per image, on one core.

Real JPEGs (`vlm._assets.photographs`: Debian mate-backgrounds, 1280x1024 to 5640x3172, or the
wheels' photographs) become what the model's forward takes, normalised float32 tensors:

- Gemma 3 (`ImageSpec.gemma3()`, 896x896): `decode_image` + `patchify` + `image_tensors`, with
  the JPEG draft decode (the default) and without it, against `Gemma3ImageProcessorPil`;
- InternVL (`ImageSpec.internvl()`, up to 12 tiles of 448 and a thumbnail): the same against
  `GotOcr2ImageProcessorPil(crop_to_patches=True)`;
- SmolVLM (`ImageSpec.smolvlm()`, the longer side to 2048, tiles of 512 and the global image):
  the same against `SmolVLMImageProcessorPil`;
- LLaVA-NeXT (`ImageSpec.llava_next()`, the base image and the best canvas's tiles of 336): the
  same against `LlavaNextImageProcessorPil`;
- LLaVA-OneVision (`ImageSpec.llava_onevision()`, the base image and up to 6x6 tiles of 384): the
  same against `LlavaOnevisionImageProcessorPil`.

In the loader the decode runs on the workers and `image_tensors` on the trainer's side; here both
run in one loop to compare like with like. Without the draft the pixels equal the processor's
(`tests/unit/test_vlm_fixed_size.py`); with it they differ by the draft's downscale.
`extra_info["images_per_s"]` is each row's rate; the ratios come from one run, side by side.

    pytest benchmarks/test_fixed_size_bench.py --benchmark-only
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from vlm import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageSpec, decode_image, image_grid, image_tensors, patchify
from vlm._assets import photographs

PHOTOGRAPHS = 6
"""Photographs decoded per round: the largest ones, where the resize and the draft count."""

CASES = {
    "gemma3": (ImageSpec.gemma3(), None, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "internvl": (ImageSpec.internvl(), 32, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "smolvlm": (ImageSpec.smolvlm(), 32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "llava_next": (ImageSpec.llava_next(), 24, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
    "llava_onevision": (ImageSpec.llava_onevision(), 24, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
}


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    found = photographs()
    data = [path.read_bytes() for path in found.paths if path.suffix == ".jpg"]
    return sorted(data, key=len, reverse=True)[:PHOTOGRAPHS]


def _processor(case: str, spec: ImageSpec, mean, std):
    if case == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": spec.size[0], "width": spec.size[1]})
    if case == "llava_next":
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        return LlavaNextImageProcessorPil(size={"shortest_edge": spec.size[0]},
                                          crop_size={"height": spec.size[0], "width": spec.size[1]},
                                          image_grid_pinpoints=[list(canvas) for canvas in spec.pinpoints])
    if case == "llava_onevision":
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil)

        return LlavaOnevisionImageProcessorPil(size={"height": spec.size[0], "width": spec.size[1]},
                                               image_grid_pinpoints=[list(canvas) for canvas in spec.pinpoints])
    if case == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        return SmolVLMImageProcessorPil(size={"longest_edge": spec.longest_edge},
                                        max_image_size={"longest_edge": spec.size[0]}, do_pad=False)
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(crop_to_patches=True, min_patches=spec.tiles[0], max_patches=spec.tiles[1],
                                    size={"height": spec.size[0], "width": spec.size[1]}, image_mean=mean,
                                    image_std=std)


@pytest.mark.parametrize("way", ["zephon", "zephon, no draft", "transformers"])
@pytest.mark.parametrize("case", list(CASES))
def test_photographs_to_model_pixels(benchmark, jpegs, case, way):
    from PIL import Image

    spec, tile, mean, std = CASES[case]
    if way == "zephon, no draft":
        spec = dataclasses.replace(spec, draft=False)
    benchmark.group = f"fixed-size: {case}"
    if way == "transformers":
        processor = _processor(case, spec, mean, std)

        def run() -> int:  # one picture a call: its tiles, as many as it gives
            return sum(len(np.asarray(processor(images=[Image.open(io.BytesIO(data))],
                                                return_tensors="np")["pixel_values"]).reshape(-1, 3, *spec.size))
                       for data in jpegs)
    else:
        def run() -> int:
            count = 0
            for data in jpegs:
                pixels = decode_image(data, spec)
                grid = np.array([image_grid(1, 1, spec) if tile is None else (pixels.shape[0] // spec.patch_size,
                                                                              pixels.shape[1] // spec.patch_size)])
                count += len(image_tensors(patchify(pixels, spec.patch_size), grid, mean=mean, std=std, tile=tile))
            return count

    tensors = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert tensors >= len(jpegs)
    benchmark.extra_info.update(images_per_s=len(jpegs) / benchmark.stats.stats.median, tensors=tensors,
                                photographs=len(jpegs))
