"""Barcodes: the per-step record of global-batch SHA-256s, and comparing two of them.

A barcode file is JSON Lines, one `{"step": s, "digest": "<sha256 hex>"}` per global step. Two runs
of the same recipe must have identical barcodes; `compare` names the first step that differs.
"""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["BarcodeWriter", "read_barcode", "compare_barcodes", "BarcodeComparison", "draw_barcodes"]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class BarcodeWriter:
    """Appends one line per step; flushes each line so a crashed run still leaves its barcode."""

    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "a", encoding="utf-8")

    def write(self, step: int, digest: str) -> None:
        """Append `step`'s digest. A line `read_barcode` would refuse (a float or negative step, a
        digest not 64 lowercase hex digits) is refused here, before it is written: found only at
        `compare`, after the run, it made the whole barcode unreadable. A NumPy integer step is
        written as the integer it is."""
        try:
            step = operator.index(step) if not isinstance(step, bool) else step
        except TypeError:
            pass  # refused below, naming it
        if type(step) is not int or step < 0 or not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            raise ValueError(
                f"not a barcode entry: step {step!r} must be a non-negative integer and digest {digest!r} "
                "a SHA-256 in 64 lowercase hex digits"
            )
        self._file.write(json.dumps({"step": step, "digest": digest}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> BarcodeWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_barcode(path: str | Path) -> dict[int, str]:
    """Step → digest. A step may appear again (a run resumed from an earlier checkpoint appends the
    steps it replays) only with the same digest: a replay that differs is refused, naming the line,
    rather than letting the later line hide the difference."""
    barcode = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    entry = json.loads(line)
                    step, digest = entry["step"], entry["digest"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: not a barcode line ({exc})") from None
                # int() and str() made a step 1.7 or true step 1 and a digest null "None": two such
                # files compared as identical.
                if type(step) is not int or step < 0 or not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
                    raise ValueError(
                        f"{path}:{n}: not a barcode line (step {step!r} must be a non-negative integer and "
                        f"digest {digest!r} a SHA-256 in 64 lowercase hex digits)"
                    )
                if barcode.setdefault(step, digest) != digest:
                    raise ValueError(
                        f"{path}:{n}: step {step} again with another digest ({digest}, earlier "
                        f"{barcode[step]}): the replayed step differs"
                    )
    return barcode


@dataclass(frozen=True)
class BarcodeComparison:
    common_steps: tuple[int, ...]
    mismatched_steps: tuple[int, ...]
    only_in_a: tuple[int, ...]
    only_in_b: tuple[int, ...]

    @property
    def first_mismatch(self) -> int | None:
        return self.mismatched_steps[0] if self.mismatched_steps else None

    @property
    def identical(self) -> bool:
        """Same digest at every step, and the same steps: a run that stopped early differs."""
        return not (self.mismatched_steps or self.only_in_a or self.only_in_b)


def compare_barcodes(a: dict[int, str], b: dict[int, str]) -> BarcodeComparison:
    common = sorted(set(a) & set(b))
    return BarcodeComparison(
        common_steps=tuple(common),
        mismatched_steps=tuple(s for s in common if a[s] != b[s]),
        only_in_a=tuple(sorted(set(a) - set(b))),
        only_in_b=tuple(sorted(set(b) - set(a))),
    )


def draw_barcodes(a: dict[int, str], b: dict[int, str], path: str | Path, labels: Iterable[str] = ("A", "B")) -> None:
    """A PNG with one vertical stripe per step for each run (colour from the digest, so equal
    digests look equal) and a red marker row under every mismatching step. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = sorted(set(a) | set(b))
    def colours(run):
        return np.array([[int(run[s][i : i + 2], 16) / 255 for i in (0, 2, 4)] if s in run else [1, 1, 1] for s in steps])

    mismatch = np.array([[1, 0, 0] if (s in a and s in b and a[s] != b[s]) else [1, 1, 1] for s in steps])
    image = np.stack([colours(a), colours(b), mismatch])
    labels = [*labels, "differs"]
    # The stripes' width, and room for the longest label (the CLI's are the files' paths, about
    # 0.08 inch a character): a fixed width cramped them and warned "Tight layout not applied".
    fig, ax = plt.subplots(figsize=(max(4, len(steps) / 8) + 0.08 * max(map(len, labels)), 1.6))
    try:  # closed even when the file cannot be written: pyplot would keep the figure for good
        ax.imshow(image, aspect="auto", interpolation="nearest")
        ax.set_yticks([0, 1, 2], labels)
        ax.set_xlabel("global step")
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).astype(int) if steps else []
        ax.set_xticks(ticks, [steps[i] for i in ticks])
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
