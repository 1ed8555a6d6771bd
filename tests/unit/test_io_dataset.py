"""A Dataset lists shards deterministically, chunks them exactly, and travels cheaply to workers."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import subprocess
import sys

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon import Chunk, ConfigurationError
from zephon.io import Dataset, ErrorPolicy, ShardInfo, ShardUnavailableError

from .conftest_io import compress, jsonl_bytes, memory_root, parquet_bytes, put, tar_bytes


def write_shards(root, sizes: list[int]) -> list[list[dict]]:
    shards = [[{"shard": s, "i": i} for i in range(n)] for s, n in enumerate(sizes)]
    for s, records in enumerate(shards):
        (root / f"part-{s:03d}.jsonl").write_bytes(jsonl_bytes(records))
    return shards


def test_directory_lists_its_shards_sorted_recursively_ignoring_other_files(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ["b.jsonl", "a.jsonl", "sub/c.jsonl", "10.jsonl", "2.jsonl"]:
        (tmp_path / name).write_bytes(jsonl_bytes([{"name": name}]))
    (tmp_path / "README.md").write_text("not a shard")
    (tmp_path / ".partial.jsonl").write_text("hidden: not a shard")
    ds = Dataset.from_path("d", str(tmp_path))
    names = [s.url.removeprefix(str(tmp_path) + "/") for s in ds.shards]
    assert names == ["10.jsonl", "2.jsonl", "a.jsonl", "b.jsonl", "sub/c.jsonl"]
    again = Dataset.from_path("d", str(tmp_path))
    assert again.shards == ds.shards and again.fingerprint() == ds.fingerprint()


def test_glob_selects_only_matching_shards(tmp_path):
    write_shards(tmp_path, [2, 3, 4])
    ds = Dataset.from_path("d", str(tmp_path / "part-00[02].jsonl"))
    assert [s.url.rpartition("/")[2] for s in ds.shards] == ["part-000.jsonl", "part-002.jsonl"]
    assert ds.num_records == 6


def test_format_is_inferred_and_a_mixed_directory_needs_it_declared(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes([{"x": 1}]))
    (tmp_path / "b.parquet").write_bytes(parquet_bytes([{"x": 2}, {"x": 3}], row_group_size=10))
    with pytest.raises(ConfigurationError, match="several formats"):
        Dataset.from_path("d", str(tmp_path))
    ds = Dataset.from_path("d", str(tmp_path), format="parquet")
    assert [s.num_records for s in ds.shards] == [2]


@pytest.mark.parametrize("declared", [None, "jsonl", "webdataset", "parquet"])
@pytest.mark.parametrize(
    "shard, fmt",
    [("b.jsonl.bz2", "jsonl"), ("b.json.xz", "jsonl"), ("b.jsonl.lz4", "jsonl"), ("b.tar.bz2", "webdataset"),
     ("b.tar.xz", "webdataset"), ("b.tbz2", "webdataset"), ("b.txz", "webdataset"), ("b.taz", "webdataset"),
     ("b.parquet.gz", "parquet"), ("b.JSONL.BZ2", "jsonl"), ("b.Json.Xz", "jsonl"), ("b.TAR.XZ", "webdataset"),
     ("b.TBZ2", "webdataset"), ("b.PARQUET.GZ", "parquet")],
)
def test_a_shard_compressed_in_a_way_zephon_cannot_read_is_a_named_error_not_left_out(tmp_path, shard, fmt, declared):
    """A directory listing `part-7.jsonl.bz2` or `shard-3.tar.xz` beside shards it reads passed
    over them as if they were a README: their records were missing from the plan unsaid."""
    readable = {"jsonl": "a.jsonl", "webdataset": "a.tar", "parquet": "a.parquet"}[fmt]
    (tmp_path / readable).write_bytes(b"{}\n" if fmt == "jsonl" else b"")
    (tmp_path / shard).write_bytes(b"compressed bytes")
    if declared not in (None, fmt):  # a shard of another format than the dataset's is not its shard
        with pytest.raises(ConfigurationError, match="holds no"):
            Dataset.from_path("d", str(tmp_path), format=declared)
        return
    message = f"{re.escape(str(tmp_path / shard))} is a {fmt} shard of .* that cannot be read"
    with pytest.raises(ConfigurationError, match=message):
        Dataset.from_path("d", str(tmp_path), format=declared)
    with pytest.raises(ConfigurationError, match=message):
        Dataset.from_path("d", str(tmp_path / shard), format=declared)


def test_names_that_only_look_compressed_are_passed_over_as_before(tmp_path):
    """A checksum or a backup beside a shard (`a.jsonl.md5`, `a.tar.bak`) is no shard."""
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes([{"x": 1}]))
    for name in ("a.jsonl.md5", "a.jsonl.bak", "a.tar.sha256", "a.jsonl.MD5", "a.JSONL.Bak", "a.TAR.SHA256"):
        (tmp_path / name).write_text("not a shard")
    assert [s.url.rpartition("/")[2] for s in Dataset.from_path("d", str(tmp_path)).shards] == ["a.jsonl"]


# Shards of each format written in lower case, and the same shards under upper- or mixed-case names
# (as Windows tools and some exporters write them); names sort alike in both, so shard order is one.
_CASED_SHARDS = {
    "jsonl": [("p0.jsonl", "P0.JSONL", None), ("p1.jsonl.gz", "P1.Jsonl.GZ", "gz"),
              ("p2.json.zst", "P2.JSON.ZST", "zst"), ("p3.jsonl.zstd", "P3.jsonl.Zstd", "zst")],
    "text": [("p0.txt", "P0.TXT", None), ("p1.txt.gz", "P1.Txt.Gz", "gz")],
    "parquet": [("p0.parquet", "P0.PARQUET", None), ("p1.parquet", "P1.Parquet", None)],
    "webdataset": [("p0.tar", "P0.TAR", None), ("p1.tar", "P1.Tar", None), ("p2.tar.gz", "P2.TAR.GZ", "gz"),
                   ("p3.tgz", "P3.Tgz", "gz"), ("p4.tar.zst", "P4.Tar.Zst", "zst"), ("p5.tzst", "P5.TZST", "zst"),
                   ("p6.tar.zstd", "P6.TAR.ZSTD", "zst")],
}


def _write_cased_shards(root, fmt: str, cased: bool) -> list[str]:
    """Write the `_CASED_SHARDS` of `fmt` under `root`, each with records of its own; their names."""
    root.mkdir()
    names = []
    for i, (lower, upper, compression) in enumerate(_CASED_SHARDS[fmt]):
        records = [{"text": f"shard {i} record {r}"} for r in range(3)]
        if fmt == "parquet":
            data = parquet_bytes(records, row_group_size=2)
        elif fmt == "webdataset":
            data = compress(tar_bytes([(f"k{r}.txt", rec["text"].encode()) for r, rec in enumerate(records)]),
                            compression)
        elif fmt == "text":
            data = compress("".join(rec["text"] + "\n" for rec in records).encode(), compression)
        else:
            data = jsonl_bytes(records, compression)
        names.append(upper if cased else lower)
        (root / names[-1]).write_bytes(data)
    (root / ("README.MD" if cased else "README.md")).write_text("not a shard")
    return names


def _records(ds: Dataset) -> list[dict]:
    return [record for chunk in ds.chunks(2) for record in ds.read_chunk(chunk).records]


@pytest.mark.parametrize("declared", [False, True], ids=["inferred", "declared"])
@pytest.mark.parametrize("listing", ["directory", "glob"])
@pytest.mark.parametrize("fmt", list(_CASED_SHARDS))
def test_shards_with_upper_or_mixed_case_suffixes_are_planned_and_read_like_lower_case_ones(
    tmp_path, fmt, listing, declared
):
    """`B.JSONL`, `C.Jsonl.GZ`, `D.PARQUET`, `E.TAR` were passed over like a README: their records
    were missing from the plan unsaid. They are shards of their format, decompressed by their
    suffix as in lower case, and read as the same records."""
    datasets = {}
    for cased in (False, True):
        root = tmp_path / ("cased" if cased else "lower")
        names = _write_cased_shards(root, fmt, cased)
        url = str(root) if listing == "directory" else f"{root}/*"
        ds = Dataset.from_path("d", url, format=fmt if declared else None)
        assert [s.url.rpartition("/")[2] for s in ds.shards] == names
        datasets[cased] = ds
    assert _records(datasets[True]) == _records(datasets[False])
    assert len(_records(datasets[True])) == 3 * len(_CASED_SHARDS[fmt])


@pytest.mark.parametrize("name, compression", [("X.JSONL", None), ("X.Json.GZ", "gz"), ("X.JSONL.ZSTD", "zst")])
def test_a_file_named_directly_with_an_upper_case_suffix_has_its_format_and_compression_inferred(
    tmp_path, name, compression
):
    (tmp_path / name).write_bytes(jsonl_bytes([{"x": 1}, {"x": 2}], compression))
    for declared in (None, "jsonl"):
        ds = Dataset.from_path("d", str(tmp_path / name), format=declared)
        assert ds.read_chunk(ds.chunks(5)[0]).records == [{"x": 1}, {"x": 2}]


def test_names_differing_only_in_the_case_of_their_suffix_are_two_shards(tmp_path):
    """On a case-sensitive filesystem `a.jsonl` and `a.JSONL` are two files: both are read."""
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes([{"x": 1}]))
    (tmp_path / "a.JSONL").write_bytes(jsonl_bytes([{"x": 2}]))
    ds = Dataset.from_path("d", str(tmp_path))
    assert [s.url.rpartition("/")[2] for s in ds.shards] == ["a.JSONL", "a.jsonl"]
    assert _records(ds) == [{"x": 2}, {"x": 1}]


def test_a_file_named_directly_is_read_in_the_declared_format(tmp_path):
    (tmp_path / "corpus.log").write_bytes(b"one\ntwo\n")
    with pytest.raises(ConfigurationError, match="cannot infer"):
        Dataset.from_path("d", str(tmp_path / "corpus.log"))
    ds = Dataset.from_path("d", str(tmp_path / "corpus.log"), format="text")
    assert ds.read_chunk(ds.chunks(5)[0]).records == [{"text": "one"}, {"text": "two"}]


def test_file_url_and_memory_url_work_like_local_paths(tmp_path):
    write_shards(tmp_path, [3])
    via_file = Dataset.from_path("d", f"file://{tmp_path}")
    root = memory_root()
    put(f"{root}/part-000.jsonl", (tmp_path / "part-000.jsonl").read_bytes())
    via_memory = Dataset.from_path("d", root)
    assert via_memory.shards[0].url.startswith("memory://")
    for ds in (via_file, via_memory):
        assert ds.read_chunk(ds.chunks(3)[0]).records == [{"shard": 0, "i": i} for i in range(3)]


@pytest.mark.parametrize("pattern", ["", "*.jsonl", "*/*.jsonl", "**/*.jsonl", "sub/**", "**/c.json*", "part-00[0-1].jsonl"])
def test_plain_paths_list_the_same_shards_as_file_urls(tmp_path, pattern):
    """Local paths are listed without fsspec (zephon.io._local); without links, what they select
    is what fsspec's own listing selects, less what is hidden below the URL."""
    write_shards(tmp_path, [2, 3])
    for name in ["sub/c.jsonl", "sub/deeper/d.jsonl", ".hidden-dir/e.jsonl", "sub/.f.jsonl", "sub/notes.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(jsonl_bytes([{"name": name}]))
    url = f"{tmp_path}/{pattern}" if pattern else str(tmp_path)
    plain = Dataset.from_path("d", url, format="jsonl")
    via_fsspec = Dataset.from_path("d", f"file://{url}", format="jsonl")
    fs = fsspec.filesystem("file")
    listing = fs.glob(url, detail=True) if pattern else fs.find(url, detail=True)
    fsspecs_own = sorted(  # less hidden files, and files in hidden directories below the URL
        p for p, info in listing.items()
        if info["type"] == "file" and re.fullmatch(r"(/[^./][^/]*)*\.jsonl", p.removeprefix(str(tmp_path)))
    )
    assert [s.url for s in plain.shards] == fsspecs_own and len(fsspecs_own) >= 1
    assert plain.shards == via_fsspec.shards
    assert [plain.read_chunk(c).records for c in plain.chunks(2)] == [
        via_fsspec.read_chunk(c).records for c in via_fsspec.chunks(2)
    ]


def hf_cache_snapshot(tmp_path):
    """A Hugging Face cache snapshot: a shard, a link to a shard's blob, and a dangling link to a
    deleted blob that names no shard (a README)."""
    blobs, data = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "a.jsonl").write_bytes(jsonl_bytes([{"i": 0}]))
    (blobs / "b").write_bytes(jsonl_bytes([{"i": 1}, {"i": 2}]))
    (data / "sub" / "b.jsonl").symlink_to(blobs / "b")
    (data / "sub" / "README.md").symlink_to(blobs / "gone-readme")
    return blobs, data


@pytest.mark.parametrize("pattern", ["", "**/*", "*/*"])
def test_file_urls_list_links_to_shards_like_plain_paths(tmp_path, pattern):
    """A Hugging Face cache snapshot holds only links to its blobs; fsspec lists a link as "other".
    A dangling link that names no shard is passed over, as a README file would be."""
    _, data = hf_cache_snapshot(tmp_path)
    url = f"{data}/{pattern}" if pattern else str(data)
    plain = Dataset.from_path("d", url)
    via_fsspec = Dataset.from_path("d", f"file://{url}")
    assert [(s.url.rpartition("/")[2], s.num_records) for s in via_fsspec.shards] == [("a.jsonl", 1), ("b.jsonl", 2)]
    assert via_fsspec.shards == plain.shards


@pytest.mark.parametrize("scheme", ["", "file://"])
@pytest.mark.parametrize("pattern", ["", "**/*.jsonl", "*/*"])
@pytest.mark.parametrize("declared", [None, "jsonl"])
def test_a_dangling_link_named_like_a_shard_is_a_named_error_not_a_shard_left_out(
    tmp_path, scheme, pattern, declared
):
    """A snapshot whose blob was deleted misses that shard: the plan would silently hold less data."""
    blobs, data = hf_cache_snapshot(tmp_path)
    (data / "sub" / "c.jsonl").symlink_to(os.path.relpath(blobs / "c", data / "sub"))
    url = f"{scheme}{data}/{pattern}" if pattern else f"{scheme}{data}"
    link, target = re.escape(str(data / "sub" / "c.jsonl")), re.escape(str(blobs / "c"))
    with pytest.raises(ConfigurationError, match=f"{link} is a shard of .* that links to {target}, which does not exist"):
        Dataset.from_path("d", url, format=declared)


def test_a_dangling_link_of_another_format_than_the_declared_one_is_not_a_shard(tmp_path):
    _, data = hf_cache_snapshot(tmp_path)
    (data / "sub" / "c.parquet").symlink_to(tmp_path / "gone.parquet")
    assert [s.url.rpartition("/")[2] for s in Dataset.from_path("d", str(data), format="jsonl").shards] == [
        "a.jsonl",
        "b.jsonl",
    ]


@pytest.mark.parametrize("scheme", ["", "file://"])
@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("data[1].jsonl", ["data[1].jsonl"]),  # as a glob it would be data1.jsonl
        ("run[2024]", ["run[2024]/x.jsonl"]),
        ("run[2024]/", ["run[2024]/x.jsonl"]),
        ("data[0-9].jsonl", ["data1.jsonl"]),  # names nothing as written: a glob
        ("data[[]1].jsonl", ["data[1].jsonl"]),
        ("run[[]2024]/*.jsonl", ["run[2024]/x.jsonl"]),
    ],
)
def test_a_path_naming_a_file_or_directory_as_written_is_not_a_glob(tmp_path, scheme, pattern, expected):
    for name in ["data[1].jsonl", "data1.jsonl", "run[2024]/x.jsonl", "run2/y.jsonl"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(jsonl_bytes([{"name": name}]))
    ds = Dataset.from_path("d", f"{scheme}{tmp_path}/{pattern}")
    assert [s.url.removeprefix(f"{tmp_path}/") for s in ds.shards] == expected
    assert ds.read_chunk(ds.chunks(1)[0]).records == [{"name": expected[0]}]


def linked_dataset(tmp_path):
    """A dataset directory holding a shard, links to a directory and a file kept elsewhere, and a
    dangling link that names no shard; the dataset is reached through a link too."""
    elsewhere, data = tmp_path / "elsewhere", tmp_path / "data"
    (elsewhere / "deep").mkdir(parents=True)
    (data / "real").mkdir(parents=True)
    (data / "real" / "a.jsonl").write_bytes(jsonl_bytes([{"i": 0}]))
    (elsewhere / "b.jsonl").write_bytes(jsonl_bytes([{"i": 1}]))
    (elsewhere / "deep" / "c.jsonl").write_bytes(jsonl_bytes([{"i": 2}, {"i": 3}]))
    (data / "linked").symlink_to(elsewhere, target_is_directory=True)
    (data / "real" / "d.jsonl").symlink_to(elsewhere / "b.jsonl")
    (data / "real" / "dangling.md").symlink_to(elsewhere / "gone.md")
    (tmp_path / "data-link").symlink_to(data, target_is_directory=True)
    return tmp_path / "data-link"


@pytest.mark.parametrize("scheme", ["", "file://"])
@pytest.mark.parametrize("pattern", ["", "/", "/**/*.jsonl", "/**"])
def test_a_directory_a_glob_and_a_file_url_list_the_same_linked_shards(tmp_path, scheme, pattern):
    """A plain glob followed links to directories; a plain directory and file:// passed over them."""
    root = linked_dataset(tmp_path)
    ds = Dataset.from_path("d", f"{scheme}{root}{pattern}")
    assert [(s.url.removeprefix(f"{root}/"), s.num_records) for s in ds.shards] == [
        ("linked/b.jsonl", 1),
        ("linked/deep/c.jsonl", 2),
        ("real/a.jsonl", 1),
        ("real/d.jsonl", 1),
    ]
    assert [r["i"] for c in ds.chunks(2) for r in ds.read_chunk(c).records] == [1, 2, 3, 0, 1]


@pytest.mark.parametrize("scheme", ["", "file://"])
@pytest.mark.parametrize("pattern", ["", "/**/*.jsonl", "/sub/**"])
@pytest.mark.parametrize("loop", ["to-itself", "to-an-ancestor", "through-two-links"])
def test_a_loop_of_links_is_a_named_error_not_shards_listed_over_and_over(tmp_path, scheme, pattern, loop):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "a.jsonl").write_bytes(jsonl_bytes([{"i": 0}]))
    if loop == "through-two-links":  # sub/out -> other, other/back -> sub
        (data / "other").mkdir()
        (data / "sub" / "out").symlink_to(data / "other", target_is_directory=True)
        (data / "other" / "back").symlink_to(data / "sub", target_is_directory=True)
    else:
        (data / "sub" / "up").symlink_to(data / "sub" if loop == "to-itself" else tmp_path, target_is_directory=True)
    with pytest.raises(ConfigurationError, match="a loop of symbolic links"):
        Dataset.from_path("d", f"{scheme}{data}{pattern}")


def deny(directory, mode: int, monkeypatch) -> None:
    """Take permissions away from `directory`: reading and searching it (0o000) or searching it
    alone (0o444). Root reads through any mode, so there the calls that the mode would make fail
    are made to fail as they would, with EACCES."""
    if os.geteuid() != 0:
        directory.chmod(mode)
        return

    def denying(real, refuses):
        def call(path=".", *args, **kwargs):
            if isinstance(path, str) and refuses(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real(path, *args, **kwargs)
        return call

    def inside(path):
        return path.startswith(f"{directory}{os.sep}")

    if mode == 0o000:
        monkeypatch.setattr(os, "scandir", denying(os.scandir, lambda path: path == str(directory)))
    monkeypatch.setattr(os, "stat", denying(os.stat, inside))
    monkeypatch.setattr(os, "lstat", denying(os.lstat, inside))


@pytest.mark.parametrize("scheme", ["", "file://"])
@pytest.mark.parametrize("pattern", ["", "/**/*.jsonl", "/*/*.jsonl", "/*/a.jsonl"])
@pytest.mark.parametrize("mode", [0o000, 0o444], ids=["unlistable", "unsearchable"])
def test_a_directory_that_cannot_be_read_is_a_named_error_not_shards_left_out(tmp_path, scheme, pattern, mode,
                                                                              monkeypatch):
    """os.walk and glob take a directory they may not read for an empty one: its shards vanished."""
    data = tmp_path / "data"
    for name in ["locked/a.jsonl", "open/a.jsonl"]:
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(jsonl_bytes([{"i": 0}]))
    deny(data / "locked", mode, monkeypatch)
    try:
        with pytest.raises(ConfigurationError, match=f"{re.escape(str(data / 'locked'))}.* cannot be read"):
            Dataset.from_path("d", f"{scheme}{data}{pattern}")
    finally:
        (data / "locked").chmod(0o755)


def test_relative_and_home_paths_are_listed_as_absolute_paths(tmp_path, monkeypatch):
    write_shards(tmp_path, [2])
    monkeypatch.chdir(tmp_path.parent)
    relative = Dataset.from_path("d", tmp_path.name)
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    home = Dataset.from_path("d", f"~/{tmp_path.name}/*.jsonl")
    expected = [str(tmp_path / "part-000.jsonl")]
    assert [s.url for s in relative.shards] == [s.url for s in home.shards] == expected
    with pytest.raises(ConfigurationError, match="not a file, a directory or a glob"):
        Dataset.from_path("d", "no-such-directory")


def test_a_relative_path_that_names_nothing_says_which_directory_it_was_looked_for_from(tmp_path, monkeypatch):
    """The README's `Dataset.from_path("bible", "zephon/data/kjv")`, run from another directory
    than the repository's, said only that the path is not a file, a directory or a glob."""
    (tmp_path / "data").mkdir()
    write_shards(tmp_path / "data", [2])
    monkeypatch.chdir(tmp_path)
    for url in ("zephon/data/kjv", "data/*.parquet"):
        with pytest.raises(ConfigurationError, match=re.escape(f"looked for from the working directory {tmp_path}")):
            Dataset.from_path("d", url)
    with pytest.raises(ConfigurationError) as caught:
        Dataset.from_path("d", str(tmp_path / "missing"))
    assert "working directory" not in str(caught.value)


def test_a_home_relative_path_that_names_nothing_is_not_said_to_be_looked_for_from_the_working_directory(
    tmp_path, monkeypatch
):
    """`~/data` is listed from the home directory, but its refusal said it was looked for from the
    working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigurationError) as caught:
        Dataset.from_path("d", "~/missing")
    assert "working directory" not in str(caught.value)


def _directory(tmp_path, where: str, names: list[str]) -> str:
    """A directory holding empty files `names`, on the local disk or in memory://."""
    if where == "local":
        for name in names:
            (tmp_path / name).write_bytes(b"")
        return str(tmp_path)
    root = memory_root()
    fsspec.filesystem("memory").mkdir(root)
    for name in names:
        put(f"{root}/{name}", b"")
    return root


_ANY_FORMAT = "file of a format read here (arrow, jsonl, parquet, text, webdataset, by suffix)"


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize(
    ("names", "format", "says"),
    [
        ([], None, f"holds no {_ANY_FORMAT}: it is empty"),
        ([], "jsonl", "holds no jsonl file: it is empty"),
        ([".DS_Store"], "jsonl", "holds no jsonl file; it holds .DS_Store"),
        (["a.jsonl"], "parquet", "holds no parquet file; it holds a.jsonl"),
        (["README.md", "_SUCCESS"], None, f"holds no {_ANY_FORMAT}; it holds README.md, _SUCCESS"),
        ([f"n{i}.md" for i in range(8)], "text", "holds no text file; it holds n0.md, n1.md, n2.md, n3.md, n4.md and 3 more"),
    ],
    ids=["empty", "empty-jsonl", "hidden-only", "other-format", "no-known-format", "many-others"],
)
def test_a_directory_holding_no_shard_says_it_exists_naming_the_format_and_what_it_holds(
    tmp_path, where, names, format, says
):
    """An empty directory, or one of other files, read as a glob that matched nothing ("matches
    no files") or said only that it holds no shards: nothing told that the directory is there
    and what is in it instead."""
    url = _directory(tmp_path, where, names)
    with pytest.raises(ConfigurationError, match=re.escape(f"the directory {url} exists but {says}")):
        Dataset.from_path("d", url, format=format)


def _stat_failing_at(monkeypatch, path: str, error: OSError) -> None:
    real_stat = os.stat

    def stat(target, *args, **kwargs):
        if os.fspath(target) == path:
            raise error
        return real_stat(target, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)


def test_a_local_path_that_cannot_be_looked_at_is_retried_not_taken_for_nothing_there(tmp_path, monkeypatch):
    """`os.path.isdir` and `isfile` say False for every error: EIO from a mounted bucket read as a
    path naming nothing."""
    write_shards(tmp_path, [2])
    _stat_failing_at(monkeypatch, str(tmp_path), OSError(errno.EIO, "Input/output error", str(tmp_path)))
    unavailable = f"{re.escape(str(tmp_path))} unavailable after 2 attempt"
    with pytest.raises(ShardUnavailableError, match=unavailable) as caught:
        Dataset.from_path("d", str(tmp_path), retries=2, retry_delay=0.001)
    assert caught.value.__cause__.errno == errno.EIO
    assert f"while listing dataset 'd' at {tmp_path}" in caught.value.__notes__


def test_a_local_path_that_may_not_be_looked_at_is_a_configuration_error_naming_it(tmp_path, monkeypatch):
    write_shards(tmp_path, [2])
    _stat_failing_at(monkeypatch, str(tmp_path), PermissionError(errno.EACCES, "Permission denied", str(tmp_path)))
    with pytest.raises(ConfigurationError, match=f"{re.escape(str(tmp_path))} may not be listed .*Permission denied"):
        Dataset.from_path("d", str(tmp_path), retries=2, retry_delay=0.001)


def test_reading_local_shards_does_not_import_fsspec(tmp_path):
    """fsspec brings asyncio and ssl (7 MiB PSS per process); local data must not pay for them."""
    write_shards(tmp_path, [3])
    script = (
        "import sys; from zephon.io import Dataset; "
        f"ds = Dataset.from_path('d', {str(tmp_path)!r}); "
        "records = ds.read_chunk(ds.chunks(3)[0]).records; "
        "print(len(records), 'fsspec' in sys.modules, 'asyncio' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["3", "False", "False"]


def test_planning_and_reading_local_shards_imports_nothing_only_a_rare_path_needs(tmp_path):
    """An http(s) server's index pages and Retry-After dates need html, urllib.parse and
    email.utils, a scan cache's entry tempfile, a misnamed field's suggestion difflib: about 1.3
    MiB of every process's memory on 3.14t that a right recipe over local data must not pay.
    Those importlib.metadata imports itself (3.11's imports email.utils) are not Zephon's."""
    write_shards(tmp_path, [3])
    rare = ("html", "urllib.parse", "email.utils", "tempfile", "difflib")
    script = (
        "import sys, importlib.metadata; "
        f"not_yet = [name for name in {rare!r} if name not in sys.modules]; "
        "from zephon.io import Dataset; "
        f"ds = Dataset.from_path('d', {str(tmp_path)!r}); "
        "records = ds.read_chunk(ds.chunks(3)[0]).records; "
        "print(len(records), 'html' in not_yet, [name for name in not_yet if name in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["3", "True", "[]"]


def test_zero_length_shard_has_no_records_no_chunks_and_no_error(tmp_path):
    write_shards(tmp_path, [2, 0, 1])
    (tmp_path / "part-003.jsonl").write_bytes(b"")
    ds = Dataset.from_path("d", str(tmp_path))
    assert [s.num_records for s in ds.shards] == [2, 0, 1, 0]
    assert ds.chunks(10) == [Chunk("d", 0, 0, 2), Chunk("d", 2, 0, 1)]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5), records_per_chunk=st.integers(1, 17))
def test_chunks_cover_every_record_once_in_shard_then_record_order(sizes, records_per_chunk):
    root = memory_root()
    expected = []
    for s, n in enumerate(sizes):
        records = [{"shard": s, "i": i} for i in range(n)]
        put(f"{root}/{s:03d}.jsonl", jsonl_bytes(records) if n else b"")
        expected += records
    ds = Dataset.from_path("d", root)
    chunks = ds.chunks(records_per_chunk)
    assert all(0 < c.num_records <= records_per_chunk for c in chunks)
    assert [(c.shard, c.start) for c in chunks] == sorted((c.shard, c.start) for c in chunks)
    covered = [(c.shard, i) for c in chunks for i in range(c.start, c.stop)]
    assert covered == [(s, i) for s, n in enumerate(sizes) for i in range(n)]
    read = [r for c in chunks for r in ds.read_chunk(c).records]
    assert read == expected


def test_pickled_dataset_is_small_and_reads_the_same(tmp_path):
    write_shards(tmp_path, [1000, 10, 700])
    ds = Dataset.from_path("d", str(tmp_path))
    chunk = ds.chunks(300)[1]
    expected = ds.read_chunk(chunk)  # builds the lazily made reading filesystem first
    payload = pickle.dumps(ds)
    assert len(payload) < 4096
    clone = pickle.loads(payload)
    assert clone == ds
    assert clone.read_chunk(chunk).records == expected.records


def test_fingerprint_is_json_and_names_every_shard(tmp_path):
    write_shards(tmp_path, [2, 3])
    ds = Dataset.from_path("d", str(tmp_path))
    fingerprint = json.loads(json.dumps(ds.fingerprint()))
    assert fingerprint["name"] == "d" and fingerprint["format"] == "jsonl"
    assert [(s["url"], s["num_records"], s["nbytes"]) for s in fingerprint["shards"]] == [
        (s.url, s.num_records, s.nbytes) for s in ds.shards
    ]
    assert all(isinstance(s, ShardInfo) for s in ds.shards)


@pytest.mark.parametrize("spelling", ["{dir}/", "./{name}", "./{name}/", "file://{dir}", "file://{dir}/", "{dir}/*.jsonl"])
def test_spellings_of_one_directory_give_the_same_shards_and_fingerprint(tmp_path, monkeypatch, spelling):
    """The fingerprint enters the checkpoint's recipe digest: a run resumed with `data/` for
    `data` was refused as a recipe over changed data, though it reads the same shards."""
    directory = tmp_path / "data"
    directory.mkdir()
    write_shards(directory, [2, 3])
    monkeypatch.chdir(tmp_path)
    plain = Dataset.from_path("d", str(directory))
    other = Dataset.from_path("d", spelling.format(dir=directory, name="data"))
    assert other.shards == plain.shards
    assert other.fingerprint() == plain.fingerprint()


def test_error_policy_accepts_its_enum_and_strings(tmp_path):
    write_shards(tmp_path, [1])
    ds = Dataset.from_path("d", str(tmp_path))
    assert ds.read_chunk(ds.chunks(1)[0], on_error=ErrorPolicy.RAISE).records == [{"shard": 0, "i": 0}]
    with pytest.raises(ConfigurationError, match="on_error='ignore'"):
        ds.read_chunk(ds.chunks(1)[0], on_error="ignore")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "non-empty name"),
        ({"format": "csv"}, "format='csv'"),
        ({"text_unit": "paragraph"}, "text_unit='paragraph'"),
        ({"cache": {"enabled": True, "size": 3}}, "cache options"),
        ({"cache": {"enabled": "false"}}, "enabled='false'"),  # bool("false") turned the cache on
        ({"cache": {"enabled": True, "dir": 3}}, "dir=3"),
        ({"retries": 0}, "retries=0"),
        ({"retries": True}, "retries=True"),  # an int to Python: it meant 1 attempt, no retry at all
        ({"storage_options": "anon=true"}, "storage_options='anon=true'"),
        ({"url_suffix": "/missing"}, "not a file, a directory or a glob"),
        ({"url_suffix": "/*.parquet"}, "matches no files"),
    ],
)
def test_bad_configuration_is_refused_at_construction(tmp_path, kwargs, message):
    write_shards(tmp_path, [1])
    kwargs = dict(kwargs)
    url = str(tmp_path) + kwargs.pop("url_suffix", "")
    name = kwargs.pop("name", "d")
    with pytest.raises(ConfigurationError, match=message):
        Dataset.from_path(name, url, **kwargs)


def test_chunks_from_elsewhere_are_refused(tmp_path):
    """Read as asked, shard -1 would be the last shard (Python's index from the end), and a
    backwards range or one starting before the shard nothing or skips: no error either way."""
    write_shards(tmp_path, [3])
    ds = Dataset.from_path("d", str(tmp_path))
    for chunk in (Chunk("other", 0, 0, 1), Chunk("d", 1, 0, 1), Chunk("d", 0, 2, 4), Chunk("d", -1, 0, 1),
                  Chunk("d", 0, -1, 1), Chunk("d", 0, 2, 1)):
        with pytest.raises(ConfigurationError, match=re.escape(f"chunk {chunk} ")):
            ds.read_chunk(chunk)
    with pytest.raises(ConfigurationError, match="records_per_chunk"):
        ds.chunks(0)


def test_io_options_change_how_a_plan_is_read_not_the_plan(tmp_path):
    write_shards(tmp_path, [3])
    ds = Dataset.from_path("d", str(tmp_path))
    other = ds.with_io_options({"cache": {"enabled": True, "dir": str(tmp_path / "cache")}, "retries": 5})
    assert other == ds and other.fingerprint() == ds.fingerprint()
    assert other.read_chunk(other.chunks(3)[0]).records == ds.read_chunk(ds.chunks(3)[0]).records
    with pytest.raises(ConfigurationError, match="unknown"):
        ds.with_io_options({"prefetch": 2})


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_files_in_hidden_directories_below_the_url_are_no_shards_unless_the_url_names_them(tmp_path, scheme):
    """A Hugging Face snapshot's `.cache/`, Jupyter's `.ipynb_checkpoints/` (a copy of every shard
    opened in the editor) and a desktop's `.Trash-1000/` were listed as shards: their records were
    read beside, or twice with, the dataset's, unsaid. A hidden directory the URL names (the hub
    cache under `~/.cache`, a glob spelling `.cache`) is read as named."""
    root = tmp_path / ".cache" / "snapshot"
    for name in ["a.jsonl", "sub/b.jsonl", ".ipynb_checkpoints/a-checkpoint.jsonl", ".cache/huggingface/c.jsonl",
                 "sub/.Trash-1000/files/d.jsonl"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(jsonl_bytes([{"name": name}]))
    listed = Dataset.from_path("d", f"{scheme}{root}")
    assert [s.url.removeprefix(f"{root}/") for s in listed.shards] == ["a.jsonl", "sub/b.jsonl"]
    globbed = Dataset.from_path("d", f"{scheme}{root}/**/*.jsonl")
    assert [s.url.removeprefix(f"{root}/") for s in globbed.shards] == ["a.jsonl", "sub/b.jsonl"]
    named = Dataset.from_path("d", f"{scheme}{root}/.cache/**/*.jsonl")
    assert [s.url.removeprefix(f"{root}/") for s in named.shards] == [".cache/huggingface/c.jsonl"]


def test_a_directory_of_several_formats_names_a_file_of_each_so_a_sidecar_is_found(tmp_path):
    """img2dataset writes `00000_stats.json` and `00000.parquet` beside each `00000.tar`: the
    directory was said to hold 'several formats ['jsonl', 'parquet', 'webdataset']', and nothing
    told that the JSON Lines were the stats files."""
    for s in range(3):
        (tmp_path / f"{s:05d}.tar").write_bytes(tar_bytes([(f"{s:05d}0000.txt", b"a caption")]))
        (tmp_path / f"{s:05d}.parquet").write_bytes(parquet_bytes([{"key": s}], row_group_size=10))
    (tmp_path / "00000_stats.json").write_text('{"count": 1}')
    with pytest.raises(ConfigurationError) as raised:
        Dataset.from_path("d", str(tmp_path))
    assert (
        "holds files of several formats: jsonl (00000_stats.json), parquet (00000.parquet, 00001.parquet and 1 more), "
        "webdataset (00000.tar, 00001.tar and 1 more); pass format="
    ) in str(raised.value)
    assert [s.url.rpartition("/")[2] for s in Dataset.from_path("d", str(tmp_path), format="webdataset").shards] == [
        "00000.tar", "00001.tar", "00002.tar"
    ]


@pytest.mark.parametrize("compression", [None, "gz", "zst"])
@pytest.mark.parametrize("layout", ["pretty", "one line"])
def test_a_json_file_holding_one_array_is_a_named_error_not_its_lines_dropped_as_malformed(tmp_path, layout, compression):
    """A `.json` file holding one JSON array of records (`json.dump(records, f, indent=2)`, an
    Alpaca-style instruction set) was planned as JSON Lines: every line of a pretty-printed array
    was dropped as `malformed_json`, a one-line array as one `not_an_object`, and nothing said why."""
    records = [{"text": f"doc {i}"} for i in range(5)]
    body = json.dumps(records, indent=2 if layout == "pretty" else None).encode() + b"\n"
    (tmp_path / f"train.json{'.' + compression if compression else ''}").write_bytes(compress(body, compression))
    with pytest.raises(ConfigurationError, match=r"train\.json.* is one JSON array, not JSON Lines") as raised:
        Dataset.from_path("d", str(tmp_path))
    assert "jq -c" in str(raised.value)


def test_json_lines_whose_first_record_is_an_array_are_read_with_that_record_skipped(tmp_path):
    """Only a shard that is one array is refused: a JSON Lines shard whose first line is an array
    among objects keeps its records, that line counted as `not_an_object`."""
    (tmp_path / "a.jsonl").write_bytes(b'[1, 2]\n{"text": "kept"}\n')
    ds = Dataset.from_path("d", str(tmp_path))
    read = ds.read_chunk(ds.chunks(10)[0], on_error="skip")
    assert read.records == [{"text": "kept"}] and [reason for _, reason in read.skipped] == ["not_an_object"]


def test_a_directory_whose_only_shards_are_in_a_hidden_directory_says_they_are_passed_over(tmp_path):
    """Its error listed `.ipynb_checkpoints/a-checkpoint.jsonl` as what the directory holds while
    saying it holds no jsonl file, and nothing told why that file was not one."""
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_bytes(jsonl_bytes([{"text": "a"}]))
    with pytest.raises(ConfigurationError) as raised:
        Dataset.from_path("d", str(tmp_path), format="jsonl")
    assert "holds no jsonl file; it holds .ipynb_checkpoints/a-checkpoint.jsonl" in str(raised.value)
    assert "files in hidden directories below it are passed over" in str(raised.value)


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_directory_named_with_glob_characters_reads_the_hidden_directories_its_url_passes_through(tmp_path, scheme):
    """A directory taken literally is no glob: `run[1]/.cache/snapshot` names `.cache` as much as
    `run1/.cache/snapshot` does. Its `[` was taken for the start of a glob's pattern, so `.cache`
    counted as a hidden directory below the URL and the snapshot's every shard was passed over."""
    root = tmp_path / "run[1]" / ".cache" / "snapshot"
    for name in ["a.jsonl", ".ipynb_checkpoints/a-checkpoint.jsonl"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(jsonl_bytes([{"name": name}]))
    listed = Dataset.from_path("d", f"{scheme}{root}")
    assert [s.url.removeprefix(f"{root}/") for s in listed.shards] == ["a.jsonl"]


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_json_lines_whose_first_array_record_spans_two_frames_are_read_not_taken_for_one_array(tmp_path, compression):
    """A shard of concatenated frames (`cat a.gz b.gz`, a streaming writer's flushes) decodes a
    frame at a time: the one-array rule saw only the first, `[`, and took the line `[1, 2]` for an
    array's opening bracket alone, refusing a JSON Lines shard that the same bytes in one frame pass."""
    body = b'[1, 2]\n{"text": "kept"}\n'
    (tmp_path / f"a.jsonl.{compression}").write_bytes(compress(body[:1], compression) + compress(body[1:], compression))
    ds = Dataset.from_path("d", str(tmp_path))
    read = ds.read_chunk(ds.chunks(10)[0], on_error="skip")
    assert read.records == [{"text": "kept"}] and [reason for _, reason in read.skipped] == ["not_an_object"]


def test_a_glob_whose_only_matches_are_in_hidden_directories_says_they_are_passed_over(tmp_path):
    """`data/*/*.jsonl` whose `*` matched only `.ipynb_checkpoints/` said it "matches no files",
    which it did match, and nothing told why they were not shards; a directory says why (above)."""
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_bytes(jsonl_bytes([{"text": "a"}]))
    with pytest.raises(ConfigurationError) as raised:
        Dataset.from_path("d", f"{tmp_path}/*/*.jsonl")
    assert "files in hidden directories below it are passed over" in str(raised.value)
    assert [s.url for s in Dataset.from_path("d", f"{tmp_path}/.*/*.jsonl").shards] == [
        f"{tmp_path}/.ipynb_checkpoints/a-checkpoint.jsonl"
    ]
