"""The process runner's own cost per item, with workers that do no work.

Text: each item's reply is what a text chunk brings back to the parent in the race's recipe: 16
records, each a short id and an int32 token array of 50-1,500 tokens (in the pickle stream, below
the shared-memory threshold). The workers return a prepared reply at once, so the time per item is
the parent's: pickling and sending the item, waiting on the workers' pipes, receiving and
unpickling the reply, resolving the future. On a machine whose cores are all tokenizing, each of
those microseconds is taken from the workers.

Image: each reply is a decoded image of the race's VLM recipe (448 × 336 RGB, 441 KiB), which the
parent copies into a batch array and lets go, through the worker's reply arena or (arena off) a
buffer file of its own, or (arena off, the buffer directory's filesystem full) the pipe. Timed: the
CPU of the parent and of the workers together, per item.

Encoded row: each item is what the parent sends to have one row of the race's VLM recipe decoded,
six encoded images of 30 KB (the race's mean), through the runner's request arena or (arena off) a
buffer file per item, or the pipe as above; the worker reads every byte and answers with a number.
Timed: the CPU of the parent and of the workers together, per item.

    python -m pytest benchmarks/test_transport_bench.py --benchmark-only    # under a minute

(`python -m`: the repository root must be on the path, for `benchmarks.race`.)
"""

from __future__ import annotations

import collections
import errno
import resource

import numpy as np
import pytest

from benchmarks.race.workers._runtime import tree_cpu_s
from runners import ProcessRunner, _transport
from zephon._runner import Stage

ITEMS = 3_000
IN_FLIGHT = 8  # a lane's prefetch window, about
WORKERS = 2  # the stage's parallelism: the process runner's worker count


def record_layout(record_build: dict) -> None:
    """Every row says which runner, how many workers and how many items in flight it measured."""
    record_build.update(runner="process", parallelism=WORKERS, in_flight=IN_FLIGHT)


def text_chunk_reply() -> list[dict]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 1_500, 16)
    return [{"id": f"doc/{i}", "input_ids": rng.integers(0, 8_192, int(n), dtype=np.int32)} for i, n in enumerate(lengths)]


def parent_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def stream(runner: ProcessRunner, count: int, take=None, items=None) -> None:
    """Submit `count` items (`items[i % len(items)]`, or i), IN_FLIGHT at a time; `take(n, result)`
    gets the n-th result back."""
    in_flight: collections.deque = collections.deque()
    received = 0

    def collect_oldest() -> None:
        nonlocal received
        result = in_flight.popleft().result(10)
        if take is not None:
            take(received, result)
        received += 1

    for i in range(count):
        in_flight.append(runner.submit(0, i if items is None else items[i % len(items)]))
        if len(in_flight) >= IN_FLIGHT:
            collect_oldest()
    while in_flight:
        collect_oldest()


def test_process_runner_round_trip_of_a_text_chunk_reply(benchmark, record_build) -> None:
    reply = text_chunk_reply()
    with ProcessRunner() as runner:
        runner.start([Stage("reply", lambda _: reply, WORKERS)])
        for _ in range(100):  # warm-up: the workers' first items pay for imports and page faults
            runner.submit(0, 0).result(10)

        def run() -> float:
            before = parent_cpu_s()
            stream(runner, ITEMS)
            return parent_cpu_s() - before

        parent_cpu = benchmark.pedantic(run, rounds=3, iterations=1)
        received = runner.submit(0, 0).result(10)
    for sent, got in zip(reply, received, strict=True):
        np.testing.assert_array_equal(got["input_ids"], sent["input_ids"])
    record_layout(record_build)
    record_build["items_per_round"] = ITEMS
    record_build["parent_cpu_us_per_item_last_round"] = round(parent_cpu / ITEMS * 1e6, 1)


IMAGES = 1_000
PATHS = ["arena", "files", "pipe (shm full)"]


def no_room(fd: int, buffer: memoryview, offset: int) -> None:
    """A buffer file's write on a full filesystem (a container's small /dev/shm)."""
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("arena", PATHS)
def test_process_runner_round_trip_of_a_decoded_image(benchmark, record_build, arena, monkeypatch) -> None:
    image = np.random.default_rng(0).integers(0, 256, (336, 448, 3), dtype=np.uint8)
    batch = np.empty((IN_FLIGHT, *image.shape), dtype=np.uint8)
    options = {} if arena == "arena" else {"reply_arena_bytes": 0}
    if arena == "pipe (shm full)":
        monkeypatch.setattr(_transport, "_pwrite_all", no_room)  # the workers forked after inherit it
    with ProcessRunner(**options) as runner:
        runner.start([Stage("decoded", lambda _: image, WORKERS)])
        for _ in range(50):
            runner.submit(0, 0).result(10)

        def copy_into_batch(n: int, result: np.ndarray) -> None:
            batch[n % IN_FLIGHT] = result

        def run() -> float:
            before = tree_cpu_s()
            stream(runner, IMAGES, copy_into_batch)
            return tree_cpu_s() - before

        cpu = benchmark.pedantic(run, rounds=3, iterations=1)
        np.testing.assert_array_equal(runner.submit(0, 0).result(10), image)
        assert (runner.stats().shm_full_bytes > 0) == (arena == "pipe (shm full)")  # the path named was taken
    record_layout(record_build)
    record_build["images_per_round"] = IMAGES
    record_build["cpu_us_per_image_last_round"] = round(cpu / IMAGES * 1e6, 1)


ROWS = 2_000


@pytest.mark.parametrize("arena", PATHS)
def test_process_runner_request_of_a_row_of_encoded_images(benchmark, record_build, arena, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    rows = [[rng.integers(0, 256, 30_000, dtype=np.uint8) for _ in range(6)] for _ in range(IN_FLIGHT)]
    options = {} if arena == "arena" else {"request_arena_bytes": 0}
    if arena == "pipe (shm full)":
        monkeypatch.setattr(_transport, "_pwrite_all", no_room)
    with ProcessRunner(**options) as runner:
        runner.start([Stage("checksum", lambda row: sum(int(image.sum()) for image in row), WORKERS)])
        for _ in range(50):
            runner.submit(0, rows[0]).result(10)

        def run() -> float:
            before = tree_cpu_s()
            stream(runner, ROWS, items=rows)
            return tree_cpu_s() - before

        cpu = benchmark.pedantic(run, rounds=3, iterations=1)
        assert runner.submit(0, rows[1]).result(10) == sum(int(image.sum()) for image in rows[1])
        assert (runner.stats().shm_full_bytes > 0) == (arena == "pipe (shm full)")
    record_layout(record_build)
    record_build["rows_per_round"] = ROWS
    record_build["cpu_us_per_row_last_round"] = round(cpu / ROWS * 1e6, 1)
