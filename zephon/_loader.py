"""The loader of one data-parallel rank: its lanes, its runner, its cursors.

With L lanes and R ranks, rank r owns lanes [r·L/R, (r+1)·L/R). Each global step takes G/L rows
from every lane, as (G/L)/m microbatches of m rows. A rank yields, step by step, its lanes'
microbatches in canonical (lane, index) order; concatenating the ranks' microbatches of a step in
rank order gives the global batch in canonical order, whatever R is.

When a finite plan runs out, a lane simply stops: its last microbatch is padded, and later steps
hold only the microbatches of lanes that still have data. No layout-dependent padding is ever
invented, so even the ragged tail of an epoch is identical on every world size; a rank whose lanes
are all done stops iterating (trainers on finite epochs must tolerate ranks finishing early).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import weakref
from collections import Counter
from concurrent.futures import Future
from time import perf_counter
from typing import Callable, Generator, Iterable, Iterator, NamedTuple, TypeVar

from . import _fork, _runner_closer, _wait
from ._barren import refuse_a_finite_run_without_rows
from ._batch import Batch, StepShape, collate
from ._checkpoint import LaneCursor, dataset_summaries, make_state, read_state, recipe_digests
from ._dataset_scope import check_dataset_scopes, work_source_dataset_names
from ._dropped_datasets import DroppedDatasets
from ._errors import CheckpointError, ConfigurationError, StateLacksLanesError, check_count
from ._job_log import RankLog, config_level
from ._ledger import Ledger
from ._lane import LaneStream
from ._packing import assemble_row
from ._prefetch import default_prefetch
from ._record_ops import estimate_stages
from ._records import Chunk, ChunkRecords
from ._runner import Runner, Stage, describe_runner, runner_factory
from ._skip_examples import SkipExamples
from ._stage_chain import AlsoRowWork, ChunkReader, RowWork, apply_row_work, compose, fuse_stages, submit_chain
from ._torch_workers import refuse_copies_in_dataloader_workers
from .work import lane_plan
from .work._estimation import SampleCount

__all__ = ["RankLoader", "check_layout"]

log = logging.getLogger("zephon")
events = RankLog(log)
T = TypeVar("T")  # what a `take_as_one` caller's function returns

_PER_DATASET_COUNTS = ("tokens_by_dataset", "images_by_dataset")
"""What a row says of itself beyond its tokens for the ledger's per-dataset counts: a row plan of a
plugin written before they were counted lacks them, and is refused naming its type, not failed on
with an AttributeError from deep in the loader."""

_MAKE_ANOTHER = (
    "make a new loader with pipeline.shard(...) and, to go on where this one stopped, give it "
    "load_state_dict(state) of a state_dict() this loader gave (it still gives one once closed)"
)
"""What a closed loader's refusal tells its caller to do: it cannot be reopened, and its state says
where it stopped."""

RECIPE_VERSION = 9
"""Bumped when a recipe's batches change with no change of its options (2: chunks dealt to lanes by
tokens, not by count; 3: first-fit closes no open row for an item that fills a row alone; 4: a
TIFF's orientation applied once, a video's sampled time that is a frame's time takes that frame,
compressed text files read whole planned by their decompressed size; 5: a PNG's verdict the same
before and after packing, multi-picture JPEGs draft-decoded, a path naming a file or directory as
written not read as a glob, links to directories listed by every spelling of a local dataset, a
video sampled over its own duration and turned upright by its display rotation, a document whose
text holds a placeholder id skipped, a tar's hidden members part of no record and a byte order mark
opening a tar's text dropped, a Parquet file repeating a column name skipped; 6: a video field
holding a list of one video decodes that video, a scheduled mixture's planning rounds sized per
phase, which may order two chunks tied at a round's boundary otherwise, a list of token ids from
the data holding a bool skipped, a tokenizer.json's own truncation and padding switched off; 7: an
image grid kept within a narrow min/max pixel window, a video decoded on one FFmpeg thread, a Hugging
Face video struct holding only a path opened, a video path read as a local file only, a still
picture in a video field skipped, a tar record cut at a member's header and a shard cut or emptied
after planning counted as truncated; 8: a relative video path read beside its local shard, and
skipped as unresolvable in any other shard, a video with a frame FFmpeg marks damaged on the way
to its sampled frames skipped as corrupt; 9: a shard's suffix and a tar member's extension read
in any case, a tar record holding a link, FIFO or device member skipped, a JSON object naming a
key twice skipped, a Parquet nanosecond value read as a standard-library value or skipped where
it has a part below a microsecond), so that a checkpoint of the old batches is refused instead
of resumed."""


class LoaderMark(NamedTuple):
    """A rank loader's place as `take_as_one` marks it: what `_take_up` installs to hand back
    everything taken since (the fields are its arguments, in order)."""

    cursors: dict[int, LaneCursor]
    ledgers: dict[int, dict]
    steps_begun: int
    rows_taken: int


def check_layout(num_lanes: int, world_size: int, rank: int, global_batch_size: int, microbatch_size: int) -> int:
    """Fail at construction, naming the numbers, on any layout that cannot split evenly."""
    rank, world_size = check_count(rank, "rank", 0), check_count(world_size, "world_size")
    global_batch_size = check_count(global_batch_size, "global_batch_size")
    if not rank < world_size:
        raise ConfigurationError(f"rank {rank} is not in [0, world_size={world_size})")
    if num_lanes % world_size:
        raise ConfigurationError(
            f"num_lanes={num_lanes} is not divisible by world_size={world_size}; "
            f"choose num_lanes as a common multiple of every world size you will run on"
        )
    if global_batch_size % num_lanes:
        raise ConfigurationError(
            f"global_batch_size={global_batch_size} is not divisible by num_lanes={num_lanes}; "
            f"{_splitting_batch_sizes(global_batch_size, num_lanes, microbatch_size)}"
        )
    per_lane = global_batch_size // num_lanes
    if per_lane % microbatch_size:
        divisors = [m for m in range(1, per_lane + 1) if per_lane % m == 0]
        raise ConfigurationError(
            f"global_batch_size/num_lanes = {global_batch_size}/{num_lanes} = {per_lane} rows per lane per step "
            f"is not divisible by microbatch_size={microbatch_size}; a microbatch_size in {divisors} would "
            f"split it, or {_splitting_batch_sizes(global_batch_size, num_lanes, microbatch_size)}"
        )
    return per_lane


def _splitting_batch_sizes(global_batch_size: int, num_lanes: int, microbatch_size: int) -> str:
    """The global batch sizes nearest `global_batch_size` that split evenly, as the end of a message."""
    step = num_lanes * microbatch_size
    below = global_batch_size // step * step
    nearest = f"{below} or {below + step}" if below else f"{step}"
    return (
        f"a global_batch_size of {nearest} would split evenly "
        f"(a multiple of num_lanes × microbatch_size = {num_lanes} × {microbatch_size})"
    )


class RankLoader:
    """Iterates one rank's microbatches; `state_dict`/`load_state_dict` for elastic resume.

    Iterate it from one thread. `state_dict()` and `load_state_dict()` may be called from another
    (an asynchronous checkpointer): they wait for the microbatch in progress (see `_moving`), and a
    load ends the iteration it lands in, as one on the iterating thread does.
    Call `close()` (or use `with`) to stop its workers; from another thread too, and an iteration
    it interrupts, and any later one, fails with ConfigurationError saying so and how to go on (a new
    loader given this one's `state_dict()`, which a closed loader still gives).
    A process forked from its own (a `multiprocessing.Process` the trainer starts, `os.fork()`)
    holds a copy that works there, even when another thread held one of its locks at the fork (see
    `_renew_locks_in_child`): iterated anew with `iter()`, it goes on from its last microbatch
    handed over, on a runner of its own. A torch DataLoader worker's copy is refused at every
    `next()` instead (`_torch_workers`).
    """

    def __init__(self, pipeline, rank: int, world_size: int, global_batch_size: int) -> None:
        self.pipeline = pipeline
        settings = pipeline.settings
        self.num_lanes = settings.num_lanes
        self.microbatch_size = pipeline.microbatch_size
        self.rows_per_step = check_layout(
            self.num_lanes, world_size, rank, global_batch_size, self.microbatch_size
        )
        # plain ints from here on: a NumPy integer would reach Batch.step and the state's JSON
        rank, world_size = int(rank), int(world_size)
        self.rank, self.world_size, self.global_batch_size = rank, world_size, int(global_batch_size)
        self._make_runner = runner_factory(settings.runner)  # before _compile: its token estimate reads data
        per_rank = self.num_lanes // world_size
        self.lanes = list(range(rank * per_rank, (rank + 1) * per_rank))
        # What every microbatch says of its step, by whether its lane's plan ends (see StepShape).
        self._step_shapes = {
            finite: StepShape(self.num_lanes, self.rows_per_step // self.microbatch_size, finite)
            for finite in (False, True)
        }
        self._compile()
        self._cursors = {lane: LaneCursor() for lane in self.lanes}
        # Global steps this rank handed microbatches of, the last perhaps in part, and the rows
        # handed over on all ranks if each handed over as many as this one: ranks saved at one
        # checkpoint agree on one of them, which is how merge_states tells a state of another.
        self._steps_begun = 0
        self._rows_taken = 0
        self._streams: dict[int, LaneStream] = {}
        self._runner: Runner | None = None
        self._ledger = Ledger()
        self._waits = _wait.NO_WAITS  # this object's, never saved nor restored (see _wait)
        # This object's observations of what its lanes dropped, never saved nor restored either.
        self._skip_examples = SkipExamples(events)
        self._dropped_datasets = _watch_dropped_datasets(self.plan, self.lanes)
        self._generation = 0
        self._closed = False
        # Guards `_closed` with what a close must find to stop (`_runner` and its finalizer,
        # `_streams`): a close from another thread as an iteration begins either finds the runner
        # and lanes it publishes, or the iteration finds the loader closed and stops them itself.
        # Held only to read or swap them, never while anything is stopped or started.
        self._lifecycle = threading.Lock()
        # Held while a runner is made and started (see `_ensure_runner`).
        self._starting = threading.Lock()
        # Held by the iterating thread while it moves the lanes (from the trainer's ask until the
        # microbatch is handed over, never across a yield), and by `state_dict` and
        # `load_state_dict`: a save on another thread read the cursors and settled the ledger while
        # the iteration moved and counted them ("dictionary changed size during iteration", or a
        # state whose ledger had lost records). `take_as_one` holds it over several microbatches
        # (TorchTitan's local batch), its mark and its hand-back included. Reentrant: a stage function
        # run inline inside a `next()` that saves does not wait on itself, nor the adapter's
        # `next()`s. `close()` and `stats()` never take it.
        self._moving = threading.RLock()
        # (pid, mark) while a `take_as_one` block runs: a child forked meanwhile hands the
        # block's microbatches back at its first use (`hand_back_a_block_cut_by_fork`).
        self._taking: tuple[int, LoaderMark] | None = None
        self._built_in_pid = os.getpid()  # a forked copy iterated in DataLoader workers is refused
        _fork.renew_in_child(self, _renew_locks_in_child)

    def __reduce__(self):
        """Refused with the way to go: a loader's lanes, runner and threads are this process's, and
        pickle failed on a function deep inside it (a spawn or forkserver DataLoader worker)."""
        raise ConfigurationError(
            "a rank loader cannot be pickled (a spawn or forkserver process, such as a torch DataLoader worker "
            "on Python 3.14, is sent its objects by pickle): its lanes, runner and threads belong to this process. "
            "Send the Pipeline, which pickles, and call pipeline.shard(...) in that process"
        )

    # -- building ---------------------------------------------------------------------------
    def _compile(self) -> None:
        pipeline, settings = self.pipeline, self.pipeline.settings
        ops = pipeline.operators
        accumulators = [op for op in ops if op.kind == "accumulator"]
        packers = pipeline.packers()
        if not packers:
            raise ConfigurationError(
                "the pipeline needs a packing operator before batch: pack_flat(max_length) for text, "
                "pack_multimodal(max_length, placeholders) for the images and videos decode_images and "
                "decode_video give (pack_flat refuses them: it packs token ids alone)"
            )
        record_ops = pipeline.record_operators()
        if any(ops.index(r) > ops.index(accumulators[0]) for r in record_ops):
            raise ConfigurationError("stateless operators (map, filter, tokenize, …) must come before packing")
        _check_one_packer(accumulators, packers)
        _check_media_carried(record_ops, accumulators[0])
        _check_packed_field(record_ops, accumulators[0])
        # A packer of a plugin may check what comes before it and take from it the settings it was
        # not given (vlm's: its decoders' spec and fields, its tokenize's BOS): here, where every
        # pipeline is bound, whether the packer came from its builder or `apply`. The loader packs,
        # plans and fingerprints with the packer it returns.
        bound_to = getattr(accumulators[0], "bound_to", None)
        packer = bound_to(record_ops) if bound_to is not None else accumulators[0]
        self.packer = packer
        self.default_pad_id = _default_pad_id(record_ops)
        on_error = settings.on_error
        _leave_cores_to_tokenizing_workers(record_ops, settings.runner)
        record_fns = [(op, op.build(on_error)) for op in record_ops]
        self.stages = fuse_stages(record_fns, settings.read_parallelism)
        self._estimate_fns = estimate_stages(record_ops)
        self.row_length = packer.max_length
        # Once per loader, and before the token estimate runs the maps and filters: walking a
        # function's code and writing the globals it reads takes seconds for a lookup table of
        # 10**6 entries, and the estimate's key and the recipe must describe the same operators.
        # Keyed by the pipeline's operators (the estimate's key names them); the packer's is its bound copy's.
        fingerprints = {
            id(op): op.fingerprint() if op.kind == "record" else
            (packer if op is accumulators[0] else op).fingerprint(self.default_pad_id) for op in ops
        }
        # Before binding: its token estimate runs the stages, which a misnamed scope leaves undecoding.
        source_names = work_source_dataset_names(pipeline.source)
        if source_names is not None:
            check_dataset_scopes(record_ops, source_names)
        self.plan = pipeline.source.bind(self._token_counter(packer, fingerprints), self.num_lanes)
        for warning in getattr(self.plan, "configuration_warnings", ()):  # a work source of the user's may have none
            log.log(config_level(logging.WARNING, self.rank), "%s", warning)
        if source_names is None:
            check_dataset_scopes(record_ops, self.plan.datasets)
        io_options = settings.io_options
        read_datasets = {
            name: ds.with_io_options(io_options) if io_options else ds for name, ds in self.plan.datasets.items()
        }
        self._reader = ChunkReader(read_datasets, on_error)
        self.factories = [op.factory(self.default_pad_id) for op in (packer, *accumulators[1:])]
        padding_row = getattr(packer, "padding_row", None)
        self._padding_row = (
            padding_row(self.default_pad_id) if padding_row else assemble_row([], self.row_length, self.default_pad_id)
        )
        self.recipe = {
            "recipe_version": RECIPE_VERSION,
            "plan": self.plan.fingerprint(),
            "operators": [fingerprints[id(op)] for op in ops],
            "num_lanes": self.num_lanes,
            "flush_every_chunks": settings.flush_every_chunks,
            "global_batch_size": self.global_batch_size,
        }
        self._recipe_digests = recipe_digests(self.recipe)  # what every state saves and is checked by
        # Stateless work the packer leaves on its rows (decoding images packed encoded) is put on
        # the runner `rows_ahead` rows before the loader takes them, per lane: at least the
        # microbatch it takes at once and two rows per worker, so that when the loader turns to a
        # lane its rows are done and the workers still hold the other lanes' next rows. It runs on
        # the workers of the stage with the most of them (the last such): no extra pool or worker
        # processes, and no more busy threads than cores.
        # Given the record operators, as the packer may read its work from them (vlm's: whether a
        # decoder left its images encoded), whether it came from its builder or was given to `apply`.
        row_work = getattr(packer, "row_work", None)
        self._row_work = row_work(settings.on_error, record_ops) if row_work else None
        max_parallelism = max((s.parallelism for s in self.stages), default=1)
        self._row_stage = max(i for i, s in enumerate(self.stages) if s.parallelism == max_parallelism)
        self.rows_ahead = max(self.microbatch_size, 2 * max_parallelism)
        self.prefetch = settings.prefetch or default_prefetch(self.plan, max_parallelism)

    def _token_counter(self, packer, fingerprints: dict[int, dict]):
        """Runs the stateless stages on a chunk and counts the tokens the packer will place: the
        packer's own `token_counter()` when it has one (e.g. image placeholders), else the length
        of its input field, and of them the tokens a loss learns where that counter's `learned`
        counts them; the records the packer's counter refused (its `drain_skips()`, where it
        has one, as an accumulator's: (address, reason) or (address, reason, detail); a bare reason,
        as counters gave before details, counts without an example) count among the drops. The first
        record of each reason is kept with its detail, for the refusal of a sample without a token.
        `fingerprints` holds the operators' fingerprints by id."""
        fns = self._estimate_fns  # skipping and counting whatever `on_error`: see estimate_stages
        make_counter = getattr(packer, "token_counter", None)
        field = getattr(packer, "field", "input_ids")
        tokens_of = make_counter() if make_counter else (lambda address, record: len(record.get(field, ())))
        packer_skips = getattr(tokens_of, "drain_skips", None)
        learned_of = getattr(tokens_of, "learned", None)  # where the packer counts the tokens a loss learns

        def count(batch: ChunkRecords) -> SampleCount:
            for fn in fns:
                batch = fn(batch)
            dropped = Counter(reason for _, reason in batch.skipped)
            if batch.filtered:
                dropped["filtered"] = len(batch.filtered)
            # The first kept detail of each reason is its first skip: the chunk keeps them in order.
            examples = {reason: next(iter(kept.items())) for reason, kept in batch.skip_details.items() if kept}
            tokens = sum(tokens_of(a, r) for a, r in zip(batch.addresses, batch.records))
            learned = None if learned_of is None else sum(map(learned_of, batch.addresses, batch.records))
            for refused in packer_skips() if packer_skips is not None else ():
                if isinstance(refused, str):  # unpacked, its letters were taken for an address and a reason
                    dropped[refused] += 1
                    continue
                address, reason, *detail = refused
                dropped[reason] += 1
                examples.setdefault(reason, (address, detail[0] if detail else ""))
            return SampleCount(tokens, dropped, tuple((reason, *example) for reason, example in examples.items()),
                               learned)

        # Same key, same counts: lets the work source measure once for every loader of a pipeline.
        # Fingerprints alone are not enough: they cannot see everything a map's or filter's closure
        # captured (a tokenizer by its type only) or an object's private attributes, so two pipelines
        # on one source differing only there took each other's measurement. The key also names the operator objects by id, which
        # rank loaders of one pipeline share (the pipeline's packer, not the copy each one binds);
        # `count.operators` keeps them alive for as long as the source keeps the counter with its
        # measurement, so no other operator can take their ids.
        operators = (*self.pipeline.record_operators(), self.pipeline.packers()[0])
        count.key = json.dumps(
            [fingerprints[id(op)] for op in operators] + [[id(op) for op in operators]], sort_keys=True
        )
        count.operators = operators
        return count

    # -- running ----------------------------------------------------------------------------
    @property
    def runner_info(self) -> dict:
        """Which runner executes the stateless work, and why it was chosen; it is started here if
        no iteration has started it yet. Any thread may read it: one runner is started, whichever
        thread asks first (`_ensure_runner`)."""
        runner = self._ensure_runner()
        return describe_runner(runner)

    def _ensure_runner(self) -> Runner:
        """The loader's runner, started on first use. Two threads may ask at once (a monitor reading
        `runner_info` as the trainer's first iteration begins): both saw no runner and each started
        one, and the one not kept was never closed (its threads, or a process runner's workers and
        /dev/shm directory, left until exit). The start is made under `_starting`, which `close()`
        never takes: a close meanwhile is found once the start is done (`_start_runner`)."""
        with self._starting:
            if self._closed:
                raise ConfigurationError(f"this loader is closed; {_MAKE_ANOTHER}")
            if self._runner is not None and self._runner_pid != os.getpid():
                # A forked child's copy (a multiprocessing.Process): the runner is the parent's. Its
                # pool threads did not survive the fork, and its workers answer the parent's reader
                # thread, which would take the child's replies for the parent's items. The child
                # starts its own; the parent's is left alone (see _close_in_owner).
                self._runner = None
            if self._runner is None:
                return self._start_runner()
            return self._runner

    def _start_runner(self) -> Runner:
        # Stage functions and chains never hold the loader: a runner's threads keep their
        # stages alive, and a loader they kept could never be collected, so its finalizer
        # below could never close a runner whose owner dropped it unclosed.
        stages = []
        for i, s in enumerate(self.stages):
            fn = compose(self._reader if i == 0 else None, s.fns)
            if self._row_work is not None and i == self._row_stage:
                fn = AlsoRowWork(fn, self._row_work.run)
            stages.append(Stage(s.name, fn, s.parallelism))
        _runner_closer.start()  # here, not in the finalizer below, which may only hand it a close
        runner = self._make_runner()
        runner.start(stages)
        # A process runner's reader thread holds the runner, so nothing frees a dropped loader's
        # workers (and their shared memory) but closing it (a thread runner frees itself). The
        # finalizer runs on whichever thread collects the loader, perhaps one holding a lock
        # the close needs (the runner's own reader thread): the closer thread closes it.
        close_runner = weakref.finalize(
            self, _runner_closer.close_later, functools.partial(_close_in_owner, runner, os.getpid())
        )
        # At exit the runners close themselves (the thread runner from a threading exit hook,
        # before threads are joined; the process runner before multiprocessing terminates its
        # workers): an atexit finalizer runs too late.
        close_runner.atexit = False
        with self._lifecycle:
            closed = self._closed
            if not closed:
                self._runner, self._runner_pid, self._close_runner = runner, os.getpid(), close_runner
        if closed:  # a close from another thread came while it started, and found no runner to stop
            close_runner.detach()
            runner.close()
            raise ConfigurationError(f"this loader was closed while its runner started; {_MAKE_ANOTHER}")
        info = describe_runner(runner)
        log.log(  # the runner follows the interpreter, the same on every rank: said once per job
            config_level(logging.INFO, self.rank),
            "zephon rank %d/%d: runner %s (%s)", self.rank, self.world_size, info["name"], info["reason"],
        )
        return runner

    def _submit(self, chunk: Chunk) -> Future:
        return submit_chain(self._runner, len(self.stages), chunk, self._reader.describe)

    def _submit_row(self, row) -> Future:
        """A future of the row with its row work done: the work's order goes to the runner, and
        the result is applied to the row as it comes back."""
        done: Future = Future()
        order = self._row_work.order(row)
        if order is None:
            done.set_result(row)
        else:
            self._runner.submit(self._row_stage, RowWork(order)).add_done_callback(
                functools.partial(apply_row_work, self._row_work, row, done))
        return done

    def _open_streams(self) -> None:
        """Open every lane's stream, replayed to its cursor. The streams are kept together once
        all are open (or one failed): a close from another thread meanwhile cannot see them, so
        they are then closed here, and the iteration fails saying so."""
        self._close_streams()
        self._ensure_runner()
        streams: dict[int, LaneStream] = {}
        try:
            self._open_lanes(streams)
        finally:
            with self._lifecycle:
                closed = self._closed
                if not closed:
                    self._streams = streams
            if closed:
                self._stop_streams(streams, self._cursors)
        if closed:
            raise ConfigurationError(f"this loader was closed while it was being iterated; {_MAKE_ANOTHER}")

    def _open_lanes(self, streams: dict[int, LaneStream]) -> None:
        flush_every = self.pipeline.settings.flush_every_chunks
        barren_records = getattr(self.plan, "barren_records", None)  # optional for other work plans
        count_chunk, count_skips = _counters(self._ledger, self._skip_examples, self._dropped_datasets)
        for lane in self.lanes:
            self._ledger.replay(lane, self._cursors[lane].segment)
        if self._dropped_datasets is not None:  # before any replay below counts a chunk into it again
            self._dropped_datasets.recount(self._ledger.snapshot()["datasets"])
        for lane in self.lanes:
            cursor = self._cursors[lane]
            stream = LaneStream(
                lane,
                lane_plan(self.plan, lane, flush_every, cursor.segment),
                cursor.segment,
                self._submit,
                self.factories,
                self.prefetch,
                count_chunk,
                count_skips,
                on_truncations=self._ledger.count_truncations,
                row_work=self._submit_row if self._row_work is not None else None,
                rows_ahead=self.rows_ahead,
                barren_records=barren_records(lane, flush_every) if barren_records else None,
                finite=self._finite(lane),
            )
            streams[lane] = stream
            for _ in range(cursor.skip):  # replay: rebuild state, drop what the trainer already had
                if not stream.skip():
                    break

    def __iter__(self) -> Iterator[Batch]:
        self.hand_back_a_block_cut_by_fork()
        asked = perf_counter()  # the first next()
        try:
            yield from self._handed_over(self._microbatches(), asked)
        except Exception as exc:
            if not self._closed or isinstance(exc, ConfigurationError):
                raise
            # Closed by another thread (a watchdog, a shutdown handler) while this one waited for
            # work: what reached it was that work cancelled, or the runner already dropped.
            raise ConfigurationError(f"this loader was closed while it was being iterated; {_MAKE_ANOTHER}") from exc

    def __len__(self) -> int:
        """Refused saying why and what to do: Python's own TypeError ("object of type 'RankLoader'
        has no len()") reached a trainer that had called no len() at all, from
        `torch.utils.data.DataLoader(loader)`, which takes any dataset that is no torch
        IterableDataset for a map-style one and asks its length first."""
        raise TypeError(
            "a Zephon loader has no len(): an endless plan (num_epochs=None) has no end, and a finite "
            "one's lanes end raggedly, at steps known only once read; stop at a step count of your own. "
            "A torch DataLoader given the loader asks its len(), taking it for a map-style dataset: "
            "iterate the loader itself (its runner already reads and tokenizes in parallel) and call "
            "batch.to_training() for the torch tensors"
        )

    def __bool__(self) -> bool:
        """True, as before `__len__` was defined, which truth testing would otherwise call."""
        return True

    def _handed_over(self, microbatches: Generator[Batch, float, None], asked: float) -> Iterator[Batch]:
        """`microbatches`, each made under `_moving`, which is let go as it is handed over. Each is
        sent when the trainer asked for it (`perf_counter`; `asked` for the first), before the
        wait for `_moving` that a save or load on another thread may impose (see `_wait`)."""
        next(microbatches)  # to its first `yield`, which takes the first ask
        try:
            while True:
                # At every next(), not the first alone: an iteration begun before a DataLoader
                # forked goes on in each worker's copy. A pid comparison: ~0.4 µs a microbatch.
                refuse_copies_in_dataloader_workers(self._built_in_pid)
                with self._moving:
                    try:
                        batch = microbatches.send(asked)
                    except StopIteration:
                        return
                yield batch
                asked = perf_counter()
        finally:
            microbatches.close()

    def _microbatches(self) -> Generator[Batch, float, None]:
        """The rank's microbatches in order, from lanes opened anew. Each is sent when the trainer
        asked for it (`_handed_over`); the wait for data is counted from when the ask holds
        `_moving` (`called`), the time until then as a wait for a save or load (see `_wait`).

        The lanes are opened in the first `next()`, so that `_handed_over` holds `_moving` over
        the opening and the first microbatch at once: opened under a hold of their own, a load on
        another thread landing between the two swapped the lanes out from under the iteration,
        which failed with a bare KeyError naming a lane."""
        asked = yield  # primed outside `_moving`: nothing before this line may touch the loader
        called = perf_counter()  # its wait takes in starting the runner and the lanes' replay
        self._generation += 1
        generation = self._generation
        # Opening replays a resumed loader's lanes up to its checkpoint, waiting for chunks as the
        # iteration does: a close from another thread may land there too.
        self._open_streams()
        per_step = self.rows_per_step
        while True:
            # Lanes are asked whether they have more only when their turn comes: asking every lane
            # up front would fill every lane's buffers before the first microbatch (time to first
            # batch x lanes). A lane not yet known to be finished may hold the step back for one
            # round in which nothing is yielded; the next round knows it, so the order is the same.
            unknown = [lane for lane in self.lanes if not self._streams[lane].exhausted]
            if not unknown:
                # every record dropped: fail, not end after zero steps
                refuse_a_finite_run_without_rows(
                    self.num_lanes, self.lanes, self._ledger,
                    handed_over_a_row=any(self._cursors[lane].position for lane in self.lanes),
                    finite=self._finite,
                    gives_a_row=lambda lane, apart: self._gives_a_row(lane, 0, count_into=apart),
                )
                return
            step = min(self._cursors[lane].position for lane in unknown) // per_step
            for lane in unknown:
                cursor = self._cursors[lane]
                while cursor.position < (step + 1) * per_step and self._streams[lane].has_more():
                    segment = cursor.segment
                    asked = yield self._microbatch(lane, step, asked, called)
                    called = perf_counter()
                    if self._closed:  # its streams and runner are gone
                        raise ConfigurationError(f"this loader was closed while it was being iterated; {_MAKE_ANOTHER}")
                    if generation != self._generation:
                        # A newer iteration (or a load_state_dict) took over while this one was
                        # suspended: stop before touching its streams, cursors or ledger.
                        return
                    if cursor.segment != segment:
                        # The lane's replay point moved: fold the counts before it, once the
                        # microbatch was handed over (see `_microbatch`; `lane_state` does too).
                        self._ledger.settle(lane, cursor.segment)

    def _microbatch(self, lane: int, step: int, asked: float, called: float) -> Batch:
        """The lane's next microbatch, counted as handed over only once it is whole, with the time
        since the trainer's ask held `_moving` (`called`) as its wait for data, and the time the
        ask waited for `_moving` before that (since `asked`) as its wait for a save or load on
        another thread (see `_wait`).

        Every row is taken first: an exception while waiting for one (Ctrl-C, a preemption
        handler, a worker that crashed for good) leaves the cursor and the ledger at the last
        microbatch handed over, so a checkpoint or a new iteration taken then starts again with
        this microbatch's first row instead of skipping the rows taken before the exception.
        The rows go back to the stream then: the lane may have found its end while they were
        taken, and must not read as finished (see `_finished`) before they are counted; nor may
        the later lanes found then to give no row at all (`_look_past`)."""
        m, cursor, stream = self.microbatch_size, self._cursors[lane], self._streams[lane]
        fetched, ended_ahead = [], []
        try:
            for _ in range(m):
                fetched.append(stream.next())
            end = (step + 1) * self.rows_per_step
            if stream.finite and (cursor.position + m >= end or stream.exhausted):
                self._look_past(lane, end, ended_ahead)
            index = (cursor.position % self.rows_per_step) // m
            batch = collate(
                [self._padding_row if got is None else got[1] for got in fetched], lane, step, index,
                self._step_shapes[stream.finite], stream.finite and stream.exhausted,
            )
            segment, skip, counts = cursor.segment, cursor.skip, self._ledger.rows_of(lane)
            for row, got in enumerate(fetched):
                segment, skip = self._account(lane, got, segment, skip, counts, batch, row)
            waits = _wait.after(self._waits, perf_counter() - called, called - asked)
        except BaseException:
            stream.give_back([got for got in fetched if got is not None])
            for later in ended_ahead:
                later.forget_end()
            raise
        # One statement, after the counting, with no call in it (where an interrupt could land)
        # nor between it and the hand-over. An interrupt while the rows were counted used to leave
        # the cursor past some of them but not past the microbatch (a checkpoint taken then
        # replayed the lane past rows the trainer never had), and then the ledger holding the rows
        # counted before it, which were counted again when the microbatch was handed over again.
        (
            cursor.segment, cursor.skip, cursor.position, self._steps_begun, self._rows_taken, self._ledger.rows[lane],
            self._waits,
        ) = (segment, skip, cursor.position + m, step + 1, self._rows_taken + m * self.world_size, counts, waits)
        return batch

    def _look_past(self, lane: int, end: int, ended: list[LaneStream]) -> None:
        """Before handing over the microbatch that ends `lane`'s part of the step, turn to the
        rank's lanes after it that have handed over no row yet, as the loader would next, until
        one has a row: a lane that never gives one (every record of it dropped) is then known
        finished now. A lane that gave a row knows its end with its last row (the stream looks one
        row ahead); one that gave none has no such row. A trainer taking each step whole never
        asks this rank again for the step, so the save it takes at the step's end said that lane
        was live at row 0, like a file from partway through the step, and merge_states refused
        it. The rows looked for are those the loader reads next anyway: the batches are unchanged,
        and the wait moves only in a lane's first step, before its first row.

        A rank's lanes are consecutive numbers, so the lanes after `lane` are counted up from it:
        finding `lane` in the rank's list and copying the rest of it cost every call all the
        rank's lanes, and a step, made of one call per lane, their square (1,024 lanes: 11 ms a
        step). A call now costs only the lanes it looks at, up to the first that goes on.

        Each stream found to give no row is added to `ended` as it is found: should the caller fail
        to hand its microbatch over, it has them forget their end (`LaneStream.forget_end`)."""
        for later in range(lane + 1, self.lanes[-1] + 1):
            stream, position = self._streams[later], self._cursors[later].position
            if stream.exhausted or position >= end:
                continue  # no part in this step
            if position or stream.has_more():
                return  # the rank's step goes on with this lane, which looks past in turn
            ended.append(stream)

    def _account(self, lane: int, got, segment: int, skip: int, counts, batch: Batch, index: int) -> tuple[int, int]:
        """The row a lane's stream gave (`got`: (segment, row), or None once a finite plan ended),
        counted into `counts` (the lane's row counts gathered for its microbatch, see
        `Ledger.rows`); returns where the cursor (at `segment`, `skip`) goes past it. Neither the
        cursor nor the ledger changes here: the caller stores both once the microbatch is counted.
        Its masked documents are noted as examples (an observation, named once per record).

        Its learned tokens are the row's own count, or, for a plugin's row plan written before
        rows counted them, read from its labels in the collated microbatch (`batch`, row `index`)."""
        if got is None:  # a finite plan ended inside this microbatch: pad the microbatch
            self._ledger.count_rows(counts, 0, self._padding_row.length, {}, {}, {})
            return segment, skip
        row_segment, row = got  # a PackedSequence or a row plan (see Accumulator); collate assembles plans
        if row_segment != segment:
            segment, skip = row_segment, 0
        learned = getattr(row, "learned_by_dataset", None)
        try:
            self._ledger.count_rows(
                counts, row.num_real_tokens, row.length, row.tokens_by_dataset, row.images_by_dataset,
                batch.learned_by_dataset(index) if learned is None else learned,
            )
        except AttributeError as exc:
            if exc.obj is not row or exc.name not in _PER_DATASET_COUNTS:
                raise
            raise ConfigurationError(
                f"rows of type {type(row).__qualname__} have no {exc.name}: a pipeline's last accumulator emits "
                f"PackedSequences or row plans that also say their tokens and images per dataset "
                f"({', '.join(_PER_DATASET_COUNTS)}), which the loader counts as it hands the rows over "
                "(see zephon._accumulator.Accumulator)"
            ) from exc
        masked = getattr(row, "masked_documents", ())
        if masked:
            self._ledger.count_masked(counts, masked)
            self._skip_examples.note_masked(lane, masked)
        return segment, skip + 1

    def _finite(self, lane: int) -> bool:
        return self.plan.num_slots(lane) is not None

    # -- state ------------------------------------------------------------------------------
    @functools.cached_property
    def _dataset_summaries(self) -> list[dict] | None:
        """What a state tells a changed dataset by (`dataset_summaries`): taken at the first save or
        load, not when the loader is built, since over 10**5 shards it costs as much as the recipe's
        digests, a time to first batch that a run which never checkpoints would pay for nothing."""
        return dataset_summaries(self.recipe)

    def state_dict(self) -> dict:
        """Plain JSON-able state of this rank's lanes (see `zephon.merge_states`). In a finite
        plan, a rank that has handed over nothing yet may read its lanes' first chunks here (see
        `_find_lanes_without_rows`). From another thread, it waits for the microbatch in progress."""
        self.hand_back_a_block_cut_by_fork()
        with self._moving:
            self._find_lanes_without_rows()
            ledgers = {lane: self._ledger.lane_state(lane, c.segment) for lane, c in self._cursors.items()}
            finished = [self._finished(lane) for lane in self.lanes]
            steps_begun = None if all(finished) else self._steps_begun
            return make_state(
                self._recipe_digests, self._dataset_summaries, self._cursors, self.num_lanes, ledgers, steps_begun,
                self._rows_taken,
            )

    def _find_lanes_without_rows(self) -> None:
        """Turn to the rank's lanes as its first microbatch would, in order until one has a row,
        and mark those before it finished: a finite plan's lane that never gives a row (every
        record of it dropped) is known finished only by asking it, which the loader does when its
        trainer asks the rank for a microbatch, or at a lane of the rank that ends its part of a
        step (`_look_past`). A rank whose every lane gives no row is never asked by a trainer
        taking each step whole: its save said every lane was live at row 0 of step 0, like a file
        from before the run began, and merge_states refused it beside the others' (it must: a rank
        with data that was never asked is behind them). A lane that gave a row, or is known
        finished, needs no asking, so this reads only while the rank's first live lane is at row 0.

        The lanes are asked on streams of their own, whose record counts are dropped: the rank's
        streams (a suspended iteration's, or one an interrupt ended) and its ledger stay as they
        are. The rows looked for are those the loader reads first anyway; the batches are unchanged.
        A closed loader reads nothing and saves its lanes as they stand."""
        if self._closed:
            return
        for lane in self.lanes:
            cursor = self._cursors[lane]
            if self._finished(lane):
                continue
            if cursor.position or not self._finite(lane) or self._gives_a_row(lane, cursor.segment):
                return
            cursor.finished = True

    def _gives_a_row(self, lane: int, segment: int, count_into: Ledger | None = None) -> bool:
        """Whether the lane, read from the start of `segment`, gives a row; its records are counted
        into `count_into` if given, never into the loader's ledger."""
        ignore = lambda *_: None
        count_chunk, count_skips = (count_into.count_chunk, count_into.count_skips) if count_into else (ignore, ignore)
        self._ensure_runner()
        flush_every = self.pipeline.settings.flush_every_chunks
        stream = LaneStream(
            lane, lane_plan(self.plan, lane, flush_every, segment), segment, self._submit, self.factories,
            self.prefetch, count_chunk, count_skips, on_truncations=ignore, finite=True,
        )
        try:
            return stream.has_more()
        finally:
            stream.close()

    def _a_lane_gives_no_row(self, cursors: dict[int, LaneCursor]) -> bool:
        """Whether a finite plan's lane that `cursors` have at row 0, not finished, gives no row at
        all: the run is then in its ragged end, though no save has said so yet. The lanes are asked
        in order, on streams of their own (see `_gives_a_row`), until one gives none. A closed
        loader reads nothing."""
        return not self._closed and any(
            not cursor.finished and cursor.position == 0 and self._finite(lane)
            and not self._gives_a_row(lane, cursor.segment)
            for lane, cursor in sorted(cursors.items())
        )

    def _finished(self, lane: int) -> bool:
        """Whether a finite plan's every row of the lane was handed over; kept in the cursor, so a
        state saved before the lane's stream is replayed after a resume still says so."""
        cursor, stream = self._cursors[lane], self._streams.get(lane)
        if stream is not None and stream.exhausted:
            cursor.finished = True
        return cursor.finished

    def load_state_dict(self, state, *, accept_changes: Iterable[str] = ()) -> None:
        """Take up the cursors of this rank's lanes from a state covering them (any world size).

        A state of another recipe is refused naming what changed, unless each change is named in
        `accept_changes` (recipe keys as the refusal names them, e.g.
        `["operators[0].map.fn"]`): the lanes then go on from their cursors with this recipe,
        whose batches from here are not bit-identical to an uninterrupted run of either recipe. A name
        that is no recipe key (a typo), and a change that would move the cursors (the plan's, the
        lane count, flush_every_chunks, the global and microbatch sizes), are refused, naming why; a
        key named that did not change is warned of (a job restarted from the new recipe's own
        checkpoint still names it).
        A state whose datasets only moved (the same shards under another directory) is taken up
        with no key named: its batches are the same. Either is logged at WARNING.

        All or nothing: a load that raises (a refused state, or Ctrl-C and a preemption handler
        raising partway) leaves the loader at the state it had, the iteration it suspended included
        (see `_take_up`); loading the state again then takes it up as a first load would. From
        another thread, it waits for the microbatch in progress."""
        self.hand_back_a_block_cut_by_fork()  # now, not over the state loaded at the next iteration
        with self._moving:
            self._load_state(state, accept_changes)

    def _load_state(self, state, accept_changes: Iterable[str]) -> None:
        cursors, ledgers, steps_begun, rows_taken, warnings = read_state(
            state, self._recipe_digests, self._dataset_summaries, self.num_lanes, accept_changes
        )
        missing = [lane for lane in self.lanes if lane not in cursors]
        if missing:
            raise StateLacksLanesError(
                f"the loader state does not cover lanes {missing} of rank {self.rank}; "
                "merge every rank's state (zephon.merge_states or zephon.distributed.gather_state) before saving",
                missing,
            )
        if len(cursors) == self.num_lanes:
            self._check_step_rest_splits_evenly(cursors)
        self._take_up({lane: cursors[lane] for lane in self.lanes}, ledgers, steps_begun, rows_taken)
        for warning in warnings:  # the same state and recipe on every rank: said once, for the job
            log.log(config_level(logging.WARNING, self.rank), "%s", warning)

    def _check_step_rest_splits_evenly(self, cursors: dict[int, LaneCursor]) -> None:
        """Refuse a state saved partway through a step that this world size would split unevenly.

        Ranks saved at one checkpoint had each taken as many of the step's microbatches (a trainer
        accumulates a fixed number per rank); on another world size the step's rest may fall
        unevenly to the ranks (a state saved on 2 ranks after 1 of each rank's 8, resumed on 4:
        3, 4, 3 and 4 left). Ranks taking as many microbatches each would then mix that step with
        the next, differently on each rank, for the rest of the run: no later global batch would
        be the uninterrupted run's, and their states would disagree on the step they are in. A
        state at a step's end always splits evenly, and so does a state merged from ranks that took
        as many rows (as `merge_states` requires) on the world size it was saved on, or on fewer
        ranks each taking over whole ranks of it. In the ragged end of a finite epoch (a lane
        finished), ranks taking as many microbatches each already run at different steps by
        design, and the check is left out: also where no lane is saved as finished but one that
        the state has at row 0 gives no row at all (every record of it dropped), which a save
        partway through the lane's rank's first step cannot know yet; such lanes are asked only
        where the state would be refused otherwise."""
        if any(cursor.finished for cursor in cursors.values()):
            return
        positions = {lane: cursor.position for lane, cursor in cursors.items()}
        if len(set(positions.values())) == 1:
            return
        per_step, m = self.rows_per_step, self.microbatch_size
        step = min(positions.values()) // per_step
        end = (step + 1) * per_step
        per_rank = self.num_lanes // self.world_size
        left = [
            sum(max(0, end - positions[lane]) for lane in range(rank * per_rank, (rank + 1) * per_rank)) // m
            for rank in range(self.world_size)
        ]
        if len(set(left)) > 1 and not self._a_lane_gives_no_row(cursors):
            raise CheckpointError(
                f"the loader state was saved partway through step {step}, whose remaining microbatches would "
                f"fall {', '.join(map(str, left))} to the {self.world_size} ranks: ranks taking as many each would "
                "never be in step again. Resume it on a world size that gives every rank as many (the one it was "
                "saved on does), or resume from a checkpoint saved at the end of a step"
            )

    def take_as_one(self, take: Callable[[], T]) -> T:
        """Call `take()`, which takes several microbatches that the caller hands on as one batch
        (TorchTitan's local batch), holding the loader over it, and hand every one of them back if
        it raises; return what it returns.

        The loader counts a microbatch as handed over when it yields it. An exception while the
        block's later microbatches are taken, or while they are stacked into tensors (a preemption
        handler, Ctrl-C), would leave the earlier ones counted but never passed on: a checkpoint or
        a new iteration taken then would skip them. So the cursors, ledger, steps begun and rows
        taken are marked as `take` begins, and taken up again if it raises having taken any (with
        none taken, taking up the mark only wiped the records counted since: a run refused at its
        end for dropping every record read in `stats()` as having read none); the iteration `take`
        took from ends there, as after `load_state_dict`. All of it under `_moving`, which a save
        or load on another thread waits for: it saved states partway through such a batch (each
        resumed one then straddled two), or read a hand-back's ledger before it and its cursors
        after. Call it on the iterating thread, between `next()` calls of the loader's iteration.

        A call, not a context manager: between `take`'s return and `_moving`'s release no Python
        function runs, and Ctrl-C lands at the next Python function called. A generator context
        manager's `__exit__` is one: an interrupt landing at its call left `_moving` held by the
        suspended generator and the block counted as handed over while its traceback lived, so a
        trainer's handler checkpointed without the block, and a save on another thread waited."""
        self.hand_back_a_block_cut_by_fork()  # before the mark, which a block cut by a fork would move
        with self._moving:
            mark = self._mark()
            try:
                self._taking = (os.getpid(), mark)
                return take()
            except BaseException:
                if self._rows_taken != mark.rows_taken:
                    self._take_up(*mark)
                raise
            finally:
                self._taking = None

    def hand_back_a_block_cut_by_fork(self) -> None:
        """In a process forked while the parent's thread was inside `take_as_one` (a torch
        DataLoader forking its workers, a trainer starting a `multiprocessing.Process`): hand the
        block's microbatches back, as an exception there would. The copy has them counted as taken,
        and the thread that would have passed them on or handed them back is not in the child: its
        saves said they were passed on, and its iteration went on after them. The loader's
        `__iter__`, `state_dict`, `load_state_dict` and `take_as_one` call it first, so no caller
        of `take_as_one` has to: only the TorchTitan adapter did, and a plain rank loader's copy
        saved and iterated on past the block, its microbatches lost. It does nothing in the
        process that took them, where a mark is another thread's block in progress, which a save
        waits for. The loader's own locks are new in the child (see `_renew_locks_in_child`)."""
        taking = self._taking
        if taking is not None and taking[0] != os.getpid():
            with self._moving:
                self._take_up(*taking[1])
                self._taking = None

    @property
    def closed(self) -> bool:
        """Whether `close()` was called: an adapter that refuses in its own words (naming itself,
        not the rank loader) tells a closed loader's ConfigurationError from another's by it."""
        return self._closed

    def _mark(self) -> LoaderMark:
        """What `_take_up` needs to hand over again everything taken from now on: this rank's
        cursors, ledger, steps begun and rows taken (what `state_dict` saves, without its recipe digests).
        Its caller (`take_as_one`) holds `_moving` over both, so that no save on another thread
        lands in between.

        A cursor learns that its lane is finished from the lane's stream only when asked
        (`_finished`); `_take_up` closes the streams, so the copies ask first: a lane finished before
        the mark stays finished in a state saved after handing back (it used to be saved as live,
        making the merged state look saved partway through a step)."""
        cursors = {lane: dataclasses.replace(self._cursors[lane], finished=self._finished(lane)) for lane in self.lanes}
        ledgers = {lane: self._ledger.lane_state(lane, cursor.segment) for lane, cursor in cursors.items()}
        return LoaderMark(cursors, ledgers, self._steps_begun, self._rows_taken)

    def _take_up(self, cursors: dict, ledgers: dict, steps_begun: int | None, rows_taken: int) -> None:
        """Install the given cursors, ledger counts, steps begun and rows taken in place of the
        loader's, ending the iteration it suspended.

        The new ledger is built first, beside the loader's, and everything is then installed, with
        the lanes of the iteration it ends swapped out, in one statement with no call in it (where
        an interrupt could land; checked with dis on 3.11 and 3.14t: only loads, stores and integer
        arithmetic): an interrupt before it leaves the loader as it was, its suspended iteration
        free to go on. Installed in steps, an interrupt (Ctrl-C, a preemption handler raising)
        while the lanes' ledger counts were taken up left the new cursors with the ledger of the
        first lanes only: the loader handed over the new state's batches with counts of both,
        which no longer balanced. The lanes swapped out are stopped after: they count into the
        ledger they were opened with, no longer the loader's."""
        ledger = Ledger()
        for lane in self.lanes:
            ledger.restore(lane, ledgers.get(lane, {}))
        steps_begun = steps_begun or 0  # None: every lane of every rank is finished
        with self._lifecycle:  # swapped like `close()` swaps them, so one of the two stops them
            (
                streams, cursors_before, self._streams, self._cursors, self._ledger, self._steps_begun,
                self._rows_taken, self._generation,
            ) = (
                self._streams, self._cursors, {}, cursors, ledger, steps_begun,
                rows_taken, self._generation + 1,
            )
        self._stop_streams(streams, cursors_before)

    def stats(self) -> dict:
        """The ledger of this rank's lanes: records read/emitted/filtered/skipped by reason per
        dataset and lane, and rows/tokens/padding/learned tokens handed to the trainer per lane,
        with each dataset's tokens, images and learned tokens in those rows
        (`lanes[lane]["datasets"]`, summed over the rank's lanes as `"mixture"`: the realised
        mixture, padding counted for none). A learned token is one whose label a loss counts (not
        IGNORE_INDEX): a document's tokens but its last, less those its loss mask leaves out and
        its image placeholders; a masked document learns none. Record counts
        are taken when a lane takes a chunk's records into its packer (not while the chunk waits
        in the prefetch window), so they run ahead of the trainer by what each lane holds: the
        rest of that chunk, the packer's open rows, the shuffle buffer and the rows looked ahead.
        Row counts are taken as rows are handed over. Across a resume the counts carry on
        exactly: nothing replayed is counted twice. Read on another thread while the trainer
        iterates, it shows whole counting steps (a chunk, a microbatch; see `_ledger`): every
        dataset and lane balances.

        `"skipped_examples"` names the records behind the skip counts: per dataset and reason, the
        first `EXAMPLES_PER_REASON` (3) skipped records this loader object took from its lanes,
        each with its `address` (also as `shard` and `index`), `lane` and `detail` (what was wrong,
        as `BadRecordError` would say; for a packer's refusal, what the record held; "" for a
        masked document and for a plugin accumulator's refusal given as a pair), in the order the
        lanes' chunks were taken, so the same on every runner; a document masked in a row handed over
        is named under `masked:<reason>`, the name of its per-lane count; the first of each is also logged at WARNING on
        the `zephon` logger (see `_skip_examples`). This process's observations, like `"wait"`:
        never in `state_dict()`, kept by `load_state_dict()`.

        `"wait"` says whether the trainer waits for data: the microbatches this loader object
        handed over (`batches`), the seconds the caller's thread spent inside `next()` for them,
        from the call until the microbatch was counted, less any wait for a `state_dict()` or
        `load_state_dict()` running on another thread (`total_s`), the first one's wait, which is
        the time to first batch (`first_s`: starting the runner, a resume's replay; not planning,
        which `pipeline.shard` does), the most recent one's (`last_s`) and the longest
        (`longest_s`); `first_s` and `last_s` are None before any. It is this process's
        wall-clock, not a recipe count: never in `state_dict()`, left as it is by
        `load_state_dict()` (a resumed loader starts it at zero, the same loader carries on), and
        carried on over a second `iter()`. A `next()` that raises or ends the iteration hands over
        nothing and counts no wait.

        `"checkpoint_wait_s"` is the rest of those `next()` calls' time: the seconds they waited
        for a save or load on another thread (an asynchronous checkpointer) to let go of the
        loader, counted, kept and reset like `"wait"`."""
        waits = self._waits
        return {
            **self._ledger.snapshot(),
            "skipped_examples": self._skip_examples.snapshot(),
            "wait": _wait.report(waits),
            "checkpoint_wait_s": _wait.checkpoint_s(waits),
        }

    # -- lifecycle --------------------------------------------------------------------------
    def _close_streams(self) -> None:
        with self._lifecycle:
            streams, self._streams = self._streams, {}
        self._stop_streams(streams, self._cursors)

    def _stop_streams(self, streams: dict[int, LaneStream], cursors: dict[int, LaneCursor]) -> None:
        """Stop `streams`, marking finished those of `cursors` (the cursors they were opened at)
        whose stream knew it."""
        # In a forked child (a multiprocessing.Process) the streams' futures are the parent's:
        # they are dropped untouched (see LaneStream.close), their work left to the parent.
        owner = self._runner is None or self._runner_pid == os.getpid()
        for lane, stream in streams.items():
            if stream.exhausted:  # the cursor keeps what only the stream knew
                cursors[lane].finished = True
            stream.close(cancel_work=owner)

    def close(self) -> None:
        """Stop the lanes and the runner; from another thread too (see `_lifecycle`). The lanes are
        taken in one swap: walked in place, a close from another thread raised "dictionary changed
        size during iteration" as an iteration began, and stopped neither the lanes nor the runner."""
        with self._lifecycle:
            self._closed = True  # first: an iteration waiting in another thread fails saying so
        self._close_streams()
        with self._lifecycle:
            runner, pid = self._runner, getattr(self, "_runner_pid", None)
            close_runner = getattr(self, "_close_runner", None)
        if runner is not None:
            # Closed here rather than through the finalizer, which runs once: a runner close cut
            # short (Ctrl-C while it waits for its workers) is then finished by closing again.
            close_runner.detach()
            _close_in_owner(runner, pid)
            with self._lifecycle:
                if self._runner is runner:
                    self._runner = None

    def __enter__(self) -> RankLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _counters(ledger: Ledger, examples: SkipExamples, dropped: DroppedDatasets | None):
    """The lanes' `on_chunk` and `on_skips`: the ledger counts, and the loader's own observers
    (the first skipped records, a dataset that drops everything) look. Bound to this ledger: lanes
    swapped out by a load count into the ledger they were opened with (see `_take_up`)."""

    def count_chunk(lane: int, segment: int, batch: ChunkRecords) -> None:
        ledger.count_chunk(lane, segment, batch)
        examples.note_chunk(lane, batch)
        if dropped is not None:
            dropped.note_chunk(lane, batch)

    def count_skips(lane: int, segment: int, skips: list) -> None:
        ledger.count_skips(lane, segment, skips)
        examples.note_skips(lane, skips)
        if dropped is not None:
            dropped.note_skips(skips)

    return count_chunk, count_skips


def _watch_dropped_datasets(plan, lanes: list[int]) -> DroppedDatasets | None:
    """A watch on the datasets of a mixture of several that nothing at planning checked (see
    `_dropped_datasets`), over each of this rank's lanes' share of each; None for other plans."""
    records_per_pass, unestimated = getattr(plan, "records_per_pass", None), getattr(plan, "unestimated", None)
    if records_per_pass is None or unestimated is None or len(plan.source.live_names()) < 2:
        return None
    watched = unestimated()
    if not watched:
        return None
    per_lane = {lane: records_per_pass(lane) for lane in lanes}
    return DroppedDatasets(
        {name: {lane: records.get(name, 0) for lane, records in per_lane.items()} for name in watched},
        {name: plan.weight_of(name) for name in watched},
        events,
    )


def _renew_locks_in_child(loader: RankLoader) -> None:
    """In a forked child: give a loader copied with the process new `_lifecycle`, `_moving` and
    `_starting` locks, taking none (registered weakly: a dropped loader is still collected, and
    its runner closed, see `_start_runner`).

    A fork copies a lock as it stands: one held by another thread of the parent (a save or load on
    an asynchronous checkpointer's thread, the trainer's thread taking a microbatch, a `close()`
    swapping the lanes out, a monitor's `runner_info` starting the runner) is held in the child by
    a thread the child does not have, and the child's first `next()`, `state_dict()` or `close()`
    on its copy waited for it for ever (a torch DataLoader forking its workers, a
    `multiprocessing.Process` started by a trainer).
    No thread of the child is inside what those locks guard, so the copy works as a copy forked
    between two microbatches does: the cursors, the ledger and the waits change in single
    statements (see `_microbatch`, `_take_up`), so the copy holds them as they were before or
    after the microbatch, save or load a parent's thread was making, never partway; the lanes the
    parent's thread was moving are the parent's, dropped untouched when the child iterates (see
    `_stop_streams`), which starts a runner of its own (see `_ensure_runner`). One thing the child
    cannot know: whether a finite plan's lane whose last rows the parent's thread was taking into
    a microbatch is finished, as its stream says, before the child hands that microbatch over
    itself; a state saved before then says it is (the batches are the same either way: a lane is
    always replayed to its end)."""
    loader._lifecycle, loader._moving, loader._starting = threading.Lock(), threading.RLock(), threading.Lock()


def _check_one_packer(accumulators, packers) -> None:
    """One packer, and the first accumulator: the loader takes the row length, the token counter
    and the padding row from it, and what comes after it (a shuffle) reorders its rows."""
    names = [op.name for op in packers]
    if len(packers) > 1:
        raise ConfigurationError(f"one packing operator per pipeline, got {names}: rows cannot be packed again")
    if accumulators[0] is not packers[0]:
        raise ConfigurationError(
            f"{accumulators[0].name} comes before {names[0]}: the packer must be the first accumulating operator "
            f"(a shuffle reorders packed rows; put it after {names[0]})"
        )


def _check_media_carried(record_ops, packer) -> None:
    """Refuse a packer that says it carries no media (`carries_media = False`: `pack_flat`) after
    operators that write some (`media_fields`: vlm's `decode_images`, `decode_video`), before any
    record is read: the batches held the captions' tokens alone, every decoded image dropped with no
    word. A packer that says nothing (a plugin's) is taken to know what it packs."""
    if getattr(packer, "carries_media", True):
        return
    writes = [f"{op.name} writes {field!r}" for op in record_ops for field in getattr(op, "media_fields", ())]
    if writes:
        raise ConfigurationError(
            f"{packer.name} packs token ids alone, but {', '.join(writes)}: every record's decoded images "
            "and frames would be dropped from the batches, unsaid. Pack them with "
            "pack_multimodal(max_length, placeholders), which places them in the rows"
        )


def _check_packed_field(record_ops, packer) -> None:
    """A packer that reads a field the tokenizer does not write would drop every record; say so
    before reading anything. Decided only when tokenizers and filters are the whole of it: a
    `map` or a plugin's operator may make the field, and without a tokenizer the data may hold
    token ids already."""
    field = getattr(packer, "field", None)  # a packer of a plugin may name its input otherwise
    tokenizers = [op for op in record_ops if op.name == "tokenize"]
    if field is None or not tokenizers or any(op.name not in ("tokenize", "filter") for op in record_ops):
        return
    made = {getattr(op, "output_field", None) for op in record_ops}
    if field not in made:
        raise ConfigurationError(
            f"{packer.name}(field={field!r}) packs a field no operator writes: tokenize writes "
            f"{tokenizers[-1].output_field!r}"
        )


def _close_in_owner(runner: Runner, pid: int) -> None:
    """Close a loader's runner, in the process that started it only: a forked child (a worker, a
    torch DataLoader worker) holds a copy of the loader, and collecting that copy must not stop
    the parent's workers or remove its shared memory."""
    if os.getpid() == pid:
        runner.close()


def _leave_cores_to_tokenizing_workers(record_ops, runner) -> None:
    """Decide tokenizers' own pool for each tokenize operator, before any of them encodes (the token
    estimate encodes as the work source binds). The workers that compete with that pool are the
    operator's parallelism, except on the inline runner, which runs every stage on the caller's one
    thread whatever the parallelism: there the pool stays on."""
    from ._record_ops import TokenizeOp
    from ._tokenizer import leave_cores_to_workers

    inline = getattr(runner, "name", runner) == "inline"
    for op in record_ops:
        if isinstance(op, TokenizeOp):
            leave_cores_to_workers(1 if inline else op.parallelism)


def _default_pad_id(record_ops) -> int:
    """The tokenizer's pad token if it has one, else 0 (padding is masked out either way)."""
    from ._record_ops import TokenizeOp

    for op in reversed(record_ops):
        if isinstance(op, TokenizeOp):
            tokenizer = op.handle().tokenizer
            for token in ("<|pad|>", "<pad>", "[PAD]", "<|endoftext|>"):
                token_id = tokenizer.token_to_id(token)
                if token_id is not None:
                    return token_id
    return 0
