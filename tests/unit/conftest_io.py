"""Shared writers and fake filesystems for the zephon.io tests (imported explicitly, not a conftest)."""

from __future__ import annotations

import contextlib
import functools
import gzip
import http.server
import io
import json
import threading
import tarfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem
from fsspec.registry import _registry

if TYPE_CHECKING:
    from zephon.io import Dataset

_COMPRESS = {None: lambda b: b, "gz": gzip.compress, "zst": lambda b: zstandard.ZstdCompressor().compress(b)}


def lines_bytes(lines: list[bytes], *, final_newline: bool = True) -> bytes:
    return b"\n".join(lines) + (b"\n" if final_newline and lines else b"")


def jsonl_bytes(records: list[dict], compression: str | None = None) -> bytes:
    return _COMPRESS[compression](lines_bytes([json.dumps(r).encode() for r in records]))


def compress(data: bytes, compression: str | None) -> bytes:
    return _COMPRESS[compression](data)


def read_all(ds: Dataset, records_per_chunk: int, on_error: str = "skip") -> tuple[list[dict], list]:
    """Every record of `ds` read chunk by chunk, and every record skipped."""
    records, skipped = [], []
    for chunk in ds.chunks(records_per_chunk):
        out = ds.read_chunk(chunk, on_error=on_error)
        records += out.records
        skipped += out.skipped
    return records, skipped


def parquet_bytes(rows: list[dict], row_group_size: int) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=row_group_size)
    return sink.getvalue()


def arrow_bytes(table: pa.Table, batch_rows: list[int], *, layout: str = "stream",
                compression: str | None = None, dictionary_deltas: bool = False) -> bytes:
    """`table` as an Arrow stream or file, in record batches of `batch_rows` rows (0: an empty batch);
    a dictionary that grows between batches written as deltas where `dictionary_deltas`, else
    replaced (a stream only)."""
    sink = io.BytesIO()
    options = pa.ipc.IpcWriteOptions(compression=compression, emit_dictionary_deltas=dictionary_deltas)
    new = pa.ipc.new_stream if layout == "stream" else pa.ipc.new_file
    # An empty batch is sliced from the batch written before it (the table's first before any), so it
    # keeps that batch's dictionaries: a file holds one per column, or deltas to it.
    last = table.to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], schema=table.schema)
    with new(sink, table.schema, options=options) as writer:
        start = 0
        for rows in batch_rows:
            if rows:
                last = table.slice(start, rows).combine_chunks().to_batches()[0]
            writer.write_batch(last if rows else last.slice(0, 0))
            start += rows
    assert start == table.num_rows
    return sink.getvalue()


def tar_bytes(members: list[tuple[str, bytes | None]]) -> bytes:
    """A tar of (name, payload) members; a None payload makes a directory member."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            if payload is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return sink.getvalue()


def memory_root() -> str:
    """A fresh memory:// directory, so tests sharing the process-wide memory store never collide."""
    return f"memory://zephon-io-tests/{uuid.uuid4().hex}"


def put(url: str, data: bytes) -> str:
    with fsspec.open(url, "wb") as f:
        f.write(data)
    return url


class _PrefixedMemoryFileSystem(MemoryFileSystem):
    """An in-memory filesystem under another protocol, with a store of its own."""

    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path):
        prefix = f"{cls.protocol}://"
        path = path[len(prefix) :] if path.startswith(prefix) else path
        return path.strip("/")


class FakeHubFileSystem(_PrefixedMemoryFileSystem):
    """Stands in for huggingface_hub's HfFileSystem: files live at their hub paths, no network."""

    protocol = "hf"
    store: dict = {}
    pseudo_dirs: list = [""]


class FlakyFileSystem(_PrefixedMemoryFileSystem):
    """Fails the next `failures` opens for reading, the next `listing_failures` questions about
    a path (`info`, which `isdir` and `isfile` ask) and the next `ls_failures` listings of a
    directory (of `ls_failing` alone, where a test names one) with `error(message)` (a transient
    error unless a test says otherwise); counts every open and every `info`. Lists a directory
    tree through fsspec's generic walk, one `ls` per directory, as the sftp, ftp and smb
    filesystems do."""

    protocol = "flaky"
    store: dict = {}
    pseudo_dirs: list = [""]
    failures = 0
    listing_failures = 0
    ls_failures = 0
    ls_failing: str | None = None
    opens = 0
    infos = 0
    error = ConnectionResetError
    find = AbstractFileSystem.find

    def info(self, path, **kwargs):
        FlakyFileSystem.infos += 1
        if FlakyFileSystem.listing_failures > 0:
            FlakyFileSystem.listing_failures -= 1
            raise FlakyFileSystem.error(f"flaky storage could not say what {path} is")
        return super().info(path, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        failing = FlakyFileSystem.ls_failing
        if FlakyFileSystem.ls_failures > 0 and (failing is None or self._strip_protocol(path) == failing):
            FlakyFileSystem.ls_failures -= 1
            raise FlakyFileSystem.error(f"flaky storage could not list {path}")
        return super().ls(path, detail=detail, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            FlakyFileSystem.opens += 1
            if FlakyFileSystem.failures > 0:
                FlakyFileSystem.failures -= 1
                raise FlakyFileSystem.error(f"flaky storage dropped {path}")
        return super()._open(path, mode, **kwargs)


class ObjectStoreFileSystem(_PrefixedMemoryFileSystem):
    """Reads like an object store: every open has its own file object (the memory filesystem hands
    every reader one shared BytesIO), reads take a little time, and the next `failing_reads` reads
    after the first `reads_before_failing` of an open raise a transient error mid-download."""

    protocol = "objstore"
    store: dict = {}
    pseudo_dirs: list = [""]
    blocksize = 256  # fsspec's get_file copies in blocks of this size, so a copy takes many reads
    read_delay_s = 0.0
    failing_reads = 0
    reads_before_failing = 0

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode:
            return super()._open(path, mode, **kwargs)
        return _SlowFlakyReader(bytes(self.store[self._strip_protocol(path)].getbuffer()), path)


class _SlowFlakyReader(io.BytesIO):
    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(data)
        self.path, self.reads = path, 0

    def read(self, size=-1):
        self.reads += 1
        time.sleep(ObjectStoreFileSystem.read_delay_s)
        if self.reads > ObjectStoreFileSystem.reads_before_failing and ObjectStoreFileSystem.failing_reads > 0:
            ObjectStoreFileSystem.failing_reads -= 1
            raise TimeoutError(f"read of {self.path} timed out")
        return super().read(size)


class _ScanCountingStore(dict):
    """A memory store that counts the passes over all of it (`MemoryFileSystem.info` makes one per
    call, `find` and `ls` one each) under `CountingStore.asked["scan"]`."""

    def __iter__(self):
        CountingStore.asked["scan"] += 1
        return super().__iter__()

    def items(self):
        CountingStore.asked["scan"] += 1
        return super().items()


class CountingStore(_PrefixedMemoryFileSystem):
    """An object store that counts what it is asked, in `asked`: ("info", path) for each `info()`,
    ("list", path) for each `ls` or `find` (`glob` lists through `find`), ("open", path) for each open for reading, and
    "scan" for each pass over its whole store. On s3 or gcs each `info()` is a HEAD request."""

    protocol = "countstore"
    store: dict = _ScanCountingStore()
    pseudo_dirs: list = [""]
    asked: Counter = Counter()

    def info(self, path, **kwargs):
        CountingStore.asked["info", self._strip_protocol(path)] += 1
        return super().info(path, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        CountingStore.asked["list", self._strip_protocol(path)] += 1
        return super().ls(path, detail=detail, **kwargs)

    def find(self, path, *args, **kwargs):
        CountingStore.asked["list", self._strip_protocol(path)] += 1
        return super().find(path, *args, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            CountingStore.asked["open", self._strip_protocol(path)] += 1
        return super()._open(path, mode, **kwargs)

    @staticmethod
    def asked_of(what: str, paths) -> int:
        """How many times `what` ("info", "list", "open", "get") was asked of any of `paths` (URLs or paths)."""
        stripped = {path.rpartition("://")[2].strip("/") for path in paths}
        asked = CountingStore.asked.items()
        return sum(n for key, n in asked if key != "scan" and key[0] == what and key[1] in stripped)


class BufferedCountingStore(CountingStore):
    """Opens files as s3fs, gcsfs and the hub's filesystem do: an `AbstractBufferedFile` that asks
    `info()` for the file's details (size, ETag, generation...) when it is opened, then reads byte
    ranges, each counted as ("get", path): a ranged GET request. Its block cache holds
    `block_size` bytes (fsspec's default where "default")."""

    protocol = "bufstore"
    store: dict = _ScanCountingStore()
    pseudo_dirs: list = [""]
    block_size: int | str = "default"

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode:
            return super()._open(path, mode, **kwargs)
        CountingStore.asked["open", self._strip_protocol(path)] += 1
        return _RangeReadFile(self, self._strip_protocol(path), mode, block_size=self.block_size)


class _RangeReadFile(AbstractBufferedFile):
    def _fetch_range(self, start, end):
        CountingStore.asked["get", self.path] += 1
        return bytes(self.fs.store[self.path].getbuffer()[start:end])


class ListingKeepingStore(_PrefixedMemoryFileSystem):
    """Reads as huggingface_hub's HfFileSystem does: a file's details (which opening it asks for)
    come from a listing of its directory, asked of the store once and kept in `listed`, and a
    pickle of it carries what it has listed, as HfFileSystem's `__reduce__` carries its `dircache`.
    Each listing asked of the store (a request to the hub) adds one to `listings_asked`, a counter
    that a test sets and processes forked after it share."""

    protocol = "listkeeping"
    store: dict = {}
    pseudo_dirs: list = [""]
    listings_asked = None  # a multiprocessing Value("i"), set by the test

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.listed: dict[str, list[dict]] = {}

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        if path not in self.store:
            return super().info(path, **kwargs)
        directory = self._parent(path)
        if directory not in self.listed:
            with self.listings_asked.get_lock():
                self.listings_asked.value += 1
            self.listed[directory] = self.ls(directory, detail=True)
        return next(entry for entry in self.listed[directory] if entry["name"] == path)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            self.info(path)
        return super()._open(path, mode, **kwargs)

    def __reduce__(self):
        return _with_listings, (type(self), self.storage_args, self.storage_options, self.listed)


def _with_listings(cls, args, kwargs, listed):
    fs = cls(*args, **kwargs)
    fs.listed = dict(listed)
    return fs


@contextmanager
def registered(cls: type[MemoryFileSystem]) -> Iterator[type[MemoryFileSystem]]:
    """Register a fake filesystem for its protocol, then put back exactly what was there before.

    fsspec has no public way to unregister, and a protocol that was never used (e.g. "hf" resolved
    lazily to huggingface_hub) must go back to being lazy, hence the private registry dict.
    """
    previous = fsspec.registry.get(cls.protocol)
    fsspec.register_implementation(cls.protocol, cls, clobber=True)
    cls.store.clear()
    cls.pseudo_dirs[:] = [""]
    try:
        yield cls
    finally:
        cls.store.clear()
        if previous is not None:
            fsspec.register_implementation(cls.protocol, previous, clobber=True)
        else:
            _registry.pop(cls.protocol, None)


class IndexServer(http.server.ThreadingHTTPServer):
    """A local HTTP server of a directory tree, as a static file server publishes one: a file is
    served with its Content-Length and Last-Modified, a directory as an index page of links to
    its entries (a subdirectory's ending in "/"). A path answers the statuses queued for it in
    `statuses` (by path, without a trailing "/") before it is served; `requests` counts the GET
    and HEAD requests of each path. A HEAD of a path in `meeting` waits at the `meeting` barrier
    for as many others as it has parties (a broken barrier: they did not come together). A file
    whose path is in `unsized` is served as a page made on request is: in chunks (HTTP/1.1's
    chunked transfer), with no Content-Length; one in `encoded` with its Content-Length and a
    `Content-Encoding: gzip`, as S3 serves an object stored with that metadata. A queued status
    of a path in `retry_after` is sent with that `Retry-After` header. A query is part of the
    path for `statuses` and `requests`, and ignored in finding the file, as a store checking a
    signed URL's signature ignores it once it is checked. A file whose suffix is in `content_types`
    is sent as that Content-Type, as a server's MIME map (or its default type) says."""

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), functools.partial(_IndexHandler, directory=str(root)))
        self.statuses: dict[str, list[int]] = {}
        self.requests: Counter[str] = Counter()
        self.meeting: tuple[set[str], threading.Barrier] | None = None
        self.unsized: set[str] = set()
        self.encoded: set[str] = set()
        self.retry_after: dict[str, str] = {}
        self.content_types: dict[str, str] = {}

    def url(self, path: str, scheme: str = "sync-http") -> str:
        """`path` on this server, through fsspec's blocking HTTP filesystem (`sync-http://`), or
        with scheme="http" through its usual one, HTTPFileSystem over aiohttp."""
        return f"{scheme}://127.0.0.1:{self.server_address[1]}/{path}"


class _IndexHandler(http.server.SimpleHTTPRequestHandler):
    server: IndexServer

    def do_GET(self) -> None:
        if not self._answered_a_queued_status() and not self._sent_unsized(body=True):
            super().do_GET()

    def do_HEAD(self) -> None:
        meeting = self.server.meeting
        if meeting is not None and self.path in meeting[0]:
            with contextlib.suppress(threading.BrokenBarrierError):
                meeting[1].wait()
        if not self._answered_a_queued_status() and not self._sent_unsized(body=False):
            super().do_HEAD()

    _retry_after: str | None = None  # sent with the queued status being answered

    def guess_type(self, path: str) -> str:
        return self.server.content_types.get(Path(path).suffix) or super().guess_type(path)

    def end_headers(self) -> None:
        if self.path in self.server.encoded:
            self.send_header("Content-Encoding", "gzip")
        if self._retry_after is not None:
            self.send_header("Retry-After", self._retry_after)
        super().end_headers()

    def _sent_unsized(self, body: bool) -> bool:
        if self.path not in self.server.unsized:
            return False
        data = Path(self.translate_path(self.path)).read_bytes()
        self.protocol_version = "HTTP/1.1"  # chunked transfer is HTTP/1.1's
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        if body:
            for start in range(0, len(data), 64):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data[start : start + 64]), data[start : start + 64]))
            self.wfile.write(b"0\r\n\r\n")
        return True

    def _answered_a_queued_status(self) -> bool:
        path = self.path.rstrip("/")
        self.server.requests[path] += 1
        queued = self.server.statuses.get(path)
        if not queued:
            return False
        self._retry_after = self.server.retry_after.get(path)
        try:
            self.send_error(queued.pop(0))
        finally:
            self._retry_after = None
        return True

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serving_over_http(root: Path) -> Iterator[IndexServer]:
    """Serve `root` over HTTP on a thread. Its `sync-http://` URLs are read through fsspec's
    blocking HTTP filesystem, whose glob, listing and errors are those of HTTPFileSystem but for
    the client's error types, and which needs no aiohttp; its `http://` URLs through
    HTTPFileSystem over aiohttp, as users read them. Importing the blocking one registers it for
    http and https too: those are put back at once, and the registry as it was at the end."""
    protocols = ("http", "https", "sync-http", "sync-https")
    previous = {protocol: _registry.get(protocol) for protocol in protocols}
    from fsspec.implementations.http_sync import HTTPFileSystem

    _put_back(previous, ("http", "https"))
    fsspec.register_implementation("sync-http", HTTPFileSystem, clobber=True)
    server = IndexServer(root)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
        _put_back(previous, protocols)


def _put_back(registered: dict[str, type | None], protocols: tuple[str, ...]) -> None:
    for protocol in protocols:
        if registered[protocol] is None:
            _registry.pop(protocol, None)
        else:
            _registry[protocol] = registered[protocol]
