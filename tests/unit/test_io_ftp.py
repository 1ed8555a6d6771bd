"""Datasets on an FTP server (`ftp://host:port/dir`), served here by pyftpdlib from a local directory."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import pytest

from zephon.io import Dataset
from zephon.io._version import version_in

from .remote_shards import assert_read_on_many_threads_as_local, assert_rewrite_refused, write_shards

# pyftpdlib is built on asyncore and asynchat, which 3.11 warns are deprecated (3.12+ take them from PyPI).
pytestmark = pytest.mark.filterwarnings("ignore:The (asyncore|asynchat) module is deprecated:DeprecationWarning")


@contextlib.contextmanager
def _serving(root: Path, refusing: tuple[str, ...] = ()):
    """An anonymous read-only FTP server of `root` on a thread, refusing the commands `refusing`
    as one that does not know them; yields its ftp:// URL."""
    from pyftpdlib.authorizers import DummyAuthorizer
    from pyftpdlib.handlers import FTPHandler
    from pyftpdlib.servers import ThreadedFTPServer

    authorizer = DummyAuthorizer()
    authorizer.add_anonymous(str(root))
    commands = {name: spec for name, spec in FTPHandler.proto_cmds.items() if name not in refusing}
    handler = type("Handler", (FTPHandler,), {"authorizer": authorizer, "proto_cmds": commands})
    logging.getLogger("pyftpdlib").setLevel(logging.WARNING)
    server = ThreadedFTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"timeout": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"ftp://127.0.0.1:{server.address[1]}"
    finally:
        server.close_all()
        thread.join(timeout=10)


@pytest.fixture
def ftp_server(tmp_path):
    """An anonymous read-only FTP server of tmp_path/root; yields its ftp:// URL and root."""
    root = tmp_path / "root"
    root.mkdir()
    with _serving(root) as url:
        yield url, root


def test_an_ftp_dataset_is_planned_and_read_on_many_threads_at_once_as_its_local_copy(ftp_server, tmp_path):
    """fsspec's FTP filesystem sends every file's commands over its one control connection:
    planning counts remote shards on up to 16 threads, whose commands interleaved, so no FTP
    dataset of more than one shard could be planned (`error_reply('200 Type set to: Binary.')`),
    nor its chunks read on several threads. Its shards were named without the server
    (`ftp:///data/s0.jsonl`): two servers' shards at one path were one to a log and a fingerprint."""
    url, root = ftp_server
    write_shards(root / "data")
    ds = assert_read_on_many_threads_as_local(f"{url}/data", root / "data")
    assert [shard.url for shard in ds.shards] == [f"{url}/data/s{shard}.jsonl" for shard in range(8)]


def test_an_ftp_dataset_with_a_cache_is_planned_and_read_on_many_threads_at_once_as_its_local_copy(ftp_server, tmp_path):
    """The cache copies each shard through the filesystem's one control connection: planning's
    threads copied at once, and no FTP dataset with a cache could be planned
    (`error_reply('200 Type set to: Binary.')`)."""
    url, root = ftp_server
    write_shards(root / "data")
    assert_read_on_many_threads_as_local(f"{url}/data", root / "data", cache={"enabled": True, "dir": str(tmp_path / "c")})


@pytest.mark.parametrize("mlst", [True, False])
@pytest.mark.parametrize("cached", [False, True])
def test_an_ftp_shard_rewritten_after_planning_is_refused(tmp_path, cached, mlst):
    """FTP's listing tells a file's modification time (MLSD's `modify` fact), which was not taken
    for a version: a shard rewritten with as many bytes was read, and its records handed out
    under the planned addresses. fsspec describes the file from its kept listing of the shard's
    directory, so a read asks the server by MLST, or, where the server has no MLST, lists the
    directory again."""
    write_shards(tmp_path / "data")
    with _serving(tmp_path, refusing=() if mlst else ("MLST",)) as url:
        assert_rewrite_refused(f"{url}/data", tmp_path / "data", cache={"enabled": cached, "dir": str(tmp_path / "c")})


def test_reading_every_chunk_of_an_ftp_shard_lists_its_directory_no_more(ftp_server, monkeypatch):
    """Each read asks the shard's version by MLST: listing its directory again instead cost a
    listing of every shard beside it per chunk read (16 ms a read among 1,000 shards)."""
    import ftplib

    url, root = ftp_server
    write_shards(root / "data")
    ds = Dataset.from_path("d", f"{url}/data")
    listed = []
    listing = ftplib.FTP.mlsd
    monkeypatch.setattr(ftplib.FTP, "mlsd", lambda self, path="", *a, **k: listed.append(path) or listing(self, path, *a, **k))
    records = [ds.read_chunk(chunk, on_error="raise").records for chunk in ds.chunks(50)]
    assert sum(map(len, records)) == 8 * 600
    assert listed == []  # the listing planning made answers every open


def test_an_mlsd_modification_time_is_a_version_and_a_plain_list_s_is_none():
    """A plain LIST's time ("Jun  5 06:30") turns into the year ("Jun  5 2026") when the file is six
    months old: the same file would read as two versions a run apart."""
    assert version_in({"size": 10, "modify": "20261205063012"}).stamp == "size=10 modify=20261205063012"
    assert version_in({"size": 10, "modify": "20261205063012.250"}) is not None
    assert version_in({"size": 10, "modify": "Dec  5 06:30"}) is None
