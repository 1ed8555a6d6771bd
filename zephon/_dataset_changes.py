"""How the datasets of a recipe differ from a checkpoint's, in words, for the recipe-mismatch refusal.

The recipe's digest of `plan.datasets` covers the whole dataset list, so a refusal could name only
the list: a user resuming a mixture of several datasets, or one whose shards changed, had to guess
which. A state carries a small summary per dataset (`_checkpoint.dataset_summaries`: its name, a
digest per setting of its entry, its shard list among them, and its shards, bytes and records
counted), and this module tells from two such lists which dataset differs and how. The summaries
only explain a refusal: whether a recipe differs is still the digest of the whole list, save for
one case they decide, a corpus moved (`moved_datasets`): the same shards under another directory.
"""

from __future__ import annotations

__all__ = ["describe_dataset_changes", "moved_datasets"]

MAX_NAMED = 4
"""The most datasets a refusal describes; a mixture of hundreds rewritten names the first few."""


def describe_dataset_changes(saved: list[dict], current: list[dict]) -> list[str]:
    """One phrase per dataset that differs, e.g. "dataset 1 ('b'): 12 shards in the checkpoint, 13
    now", at most MAX_NAMED and a count of the rest. Datasets are paired by name where every name
    on both sides is a distinct str (a dataset added or removed then shifts no other), else by index."""
    by_name = all(_distinct_names(side) for side in (saved, current))
    key = (lambda i, s: s["name"]) if by_name else (lambda i, s: i)
    saved_at = {key(i, s): (i, s) for i, s in enumerate(saved)}
    current_at = {key(i, s): (i, s) for i, s in enumerate(current)}
    phrases = []
    for k, (i, now) in current_at.items():
        if k not in saved_at:
            phrases.append(f"{_label(i, now)}: not in the checkpoint")
            continue
        how = _how_it_differs(saved_at[k][1], now)
        if how:
            phrases.append(f"{_label(i, now)}: {how}")
    phrases += [f"{_label(j, then)} of the checkpoint: not in the recipe now"
                for k, (j, then) in saved_at.items() if k not in current_at]
    common_then = [k for k in saved_at if k in current_at]
    common_now = [k for k in current_at if k in saved_at]
    if common_then != common_now:
        phrases.append(f"their order: {_names(common_then)} in the checkpoint, {_names(common_now)} now")
    if len(phrases) > MAX_NAMED:
        phrases = phrases[:MAX_NAMED] + [f"and {len(phrases) - MAX_NAMED} more"]
    return phrases


def moved_datasets(saved: list[dict], current: list[dict]) -> list[str]:
    """Where the dataset lists differ only in where their shards are, one phrase per dataset moved,
    e.g. "dataset 0 ('a'): /mnt/a/corpus/ in the checkpoint, /scratch/corpus/ now"; [] where they
    differ otherwise, or not at all, or a side has no roots (a state of version 6).

    Moved means: the same datasets in the same order, every setting of each entry the same but its
    shard list, and that list the same under the shards' root (`_checkpoint._shards_root`): the
    same names relative to it, in the same order, with the same record counts and sizes. Those are
    all a plan reads of a dataset besides its records (chunks are cut from record counts, dealt by
    a seed of the dataset's name, weighed by the records' bytes and tokens), so the batches of such
    a recipe are those of the checkpoint's, as for the same shards spelled another way (`file://`);
    the content is trusted as far as it is in place: by sizes and counts."""
    if len(saved) != len(current):
        return []
    moved = []
    for index, (then, now) in enumerate(zip(saved, current)):
        if then["name"] != now["name"] or set(then["settings"]) != set(now["settings"]):
            return []
        if any(then["settings"][k] != now["settings"][k] for k in then["settings"] if k != "shards"):
            return []
        if then["settings"].get("shards") == now["settings"].get("shards"):
            continue
        roots = then.get("root"), now.get("root")
        under = then.get("shards_under_root"), now.get("shards_under_root")
        if None in roots or None in under or under[0] != under[1]:
            return []
        moved.append(f"{_label(index, now)}: {roots[0]} in the checkpoint, {roots[1]} now")
    return moved


def _distinct_names(summaries: list[dict]) -> bool:
    names = [s["name"] for s in summaries]
    return None not in names and len(set(names)) == len(names)


def _label(index: int, summary: dict) -> str:
    return f"dataset {index}" + (f" ({summary['name']!r})" if summary["name"] is not None else "")


def _names(names: list) -> str:
    shown = ", ".join(map(repr, names[:MAX_NAMED]))
    return shown + (", …" if len(names) > MAX_NAMED else "")


def _how_it_differs(then: dict, now: dict) -> str:
    """The settings of one dataset's entry that differ, its shard list told by count and size."""
    keys = sorted(set(then["settings"]) | set(now["settings"]))
    changed = [k for k in keys if then["settings"].get(k) != now["settings"].get(k)]
    return ", ".join(_how_shards_differ(then, now) if k == "shards" else f"{k} changed" for k in changed)


def _how_shards_differ(then: dict, now: dict) -> str:
    if then["num_shards"] is None or now["num_shards"] is None:
        return "shard list changed"
    if then["num_shards"] != now["num_shards"]:
        count = then["num_shards"]
        return f"{count} shard{'' if count == 1 else 's'} in the checkpoint, {now['num_shards']} now"
    sizes = [
        f"{then[key]:,} {unit} in the checkpoint, {now[key]:,} now"
        for key, unit in (("nbytes", "bytes"), ("num_records", "records"))
        if then[key] is not None and now[key] is not None and then[key] != now[key]
    ]
    if then.get("root") and now.get("root") and then["root"] != now["root"]:
        sizes.append(f"under {then['root']} in the checkpoint, {now['root']} now")
    return "shard list changed (same count" + ("; " + "; ".join(sizes) if sizes else " and total size") + ")"
