"""Loader state: cursors per lane, a recipe fingerprint, a version — plain JSON, never pickle.

A lane's cursor is (segment, skip, position): replay the lane from the start of `segment`, drop
the first `skip` rows it produces (the trainer already consumed them), and count the lane's rows
from `position`. Beside it travel the lane's settled ledger counts (see `_ledger.py`). Nothing
buffered is ever saved; loading a state cannot execute code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping

from ._errors import CheckpointError, RecipeMismatchError
from ._sha256 import sha256

__all__ = ["LaneCursor", "STATE_FORMAT", "STATE_VERSION", "make_state", "read_state", "merge_states"]

STATE_FORMAT = "zephon.loader_state"
STATE_VERSION = 3  # 2: recipe digests per setting (plan.seed, operators[i].op.setting); 3: zephon._random draws


@dataclass
class LaneCursor:
    """Where a lane stands. `position` counts rows handed to the trainer, padding included."""

    segment: int = 0
    skip: int = 0
    position: int = 0

    def as_json(self) -> list[int]:
        return [self.segment, self.skip, self.position]


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def recipe_digests(recipe: Mapping) -> dict[str, str]:
    """A short digest per recipe setting, so a mismatch can be named without storing it all.

    Settings are named one level below the recipe's top: `plan.seed`, `plan.mixture`,
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
    return {k: sha256(canonical_json(v).encode()).hexdigest()[:16] for k, v in named.items()}


def _checksum(body: Mapping) -> str:
    return sha256(canonical_json(body).encode()).hexdigest()


def make_state(
    recipe: Mapping, lanes: Mapping[int, LaneCursor], num_lanes: int, ledgers: Mapping[int, dict]
) -> dict:
    body = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "num_lanes": num_lanes,
        "recipe": recipe_digests(recipe),
        "lanes": {str(lane): cursor.as_json() for lane, cursor in sorted(lanes.items())},
        "ledger": {str(lane): ledgers[lane] for lane in sorted(ledgers)},
    }
    return {**body, "checksum": _checksum(body)}


def _intact(state: object) -> dict:
    """The state as a dict, after checking that it is a Zephon state of this version whose checksum
    matches its content; raises CheckpointError naming what is wrong otherwise."""
    if isinstance(state, (str, bytes)):
        try:
            state = json.loads(state)
        except ValueError as exc:
            raise CheckpointError(f"loader state is not valid JSON: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError("not a Zephon loader state (missing or wrong 'format' field)")
    if state.get("version") != STATE_VERSION:
        raise CheckpointError(
            f"loader state version {state.get('version')!r} is not supported (this Zephon reads {STATE_VERSION})"
        )
    body = {k: v for k, v in state.items() if k != "checksum"}
    if state.get("checksum") != _checksum(body):
        raise CheckpointError("loader state checksum does not match its content (truncated or edited)")
    return state


def read_state(state: object, recipe: Mapping, num_lanes: int) -> tuple[dict[int, LaneCursor], dict[int, dict]]:
    """Validate a state against the current recipe; return its cursors and ledger counts by lane."""
    state = _intact(state)
    _check_shape(state)
    saved = state["recipe"]
    current = recipe_digests(recipe)
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if changed:
        raise RecipeMismatchError(
            "the checkpoint was taken with a different recipe; changed: " + ", ".join(changed)
            + ". Performance settings (runner, parallelism, world size) may change on resume; the recipe may not."
        )
    if state["num_lanes"] != num_lanes:
        raise RecipeMismatchError(f"num_lanes changed: checkpoint has {state['num_lanes']}, pipeline has {num_lanes}")
    try:
        cursors = {int(lane): LaneCursor(*map(int, cursor)) for lane, cursor in state["lanes"].items()}
        ledgers = {int(lane): dict(counts) for lane, counts in state.get("ledger", {}).items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"malformed lane cursors in loader state: {exc}") from None
    return cursors, ledgers


def _check_shape(state: dict) -> None:
    """The shape `make_state` writes. A checksum only proves the content is what was signed: a
    state edited and signed again by hand must still not reach the loader as a KeyError or a
    negative cursor."""
    if not isinstance(state.get("recipe"), dict) or not _is_count(state.get("num_lanes")):
        raise CheckpointError("malformed loader state: 'recipe' must be an object and 'num_lanes' an integer")
    lanes, ledger = state.get("lanes"), state.get("ledger", {})
    if not isinstance(lanes, dict) or not all(
        isinstance(cursor, list) and len(cursor) == 3 and all(map(_is_count, cursor)) for cursor in lanes.values()
    ):
        raise CheckpointError("malformed lane cursors in loader state: each lane needs 3 non-negative integers")
    if not isinstance(ledger, dict) or not all(_is_lane_ledger(counts) for counts in ledger.values()):
        raise CheckpointError("malformed ledger in loader state: each lane needs its record and row counts")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_lane_ledger(counts: object) -> bool:
    """{"records": {dataset: {name: count | {reason: count}}}, "rows": {name: count}}."""
    if not isinstance(counts, dict) or set(counts) - {"records", "rows"}:
        return False
    records, rows = counts.get("records", {}), counts.get("rows", {})
    if not isinstance(records, dict) or not isinstance(rows, dict) or not all(map(_is_count, rows.values())):
        return False
    return all(
        isinstance(by_name, dict)
        and all(_is_count(v) or (isinstance(v, dict) and all(map(_is_count, v.values()))) for v in by_name.values())
        for by_name in records.values()
    )


def merge_states(states: Iterable[Mapping]) -> dict:
    """Combine the states of all ranks into one covering every lane (ranks own disjoint lanes).

    Each input must be intact (its checksum is verified): merging never launders an edited state.
    """
    states = [_intact(state) for state in states]
    for state in states:
        _check_shape(state)
    if not states:
        raise CheckpointError("merge_states needs at least one state")
    first = states[0]
    lanes: dict[str, list[int]] = {}
    ledger: dict[str, dict] = {}
    for state in states:
        for key in ("format", "version", "num_lanes", "recipe"):
            if state.get(key) != first.get(key):
                raise CheckpointError(f"cannot merge loader states that differ in {key!r}")
        for lane, cursor in state["lanes"].items():
            if lane in lanes and lanes[lane] != cursor:
                raise CheckpointError(f"lane {lane} appears in two states with different cursors")
            lanes[lane] = cursor
        ledger.update(state.get("ledger", {}))
    body = {k: first[k] for k in ("format", "version", "num_lanes", "recipe")}
    body["lanes"] = dict(sorted(lanes.items(), key=lambda kv: int(kv[0])))
    body["ledger"] = dict(sorted(ledger.items(), key=lambda kv: int(kv[0])))
    return {**body, "checksum": _checksum(body)}
