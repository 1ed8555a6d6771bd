"""TokenEstimation samples the same records it always did, at a cost linear in the dataset's shards.

Which records the estimate reads decides every token-planned batch, so the selection is pinned
shard by shard on shapes that stress its edges. Laying the shards end to end once (not once per
sample window) is pinned by counting the Python lines the selection runs, never by timing.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from zephon.work import TokenEstimation
from zephon.work import _estimation
from zephon.work._estimation import _Concatenation


def dataset(sizes: list[int]) -> SimpleNamespace:
    """What the sample reads of a dataset: its name and its shards' record counts."""
    return SimpleNamespace(name="d", shards=[SimpleNamespace(num_records=n) for n in sizes])


def written(chunks) -> str:
    assert all(chunk.dataset == "d" for chunk in chunks)
    return " ".join(f"{chunk.shard}:{chunk.start}-{chunk.stop}" for chunk in chunks)


# (shard sizes, TokenEstimation options, the sample as "shard:start-stop" chosen before planning
# laid the shards end to end once)
SAMPLES = {
    "empty shards among others": (
        [0, 40, 0, 0, 700, 3, 0, 1500, 0, 90, 0],
        {},
        (
            "4:28-60 4:215-247 4:360-392 4:461-493 4:607-639 7:98-130 7:170-202 7:291-323 7:516-548 7:575-607 "
            "7:724-756 7:901-933 7:1057-1089 7:1243-1275 7:1342-1374 9:27-59"
        ),
    ),
    "one shard": (
        [10_000],
        {},
        (
            "0:191-223 0:737-769 0:1366-1398 0:2150-2182 0:2766-2798 0:3405-3437 0:3882-3914 0:4442-4474 "
            "0:5404-5436 0:6087-6119 0:6707-6739 0:6986-7018 0:7599-7631 0:8595-8627 0:8945-8977 0:9964-9996"
        ),
    ),
    "more windows than shards": (
        [200, 0, 150, 400, 250],
        {"sample_records": 256, "sample_chunks": 64},
        (
            "0:3-7 0:16-20 0:31-35 0:46-50 0:63-67 0:78-82 0:104-108 0:120-124 0:135-139 0:141-145 0:162-166 "
            "0:171-175 0:193-197 2:9-13 2:29-33 2:38-42 2:61-65 2:72-76 2:86-90 2:106-110 2:123-127 2:131-135 "
            "2:146-150 3:18-22 3:28-32 3:44-48 3:66-70 3:72-76 3:88-92 3:105-109 3:118-122 3:145-149 3:155-159 "
            "3:169-173 3:181-185 3:201-205 3:212-216 3:233-237 3:249-253 3:269-273 3:282-286 3:301-305 3:308-312 "
            "3:330-334 3:344-348 3:363-367 3:369-373 3:393-397 4:11-15 4:18-22 4:37-41 4:54-58 4:63-67 4:88-92 "
            "4:94-98 4:118-122 4:128-132 4:141-145 4:159-163 4:179-183 4:187-191 4:206-210 4:227-231 4:240-244"
        ),
    ),
    "windows spanning many one-record shards": (
        [1, 0, 1, 1] * 750,
        {"sample_records": 96, "sample_chunks": 8, "seed": 3},
        (
            "59:0-1 60:0-1 62:0-1 63:0-1 64:0-1 66:0-1 67:0-1 68:0-1 70:0-1 71:0-1 72:0-1 74:0-1 636:0-1 638:0-1 "
            "639:0-1 640:0-1 642:0-1 643:0-1 644:0-1 646:0-1 647:0-1 648:0-1 650:0-1 651:0-1 1054:0-1 1055:0-1 "
            "1056:0-1 1058:0-1 1059:0-1 1060:0-1 1062:0-1 1063:0-1 1064:0-1 1066:0-1 1067:0-1 1068:0-1 1327:0-1 "
            "1328:0-1 1330:0-1 1331:0-1 1332:0-1 1334:0-1 1335:0-1 1336:0-1 1338:0-1 1339:0-1 1340:0-1 1342:0-1 "
            "1774:0-1 1775:0-1 1776:0-1 1778:0-1 1779:0-1 1780:0-1 1782:0-1 1783:0-1 1784:0-1 1786:0-1 1787:0-1 "
            "1788:0-1 2019:0-1 2020:0-1 2022:0-1 2023:0-1 2024:0-1 2026:0-1 2027:0-1 2028:0-1 2030:0-1 2031:0-1 "
            "2032:0-1 2034:0-1 2452:0-1 2454:0-1 2455:0-1 2456:0-1 2458:0-1 2459:0-1 2460:0-1 2462:0-1 2463:0-1 "
            "2464:0-1 2466:0-1 2467:0-1 2943:0-1 2944:0-1 2946:0-1 2947:0-1 2948:0-1 2950:0-1 2951:0-1 2952:0-1 "
            "2954:0-1 2955:0-1 2956:0-1 2958:0-1"
        ),
    ),
    "one window": (
        [300, 300, 300],
        {"sample_records": 100, "sample_chunks": 1},
        "0:255-300 1:0-55",
    ),
    "a dataset no larger than the sample": (
        [0, 3, 5, 0],
        {},
        "1:0-3 2:0-5",
    ),
    "only empty shards": (
        [0, 0],
        {},
        "",
    ),
}


@pytest.mark.parametrize("sizes,options,expected", SAMPLES.values(), ids=SAMPLES.keys())
def test_the_estimation_sample_reads_the_records_it_always_read(sizes, options, expected):
    assert written(TokenEstimation(**options)._sample_chunks(dataset(sizes))) == expected


def walked(sizes: list[int], start: int, stop: int) -> str:
    """Records [start, stop) of the shards laid end to end, found by walking every shard."""
    parts, offset = [], 0
    for shard, size in enumerate(sizes):
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            parts.append(f"{shard}:{lo - offset}-{hi - offset}")
        offset += size
    return " ".join(parts)


@pytest.mark.parametrize("sizes", [[5], [0, 3, 0, 0, 4, 1, 0], [1, 1, 1, 1, 1], [2, 0, 7, 0]])
def test_any_range_of_the_shards_laid_end_to_end_gives_the_chunks_a_walk_over_every_shard_gives(sizes):
    records = _Concatenation("d", sizes)
    total = sum(sizes)
    for start in range(total + 2):
        for stop in range(total + 2):
            assert written(records.chunks(start, stop)) == walked(sizes, start, stop), (start, stop)


def lines_run(fn) -> int:
    """How many lines of the estimation module `fn()` runs (a deterministic count of its steps)."""
    lines, module = 0, _estimation.__file__

    def in_module(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return in_module

    def on_call(frame, event, arg):
        return in_module if frame.f_code.co_filename == module else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return lines


def test_choosing_the_sample_runs_lines_in_proportion_to_shards_plus_windows_not_their_product():
    shards, windows = 2_000, 64
    estimation = TokenEstimation(sample_records=10 * windows, sample_chunks=windows)
    lines = lines_run(lambda: estimation._sample_chunks(dataset([10] * shards)))
    # Each window of 10 records spans at most two shards of 10; a walk over every shard for each
    # window ran four lines a shard: 2,000 x 64 x 4.
    assert lines <= 4 * shards + 40 * windows
