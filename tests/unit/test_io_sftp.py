"""Datasets on an SFTP server (`sftp://user@host:port/dir`), served here by paramiko's server side
from a local directory, read-only, password accepted."""

from __future__ import annotations

import os
import socket
import threading

import paramiko
import pytest

from .remote_shards import assert_read_on_many_threads_as_local, assert_rewrite_refused, write_shards


def _sftp_files(root: str):
    """paramiko's SFTP server interface over `root`: listing, stat and opening for reading."""

    class Handle(paramiko.SFTPHandle):
        def stat(self):
            return paramiko.SFTPAttributes.from_stat(os.fstat(self.readfile.fileno()))

    class Files(paramiko.SFTPServerInterface):
        def _local(self, path: str) -> str:
            return os.path.join(root, path.lstrip("/"))

        def list_folder(self, path):
            listed = []
            for name in os.listdir(self._local(path)):
                attributes = paramiko.SFTPAttributes.from_stat(os.stat(os.path.join(self._local(path), name)))
                attributes.filename = name
                listed.append(attributes)
            return listed

        def stat(self, path):
            return paramiko.SFTPAttributes.from_stat(os.stat(self._local(path)))

        lstat = stat

        def open(self, path, flags, attr):
            handle = Handle(flags)
            handle.readfile = open(self._local(path), "rb")  # noqa: SIM115 (closed by paramiko with the handle)
            return handle

        def canonicalize(self, path):
            return "/" + path.lstrip("/") if path not in ("", ".") else "/"

    return Files


class _Accepting(paramiko.ServerInterface):
    def check_auth_password(self, username, password):
        return paramiko.AUTH_SUCCESSFUL

    def get_allowed_auths(self, username):
        return "password"

    def check_channel_request(self, kind, chanid):
        return paramiko.OPEN_SUCCEEDED


@pytest.fixture
def sftp_server(tmp_path):
    """An SFTP server of tmp_path/root on a thread; yields its sftp:// URL (user `u`), its root and
    the storage_options that log in."""
    root = tmp_path / "root"
    root.mkdir()
    key = paramiko.RSAKey.generate(2048)
    listener = socket.create_server(("127.0.0.1", 0))
    transports = []

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed at teardown
                return
            transport = paramiko.Transport(connection)
            transport.add_server_key(key)
            transport.set_subsystem_handler("sftp", paramiko.SFTPServer, _sftp_files(str(root)))
            transport.start_server(server=_Accepting())
            transports.append(transport)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"sftp://u@127.0.0.1:{listener.getsockname()[1]}", root, {"username": "u", "password": "p"}
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes its accept(), which close() alone leaves waiting
        listener.close()
        for transport in transports:
            transport.close()
        thread.join(timeout=10)


def test_an_sftp_dataset_is_planned_and_read_on_many_threads_at_once_as_its_local_copy(sftp_server):
    """fsspec's SFTP filesystem sends every file's requests over paramiko's one SFTP client, which
    threads cannot share (paramiko issue #1836): planned and read on eight threads, a dataset
    failed with `SFTPError('Garbage packet received')` or hung for good. Its shards were named
    without the server (`sftp:///data/s0.jsonl`)."""
    url, root, options = sftp_server
    write_shards(root / "data")
    ds = assert_read_on_many_threads_as_local(f"{url}/data", root / "data", storage_options=options)
    assert [shard.url for shard in ds.shards] == [f"{url}/data/s{shard}.jsonl" for shard in range(8)]


@pytest.mark.timeout(120, method="thread")  # the old hang: the signal method's failure waits on the hung threads
def test_an_sftp_dataset_with_a_cache_is_planned_and_read_on_many_threads_at_once_as_its_local_copy(sftp_server, tmp_path):
    """The cache copies each shard through paramiko's one SFTP client: planning's threads copied at
    once, and a dataset with a cache hung for good while it was planned."""
    url, root, options = sftp_server
    write_shards(root / "data")
    assert_read_on_many_threads_as_local(f"{url}/data", root / "data", storage_options=options,
                                         cache={"enabled": True, "dir": str(tmp_path / "c")})


@pytest.mark.parametrize("cached", [False, True])
def test_an_sftp_shard_rewritten_after_planning_is_refused(sftp_server, tmp_path, cached):
    url, root, options = sftp_server
    write_shards(root / "data")
    assert_rewrite_refused(f"{url}/data", root / "data", storage_options=options,
                           cache={"enabled": cached, "dir": str(tmp_path / "c")})
