"""Work plans: which chunk each lane reads at each of its slots, and where flushes fall.

Each lane has an endless (or epoch-bounded) sequence of *slots*, each holding one chunk. Any slot
can be computed directly from its index (in logarithmic time), so a resumed lane starts at its
cursor without replaying the plan from the beginning. The order within a dataset is a seeded
permutation per epoch; how datasets are interleaved follows their target token shares (see
MixturePlan and TokenInterleave).
"""

from __future__ import annotations

import heapq
import json
import math
import numbers
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from .. import _fork
from .._barren import filtered_note
from .._errors import ConfigurationError, check_count, check_seed, is_finite_number
from .._random import SeededStream
from .._records import Chunk
from ._chunk_table import ChunkTable
from ._estimation import TokenCounter, TokenEstimation, TokenStats

if TYPE_CHECKING:
    from ..io import Dataset

__all__ = [
    "EMPTY_SLOTS_LIMIT",
    "Flush",
    "MixturePlan",
    "ScheduledMixtureWorkSource",
    "StaticMixtureWorkSource",
    "TokenInterleave",
    "WorkPlan",
    "WorkSource",
    "lane_plan",
]


@dataclass(frozen=True)
class Flush:
    """Sentinel between two segments of a lane: every accumulator empties itself and starts over.

    `segment` is the index of the segment that *starts* after this flush.
    """

    segment: int


@runtime_checkable
class WorkPlan(Protocol):
    """A bound, deterministic plan of chunks for each of `num_lanes` lanes."""

    datasets: Mapping[str, Dataset]
    num_lanes: int

    def slot(self, lane: int, s: int) -> Chunk | None:
        """The chunk of the lane's slot s, or None for an empty slot. An endless plan gives each
        lane a chunk at least once in every EMPTY_SLOTS_LIMIT slots (see `lane_plan`)."""

    def num_slots(self, lane: int) -> int | None:
        """Number of slots of the lane in a finite plan; None when the plan is endless."""

    def fingerprint(self) -> dict: ...


@runtime_checkable
class WorkSource(Protocol):
    """Turns datasets, a mixture and a seed into a WorkPlan once the pipeline can count tokens.

    A source may also declare `dataset_names`, the names its plans' datasets will have (the
    mixture sources do): a stage scoped to a name not among them is then refused before the
    source is bound, which runs the stages on a token-estimation sample; without it, once the
    plan is bound, against the plan's `datasets`. Only that name is read, so a source of the
    user's own may hold a `datasets` of anything (hub ids, a count)."""

    def bind(self, count_tokens: TokenCounter | None, num_lanes: int) -> WorkPlan: ...


EMPTY_SLOTS_LIMIT = 1 << 20
"""The most empty slots in a row `lane_plan` reads from an endless plan before refusing it: a lane
given no chunk for ever would otherwise be read for ever (flushes of empty segments, no row, no
error). A finite plan ends by itself and may hold runs of any length."""


def lane_plan(plan: WorkPlan, lane: int, flush_every: int, start_segment: int = 0) -> Iterator[Chunk | Flush]:
    """The input of one lane from the start of `start_segment`: chunks with a Flush every
    `flush_every` slots (empty slots count as slots, so segment boundaries never move), and a
    final Flush when a finite plan ends. Raises ConfigurationError, naming the lane, where an
    endless plan gives it EMPTY_SLOTS_LIMIT empty slots in a row."""
    total = plan.num_slots(lane)
    first = slot = start_segment * flush_every
    empty = 0
    while True:
        if slot % flush_every == 0 and slot > first:
            yield Flush(slot // flush_every)
        if total is not None and slot >= total:
            yield Flush(slot // flush_every + 1)
            return
        chunk = plan.slot(lane, slot)
        if chunk is not None:
            empty = 0
            yield chunk
        elif total is None:
            empty += 1
            if empty >= EMPTY_SLOTS_LIMIT:
                raise ConfigurationError(
                    f"the endless work plan gave lane {lane} no chunk in {empty} slots in a row (slots "
                    f"{slot - empty + 1} to {slot}): the lane would be read for ever without a row. A WorkPlan "
                    f"must give every lane of an endless plan a chunk at least once in {EMPTY_SLOTS_LIMIT} slots "
                    "(or end the plan: num_slots)"
                )
        slot += 1


MEASURED_RECIPES_KEPT = 8
"""How many counting recipes (a pipeline's stateless operators and packer) a work source keeps the
token measurements of, the most recently used. Each keeps its operators alive (their ids are in its
key), so keeping all of them grew a source by every pipeline built on it; rank loaders of one
pipeline, built together, still measure once, and a pipeline whose measurement was let go is
measured again, on the same sample, to the same stats."""


Schedule = tuple[tuple[int, dict[str, float]], ...]

Passes = int | float
"""Passes over a dataset (`num_epochs`): whole ones, or a fraction of one (0.5, 2.5)."""
"""Mixture phases: (global token count at which the phase starts, normalised weights)."""


class _MixtureWorkSource:
    """Shared validation and binding of the mixture work sources; see the two public classes (each
    checks its `datasets` argument first, with `_check_datasets`)."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        schedule: Sequence[tuple[int, Mapping[str, float]]],
        token_estimation: TokenEstimation | None,
        seed: int,
        records_per_chunk: int,
        num_epochs: Passes | Mapping[str, Passes] | None,
        round_size: int,
    ) -> None:
        names = [d.name for d in datasets]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"dataset names must be unique, got {names}")
        records_per_chunk = check_count(records_per_chunk, "records_per_chunk")
        round_size = check_count(round_size, "round_size")
        num_epochs = _checked_epochs(num_epochs, names)
        if token_estimation is not None and not isinstance(token_estimation, TokenEstimation):
            raise ConfigurationError(f"token_estimation must be a TokenEstimation instance or None, got {token_estimation!r}")
        self.datasets = tuple(datasets)
        self.schedule: Schedule = _validate_schedule(schedule, names)
        self.token_estimation = token_estimation
        self.seed = check_seed(seed, "seed")
        self.records_per_chunk = records_per_chunk
        self.num_epochs = num_epochs
        self.round_size = round_size
        if num_epochs is not None:
            _check_finite_schedule(self.schedule, self.live_names(), num_epochs)
        self._measured: OrderedDict[str, tuple[TokenCounter, dict[str, TokenStats]]] = OrderedDict()
        self._measuring = threading.Lock()
        _fork.renew_in_child(self, _renew_measuring_in_child)

    def __getstate__(self) -> dict:
        """A work source is configuration plus a per-process measurement cache; a pickle (a pipeline
        sent to a spawn or forkserver worker, or to another rank) carries the configuration only.
        The lock cannot be pickled, and the cache's keys name operator objects by id, which mean
        nothing in another process: the copy measures again, on the same sample, to the same stats."""
        state = self.__dict__.copy()
        del state["_measuring"]
        state["_measured"] = OrderedDict()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._measuring = threading.Lock()
        _fork.renew_in_child(self, _renew_measuring_in_child)

    @property
    def dataset_names(self) -> tuple[str, ...]:
        """The datasets' names, in declaration order: what a stage's `dataset_scope` is checked
        against before the source is bound (see `WorkSource`)."""
        return tuple(d.name for d in self.datasets)

    def epochs_of(self, name: str) -> Passes | None:
        """The passes over dataset `name` a finite plan makes (None: endless)."""
        return self.num_epochs if not isinstance(self.num_epochs, dict) else self.num_epochs[name]

    def live_names(self) -> list[str]:
        """Datasets with a positive weight in some phase, in declaration order."""
        return [d.name for d in self.datasets if any(w[d.name] > 0 for _, w in self.schedule)]

    def bind(self, count_tokens: TokenCounter | None, num_lanes: int) -> MixturePlan:
        stats: dict[str, TokenStats] = {}
        if self.token_estimation is not None and count_tokens is not None:
            live = set(self.live_names())
            for ds in self.datasets:
                if ds.name in live:
                    stats[ds.name] = self._measure(ds, count_tokens)
        return MixturePlan(self, stats, num_lanes)

    def _measure(self, dataset: Dataset, count_tokens: TokenCounter) -> TokenStats:
        """Measured once per (counting recipe, dataset) in this process while the recipe is among
        the MEASURED_RECIPES_KEPT last used: every rank loader built from the same pipeline reuses
        it. Counters without a `key` attribute are always re-run. The first counter of a key is
        kept with its measurements, so objects its key names by id stay alive while they are kept."""
        key = getattr(count_tokens, "key", None)
        if key is None:
            return self.token_estimation.measure(dataset, count_tokens)
        dataset_key = json.dumps(dataset.fingerprint(), sort_keys=True)
        with self._measuring:
            if key in self._measured:
                self._measured.move_to_end(key)
            else:
                self._measured[key] = (count_tokens, {})
                while len(self._measured) > MEASURED_RECIPES_KEPT:
                    self._measured.popitem(last=False)
            stats = self._measured[key][1]
            if dataset_key not in stats:
                stats[dataset_key] = self.token_estimation.measure(dataset, count_tokens)
            return stats[dataset_key]


def _renew_measuring_in_child(source: _MixtureWorkSource) -> None:
    """In a forked child: give a work source copied with the process a new `_measuring` lock,
    taking none.

    A fork copies the lock as it stands: held by another thread of the parent measuring a token
    estimate (a loader built on another thread as a torch DataLoader forks its workers or a
    trainer starts a `multiprocessing.Process`), it is held in the child by a thread the child
    does not have, and a loader the child built from the same pipeline waited for it for ever.
    The cache it guards changes in single statements, a dataset's stats stored only once
    measured, so the child's copy lacks at most the measurement that thread was making, which the
    child makes again, on the same sample, to the same stats."""
    source._measuring = threading.Lock()


def _check_datasets(datasets) -> None:
    from ..io import Dataset  # at run time only: zephon.io is the heavier import

    if not isinstance(datasets, Sequence) or isinstance(datasets, (str, bytes)) or not all(
        isinstance(d, Dataset) for d in datasets
    ):
        raise ConfigurationError(f"datasets must be a sequence of zephon.io.Dataset, got {datasets!r}")
    if not datasets:
        raise ConfigurationError("a work source needs at least one dataset")


def _checked_epochs(num_epochs, names: list[str]) -> Passes | dict[str, Passes] | None:
    """`num_epochs` as a plan keeps it: None (endless), one count of passes for every dataset, or a
    count per dataset naming each exactly. Counts all alike are the one count: the same plan, so
    the same fingerprint, and a checkpoint saved with either resumes with the other."""
    if num_epochs is None:
        return None
    if not isinstance(num_epochs, Mapping):
        return _passes(num_epochs, "num_epochs (or None: endless)")
    _check_names("num_epochs", num_epochs, names, "count",
                 "key it by the names given to Dataset.from_path, one count each, or give one count for all")
    epochs = {name: _passes(num_epochs[name], f"num_epochs[{name!r}]") for name in names}
    counts = set(epochs.values())
    return counts.pop() if len(counts) == 1 else epochs


def _passes(value: object, what: str) -> Passes:
    """A positive number of passes, an int where it is whole (2.0 is 2: the same plan and
    fingerprint), else a float. A bool, a string or a non-finite number is refused."""
    if not is_finite_number(value) or not value > 0:
        raise ConfigurationError(
            f"{what} must be a positive number of passes (2, or 0.5 for half of one), got {value!r}"
        )
    return int(value) if float(value).is_integer() else float(value)


def _check_names(argument: str, given: Mapping, names: list[str], value: str, remedy: str) -> None:
    """Refuse a per-dataset mapping (`mixture`, `num_epochs`) that does not name every dataset
    exactly once, saying which names are no dataset's and which datasets have no `value`."""
    if set(given) == set(names):
        return
    unknown, unnamed = sorted(set(given) - set(names)), sorted(set(names) - set(given))
    problems = ([f"{unknown} name no dataset"] if unknown else []) + ([f"{unnamed} have no {value}"] if unnamed else [])
    raise ConfigurationError(
        f"{argument} names {sorted(given)} do not match dataset names {sorted(names)}: {'; '.join(problems)}; {remedy}"
    )


def _validate_schedule(schedule, names: list[str]) -> Schedule:
    if not isinstance(schedule, (list, tuple)):
        raise ConfigurationError(f"a mixture schedule is a list of (start token, weights) phases, got {schedule!r}")
    phases = []
    for phase in schedule:
        if not (isinstance(phase, (tuple, list)) and len(phase) == 2 and isinstance(phase[1], Mapping)):
            raise ConfigurationError(f"a mixture phase is (start token, {{dataset name: weight}}), got {phase!r}")
        start, weights = phase
        start = _token_count(start)
        unknown = set(weights) - set(names)
        if unknown:
            raise ConfigurationError(f"mixture names {sorted(unknown)} are not datasets of this source {names}")
        if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) for w in weights.values()):
            raise ConfigurationError(f"mixture weights must be numbers: {dict(weights)}")
        weights = {n: weights.get(n, 0.0) for n in names}
        if not all(is_finite_number(w) and w >= 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ConfigurationError(f"mixture weights must be finite, non-negative and not all zero: {weights}")
        phases.append((start, _normalised({n: float(w) for n, w in weights.items()})))
    # The order first: a schedule holding its token-0 phase out of order was told it has none.
    if any(b[0] <= a[0] for a, b in zip(phases, phases[1:])):
        raise ConfigurationError(f"mixture phases must start at increasing token counts: {[p[0] for p in phases]}")
    if not phases or phases[0][0] != 0:
        raise ConfigurationError("a mixture schedule must start with a phase at token 0")
    return tuple(phases)


def _token_count(start) -> int:
    """A phase start as an int: a whole number (1e9 is 10**9) that a float can hold, as the plan
    divides it among lanes; a fraction is refused rather than truncated (0.5 would become 0)."""
    if not (is_finite_number(start) and float(start).is_integer()):
        raise ConfigurationError(f"a mixture phase starts at a token count, a whole number below 1.8e308; got {start!r}")
    return int(start)


SMALLEST_SHARE = 2.0**-52
"""The smallest positive share of a phase's total weight: float64's resolution next to 1. A lane
reaches a dataset's chunks at its tokens ÷ its share on a float token axis, which a subnormal share
(5e-324) sends to infinity; no run of realistic length would draw a single chunk at a smaller share."""


def _normalised(weights: dict[str, float]) -> dict[str, float]:
    """Weights as shares of their total, scaled by the largest first so that huge weights
    (1e308 twice) do not sum to infinity and turn every share into 0."""
    largest = max(weights.values())
    scaled = {n: w / largest for n, w in weights.items()}
    total = sum(scaled.values())
    shares = {n: w / total for n, w in scaled.items()}
    tiny = {n: weights[n] for n, share in shares.items() if 0 < share < SMALLEST_SHARE}
    if tiny:
        raise ConfigurationError(
            f"mixture weights {tiny} are positive but below 2**-52 of their phase's total {weights}: "
            "no run could draw from them and the plan cannot place them; give them 0 or a larger weight"
        )
    return shares


class StaticMixtureWorkSource(_MixtureWorkSource):
    """Mixes datasets by a fixed *token* ratio.

    `mixture` maps dataset names to weights (normalised; default: equal; a positive weight below
    2**-52 of the total is refused, see SMALLEST_SHARE). With a
    `token_estimation`, weights are token shares (with `TokenEstimation(count="learned")`, shares of
    the tokens a loss learns); without one, they are record shares.
    `num_epochs=None` plans forever (each dataset restarts with a fresh permutation); an integer
    bounds each dataset to that many passes, after which it drops out and the plan ends once every
    dataset is done; a mapping gives each dataset its own count (`{"math": 3, "web": 1}`: three
    passes over one, one over the other). A fraction reads that share of a pass (`{"web": 0.5}`):
    in each lane, the nearest whole number of its chunks of the dataset, at least one, in the
    pass's seeded order, so about half of web's records, none twice. The weights still say how the
    datasets interleave while each lasts: for all of them to end together, weigh each by its passes
    times its tokens.
    `records_per_chunk` is the unit of dispatch and of mixing; `round_size` is about how many
    chunks a planning round holds.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        mixture: Mapping[str, float] | None = None,
        token_estimation: TokenEstimation | None = None,
        seed: int = 0,
        *,
        records_per_chunk: int = 128,
        num_epochs: Passes | Mapping[str, Passes] | None = None,
        round_size: int = 1024,
    ) -> None:
        _check_datasets(datasets)
        if mixture is not None and not isinstance(mixture, Mapping):
            raise ConfigurationError(f"mixture maps dataset names to weights, got {mixture!r}")
        names = [d.name for d in datasets]
        mixture = dict(mixture) if mixture is not None else {n: 1.0 for n in names}
        _check_names("mixture", mixture, names, "weight",
                     "key the mixture by the names given to Dataset.from_path, one weight each (0 leaves one out)")
        super().__init__(datasets, [(0, mixture)], token_estimation, seed, records_per_chunk, num_epochs, round_size)

    @property
    def mixture(self) -> dict[str, float]:
        """The normalised weights, as a copy: the source's own dict is what later plans and their
        fingerprints read, so a caller changing the one it got must change nothing there."""
        return dict(self.schedule[0][1])


def _check_finite_schedule(schedule: Schedule, live: list[str], num_epochs: Passes | dict[str, Passes]) -> None:
    """A finite plan ends when every dataset it draws on has finished its epochs; a dataset whose
    weight is 0 in the last phase stops being drawn there and would never finish, so the plan
    could neither deliver the rest of it nor end."""
    start, weights = schedule[-1]
    starved = [name for name in live if not weights[name] > 0]
    if starved:
        raise ConfigurationError(
            f"with num_epochs={num_epochs} every dataset the schedule draws on needs a positive weight in "
            f"its last phase (from token {start}), or it never finishes its epochs: {starved} have none"
        )


class ScheduledMixtureWorkSource(_MixtureWorkSource):
    """Mixture weights that change at given *global token counts*, deterministically.

    `schedule` is a list of (start_token, weights): the first phase starts at 0; a phase's weights
    hold from its start token until the next phase's. Token counts are the expected tokens the plan
    hands out over all lanes (each lane switches at start_token / num_lanes of its own tokens), so the
    switch point is a pure function of the recipe — the same on every layout and after every resume.
    Without a `token_estimation` the plan weighs chunks by records, as StaticMixtureWorkSource does:
    weights are record shares and start counts are global record counts; with
    `TokenEstimation(count="learned")` both count the tokens a loss learns.
    Datasets carry on where they were when a phase changes (no epoch restarts).
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        schedule: Sequence[tuple[int, Mapping[str, float]]],
        token_estimation: TokenEstimation | None = None,
        seed: int = 0,
        *,
        records_per_chunk: int = 128,
        num_epochs: Passes | Mapping[str, Passes] | None = None,
        round_size: int = 1024,
    ) -> None:
        _check_datasets(datasets)
        super().__init__(datasets, schedule, token_estimation, seed, records_per_chunk, num_epochs, round_size)


class MixturePlan:
    """A mixture work source bound to token statistics and a lane count; one per loader.

    Each dataset's chunks are dealt to lanes in a seeded order, each to the lane holding the
    fewest of its expected tokens so far (`_deal_by_tokens`), and every lane mixes its own share of
    each dataset by tokens (see TokenInterleave). Lanes hand the trainer equal numbers of tokens, so mixing *inside* each lane
    is what keeps the global token shares on target at every step, not only on average.
    """

    def __init__(self, source: _MixtureWorkSource, stats: Mapping[str, TokenStats], num_lanes: int) -> None:
        self.source = source
        self.stats = dict(stats)
        self.num_lanes = num_lanes
        self.datasets = {ds.name: ds for ds in source.datasets}
        live_names = set(source.live_names())
        live = [ds for ds in source.datasets if ds.name in live_names]
        dealt: dict[str, list[ChunkTable]] = {}
        weights: dict[str, list[np.ndarray]] = {}
        # What the loader warns of on the job's rank 0 (`_uneven_lanes`): a plan is bound on every rank.
        self.configuration_warnings: list[str] = []
        for ds in live:
            chunks = ChunkTable.of(ds, source.records_per_chunk)
            if ds.num_records == 0:
                raise ConfigurationError(f"dataset {ds.name!r} has no records to mix: give it weight 0 or leave it out")
            if ds.num_records < num_lanes:  # no records_per_chunk helps
                raise ConfigurationError(
                    f"dataset {ds.name!r} has {ds.num_records} records, fewer than num_lanes={num_lanes}: every lane "
                    "needs a share of every dataset it mixes; give it weight 0 or use fewer lanes"
                )
            if len(chunks) < num_lanes:
                fits = _records_per_chunk_for(ds, num_lanes, source.records_per_chunk)
                raise ConfigurationError(
                    f"dataset {ds.name!r} has {ds.num_records} records in {len(ds.shards)} "
                    f"shard{'s' if len(ds.shards) != 1 else ''}, cut into "
                    f"{len(chunks)} chunks of at most {source.records_per_chunk} records (a chunk never spans "
                    f"shards), fewer than num_lanes={num_lanes}: every lane needs a share of every dataset; give "
                    f"the work source smaller chunks, {type(source).__name__}(records_per_chunk={fits}) or less"
                )
            tokens = self._expected_tokens(ds, chunks)
            order = _seeded_permutation(f"{source.seed}/deal/{ds.name}", len(chunks))
            lanes = _deal_by_tokens(order, tokens, num_lanes)
            dealt[ds.name] = [chunks.take(lane) for lane in lanes]
            weights[ds.name] = [tokens[lane] for lane in lanes]
            uneven = _uneven_lanes(ds, source.records_per_chunk, [float(w.sum()) for w in weights[ds.name]])
            if uneven and source.num_epochs is None:
                self.configuration_warnings.append(uneven)
            if wasteful := ds.wasteful_decoding(source.records_per_chunk):
                self.configuration_warnings.append(wasteful)
        self._lanes = [
            TokenInterleave(
                {n: dealt[n][lane] for n in dealt},
                {n: weights[n][lane] for n in weights},
                [(start / num_lanes, {n: w[n] for n in dealt}) for start, w in source.schedule],
                seed=f"{source.seed}/lane/{lane}",
                round_size=max(1, source.round_size // num_lanes),
                num_epochs=None if source.num_epochs is None else {n: source.epochs_of(n) for n in dealt},
            )
            for lane in range(num_lanes)
        ]

    def _expected_tokens(self, dataset: Dataset, chunks: ChunkTable) -> np.ndarray:
        """Tokens per raw byte × raw bytes when estimated, else records (a record mixture).

        A measured dataset whose sample yields no token is refused: weighting it by records while
        the others are weighted by tokens would read it hundreds of times over its share, and no
        weight gives a dataset without tokens a token share."""
        stats = self.stats.get(dataset.name)
        rate = None if stats is None else self._rate(stats)
        if stats is None:
            weights = chunks.num_records().astype(np.float64)
        elif rate > 0:
            dataset.check_plannable()
            weights = chunks.raw_bytes(dataset).astype(np.float64) * rate
        else:
            whole = "all" if stats.sampled_records >= dataset.num_records else f"of {dataset.num_records}"
            if stats.tokens == 0:
                found = "no token"
            elif stats.tokens_per_byte == 0:
                found = f"{stats.tokens} tokens in 0 raw bytes"
            else:  # tokens, none of them learned, in a mixture of learned tokens
                found = "no token a loss learns (TokenEstimation(count='learned'))"
            dropped = ", ".join(f"{reason} {count}" for reason, count in stats.dropped)
            why = [f"records dropped: {dropped}"] if dropped else []
            why += [f"first {reason} at {address}" + (f": {detail}" if detail else "")
                    for reason, address, detail in stats.examples]
            raise ConfigurationError(
                f"dataset {dataset.name!r}: the token estimation sample of {stats.sampled_records} records "
                f"({whole}) yielded {found}" + (f" ({'; '.join(why)})" if why else "")
                + ", so its token share cannot be planned; check its field names and filters, give it "
                "weight 0, or sample more records (TokenEstimation(sample_records=...))"
                + filtered_note(dict(stats.dropped))
            )
        return np.maximum(weights, 1e-9)

    @property
    def _by_learned(self) -> bool:
        """Whether shares are of the tokens a loss learns (`TokenEstimation(count="learned")`)."""
        estimation = self.source.token_estimation
        return estimation is not None and estimation.count == "learned"

    def _rate(self, stats: TokenStats) -> float:
        """What a byte of the dataset weighs in the mixture: its tokens, or the tokens a loss learns."""
        return stats.learned_per_byte if self._by_learned else stats.tokens_per_byte

    def slot(self, lane: int, s: int) -> Chunk | None:
        return self._lanes[lane].slot(s)

    def num_slots(self, lane: int) -> int | None:
        return self._lanes[lane].num_slots()

    def barren_records(self, lane: int, flush_every: int) -> int | None:
        """How many records in a row the lane may read without handing over a row before its
        recipe is taken to make none (every record dropped by a stage: a misnamed field, a spec
        no image meets): `TokenInterleave.barren_records`, plus a segment and a chunk per dataset
        of slack (rows leave at a flush at the latest, and a lane's prefixes keep within about a
        chunk per dataset of their shares). None for a finite plan, which ends by itself."""
        if self.source.num_epochs is not None:
            return None
        slack = (flush_every + len(self.datasets) + 1) * self.source.records_per_chunk
        return int(self._lanes[lane].barren_records()) + slack

    def records_per_pass(self, lane: int) -> dict[str, int]:
        """The records of each dataset dealt to the lane: what it reads of each in one pass."""
        return self._lanes[lane].records_per_pass()

    def unestimated(self) -> list[str]:
        """The datasets with a share planned by records, not by an estimate of their tokens
        (no `TokenEstimation`): nothing at planning checked that any of their records survives."""
        return [name for name in self.source.live_names() if name not in self.stats]

    def weight_of(self, name: str) -> str:
        """The dataset's normalised mixture weight, or its weight in each phase of a schedule."""
        weights = [f"{phase[name]:.3g}" for _, phase in self.source.schedule]
        return weights[0] if len(weights) == 1 else f"{', '.join(weights)} in the schedule's {len(weights)} phases"

    def fingerprint(self) -> dict:
        return {
            "kind": "static_mixture",
            "datasets": [ds.fingerprint() for ds in self.source.datasets],
            "schedule": [[start, weights] for start, weights in self.source.schedule],
            "seed": self.source.seed,
            "records_per_chunk": self.source.records_per_chunk,
            "num_epochs": self.source.num_epochs,
            "round_size": self.source.round_size,
            "tokens_per_byte": {n: s.tokens_per_byte for n, s in sorted(self.stats.items())},
            **({"learned_per_byte": {n: s.learned_per_byte for n, s in sorted(self.stats.items())}}
               if self._by_learned else {}),
        }


def _seeded_permutation(key: str, n: int) -> np.ndarray:
    return SeededStream.from_key(key).permutation(n)


def _records_per_chunk_for(dataset: Dataset, num_lanes: int, too_large: int) -> int:
    """The largest records_per_chunk below `too_large` that cuts `dataset` into at least
    `num_lanes` *full* chunks (floor(count / size) of a shard), for the refusal to name: "lower it"
    left the user guessing by how much. Counting a shard's tail chunk too named a size that dealt
    some lane a tail alone (51 records, 2 lanes: 50, leaving one lane a single record, which it
    repeated for half its tokens); with a full chunk for every lane, dealing by tokens gives each
    one at least a full chunk's worth (`_deal_by_tokens`). The full chunks only grow in number as
    the size shrinks, and size 1 makes every record one, so a dataset of num_lanes records fits."""
    counts = np.array([shard.num_records for shard in dataset.shards], dtype=np.int64)
    low, high = 1, too_large - 1  # low always fits; find the largest size that does
    while low < high:
        size = (low + high + 1) // 2
        if int((counts // size).sum()) >= num_lanes:
            low = size
        else:
            high = size - 1
    return low


_UNEVEN_LANES = 0.25
"""A lane holding less than this share of the expected tokens of a dataset that another lane
holds is warned of: it reads its records over four times as often as that lane its. Closer
shares are what small datasets dealt in whole chunks give (a lane of 5 chunks beside one of 6),
not worth a line on every run."""


def _uneven_lanes(dataset: Dataset, records_per_chunk: int, held: list[float]) -> str | None:
    """A warning where dealing a dataset's chunks left a lane far fewer of its tokens than another.

    Each lane mixes its own share of every dataset by tokens, so on an endless plan a lane holding
    a few records of a dataset repeats them to fill that dataset's share of its rows: a dataset of
    about one chunk per lane (51 records in chunks of 50 on 2 lanes) had one lane read a single
    record in 807 of 800 rows, silently. Dealing by tokens keeps lanes within one chunk of each
    other, so smaller chunks even them out: the warning names the size that gives every lane a
    full chunk. A finite plan reads each record once per epoch whatever the lane: not warned of."""
    least, most = min(held), max(held)
    if most <= 0 or least >= _UNEVEN_LANES * most:
        return None
    lane, fullest = held.index(least), held.index(most)
    return (
        f"dataset {dataset.name!r}: its chunks of up to {records_per_chunk} records leave lane {lane} "
        f"{100 * least / most:.0f}% of the expected tokens lane {fullest} holds, so lane {lane} reads each of its "
        f"records about {most / max(least, 1e-9):.0f}x as often as lane {fullest} does; records_per_chunk="
        f"{_records_per_chunk_for(dataset, len(held), records_per_chunk)} or less deals them more evenly"
    )


def _deal_by_tokens(order: np.ndarray, tokens: np.ndarray, num_lanes: int) -> list[np.ndarray]:
    """Chunk indices per lane: taken in `order`, each goes to the lane with the fewest expected
    tokens so far (the lowest-numbered on a tie), so the first `num_lanes` go one to each lane.

    Dealing by count (chunk j to lane j mod num_lanes) ignored that chunks differ in size: shards
    end in small tail chunks, and a lane dealt mostly tails held a few records of a dataset, which
    it then repeated endlessly to fill that dataset's share of its tokens (the README's recipe with
    seed 7: of jargon's expected tokens per epoch one lane of 8 held 393, two of its records, and
    another 70,206; dealt by tokens, 38,722 to 55,748). Dealt by tokens, no lane holds more of a
    dataset than another by over its largest chunk."""
    loads = [(0.0, lane) for lane in range(num_lanes)]  # a heap, already in order
    lanes: list[list[int]] = [[] for _ in range(num_lanes)]
    for index, weight in zip(order.tolist(), tokens[order].tolist()):
        load, lane = loads[0]
        lanes[lane].append(index)
        heapq.heapreplace(loads, (load + weight, lane))
    return [np.asarray(lane, dtype=np.intp) for lane in lanes]


class TokenInterleave:
    """One lane's endless (or epoch-bounded) interleave of several chunk streams by token shares.

    Every chunk has an expected token count. Each dataset's stream (a seeded permutation of its
    chunks per epoch) is cut into rounds by cumulative tokens: round r holds the chunks whose token
    midpoint falls in the round's part of the dataset's cumulative target, ordered by the time (on
    the lane's token axis) at which the schedule reaches that midpoint. Where a round starts is
    a closed-form sum, so slot s is found by binary search over rounds: resuming deep into a run
    costs the same as resuming early. Every prefix is within about one chunk per dataset of the
    target token shares. Thread-unsafe (it caches rounds): each loader binds its own plan.
    """

    def __init__(self, chunks, weights, phases, *, seed: str, round_size: int,
                 num_epochs: dict[str, Passes] | None) -> None:
        self._names = list(chunks)
        self._chunks = chunks
        self._weights = weights
        self._seed = seed
        self._num_epochs = num_epochs
        self._epoch_tokens = {n: float(weights[n].sum()) for n in self._names}
        self._phases = list(phases)
        self._round_grid = self._cut_rounds(round_size)
        self._rounds: dict[int, list[Chunk]] = {}
        self._epoch = lru_cache(maxsize=32)(self._draw_epoch)
        # (index, first slot, first slot of the next) of the last lookup; at first an empty round
        # before round 0, which starts at slot 0
        self._last_round = (-1, 0, 0)
        self._barren_records: float | None = None

    def _cut_rounds(self, round_size: int) -> list[tuple[int, float, float]]:
        """(index of its first round, start token, tokens per round) of each phase: each phase cuts
        its stretch of the token axis into rounds of about `round_size` chunks at its own shares
        (its last round ends at the next phase's start). One size for every phase, sized by the
        first, put tens of thousands of chunks in a round of a phase on chunks far smaller than the
        first phase's, all listed at once, and never finished listing one on weight-1e-9 chunks."""
        grid, first_round = [], 0
        for i, (start, shares) in enumerate(self._phases):
            chunks_per_token = sum(shares[n] * len(self._chunks[n]) / self._epoch_tokens[n] for n in self._names)
            round_tokens = round_size / max(chunks_per_token, 1e-12)
            grid.append((first_round, start, round_tokens))
            if i + 1 < len(self._phases):
                rounds = (self._phases[i + 1][0] - start) / round_tokens
                if not math.isfinite(rounds):  # a next phase past float's range of rounds: never reached
                    break
                first_round += math.ceil(rounds)
        return grid

    def _round_end(self, round_index: int) -> float:
        """Where round `round_index` starts on the lane's token axis (where the one before ends)."""
        for first_round, start, round_tokens in reversed(self._round_grid):
            if first_round <= round_index:
                return start + (round_index - first_round) * round_tokens
        return 0.0

    def _target(self, name: str, round_index: int) -> float:
        """Cumulative expected tokens of `name` before round `round_index`: the integral of its
        share over the lane's token axis, which is piecewise linear across mixture phases."""
        end_tokens = self._round_end(round_index)
        total = 0.0
        for i, (start, shares) in enumerate(self._phases):
            if end_tokens <= start:
                break
            stop = self._phases[i + 1][0] if i + 1 < len(self._phases) else end_tokens
            total += shares[name] * (min(end_tokens, stop) - start)
        return total

    def _time_of(self, name: str, tokens: float) -> float:
        """Inverse of `_target` on the token axis: where the lane has handed out `tokens` of `name`.
        Sorting a round's chunks by this time interleaves them as their phases dictate."""
        done = 0.0
        for i, (start, shares) in enumerate(self._phases):
            share = shares[name]
            stop = self._phases[i + 1][0] if i + 1 < len(self._phases) else math.inf
            if share > 0 and tokens <= done + share * (stop - start):
                return start + (tokens - done) / share
            done += share * (stop - start) if stop != math.inf else 0.0
        return math.inf

    def _draw_epoch(self, name: str, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(permutation, token midpoint of each permuted chunk within the epoch); `_epoch` caches it
        per plan (a lane looks a few epochs up many times, in each slot's binary search over rounds):
        a cache on the method, shared by every plan, kept closed loaders' plans alive."""
        order = _seeded_permutation(f"{self._seed}/epoch/{name}/{epoch}", len(self._chunks[name]))
        weights = self._weights[name][order]
        return order, np.cumsum(weights) - weights / 2

    def _limit(self, name: str) -> int | None:
        """The slots of `name` the lane's plan holds: its passes over the dataset's chunks, a
        fraction of a pass rounded to the nearest chunk (at least one: the lane mixes the dataset)."""
        if self._num_epochs is None:
            return None
        passes, chunks = self._num_epochs[name], len(self._chunks[name])
        return passes * chunks if isinstance(passes, int) else max(1, round(passes * chunks))

    def _count_before(self, name: str, round_index: int) -> int:
        """How many chunks of `name` come before round `round_index`."""
        target = self._target(name, round_index)
        epoch_tokens, n = self._epoch_tokens[name], len(self._chunks[name])
        epoch = int(target // epoch_tokens)
        _, mids = self._epoch(name, epoch)
        count = epoch * n + int(np.searchsorted(mids, target - epoch * epoch_tokens, side="left"))
        limit = self._limit(name)
        return count if limit is None else min(count, limit)

    def _round_start(self, round_index: int) -> int:
        return sum(self._count_before(n, round_index) for n in self._names)

    def _round(self, round_index: int) -> list[Chunk]:
        cached = self._rounds.get(round_index)
        if cached is not None:
            return cached
        keyed = []
        for d, name in enumerate(self._names):
            n, epoch_tokens = len(self._chunks[name]), self._epoch_tokens[name]
            for k in range(self._count_before(name, round_index), self._count_before(name, round_index + 1)):
                epoch, i = divmod(k, n)
                order, mids = self._epoch(name, epoch)
                position = self._time_of(name, epoch * epoch_tokens + mids[i])
                keyed.append((position, d, self._chunks[name][int(order[i])]))
        keyed.sort(key=lambda t: (t[0], t[1]))
        chunks = [chunk for _, _, chunk in keyed]
        if len(self._rounds) > 8:
            self._rounds.clear()
        self._rounds[round_index] = chunks
        return chunks

    def slot(self, s: int) -> Chunk | None:
        total = self.num_slots()
        if total is not None and s >= total:
            return None
        index, start = self._round_of(s)
        return self._round(index)[s - start]

    def _round_of(self, s: int) -> tuple[int, int]:
        """(index, first slot) of the round holding slot `s`. A lane reads its slots in order, so
        the round of the previous lookup is tried first (text race recipe, 3.14t: the loader's
        dispatch of a chunk 21.5 -> 15.5 us), and a slot past it is searched for from there, by
        steps doubling from one round: with many lanes a round holds a chunk or two (or none),
        and searching from round 0 at each new one asked where ~2·log2(r) rounds start, ~3 ms a
        chunk deep into a run of 10 datasets on 256 lanes. A slot before it is searched for from
        round 0, which starts at slot 0."""
        index, start, stop = self._last_round
        if start <= s < stop:
            return index, start
        lo, lo_start = (index + 1, stop) if s >= stop else (0, 0)
        hi, step = lo + 1, 1
        hi_start = self._round_start(hi)
        while hi_start <= s:  # find a round that starts after s
            lo, lo_start, step = hi, hi_start, step * 2
            hi = lo + step
            hi_start = self._round_start(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            mid_start = self._round_start(mid)
            if mid_start <= s:
                lo, lo_start = mid, mid_start
            else:
                hi, hi_start = mid, mid_start
        self._last_round = (lo, lo_start, hi_start)
        return lo, lo_start

    def num_slots(self) -> int | None:
        if self._num_epochs is None:
            return None
        return sum(self._limit(n) for n in self._names)

    def records_per_pass(self) -> dict[str, int]:
        """The records of each dataset's chunks in this lane: one pass (an epoch) of them."""
        return {n: int(self._chunks[n].num_records().sum()) for n in self._names}

    def barren_records(self) -> float:
        """Records this lane may read without a surviving one and still make rows later: all it
        reads before the last mixture phase starts (an earlier phase may draw only on datasets
        whose records this lane drops), plus twice what it reads while each dataset with a share
        completes one epoch of its chunks, for the slowest dataset in the phase where it is
        slowest. One epoch of dataset n spans (its epoch tokens ÷ its share) of the lane's token
        axis, over which every dataset m is read at its share times its records per expected
        token. Computed once per lane, from the chunk tables' arrays: a Chunk made per chunk to
        read its records took ~2 us each, half a minute for a rank of 16 million chunks."""
        if self._barren_records is None:
            per_token = {n: int(self._chunks[n].num_records().sum()) / self._epoch_tokens[n] for n in self._names}
            per_axis_token = [sum(shares[m] * per_token[m] for m in self._names) for _, shares in self._phases]
            before_last = sum(
                (self._phases[i + 1][0] - start) * per_axis_token[i] for i, (start, _) in enumerate(self._phases[:-1])
            )
            longest_epoch = max(
                self._epoch_tokens[n] / shares[n] * per_axis_token[i]
                for i, (_, shares) in enumerate(self._phases)
                for n in self._names
                if shares[n] > 0
            )
            self._barren_records = before_last + 2 * longest_epoch
        return self._barren_records
