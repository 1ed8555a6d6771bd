"""From a user's URL to a sorted list of shard files and their format.

A URL names one file (one shard), a directory (every shard below it) or a glob (every matching
shard). In a directory or glob only files of the dataset's format count, so a README or a `_SUCCESS`
marker next to the data is not mistaken for a shard; hidden files (basename starting with ".") are
ignored, and so are the files of a hidden directory below the URL that the URL does not name (a
Hugging Face snapshot's `.cache/`, Jupyter's `.ipynb_checkpoints/`). A link whose target is gone is a missing shard when its name is a shard's (a
ConfigurationError naming the link and its target), and passed over like any other file otherwise.
Paths are sorted, so the same URL always gives the same shards in the same order. Beside Arrow
files, the JSON files Hugging Face `datasets` writes there are no shards, and two of its layouts
that would be read as something else than one dataset are refused (`_datasets_layout`).

Suffixes are compared in any case: `B.JSONL`, `C.Jsonl.GZ` (gzip), `D.PARQUET` and `E.TAR`, as
Windows tools and some exporters write them, are shards of their format, where they were passed over
like a README. Only the comparison ignores case, never the path: `a.jsonl` and `a.JSONL` are two
files, and two shards.

A file named like a shard of the dataset's format under a compression Zephon does not read
(`part-7.jsonl.bz2`, `shard-4.txz`, `p.parquet.gz`: Parquet and Arrow are read by seeking, so only
line formats and tars may be gzip or zstd, a tar as `.tar.gz`, `.tgz`, `.tar.zst` or `.tzst`) is a
ConfigurationError naming it: passed over like a README, its records were missing from the plan
unsaid. Names that only add a suffix (`a.jsonl.md5`,
`a.JSONL.MD5`, `a.tar.bak`) are no shards, as before.

A URL that names an existing file or directory as written is that file or directory, even when its
name holds glob characters (`data[1].jsonl`, `run[2024]/`): read as a glob, `data[1].jsonl` would
silently be `data1.jsonl`. Only a URL that names nothing is expanded as a glob, so a glob whose
fixed part holds such a character escapes it as `glob.escape` does (`run[[]2024]/*.jsonl`).

What a URL names is asked once (`info()`; `os.stat` for a local path), and only FileNotFoundError
means nothing is there. fsspec's `isdir` and `isfile`, asked before, say False for every OSError,
so a store out of reach (a refused connection, a 5xx, EIO from a mounted bucket) read as a URL
naming nothing, a ConfigurationError no retry looks at; such an error now reaches the caller's
retry. Permission denied is a ConfigurationError naming the URL, never retried: a denial lasts
until the credentials, `storage_options` or the permissions change; so is a client that found no
credentials to sign with (`_credentials`). fsspec's HTTP `info()` raises
FileNotFoundError for every failure, so there the status under it is read (`_http_status`): a 401
or 403 is a denial, a 5xx or a failed connection reaches the retry, a 404 is nothing there. A shard
whose server tells no size (no Content-Length, or one of a Content-Encoding) is an UnsizedShardError
naming it. A directory that holds no shard of the format says so, naming a few of the files it holds (or that it is empty), where it
read as a glob that matched nothing.

On http(s), where `info()` calls every URL a file, a URL whose path ends in "/" names a directory:
its shards are the files of the format its index page links to directly below it, and those of the
subdirectories it links to (`_http_index`); one without the slash that answers with an HTML page,
redirected to the slash or named with no suffix, is a ConfigurationError saying to add it. The
format and compression of an http(s) file named directly are guessed from its URL's path: a signed
URL's query (`?X-Amz-Signature=…`) is no part of its name.

A URL behind fsspec's cache (`simplecache::https://host/data/`, `filecache::`; `blockcache::` is
refused, `_url_caches`) is listed as the URL without it: what it names is asked of the store
under the cache (`_protocols.store_of`), which the cache hands such questions to anyway, so that
an http(s) one gets all of the above; the cache is what its shards are read through. A URL with the slash whose
page is no directory listing is a ConfigurationError naming its Content-Type, not an empty
directory (`_http_index.check_a_listing`).

`hf://ORG/NAME/CONFIG/SPLIT` is shorthand for the Parquet files the Hugging Face hub keeps for every
dataset on its `refs/convert/parquet` branch (`~parquet` is the hub's alias for that revision),
laid out as `CONFIG/SPLIT/NNNN.parquet`. Any other `hf://` URL (e.g. `hf://datasets/...`) is used
as written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from .._errors import ConfigurationError, relative_path_note
from ._compression import compression_of
from ._credentials import missing_credentials, no_credentials_for
from ._datasets_layout import ARROW_SUFFIXES, without_datasets_sidecars
from ._errors import UnsizedShardError
from ._fsspec_walk import links_to_nothing, lister
from ._http_status import DENIED_STATUS, TRANSIENT_STATUS, refused_by_its_server, status_of
from ._listing import Listing
from ._local import LocalFiles, is_plain_path, list_local
from ._protocols import is_http, is_local, store_of
from ._retry import is_transient
from ._url_caches import refuse_block_cache

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["FORMATS", "Located", "infer_format", "hf_parquet_url", "locate"]

FORMATS = ("arrow", "jsonl", "parquet", "text", "webdataset")

_LINE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "text"}
_PLAIN_SUFFIXES = {".parquet": "parquet", ".tar": "webdataset", **{suffix: "arrow" for suffix in ARROW_SUFFIXES}}
_SUFFIXES = {**_LINE_SUFFIXES, **_PLAIN_SUFFIXES}
_COMPRESSIBLE_SUFFIXES = {**_LINE_SUFFIXES, ".tar": "webdataset"}  # what a .gz or .zst may follow
_HUB_REPO_TYPES = ("datasets", "models", "spaces")
_GLOB_CHARS = "*?["
# Compressions of whole files that no format here decodes, and the suffixes that mean "a compressed
# tar" in one of them (those GNU tar's --auto-compress knows, but .tgz and .tzst: gzip and zstd).
_UNREAD_COMPRESSIONS = (".bz2", ".xz", ".lzma", ".lz4", ".br", ".snappy", ".zip", ".7z")
_COMPRESSED_TAR = (".taz", ".tbz", ".tbz2", ".tb2", ".txz", ".tlz")
_READ_COMPRESSED_TAR = {".tgz": "gzip", ".tzst": "zstd"}  # what `.tar.gz` and `.tar.zst` are short for


@dataclass(frozen=True)
class Located:
    """The shard files of a URL: `paths[i]` is `nbytes[i]` long and compressed with `compressions[i]`.
    `listed[i]` is what the filesystem told of it when listing it (fsspec's details: size, ETag,
    modification time...), which planning reads its version from; None for a file listed by the
    standard library."""

    fs: AbstractFileSystem | LocalFiles
    format: str
    paths: tuple[str, ...]
    nbytes: tuple[int, ...]
    compressions: tuple[str | None, ...]
    listed: tuple[Mapping[str, Any] | None, ...]


def infer_format(path: str) -> tuple[str, str | None] | None:
    """(format, compression) named by a file's suffixes in any case, or None when they name no known
    format.

    Only line formats and tars may be compressed: Parquet and Arrow are read by seeking into them.
    """
    name = path.lower()
    for suffix, compression in _READ_COMPRESSED_TAR.items():
        if name.endswith(suffix):
            return "webdataset", compression
    compression = compression_of(name)
    stem = name[: name.rfind(".")] if compression else name
    for suffix, fmt in (_COMPRESSIBLE_SUFFIXES if compression else _SUFFIXES).items():
        if stem.endswith(suffix):
            return fmt, compression
    return None


def _hidden(path: str) -> bool:
    """A dot file (`.DS_Store`, an editor's `._x.jsonl`), never planned as a shard of a listing."""
    return path.rpartition("/")[2].startswith(".")


def _in_hidden_directory(listing: Listing) -> Callable[[str], bool]:
    """Whether a file `listing` found lies in a hidden directory below what the URL names, one the
    URL did not spell: a Hugging Face snapshot's `.cache/`, Jupyter's `.ipynb_checkpoints/` (a copy
    of each shard opened in the editor), a desktop's `.Trash-1000/`. Their files are no more the
    dataset's than a hidden file is, and planning them read their records beside (or twice with)
    the dataset's, unsaid. The directories the URL passes through (`~/.cache/...` of a hub cache)
    and those its glob's parts spell (`.cache/*`, `.c*/`) are read as named. Made once per listing:
    a path holding no "/." after the URL's fixed part is answered without splitting it."""
    url_parts = listing.path.rstrip("/").split("/")
    fixed = len(url_parts)
    if listing.kind == "glob":  # a directory is taken literally, its `[` and `*` too
        fixed = next((i for i, part in enumerate(url_parts) if any(c in part for c in _GLOB_CHARS)), fixed)
    prefix = len("/".join(url_parts[:fixed]))
    spelled = [part for part in url_parts[fixed:] if part.startswith(".")] if listing.kind == "glob" else []

    def hidden(path: str) -> bool:
        if "/." not in path[prefix:]:
            return False
        return any(
            part.startswith(".") and not any(fnmatchcase(part, pattern) for pattern in spelled)
            for part in path.split("/")[fixed:-1]
        )

    return hidden


def _may_be_a_shard(path: str) -> bool:
    """Whether a file a listing found may be planned as a shard: named as one of a known format and
    not hidden (see `locate`)."""
    return not _hidden(path) and infer_format(path) is not None


def _may_be_a_shard_below(path: str, kind: Literal["directory", "glob"]) -> Callable[[str], bool]:
    """`_may_be_a_shard` for the listing of `path`, also false in a hidden directory below it: the
    walk asks only such files their size (`_fsspec_walk`), and one in `.ipynb_checkpoints/`, no
    shard, cost a request, and failed the dataset where its server would not describe it."""
    in_hidden_directory = _in_hidden_directory(Listing(path, kind))
    return lambda file: _may_be_a_shard(file) and not in_hidden_directory(file)


def _unreadable_shard(path: str) -> tuple[str, str] | None:
    """(format, why it cannot be read) for a file named like a shard of a format but compressed in a
    way that format is not read in, or None. Suffixes are compared in any case, and named as written."""
    name = path.lower()
    written = path[path.rfind(".") :]
    if name.endswith(_COMPRESSED_TAR):
        why = "a compressed tar in a compression Zephon does not read: a tar may be .tar.gz, .tgz, .tar.zst or .tzst"
        return "webdataset", f"({written}, {why})"
    stem, dot, suffix = name.rpartition(".")
    if compression_of(name) is not None:
        plain = infer_format(stem)
        if plain is not None and plain[0] in ("arrow", "parquet"):
            return plain[0], f"({written}: {plain[0]} shards are read by seeking, so they cannot be compressed)"
        return None
    if dot + suffix in _UNREAD_COMPRESSIONS and (plain := infer_format(stem)) is not None and plain[1] is None:
        return plain[0], f"({written} is no compression Zephon reads: line shards and tars may be .gz, .zst or .zstd)"
    return None


def _refuse_unreadable(path: str, url: str, fmt: str, why: str) -> NoReturn:
    raise ConfigurationError(
        f"{path} is a {fmt} shard of {url} that cannot be read {why}: decompress it, or move it out "
        "of the dataset"
    )


def hf_parquet_url(url: str) -> str | None:
    """The hub Parquet glob for `hf://ORG/NAME/CONFIG/SPLIT`, or None for any other URL."""
    if not url.startswith("hf://"):
        return None
    parts = url[len("hf://") :].strip("/").split("/")
    if len(parts) != 4 or not all(parts) or parts[0] in _HUB_REPO_TYPES:
        return None
    org, name, config, split = parts
    return f"hf://datasets/{org}/{name}@~parquet/{config}/{split}/*.parquet"


def locate(url: str, format: str | None, storage_options: dict) -> Located:
    """List the shards of `url`; raise ConfigurationError when there are none or the format is unclear."""
    if format is not None and format not in FORMATS:
        raise ConfigurationError(f"format={format!r} is not one of {FORMATS}")
    hub_url = hf_parquet_url(url)
    if hub_url is not None:
        if format not in (None, "parquet"):
            raise ConfigurationError(f"{url} names hub Parquet files, but format={format!r}")
        try:
            return _locate_listed(hub_url, "parquet", storage_options)
        except ConfigurationError as error:
            partial = _partial_conversion(url, hub_url, storage_options)
            if partial is None:
                raise
            raise partial from error
    return _locate_listed(url, format, storage_options)


def _partial_conversion(url: str, hub_url: str, storage_options: dict) -> ConfigurationError | None:
    """The error for a hub split converted only in part, or None where there is no such part.

    The hub's Parquet conversion holds only the first 5 GB of a larger split, under
    `CONFIG/partial-SPLIT/`, so the shorthand's `CONFIG/SPLIT/*.parquet` matches nothing: the
    error says where the part is and that it is a part, rather than that nothing matched."""
    directory, _, pattern = hub_url.rpartition("/")
    config, _, split = directory.rpartition("/")
    partial = f"{config}/partial-{split}/{pattern}"
    try:
        _, listing = _list(partial, storage_options)
    except (ConfigurationError, OSError):  # the original error stands
        return None
    if listing is None or not listing.sizes:
        return None
    repository = hub_url[: hub_url.index("@~parquet")]
    return ConfigurationError(
        f"{url}: the hub converted only the first 5 GB of this split to Parquet, as {partial}; name "
        f"those files to read that part, or the repository's own files ({repository}/...) to read it all"
    )


def _locate_listed(url: str, format: str | None, storage_options: dict) -> Located:
    """`locate` for a URL as it is listed (a hub shorthand already rewritten)."""
    try:
        fs, listing = _list(url, storage_options)
    except PermissionError as error:
        raise ConfigurationError(
            f"{url} may not be listed ({error}): check the credentials, storage_options or the path's permissions"
        ) from error
    except Exception as error:
        if missing_credentials(error):
            raise no_credentials_for(url, error) from error
        raise
    if listing is None:
        raise ConfigurationError(f"{url} is not a file, a directory or a glob that matches anything{_relative_to(url)}")
    if listing.kind == "file":
        return _single_file(fs, listing.path, url, format, listing.details.get(listing.path))
    in_hidden_directory = _in_hidden_directory(listing)
    files = {p: size for p, size in listing.sizes.items() if not _hidden(p) and not in_hidden_directory(p)}
    if not files and listing.kind == "glob":
        passed_over = _passed_over_in_hidden_directories(listing)
        raise ConfigurationError(f"{url} matches no files{passed_over}{_relative_to(url)}")
    if format in (None, "arrow"):
        files = without_datasets_sidecars(url, listing, files)
    inferred = {p: infer_format(p) for p in files}
    unreadable = {p: u for p in files if (u := _unreadable_shard(p)) is not None}
    if format is None:
        found = sorted({fc[0] for fc in [*inferred.values(), *unreadable.values()] if fc is not None})
        if not found and listing.kind == "directory":
            raise _holds_no_shard(url, listing, None)
        if len(found) > 1:
            raise _several_formats(url, listing, {**inferred, **unreadable})
        if not found:
            raise ConfigurationError(f"{url} holds no file of a known format; pass format= (one of {FORMATS})")
        format = found[0]
    for p, (fmt, why) in sorted(unreadable.items()):
        if fmt == format:
            _refuse_unreadable(p, url, fmt, why)
    paths = sorted(p for p, fc in inferred.items() if fc is not None and fc[0] == format)
    if not paths:
        if listing.kind == "directory":
            raise _holds_no_shard(url, listing, format)
        raise ConfigurationError(f"{url} holds no {format} shards")
    for p in paths:
        if files[p] is None:  # see `list_local` and `_fsspec_walk`
            raise _sizeless(fs, p, url, listing.details.get(p))
    return Located(
        fs,
        format,
        tuple(paths),
        tuple(int(files[p]) for p in paths),
        tuple(inferred[p][1] for p in paths),
        tuple(listing.details.get(p) for p in paths),
    )


def _sizeless(
    fs: AbstractFileSystem | LocalFiles, path: str, url: str, details: Mapping[str, Any] | None
) -> ConfigurationError:
    """The error for a shard listed with no size: a link to nothing, or a file its server tells
    no size of (`UnsizedShardError`)."""
    if is_local(fs):
        target = f"links to {os.path.realpath(path)}, which does not exist"
    elif links_to_nothing(details):
        target = "is a link to nothing"
    else:
        return UnsizedShardError(path, url)
    return ConfigurationError(
        f"{path} is a shard of {url} that {target}: the shard is missing (a deleted blob of a Hugging Face "
        "cache, a moved file)"
    )


def _relative_to(url: str) -> str:
    """Where a plain local path was looked for (`relative_path_note`); nothing for a URL."""
    return relative_path_note(url) if is_plain_path(url) else ""


_NAMES_SHOWN = 5


_NAMES_SHOWN_PER_FORMAT = 2


def _several_formats(url: str, listing: Listing, formats: Mapping[str, tuple[str, Any] | None]) -> ConfigurationError:
    """The error for a directory or glob holding files of several formats and no `format=`, naming
    the first files of each: a sidecar read as a format of its own (img2dataset's
    `00000_stats.json` beside its tars is JSON Lines by suffix) shows at once."""
    prefix = listing.path.rstrip("/") + "/"
    by_format: dict[str, list[str]] = {}
    for path, found in sorted(formats.items()):
        if found is not None:
            by_format.setdefault(found[0], []).append(path.removeprefix(prefix))
    held = []
    for fmt, names in sorted(by_format.items()):
        more = len(names) - _NAMES_SHOWN_PER_FORMAT
        held.append(f"{fmt} ({', '.join(names[:_NAMES_SHOWN_PER_FORMAT])}{f' and {more} more' if more > 0 else ''})")
    return ConfigurationError(
        f"{url} holds files of several formats: {', '.join(held)}; pass format= naming the dataset's "
        f"(one of {FORMATS}): the others' files are then passed over"
    )


def _holds_no_shard(url: str, listing: Listing, format: str | None) -> ConfigurationError:
    """The error for a directory that exists but holds no shard of `format` (of any format read,
    when None), naming the first few files it holds, hidden ones included, so that a wrong
    directory or a wrong format= shows at once."""
    what = f"{format} file" if format else f"file of a format read here ({', '.join(FORMATS)}, by suffix)"
    prefix = listing.path.rstrip("/") + "/"
    names = sorted(p.removeprefix(prefix) for p in listing.sizes)
    if not names:
        return ConfigurationError(f"the directory {url} exists but holds no {what}: it is empty")
    more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    return ConfigurationError(
        f"the directory {url} exists but holds no {what}; it holds {', '.join(names[:_NAMES_SHOWN])}{more}"
        f"{_passed_over_in_hidden_directories(listing)}"
    )


def _passed_over_in_hidden_directories(listing: Listing) -> str:
    """What an error saying a listing holds no shard adds where files named as shards lie in
    hidden directories below its URL: they were passed over, and how to read them."""
    in_hidden_directory = _in_hidden_directory(listing)
    if any(in_hidden_directory(p) and infer_format(p) is not None for p in listing.sizes):
        return " (files in hidden directories below it are passed over: name such a directory in the URL to read it)"
    return ""


def _list(url: str, storage_options: dict) -> tuple[AbstractFileSystem | LocalFiles, Listing | None]:
    """The URL's filesystem and what it names, None when nothing is there.

    A plain local path is listed with the standard library, and so is a `file://` URL: fsspec's
    local listing passes over linked directories. Elsewhere the URL is asked for its `info()`
    once, which tells a directory (then listed with details, one call), a file (whose details are
    kept for its size and version) and nothing (FileNotFoundError alone: then a glob is expanded,
    and its FileNotFoundError is a glob matching nothing, not an error to retry).
    """
    if is_plain_path(url) and not storage_options:
        return LocalFiles(), list_local(url, has_glob=any(char in url for char in _GLOB_CHARS))
    import fsspec  # only here: see _local for what importing it costs

    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    refuse_block_cache(fs, url)
    has_glob = any(char in path for char in _GLOB_CHARS)
    if is_local(fs):
        return fs, list_local(path, has_glob)
    # A cache in front of the store (`simplecache::https://…`) is for reading: what the URL names
    # is asked of the store, which the cache hands such questions to anyway (`_protocols`).
    store = store_of(fs)
    if is_http(store) and path.endswith("/") and not has_glob:
        return fs, _index_listing(store, url, path)
    try:
        info = store.info(path)
    except FileNotFoundError as error:
        if is_http(store):
            _raise_unless_not_found(url, error, _a_pattern_as_a_url(path))
        info = None
    if info is not None and info["type"] == "directory":
        found = lister(store, url, _may_be_a_shard_below(path, "directory")).find(path, detail=True)
        return fs, _files_of(path, "directory", found)
    if info is not None and info["type"] == "file":
        if is_http(store) and _index_pages().an_index_page(path, info):
            raise _index_pages().index_page_error(url)
        return fs, Listing(path, "file", details={path: info})
    if not has_glob:
        return fs, None
    try:
        matches = lister(store, url, _may_be_a_shard_below(path, "glob")).glob(path, detail=True)
    except FileNotFoundError as error:  # the glob's directory is missing; the hub says why (a repository not found)
        raise ConfigurationError(f"{url} matches no files ({error})") from error
    return fs, _files_of(path, "glob", matches)


def _index_pages():
    """`_http_index`, imported for http(s) datasets only: it brings `html` and `urllib.parse`
    (about 1 MiB of every process's memory on 3.14t), which local and other remote data never use."""
    from . import _http_index

    return _http_index


def _index_listing(fs: AbstractFileSystem, url: str, path: str) -> Listing | None:
    """The files an http(s) directory's index page links to, and those of its subdirectories'
    (`_http_index`), None where the page is not there. As for `info()`, only a 404
    (FileNotFoundError), or a status that is neither a denial (a ConfigurationError naming the
    directory, from the walk) nor worth a retry, means nothing there. A page in which the walk
    finds no file is refused unless it is a listing (`check_a_listing`)."""
    try:
        found = lister(fs, url, _may_be_a_shard_below(path, "directory")).find(path, detail=True)
    except FileNotFoundError:
        return None
    except Exception as error:
        if (status := status_of(error)) is not None and status not in TRANSIENT_STATUS | DENIED_STATUS:
            return None
        raise
    if not found:  # an empty directory, or a page that is no listing at all
        _index_pages().check_a_listing(fs, url, path)
    return _files_of(path, "directory", found)


def _a_pattern_as_a_url(path: str) -> bool:
    """Whether an http(s) URL holds a glob's pattern, which a server may deny as a URL taken
    literally. Not where its only glob character is the `?` that begins a query of `key=value`
    pairs: that is a signed URL (S3's, GCS's, a CDN's), whose server denies it as itself once
    its signature has expired, and which no glob of shards' names is."""
    before, mark, query = path.partition("?")
    return any(char in before for char in _GLOB_CHARS) or bool(mark) and "=" not in query


def _raise_unless_not_found(url: str, error: FileNotFoundError, a_pattern: bool) -> None:
    """Raise what HTTP's `info()` of `url` met, where it told FileNotFoundError for something else
    than nothing there (`_http_status`): a denial as a ConfigurationError naming the URL and the
    status, at once; a server or connection that may answer later as its own error, which the
    caller's retry retries. A URL holding a glob's pattern (`_a_pattern_as_a_url`) that its
    server denies is expanded as a glob, as one it does not have: servers that hide what they do
    not have (S3, CloudFront) answer 403 for a pattern taken literally, and the walk names a
    directory it is denied."""
    cause = error.__cause__
    status = status_of(cause)
    if status in DENIED_STATUS and not a_pattern:
        raise refused_by_its_server(url, status) from cause
    if status in TRANSIENT_STATUS or (status is None and cause is not None and is_transient(cause)):
        raise cause


def _files_of(path: str, kind: Literal["directory", "glob"], listing: Mapping[str, Mapping[str, Any]]) -> Listing:
    files = {p: info for p, info in listing.items() if info["type"] == "file"}
    return Listing(path, kind, {p: info["size"] for p, info in files.items()}, files)


def _single_file(
    fs: AbstractFileSystem | LocalFiles, path: str, url: str, format: str | None, details: Mapping[str, Any] | None
) -> Located:
    """A file named directly is a shard whatever its name, once its format is known. The name of
    an http(s) one is its URL's path (`_http_index.path_of`): a signed URL's query followed it,
    so that its format was never guessed and a gzip shard's compression was missed."""
    name = _index_pages().path_of(path) if is_http(fs) else path
    inferred = infer_format(name)
    unreadable = _unreadable_shard(name)
    if unreadable is not None and format in (None, unreadable[0]):
        _refuse_unreadable(path, url, *unreadable)
    if format is None:
        if inferred is None:
            raise ConfigurationError(f"cannot infer the format of {url} from its name; pass format=")
        format = inferred[0]
    compression = (compression_of(name) if format in ("jsonl", "text")
                   else inferred[1] if format == "webdataset" and inferred is not None and inferred[0] == format
                   else None)
    size = fs.size(path) if details is None else details["size"]
    if size is None:
        raise UnsizedShardError(url, url)
    return Located(fs, format, (path,), (int(size),), (compression,), (details,))
