"""merge_states combines rank states and never launders a damaged one, nor ranks out of step."""

from __future__ import annotations

import copy
import json
from collections import Counter
from itertools import islice

import pytest

from tests.harness import (
    GLOBAL_BATCH, MICROBATCH, NUM_LANES, Interrupt, microbatch_digests, microbatches_per_rank_step, text_pipeline,
)
from zephon import CheckpointError, merge_states


@pytest.fixture(scope="module")
def rank_states(make_jsonl_corpus, demo_tokenizer_path):
    pipeline = text_pipeline(make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path)
    states = []
    for rank in range(2):
        with pipeline.shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            it = iter(loader)
            for _ in range(6):
                next(it)
            states.append(loader.state_dict())
    return states


def test_merging_rank_states_covers_every_lane(rank_states):
    merged = merge_states(rank_states)
    assert sorted(map(int, merged["lanes"])) == list(range(8))
    assert merged["steps_begun"] == 1 and merged["finished"] == []  # 6 of a rank's 8 microbatches of step 0
    assert merge_states([merged]) == merged


@pytest.mark.parametrize("as_text", [False, True])
def test_merging_one_state_not_in_a_list_is_refused_saying_so_not_called_invalid_json(rank_states, as_text):
    """merge_states(state) iterated the state's keys and called the first one invalid JSON: a
    good checkpoint reported as a damaged one."""
    import json

    state = json.dumps(rank_states[0]) if as_text else rank_states[0]
    with pytest.raises(CheckpointError, match=r"merge_states takes the states of every rank \(a list\)"):
        merge_states(state)



def _titan_state_dicts(rank_states: list[dict]) -> list[dict]:
    """What each replica's `ZephonDataLoader.state_dict()` returns without a process group: its
    own lanes' state as JSON under `STATE_KEY`."""
    from zephon.integrations.torchtitan import STATE_KEY

    return [{STATE_KEY: json.dumps(state, sort_keys=True)} for state in rank_states]


TITAN_STATE_DICTS_GIVEN = {
    "one_state_dict": lambda state_dicts: state_dicts[0],
    "one_state_dicts_json": lambda state_dicts: json.dumps(state_dicts[0]),
    "a_list_of_state_dicts": lambda state_dicts: state_dicts,
    "a_list_of_their_json": lambda state_dicts: [json.dumps(d) for d in state_dicts],
}


@pytest.mark.parametrize("given", sorted(TITAN_STATE_DICTS_GIVEN))
def test_merging_torchtitan_state_dicts_is_refused_saying_what_to_pass_instead(rank_states, given):
    """A `ZephonDataLoader.state_dict()` (`{'zephon_state': JSON}`), or that dict's JSON, given to
    merge_states was refused in the core's words: one not in a list as "one state" to put in a
    list, which only brought the next refusal, and one in a list as no loader state, "the loader
    state is its 'zephon_state'", not saying that this JSON text is what to load, nor that a
    state_dict() gathered over a process group needs no merge. The refusal names what to pass, and
    what it names merges."""
    given_value = TITAN_STATE_DICTS_GIVEN[given](_titan_state_dicts(rank_states))
    with pytest.raises(CheckpointError) as refusal:
        merge_states(given_value)
    message = str(refusal.value)
    assert "ZephonDataLoader's state_dict()" in message
    assert "local_state_dict()" in message
    assert "json.loads(state_dict['zephon_state'])" in message
    assert "needs no merge" in message
    assert merge_states([json.loads(d["zephon_state"]) for d in _titan_state_dicts(rank_states)]) == merge_states(
        rank_states
    )


def test_merging_refuses_ranks_saved_at_different_steps(make_jsonl_corpus, demo_tokenizer_path):
    """One rank's file from an older checkpoint: its lanes would replay steps the others skip."""
    pipeline = text_pipeline(make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path)
    states = []
    for rank, steps in ((0, 2), (1, 3)):
        with pipeline.shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            it = iter(loader)
            for _ in range(steps * microbatches_per_rank_step(loader)):
                next(it)
            states.append(loader.state_dict())
    assert [state["steps_begun"] for state in states] == [2, 3]
    with pytest.raises(CheckpointError, match=r"saved at different steps \(2, 3\)"):
        merge_states(states)


def test_finished_lanes_and_the_step_survive_a_resume(make_jsonl_corpus, demo_tokenizer_path):
    """In the ragged end of a finite epoch, lanes that ran out lag the others by design: the state
    marks them finished, so ranks saved at one step still merge, and a rank that loads the state
    says the same before its lanes are replayed."""
    make = lambda: text_pipeline(
        make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path, num_epochs=1
    )
    per_rank_step = []
    for rank in range(2):
        with make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            per_rank_step.append(Counter(batch.step for batch in loader))
    full = per_rank_step[0][0]
    step = next(s for s in sorted(per_rank_step[0]) if per_rank_step[0][s] < full) + 1  # after lanes ran out
    states = []
    for rank in range(2):
        with make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            it = iter(loader)
            for _ in range(sum(n for s, n in per_rank_step[rank].items() if s < step)):
                next(it)
            states.append(loader.state_dict())
    merged = merge_states(states)
    assert merged["steps_begun"] == step and 0 < len(merged["finished"]) < 8
    resumed = []
    for rank in range(4):
        with make().shard(rank, 4, global_batch_size=GLOBAL_BATCH) as loader:
            loader.load_state_dict(merged)
            resumed.append(loader.state_dict())
    assert merge_states(resumed) == merged


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda body: body.update(steps_begun=-1), "'steps_begun' must be"),
        (lambda body: body.pop("steps_begun"), "'steps_begun' must be"),
        (lambda body: body.update(finished=[0, 0]), "'finished' must list"),
        (lambda body: body.update(finished=["0"]), "'finished' must list"),
        (lambda body: body.update(finished=[9]), "'finished' must list"),
        (lambda body: body.pop("rows_taken"), "'rows_taken' must be"),
    ],
)
def test_merging_refuses_a_re_signed_state_with_a_malformed_step_or_finished(rank_states, edit, message):
    from zephon._checkpoint import _checksum

    body = copy.deepcopy({k: v for k, v in rank_states[0].items() if k != "checksum"})
    edit(body)
    with pytest.raises(CheckpointError, match=message):
        merge_states([{**body, "checksum": _checksum(body)}, rank_states[1]])


def test_merging_refuses_an_edited_state(rank_states):
    edited = copy.deepcopy(rank_states[0])
    edited["lanes"]["0"][1] += 5
    with pytest.raises(CheckpointError, match="checksum"):
        merge_states([edited, rank_states[1]])


@pytest.mark.parametrize(
    "change, changed", [({"seed": 7}, "operators[2].shuffle.seed, plan.seed"), ({"max_length": 32}, "pack_flat.max_length")]
)
def test_merging_refuses_ranks_of_another_recipe(make_jsonl_corpus, demo_tokenizer_path, rank_states, change, changed):
    """Rank 1's file from a run of another recipe: the merged state would carry rank 0's recipe,
    so the run resuming it takes rank 1's lanes from cursors into other batches, unrefused. The
    refusal names the state and the settings that differ: it said 'recipe' alone."""
    other = text_pipeline(make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path, **change)
    with other.shard(1, 2, global_batch_size=GLOBAL_BATCH) as loader:
        it = iter(loader)
        for _ in range(6):
            next(it)
        foreign = loader.state_dict()
    assert foreign["rows_taken"] == rank_states[1]["rows_taken"], "only the recipe differs"
    with pytest.raises(CheckpointError, match="cannot merge loader states that differ in 'recipe'") as refused:
        merge_states([rank_states[0], foreign])
    assert "state 1 against state 0" in str(refused.value) and changed in str(refused.value)


def test_merging_refuses_overlapping_lanes_with_different_cursors(rank_states):
    other = merge_states(rank_states)
    with pytest.raises(CheckpointError, match="appears in two states"):
        merge_states([rank_states[0], _rebuilt(other, lane="0", skip_delta=1)])


def test_merging_refuses_overlapping_lanes_with_different_ledger_counts(rank_states):
    """A lane given twice must agree on its counts as on its cursor: the last state's ledger used
    to win unseen. Given twice alike (a rank's state beside the merged one), it merges."""
    merged = merge_states(rank_states)
    assert merge_states([rank_states[0], merged]) == merged
    with pytest.raises(CheckpointError, match="lane 0 appears in two states with different ledger counts"):
        merge_states([rank_states[0], _with_one_more_row_counted(merged, lane="0")])


def _with_one_more_row_counted(state, lane):
    """An intact state whose ledger counts one more row on `lane`, its cursor unchanged."""
    from zephon._checkpoint import _checksum

    body = copy.deepcopy({k: v for k, v in state.items() if k != "checksum"})
    rows = body["ledger"][lane]["rows"]
    rows["rows"] = rows.get("rows", 0) + 1
    return {**body, "checksum": _checksum(body)}


def _rebuilt(state, lane, skip_delta):
    """A different but intact state: a cursor moved, the checksum recomputed as Zephon would."""
    from zephon._checkpoint import _checksum

    body = copy.deepcopy({k: v for k, v in state.items() if k != "checksum"})
    body["lanes"][lane][1] += skip_delta
    return {**body, "checksum": _checksum(body)}


def test_ranks_taking_fixed_size_local_batches_merge_in_the_ragged_end(make_jsonl_corpus, demo_tokenizer_path):
    """TorchTitan takes the same number of microbatches from every rank per optimizer step; once a
    lane runs out, its rank's live lanes hand over later steps early, so at one trainer step ranks
    have begun different steps. Every such checkpoint merges, and resumes each rank exactly."""
    make = lambda: text_pipeline(
        make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path, num_epochs=1
    )
    loaders = [make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) for rank in range(2)]
    iterators = [iter(loader) for loader in loaders]
    checkpoints, ahead = [], False
    try:
        while True:
            taken = [list(islice(it, microbatches_per_rank_step(loader))) for loader, it in zip(loaders, iterators)]
            if any(len(batches) < microbatches_per_rank_step(loader) for batches, loader in zip(taken, loaders)):
                break
            states = [loader.state_dict() for loader in loaders]
            ahead = ahead or len({state["steps_begun"] for state in states}) > 1
            checkpoints.append(merge_states(states))
    finally:
        for loader in loaders:
            loader.close()
    assert ahead  # the scenario happened: a rank with a finished lane ran ahead of the other
    resumed_in_all = 0
    for rank in range(2):
        with make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            rest = [batch.digest() for batch in loader]
        with make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            loader.load_state_dict(checkpoints[-1])
            resumed = [batch.digest() for batch in loader]
        assert rest[len(rest) - len(resumed) :] == resumed
        resumed_in_all += len(resumed)
    assert resumed_in_all  # the last checkpoint left microbatches to resume


def test_a_rank_with_a_finished_lane_saved_behind_the_others_is_refused(make_jsonl_corpus, demo_tokenizer_path):
    """A finished lane lets a rank run ahead of the ranks whose lanes all have data, never behind:
    its file from an older checkpoint is still refused."""
    make = lambda: text_pipeline(
        make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path, num_epochs=1
    )
    states = {}
    for rank in range(2):
        with make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            for batch in loader:
                states.setdefault(rank, []).append(loader.state_dict())
    early = next(state for state in states[0] if state["finished"] and state["steps_begun"] is not None)
    later = next(state for state in states[1] if not state["finished"] and state["steps_begun"] > early["steps_begun"])
    with pytest.raises(CheckpointError, match="saved at different steps"):
        merge_states([early, later])


def _saves_at_every_step_end(make) -> list[dict[int, dict]]:
    """Per rank of 2, {steps taken: state} of a trainer taking each step whole and saving after
    every step of a finite epoch (a rank with nothing left of a step saves as it stands)."""
    per_rank_step = []
    for rank in range(2):
        with make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            per_rank_step.append(Counter(batch.step for batch in loader))
    steps = max(max(per_step) for per_step in per_rank_step if per_step) + 1
    saves = []
    for rank, per_step in enumerate(per_rank_step):
        with make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            it = iter(loader)
            saves.append({})
            for step in range(steps):
                for _ in range(per_step[step]):
                    next(it)
                saves[rank][step + 1] = loader.state_dict()
    return saves


def test_every_step_end_save_of_ranks_taking_each_step_whole_merges_and_resumes_on_any_world_size(
    make_jsonl_corpus, demo_tokenizer_path
):
    """Lanes of a finite epoch end at different steps, some with a step's last microbatch (lane 2
    here: its rank hands over nothing after it). A lane is finished the moment its last row is
    handed over, not when its rank's loader next turns to it, which a rank with nothing left never
    does: every save at a step's end merges, and resumed on 1 and on 4 ranks hands over exactly
    the rest of the uninterrupted run."""
    make = lambda: text_pipeline(
        make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path, num_epochs=1
    )
    reference = microbatch_digests(make(), 1, until_step=10**6)
    saves = _saves_at_every_step_end(make)
    rows_per_lane_step = GLOBAL_BATCH // NUM_LANES
    ended_with_a_step = 0
    for steps in sorted(saves[0]):
        merged = merge_states([save[steps] for save in saves])
        ended_with_a_step += sum(
            int(lane) in merged["finished"] and cursor[2] == steps * rows_per_lane_step
            for lane, cursor in merged["lanes"].items()
        )
        rest = {key: digest for key, digest in reference.items() if key[0] >= steps}
        for world in (1, 4):
            assert microbatch_digests(make(), world, until_step=10**6, state=merged) == rest, (steps, world)
    assert ended_with_a_step  # the scenario happened: a save right after a lane's data ended with a step


def _last_segments_records(pipeline, flush_every: int) -> frozenset[str]:
    """The texts of the records in every lane's last segment (the chunks after its last flush
    but the final one) of `pipeline`'s plan."""
    from zephon.work import Flush, lane_plan

    texts = set()
    with pipeline.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        for lane in range(NUM_LANES):
            *items, _final_flush = lane_plan(loader.plan, lane, flush_every)
            for item in reversed(items):
                if isinstance(item, Flush):
                    break
                dataset = loader.plan.datasets[item.dataset]
                texts.update(record["text"] for record in dataset.read_chunk(item, on_error="skip").records)
    return frozenset(texts)


def _lane_records(pipeline, lanes) -> frozenset[str]:
    """The texts of every record that `pipeline`'s plan gives to `lanes`."""
    from zephon.work import Flush, lane_plan

    texts = set()
    with pipeline.shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        for lane in lanes:
            for item in lane_plan(loader.plan, lane, 2):
                if not isinstance(item, Flush):
                    dataset = loader.plan.datasets[item.dataset]
                    texts.update(record["text"] for record in dataset.read_chunk(item, on_error="skip").records)
    return frozenset(texts)


def test_a_lane_that_gives_no_row_at_all_is_found_finished_before_its_rank_ends_a_step_and_every_save_merges(
    make_jsonl_corpus, demo_tokenizer_path
):
    """A filter drops every record of lane 3, rank 0's last lane on 2 ranks: it never gives a row,
    so no row of its own can tell that it is finished. A trainer taking each step whole takes rank
    0's step from lanes 0-2 and never turns the loader to lane 3; its save after step 0 said lane 3
    was live at row 0, like a file from partway through that step, and merge_states refused it
    ("saved at different steps (1) having taken different numbers of rows"). The loader now looks
    past a lane ending its part of a step to the lanes after it that have given nothing yet, so
    every step-end save merges and resumes on 1 and on 4 ranks exactly as the uninterrupted run."""
    corpora = make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12)
    plain = text_pipeline(*corpora, demo_tokenizer_path, num_epochs=1, estimate_tokens=False)
    dropped = _lane_records(plain, [3])
    make = lambda: text_pipeline(
        *corpora, demo_tokenizer_path, num_epochs=1, estimate_tokens=False,
        map_fn=lambda record: None if record["text"] in dropped else record,
    )
    reference = microbatch_digests(make(), 1, until_step=10**6)
    assert {lane for _, lane, _ in reference} == set(range(NUM_LANES)) - {3}  # the scenario: lane 3 gives nothing
    saves = _saves_at_every_step_end(make)
    for steps in sorted(saves[0]):
        merged = merge_states([save[steps] for save in saves])
        assert 3 in merged["finished"], steps
        rest = {key: digest for key, digest in reference.items() if key[0] >= steps}
        for world in (1, 4):
            assert microbatch_digests(make(), world, until_step=10**6, state=merged) == rest, (steps, world)


def test_an_interrupt_while_collating_the_microbatch_that_found_a_later_lane_empty_saves_it_as_live(
    make_jsonl_corpus, demo_tokenizer_path, monkeypatch
):
    """Lane 3 gives no row (a filter drops its records). Rank 0 of 2 finds that out as it takes
    the microbatch ending lane 2's part of step 0 (`_look_past`). Ctrl-C while collating that
    microbatch must leave the state as it was before it: lane 3 still live. The save said lane 3
    was finished, although the trainer had not been given the microbatch that found it out.
    Found by the long fuzz of `test_fuzz_resume.py`. Iterating again hands over the rest, and
    once that microbatch is handed over the save says lane 3 is finished."""
    from zephon import _loader

    corpora = make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12)
    plain = text_pipeline(*corpora, demo_tokenizer_path, num_epochs=1, estimate_tokens=False)
    dropped = _lane_records(plain, [3])
    pipeline = text_pipeline(
        *corpora, demo_tokenizer_path, num_epochs=1, estimate_tokens=False,
        map_fn=lambda record: None if record["text"] in dropped else record,
    )
    key = lambda batch: (batch.step, batch.lane, batch.index, batch.digest())
    with pipeline.shard(0, 2, global_batch_size=GLOBAL_BATCH) as loader:
        uninterrupted = list(map(key, loader))
    finding = next(i for i, (step, lane, _, _) in enumerate(uninterrupted)
                   if lane == 2 and (i + 1 == len(uninterrupted) or uninterrupted[i + 1][0] > step))
    with pipeline.shard(0, 2, global_batch_size=GLOBAL_BATCH) as loader:
        for _ in islice(loader, finding):
            pass
        expected = loader.state_dict()
    assert 3 not in expected["finished"]  # the scenario: no save before that microbatch knows it

    collate, calls = _loader.collate, Counter()

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == finding + 1:
            raise Interrupt
        return collate(*args)

    with pipeline.shard(0, 2, global_batch_size=GLOBAL_BATCH) as loader:
        seen = []
        with monkeypatch.context() as patch:
            patch.setattr(_loader, "collate", interrupted)
            with pytest.raises(Interrupt):
                for batch in loader:
                    seen.append(key(batch))
        assert loader.state_dict() == expected
        rest = iter(loader)
        seen.append(key(next(rest)))
        assert 3 in loader.state_dict()["finished"]
        seen += map(key, rest)
    assert seen == uninterrupted


def test_a_rank_whose_every_lane_gives_no_row_saves_as_finished_though_never_asked_and_every_save_merges(
    make_jsonl_corpus, demo_tokenizer_path
):
    """A filter drops every record of lanes 4-7, all of rank 1's lanes on 2 ranks: a trainer taking
    each step whole never asks rank 1 for anything. Its save said every lane was live at row 0,
    step 0, like a file from before the run began, and merge_states refused it beside rank 0's
    ("saved at different steps (0, 1)"). Its save now says its lanes are finished, as the
    uninterrupted run on 1 rank does, so every step-end save merges, resumes on 1, 2 and 4 ranks
    exactly as the rest of the uninterrupted run, and the ledger ends where that run's does."""
    corpora = make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12)
    plain = text_pipeline(*corpora, demo_tokenizer_path, num_epochs=1, estimate_tokens=False)
    dropped = _lane_records(plain, [4, 5, 6, 7])
    make = lambda: text_pipeline(
        *corpora, demo_tokenizer_path, num_epochs=1, estimate_tokens=False,
        map_fn=lambda record: None if record["text"] in dropped else record,
    )
    reference = microbatch_digests(make(), 1, until_step=10**6)
    assert {lane for _, lane, _ in reference} == {0, 1, 2, 3}  # the scenario: rank 1 of 2 gives nothing
    with make().shard(0, 1, global_batch_size=GLOBAL_BATCH) as loader:
        list(loader)
        whole_ledger = _ledger_totals([loader.stats()])
    saves = _saves_at_every_step_end(make)
    for steps in sorted(saves[0]):
        assert saves[1][steps]["steps_begun"] is None and saves[1][steps]["finished"] == [4, 5, 6, 7], steps
        merged = merge_states([save[steps] for save in saves])
        rest = {key: digest for key, digest in reference.items() if key[0] >= steps}
        for world in (1, 2, 4):
            assert microbatch_digests(make(), world, until_step=10**6, state=merged) == rest, (steps, world)
            assert _ledger_totals(_stats_of_a_resumed_epoch(make(), world, merged)) == whole_ledger, (steps, world)


def _ledger_totals(stats: list[dict]) -> dict:
    """The ledger's record counts per dataset summed over ranks' `stats()`, checked to balance."""
    totals: dict[str, Counter] = {}
    for one in stats:
        for name, entry in one["datasets"].items():
            total = totals.setdefault(name, Counter())
            total.update({key: value for key, value in entry["total"].items() if key != "skipped"})
            total.update({f"skipped:{reason}": n for reason, n in entry["total"]["skipped"].items()})
    for name, total in totals.items():
        dropped = sum(n for key, n in total.items() if key.startswith("skipped:"))
        assert total["read"] == total["emitted"] + total["filtered"] + dropped, (name, total)
    return totals


def _stats_of_a_resumed_epoch(pipeline, world_size: int, state: dict) -> list[dict]:
    stats = []
    for rank in range(world_size):
        with pipeline.shard(rank, world_size, global_batch_size=GLOBAL_BATCH) as loader:
            loader.load_state_dict(state)
            list(loader)
            stats.append(loader.stats())
    return stats


def test_a_lane_whose_last_chunks_give_no_row_is_finished_with_its_last_row_and_every_step_end_save_merges(
    make_jsonl_corpus, demo_tokenizer_path
):
    """A filter drops every record of each lane's last segment, so a lane's last row comes from
    the flush before, with chunks still to read that give none. The lane is finished the moment
    that row is handed over (it used to be found only when its rank's loader next turned to it,
    which a rank with nothing left never does: its step-end save stayed "live" a step behind and
    merge_states refused it). Every save at a step's end merges and resumes on 1 and on 4 ranks
    exactly as the rest of the uninterrupted run."""
    corpora = make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12)
    plain = text_pipeline(*corpora, demo_tokenizer_path, num_epochs=1, estimate_tokens=False)
    dropped = _last_segments_records(plain, flush_every=2)
    assert dropped  # the scenario: some lanes' last segments hold chunks, all of whose records go
    make = lambda: text_pipeline(
        *corpora, demo_tokenizer_path, num_epochs=1, estimate_tokens=False,
        map_fn=lambda record: None if record["text"] in dropped else record,
    )
    reference = microbatch_digests(make(), 1, until_step=10**6)
    saves = _saves_at_every_step_end(make)
    for steps in sorted(saves[0]):
        merged = merge_states([save[steps] for save in saves])
        rest = {key: digest for key, digest in reference.items() if key[0] >= steps}
        for world in (1, 4):
            assert microbatch_digests(make(), world, until_step=10**6, state=merged) == rest, (steps, world)


def test_a_rank_file_from_an_older_save_is_refused_once_every_rank_has_a_finished_lane(
    make_jsonl_corpus, demo_tokenizer_path
):
    """Ranks taking each step whole, saved at every step's end: once every rank has a finished
    lane, one rank's file from the save a step earlier (either rank's) must still be told apart."""
    saves = _saves_at_every_step_end(
        lambda: text_pipeline(
            make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path, num_epochs=1
        )
    )
    both = [
        step for step in sorted(set(saves[0]) & set(saves[1]))
        if all(save[step]["finished"] and save[step]["steps_begun"] is not None for save in saves)
    ]
    assert len(both) >= 2  # the scenario happened: two saves at which every rank had a finished lane
    older, newer = both[0], both[1]
    assert merge_states([saves[0][newer], saves[1][newer]])["steps_begun"] == newer
    for mixed in ([saves[0][older], saves[1][newer]], [saves[0][newer], saves[1][older]]):
        with pytest.raises(CheckpointError, match="saved at different steps"):
            merge_states(mixed)



def test_merging_refuses_ranks_that_took_different_parts_of_one_step(make_jsonl_corpus, demo_tokenizer_path):
    """Both ranks have begun step 0, one with 6 of its 8 microbatches, the other with 3: a save
    from partway through the step beside one from later in it. Before the ragged end, ranks of one
    checkpoint have taken as many rows."""
    pipeline = text_pipeline(make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path)
    states = []
    for rank, taken in ((0, 6), (1, 3)):
        with pipeline.shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            for _ in islice(iter(loader), taken):
                pass
            states.append(loader.state_dict())
    assert [state["steps_begun"] for state in states] == [1, 1]
    with pytest.raises(CheckpointError, match=r"having taken different numbers of rows \(12, 24\)"):
        merge_states(states)


def test_a_rank_file_from_earlier_in_the_same_step_is_refused_in_the_ragged_end(make_jsonl_corpus, demo_tokenizer_path):
    """Ranks taking each step whole, in the ragged end: at a step's end they have begun as many
    steps but taken different numbers of rows (finished lanes gave fewer). Either rank's file from
    partway through that step has begun as many steps too; its live lanes stopping short of the
    step's end, where the other rank's stand, must tell it apart."""
    make = lambda: text_pipeline(
        make_jsonl_corpus(3, 40, 11), make_jsonl_corpus(2, 40, 12), demo_tokenizer_path, num_epochs=1
    )
    saves = _saves_at_every_step_end(make)
    one_microbatch = MICROBATCH * 2  # rows on all ranks, as a rank of 2 counts them
    steps = next(
        s for s in sorted(saves[0])[1:]
        if len({save[s]["rows_taken"] for save in saves}) > 1
        and all(save[s]["steps_begun"] is not None for save in saves)
        and all(save[s]["rows_taken"] - save[s - 1]["rows_taken"] > one_microbatch for save in saves)
    )
    assert merge_states([save[steps] for save in saves])["steps_begun"] == steps
    for rank in range(2):
        with make().shard(rank, 2, global_batch_size=GLOBAL_BATCH) as loader:
            for batch in loader:
                if batch.step == steps - 1:  # the first microbatch of the last step taken
                    break
            partway = loader.state_dict()
        assert partway["steps_begun"] == steps and partway["rows_taken"] < saves[rank][steps]["rows_taken"]
        mixed = [partway if r == rank else save[steps] for r, save in enumerate(saves)]
        with pytest.raises(CheckpointError, match="saved at different steps"):
            merge_states(mixed)
