"""What Hugging Face `datasets` writes beside its Arrow files, and what a directory of them means.

`Dataset.save_to_disk(dir)` writes `data-00000-of-00001.arrow` (more shards for a large dataset)
beside two JSON files of its own, `state.json` and `dataset_info.json`, which are no records: they
are passed over, so that such a directory is an Arrow dataset as it stands, where by suffix it held
two formats. Two layouts would be read as something else than one dataset, and are refused naming
what to read instead:

- `DatasetDict.save_to_disk(dir)` writes a directory per split under a `dataset_dict.json`: read
  whole, the train and test splits were one dataset;
- the cache `datasets` keeps of a dataset (`~/.cache/huggingface/datasets/.../<hash>/`) holds
  beside the dataset's own files a `cache-<fingerprint>.arrow` for each `map` or `filter` run on
  it: other versions of its records, read whole as more of them.

A glob (`dir/train/*.arrow`, `dir/*-train*.arrow`) names the files meant, and is taken as named.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping

from .._errors import ConfigurationError
from ._listing import Listing

__all__ = ["ARROW_SUFFIXES", "without_datasets_sidecars"]

ARROW_SUFFIXES = (".arrow", ".feather")
_SIDECARS = frozenset({"state.json", "dataset_info.json"})
_DATASET_DICT = "dataset_dict.json"
_CACHE_PREFIX = "cache-"
_NAMES_SHOWN = 3


def without_datasets_sidecars(url: str, listing: Listing, files: Mapping[str, int | None]) -> dict[str, int | None]:
    """`files` without the JSON files `datasets` writes beside its Arrow files (in a directory
    holding one); raises ConfigurationError for a directory that holds a `DatasetDict`'s splits or
    a dataset's cache files (module docstring)."""
    arrow = sorted(path for path in files if path.lower().endswith(ARROW_SUFFIXES))
    if not arrow:
        return dict(files)
    prefix = listing.path.rstrip("/") + "/"
    if listing.kind == "directory":
        if (splits := _dataset_dict_splits(files, arrow)) is not None:
            example = next((split for split in splits if split.endswith("/train")), splits[0])
            raise ConfigurationError(
                f"{url} holds a DatasetDict saved by Hugging Face datasets ({_DATASET_DICT}), whose splits "
                f"({', '.join(name.removeprefix(prefix) for name in splits)}) would be read as one dataset: "
                f"name one split's directory ({example})"
            )
        if cached := [path for path in arrow if posixpath.basename(path).startswith(_CACHE_PREFIX)]:
            shown = ", ".join(path.removeprefix(prefix) for path in cached[:_NAMES_SHOWN])
            more = f" and {len(cached) - _NAMES_SHOWN} more" if len(cached) > _NAMES_SHOWN else ""
            raise ConfigurationError(
                f"{url} holds the cache files Hugging Face datasets writes for each map or filter run on a "
                f"dataset ({shown}{more}), other versions of its records, beside the dataset's own files: name "
                "the files meant with a glob (`.../*-train*.arrow`), or save the dataset with save_to_disk and "
                "name that directory"
            )
    holding_arrow = {posixpath.dirname(path) for path in arrow}
    return {
        path: size for path, size in files.items()
        if not (posixpath.basename(path) in _SIDECARS and posixpath.dirname(path) in holding_arrow)
    }


def _dataset_dict_splits(files: Mapping[str, int | None], arrow: list[str]) -> list[str] | None:
    """The split directories below a `dataset_dict.json` that hold Arrow files, or None."""
    for path in files:
        if posixpath.basename(path) == _DATASET_DICT:
            top = posixpath.dirname(path) + "/"
            below = {posixpath.dirname(arrow_file) for arrow_file in arrow if arrow_file.startswith(top)}
            splits = sorted(folder for folder in below if folder + "/" != top)
            if splits:
                return splits
    return None
