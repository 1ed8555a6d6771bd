"""The Pipeline: an immutable description of the path from stored records to training batches.

Building a pipeline never reads data or starts workers; `shard()` (or iterating) does. Each
builder method returns a new Pipeline, so a recipe can be shared and extended safely.
"""

from __future__ import annotations

import copy
import datetime
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

from ._chat import RenderChatOp, check_chat_options
from ._chat_render import check_template_kwargs, check_today
from ._dataset_scope import check_dataset_names
from ._entry_points import find
from ._errors import ConfigurationError, check_count, check_field_name
from ._loss_mask import LOSS_MASK_FIELD, check_loss_mask_options
from ._markers import OFFSETS_FIELD, check_marker
from ._packing import PackFlatOp
from ._preference import PackPairsOp
from ._record_ops import FilterOp, MapOp, RecordOperator, TokenizeOp, check_parallelism, check_user_function
from ._runner import Runner
from ._shuffle import ShuffleOp
from ._tokenizer import SPLIT_SPECIAL_TOKENS
from .io._dataset import check_io_options
from .work import WorkSource

__all__ = ["Pipeline", "PipelineOptions", "BatchOp"]

ON_ERROR = ("skip", "raise")


@dataclass(frozen=True)
class PipelineOptions:
    """Settings of a pipeline.

    Recipe (must stay fixed across a resume): `num_lanes`, `flush_every_chunks`.
    Performance (free to change on resume): `runner`, `prefetch`, `read_parallelism`.
    `prefetch` is the chunks each lane keeps in flight; None: 8 per worker of the widest stage when
    the plan's chunks are small (4 × workers × the mean chunk ≤ 1 MiB of raw bytes), else 4 per worker.
    Policy: `on_error` ("skip": count bad records and go on; "raise": fail on the first one training
    reaches; the token estimate's sample, read when `shard()` plans, skips them under either).
    Storage: `io_options` (`cache`, `retries`, `retry_delay`; see `Dataset.with_io_options`) apply to
    every dataset's chunk reads while a loader iterates, e.g. `{"cache": {"enabled": True}}` keeps
    remote shards on local disk. The token estimate's sample, read by the work source when `shard()`
    builds a loader, is read with each Dataset's own settings (those given to `Dataset.from_path`).
    """

    num_lanes: int = 8
    flush_every_chunks: int = 16
    runner: str | Runner | Callable[[], Runner] = "auto"
    prefetch: int | None = None
    read_parallelism: int | None = None
    on_error: str = "skip"
    io_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_lanes", "flush_every_chunks"):
            object.__setattr__(self, name, check_count(getattr(self, name), name))
        for name in ("prefetch", "read_parallelism"):  # None: Zephon's default
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_count(getattr(self, name), name))
        if not isinstance(self.io_options, dict):
            raise ConfigurationError(f"io_options must be a dict, got {self.io_options!r}")
        # A copy: the caller's dict, changed later, would change these settings under a built pipeline.
        object.__setattr__(self, "io_options", copy.deepcopy(self.io_options))
        check_io_options(self.io_options)
        if self.on_error not in ON_ERROR:
            raise ConfigurationError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")


@dataclass(frozen=True)
class BatchOp:
    """The last operator: rows are handed to the trainer `microbatch_size` at a time. Part of the
    recipe (a resume with another size is refused): it decides how a step's rows are cut into
    microbatches, and where a lane's cursor stands within a step."""

    microbatch_size: int
    name: str = "batch"
    kind = "batch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "microbatch_size", check_count(self.microbatch_size, "batch: microbatch_size"))

    def fingerprint(self, default_pad_id: int) -> dict:
        return {"op": self.name, "microbatch_size": self.microbatch_size}


class Pipeline:
    """Operators from a WorkSource's records to microbatches.

    Thread-safety: a Pipeline is immutable and may be shared; the loaders it creates are not.
    """

    def __init__(self, source: WorkSource, *, operators: tuple = (), options: PipelineOptions | None = None) -> None:
        # Checked here: a Dataset or a path would otherwise fail at shard() as a bare AttributeError.
        if not isinstance(source, WorkSource):
            raise ConfigurationError(
                f"a Pipeline needs a work source (e.g. StaticMixtureWorkSource([dataset, ...])), got {source!r}"
            )
        if options is not None and not isinstance(options, PipelineOptions):
            raise ConfigurationError(f"options must be a PipelineOptions (or use .options(...)), got {options!r}")
        self.source = source
        self.operators = tuple(operators)
        self.settings = options or PipelineOptions()

    def _with(self, op) -> Pipeline:
        if self.operators and self.operators[-1].kind == "batch":
            # Said as what to do: "shuffle: batch must be the last operator" read as a rule broken
            # by the shuffle, and named neither where it goes nor that the pipeline already ends.
            instead = "the pipeline has one already" if op.kind == "batch" else f"add {op.name} before .batch(...)"
            raise ConfigurationError(f"cannot add {op.name} after batch: batch must be the last operator; {instead}")
        return Pipeline(self.source, operators=self.operators + (op,), options=self.settings)

    def options(self, **settings: Any) -> Pipeline:
        """Set pipeline options (see PipelineOptions); unknown names are an error."""
        known = set(PipelineOptions.__dataclass_fields__)
        unknown = set(settings) - known
        if unknown:
            raise ConfigurationError(f"unknown pipeline options {sorted(unknown)}; known: {sorted(known)}")
        return Pipeline(self.source, operators=self.operators, options=replace(self.settings, **settings))

    def map(self, fn: Callable[[dict], dict | None], *, parallelism: int = 1,
            datasets: str | list[str] | None = None) -> Pipeline:
        """Append `fn(record) -> record | None` (None drops the record as filtered). What `fn`
        returns is copied before later stages change it, so it may return one dict for many
        records (a default, a cache): each gets its own copy, on every runner. `datasets` (None:
        every one) names the datasets of the mixture whose records it maps; the others' pass
        unchanged (`tokenize` has the same)."""
        return self._with(MapOp(check_user_function(fn, "map"), check_parallelism(parallelism, "map"),
                                check_dataset_names(datasets, "map")))

    def filter(self, fn: Callable[[dict], bool], *, parallelism: int = 1,
               datasets: str | list[str] | None = None) -> Pipeline:
        """Append `fn(record) -> bool`: a record it returns false for is dropped, counted as
        `filtered`. A coroutine or generator returned (an `async def`, a `yield`) is refused, since
        it is true whatever it holds and would keep every record. `datasets` as `map`'s."""
        return self._with(FilterOp(check_user_function(fn, "filter"), check_parallelism(parallelism, "filter"),
                                   check_dataset_names(datasets, "filter")))

    def tokenize(
        self,
        tokenizer_id: str | os.PathLike,
        field: str = "text",
        *,
        parallelism: int = 1,
        bos: str | None = None,
        eos: str | None = None,
        output_field: str = "input_ids",
        keep_field: bool = False,
        split_special_tokens: bool = SPLIT_SPECIAL_TOKENS,
        marker: str | None = None,
        offsets_field: str = OFFSETS_FIELD,
        prompt_field: str | None = None,
        loss_mask_field: str = LOSS_MASK_FIELD,
        segments: bool = False,
        datasets: str | list[str] | None = None,
    ) -> Pipeline:
        """Append the tokenizer: `record[field]` (a str) becomes `record[output_field]`, int32 ids,
        with `bos`/`eos` (token strings) around them.

        `split_special_tokens` (default True): a special token's string inside the text (`<|eos|>`
        in a web page about tokenizers) is tokenized as the text it is, so a document cannot put a
        control id (an EOS or the pad id, under a label that trains on it) in the middle of itself;
        False matches it as the special token, `tokenizers`' own default.

        `marker` (None: off) is the string by which a text says where an image goes, LLaVA's
        `"<image>"`: the text is split at each, the marker's text dropped (a newline after it is
        text, kept), and the offset of each marker among the ids, BOS counted (the position of the
        next text token), written to `record[offsets_field]` as a tuple, empty for a text without
        one. `pack_multimodal` reads that field by default (its `offsets_field`, the same default)
        and places image k there; a record whose markers are not as many as its images is skipped
        there as `marker_count_mismatch`. The pieces are tokenized apart, so ids at a marker's seam
        can differ from those of the whole text (` dog<image>.` is ` dog` and `.`, never one
        token), as in LLaVA's own `tokenizer_image_token`.

        `prompt_field` (None: off) names a text the document is conditioned on and not trained on
        (a question, PaliGemma's task prefix): the ids are BOS, the prompt's, the text's, EOS, and
        `record[loss_mask_field]` is one bool per id, False over BOS and the prompt, which the
        packers read (a label of IGNORE_INDEX before each such token). The two texts are encoded
        apart, as a processor encodes a prompt and its answer, so put the space or newline between
        them in the prompt. A marker may stand in either; its offset counts the prompt's ids. A
        record whose prompt is missing or not a str is skipped (`missing_field`, `not_text`); an
        empty prompt trains on the whole text.

        `segments=True` reads `record[field]` as a list of [text, learned] pairs (a chat's turns, as
        a map writes them with the model's chat template: `[["USER: <image>\\nWhat is it?
        ASSISTANT:", False], [" A dog.</s>", True], ...]`): the ids are BOS, the texts' joined and
        encoded whole (as the chat is encoded at inference; no seam where a segment ends), EOS, and
        `loss_mask_field` marks each id learned where any character it holds is learned (as
        transformers' assistant mask), EOS as the last segment. A segment may be a triple, [text,
        learned, True], for a chat template's own text (`render_chat` writes them): the special
        tokens' strings in it are the control tokens they name, while in the other segments (the
        messages' contents) they stay text as `split_special_tokens` says. A record whose field is
        not such a list is skipped (`not_segments`), one whose texts are all blank as
        `empty_document`.

        `datasets` (None: every one) names the datasets of the mixture whose records this stage
        tokenizes; the others' pass it unchanged, so that a mixture of text and chats tokenizes
        each its own way: `.render_chat(..., datasets="chats").tokenize(..., field="segments",
        segments=True, datasets="chats").tokenize(..., field="text", datasets="web")`. A name that
        is no dataset of the work source is refused when the pipeline is sharded.
        """
        if isinstance(tokenizer_id, os.PathLike):
            tokenizer_id = os.fspath(tokenizer_id)
        # Checked here, not where a record first meets them: "no" would keep the field as True does.
        for name, flag in (("keep_field", keep_field), ("split_special_tokens", split_special_tokens)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"tokenize: {name} must be True or False, got {flag!r}")
        for name, value in (("field", field), ("output_field", output_field), ("offsets_field", offsets_field)):
            check_field_name(value, f"tokenize: {name}")
        check_marker(marker, offsets_field, field, output_field)
        check_loss_mask_options(prompt_field, segments, loss_mask_field,
                                (field, output_field, *((offsets_field,) if marker else ())))
        for name, token in (("bos", bos), ("eos", eos)):
            if token is not None and not isinstance(token, str):  # an id (bos=1) failed as a bare TypeError
                raise ConfigurationError(f"tokenize: {name} must be a token's string or None, got {token!r}")
        op = TokenizeOp(
            tokenizer_id, field, check_parallelism(parallelism, "tokenize"), bos, eos, output_field, keep_field,
            split_special_tokens, marker, offsets_field, prompt_field, loss_mask_field, segments,
            check_dataset_names(datasets, "tokenize"),
        )
        handle = op.handle()  # fail now, not in a worker, if the tokenizer or its special tokens are missing
        handle.token_id(bos)
        handle.token_id(eos)
        return self._with(op)

    def render_chat(
        self,
        tokenizer_dir: str | os.PathLike,
        field: str = "messages",
        *,
        output_field: str = "segments",
        learned_roles: tuple[str, ...] | list[str] = ("assistant",),
        parallelism: int = 1,
        keep_field: bool = False,
        role_key: str = "role",
        content_key: str = "content",
        roles: dict[str, str] | None = None,
        tools_field: str | None = None,
        on_rewrite: str = "skip",
        today: str | datetime.date | None = None,
        template_kwargs: dict[str, Any] | None = None,
        documents_field: str | None = None,
        template_name: str | None = None,
        template_kwargs_field: str | None = None,
        datasets: str | list[str] | None = None,
    ) -> Pipeline:
        """Append a chat renderer: `record[field]`, a list of {"role": str, "content": str}
        messages (or contents as lists of parts, `[{"type": "image"}, {"type": "text", "text":
        str}]`, handed to the template as processors' templates take them), becomes
        `record[output_field]`, the segments `tokenize(field=output_field, segments=True)` reads,
        as the chat template of the tokenizer in `tokenizer_dir` writes the chat (transformers'
        `apply_chat_template`; `pip install 'zephon[chat]'`). The messages of `learned_roles` are
        learned: an assistant's from past its generation prompt to the end of its turn as the
        template writes it, another role's whole text. Chats stored as ShareGPT's
        and LLaVA-Instruct's `{"from": "human", "value": ...}` are read with `role_key="from",
        content_key="value", roles={"human": "user", "gpt": "assistant"}` (the roles renamed to the
        template's before `learned_roles` is asked). Tool-calling chats (OpenAI's: an assistant's
        `tool_calls`, its content None or left out, the results as `tool` messages) keep every key
        of their messages for the template, and `tools_field` names a record's field of the
        tools' JSON schemas (a list, or the list as a JSON str) handed to the template as
        `tools`; a record without it offers none, one whose field holds no such list is skipped
        (`not_tools`); `documents_field` names one of documents (a retrieval's, `[{"title": ...,
        "text": ...}]`, or that list as a JSON str) handed to it as `documents`, as RAG templates
        read them (`not_documents`). The template's own text is flagged so that its control tokens are matched
        while a content quoting one keeps it as text (`zephon._chat`). The template is read now,
        and its text enters the recipe. A directory of several named templates (Hermes' and
        Command-R's `tool_use`, `rag`) renders a chat with tools with its `tool_use` one and others
        with its default, as `apply_chat_template` picks them, or every chat with the one
        `template_name` names. Give the tokenizer no `bos` where the template writes the
        BOS itself. A template that reads the clock (`strftime_now`: Llama 3.1's "Today Date")
        writes `today` ("YYYY-MM-DD", midnight), the recipe's date, so that a chat is the same ids
        on any day; without it such a template is refused. `template_kwargs` are the switches the
        template reads beside the chat, as `apply_chat_template`'s keyword arguments
        (`{"enable_thinking": False}`, Qwen3's), JSON values; they enter the recipe.
        `template_kwargs_field` names a record's own (a dict, or one as a JSON str; TRL's
        `chat_template_kwargs` column), over `template_kwargs` (`not_template_kwargs`).
        `datasets` (None: every one) names the datasets of chats in a mixture; the others' records
        pass unchanged, to be tokenized as text (`tokenize(datasets=...)`).

        The texts are found by rendering the chat's prefixes: one where the learned text starts or
        ends, and one more for each assistant turn's generation prompt, about two a turn of a user
        and an assistant. transformers hands the template the chat once (as `apply_chat_template`
        does) and its compiled template renders the prefixes (`zephon._chat_render`). A chat the
        template refuses is skipped (`chat_template_error`), as is one it writes otherwise once
        later messages follow (`chat_template_not_prefix`; with `on_rewrite="learn_last"` such a
        chat, as a reasoning model's template that drops the thinking of turns before the last
        question, learns its last message alone, the chat before it the context the template gives
        it), one quoting a control token in a content it does not write as given
        (`chat_content_not_found`) and one that is no list of messages (`not_messages`).
        """
        tokenizer_dir, roles = check_chat_options(tokenizer_dir, field, output_field, learned_roles, role_key,
                                                  content_key, roles, tools_field, on_rewrite, documents_field,
                                                  template_name, template_kwargs_field)
        if not isinstance(keep_field, bool):
            raise ConfigurationError(f"render_chat: keep_field must be True or False, got {keep_field!r}")
        op = RenderChatOp(tokenizer_dir, field, output_field, tuple(learned_roles),
                          check_parallelism(parallelism, "render_chat"), keep_field, role_key, content_key, roles,
                          tools_field, on_rewrite, check_today(today), check_template_kwargs(template_kwargs),
                          documents_field, template_name, template_kwargs_field,
                          check_dataset_names(datasets, "render_chat"))
        op.templates  # read now: no template, one that does not compile or a clock without today is refused here
        return self._with(op)

    def pack_flat(
        self,
        max_length: int,
        algorithm: str = "wrap",
        *,
        pad_id: int | None = None,
        field: str = "input_ids",
        max_open_rows: int = 16,
        loss_mask_field: str = LOSS_MASK_FIELD,
        overlong: str = "split",
        document_values: Sequence[str] = (),
    ) -> Pipeline:
        """Append the text packer: "wrap" cuts documents at every max_length tokens, "first_fit"
        places each whole document in the first open row with room (at most `max_open_rows` open;
        wrap keeps one and ignores it); a document longer than a row is first cut into max_length
        pieces that each fill a row alone, the rest placed first-fit. "pad" packs nothing: each
        document (each max_length piece of a longer one) is a row of its own, padded. A record
        whose `field` is absent, not token ids, or empty is skipped (`missing_field`, `not_tokens`,
        `empty_document`).

        A record that holds `loss_mask_field` (one bool, or 0/1, per id: what `tokenize(prompt_field=)`
        writes) trains only on the tokens it marks True: the label before every other token is
        IGNORE_INDEX. One that does not trains on every token; one whose mask is not one flag per
        id is skipped (`bad_loss_mask`).

        `overlong` says what becomes of a document longer than a row: "split" (the default) cuts it
        into pieces as above, whose later ones train without what came before them (a chat cut
        mid-answer); "truncate" keeps its first `max_length` tokens (its last one then has no
        label), "keep_end" its last (TRL's `truncation_mode="keep_end"`: the answer kept, the start
        of its prompt dropped), counted per dataset in `stats()` as `truncated` and
        `truncated_tokens`; "skip" skips it (`document_too_long`).

        `document_values` names number fields of the records (a KTO label, a reward, a loss weight)
        that each row carries one per document: the ragged field of each name holds, row by row,
        the value of the record of each document (`document_ids == d`), float64, in the order
        `zephon.preference.document_log_probs` gives the documents. A record without one is
        skipped (`missing_field`), one whose value is no finite number as `bad_document_value`."""
        return self._with(PackFlatOp(max_length, algorithm, pad_id, field, max_open_rows, loss_mask_field, overlong,
                                     document_values))

    def pack_pairs(
        self,
        max_length: int,
        algorithm: str = "first_fit",
        *,
        pad_id: int | None = None,
        chosen_field: str = "chosen_ids",
        rejected_field: str = "rejected_ids",
        chosen_loss_mask_field: str = "chosen_loss_mask",
        rejected_loss_mask_field: str = "rejected_loss_mask",
        max_open_rows: int = 16,
        overlong: str = "skip",
        document_values: Sequence[str] = (),
    ) -> Pipeline:
        """Append the preference-pair packer (DPO and its kin): each record's chosen and rejected
        documents, the ids two `tokenize` stages write to `chosen_field` and `rejected_field` (with
        their loss masks in `chosen_loss_mask_field` and `rejected_loss_mask_field`, where they have
        a prompt or are chats), go into one row, never split: the chosen as document 2k of the row,
        its rejected as 2k+1, so that a loss summing each document's log-probabilities over its
        learned labels pairs document 2k with 2k+1. "first_fit" places a pair in the first open row
        with room (at most `max_open_rows` open); "pad" gives each pair a row of its own.

        A record where either document is absent, not token ids, empty, or has a bad loss mask is
        skipped once, for the first of the two refused (`missing_field`, ...). `overlong` says what
        becomes of a pair longer than a row: "skip" (the default) skips it (`pair_too_long`);
        "truncate" keeps each document's first tokens, "keep_end" its last (the answers kept, the
        starts of their prompts dropped), the shorter whole where it takes at most half the row,
        counted in `stats()` as `truncated` and `truncated_tokens`, and skips it as `pair_too_long`
        where either would then learn nothing.

        A `tokenize` writing one of the two documents whose loss mask goes to another field than
        this packer reads it from is refused when the pipeline is sharded: it would train on the
        prompt, or read the other document's mask. `zephon.preference` reads the pairs back from a
        batch: `pair_log_probs` (a DPO-style loss) and `pair_scores` (a reward model's).
        `document_values` carries a record's number fields (a pair's margin) into the row, as
        `pack_flat`'s does, each value twice: for the chosen document and for the rejected."""
        return self._with(PackPairsOp(max_length, algorithm, pad_id, chosen_field, rejected_field,
                                      chosen_loss_mask_field, rejected_loss_mask_field, max_open_rows, overlong,
                                      document_values))

    def shuffle(self, buffer_size: int, seed: int = 0) -> Pipeline:
        """Append a seeded shuffle buffer of `buffer_size` rows per lane segment.

        A second shuffle with the seed of one already in the pipeline is refused: its generator
        comes from the same (seed, lane, segment), so it would draw the same numbers as the first
        and undo none of its patterns, silently weaker than it reads."""
        op = ShuffleOp(buffer_size, seed)
        if any(isinstance(other, ShuffleOp) and other.seed == op.seed for other in self.operators):
            raise ConfigurationError(
                f"shuffle: seed {op.seed} is already another shuffle's in this pipeline; two shuffles with one "
                "seed draw the same random numbers: give this one its own seed"
            )
        return self._with(op)

    def batch(self, microbatch_size: int) -> Pipeline:
        """End the pipeline: each lane's rows are handed over as `Batch`es of `microbatch_size`
        rows. Part of the recipe; `shard(global_batch_size=G)` then takes G / num_lanes rows of
        every lane a step, which must be a multiple of `microbatch_size`."""
        return self._with(BatchOp(microbatch_size))

    def apply(self, operator) -> Pipeline:
        """Append an operator object: a RecordOperator (kind "record": stateless, on workers) or an
        accumulator operator (kind "accumulator": `factory(default_pad_id)` and
        `fingerprint(default_pad_id)`). This is how `vlm` adds its operators. A record operator
        scoped to some datasets declares them as `dataset_scope` (see `RecordOperator`); a packer
        may offer `bound_to(operators)`, which the loader calls with the record operators before it
        when the pipeline is sharded: it refuses those it cannot pack (ConfigurationError) and
        returns the packer the loader packs and fingerprints with, its settings left unset taken
        from them (vlm's: its decoders' spec and fields). Its `row_work(on_error, operators)` is
        given them too."""
        if getattr(operator, "kind", None) not in ("record", "accumulator"):
            raise ConfigurationError(f"{operator!r} is neither a record nor an accumulator operator")
        return self._with(operator)

    def __getattr__(self, name: str):
        """Builder methods contributed by other packages through the `zephon.pipeline` entry points
        (e.g. `decode_images` from `vlm`), so the core never imports them."""
        if name.startswith("_"):
            raise AttributeError(name)
        found = find("zephon.pipeline", name)
        if found:
            method = next(iter(found)).load()  # the first, where several packages register the name
            return lambda *args, **kwargs: method(self, *args, **kwargs)
        raise AttributeError(_no_such_operator(name))

    @property
    def microbatch_size(self) -> int:
        if not self.operators or self.operators[-1].kind != "batch":
            raise ConfigurationError("the pipeline must end with .batch(microbatch_size)")
        return self.operators[-1].microbatch_size

    def shard(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        global_batch_size: int | None = None,
    ):
        """The loader of one data-parallel rank. Rank and world size default to torch.distributed's
        when a process group is initialised, else to a single rank (refused where a launcher's
        `WORLD_SIZE` says there are more processes: each would read the whole stream).
        `global_batch_size` defaults to one microbatch per lane."""
        from ._loader import RankLoader

        if rank is None or world_size is None:
            from .distributed import rank_and_world_size

            rank, world_size = rank_and_world_size(rank, world_size)
        if global_batch_size is None:
            global_batch_size = self.settings.num_lanes * self.microbatch_size
        return RankLoader(self, rank, world_size, global_batch_size)

    def __iter__(self) -> Iterator:
        loader = self.shard()
        try:
            yield from loader
        finally:
            loader.close()

    def record_operators(self) -> list[RecordOperator]:
        return [op for op in self.operators if op.kind == "record"]

    def packers(self) -> list:
        """The packing operators: accumulators with a `max_length`, the length of the rows they
        emit (pack_flat, vlm's pack_multimodal). A loader needs exactly one."""
        return [op for op in self.operators if op.kind == "accumulator" and hasattr(op, "max_length")]


def _no_such_operator(name: str) -> str:
    """What a Pipeline says of a name it lacks. A rank loader's method asked of the recipe
    (`pipeline.state_dict()` in a checkpoint hook) is a mistake of place, not a missing operator,
    so it names where the method is."""
    from ._loader import RankLoader  # where used, as shard() imports it

    if hasattr(RankLoader, name):
        return (
            f"Pipeline has no {name!r}: a Pipeline is the recipe: {name} is its loader's, "
            f"loader = pipeline.shard(...), then loader.{name}"
        )
    return f"Pipeline has no operator {name!r}"
