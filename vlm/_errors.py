"""Decode failures with a named reason, so that a bad image or video is skipped and counted by kind.

The reason strings are part of the contract: they are what the ledger counts and what stats show.
"""

from __future__ import annotations

from zephon._errors import ZephonError

__all__ = ["IMAGE_REASONS", "VIDEO_REASONS", "ImageDecodeError", "MediaDecodeError", "VideoDecodeError"]

IMAGE_FILE_REASONS = frozenset({"missing_image_file", "unopenable_image_file"})
"""The reasons `decode_images(paths=True)` gives a path whose file cannot be read: no image was read."""

IMAGE_REASONS = frozenset({"corrupt_image", "truncated_image", "decompression_bomb", *IMAGE_FILE_REASONS})
"""Every reason `decode_image` can raise with, and those of an image read from a path."""

VIDEO_FILE_REASONS = frozenset({"missing_video_file", "unopenable_video_file"})
"""The reasons `decode_video` gives a path whose file cannot be opened: no media was read."""

VIDEO_REASONS = frozenset({"corrupt_video", "video_too_short", "decompression_bomb", "not_a_video",
                           *VIDEO_FILE_REASONS})
"""Every reason `decode_video` can raise with."""


class MediaDecodeError(ZephonError):
    """Bytes that could not become pixels; `reason` is a short stable name, `detail` is for humans."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (type(self), (self.reason, self.detail))


class ImageDecodeError(MediaDecodeError):
    """An image was corrupt, truncated or a decompression bomb, or its path named no file or one
    that cannot be read (see `IMAGE_REASONS`)."""


class VideoDecodeError(MediaDecodeError):
    """A video was corrupt, shorter than the requested window, too large, or a still picture, or
    its path named no file or one that cannot be opened (see `VIDEO_REASONS`)."""
