"""Loader state: cursors per lane, a recipe fingerprint, a version — plain JSON, never pickle.

A lane's cursor is (segment, skip, position): replay the lane from the start of `segment`, drop
the first `skip` rows it produces (the trainer already consumed them), and count the lane's rows
from `position`. Beside it travel the lane's settled ledger counts (see `_ledger.py`). Nothing
buffered is ever saved; loading a state cannot execute code.

A state also says how far its rank has gone, two ways: the global steps it has begun handing over,
and the rows handed over on all ranks together as it counts them (its own rows since it was
resumed, times the world size, on top of the count it was resumed at). Ranks saved at one
checkpoint agree on the rows, or, once a lane has finished, on the steps with every live lane at
their end (see `_one_checkpoint`); `merge_states` refuses states that do neither, since their
lanes would resume out of step with each other. It also says which of its lanes a finite plan has
finished, and, per dataset of the recipe, a summary that lets a refusal of another recipe say which
dataset differs and how (see `dataset_summaries`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple

from ._accepted_changes import accepted_keys, check_accepted, how_to_accept
from ._dataset_changes import describe_dataset_changes, moved_datasets
from ._errors import CheckpointError, RecipeMismatchError
from ._recipe_keys import meaning_of_keys
from ._sha256 import sha256

__all__ = [
    "LaneCursor", "STATE_FORMAT", "STATE_VERSION", "TORCHTITAN_STATE_KEY", "ReadState", "make_state", "read_state",
    "recipe_digests", "dataset_summaries", "merge_states",
]

STATE_FORMAT = "zephon.loader_state"
TORCHTITAN_STATE_KEY = "zephon_state"
"""The one key of TorchTitan's `ZephonDataLoader.state_dict()`, whose value is a loader state's JSON
text. Kept here, where the refusals of such a dict given for a loader state name it, and taken from
here by the adapter: the core never imports an integration."""

_MERGE_TAKES_NO_TITAN_STATE_DICT = (
    f"merge_states takes Zephon loader states, not a ZephonDataLoader's state_dict() (TorchTitan's "
    f"{{{TORCHTITAN_STATE_KEY!r}: JSON}}) nor its JSON text: give it a list of every replica's "
    f"loader.local_state_dict(), or json.loads(state_dict[{TORCHTITAN_STATE_KEY!r}]) of each saved state_dict. "
    "A state_dict() saved with a process group initialised was gathered over it, covers every lane and needs no "
    "merge: ZephonDataLoader.load_state_dict takes it as it is"
)
"""merge_states' refusal of such a dict, alone, in a list or as JSON text: the core's own words said
only where the loader state is inside one, or, given one not in a list, to put it in a list, where
it was refused next. Such dicts are not unwrapped and merged instead: the core reads one spelling
of a state, and what a merge of them returned would not be one of them (a ZephonDataLoader's own
`load_state_dict` takes either)."""

# 2: recipe digests per setting (plan.seed, operators[i].op.setting); 3: zephon._random draws;
# 4: "steps_begun" and "finished", so that merging ranks saved at different steps is refused;
# 5: "rows_taken", so that it is refused also once every rank has a finished lane;
# 6: "datasets", a summary per dataset, so that a refusal names the dataset that changed
# 7: a dataset summary's "root" and "shards_under_root", so that a corpus moved elsewhere resumes
STATE_VERSION = 7
READ_VERSIONS = (5, 6, 7)
"""Versions read: a state of version 5 has no dataset summaries, and a refusal of another dataset
list names only `plan.datasets`, as the Zephon that wrote it did; one of version 6 has summaries
without the shards' root, and a corpus moved since it was saved is refused as it was then."""
_SUMMARY_KEYS = {"name", "settings", "num_shards", "nbytes", "num_records"}
_ROOT_KEYS = {"root", "shards_under_root"}
"""What a summary of version 7 adds to those of version 6 (see `_shards_root`)."""


@dataclass
class LaneCursor:
    """Where a lane stands. `position` counts rows handed to the trainer, padding included;
    `finished` is set once a finite plan's every row of the lane was handed over."""

    segment: int = 0
    skip: int = 0
    position: int = 0
    finished: bool = False

    def as_json(self) -> list[int]:
        return [self.segment, self.skip, self.position]


def canonical_json(value) -> str:
    """One text per value (keys sorted, no spaces, ASCII only), so that a digest of it is the same
    in every process and on every machine."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def recipe_digests(recipe: Mapping) -> dict[str, str]:
    """A short digest per recipe setting, so a mismatch can be named without storing it all.

    Settings are named one level below the recipe's top: `plan.seed`, `plan.schedule`,
    `plan.datasets`; an operator's as `operators[i].<op>.<setting>` (e.g.
    `operators[2].pack_flat.max_length`). Deeper values (the dataset list) get one digest each.
    """
    named: dict[str, object] = {}
    for key, value in recipe.items():
        if isinstance(value, Mapping) and value:
            named.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for i, item in enumerate(value):
                prefix = f"{key}[{i}].{item.get('op', '')}".rstrip(".")
                named.update({f"{prefix}.{k}": v for k, v in item.items() if k != "op"} or {prefix: {}})
        else:
            named[key] = value
    return {k: _short_digest(v) for k, v in named.items()}


def _short_digest(value) -> str:
    return _text_digest(canonical_json(value))


def _text_digest(text: str) -> str:
    return sha256(text.encode()).hexdigest()[:16]


def dataset_summaries(recipe: Mapping) -> list[dict] | None:
    """A summary of each entry of the recipe's `plan.datasets`, for a refusal to say which dataset
    differs and how (`describe_dataset_changes`): its name, a digest per setting of its entry (its
    shard list's among them), its shards, bytes and records counted, and the directory its shards
    share with a digest of the shard list under it (`moved_datasets` tells a corpus copied
    elsewhere by them). Never the shard list itself: a checkpoint holds cursors and digests. None
    where the plan holds no list of entries (a WorkPlan of the user's may fingerprint its datasets
    otherwise)."""
    plan = recipe.get("plan")
    entries = plan.get("datasets") if isinstance(plan, Mapping) else None
    if not isinstance(entries, list) or not all(isinstance(entry, Mapping) for entry in entries):
        return None
    return [_dataset_summary(entry) for entry in entries]


def _dataset_summary(entry: Mapping) -> dict:
    """Its shards are asked whether they are dicts, not Mappings: the recipe is plain JSON data, and
    asking the abstract class of each of 10**5 shards cost a tenth of a second."""
    shards = entry.get("shards")
    listed = isinstance(shards, list) and all(isinstance(shard, dict) for shard in shards)
    name = entry.get("name")
    root = _shards_root(shards) if listed else None
    # The shard list written once: its digest, and with the root cut from every URL, the digest of
    # the list under the root (a second list of 10**5 dicts written again took twice as long).
    text = canonical_json(shards)
    return {
        "name": name if isinstance(name, str) else None,
        "settings": {str(key): _text_digest(text) if key == "shards" else _short_digest(value)
                     for key, value in entry.items()},
        "num_shards": len(shards) if listed else None,
        "nbytes": _total(shards, "nbytes") if listed else None,
        "num_records": _total(shards, "num_records") if listed else None,
        "root": root,
        "shards_under_root": None if root is None else _text_digest(
            text.replace('"url":' + canonical_json(root)[:-1], '"url":"')
        ),
    }


def _shards_root(shards: list[dict]) -> str | None:
    """The directory (ending in "/") that every shard's URL begins with, the deepest one; None
    where a shard has no URL or there is no shard. A corpus copied elsewhere (`/mnt/a/corpus/` to
    `/scratch/corpus/`, a local directory to `s3://bucket/corpus/`) keeps the shard list under it:
    its names relative to it, in the same order, with their counts and sizes."""
    urls = [shard.get("url") for shard in shards]
    if not urls or not all(isinstance(url, str) for url in urls):
        return None
    first, last = min(urls), max(urls)  # the prefix they share, every other URL shares
    common = next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), min(len(first), len(last)))
    return first[: first.rfind("/", 0, common) + 1]


def _total(shards: list[dict], key: str) -> int | None:
    """The shards' `key` summed, or None where one is no count (`type(...) is int` leaves out bools)."""
    values = [shard.get(key) for shard in shards]
    return sum(values) if all(type(value) is int and value >= 0 for value in values) else None


def _copied(datasets: list[dict] | None) -> list[dict] | None:
    """Summaries of the state's own: a loader hands the same summaries to every state it saves, and
    a caller editing one state in place must not edit the next (nor the summaries a refusal reads)."""
    return None if datasets is None else [{**summary, "settings": dict(summary["settings"])} for summary in datasets]


def _checksum(body: Mapping) -> str:
    return sha256(canonical_json(body).encode()).hexdigest()


def make_state(
    digests: Mapping[str, str],
    datasets: list[dict] | None,
    lanes: Mapping[int, LaneCursor],
    num_lanes: int,
    ledgers: Mapping[int, dict],
    steps_begun: int | None,
    rows_taken: int,
) -> dict:
    """`digests`: the recipe's, as `recipe_digests` gives them (a loader takes them once: its
    recipe holds what its maps and filters read, written whole, which may take long to hash).
    `datasets`: the recipe's dataset summaries, as `dataset_summaries` gives them (copied).
    `steps_begun`: the global steps the rank handed over microbatches of, the last one perhaps
    in part; None once its every lane is finished (a rank that is done cannot be out of step).
    `rows_taken`: the rows handed over on all ranks together if every rank handed over as many as
    this one since the state it resumed from (whose count it starts from)."""
    body = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "num_lanes": num_lanes,
        "recipe": dict(digests),
        "datasets": _copied(datasets),
        "steps_begun": steps_begun,
        "rows_taken": rows_taken,
        "lanes": {str(lane): cursor.as_json() for lane, cursor in sorted(lanes.items())},
        "finished": sorted(lane for lane, cursor in lanes.items() if cursor.finished),
        "ledger": {str(lane): ledgers[lane] for lane in sorted(ledgers)},
    }
    return {**body, "checksum": _checksum(body)}


def _intact(state: object, titan_refusal: str | None = None) -> dict:
    """The state as a dict, after checking that it is a Zephon state of this version whose checksum
    matches its content; raises CheckpointError naming what is wrong otherwise, `titan_refusal`
    for a ZephonDataLoader's state_dict() where the caller has words of its own for it."""
    if isinstance(state, (str, bytes)):
        try:
            state = json.loads(state)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
            named = isinstance(state, str) and not state.lstrip().startswith(("{", "["))
            path = " (a str is the state's JSON text, not a file's name: load the file and pass what it holds)"
            raise CheckpointError(f"loader state is not valid JSON: {exc}{path if named else ''}") from None
    if _is_titan_state_dict(state):
        raise CheckpointError(
            titan_refusal
            or "not a Zephon loader state but a ZephonDataLoader's state_dict() (TorchTitan's): "
            f"the loader state is its {TORCHTITAN_STATE_KEY!r}"
        )
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError("not a Zephon loader state (missing or wrong 'format' field)")
    if state.get("version") not in READ_VERSIONS:
        raise CheckpointError(
            f"loader state version {state.get('version')!r} is not supported "
            f"(this Zephon reads {', '.join(map(str, READ_VERSIONS))})"
        )
    body = {k: v for k, v in state.items() if k != "checksum"}
    try:
        checksum = _checksum(body)
    except (TypeError, ValueError, RecursionError) as exc:  # a NumPy integer, an array, deep nesting: no state make_state wrote
        raise CheckpointError(
            f"loader state is not plain JSON data ({exc}): load it as it was saved (e.g. json.loads of its text)"
        ) from None
    if state.get("checksum") != checksum:
        raise CheckpointError("loader state checksum does not match its content (truncated or edited)")
    return state


def _is_titan_state_dict(value: object) -> bool:
    """Whether `value` is a ZephonDataLoader's state_dict() (its one key holding a state's JSON)."""
    return isinstance(value, Mapping) and set(value) == {TORCHTITAN_STATE_KEY}


def _parsed(value: object) -> object:
    """`value` read as JSON if it is text that holds JSON, else `value` itself: only to tell what a
    refused value is; `_intact` reads a state, and says why text is no JSON."""
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


class ReadState(NamedTuple):
    """A state read against the current recipe: its cursors and ledger counts by lane, its steps
    begun and rows taken, and what the loader warns of taking it up (a moved corpus, changes
    accepted)."""

    cursors: dict[int, LaneCursor]
    ledgers: dict[int, dict]
    steps_begun: int | None
    rows_taken: int
    warnings: tuple[str, ...]


def read_state(
    state: object,
    current: Mapping[str, str],
    datasets: list[dict] | None,
    num_lanes: int,
    accept_changes: Iterable[str] = (),
) -> ReadState:
    """Validate a state against the current recipe's digests (`recipe_digests`) and dataset
    summaries (`dataset_summaries`), accepting the recipe keys named in `accept_changes` that
    changed and may be (`_accepted_changes`), and a dataset list whose shards only moved
    (`moved_datasets`)."""
    accepted = accepted_keys(accept_changes)
    state = _intact(state)
    _check_shape(state)
    saved, saved_datasets = state["recipe"], state.get("datasets")
    changed = _changed_keys(saved, current)
    moved = (
        moved_datasets(saved_datasets, datasets)
        if "plan.datasets" in changed and saved_datasets is not None and datasets is not None
        else []
    )
    if moved:
        changed.remove("plan.datasets")
    unchanged = check_accepted(accepted, changed, saved, current)
    accepted = tuple(key for key in accepted if key not in unchanged)
    refused = [key for key in changed if key not in accepted]
    if refused:
        how = describe_dataset_changes(saved_datasets, datasets) if "plan.datasets" in refused and not (
            saved_datasets is None or datasets is None
        ) else []
        raise RecipeMismatchError(
            "the checkpoint was taken with a different recipe; changed: " + ", ".join(refused)
            + (f" (accept_changes named {', '.join(accepted)})" if accepted else "")
            + (". In plan.datasets: " + "; ".join(how) if how else "")
            + (". The datasets moved, which alone is accepted: " + "; ".join(moved) if moved else "")
            + ". Performance settings (runner, parallelism, world size) may change on resume; the recipe may not."
            + meaning_of_keys(refused) + how_to_accept([*accepted, *refused], saved, current),
            tuple(refused),
        )
    warnings = []
    if moved:
        warnings.append(
            "resuming from a checkpoint whose datasets moved: " + "; ".join(moved)
            + ". The shards are the same under the new root (names, order, sizes and record counts), so the "
            "batches are those the checkpoint's run would have had"
        )
    if accepted:
        warnings.append(
            f"resuming from a checkpoint of another recipe, accepting the changes named in accept_changes: "
            f"{', '.join(accepted)}. The lanes go on from their cursors with the new recipe: the batches from here "
            "are the new recipe's, not bit-identical to an uninterrupted run of either recipe"
        )
    if unchanged:
        warnings.append(
            f"accept_changes names {', '.join(unchanged)}, in which the checkpoint's recipe does not differ from this "
            "one: nothing to accept there (a key left from an earlier resume; remove it once no checkpoint of the "
            "old recipe is to be resumed)"
        )
    if state["num_lanes"] != num_lanes:
        raise RecipeMismatchError(
            f"num_lanes changed: checkpoint has {state['num_lanes']}, pipeline has {num_lanes}", ("num_lanes",)
        )
    finished = set(state["finished"])
    cursors = {int(lane): LaneCursor(*cursor, finished=int(lane) in finished) for lane, cursor in state["lanes"].items()}
    ledgers = {int(lane): dict(counts) for lane, counts in state["ledger"].items()}
    return ReadState(cursors, ledgers, state["steps_begun"], state["rows_taken"], tuple(warnings))


def _changed_keys(saved: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """The recipe keys (`recipe_digests`) whose digests differ, or that one side lacks."""
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def _check_shape(state: dict) -> None:
    """The shape `make_state` writes. A checksum only proves the content is what was signed: a
    state edited and signed again by hand must still not reach the loader as a KeyError, a
    negative cursor, a lane no rank owns, a count the ledger cannot add, or a lane without its
    ledger counts (its stats would start again at zero, unsaid)."""
    num_lanes = state.get("num_lanes")
    if not isinstance(state.get("recipe"), dict) or not _is_count(num_lanes):
        raise CheckpointError("malformed loader state: 'recipe' must be an object and 'num_lanes' an integer")
    lanes, ledger = state.get("lanes"), state.get("ledger")
    if not isinstance(lanes, dict) or not all(
        isinstance(cursor, list) and len(cursor) == 3 and all(map(_is_count, cursor)) for cursor in lanes.values()
    ):
        raise CheckpointError("malformed lane cursors in loader state: each lane needs 3 non-negative integers")
    if "ledger" not in state:
        raise CheckpointError(
            f"malformed loader state: the 'ledger' key is missing (a state of version {STATE_VERSION} carries "
            "the ledger counts of every lane it has a cursor for; without them the stats would start again at zero)"
        )
    if not isinstance(ledger, dict) or not all(_is_lane_ledger(counts) for counts in ledger.values()):
        raise CheckpointError(
            "malformed ledger in loader state: each lane needs "
            "{'records': {dataset: {name: count}}, 'rows': {name: count}} with non-negative integer counts"
        )
    _check_lane_keys(lanes, "lane cursors", num_lanes)
    _check_lane_keys(ledger, "ledger", num_lanes)
    if set(ledger) != set(lanes):
        raise CheckpointError(
            f"malformed ledger in loader state: its lanes {sorted(map(int, ledger))} are not those of the lane "
            f"cursors {sorted(map(int, lanes))} (each lane's counts travel with its cursor)"
        )
    steps_begun, finished = state.get("steps_begun"), state.get("finished")
    if "steps_begun" not in state or (steps_begun is not None and not _is_count(steps_begun)):
        raise CheckpointError("malformed loader state: 'steps_begun' must be a non-negative integer or null")
    if not _is_count(state.get("rows_taken")):
        raise CheckpointError("malformed loader state: 'rows_taken' must be a non-negative integer")
    datasets, version = state.get("datasets"), state["version"]
    if ("datasets" not in state and version >= 6) or (
        datasets is not None
        and not (isinstance(datasets, list) and all(_is_dataset_summary(summary, version) for summary in datasets))
    ):
        raise CheckpointError(
            "malformed loader state: 'datasets' must be null or a list of dataset summaries "
            "({'name', 'settings': {setting: digest}, 'num_shards', 'nbytes', 'num_records'"
            + (", 'root', 'shards_under_root'" if version >= 7 else "") + "})"
        )
    if (
        not isinstance(finished, list)
        or not all(map(_is_count, finished))
        or len({str(lane) for lane in finished} & set(lanes)) != len(finished)
    ):
        raise CheckpointError("malformed loader state: 'finished' must list distinct lanes of the state's cursors")


def _check_lane_keys(by_lane: dict, what: str, num_lanes: int) -> None:
    """Each key must be `str(lane)` for a lane of this state, as `make_state` writes it: "01" would
    be a second name for lane 1, and a lane out of range is owned by no rank, so merging would sign
    it again and carry it forever."""
    for key in by_lane:
        lane = _lane_number(key)
        if lane is None or not 0 <= lane < num_lanes:
            raise CheckpointError(
                f"malformed {what} in loader state: lane key {key!r} is not a lane of this state "
                f"(a decimal number from 0 to num_lanes - 1 = {num_lanes - 1}, without leading zeros)"
            )


def _lane_number(key: object) -> int | None:
    """The lane `key` names if it is spelled exactly as `str(lane)`; None for "x", "01", "+1" or " 1"."""
    try:
        lane = int(key)
    except (TypeError, ValueError):
        return None
    return lane if str(lane) == key else None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_dataset_summary(summary: object, version: int) -> bool:
    """What `_dataset_summary` writes (less the root and its digest before version 7), which
    `describe_dataset_changes` and `moved_datasets` read."""
    return (
        isinstance(summary, dict)
        and set(summary) == (_SUMMARY_KEYS | _ROOT_KEYS if version >= 7 else _SUMMARY_KEYS)
        and all(summary.get(key) is None or isinstance(summary[key], str) for key in ("name", *_ROOT_KEYS))
        and isinstance(summary["settings"], dict)
        and all(isinstance(digest, str) for digest in summary["settings"].values())
        and all(summary[key] is None or _is_count(summary[key]) for key in ("num_shards", "nbytes", "num_records"))
    )


def _is_lane_ledger(counts: object) -> bool:
    """What `Ledger.lane_state` writes, and nothing else, since `Ledger.settle` adds these counts:
    {"records": {dataset: {name: count}}, "rows": {name: count}}."""
    if not isinstance(counts, dict) or set(counts) != {"records", "rows"}:
        return False
    records = counts["records"]
    return _is_counter(counts["rows"]) and isinstance(records, dict) and all(map(_is_counter, records.values()))


def _is_counter(value: object) -> bool:
    """{name: count}, as a `collections.Counter` of the ledger is saved."""
    return isinstance(value, dict) and all(map(_is_count, value.values()))


def merge_states(states: Iterable[Mapping]) -> dict:
    """Combine the states of all ranks into one covering every lane (ranks own disjoint lanes; a
    lane given in two states, by peers of one data-parallel rank, must have the same cursor and
    ledger counts in both).

    Each input must be intact (its checksum is verified): merging never launders an edited state.
    Each is a loader state or its JSON text; a TorchTitan `ZephonDataLoader.state_dict()`, or its
    JSON text, is refused saying what to give instead (`_MERGE_TAKES_NO_TITAN_STATE_DICT`).
    """
    if isinstance(states, (Mapping, str, bytes)):  # iterated, one state gave its keys or characters
        if _is_titan_state_dict(_parsed(states)):
            raise CheckpointError(_MERGE_TAKES_NO_TITAN_STATE_DICT)
        raise CheckpointError(
            "merge_states takes the states of every rank (a list), got one state: merge_states([state])"
        )
    states = [_intact(state, _MERGE_TAKES_NO_TITAN_STATE_DICT) for state in states]
    for state in states:
        _check_shape(state)
    if not states:
        raise CheckpointError("merge_states needs at least one state")
    first = states[0]
    lanes: dict[str, list[int]] = {}
    finished: set[int] = set()
    ledger: dict[str, dict] = {}
    for index, state in enumerate(states):
        for key in ("format", "version", "num_lanes", "recipe", "datasets"):
            if state.get(key) != first.get(key):
                # Which state and, for the recipe, which keys: the refusal named 'recipe' alone, and
                # finding the stale rank's file and the setting took opening every state.
                how = f" (changed: {', '.join(_changed_keys(first[key], state[key]))})" if key == "recipe" else ""
                raise CheckpointError(
                    f"cannot merge loader states that differ in {key!r}: state {index} against state 0{how}; "
                    "every state merged is one rank's of one run (was one rank's file left from another run?)"
                )
        for lane, cursor in state["lanes"].items():
            done = int(lane) in state["finished"]
            if lane in lanes and (lanes[lane] != cursor or (int(lane) in finished) != done):
                raise CheckpointError(f"lane {lane} appears in two states with different cursors")
            # A lane's counts follow from its cursor, so ranks holding one lane (tensor-parallel
            # peers gathered together) agree on them; the last state's used to win unseen.
            if lane in ledger and ledger[lane] != state["ledger"][lane]:
                raise CheckpointError(f"lane {lane} appears in two states with different ledger counts")
            lanes[lane] = cursor
            ledger[lane] = state["ledger"][lane]
        finished.update(state["finished"])
    body = {k: first[k] for k in ("format", "version", "num_lanes", "recipe", "datasets") if k in first}
    body["steps_begun"] = _one_checkpoint(states)
    # What was handed over, as the cursors (padding included) say: what every rank resumed from it counts on.
    body["rows_taken"] = sum(cursor[2] for cursor in lanes.values())
    body["lanes"] = dict(sorted(lanes.items(), key=lambda kv: int(kv[0])))
    body["finished"] = sorted(finished)
    body["ledger"] = dict(sorted(ledger.items(), key=lambda kv: int(kv[0])))
    return {**body, "checksum": _checksum(body)}


def _one_checkpoint(states: list[dict]) -> int | None:
    """The steps begun of the merged state, once the ranks' states are shown to come from one
    checkpoint; raises CheckpointError otherwise.

    Ranks saved at one checkpoint have taken as many rows: their trainer takes as many microbatches
    from every rank between checkpoints (TorchTitan's local batches, a loop accumulating a fixed
    number per optimizer step), and the rows of a step split evenly across ranks (a resume that
    would split them unevenly is refused, see `RankLoader.load_state_dict`). So do they in the
    ragged end of a finite epoch, where a finished lane lets a rank's live lanes run steps ahead.
    There a trainer that takes each step whole leaves them having taken fewer rows where lanes
    finished, and that is accepted too where it is what they show: the same steps begun, and every
    lane not finished at one position, the end of those steps. A state of an older save (one
    rank's file left behind) has taken fewer rows, and begun fewer steps or, saved within the same
    step, left a live lane short of the step's end: its lanes would replay what the others' trainer
    already had. Not told apart: an older save that took as many rows (in the ragged end, finished
    lanes can make a rank's rows at an earlier step equal another's), and a rank's file from
    within the step when no other rank has a live lane to set beside it. Ranks whose lanes are all
    finished have nothing left to be out of step with and are left out. The merged count is the
    smallest."""
    live = [state for state in states if state["steps_begun"] is not None]
    steps = sorted({state["steps_begun"] for state in live})
    rows = sorted({state["rows_taken"] for state in live})
    if len(rows) > 1 and (len(steps) > 1 or len(_live_lane_positions(live)) > 1):
        raise CheckpointError(
            f"cannot merge loader states saved at different steps ({', '.join(map(str, steps))}) having taken "
            f"different numbers of rows ({', '.join(map(str, rows))}): every rank's state must come from the same "
            "checkpoint, taken when every rank had handed over as many microbatches (or, once a lane has finished, "
            "at the end of a step)"
        )
    return steps[0] if steps else None


def _live_lane_positions(states: list[dict]) -> set[int]:
    """The positions of the states' lanes that no finite plan has finished."""
    return {
        cursor[2] for state in states for lane, cursor in state["lanes"].items() if int(lane) not in state["finished"]
    }
