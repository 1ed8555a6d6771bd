"""Where a media path read from the data points (beside its shard, never the worker's working
directory), and what the OS finds there.

A record that names its video or image by a relative path (a JSON line's "clips/a.mp4" or
LLaVA's "images/000123.jpg", a Hugging Face column's {"bytes": None, "path": "clips/a.mp4"})
means a file kept with the dataset, as the `file_name` of a Hugging Face folder dataset's
metadata file is relative to that file. Opened
from the working directory, the same recipe read other files, or none, when started or resumed
from another directory or on another node, and nothing in the recipe told. So a relative path is
joined to the directory of the shard that holds the record when that shard is a local file: its
address then holds the shard's absolute path (`zephon.io` keeps local shards as plain absolute
paths, `file://` ones too). A remote shard (s3://, hf://, ...), or an address whose shard is not
an absolute local path, gives no directory a worker could open the file from: such a path is not
resolved at all, rather than guessed. An absolute path is taken as it is.

What is at the resolved path is the OS's to say (`open_media_file`): no file there is
`missing_<media>_file`, something that cannot be opened as a file `unopenable_<media>_file`, and
neither is corrupt media, since no media was read: counted as corrupt, a folder a copy left out
sent an operator looking for damage.
"""

from __future__ import annotations

import os
import stat

from ._errors import ImageDecodeError, MediaDecodeError

__all__ = ["as_the_record_names_it", "open_media_file", "read_image_file", "resolve_beside_shard"]


def resolve_beside_shard(path: str | os.PathLike, shard: str) -> str | None:
    """`path` if absolute, else joined to the directory of the local shard `shard`; None when
    `path` is relative and `shard` is not an absolute local path."""
    path = os.fspath(path)
    if os.path.isabs(path):
        return path
    if "://" in shard or "::" in shard or not os.path.isabs(shard):
        return None
    return os.path.join(os.path.dirname(shard), path)


def as_the_record_names_it(path: str | os.PathLike, shard: str) -> str:
    """The path as the record writes it and, when relative, the shard it was resolved beside: what
    an operator needs besides the file looked for to tell a wrong root or a folder a copy left out."""
    path = os.fspath(path)
    if os.path.isabs(path):
        return f"the record names the absolute path {path!r}"
    return f"the record names {path!r}, resolved beside its shard {shard}"


def open_media_file(path: str, media: str, error: type[MediaDecodeError]) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the file at `path` and its status, or `error` with reason
    missing_<media>_file where no file is there (no such name, or a parent that is a file) and
    unopenable_<media>_file where something is there that cannot be opened as a file (a directory,
    permission denied, a symlink loop, a name holding a NUL, which the OS refuses to be asked with
    a ValueError, not an OSError). The OS decides, never a decoder's error code, which a demuxer
    may also return for bad bytes, so a damaged file is never called missing."""
    if "\x00" in path:
        raise error(f"unopenable_{media}_file", f"{path!r} holds a NUL character, which no file name can")
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO with no writer
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise error(f"missing_{media}_file", f"no file at {path!r} ({type(exc).__name__}: {exc.strerror})") from None
    except OSError as exc:
        raise error(f"unopenable_{media}_file",
                    f"{path!r} cannot be opened ({type(exc).__name__}: {exc.strerror})") from None
    status = os.fstat(descriptor)
    if stat.S_ISDIR(status.st_mode):
        os.close(descriptor)
        raise error(f"unopenable_{media}_file", f"{path!r} is a directory, not a file")
    return descriptor, status


def read_image_file(path: str) -> bytes:
    """The bytes of the image file at `path`, or `ImageDecodeError` (missing_image_file,
    unopenable_image_file: `open_media_file`). Only a regular file is read: a FIFO, socket or
    device (/dev/zero) named by the data would block a worker or never end, so it is
    unopenable_image_file too, as is a file whose read fails (an I/O error): no image was read."""
    descriptor, status = open_media_file(path, "image", ImageDecodeError)
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(status.st_mode):
            raise ImageDecodeError("unopenable_image_file",
                                   f"{path!r} is not a regular file (a FIFO, socket or device)")
        try:
            return file.read()
        except OSError as exc:
            raise ImageDecodeError("unopenable_image_file",
                                   f"{path!r} cannot be read ({type(exc).__name__}: {exc.strerror})") from None
