"""Vision-language operators on Zephon's lane core: image and video decode, placeholder
conventions, and multimodal packing. Depends on `zephon`; `zephon` never imports it."""

from ._errors import (
    IMAGE_REASONS,
    VIDEO_REASONS,
    ImageDecodeError,
    MediaDecodeError,
    VideoDecodeError,
)
from ._image import (
    PILLOW_MAX_IMAGE_PIXELS,
    ImageSpec,
    SizedImage,
    decode_image,
    decode_image_with_size,
    image_grid,
    load_rgb,
    patchify,
)
from ._packing import (
    IMAGE_POSITIONS,
    MultimodalPacker,
    PackMultimodal,
    PlacedDocument,
    RowPlan,
    assemble_row,
)
from ._pairs import MultimodalPairPacker, PackMultimodalPairs
from ._placeholders import (
    AyaVisionPlaceholders,
    Cohere2VisionPlaceholders,
    Idefics3Placeholders,
    Llama4Placeholders,
    LlavaNextPlaceholders,
    PadPlaceholders,
    PixtralPlaceholders,
    Placeholders,
    QwenPlaceholders,
    TimestampText,
    lookup_token_id,
)
from ._stages import (
    DEFAULT_IMAGE_FIELDS,
    DEFAULT_VIDEO_FIELDS,
    DecodeImages,
    DecodeVideo,
    run_processor,
)
from ._frame_text import FrameText
from ._gemma3 import gemma3_model_inputs
from ._paligemma import paligemma_model_inputs
from ._gemma4 import gemma4_model_inputs
from ._image_tensors import batch_num_images, image_tensors, video_tensors
from ._qwen_rows import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, qwen_model_inputs, qwen_pixel_values, qwen_video_pixel_values
from ._video import VideoSpec, decode_video, sample_times

__all__ = [
    "AyaVisionPlaceholders",
    "Cohere2VisionPlaceholders",
    "DEFAULT_IMAGE_FIELDS",
    "DEFAULT_VIDEO_FIELDS",
    "IMAGE_POSITIONS",
    "IMAGE_REASONS",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "PILLOW_MAX_IMAGE_PIXELS",
    "VIDEO_REASONS",
    "DecodeImages",
    "DecodeVideo",
    "FrameText",
    "Idefics3Placeholders",
    "ImageDecodeError",
    "ImageSpec",
    "Llama4Placeholders",
    "LlavaNextPlaceholders",
    "MediaDecodeError",
    "MultimodalPacker",
    "MultimodalPairPacker",
    "PackMultimodal",
    "PackMultimodalPairs",
    "PadPlaceholders",
    "PixtralPlaceholders",
    "PlacedDocument",
    "Placeholders",
    "QwenPlaceholders",
    "RowPlan",
    "SizedImage",
    "TimestampText",
    "VideoDecodeError",
    "VideoSpec",
    "assemble_row",
    "batch_num_images",
    "decode_image",
    "decode_image_with_size",
    "decode_video",
    "gemma3_model_inputs",
    "gemma4_model_inputs",
    "image_grid",
    "image_tensors",
    "load_rgb",
    "lookup_token_id",
    "paligemma_model_inputs",
    "patchify",
    "qwen_model_inputs",
    "qwen_pixel_values",
    "qwen_video_pixel_values",
    "run_processor",
    "sample_times",
    "video_tensors",
]
