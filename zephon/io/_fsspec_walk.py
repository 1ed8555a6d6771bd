"""fsspec's generic `find` and `glob` over a walk that fails at any directory it cannot list.

Filesystems with no listing of their own (sftp, ftp, smb, http(s)) list a tree through fsspec's
generic walk, one `ls` per directory, which takes a directory it cannot list for an empty one.
Asked with `on_error="raise"` it raises for the directory asked only: it does not hand the
argument down, so a directory below it that could not be listed (a dropped connection, a
permission, an HTTP 5xx or 403) still read as empty, and its shards were missing from the plan
unsaid. Here fsspec's own `find` and `glob` run over a walk that lists every directory with
`ls(detail=True)` and raises at each one it cannot list: a denial (PermissionError, HTTP 401 or
403), which waiting does not lift, as a ConfigurationError naming the directory at once; any other
failure of the directory asked as `ls` raised it, as `on_error="raise"` did (FileNotFoundError:
a glob matching nothing); a transient one below it (an OSError, aiohttp's errors that
`is_transient` names) as `UnlistedError` naming it, an OSError, so the caller retries the listing
whole. A 404 for a directory its parent's index page links to is such an error: the retry lists
the parent again, which no longer links a directory removed meanwhile.

http(s)' glob of its own, which differs from fsspec's generic one only in not taking `?` for a
glob character, is not used: it walks with `on_error="raise"`, which reaches the directory asked
only. Its URLs are globbed as every other filesystem's, `?` included, as `_locate` reads them.

A glob's walk lists only the directories that could hold a match, as a local glob does: fsspec's
lists every directory down to the pattern's depth, and one the pattern's fixed parts rule out
(`bucket/private` under `bucket/2024-*/*.jsonl`) failed the dataset once it raised. A symbolic
link, which sftp's listing types "link" (neither file nor directory, so it was dropped with its
shards, unsaid), is resolved by `info`, which follows it: one to a file is listed as that file
under the link's name; one to a directory the walk would list is a ConfigurationError naming it,
since the walk does not follow it (nothing here tells a loop); one to nothing is listed with no
size, which `_locate` refuses where its name is a shard's.

A file listed with no size (an HTTP index page is links, and tells none) is asked its `info()`
once it is found (for a glob, once it matched), as a local glob asks `stat`: planning refused
every such shard as a link to nothing, so that no http(s) glob could be planned. Only a file named
as a shard is asked (the caller's `may_be_a_shard`): a README, a hidden file beside the shards or
one in a hidden directory below the URL cost a request each, and one the server would not describe (a broken link on the index page)
failed the dataset. One that `info()` cannot find (HTTP's says so for any failure) raises
`UnlistedError` naming it, but for one its server denies (401, 403): a ConfigurationError naming it.

On http(s) a directory's entries are the links its index page makes to what is directly below it
(`_http_index.entries_below`): a link up, deeper, or with a query is no entry of it.

A server that follows a symbolic link to a directory above it (a static file server does, and lists
it as a subdirectory) shows no link: the walk went round the loop until the server's own limit on
links (40 on Linux), planning the same shards again each time. A loop repeats: a directory that
lists what the directory one step above it lists, and that one what the one a step further up
lists, the steps being the same names (`data/loop/data/loop/data`), is a ConfigurationError naming
it (`_check_not_round_a_loop`), as a local loop is. Twice, not once: a directory nested under its
own name (`nested/nested/`, an archive unpacked into a folder of its name) may list what its parent
lists once.

Filesystems with a listing of their own (s3fs, gcsfs, the hub's, the memory filesystem) raise by
themselves and are listed as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError
from ._http_status import DENIED_STATUS, denied, refused_by_its_server, status_of
from ._protocols import is_http
from ._retry import is_transient

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["UnlistedError", "links_to_nothing", "lister"]

Details = dict[str, Mapping[str, Any]]
Listed = tuple[frozenset[str], frozenset[str]]  # a directory's subdirectories and files, by name

# How many shards' info() `_sized` asks at once: under requests' pool of 10 connections per host
# (fsspec's blocking HTTP filesystem), past which each extra one is opened, then dropped, warned of.
_INFOS_AT_ONCE = 8
_LINK = "zephon_followed_link"  # in a followed link's details: they are its target's, if it has one


class UnlistedError(OSError):
    """A directory below the one a dataset's URL names could not be listed, or a file a listing
    found could not be looked at. Its own type, so that a vanished subdirectory or file
    (FileNotFoundError) is not read as a glob that matched nothing."""


def links_to_nothing(details: Mapping[str, Any] | None) -> bool:
    """Whether a file the walk listed with no size is a link whose target is gone, not a file
    whose server tells no size."""
    return bool(details and details.get(_LINK))


def lister(fs: AbstractFileSystem, url: str, may_be_a_shard: Callable[[str], bool]) -> Any:
    """What lists `url`'s tree on `fs` (its `find` and `glob`): `fs` itself where it lists by its
    own code; else fsspec's generic `find` and `glob` over a walk that raises, whether or not `fs`
    has a glob of its own over the generic walk (http's: module docstring), asking the size of
    each file found with none that `may_be_a_shard` by its path."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    base, prefix = (AsyncFileSystem, "_") if isinstance(fs, AsyncFileSystem) else (AbstractFileSystem, "")

    def generic(name: str) -> bool:
        # The bound method, not the class's: a caching filesystem (`simplecache::`) hands on those it wraps.
        return getattr(getattr(fs, prefix + name), "__func__", None) is getattr(base, prefix + name)

    if not (generic("find") and generic("walk")):
        return fs
    return _RaisingWalk(fs, url, may_be_a_shard)


class _RaisingWalk:
    """`fs` seen through fsspec's generic `find` and `glob`, whose walk raises (module docstring).
    Holds nothing but `fs`, the URL and what tells a shard; used for one listing."""

    def __init__(self, fs: AbstractFileSystem, url: str, may_be_a_shard: Callable[[str], bool]) -> None:
        self._fs, self._url, self._may_be_a_shard = fs, url, may_be_a_shard
        self._may_hold: Callable[[str], bool] = lambda directory: True
        self._globbing = False  # the generic glob's own `find`: only its matches are sized

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Details:
        from fsspec.spec import AbstractFileSystem

        found = AbstractFileSystem.find(self, path, *args, **kwargs)
        return found if self._globbing else self._sized(found)

    def glob(self, path: str, **kwargs: Any) -> Details:
        from fsspec.spec import AbstractFileSystem

        self._may_hold = _may_hold_a_match(self._fs._strip_protocol(path))
        self._globbing = True
        try:
            matches = AbstractFileSystem.glob(self, path, **kwargs)
        finally:
            self._globbing = False
        return self._sized(matches)

    def isdir(self, path: str) -> bool:
        """`fs.isdir`, which the generic glob asks of its directory: http's lists it, so a denial
        there is one of the directory asked."""
        try:
            return self._fs.isdir(path)
        except Exception as error:
            if denied(error):
                raise self._denial(path, error) from error
            raise

    def isfile(self, path: str) -> bool:
        """False: what the generic `find` asks of a directory in which its walk found nothing,
        to list it as a file. `_locate` finds only in a directory, but on http(s), where its index
        page is a file too, an empty one was listed as that page, with no details."""
        return False

    def _sized(self, found: Details) -> Details:
        """`found` (asked with details, as `_locate` asks), where a shard listed with no size (an
        HTTP index page tells none) has its `info()`: one request per shard found, not per file
        listed, and none where the listing told a size or the file is a link to nothing. Up to
        `_INFOS_AT_ONCE` are asked at a time: one after another, thousands of shards on a distant
        server cost thousands of round trips."""
        unsized = [name for name, info in found.items() if self._unsized_shard(name, info)]
        if not unsized:
            return found
        with ThreadPoolExecutor(min(_INFOS_AT_ONCE, len(unsized)), thread_name_prefix="zephon-info") as pool:
            try:
                infos = dict(zip(unsized, pool.map(self._info, unsized)))
            except BaseException:
                pool.shutdown(cancel_futures=True)  # the first failure in order is raised; ask no more
                raise
        return {name: infos.get(name, info) for name, info in found.items()}

    def _unsized_shard(self, name: str, info: Mapping[str, Any]) -> bool:
        return info["type"] == "file" and info["size"] is None and not info.get(_LINK) and self._may_be_a_shard(name)

    def _info(self, name: str) -> Mapping[str, Any]:
        try:
            return {**self._fs.info(name), "name": name}
        except FileNotFoundError as error:  # HTTP's info says so for any failure: a denial is told by its status
            if (status := status_of(error.__cause__)) in DENIED_STATUS:
                what = f"{name}, a file of {self._url} its directory lists,"
                raise refused_by_its_server(what, status) from error.__cause__
            raise UnlistedError(
                f"{name}, a file of {self._url} its directory lists, could not be looked at ({error}): "
                "it would be missing from the dataset"
            ) from error

    def walk(self, path: str, maxdepth: int | None = None, **_: Any) -> Iterator[tuple[str, Details, Details]]:
        """(directory, its subdirectories, its files) by name, with details, for `path` and the
        directories below it down to `maxdepth` levels: what the generic `find` asks of a walk."""
        top = self._fs._strip_protocol(path)
        pending: list[tuple[str, int | None, dict[str, Listed]]] = [(top, maxdepth, {})]
        while pending:
            directory, depth, above = pending.pop()
            listing = self._listed(directory, below=directory != top)
            subdirectories: Details = {}
            files: Details = {}
            for info in map(self._followed, listing):
                name = info["name"].rstrip("/")
                if info["type"] == "directory" and name != directory:
                    subdirectories[name.rsplit("/", 1)[-1]] = info
                else:
                    files["" if name == directory else name.rsplit("/", 1)[-1]] = info
            listed = (frozenset(subdirectories), frozenset(files))
            self._check_not_round_a_loop(directory.rstrip("/"), listed, above)
            yield directory, subdirectories, files
            if depth is None or depth > 1:
                below = None if depth is None else depth - 1
                way_down = {**above, directory.rstrip("/"): listed}
                for info in subdirectories.values():
                    name = info["name"].rstrip("/")
                    if self._may_hold(name):
                        self._check_not_a_link(name, info)
                        pending.append((name, below, way_down))

    def _check_not_round_a_loop(self, directory: str, listed: Listed, above: Mapping[str, Listed]) -> None:
        """Refuse `directory` where it lists what a directory `above` it lists, and that one what
        the one as far above it lists, the same names down (module docstring). `above` holds the
        listings of the directories the walk came through to reach it."""
        for ancestor, ancestor_listed in above.items():
            step = directory[len(ancestor) :]
            if ancestor_listed == listed and ancestor.endswith(step) and above.get(ancestor[: -len(step)]) == listed:
                raise ConfigurationError(
                    f"{directory}, a directory of {self._url}, lists what {ancestor} and {ancestor[: -len(step)]} "
                    f"list: its server follows a link back up the tree (which it does not show), round which the "
                    "walk would plan the same shards again and again; remove the link, or name the directories "
                    "of the dataset below it"
                )

    def _followed(self, info: Mapping[str, Any]) -> Mapping[str, Any]:
        """`info`, or for a link what it links to under the link's name, marked `_LINK` where it
        links to a directory (refused if the walk would list it) or to nothing (size None, refused
        by `_locate` if it is a shard, and never asked its size)."""
        if info["type"] != "link":
            return info
        name = info["name"].rstrip("/")
        try:
            target = self._fs.info(name)
        except FileNotFoundError:
            return {**info, "name": name, "type": "file", "size": None, _LINK: True}
        return {**target, "name": name, **({_LINK: True} if target["type"] == "directory" else {})}

    def _check_not_a_link(self, directory: str, info: Mapping[str, Any]) -> None:
        if info.get(_LINK):
            raise ConfigurationError(
                f"{directory}, a link of {self._url} to a directory, is not followed on this filesystem (a loop of "
                "links could not be told): its shards would be missing from the dataset; name the directory it "
                "links to in the dataset instead"
            )

    def _listed(self, directory: str, below: bool) -> list[Mapping[str, Any]]:
        """`directory`'s listing. A denial is a ConfigurationError naming it; any other failure of
        the directory asked raises as it is (FileNotFoundError: nothing there), and of one below
        it, where it is transient, as UnlistedError naming it."""
        try:
            listing = self._fs.ls(directory, detail=True)
        except Exception as error:
            if denied(error):
                raise self._denial(directory, error) from error
            if not below or not is_transient(error):
                raise
            raise UnlistedError(
                f"{directory}, a directory of {self._url}, could not be listed ({type(error).__name__}: {error}): "
                "its shards would be missing from the dataset"
            ) from error
        if not is_http(self._fs):
            return listing
        from ._http_index import entries_below  # http(s) only: it imports html and urllib.parse

        return entries_below(directory, listing)

    def _denial(self, directory: str, error: Exception) -> ConfigurationError:
        return ConfigurationError(
            f"{directory}, a directory of {self._url}, may not be listed ({error}): its shards would be "
            "missing from the dataset; check the credentials, storage_options or the directory's permissions"
        )


def _may_hold_a_match(pattern: str) -> Callable[[str], bool]:
    """Whether a directory may hold a file `pattern` matches: each of its parts matches the
    pattern's part at its depth, up to the pattern's first `**`, as fsspec's glob (`glob_translate`)
    matches parts. A directory whose names take another form than the pattern's (a protocol
    prefixed) holds none that fsspec's glob would match either."""
    from fsspec.utils import glob_translate

    parts = pattern.split("/")
    fixed = parts[: parts.index("**")] if "**" in parts else parts
    matchers = [re.compile(glob_translate(part)).match for part in fixed]

    def may_hold(directory: str) -> bool:
        return all(match(name) for match, name in zip(matchers, directory.split("/")))

    return may_hold
