"""The process runner's own cost per item, with workers that do no work.

Each item's reply is what a text chunk brings back to the parent in the race's recipe: 16 records,
each a short id and an int32 token array of 50-1,500 tokens (in the pickle stream, below the
shared-memory threshold). The workers return a prepared reply at once, so the time per item is the
parent's: pickling and sending the item, waiting on the workers' pipes, receiving and unpickling the
reply, resolving the future. On a machine whose cores are all tokenizing, each of those
microseconds is taken from the workers.

    pytest benchmarks/test_transport_bench.py --benchmark-only        # a few seconds
"""

from __future__ import annotations

import collections
import resource

import numpy as np

from runners import ProcessRunner
from zephon._runner import Stage

ITEMS = 3_000
IN_FLIGHT = 8  # a lane's prefetch window, about


def text_chunk_reply() -> list[dict]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 1_500, 16)
    return [{"id": f"doc/{i}", "input_ids": rng.integers(0, 8_192, int(n), dtype=np.int32)} for i, n in enumerate(lengths)]


def test_process_runner_round_trip_of_a_text_chunk_reply(benchmark, record_build) -> None:
    reply = text_chunk_reply()
    with ProcessRunner() as runner:
        runner.start([Stage("reply", lambda _: reply, 2)])
        for _ in range(100):  # warm-up: the workers' first items pay for imports and page faults
            runner.submit(0, 0).result(10)

        def run() -> float:
            before = resource.getrusage(resource.RUSAGE_SELF)
            in_flight: collections.deque = collections.deque()
            for i in range(ITEMS):
                in_flight.append(runner.submit(0, i))
                if len(in_flight) >= IN_FLIGHT:
                    in_flight.popleft().result(10)
            while in_flight:
                in_flight.popleft().result(10)
            after = resource.getrusage(resource.RUSAGE_SELF)
            return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

        parent_cpu = benchmark.pedantic(run, rounds=3, iterations=1)
        received = runner.submit(0, 0).result(10)
    for sent, got in zip(reply, received, strict=True):
        np.testing.assert_array_equal(got["input_ids"], sent["input_ids"])
    record_build["items_per_round"] = ITEMS
    record_build["parent_cpu_us_per_item_last_round"] = round(parent_cpu / ITEMS * 1e6, 1)
