"""Datasets on an FTP server (`ftp://host:port/dir`), served here by pyftpdlib from a local directory."""

from __future__ import annotations

import logging
import threading

import pytest

from zephon.io._version import version_in

from .remote_shards import assert_read_on_many_threads_as_local, assert_rewrite_refused, write_shards

# pyftpdlib is built on asyncore and asynchat, which 3.11 warns are deprecated (3.12+ take them from PyPI).
pytestmark = pytest.mark.filterwarnings("ignore:The (asyncore|asynchat) module is deprecated:DeprecationWarning")


@pytest.fixture
def ftp_server(tmp_path):
    """An anonymous read-only FTP server of tmp_path/root; yields its ftp:// URL."""
    from pyftpdlib.authorizers import DummyAuthorizer
    from pyftpdlib.handlers import FTPHandler
    from pyftpdlib.servers import ThreadedFTPServer

    root = tmp_path / "root"
    root.mkdir()
    authorizer = DummyAuthorizer()
    authorizer.add_anonymous(str(root))
    handler = type("Handler", (FTPHandler,), {"authorizer": authorizer})
    logging.getLogger("pyftpdlib").setLevel(logging.WARNING)
    server = ThreadedFTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"timeout": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"ftp://127.0.0.1:{server.address[1]}", root
    finally:
        server.close_all()
        thread.join(timeout=10)


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


@pytest.mark.parametrize("cached", [False, True])
def test_an_ftp_shard_rewritten_after_planning_is_refused(ftp_server, tmp_path, cached):
    """FTP's listing tells a file's modification time (MLSD's `modify` fact), which was not taken
    for a version: a shard rewritten with as many bytes was read, and its records handed out
    under the planned addresses. fsspec keeps the listing of the shard's directory and describes
    the file from it, so a read asks for it again."""
    url, root = ftp_server
    write_shards(root / "data")
    assert_rewrite_refused(f"{url}/data", root / "data", cache={"enabled": cached, "dir": str(tmp_path / "c")})


def test_an_mlsd_modification_time_is_a_version_and_a_plain_list_s_is_none():
    """A plain LIST's time ("Jun  5 06:30") turns into the year ("Jun  5 2026") when the file is six
    months old: the same file would read as two versions a run apart."""
    assert version_in({"size": 10, "modify": "20261205063012"}).stamp == "size=10 modify=20261205063012"
    assert version_in({"size": 10, "modify": "20261205063012.250"}) is not None
    assert version_in({"size": 10, "modify": "Dec  5 06:30"}) is None
