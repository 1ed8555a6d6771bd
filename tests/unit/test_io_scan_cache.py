"""`Dataset.from_path(scan_cache=DIR)`: planning takes each shard's scan from DIR where it is found,
so ranks and restarts do not read the whole corpus again, and the plan is the one a scan makes."""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest

from zephon import ConfigurationError, _file_lock
from zephon.demo._recipe import demo_pipeline
from zephon.io import Dataset, _local, _scan_cache

from tests.harness import step_digests

from .conftest_io import CountingStore, jsonl_bytes, put, registered

_SHARDS = 3


@pytest.fixture
def opens(monkeypatch):
    """Opens for reading of shards, local ones (through `LocalFiles`) and `countstore://` ones, by path."""
    counted: Counter = Counter()
    local_open = _local.LocalFiles.open

    def counting_open(self, path, mode="rb"):
        counted[path] += 1
        return local_open(self, path, mode)

    monkeypatch.setattr(_local.LocalFiles, "open", counting_open)
    with registered(CountingStore):
        CountingStore.asked.clear()
        yield lambda: sum(counted.values()) + sum(n for key, n in CountingStore.asked.items() if key[0] == "open")


def _write(where: str, tmp_path, lines_per_shard: int = 40) -> str:
    """A JSON Lines dataset of `_SHARDS` shards, on local disk or on `countstore://`; its URL."""
    root = str(tmp_path / "data") if where == "local" else f"{CountingStore.protocol}://bucket/data"
    if where == "local":
        os.makedirs(root)
    for i in range(_SHARDS):
        data = jsonl_bytes([{"text": f"shard {i} line {j} " * (j % 5)} for j in range(lines_per_shard + i)])
        if where == "local":
            with open(os.path.join(root, f"part-{i}.jsonl"), "wb") as f:
                f.write(data)
        else:
            put(f"{root}/part-{i}.jsonl", data)
    return root


def _plan_facts(ds: Dataset) -> tuple:
    """Everything planning found, arrays included."""
    arrays = [
        tuple(None if a is None else a.tolist() for a in (access.seek, access.record_offsets)) for access in ds._access
    ]
    return ds.shards, arrays, ds.fingerprint(), ds.chunk_bounds(7)[2].tolist()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_warm_scan_cache_plans_the_same_as_a_scan_without_opening_any_shard(tmp_path, opens, where):
    url = _write(where, tmp_path)
    scanned = _plan_facts(Dataset.from_path("d", url))
    cold = _plan_facts(Dataset.from_path("d", url, scan_cache=tmp_path / "scans"))
    before_warm = opens()
    warm = _plan_facts(Dataset.from_path("d", url, scan_cache=tmp_path / "scans"))
    assert opens() == before_warm
    assert scanned == cold == warm


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_shard_rewritten_with_as_many_bytes_after_its_scan_was_kept_is_scanned_again(tmp_path, opens, where):
    url = _write(where, tmp_path)
    Dataset.from_path("d", url, scan_cache=tmp_path / "scans")
    shard = f"{url}/part-1.jsonl"
    size = Dataset.from_path("d", url).shards[1].nbytes
    time.sleep(0.01)  # a version holds a modification time
    if where == "local":
        with open(shard, "wb") as f:
            f.write(b"\n" * size)
    else:
        put(shard, b"\n" * size)
    before = opens()
    ds = Dataset.from_path("d", url, scan_cache=tmp_path / "scans")
    assert opens() > before
    assert ds.shards[1].num_records == size
    assert _plan_facts(ds) == _plan_facts(Dataset.from_path("d", url))


def _entries(directory) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "**", "*.npz"), recursive=True))


def _files(directory) -> list[str]:
    """Every file in a scan cache directory, by its path in it."""
    return sorted(os.path.relpath(path, directory) for path in glob.glob(os.path.join(directory, "**", "*"),
                                                                         recursive=True) if os.path.isfile(path))


def test_a_local_shard_rewritten_in_place_to_its_size_and_given_back_its_mtime_is_scanned_again(tmp_path):
    """Size, inode and mtime stay as they were (`touch -r`, `os.utime` after an in-place rewrite);
    the inode's change time does not, and an entry kept under the old one held the old count."""
    url = _write("local", tmp_path)
    scans = tmp_path / "scans"
    Dataset.from_path("d", url, scan_cache=scans)
    shard = os.path.join(url, "part-1.jsonl")
    before = os.stat(shard)
    with open(shard, "r+b") as f:
        f.write(b"\n" * before.st_size)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    while os.stat(shard).st_ctime_ns == before.st_ctime_ns:  # still within the tick the kernel stamped it in
        os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(shard)
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (before.st_size, before.st_ino, before.st_mtime_ns)
    ds = Dataset.from_path("d", url, scan_cache=scans)
    assert ds.shards[1].num_records == before.st_size
    assert _plan_facts(ds) == _plan_facts(Dataset.from_path("d", url))


def _rewrite(shard: str, records: int) -> None:
    """Another version of `shard`: another size, so another version whatever the clock."""
    with open(shard, "wb") as f:
        f.write(jsonl_bytes([{"text": "x"}] * records))


def test_storing_a_shard_s_new_version_removes_the_entries_and_lock_files_of_its_old_ones_not_locked_ones(tmp_path):
    """Entries of versions since replaced, and their lock files, were kept until the directory
    was cleared: a corpus regenerated daily grew its scan cache by a copy of its scans a day."""
    (tmp_path / "data").mkdir()
    shard, other = str(tmp_path / "data" / "a.jsonl"), str(tmp_path / "data" / "b.jsonl")
    _rewrite(shard, 1)
    _rewrite(other, 1)
    scans = str(tmp_path / "scans")
    Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans)
    first = set(_files(scans))
    assert len(first) == 4  # an entry and a lock file a shard
    _rewrite(shard, 2)
    Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans)
    second = set(_files(scans))
    assert len(second) == 4 and len(second - first) == 2
    [held] = [name for name in second - first if name.endswith(".lock")]
    handle = os.open(os.path.join(scans, held), os.O_RDWR)  # as a rank still scanning that version holds it
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _rewrite(shard, 3)
        Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans)
        third = set(_files(scans))
        assert len(third) == 6 and held in third and held.replace(".lock", ".npz") in third
    finally:
        os.close(handle)
    _rewrite(shard, 4)
    assert Dataset.from_path("d", str(tmp_path / "data"), scan_cache=scans).num_records == 5
    assert len(set(_files(scans))) == 4 and first & second <= set(_files(scans))


def _cut(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte_of_the_offsets(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        at = data.index(b"record_offsets.npy") + 200  # inside the stored array, past its header
        data[at] ^= 0xFF
        f.seek(0)
        f.write(data)


def _swap_with_another_entry(path: str) -> None:
    other = next(entry for entry in _entries(os.path.dirname(os.path.dirname(path))) if entry != path)
    with open(other, "rb") as f, open(path, "wb") as g:
        g.write(f.read())


def _one_record_fewer(path: str) -> None:
    with np.load(path) as stored:
        fields = {name: stored[name] for name in stored.files}
    fields["num_records"] = fields["num_records"] - 1
    with open(path, "wb") as f:
        np.savez(f, **fields)


def _empty(path: str) -> None:
    open(path, "wb").close()


@pytest.mark.parametrize(
    "damage", [_cut, _flip_a_byte_of_the_offsets, _swap_with_another_entry, _one_record_fewer, _empty]
)
def test_a_damaged_scan_cache_entry_is_not_trusted_but_counted_in_a_warning_and_rescanned(tmp_path, caplog, damage):
    url = _write("local", tmp_path)
    scans = tmp_path / "scans"
    Dataset.from_path("d", url, scan_cache=scans)
    entries = _entries(scans)
    assert len(entries) == _SHARDS
    damage(entries[0])
    with caplog.at_level(logging.WARNING, logger="zephon"):
        ds = Dataset.from_path("d", url, scan_cache=scans)
    assert _plan_facts(ds) == _plan_facts(Dataset.from_path("d", url))
    warned = [r.getMessage() for r in caplog.records if "scan cache" in r.getMessage()]
    assert len(warned) == 1 and "1 entries" in warned[0] and entries[0] in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zephon"):
        Dataset.from_path("d", url, scan_cache=scans)  # the entry was replaced
    assert not [r for r in caplog.records if "scan cache" in r.getMessage()]


def test_a_text_shard_scanned_by_line_is_not_taken_for_its_scan_by_file(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("one\ntwo\nthree\n")
    by_line = Dataset.from_path("t", str(tmp_path / "data"), scan_cache=tmp_path / "scans")
    by_file = Dataset.from_path("t", str(tmp_path / "data"), text_unit="file", scan_cache=tmp_path / "scans")
    assert (by_line.num_records, by_file.num_records) == (3, 1)


def test_a_one_array_json_shard_kept_by_a_zephon_before_its_refusal_is_refused_not_planned_from_the_entry(
    tmp_path, monkeypatch
):
    """The scan of a shard that is one JSON array now refuses it (`_jsonl`); a Zephon before that
    rule (scan cache version 2) kept its scan as a count of malformed lines. Taken from a warm
    cache, the shard was planned and its every line dropped again, where a cold cache (another
    host's, another directory) refused it: whether a dataset plans depended on what was cached."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=2) + "\n")
    with monkeypatch.context() as before_the_rule:
        before_the_rule.setattr(_scan_cache, "SCAN_CACHE_VERSION", 2)
        before_the_rule.setattr("zephon.io._jsonl._refuse_one_array", lambda url, opening, num_lines: None)
        Dataset.from_path("d", str(tmp_path / "data"), scan_cache=tmp_path / "scans")
    with pytest.raises(ConfigurationError, match="is one JSON array, not JSON Lines"):
        Dataset.from_path("d", str(tmp_path / "data"), scan_cache=tmp_path / "scans")


class _VersionlessStore(CountingStore):
    """Tells a file's name, size and type, and no version (as an HTTP server without ETag or Last-Modified)."""

    protocol = "versionless"
    store: dict = {}
    pseudo_dirs: list = [""]

    def info(self, path, **kwargs):
        return {key: value for key, value in super().info(path, **kwargs).items() if key in ("name", "size", "type")}

    def find(self, path, *args, **kwargs):
        found = super().find(path, *args, **kwargs)
        if not kwargs.get("detail"):
            return found
        return {name: {key: entry[key] for key in ("name", "size", "type")} for name, entry in found.items()}


def test_a_shard_whose_storage_tells_no_version_is_scanned_every_time_and_never_kept(tmp_path):
    with registered(_VersionlessStore):
        CountingStore.asked.clear()
        put("versionless://bucket/data/a.jsonl", jsonl_bytes([{"text": "x"}] * 5))
        for _ in range(2):
            assert Dataset.from_path("d", "versionless://bucket/data", scan_cache=tmp_path / "scans").num_records == 5
        assert CountingStore.asked["open", "bucket/data/a.jsonl"] == 2
        assert _entries(tmp_path / "scans") == []


def test_ranks_planning_at_once_on_a_cold_scan_cache_read_each_shard_once(tmp_path, monkeypatch):
    """The first rank to miss an entry scans the shard under its lock; the others wait, then load it."""
    with registered(CountingStore):
        url = _write("memory", tmp_path)
        CountingStore.asked.clear()
        slow_open = CountingStore._open

        def opening_slowly(self, path, mode="rb", **kwargs):
            time.sleep(0.2)
            return slow_open(self, path, mode, **kwargs)

        monkeypatch.setattr(CountingStore, "_open", opening_slowly)
        start = threading.Barrier(2)
        planned = []

        def rank():
            start.wait()
            planned.append(_plan_facts(Dataset.from_path("d", url, scan_cache=tmp_path / "scans")))

        ranks = [threading.Thread(target=rank) for _ in range(2)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join()
        assert len(planned) == 2 and planned[0] == planned[1]
        assert [n for key, n in CountingStore.asked.items() if key[0] == "open"] == [1] * _SHARDS


_REMEDY = {errno.EROFS: "mounted read-only", errno.ENOSPC: "free space on its disk", errno.EACCES: "write permission"}
"""What the error tells the operator to do, by errno (zephon/io/_unwritable.py)."""


@pytest.mark.parametrize("errno_", [errno.EROFS, errno.ENOSPC, errno.EACCES], ids=["read-only", "full", "denied"])
def test_a_scan_cache_that_cannot_take_an_entry_is_a_configuration_error_naming_it(tmp_path, monkeypatch, errno_):
    """Planning without the cache would read the whole corpus on every rank again, unsaid."""
    url = _write("local", tmp_path)
    scans = str(tmp_path / "scans")
    os.makedirs(scans)
    real_open = os.open

    def refusing_open(path, *args, **kwargs):
        if str(path).startswith(scans):
            raise OSError(errno_, os.strerror(errno_), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(_scan_cache.os, "open", refusing_open)
    named = f"scan cache directory {scans} cannot be written .*{errno.errorcode[errno_]}"
    with pytest.raises(ConfigurationError, match=named) as caught:
        Dataset.from_path("d", url, scan_cache=scans)
    assert _REMEDY[errno_] in str(caught.value)
    if errno_ != errno.ENOSPC:  # an operator told to free space on a read-only or denied disk deletes for nothing
        assert "free space" not in str(caught.value)


def test_a_warm_scan_cache_on_a_disk_that_takes_no_writes_is_read(tmp_path, monkeypatch, opens):
    url = _write("local", tmp_path)
    scans = str(tmp_path / "scans")
    Dataset.from_path("d", url, scan_cache=scans)
    real_open = os.open

    def refusing_open(path, *args, **kwargs):
        if str(path).startswith(scans):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(_scan_cache.os, "open", refusing_open)
    before = opens()
    assert Dataset.from_path("d", url, scan_cache=scans).num_records == sum(40 + i for i in range(_SHARDS))
    assert opens() == before


@pytest.mark.parametrize(
    "given", [lambda tmp: tmp / "a-file" / "scans", lambda tmp: "s3://bucket/scans", lambda tmp: 7],
    ids=["under-a-file", "a-url", "not-a-path"],
)
def test_a_scan_cache_that_is_no_local_directory_that_can_be_made_is_a_configuration_error(tmp_path, given):
    (tmp_path / "a-file").write_text("")
    url = _write("local", tmp_path)
    with pytest.raises(ConfigurationError, match="scan_cache|scan cache directory"):
        Dataset.from_path("d", url, scan_cache=given(tmp_path))


def test_a_rank_that_waited_on_a_lock_file_a_cleaner_removed_locks_the_one_now_in_its_place(tmp_path, monkeypatch):
    """A cleaner removes an old version's lock file while holding its lock; a rank waiting on that
    file then locks a file no other rank opens, and would scan and store beside the next one."""
    path = str(tmp_path / "entry.lock")
    held = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    waiting = threading.Event()
    real_lock = _scan_cache.lock

    def signalling_lock(handle, blocking):
        waiting.set()
        return real_lock(handle, blocking)

    monkeypatch.setattr(_scan_cache, "lock", signalling_lock)
    taken = []
    rank = threading.Thread(target=lambda: taken.append(_scan_cache._locked(path)))
    rank.start()
    waiting.wait()
    os.unlink(path)  # as `_remove_superseded` does, under the lock
    os.close(held)
    rank.join()
    [(handle, locked)] = taken
    try:
        assert locked and os.fstat(handle).st_ino == os.stat(path).st_ino
    finally:
        os.close(handle)


def test_a_cleaner_whose_lock_file_was_replaced_meanwhile_leaves_the_entry_a_rank_now_stores(tmp_path, monkeypatch):
    """Another cleaner removed an old version's lock file after this one opened it, and a rank
    waiting on that version locked the file now at its name and began storing. The lock this
    cleaner then took, on the removed file, guards nothing: it removed the rank's `.part` and its
    lock file, so the rank's store failed and a third rank could scan that version beside it."""
    versions = str(tmp_path)
    stem, kept = os.path.join(versions, "a" * 64), os.path.join(versions, "b" * 64 + ".npz")
    for name in (stem + ".npz", stem + ".lock", kept):
        open(name, "wb").close()
    real_lock = _file_lock.lock
    rank = []

    def replaced_before_locking(handle, blocking):
        if not rank:
            os.unlink(stem + ".lock")  # the other cleaner, under its lock
            os.unlink(stem + ".npz")
            rank.append(os.open(stem + ".lock", os.O_RDWR | os.O_CREAT))
            fcntl.flock(rank[0], fcntl.LOCK_EX)
            open(stem + ".npz.part", "wb").close()
        return real_lock(handle, blocking)

    monkeypatch.setattr(_file_lock, "lock", replaced_before_locking)
    try:
        _scan_cache._remove_superseded(versions, kept)
        assert os.path.exists(stem + ".npz.part")
        assert os.stat(stem + ".lock").st_ino == os.fstat(rank[0]).st_ino
    finally:
        os.close(rank[0])


_WARM_FROM_ANOTHER_PROCESS = """
import json, sys
from tests.harness import step_digests
from zephon.demo._recipe import demo_pipeline
print(json.dumps(step_digests(demo_pipeline(runner="inline", scan_cache=sys.argv[1]), 1, 3)))
"""


def test_the_demo_recipe_s_batches_are_the_same_with_its_scans_cold_warm_and_warm_in_another_process(tmp_path):
    scans = str(tmp_path / "scans")
    scanned = step_digests(demo_pipeline(runner="inline"), 1, 3)
    cold = step_digests(demo_pipeline(runner="inline", scan_cache=scans), 1, 3)
    assert len(_entries(scans)) == 7  # the shards of both datasets
    warm = step_digests(demo_pipeline(runner="inline", scan_cache=scans), 1, 3)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other = subprocess.run([sys.executable, "-c", _WARM_FROM_ANOTHER_PROCESS, scans], capture_output=True,
                           text=True, check=True, cwd=root)
    assert scanned == cold == warm == json.loads(other.stdout)


_KILLED_WHILE_WRITING = """
import os, signal, sys
from zephon.io import Dataset, _scan_cache

def write_half_then_die(f, **arrays):
    f.write(b"PK" + b"\\0" * 100)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

_scan_cache.np.savez = write_half_then_die
Dataset.from_path("d", sys.argv[1], scan_cache=sys.argv[2])
"""


def test_a_writer_killed_while_storing_a_scan_leaves_no_entry_and_the_next_planning_stores_it_whole(tmp_path, caplog):
    url = _write("local", tmp_path)
    scans = str(tmp_path / "scans")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_WRITING, url, scans], cwd=root, capture_output=True)
    assert killed.returncode == -9, killed.stderr
    assert _entries(scans) == [] and any(name.endswith(".part") for name in _files(scans))
    with caplog.at_level(logging.WARNING, logger="zephon"):
        ds = Dataset.from_path("d", url, scan_cache=scans)
    assert not caplog.records
    assert _plan_facts(ds) == _plan_facts(Dataset.from_path("d", url))
    assert len(_entries(scans)) == _SHARDS and not any(name.endswith(".part") for name in _files(scans))


def test_a_filesystem_that_never_reports_the_lock_file_at_its_name_is_used_unlocked_not_waited_on(tmp_path, monkeypatch):
    """Were an open file's identity never the one its name reports (a filesystem answering `fstat`
    and `stat` with different inodes), relocking would go on for ever: the rank scans unlocked."""
    monkeypatch.setattr(_scan_cache, "still_at", lambda handle, path: False)
    path = str(tmp_path / "entry.lock")
    result = []
    rank = threading.Thread(target=lambda: result.append(_scan_cache._locked(path)), daemon=True)
    rank.start()
    rank.join(60)
    assert result, "_locked kept relocking a file its filesystem never reports at its name"
    [(handle, locked)] = result
    os.close(handle)
    assert not locked
