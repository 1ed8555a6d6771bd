"""Images held encoded until their row is decoded: decode after packing.

A decoded image is 4-15x larger than its PNG or JPEG (the race's PNGs: 22.9 MiB encoded, 93.7 MiB
decoded at 448 px). Decoded before packing, every image waits decoded in its lane's prefetch
window, its open row, the shuffle buffer and the rows a segment's flush releases at once: on the
race's VLM recipe ~900 live images. The packer only needs each image's patch grid, which the
header gives, so `DecodeImages(defer=True)` parses and checks the header on the workers
(`probe_image`) and passes a `DeferredImage`; the loader has each row decoded on the workers a few
rows before it takes the row (`DecodeDeferred`, the packer's row work).

An image whose header parses but whose pixels do not decode can then only fail after its row was
planned. Its document stays where it was placed (the row's layout is a decision already made) but
trains nothing: every label of the document is IGNORE_INDEX, and the image that failed has zero
patches. Its other images keep the pixels they decoded to: the document has no label, so they add
no loss of their own (zeroing them too would change the rows of runs already made). The row
reports it as (address, reason, detail), the loader counts it per lane as `masked:<reason>` with
the rows it hands to the trainer and names it with the decoder's detail in
`stats()["skipped_examples"]`, and with `on_error="raise"` it fails with `BadRecordError` instead. The
same bytes fail the same way on every worker, so the batches stay a pure function of the recipe.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

import numpy as np

from zephon._errors import BadRecordError

from ._errors import ImageDecodeError
from ._image import ImageSpec, decode_image, decode_image_with_size

__all__ = ["DecodeDeferred", "DeferredImage", "decode_row"]


@dataclass(frozen=True, eq=False)
class DeferredImage:
    """Encoded image bytes whose header was checked, and the (rows, cols) grid they decode to.

    Pickled (protocol 5), the bytes are an out-of-band buffer, so the process runner moves them
    through shared memory like arrays; `data` may then be a read-only view of those pages.
    """

    data: bytes | memoryview
    grid: tuple[int, int]
    spec: ImageSpec
    size: tuple[int, int] | None = None
    """The (height, width) of the picture as shown, from the same header (`probe_image_with_size`),
    where the placeholders count from it (`ImageSpec(fit="split")`'s, `"anyres"`'s and
    `"canvas"`'s)."""

    def __reduce_ex__(self, protocol: int):
        data = pickle.PickleBuffer(self.data) if protocol >= 5 else self.data
        return (DeferredImage, (data, self.grid, self.spec, self.size))

    @property
    def shape(self) -> tuple[int, int, int]:
        """The (H, W, 3) shape `decode()` returns."""
        p = self.spec.patch_size
        return self.grid[0] * p, self.grid[1] * p, 3

    @property
    def dtype(self) -> np.dtype:
        """uint8, what `decode()` returns: with `shape`, how a packer refusing the image describes it."""
        return np.dtype(np.uint8)

    def decode(self) -> np.ndarray:
        """(H, W, 3) uint8 on the planned grid; `ImageDecodeError` if the bytes do not give it."""
        if self.size is None:
            pixels, size = decode_image(self.data, self.spec, probed=True), None  # `grid` came from probe_image
        else:
            pixels, size = decode_image_with_size(self.data, self.spec, probed=True)
        if pixels.shape != self.shape or size != self.size:
            shown = "" if size == self.size else f", a {size[0]}x{size[1]} picture,"
            raise ImageDecodeError(
                "corrupt_image",
                f"decoded to {pixels.shape[:2]}{shown} instead of the {self.shape[:2]} its header announced "
                "(an EXIF orientation after a PNG's pixel data)",
            )
        return pixels


@dataclass(frozen=True)
class DecodeDeferred:
    """The row work of a packer whose images were deferred, in the three parts the loader runs:
    `order(plan)` on its thread (the deferred images, or None), `run(order)` on a worker (the
    pure part: decoding), `apply(plan, done)` in the loader's process once the pixels are back
    (on whichever thread received them; it only builds a new plan). Only the encoded images
    cross to the worker and only their pixels come back, not the whole plan, which matters to the
    process runner: every byte crossing is pickled by the loader's process."""

    on_error: str

    def order(self, plan) -> tuple[DeferredImage, ...] | None:
        """Each deferred image of the row once: a preference pair's two documents hold the same ones
        (`vlm._pairs`), decoded once for both."""
        deferred = dict.fromkeys(image for doc in plan.documents for image in doc.images
                                 if isinstance(image, DeferredImage))  # by identity: no two compare equal
        return tuple(deferred) or None

    @staticmethod
    def run(order: tuple[DeferredImage, ...]) -> list[np.ndarray | tuple[str, str]]:
        """Each image's pixels, or (reason, detail) where it failed."""
        done: list[np.ndarray | tuple[str, str]] = []
        for image in order:
            try:
                done.append(image.decode())
            except ImageDecodeError as exc:
                done.append((exc.reason, exc.detail))
        return done

    def apply(self, plan, done: list):
        """The plan with the pixels in place; a document with a failed image is masked (that image
        zero, its other images as decoded), or with `on_error="raise"` the failure raises
        `BadRecordError` naming its record."""
        decoded = dict(zip(self.order(plan) or (), done))
        documents, masked = [], []
        for number, doc in enumerate(plan.documents):
            if not any(isinstance(image, DeferredImage) for image in doc.images):
                documents.append(doc)
                continue
            images, failure = [], None
            for index, image in enumerate(doc.images):
                if isinstance(image, DeferredImage):
                    pixels = decoded[image]
                    if isinstance(pixels, tuple):
                        reason, detail = pixels
                        if self.on_error == "raise":
                            raise BadRecordError(doc.address, reason, detail)
                        if len(doc.images) > 1:
                            detail = f"image {index + 1} of {len(doc.images)}: {detail}"
                        failure = failure or (reason, detail)
                        pixels = np.zeros(image.shape, dtype=np.uint8)
                    image = pixels
                images.append(image)
            documents.append(dataclasses.replace(doc, images=tuple(images)))
            if failure is not None:
                masked.append((number, *failure))
        return dataclasses.replace(plan, documents=tuple(documents), masked=plan.masked + tuple(masked))


def decode_row(plan, on_error: str):
    """The row plan with every `DeferredImage` decoded here, in this thread (see `DecodeDeferred`)."""
    work = DecodeDeferred(on_error)
    order = work.order(plan)
    return plan if order is None else work.apply(plan, work.run(order))
