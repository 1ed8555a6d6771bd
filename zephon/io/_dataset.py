"""`Dataset`: a named, planned collection of shards that reads chunks of records.

Construction (`from_path`) does all the listing and counting, once, in the process that builds the
plan; the result is immutable, cheap to pickle (metadata, small seek indexes and the filesystem
— for fsspec, its constructor arguments) and reads any chunk in any process without re-planning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import ConfigurationError
from .._job_log import RankLog
from .._records import Chunk, ChunkRecords
from ._arrow import ArrowIPC
from ._decode_units import wasteful_decoding
from ._format import ShardFile, ShardFormat, ShardScan
from ._jsonl import JsonLines
from ._local import LocalFiles
from ._locate import locate
from ._no_ranges import ranges_refused
from ._protocols import is_local
from ._parquet import Parquet
from ._policy import ErrorPolicy, Slot, collect
from ._retry import RetryPolicy
from ._scan_cache import ScanCache
from ._storage import CacheOptions, filesystem_made_here, reading_filesystem
from ._text import TEXT_UNITS, Text
from ._version import ShardVersion, check_unchanged, version_in, version_of
from ._webdataset import WebDataset

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


__all__ = ["Dataset", "ShardInfo", "check_io_options"]

log = RankLog(logging.getLogger("zephon"))

_REMOTE_PLANNING_THREADS = 16  # counting remote shards waits on the network: many in flight at once
_IO_OPTIONS = ("cache", "retries", "retry_delay")


def check_io_options(io_options: Mapping[str, Any]) -> None:
    """Refuse, naming it, what `Dataset.with_io_options` would refuse: `Pipeline.options` checks
    its `io_options` when they are set, not when a loader applies them after planning."""
    _apply_io_options(io_options, CacheOptions.from_dict(None), RetryPolicy())


def _apply_io_options(
    io_options: Mapping[str, Any], cache: CacheOptions, retry: RetryPolicy
) -> tuple[CacheOptions, RetryPolicy]:
    unknown = sorted(set(io_options) - set(_IO_OPTIONS))
    if unknown:
        raise ConfigurationError(f"io options {unknown} are unknown; expected {list(_IO_OPTIONS)}")
    cache = CacheOptions.from_dict(io_options["cache"]) if "cache" in io_options else cache
    retry = RetryPolicy(io_options.get("retries", retry.attempts), io_options.get("retry_delay", retry.base_delay))
    return cache, retry


def _planning_threads(fs: AbstractFileSystem | LocalFiles, num_shards: int) -> int:
    """How many shards to count at once: a local shard is counted as fast as a core can scan it,
    so threads beyond the cores only add their own heaps (on 3.14t each thread's allocator kept
    ~0.4 MiB more PSS after planning)."""
    limit = _usable_cores() if is_local(fs) else _REMOTE_PLANNING_THREADS
    return max(1, min(limit, num_shards))


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class ShardInfo:
    """Planning facts of one shard: its URL, how many record slots it holds, its size in bytes as
    stored (`nbytes`) and decompressed (`raw_bytes`)."""

    url: str
    num_records: int
    nbytes: int
    raw_bytes: int = 0


@dataclass(frozen=True)
class _ShardAccess:
    """How to reach one shard's records: filesystem path, codec, seek points (see ShardScan) and
    the version of the file they were found in (see `_version`)."""

    path: str
    compression: str | None
    seek: np.ndarray | None = field(compare=False)
    record_offsets: np.ndarray | None = field(default=None, compare=False)
    offsets_dropped: bool = field(default=False, compare=False)  # by a pickle: see Dataset.check_plannable
    version: ShardVersion | None = field(default=None, compare=False)
    copy: str | None = field(default=None, compare=False)  # its seekable copy, which `seek` indexes


@dataclass(frozen=True, kw_only=True)
class Dataset:
    """A named collection of shards, planned once and read chunk by chunk.

    Immutable and thread-safe: `read_chunk` opens its own file handle on every call. Records are
    dicts; the address of a record is (dataset name, shard URL, index of its slot in the shard),
    where every slot counts, bad ones included, so that a skipped record can be found again.
    Build one with `Dataset.from_path`.
    """

    name: str
    url: str
    format: str
    text_unit: str
    shards: tuple[ShardInfo, ...]
    _access: tuple[_ShardAccess, ...] = field(repr=False)
    _reader: ShardFormat = field(repr=False)
    _fs: AbstractFileSystem | LocalFiles = field(repr=False, compare=False)
    _cache: CacheOptions = field(repr=False, compare=False)
    _retry: RetryPolicy = field(repr=False, compare=False)
    _fs_made_in: int = field(default_factory=os.getpid, repr=False, compare=False)  # the process `_fs` is of

    @classmethod
    def from_path(
        cls,
        name: str,
        url: str | os.PathLike,
        *,
        format: str | None = None,
        storage_options: dict | None = None,
        text_unit: str = "line",
        cache: dict | None = None,
        scan_cache: str | os.PathLike | None = None,
        seekable_copies: bool = False,
        retries: int = 3,
        retry_delay: float = 0.5,
    ) -> Dataset:
        """List and count the shards at `url` (any fsspec URL, a directory, a glob or `hf://`).

        `format` ("arrow", "jsonl", "parquet", "text", "webdataset") is inferred from file suffixes,
        in any case, when None; a file named like a shard but compressed in a way it is not read in
        (`a.jsonl.bz2`, `s.tar.gz`, `p.parquet.gz`) is a `ConfigurationError` naming it, not passed
        over. `text_unit` ("line" or "file") says what a text record is.
        `cache={"enabled": True, "dir": ...}` copies remote shards to local disk. `scan_cache`, a
        local directory, keeps what counting each shard found, so that the next planning of the
        same version of a shard (another rank, a resumed run) reads none of it (`_scan_cache`);
        the plan is the same either way. `seekable_copies=True` (with `scan_cache`) also keeps
        there a copy of each JSON Lines, text or WebDataset tar shard written as one gzip or zstd
        stream, in zstd frames, which its chunk reads enter near their records instead of
        decompressing the shard from its start (`_seekable_copy`): about the shard's size again on
        that disk. A storage error, listing or reading, is retried: `retries` counts the attempts
        in all, the first one included (1: no retry), waiting `retry_delay` seconds before the
        second and doubling, up to a minute. Listing, only "no such file" means nothing is at `url`,
        and permission denied is a `ConfigurationError` at once; every error of listing is noted
        with the dataset's name.
        """
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a dataset needs a non-empty name, got {name!r}")
        if isinstance(url, os.PathLike):
            url = os.fspath(url)
        if not isinstance(url, str) or not url:
            raise ConfigurationError(f"dataset {name!r} needs a URL or path as a str, got {url!r}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigurationError(  # else a bare TypeError from fsspec, or a ValueError from dict()
                f"storage_options={storage_options!r} must be a dict of the filesystem's options, e.g. {{'anon': True}}"
            )
        retry = RetryPolicy(retries, retry_delay)
        if not isinstance(seekable_copies, bool):
            raise ConfigurationError(f"seekable_copies={seekable_copies!r} must be True or False")
        if seekable_copies and scan_cache is None:
            raise ConfigurationError("seekable_copies=True keeps the copies in the scan cache: give scan_cache=DIR too")
        scans_kept = None if scan_cache is None else ScanCache(scan_cache, seekable_copies)
        options = _copied_options(dict(storage_options or {}))
        try:  # listing a remote store fails as transiently as reading it (a hub out of reach)
            located = retry.call(url, lambda: locate(url, format, options))
        except Exception as error:  # a ConfigurationError too: in a mixture, the name says which dataset
            error.add_note(f"while listing dataset {name!r} at {url}")
            raise
        reader = _make_reader(located.format, text_unit)
        cache_options = CacheOptions.from_dict(cache)
        listed = {
            path: version
            for path, details in zip(located.paths, located.listed, strict=True)
            if details is not None and (version := version_in(details)) is not None
        }
        fs = reading_filesystem(located.fs, cache_options, listed)
        urls = tuple(_shard_url(located.fs, path) for path in located.paths)

        def scan(i: int) -> tuple[ShardScan, ShardVersion | None, str | None]:
            if located.nbytes[i] == 0:  # holds no record: never read, so its version is never asked
                return ShardScan(0), None, None
            shard = ShardFile(urls[i], located.paths[i], located.compressions[i], fs)
            try:
                return scan_shard(shard)
            except ValueError as error:  # a Parquet footer, on a server that refuses ranges
                if not ranges_refused(error):
                    raise
                return scan_shard(replace(shard, planned_nbytes=located.nbytes[i], from_start=True))

        def scan_shard(shard: ShardFile) -> tuple[ShardScan, ShardVersion | None, str | None]:
            def version_and_scan() -> tuple[ShardScan, ShardVersion | None, str | None]:
                # The version first: a file rewritten during the scan is then refused at its reads,
                # where asked after the scan it would be taken for the version the plan was made from.
                # The listing's was taken before either, for the size planned; asked only where it
                # tells none (on an object store each `info()` is a request).
                version = listed.get(shard.path) or version_of(located.fs, shard.path)
                if scans_kept is None or version is None:
                    return reader.scan(shard), version, None
                url = os.path.abspath(shard.path) if is_local(located.fs) else shard.url
                found, distrusted = scans_kept.scan(shard, url, version, reader)
                return found, version, distrusted

            try:
                return retry.call(shard.url, version_and_scan)
            except Exception as error:
                error.add_note(f"while planning shard {shard.url} of dataset {name!r}")
                raise

        with ThreadPoolExecutor(max_workers=_planning_threads(located.fs, len(urls))) as pool:
            scans = list(pool.map(scan, range(len(urls))))
        distrusted = [why for _, _, why in scans if why is not None]
        if distrusted:
            log.warning("dataset %r: %d entries of scan cache %s could not be trusted, their shards were "
                        "scanned again (the first: %s)", name, len(distrusted), scans_kept.directory, distrusted[0])
        facts = zip(urls, located.paths, located.nbytes, located.compressions, scans, strict=True)
        planned = [
            (ShardInfo(u, s.num_records, n, n if s.raw_bytes is None else s.raw_bytes),
             _ShardAccess(p, c, s.seek, s.record_offsets, version=v, copy=s.copy))
            for u, p, n, c, (s, v, _) in facts
        ]
        return cls(
            name=name,
            url=url,
            format=located.format,
            text_unit=text_unit,
            shards=tuple(info for info, _ in planned),
            _access=tuple(access for _, access in planned),
            _reader=reader,
            _fs=located.fs,
            _cache=cache_options,
            _retry=retry,
        )

    @property
    def num_records(self) -> int:
        return sum(shard.num_records for shard in self.shards)

    def chunks(self, records_per_chunk: int) -> list[Chunk]:
        """Every record slot in exactly one chunk, in shard order then record order.

        Chunks never cross a shard boundary, so a shard's last chunk may be shorter; an empty shard
        gives no chunk.
        """
        shard, start, stop = self.chunk_bounds(records_per_chunk)
        return [Chunk(self.name, *bounds) for bounds in zip(shard.tolist(), start.tolist(), stop.tolist())]

    def chunk_bounds(self, records_per_chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (shard, start, stop) of every chunk of `chunks`, in its order, as three int64 arrays:
        what a plan of millions of chunks holds instead of a Chunk each (`zephon.work`'s ChunkTable)."""
        if not isinstance(records_per_chunk, int) or records_per_chunk < 1:
            raise ConfigurationError(f"records_per_chunk={records_per_chunk!r} must be an int >= 1")
        counts = np.array([shard.num_records for shard in self.shards], dtype=np.int64)
        per_shard = -(-counts // records_per_chunk)
        shard = np.repeat(np.arange(len(counts), dtype=np.int64), per_shard)
        first = np.cumsum(per_shard) - per_shard
        start = (np.arange(len(shard), dtype=np.int64) - first[shard]) * records_per_chunk
        return shard, start, np.minimum(start + records_per_chunk, counts[shard])

    def wasteful_decoding(self, records_per_chunk: int) -> str | None:
        """A warning where reading this dataset's chunks decodes many more records than they hold
        (Parquet shards in large row groups, Arrow in large record batches, large compressed line
        shards: `_decode_units`)."""
        shards = [(a.seek, s.num_records, a.compression, s.raw_bytes)
                  for a, s in zip(self._access, self.shards, strict=True)]
        return wasteful_decoding(self._reader, self.name, shards, records_per_chunk)

    def read_chunk(self, chunk: Chunk, *, on_error: str | ErrorPolicy = "skip") -> ChunkRecords:
        """The records of `chunk`; bad ones are skipped with their reason or raise BadRecordError.

        Storage errors are retried; a shard that stays unreadable, or is another version of its
        file than the one planned (rewritten in place), raises ShardUnavailableError.
        """
        policy = ErrorPolicy.parse(on_error)
        self._check(chunk)
        info, access = self.shards[chunk.shard], self._access[chunk.shard]
        fs, reading_fs = self._filesystems()
        cached = reading_fs is not fs
        # Through the cache the version is asked of the remote before the copy is found or made;
        # otherwise it is read from the file opened (see `_version`), with no request of its own.
        shard = ShardFile(info.url, access.path, access.compression, reading_fs, info.nbytes,
                          None if cached else access.version)
        if chunk.num_records == 0:
            return collect(chunk, info.url, [], policy)
        from_start = chunk.shard in self.__dict__.get("_ranges_refused", ())
        if from_start:
            shard = replace(shard, planned_version=None, from_start=True)

        def read() -> list[Slot]:
            if access.copy is not None and chunk.shard not in self.__dict__.get("_copies_gone", ()):
                copy = ShardFile(info.url, access.copy, "zstd", LocalFiles())
                try:
                    return self._reader.read(copy, access.seek, chunk.start, chunk.stop)
                except FileNotFoundError:
                    self._copy_gone(chunk.shard, access.copy)
            if cached or from_start:
                check_unchanged(access.version, fs, access.path, info.url)
            seek = access.seek if access.copy is None else self._reader.stream_seek(access.seek)
            return self._reader.read(shard, seek, chunk.start, chunk.stop)

        try:
            slots = self._retry.call(info.url, read)
        except ValueError as error:
            if from_start or not ranges_refused(error):
                raise
            self._read_from_start(chunk.shard, info.url)
            return self.read_chunk(chunk, on_error=policy)
        return collect(chunk, info.url, slots, policy)

    def _copy_gone(self, index: int, copy: str) -> None:
        """Read shard `index` itself from now on in this process, its seekable copy `copy` gone
        (a scan cache cleared meanwhile), saying so once per shard and process."""
        gone = self.__dict__.setdefault("_copies_gone", set())
        if index not in gone:
            log.warning("dataset %r: the seekable copy %s of shard %s is gone, so its chunks are read from the "
                        "shard itself, each decompressing it from its start; plan again to copy it again",
                        self.name, copy, self.shards[index].url)
        gone.add(index)

    def _read_from_start(self, index: int, url: str) -> None:
        """Read shard `index` from its start from now on in this process (`_no_ranges`), saying so
        once per dataset and process."""
        refused = self.__dict__.setdefault("_ranges_refused", set())
        if not refused:
            log.warning(
                "dataset %r: the server of %s does not answer range requests, so each chunk of its shards is "
                "read from the start of its shard, the bytes before it too; serve the files with a server that "
                "answers them, or give cache={'enabled': True} to read one local copy of each shard",
                self.name, url,
            )
        refused.add(index)

    def raw_bytes(self, chunk: Chunk) -> int:
        """Decompressed bytes of a chunk's records (see `raw_bytes_of`)."""
        self._check(chunk)
        return int(self.raw_bytes_of(chunk.shard, np.array([chunk.start]), np.array([chunk.stop]))[0])

    def raw_bytes_of(self, shard: int, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """Decompressed bytes of the records [starts[i], stops[i]) of one shard, for each i: exact
        where planning saw each record's offset (line formats), else the shard's raw bytes prorated
        by record count (in Python ints: raw bytes times a record count can pass 2**63). All at
        once: a plan of millions of chunks makes no Chunk object to ask for each."""
        offsets = self._access[shard].record_offsets
        if offsets is not None:
            return offsets[stops] - offsets[starts]
        info = self.shards[shard]
        prorated = [info.raw_bytes * n // max(1, info.num_records) for n in (stops - starts).tolist()]
        return np.array(prorated, dtype=np.int64)

    def check_plannable(self) -> None:
        """Raise ConfigurationError if this is an unpickled copy that lost the per-record offsets
        a plan by raw bytes (token estimation) reads: its `raw_bytes` would prorate shard bytes
        instead, and a work source bound to it would plan other lanes than one bound to the Dataset
        it was pickled from (a rank given a copy against a rank that built its own), silently."""
        if any(access.offsets_dropped for access in self._access):
            raise ConfigurationError(
                f"dataset {self.name!r} was unpickled, and a pickle leaves out the per-record byte offsets "
                "that planning by tokens reads (a copy would plan other lanes than the original): build it "
                "with Dataset.from_path in the process that binds the work source"
            )

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this dataset's content for a checkpoint: a change here changes the records.

        The URL as given is left out: the shards it lists are in, each by its listed URL, and
        spellings of one directory (`data`, `data/`, `./data`, `file://`, a glob of all its shards)
        list the same ones; with it, a run resumed under another spelling was refused."""
        return {
            "name": self.name,
            "format": self.format,
            "text_unit": self.text_unit,
            "shards": [
                {"url": s.url, "num_records": s.num_records, "nbytes": s.nbytes} for s in self.shards
            ],
        }

    def with_io_options(self, io_options: Mapping[str, Any]) -> Dataset:
        """This dataset (same plan, not re-listed) read with other `cache`/`retries`/`retry_delay`."""
        cache, retry = _apply_io_options(io_options, self._cache, self._retry)
        return replace(self, _cache=cache, _retry=retry)

    def _filesystems(self) -> tuple[AbstractFileSystem | LocalFiles, AbstractFileSystem | LocalFiles]:
        """The filesystem of this dataset in this process, and the one its reads go through (the
        cache in front of it, or itself), made once per process.

        A process-runner worker is forked with the Dataset, not sent a pickle of it: there `_fs`
        is the parent's object, which an asynchronous filesystem (http(s) over aiohttp, s3fs,
        gcsfs) refuses to serve ("This class is not fork-safe": its requests ran on the parent's
        event loop), and a blocking one would share the parent's connections. So a process other
        than the one `_fs` was made in makes its own as unpickling `_fs` would
        (`filesystem_made_here`): from its constructor arguments, and for the hub's with the
        listings the parent's holds. Two threads asking at once each make the pair; one is kept,
        both work."""
        made = self.__dict__.get("_made_here")
        pid = os.getpid()
        if made is None or made[0] != pid:
            fs = self._fs if self._fs_made_in == pid else filesystem_made_here(self._fs)
            planned = {access.path: access.version for access in self._access if access.version is not None}
            made = (pid, fs, reading_filesystem(fs, self._cache, planned))
            self.__dict__["_made_here"] = made
        return made[1], made[2]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_made_here", None)  # made on first read in the receiving process
        state.pop("_ranges_refused", None)  # learnt again, and said again, by each process
        state.pop("_copies_gone", None)
        # Per-record offsets serve planning only, which happens where the Dataset was built.
        state["_access"] = tuple(
            replace(a, record_offsets=None, offsets_dropped=a.record_offsets is not None) for a in self._access
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _fs_made_in=os.getpid())  # unpickling made `_fs` here

    def _check(self, chunk: Chunk) -> None:
        if chunk.dataset != self.name:
            raise ConfigurationError(f"chunk {chunk} belongs to dataset {chunk.dataset!r}, not {self.name!r}")
        if not 0 <= chunk.shard < len(self.shards):
            raise ConfigurationError(
                f"chunk {chunk} names shard {chunk.shard}; {self.name!r} has {len(self.shards)}"
            )
        num_records = self.shards[chunk.shard].num_records
        if not 0 <= chunk.start <= chunk.stop <= num_records:
            raise ConfigurationError(
                f"chunk {chunk} is outside [0, {num_records}) of shard {self.shards[chunk.shard].url}"
            )


def _copied_options(options: Any) -> Any:
    """`options` with its dicts and lists copied, however deeply nested; other values (a session,
    a credentials object) kept as they are, since they may not be copyable.

    The filesystem keeps the options it was given and a pickle rebuilds it from them: a nested
    dict the caller changed afterwards (reused for the next dataset's endpoint) sent the copies
    in worker processes elsewhere than the Dataset they were pickled from."""
    if isinstance(options, dict):
        return {key: _copied_options(value) for key, value in options.items()}
    if isinstance(options, list):
        return [_copied_options(value) for value in options]
    return options


def _make_reader(format: str, text_unit: str) -> ShardFormat:
    if text_unit not in TEXT_UNITS:  # checked for every format: a typo should not wait for a text dataset
        raise ConfigurationError(f"text_unit={text_unit!r} is not one of {TEXT_UNITS}")
    if format == "text":
        return Text(text_unit)
    return {"arrow": ArrowIPC, "jsonl": JsonLines, "parquet": Parquet, "webdataset": WebDataset}[format]()


def _shard_url(fs: AbstractFileSystem | LocalFiles, path: str) -> str:
    """Local shards keep their plain path (what a user recognises in a log); others their full URL,
    with the server that ftp's, sftp's and smb's paths leave out (`ftp:///data/a.jsonl` named
    none: two servers' shards at one path were one shard to a log and to the dataset's
    fingerprint). The user is named as the URL named it; a password never."""
    if is_local(fs):
        return path
    url = fs.unstrip_protocol(path)
    scheme, no_server, rest = url.partition(":///")
    options = getattr(fs, "storage_options", {})
    if not no_server or not options.get("host"):
        return url
    user = f"{options['username']}@" if options.get("username") else ""
    port = f":{options['port']}" if options.get("port") else ""
    return f"{scheme}://{user}{options['host']}{port}/{rest}"
