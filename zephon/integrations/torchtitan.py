"""A TorchTitan data loader on Zephon lanes, built from a `DataRecipe`.

Targets TorchTitan 0.3.0 (`torchtitan.components.dataloader.BaseDataLoader`). TorchTitan's
contract, read from that release:

- the trainer builds the loader with `config.dataloader.build(dp_world_size=, dp_rank=,
  tokenizer=, seq_len=, local_batch_size=, snapshot_every_n_steps=)`;
- each `next()` on the loader's iterator yields `(input_dict, labels)`: `input_dict["input"]` a
  (local_batch_size, seq_len) token tensor, every other key of `input_dict` (here `positions`)
  passed to the model's forward; the trainer calls `next()` `gradient_accumulation_steps` times per
  optimizer step, where gradient_accumulation_steps = global_batch_size / (local_batch_size ×
  dp_world_size);
- the checkpointer stores the loader (a `Stateful`) under the key `dataloader` of a DCP checkpoint:
  `state_dict()` on every rank at save, `state_dict()` (as a template) then `load_state_dict()` at
  load. TorchTitan's own loaders write one key per data-parallel rank and refuse a different
  data-parallel degree on load.

`ZephonDataLoader.state_dict()` instead writes ONE key holding the state of EVERY lane (gathered
over the process group), identical on all ranks: DCP saves it once, every rank of a later run —
on any data-parallel degree that divides the lane count — reads it and picks its own lanes.

When `torchtitan` is importable the loader subclasses its `BaseDataLoader` and its `Config`
subclasses `BaseDataLoader.Config`; otherwise it implements the same contract on its own, so this
module imports without torch or torchtitan.
"""

from __future__ import annotations

import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from itertools import islice
from typing import Any, Self

import numpy as np

from .._accepted_changes import accepted_keys
from .._batch import Batch
from .._checkpoint import STATE_FORMAT, TORCHTITAN_STATE_KEY
from .._dataset_scope import check_dataset_names
from .._errors import (CheckpointError, ConfigurationError, RecipeMismatchError, StateLacksLanesError, check_count,
                       check_field_name)
from .._job_log import config_level
from .._loader import check_layout
from .._packing import PackFlatOp
from .._pipeline import Pipeline
from ..distributed import gather_state, group_size, rank_and_world_size
from ..work._estimation import COUNTS
from ._recipe_fields import data_recipe_fields

__all__ = ["STATE_KEY", "TORCHTITAN_VERSION", "DataRecipe", "ZephonDataLoader", "build_zephon_dataloader"]

log = logging.getLogger("zephon.integrations.torchtitan")

TORCHTITAN_VERSION = "0.3.0"
"""The TorchTitan release whose data-loader contract this module was written against."""

STATE_KEY = TORCHTITAN_STATE_KEY
"""The one key of `ZephonDataLoader.state_dict()`: the JSON state of every lane (named in the core,
whose refusals of this dict given for a loader state name it)."""

_MAKE_ANOTHER = (
    "build a new ZephonDataLoader and, to go on where this one stopped, give it load_state_dict(state) of "
    "a state_dict() this one gave (it still gives one once closed)"
)
"""What a closed ZephonDataLoader's refusal tells its caller to do: the rank loader's own advice,
a loader from `pipeline.shard(...)`, is not one a TorchTitan trainer can use."""

try:
    from torchtitan.components.dataloader import BaseDataLoader as _TitanBase
except ImportError:  # torchtitan (or torch) is optional: implement the contract without it
    _TitanBase = None


@dataclass(frozen=True)
class DataRecipe:
    """Everything that decides the data, plus the performance knobs to run it with.

    Recipe (must stay the same across a resume; a change is refused naming the field): `datasets`,
    `mixture`, `tokenizer`, `text_field`, `prompt_field`, `chat_field` and the other `chat_` fields,
    `bos`, `eos`, `max_length`, `packing`, `overlong`, `shuffle_buffer`, `seed`, `num_lanes`,
    `microbatch_size`, `flush_every_chunks`, `records_per_chunk`, `token_estimation`,
    `mixture_count`, `num_epochs` — and the global batch size, which the loader takes separately.
    Performance (free to change on resume): `parallelism`, `runner`, `cache`, `scan_cache`,
    `seekable_copies`. `scan_cache`, a local directory, keeps each shard's scan
    (`Dataset.from_path(scan_cache=)`): every rank plans for itself at every start, and without it
    each one reads every JSON Lines or text shard through to count its records. `seekable_copies`
    (with `scan_cache`) keeps there a copy in zstd frames of each such shard, or WebDataset tar,
    written as one gzip or zstd stream, which chunk reads enter near their records
    (`Dataset.from_path(seekable_copies=)`).

    `datasets` are `(name, url)` pairs (any URL `zephon.io.Dataset.from_path` reads); a mapping is
    accepted and kept in its order. `mixture` maps names to token shares (normalised; None: equal).
    `num_epochs` is one count of passes for every dataset, or maps names to counts, kept as pairs
    like `mixture` (None: endless; a count may be a fraction of a pass, see
    `StaticMixtureWorkSource`).
    `num_lanes` should be a common multiple of every data-parallel size the run may use.
    `prompt_field` names the text each record's `text_field` is conditioned on and not trained on
    (`tokenize(prompt_field=...)`; TRL's prompt-completion records: `prompt_field="prompt",
    text_field="completion"`): its ids come first and are labelled -100; a record without it is
    skipped as `missing_field`.
    `chat_field` names a field of chats (`{"role", "content"}` messages) to train on instead of
    `text_field`'s text: rendered with the chat template in the tokenizer's directory
    (`Pipeline.render_chat`, `pip install 'zephon[chat]'`) and tokenized as segments, the
    assistant's turns learned and the rest labelled -100. `chat_today` ("YYYY-MM-DD") is the date
    a template that reads the clock writes (Llama 3.1's "Today Date"; render_chat's `today`), and
    `chat_template_kwargs` the template's own switches (`{"enable_thinking": False}`, Qwen3's;
    render_chat's `template_kwargs`), kept as pairs like `mixture`. A record's own fields are handed
    to the template where named: `chat_tools_field` (the tools' schemas, `tools`; a chat with tools
    is rendered with the directory's `tool_use` template where it has one), `chat_documents_field`
    (a retrieval's documents, `documents`) and `chat_template_kwargs_field` (its own switches over
    the recipe's: TRL's `chat_template_kwargs` column). `chat_template_name` names the one of the
    directory's templates every chat is rendered with. Chats stored as ShareGPT's (`{"from": "human",
    "value": ...}`) are read with `chat_keys=("from", "value")` (the role's key and the content's)
    and `chat_roles={"human": "user", "gpt": "assistant"}`, kept as pairs; `chat_learned_roles`
    (default the assistant's) and `chat_on_rewrite` ("learn_last": where the template rewrites
    earlier turns, as a reasoning model's drops their thinking, the last answer alone is learned)
    are render_chat's. `chat_datasets` names the datasets that hold chats where others hold
    plain text (`text_field`, learned whole): a mixture of pretraining text and chats. The `chat_`
    fields need `chat_field`.
    `overlong` is what becomes of a document longer than `max_length` (`pack_flat`'s: "split"
    across rows, "truncate" to its first `max_length` tokens, "keep_end" to its last, or "skip";
    chats are best truncated or skipped). `mixture_count="learned"` makes `mixture` shares of the
    tokens a loss learns rather than of every token (`TokenEstimation(count=...)`): chats mixed
    with text get their weight of the training signal.
    """

    datasets: tuple[tuple[str, str], ...]
    tokenizer: str
    mixture: tuple[tuple[str, float], ...] | None = None
    text_field: str = "text"
    prompt_field: str | None = None
    chat_field: str | None = None
    chat_today: str | None = None
    chat_template_kwargs: tuple[tuple[str, object], ...] | None = None
    chat_tools_field: str | None = None
    chat_documents_field: str | None = None
    chat_template_kwargs_field: str | None = None
    chat_template_name: str | None = None
    chat_keys: tuple[str, str] | None = None
    chat_roles: tuple[tuple[str, str], ...] | None = None
    chat_learned_roles: tuple[str, ...] | None = None
    chat_on_rewrite: str | None = None
    chat_datasets: tuple[str, ...] | None = None
    bos: str | None = None
    eos: str | None = None
    max_length: int = 2048
    packing: str = "wrap"
    overlong: str = "split"
    shuffle_buffer: int = 1024
    seed: int = 0
    num_lanes: int = 32
    microbatch_size: int = 1
    flush_every_chunks: int = 16
    records_per_chunk: int = 128
    token_estimation: bool = True
    mixture_count: str = "tokens"
    num_epochs: int | float | tuple[tuple[str, int | float], ...] | None = None
    parallelism: int = 1
    runner: str = "auto"
    cache: bool = False
    scan_cache: str | None = None
    seekable_copies: bool = False

    def __post_init__(self) -> None:
        datasets = self.datasets.items() if isinstance(self.datasets, Mapping) else self.datasets
        try:
            datasets = tuple((str(name), str(url)) for name, url in datasets)
        except (TypeError, ValueError):
            raise ConfigurationError(f"DataRecipe.datasets must be (name, url) pairs, got {self.datasets!r}") from None
        if not datasets:
            raise ConfigurationError("DataRecipe.datasets is empty")
        object.__setattr__(self, "datasets", datasets)
        if self.mixture is not None:
            mixture = self.mixture.items() if isinstance(self.mixture, Mapping) else self.mixture
            try:
                mixture = tuple((str(name), float(weight)) for name, weight in mixture)
            except (TypeError, ValueError):  # float()'s own error names neither the field nor the dataset
                raise ConfigurationError(
                    f"DataRecipe.mixture must map dataset names to token shares, got {self.mixture!r}"
                ) from None
            object.__setattr__(self, "mixture", mixture)
        if isinstance(self.num_epochs, (Mapping, list, tuple)):  # a count is the work source's to check
            epochs = self.num_epochs.items() if isinstance(self.num_epochs, Mapping) else self.num_epochs
            try:
                epochs = tuple((str(name), count) for name, count in epochs)
            except (TypeError, ValueError):
                raise ConfigurationError(
                    f"DataRecipe.num_epochs must be a count, or map dataset names to counts, got {self.num_epochs!r}"
                ) from None
            object.__setattr__(self, "num_epochs", epochs)
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigurationError(f"DataRecipe.tokenizer must name a tokenizer, got {self.tokenizer!r}")
        self._settle_chat_fields([name for name, _ in datasets])
        for name in ("token_estimation", "cache", "seekable_copies"):  # "no" is true: it would switch on what it names
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"DataRecipe.{name} must be True or False, got {getattr(self, name)!r}")
        if self.mixture_count not in COUNTS:
            raise ConfigurationError(f"DataRecipe.mixture_count must be one of {COUNTS}, got {self.mixture_count!r}")
        if self.mixture_count != "tokens" and not self.token_estimation:
            raise ConfigurationError(f"DataRecipe.mixture_count={self.mixture_count!r} is measured by "
                                     "token_estimation, which is False: without it the mixture is of records")

    def _settle_chat_fields(self, dataset_names: list[str]) -> None:
        """Refuse the `chat_` fields without `chat_field`, those that are no such field or dataset
        names, and a `prompt_field` where no record is text; keep mappings and lists as tuples,
        hashable, as the recipe's other mappings."""
        if self.chat_field is not None:
            check_field_name(self.chat_field, "DataRecipe.chat_field")
        if self.prompt_field is not None:
            check_field_name(self.prompt_field, "DataRecipe.prompt_field")
            if self.chat_field is not None and self.chat_datasets is None:
                raise ConfigurationError(
                    "DataRecipe.prompt_field is for the records of text_field, and with chat_field every dataset "
                    "holds chats: name those that do in chat_datasets, or leave prompt_field out")
        for name in _CHAT_OPTIONS:
            if getattr(self, name) is not None and self.chat_field is None:
                raise ConfigurationError(f"DataRecipe.{name} is for chats: give chat_field, the field of the chats")
            if name.endswith("_field") and getattr(self, name) is not None:
                check_field_name(getattr(self, name), f"DataRecipe.{name}")
        for name in ("chat_template_kwargs", "chat_roles"):
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, tuple(getattr(self, name).items()))
        if isinstance(self.chat_learned_roles, list):
            object.__setattr__(self, "chat_learned_roles", tuple(self.chat_learned_roles))
        if self.chat_datasets is not None:
            chats = check_dataset_names(self.chat_datasets, "DataRecipe", "chat_datasets")
            unknown = sorted(set(chats) - set(dataset_names))
            if unknown:
                raise ConfigurationError(f"DataRecipe.chat_datasets names {unknown}, no dataset of the recipe's "
                                         f"{dataset_names}")
            object.__setattr__(self, "chat_datasets", chats)
        if self.chat_keys is not None:
            keys = tuple(self.chat_keys) if isinstance(self.chat_keys, (list, tuple)) else ()
            if len(keys) != 2 or not all(isinstance(key, str) and key for key in keys):
                raise ConfigurationError(f"DataRecipe.chat_keys must be the messages' (role key, content key), as "
                                         f"('from', 'value') for ShareGPT's, got {self.chat_keys!r}")
            object.__setattr__(self, "chat_keys", keys)

    def pipeline(self) -> Pipeline:
        """The Zephon pipeline this recipe describes: (render the chats →) tokenize → pack → shuffle
        → batch."""
        from ..io import Dataset
        from ..work import StaticMixtureWorkSource, TokenEstimation

        cache = {"enabled": True} if self.cache else None
        source = StaticMixtureWorkSource(
            datasets=[
                Dataset.from_path(name, url, cache=cache, scan_cache=self.scan_cache,
                                  seekable_copies=self.seekable_copies)
                for name, url in self.datasets
            ],
            mixture=dict(self.mixture) if self.mixture is not None else None,
            token_estimation=TokenEstimation(count=self.mixture_count) if self.token_estimation else None,
            seed=self.seed,
            records_per_chunk=self.records_per_chunk,
            num_epochs=dict(self.num_epochs) if isinstance(self.num_epochs, tuple) else self.num_epochs,
        )
        pipeline = Pipeline(source).options(num_lanes=self.num_lanes, runner=self.runner,
                                            flush_every_chunks=self.flush_every_chunks)
        tokenize = {"parallelism": self.parallelism, "bos": self.bos, "eos": self.eos}
        text = {"field": self.text_field, "prompt_field": self.prompt_field}
        if self.chat_field is None:
            pipeline = pipeline.tokenize(self.tokenizer, **text, **tokenize)
        else:  # a tokenizer.json's chat template is in its directory's tokenizer_config.json
            directory = os.path.dirname(self.tokenizer) if self.tokenizer.endswith(".json") else self.tokenizer
            chats = self.chat_datasets
            pipeline = (pipeline.render_chat(directory, field=self.chat_field, parallelism=self.parallelism,
                                             datasets=chats, **self._render_chat_options())
                        .tokenize(self.tokenizer, field="segments", segments=True, datasets=chats, **tokenize))
            texts = [name for name, _ in self.datasets if chats is not None and name not in chats]
            if texts:
                pipeline = pipeline.tokenize(self.tokenizer, **text, datasets=texts, **tokenize)
        return (
            pipeline
            .pack_flat(max_length=self.max_length, algorithm=self.packing, overlong=self.overlong)
            .shuffle(buffer_size=self.shuffle_buffer, seed=self.seed)
            .batch(microbatch_size=self.microbatch_size)
        )

    def _render_chat_options(self) -> dict:
        """render_chat's keyword arguments for the `chat_` fields given (its defaults for the rest)."""
        options = {"today": self.chat_today, "tools_field": self.chat_tools_field,
                   "documents_field": self.chat_documents_field, "template_name": self.chat_template_name,
                   "template_kwargs_field": self.chat_template_kwargs_field}
        if self.chat_template_kwargs is not None:
            options["template_kwargs"] = dict(self.chat_template_kwargs)
        if self.chat_keys is not None:
            options["role_key"], options["content_key"] = self.chat_keys
        if self.chat_roles is not None:
            options["roles"] = dict(self.chat_roles)
        if self.chat_learned_roles is not None:
            options["learned_roles"] = self.chat_learned_roles
        if self.chat_on_rewrite is not None:
            options["on_rewrite"] = self.chat_on_rewrite
        return options


_DATA_RECIPE_FIELDS = tuple(field.name for field in dataclass_fields(DataRecipe))
"""DataRecipe's fields in the order it declares them, the order a refusal names the changed ones in."""

_CHAT_OPTIONS = tuple(name for name in _DATA_RECIPE_FIELDS if name.startswith("chat_") and name != "chat_field")
"""The DataRecipe fields that say how `chat_field`'s chats are rendered: nothing without it."""


class _DataLoaderContract(ABC):
    """TorchTitan's `BaseDataLoader` contract where torchtitan is not installed: an iterable of
    `(input_dict, labels)` that is `Stateful` (torch's `Stateful` is a structural protocol, so DCP
    accepts it as one)."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[dict, Any]]: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _check_titan_layout(
    num_lanes: int, microbatch_size: int, dp_rank: int, dp_world_size: int, global_batch_size: int, local_batch_size: int
) -> None:
    """Fail at construction, naming the numbers, on a layout that cannot split evenly: the core's
    lane checks, then TorchTitan's local-batch ones."""
    check_layout(num_lanes, dp_world_size, dp_rank, global_batch_size, microbatch_size)
    local_step = global_batch_size // dp_world_size
    if local_batch_size < 1 or local_step % local_batch_size:
        raise ConfigurationError(
            f"local_batch_size={local_batch_size} does not divide the {local_step} rows each of the "
            f"dp_world_size={dp_world_size} replicas takes per step (global_batch_size={global_batch_size}): "
            f"TorchTitan needs global_batch_size = local_batch_size × dp_world_size × gradient accumulation steps"
        )
    if local_batch_size % microbatch_size:
        raise ConfigurationError(
            f"local_batch_size={local_batch_size} is not a multiple of the recipe's microbatch_size="
            f"{microbatch_size}: each yielded batch must hold whole microbatches (choose a microbatch_size "
            f"that divides every local batch size the run may use, e.g. 1)"
        )


_Base = _TitanBase if _TitanBase is not None else _DataLoaderContract


class ZephonDataLoader(_Base):
    """One data-parallel replica's share of a Zephon stream, in TorchTitan's loader contract.

    Each global step of `global_batch_size` rows takes the same rows whatever `dp_world_size` is;
    this replica yields its lanes' rows of every step in canonical (lane, microbatch) order, in
    `gradient_accumulation_steps` batches of `local_batch_size` rows:
    `({"input": input_ids, "positions": position_ids}, labels)`, int64 tensors of shape
    (local_batch_size, max_length). Labels are next-token aligned already (IGNORE_INDEX = -100 at
    document ends and padding), as TorchTitan's own text loader yields them; `positions` restart at
    each document, from which TorchTitan's `flex` and `varlen` attention build block-causal masks
    (with `sdpa` it builds none, and the documents packed in a row attend to one another).

    `recipe` is a `DataRecipe` or a ready text `zephon.Pipeline` (packed by `pack_flat`, ending in
    `.batch`; a multimodal packer's rows are refused, their image patches and `mrope_position_ids`
    having no place here). `dp_rank` and `dp_world_size` default to torch.distributed's (the
    world's). `group` is the process group over which `state_dict()` gathers the lanes (default:
    the world, which also works when tensor/pipeline parallel peers hold identical copies); a
    group smaller than the world needs `dp_rank` and `dp_world_size` given, since its own rank need
    not be the data-parallel one. `accept_changes` names the recipe keys in which a checkpoint
    loaded may differ from `recipe`, on purpose (the trainer calls `load_state_dict` with the state
    alone): see `RankLoader.load_state_dict`; a key named that did not change (a restart from the new
    recipe's own checkpoint) is warned of, not refused.

    With a finite plan (`num_epochs`), yields are exact until a lane runs out; the last one may be
    short, then iteration stops, on each replica at a step of its own. TorchTitan 0.3.0 does not
    agree the end between ranks: the replica that runs out leaves its loop while the others wait in
    the step's all-reduce, and fail. Give TorchTitan an endless plan and `training.steps`.

    Iterate it from one thread. `local_state_dict()` may be called from another (an asynchronous
    checkpointer): it waits for the local batch in progress. `state_dict()` gathers over the
    process group, a collective: call it where the job's other collectives are issued. `close()`
    (or `with`) stops its workers.
    """

    if _TitanBase is not None:

        @dataclass(kw_only=True, slots=True)
        class Config(_TitanBase.Config):
            """`Trainer.Config.dataloader` for a Zephon stream (see the integrations README)."""

            recipe: DataRecipe | None = None
            global_batch_size: int = -1
            """Rows per optimizer step; set it to `training.global_batch_size`. -1: local × dp (then a
            resume on another data-parallel size is refused, the global batch having changed)."""
            emit_positions: bool = True
            accept_changes: tuple[str, ...] = ()
            """Recipe keys whose change the checkpoint loaded may have (see `ZephonDataLoader`)."""

            def build(self, **kwargs):
                return build_zephon_dataloader(self, **kwargs)

    else:

        @dataclass(kw_only=True)
        class Config:
            """`Trainer.Config.dataloader` for a Zephon stream (see the integrations README)."""

            dataset: str = ""
            dataset_path: str | None = None
            recipe: DataRecipe | None = None
            global_batch_size: int = -1
            emit_positions: bool = True
            accept_changes: tuple[str, ...] = ()

            def build(self, **kwargs):
                return build_zephon_dataloader(self, **kwargs)

    def __init__(
        self,
        recipe: DataRecipe | Pipeline,
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
        global_batch_size: int | None = None,
        *,
        local_batch_size: int | None = None,
        group=None,
        emit_positions: bool = True,
        accept_changes: Iterable[str] = (),
    ) -> None:
        pipeline = recipe.pipeline() if isinstance(recipe, DataRecipe) else recipe
        if not isinstance(pipeline, Pipeline):
            raise ConfigurationError(f"ZephonDataLoader needs a DataRecipe or a zephon.Pipeline, got {type(recipe).__name__}")
        packers = pipeline.packers()
        if packers and not isinstance(packers[0], PackFlatOp):
            # TorchTitan's batch is (input, positions) and labels: image patches would be dropped.
            raise ConfigurationError(
                f"ZephonDataLoader yields TorchTitan's text batches, but this pipeline packs with "
                f"{packers[0].name}, whose rows carry fields it has no place for (image patches and "
                "their positions); iterate pipeline.shard(...) and pass Batch.to_training() to the model"
            )
        if group is not None and (dp_rank is None or dp_world_size is None):
            _check_group_is_the_world(group, dp_rank, dp_world_size)
        dp_rank, dp_world_size = rank_and_world_size(dp_rank, dp_world_size)
        num_lanes, m = pipeline.settings.num_lanes, pipeline.microbatch_size
        if global_batch_size is None:
            raise ConfigurationError("ZephonDataLoader needs global_batch_size (rows per optimizer step)")
        # Counts, as the core takes them: "8" and 8.0 are refused by name, not met by a TypeError or rounded.
        global_batch_size = check_count(global_batch_size, "global_batch_size")
        if local_batch_size is not None:
            local_batch_size = check_count(local_batch_size, "local_batch_size")
        else:
            local_batch_size = global_batch_size // dp_world_size if global_batch_size % dp_world_size == 0 else 0
        _check_titan_layout(num_lanes, m, dp_rank, dp_world_size, global_batch_size, local_batch_size)
        # state_dict() gathers over `group`, which holds every replica only if their number divides
        # its size (each replica being one or more of its ranks): checked now, not at the first save.
        gathered = group_size(group)
        if gathered is not None and gathered % dp_world_size:
            raise ConfigurationError(
                f"dp_world_size={dp_world_size} replicas cannot all be among the {gathered} ranks of the process "
                "group that state_dict() gathers the lanes over: give the data-parallel size of this job (TorchTitan's "
                "dp_world_size) or the group that holds every replica"
            )
        self.recipe = recipe if isinstance(recipe, DataRecipe) else None
        # plain ints: a NumPy integer would reach the trainer's step arithmetic and its logs
        self.dp_rank, self.dp_world_size = int(dp_rank), int(dp_world_size)
        self.global_batch_size, self.local_batch_size = int(global_batch_size), int(local_batch_size)
        self.gradient_accumulation_steps = self.global_batch_size // (self.local_batch_size * self.dp_world_size)
        self.emit_positions = emit_positions
        self.accept_changes = accepted_keys(accept_changes)
        self.last_microbatches: tuple[Batch, ...] = ()
        """The Zephon microbatches behind the most recent yield (for barcodes: `Batch.digest()`)."""
        self._group = group
        self._loader = pipeline.shard(dp_rank, dp_world_size, global_batch_size=global_batch_size)
        self._warned_partway = False
        self._warned_alone = False

    def __reduce__(self):
        """Refused with this loader's own way to go: its rank loader's refusal says to call
        pipeline.shard(...) in the other process, whose loader a TorchTitan trainer cannot use."""
        raise ConfigurationError(
            "a ZephonDataLoader cannot be pickled (a spawn or forkserver process is sent its objects by pickle): "
            "its rank loader's lanes, runner and threads belong to this process. Send the DataRecipe or the "
            "Pipeline, which pickle, and build a ZephonDataLoader in that process"
        )

    @property
    def loader(self):
        """The underlying `zephon.RankLoader`."""
        return self._loader

    @property
    def lanes(self) -> list[int]:
        return self._loader.lanes

    def __iter__(self) -> Iterator[tuple[dict, Any]]:
        per_yield = self.local_batch_size // self._loader.microbatch_size
        microbatches = iter(self._loader)
        while True:
            # Taken as one (see `RankLoader.take_as_one`): an exception before the yield hands
            # the local batch's microbatches back, and no save or load on another thread lands
            # partway through it.
            try:
                group, batch = self._loader.take_as_one(lambda: self._local_batch(microbatches, per_yield))
            except ConfigurationError:
                if self._loader.closed:
                    # The rank loader's refusal says to make a loader with pipeline.shard(...).
                    raise ConfigurationError(f"this ZephonDataLoader is closed; {_MAKE_ANOTHER}") from None
                raise
            if not group:
                return
            self.last_microbatches = group
            yield batch
            if len(group) < per_yield:
                return

    def _local_batch(self, microbatches: Iterator[Batch], per_yield: int) -> tuple[tuple[Batch, ...], Any]:
        """The next local batch's microbatches and their tensors (none and None at the end)."""
        group = tuple(islice(microbatches, per_yield))  # never pulls a microbatch it does not yield
        return group, (self._collate(group) if group else None)

    def _collate(self, group: tuple[Batch, ...]) -> tuple[dict, Any]:
        import torch

        def stacked(name: str):
            return torch.from_numpy(np.concatenate([b.tokens[name] for b in group])).long()

        inputs = {"input": stacked("input_ids")}
        if self.emit_positions:
            inputs["positions"] = stacked("position_ids")
        return inputs, stacked("labels")

    # -- Stateful ----------------------------------------------------------------------------
    def local_state_dict(self) -> dict:
        """This replica's lanes only (plain JSON); `zephon.merge_states` combines replicas."""
        return self._loader.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """`{STATE_KEY: JSON}` covering every lane: gathered over the process group when one is
        initialised (every rank must call this, as DCP does), else this replica's own lanes, which
        resume it on this data-parallel size only (warned of at the first such save; for another,
        merge every replica's `local_state_dict()` with `zephon.merge_states`).

        A JSON string rather than nested containers: DCP stores it as one opaque value, identical
        on every rank, so it is written once and read back by any number of ranks.
        """
        state = gather_state(self._loader, self._group)
        self._warn_of_a_state_of_this_replica_alone(state)
        self._warn_of_a_save_partway_through_a_step(state)
        return {STATE_KEY: json.dumps(state, sort_keys=True)}

    def _warn_of_a_state_of_this_replica_alone(self, state: dict) -> None:
        """Warn, once per loader, of a `state_dict()` that holds this replica's lanes only (no
        process group to gather over, and other replicas): it resumes this replica on this
        data-parallel size, but a resume on another finds lanes missing. Said at the save, where
        the way to a state of every lane can still be taken, not only at that resume."""
        if self._warned_alone or len(state["lanes"]) == state["num_lanes"]:
            return
        self._warned_alone = True
        log.log(
            config_level(logging.WARNING, self.dp_rank),
            "state_dict() of replica %d of %d holds its own lanes only (%d of %d): no torch.distributed process "
            "group is initialised to gather the others' over. To resume on another data-parallel size, initialise "
            "one before saving, or save every replica's local_state_dict() and load zephon.merge_states of them",
            self.dp_rank, self.dp_world_size, len(state["lanes"]), state["num_lanes"],
        )

    def _warn_of_a_save_partway_through_a_step(self, state: dict) -> None:
        """Warn, once per loader, of a state saved partway through a Zephon step.

        TorchTitan saves after whole optimizer steps, so there such a save means that
        `training.global_batch_size` is not this loader's: the trainer does not pass its own to
        `build`, and nothing else tells. Said at the first such save, not left to a resume on
        another data-parallel size, which refuses the state without a word of the cause. A
        finite plan's ragged end, where lanes end at steps of their own, is left out."""
        rows = state.get("rows_taken")
        if self._warned_partway or rows is None or state.get("finished") or rows % self.global_batch_size == 0:
            return
        self._warned_partway = True
        log.log(
            config_level(logging.WARNING, self.dp_rank),
            "state_dict() saved partway through Zephon step %d (%d of its %d rows taken): where the trainer "
            "saves after whole optimizer steps (TorchTitan), its global batch size is not this loader's "
            "global_batch_size=%d; set training.global_batch_size to it. Such a state resumes on this "
            "data-parallel size or on fewer replicas, and is refused on others",
            rows // self.global_batch_size, rows % self.global_batch_size, self.global_batch_size,
            self.global_batch_size,
        )

    def load_state_dict(self, state_dict: Mapping[str, Any] | str | bytes) -> None:
        """Take up this replica's lanes from a state saved on any data-parallel size.

        Takes what `state_dict()` returns (through DCP or not), and a Zephon loader state as
        `local_state_dict()` and `zephon.merge_states` give it, or its JSON text or bytes (what
        `state_dict()` holds under `STATE_KEY`): a plain loop that merges its replicas' states loads
        the merge as it is. An empty mapping is accepted (TorchTitan's convention for "nothing
        saved"); anything else that is no mapping (None: a checkpoint's key that was missing) is
        refused rather than taken for nothing saved, as are another loader's state, a changed recipe
        and a state missing this replica's lanes.
        """
        if isinstance(state_dict, (str, bytes)):
            self._take_up(state_dict)
            return
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(
                f"not a loader state: got {type(state_dict).__name__}; load_state_dict takes what state_dict() "
                f"returned ({{{STATE_KEY!r}: JSON}}), a Zephon loader state (merge_states) or its JSON, "
                "and {} for nothing saved"
            )
        if state_dict.get("format") == STATE_FORMAT:
            self._take_up(dict(state_dict))
            return
        if not state_dict:
            return
        if STATE_KEY not in state_dict:
            raise CheckpointError(
                f"the dataloader state has keys {sorted(state_dict)} but no {STATE_KEY!r}: it was not written "
                f"by ZephonDataLoader (a TorchTitan loader writes one 'dp_rank_N' key per rank)"
            )
        self._take_up(state_dict[STATE_KEY])

    def _take_up(self, state) -> None:
        """Load a Zephon loader state; a refusal of another recipe also names the DataRecipe fields
        behind the recipe keys it names (a changed mixture is `plan.schedule` there), and one of a
        state lacking this replica's lanes names this loader's ways to a state of every lane: the
        core's advice (`merge_states` the states, or `gather_state`) refuses a `state_dict()` and
        this loader, so following it took a second refusal."""
        try:
            self._loader.load_state_dict(state, accept_changes=self.accept_changes)
        except StateLacksLanesError as refusal:
            raise StateLacksLanesError(
                f"the loader state lacks lanes {refusal.lanes} of this replica (dp_rank {self.dp_rank} of "
                f"{self.dp_world_size}): it holds another replica's lanes alone, a state_dict() saved without a "
                "torch.distributed process group (or a local_state_dict()). Resume from a state of every lane: "
                "save with the process group initialised, where state_dict() gathers every replica's lanes (as under "
                "TorchTitan), or save every replica's local_state_dict() and give each replica "
                "zephon.merge_states(those) (or its JSON)",
                refusal.lanes,
            ) from None
        except RecipeMismatchError as refusal:
            fields = data_recipe_fields(refusal.changed, _DATA_RECIPE_FIELDS) if self.recipe is not None else []
            if not fields:
                raise
            raise RecipeMismatchError(
                f"{refusal} DataRecipe fields that changed: {', '.join(fields)}.", refusal.changed
            ) from refusal

    # -- lifecycle -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """The rank loader's `stats()`. Its `"wait"` counts microbatches, `local_batch_size /
        microbatch_size` of them per batch this loader yields, and the time spent taking them;
        stacking them into tensors is not in it, nor is a wait for a save or load on another
        thread before a batch (this loader holds the rank loader over each batch, so it waits
        before asking for the first microbatch, and `"checkpoint_wait_s"` stays near zero).
        Microbatches that an interrupted yield hands back (see `__iter__`) keep the waits they
        were counted with, and count new ones when they are taken again."""
        return self._loader.stats()

    def close(self) -> None:
        self._loader.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_group_is_the_world(group, dp_rank, dp_world_size) -> None:
    """Refuse a `group` smaller than the world beside a missing `dp_rank` or `dp_world_size`.

    Those default to the whole world's rank and size, not the group's: with a data-parallel group
    of 2 in a world of 8 the loader took itself for one of 8 replicas and failed saying that 8
    replicas cannot all be among the group's 2 ranks, asking for a size the caller had not given. The group's
    own rank is no answer either: `group` names the ranks `state_dict()` gathers over, which may
    hold tensor- or pipeline-parallel peers with identical copies, so it need not be this
    replica's data-parallel rank. A group as large as the world changes nothing and is taken."""
    gathered, world = group_size(group), group_size()
    if gathered != world:
        raise ConfigurationError(
            f"ZephonDataLoader(group=...) holds {gathered} of the {world} ranks, but dp_rank={dp_rank!r} and "
            f"dp_world_size={dp_world_size!r} would default to the whole world's rank and size, not this "
            "replica's data-parallel ones: give dp_rank and dp_world_size (TorchTitan's) with a group"
        )


def build_zephon_dataloader(
    config,
    *,
    dp_world_size: int,
    dp_rank: int,
    local_batch_size: int,
    seq_len: int | None = None,
    tokenizer=None,
    snapshot_every_n_steps: int | None = None,
    **other,
) -> ZephonDataLoader:
    """What TorchTitan 0.3.0's trainer calls through `config.dataloader.build(...)`.

    `seq_len` (`training.seq_len`) must equal the recipe's `max_length`; TorchTitan's `dataset` and
    `dataset_path` fields must stay unset (the recipe names the data). `tokenizer` (TorchTitan's,
    from `hf_assets_path`) is not used: the recipe names its own, whose vocabulary must fit the
    model. `snapshot_every_n_steps` is not needed: a Zephon state is a few cursors, cheap at any step.
    """
    recipe = getattr(config, "recipe", None)
    if recipe is None:
        raise ConfigurationError("dataloader.recipe is not set: give ZephonDataLoader.Config a DataRecipe")
    # TorchTitan's own fields, which the Config inherits: set (`--dataloader.dataset c4`), they
    # were ignored and the job trained on the recipe's datasets while its config named another.
    for name, unset in (("dataset", ""), ("dataset_path", None)):
        value = getattr(config, name, unset)
        if value != unset:
            raise ConfigurationError(
                f"dataloader.{name}={value!r} is not read by ZephonDataLoader: the data is the recipe's "
                "datasets (DataRecipe.datasets); leave it unset"
            )
    # Both warnings below are about the job's configuration, the same on every rank: said once.
    level = config_level(logging.WARNING, dp_rank)
    if other:
        log.log(level, "ZephonDataLoader ignores unknown build arguments %s", sorted(other))
    # A ready Pipeline (which ZephonDataLoader takes too) has its row length in its packer.
    packers = recipe.packers() if isinstance(recipe, Pipeline) else []
    max_length = recipe.max_length if isinstance(recipe, DataRecipe) else packers[0].max_length if packers else None
    if seq_len is not None and max_length is not None and seq_len != max_length:
        raise ConfigurationError(
            f"training.seq_len={seq_len} differs from the data recipe's max_length={max_length}; make them equal"
        )
    global_batch_size = config.global_batch_size
    if global_batch_size is None or global_batch_size < 0:
        global_batch_size = local_batch_size * dp_world_size
        log.log(
            level,
            "dataloader.global_batch_size is not set: using local_batch_size × dp_world_size = %d. A resume on "
            "another data-parallel size will be refused (the global batch size is part of the recipe); set it "
            "to training.global_batch_size to make the run elastic", global_batch_size,
        )
    return ZephonDataLoader(
        recipe,
        dp_rank,
        dp_world_size,
        global_batch_size,
        local_batch_size=local_batch_size,
        emit_positions=getattr(config, "emit_positions", True),
        accept_changes=getattr(config, "accept_changes", ()),
    )
