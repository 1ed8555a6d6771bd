"""What an http(s) server's index pages name: the directories of a dataset served over HTTP.

HTTP has no directories, only pages: a static file server (`python -m http.server`, nginx's
autoindex, Apache's mod_autoindex) answers a URL ending in "/" with an HTML page of links to the
files and subdirectories there, which fsspec's HTTPFileSystem `ls` reads. Its `info()` calls every
URL a file, the page too, so a directory URL was planned as one shard of HTML.

A URL whose path ends in "/" is read as a directory (`_locate`), and only what its page links to
*directly below it* is an entry of it (`entries_below`): `ls` keeps every link under the URL's
prefix, so without this a page's `../other/x.jsonl`, a deeper `/data/sub/x.jsonl` (a shard of
`sub/`, listed from its own page), a link with a query (Apache's column-sort links `?C=N;O=D`, a
download button's `a.jsonl?dl=1`: pages the server makes, not files) or a fragment were planned as
shards of the directory. Links to another host or outside the prefix `ls` drops itself. A link is
taken for what it resolves to: `ls` joins it to the URL as written, so Caddy's `./a.jsonl` (it
links every entry so) read as a file deeper down and was dropped; and one `ls` keeps in the
other scheme (`https://` on an `http://` page: a page made behind a TLS proxy) is named in the
directory URL's, as the user named the dataset, where it read as another directory's and was
dropped too. A link ending in "/" is a subdirectory, walked as a local one is; links are named as
the page writes them (percent-encoded where it encodes), once each, and sorted by the caller.

A URL without the slash whose server answers with an HTML page, where it redirected to the URL with
the slash (as static file servers do for a directory) or its name has no suffix, is refused
(`an_index_page`, `index_page_error`) rather than read as a directory: links on such a page resolve
against its parent in a browser (RFC 3986) but under the URL in fsspec, so the two disagree about
what it holds; and an HTML page at such a URL may be no index at all (a login page, a CDN's error
page served with a 200). Adding the slash is one character and says what is meant. A name with a
suffix and no such redirect is a file's: a server whose MIME map lacks its suffix may send it as
text/html (its default type), and `e.ndjson` read with format= was refused as an index page. Only
fsspec's HTTPFileSystem over aiohttp tells a Content-Type (`mimetype`); its blocking one reads such
a URL as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

from .._errors import ConfigurationError

__all__ = ["an_index_page", "entries_below", "index_page_error", "path_of"]


def path_of(url: str) -> str:
    """The path of an http(s) URL, without its query or fragment: what names the file, where a
    signed URL's query (`?X-Amz-Signature=…`) only authorises reading it."""
    return urlsplit(url).path


def entries_below(directory: str, listing: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The entries of `directory`'s index page (`ls` with details) that name a file or
    subdirectory directly below it (module docstring)."""
    prefix = directory.rstrip("/") + "/"
    scheme = urlsplit(prefix).scheme
    below: dict[str, Mapping[str, Any]] = {}
    for entry in listing:
        link = urlsplit(entry["name"])
        if link.query or link.fragment:
            continue
        # The path with its `.` and `..` segments resolved (RFC 3986), in the directory's scheme.
        name = urljoin(f"{scheme}://{link.netloc}/", link.path)
        rest = name[len(prefix) :].removesuffix("/") if name.startswith(prefix) else ""
        if rest and "/" not in rest:
            # Typed by the name resolved, as `ls` types the link written: `sub/.` is the directory
            # `./sub/` is, whichever of the two the page's (unordered) links gave first.
            below[name] = {**entry, "name": name, "type": "directory" if name.endswith("/") else "file"}
    return list(below.values())


def an_index_page(path: str, info: Mapping[str, Any]) -> bool:
    """Whether the file `info()` found at `path` (a URL without the trailing slash) is a
    directory's index page: HTML, reached by a redirect to a URL ending in "/" or named with no
    suffix (module docstring). fsspec's blocking filesystem tells neither type nor URL: never."""
    if info.get("mimetype") != "text/html":
        return False
    name = path_of(path).rpartition("/")[2]
    return path_of(info.get("url", path)).endswith("/") or "." not in name


def index_page_error(url: str) -> ConfigurationError:
    """The error for an http(s) URL without a trailing slash whose server answers with a
    directory's index page (`an_index_page`)."""
    return ConfigurationError(
        f"{url} answers with an HTML page (Content-Type text/html), not a shard: to read the files a "
        f"directory's index page links to, end the URL with '/' ({url}/); an HTML page is no shard of "
        "any format read here"
    )
