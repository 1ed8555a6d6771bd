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

A URL with the slash whose server answers with a page that is no directory listing (an HTML page
linking to no file below it, a JSON body, a text/plain 200) was read as an empty directory, since
fsspec's `ls` finds no link there, and surfaced as a dataset holding no shard. Where the walk finds
no file, the page is looked at (`check_a_listing`): one linking to a subdirectory below it is a
listing, one linking to nothing is an empty directory's index only where it is HTML whose text
names the directory's path, as static file servers title theirs (`an_empty_listing`); any other is a
ConfigurationError naming the URL and the Content-Type it was sent as (`not_a_listing_error`).
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urljoin, urlsplit

from .._errors import ConfigurationError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "an_empty_listing", "an_index_page", "check_a_listing", "entries_below", "index_page_error", "not_a_listing_error",
    "path_of",
]

# How much of a page linking to nothing below its directory is read to tell an empty index from another page.
_PAGE_BYTES_READ = 64 * 1024


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


def check_a_listing(fs: AbstractFileSystem, url: str, directory: str) -> None:
    """Raise `not_a_listing_error` where `directory`'s page, in which the walk found no file, is no
    directory listing (module docstring). Asked only then, at the cost of one listing, one `info()`
    and one read of the page's first `_PAGE_BYTES_READ` bytes: a page that links to a
    subdirectory is a listing, whatever it holds; one linking to nothing below it is an empty
    directory's only where it is HTML whose text names the directory's path (`an_empty_listing`)."""
    if entries_below(directory, fs.ls(directory, detail=True)):
        return
    mimetype = fs.info(directory).get("mimetype")
    page = fs.cat_file(directory, start=0, end=_PAGE_BYTES_READ) if mimetype in (None, "text/html") else b""
    if not an_empty_listing(directory, mimetype, page[:_PAGE_BYTES_READ]):
        raise not_a_listing_error(url, mimetype)


def an_empty_listing(directory: str, mimetype: str | None, page: bytes) -> bool:
    """Whether `page`, sent as `mimetype` (None where the filesystem does not tell it) for
    `directory` and linking to nothing below it, is an empty directory's index: HTML whose text
    names the directory's path, as static file servers title their index pages ("Directory
    listing for /data/empty/", "Index of /data/empty"). A JSON or plain-text body, or an HTML page
    whose text does not name the path, at most its links do (a login page, an application's page,
    a CDN's error page sent with a 200), is none."""
    if mimetype not in (None, "text/html"):
        return False
    text = html.unescape(page.decode("utf-8", errors="replace"))
    if mimetype is None and not re.search(r"<(html|title)\b", text, re.IGNORECASE):
        return False
    path = path_of(directory).rstrip("/") or "/"
    # The path whole, in the page's text as a title or heading writes it ("Index of /data/empty"):
    # not inside a link (a login page's `action="/data/"`, `?next=/data/`, a canonical URL), nor
    # the start of another path (`/site-assets/…` is not `/site`).
    named = "|".join(re.escape(form) for form in sorted({path, unquote(path)}))
    return re.search(rf"(?<=[>\s])(?:{named})/?(?=[<\"'\s]|$)", text) is not None


def not_a_listing_error(url: str, mimetype: str | None) -> ConfigurationError:
    """The error for a directory URL (ending in "/") whose server answers with a page that is no
    directory listing (`check_a_listing`)."""
    sent = f"Content-Type {mimetype}" if mimetype else "a Content-Type fsspec's blocking HTTP filesystem does not tell"
    return ConfigurationError(
        f"{url} answers with a page ({sent}) that is no directory listing Zephon can read: a URL ending in '/' "
        "is read as a directory from the index page its server makes, whose links name its files, and this page "
        "links to no file or directory below it nor names the directory as an empty index does. Name the shards by "
        "their own URLs, or give a glob on a store that can be listed (s3://, gs://, a local path)"
    )
