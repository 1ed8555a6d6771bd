"""A rank loader handed to a torch DataLoader, as a PyTorch user wraps any stream.

With `num_workers=N` the DataLoader forks N workers, each iterating its own copy of the loader: with
N ≥ 2 every microbatch reached the trainer N times, silently; with one worker the trainer's loader
never moved, so its state_dict() saved a checkpoint that replayed the data. Both are refused,
naming the worker; a loader each worker builds for itself still works. A loader pickled (a spawn or
forkserver worker, the default start method on Linux from Python 3.14) is refused saying to send
the Pipeline instead, not with pickle's word about a local function deep inside it.
"""

from __future__ import annotations

import pickle

import pytest

from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from zephon import ConfigurationError

TAKEN = 6  # microbatches the trainer takes: a few steps of the 4-lane harness pipeline


def _pipeline(tmp_path):
    return text_pipeline(jsonl_dataset(tmp_path / "d"), runner="inline", num_epochs=None)


def _positions(batches) -> list[tuple[int, int, int]]:
    return [(b.step, b.lane, b.index) for b in batches]


def _dataloader(stream, num_workers: int):
    torch_data = pytest.importorskip("torch.utils.data")

    class Stream(torch_data.IterableDataset):
        def __init__(self, stream) -> None:
            self.stream = stream

        def __iter__(self):
            return iter(self.stream() if callable(self.stream) else self.stream)

    return torch_data.DataLoader(Stream(stream), batch_size=None, num_workers=num_workers)


def _direct(pipeline) -> list[tuple[int, int, int]]:
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        return _positions(b for b, _ in zip(loader, range(TAKEN)))


def test_a_loader_copied_into_several_dataloader_workers_is_refused_not_handed_over_once_per_worker(tmp_path):
    pipeline = _pipeline(tmp_path)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        batches = _dataloader(loader, num_workers=2)
        with pytest.raises(ConfigurationError) as refused:
            list(zip(batches, range(TAKEN)))
    message = str(refused.value)
    assert "torch DataLoader worker" in message and "of 2" in message
    assert "each microbatch 2 times" in message and "num_workers=0" in message


def test_a_loader_copied_into_one_dataloader_worker_is_refused_since_the_trainers_state_would_not_move(tmp_path):
    pipeline = _pipeline(tmp_path)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(ConfigurationError) as refused:
            list(zip(_dataloader(loader, num_workers=1), range(TAKEN)))
        assert loader.state_dict()["rows_taken"] == 0  # what a checkpoint saved here would have resumed from
    message = str(refused.value)
    assert "torch DataLoader worker 0 of 1" in message and "state_dict()" in message and "num_workers=0" in message


def test_a_loader_each_dataloader_worker_builds_for_itself_is_not_refused(tmp_path):
    pipeline = _pipeline(tmp_path)
    direct = _direct(pipeline)

    def own_loader():
        with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
            yield from zip(loader, range(TAKEN))

    taken = _positions(b for b, _ in _dataloader(own_loader, num_workers=2))
    assert sorted(taken) == sorted(direct * 2)  # each worker's own loader of one rank: as the trainer asked


def test_pickling_a_loader_says_to_send_the_pipeline_and_shard_it_there(tmp_path):
    pipeline = _pipeline(tmp_path)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(ConfigurationError) as refused:
            pickle.dumps(loader)
    assert "pipeline.shard(" in str(refused.value) and "pickle" in str(refused.value)
    assert pickle.loads(pickle.dumps(pipeline)).settings == pipeline.settings  # what to send instead


def test_an_iteration_begun_before_the_dataloader_forked_is_refused_in_its_workers_too(tmp_path):
    """The copy was checked at an iteration's first next() only: an iterator the trainer had taken
    a microbatch from (to look at one) went on unrefused in every worker, and the trainer got each
    later microbatch twice, silently."""
    pipeline = _pipeline(tmp_path)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        begun = iter(loader)
        next(begun)
        with pytest.raises(ConfigurationError) as refused:
            list(zip(_dataloader(begun, num_workers=2), range(TAKEN)))
    assert "torch DataLoader worker" in str(refused.value) and "each microbatch 2 times" in str(refused.value)


def test_a_dataloader_given_the_loader_itself_is_told_why_it_has_no_length_and_what_to_do(tmp_path):
    """`DataLoader(loader)` takes the loader for a map-style dataset and asks its len() at the
    first `iter()`: the trainer, who called no len(), met Python's bare "object of type
    'RankLoader' has no len()". `list()` and truth testing, which look for a length, still work."""
    torch_data = pytest.importorskip("torch.utils.data")
    pipeline = _pipeline(tmp_path)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(TypeError) as refused:
            iter(torch_data.DataLoader(loader, batch_size=None))
        assert loader
        assert len(list(zip(loader, range(TAKEN)))) == TAKEN
    message = str(refused.value)
    assert "has no len()" in message and "DataLoader" in message and "iterate the loader itself" in message
    assert "to_training()" in message


def test_len_of_a_loader_says_why_it_has_none(tmp_path):
    pipeline = _pipeline(tmp_path)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(TypeError, match="num_epochs=None"):
            len(loader)
