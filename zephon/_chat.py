"""A chat's messages as the segments `tokenize(segments=True)` reads, rendered with the model's own
chat template (`Pipeline.render_chat`).

Instruction data comes as chats: `[{"role": "user", "content": ...}, {"role": "assistant", ...}]`,
a content a str or, in vision data, a list of parts (`[{"type": "image"}, {"type": "text", "text":
...}]`) that the template writes itself (an image part as the model's image marker). A model is
trained on them as its chat template writes them, and on its assistant turns alone. The template
is a Jinja program, rendered as transformers' `apply_chat_template` renders it (with the recipe's
date for its clock: `zephon._chat_render`); what it writes for messages j to
k is found by rendering the chat's prefixes: what the first k + 1 messages render to past what the
first j do. A learned assistant message's text starts after its generation prompt (the first k
rendered with `add_generation_prompt=True`: `<|im_start|>assistant\n`), which is not learned, as
at inference the model is given it; a learned message of another role (`learned_roles`) has no
generation prompt, and is learned whole.

Consecutive messages learned alike are one segment, flagged as the template's (`[text, learned,
True]`), whose special tokens' strings `tokenize` matches as the control tokens they are: encoded
whole, as transformers encodes the rendered chat, and rendered only where a segment ends. Where a
message's text holds such a string itself (its content, a text part, a tool call's argument quoting
`<|im_end|>`), that text is cut out as a segment of its own, which stays text
(`split_special_tokens`), so that no message can end its turn; where it stands is found by
rendering the message once more with a mark in its place (`_marked`). Spaces that end a segment
before a word move into the next (`_spaces_forward`), as a byte-level tokenizer writes them.

Tool-calling chats (OpenAI's layout: an assistant's `tool_calls`, the results as `tool` messages)
keep every key of their messages for the template, and a record's tools (their JSON schemas) are
handed to it as `tools`.

A chat the template cannot render (a role it refuses), one whose renderings are no prefixes of one
another (a template that writes earlier messages otherwise once later ones follow), and one whose
quoting content the template does not write as given, are skipped by name, never trained on
half-made.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ._chat_render import check_template, keyword_as_json, reads_clock, renderer, transformers_tokenizer
from ._dataset_scope import scoped, with_scope
from ._errors import BadRecordError, ConfigurationError, check_field_name
from ._field_names import fields_it_has
from ._loss_mask import sample as _sample
from ._record_ops import RecordFn, RecordOperator
from ._records import ChunkRecords
from ._sha256 import sha256

__all__ = ["RenderChatOp", "chat_templates_of", "check_chat_options"]


@functools.lru_cache(maxsize=8)
def _control_strings(tokenizer_dir: str) -> tuple[str, ...]:
    """The strings of the tokenizer's special tokens: what `tokenize` encodes as text inside a
    message's content (`split_special_tokens`) and as control tokens in the template's text."""
    added = transformers_tokenizer(tokenizer_dir).backend_tokenizer.get_added_tokens_decoder().values()
    return tuple(sorted(token.content for token in added if token.special))


def chat_templates_of(tokenizer_dir: str) -> dict[str, str]:
    """The chat templates the tokenizer directory holds, by name: its one template (its
    `chat_template.jinja`, or its tokenizer_config.json's `chat_template`; where the tokenizer has
    none, a processor's `chat_template.json`, the only one many vision models' directories hold)
    as "default", or the templates it names (`tool_use`, `rag`: Hermes' and Command-R's, in
    `additional_chat_templates/` or tokenizer_config.json's list); refused by name where it holds none."""
    template = getattr(transformers_tokenizer(tokenizer_dir), "chat_template", None)
    if isinstance(template, dict):
        return {name: text for name, text in template.items() if isinstance(text, str) and text}
    if not isinstance(template, str) or not template:
        template = _processor_template(tokenizer_dir)
    if not template:
        raise ConfigurationError(
            f"render_chat: {tokenizer_dir!r} holds no chat template (a chat_template.jinja, a chat_template "
            f"in tokenizer_config.json, or a processor's {_PROCESSOR_TEMPLATE}): give the directory of the "
            "model's tokenizer"
        )
    return {"default": template}


_PROCESSOR_TEMPLATE = "chat_template.json"


def _processor_template(tokenizer_dir: str) -> str | None:
    """The template of the directory's `chat_template.json` ({"chat_template": str}, as processors
    save it), None where there is none; one that holds no such str is refused naming it."""
    path = os.path.join(tokenizer_dir, _PROCESSOR_TEMPLATE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            template = json.load(file).get("chat_template")
    except (ValueError, AttributeError) as error:
        raise ConfigurationError(f"render_chat: {path!r} is no processor's chat template: {error}") from None
    if not isinstance(template, str) or not template:
        raise ConfigurationError(f"render_chat: {path!r} holds no \"chat_template\" str, as processors save it")
    return template


@dataclass(frozen=True)
class RenderChatOp(RecordOperator):
    """Writes `record[field]`, a list of {"role", "content"} messages, as `record[output_field]`:
    the [text, learned(, template)] segments of the chat as the template renders it, the messages
    of `learned_roles` learned (see the module docstring). Messages stored under other keys
    (ShareGPT's and LLaVA-Instruct's {"from": "human", "value": ...}) are read by `role_key` and
    `content_key`, their roles renamed to the template's by `roles` (pairs: ("human", "user"),
    ("gpt", "assistant")) before `learned_roles` is asked. A record's `tools_field` (the tools'
    schemas) is handed to the template as `tools`, its `documents_field` (a retrieval's documents)
    as `documents`; `template_kwargs`, (name, JSON) pairs, as the names the template reads (Qwen3's
    `enable_thinking`), and over them a record's `template_kwargs_field` (TRL's
    `chat_template_kwargs` column). Those fields and the messages' are dropped unless
    `keep_field`. Skips: `missing_field`, `not_messages` (not a list of messages with a str role
    and a content that is a str or a list of {"type": str} parts, a text part's "text" a str, or
    None beside `tool_calls`), `not_tools`, `not_documents`, `not_template_kwargs`,
    `chat_template_error` (the template raised), `chat_template_not_prefix`,
    `chat_content_not_found`."""

    tokenizer_dir: str
    field: str = "messages"
    output_field: str = "segments"
    learned_roles: tuple[str, ...] = ("assistant",)
    parallelism: int = 1
    keep_field: bool = False
    role_key: str = "role"
    content_key: str = "content"
    roles: tuple[tuple[str, str], ...] = ()
    tools_field: str | None = None
    on_rewrite: str = "skip"
    today: str | None = None
    template_kwargs: tuple[tuple[str, str], ...] = ()
    documents_field: str | None = None
    template_name: str | None = None
    template_kwargs_field: str | None = None
    datasets: tuple[str, ...] | None = None
    name: str = "render_chat"

    @property
    def dataset_scope(self) -> tuple[str, ...] | None:
        return self.datasets

    @functools.cached_property
    def templates(self) -> dict[str, str]:
        """The templates rendered with, by name, read once, when the pipeline is built: the recipe
        names them, and every worker renders with them, whatever the directory holds later. The
        one `template_name` names; else the directory's default, and where records hand tools
        (`tools_field`) its `tool_use` template for a chat with tools, as `apply_chat_template`
        picks it. A name the directory lacks, a template that does not compile, or one that reads
        the clock without `today`, is refused here (`zephon._chat_render`)."""
        held = chat_templates_of(self.tokenizer_dir)
        if self.template_name is not None:
            names = [self.template_name]
        else:
            names = ["default", *(["tool_use"] if self.tools_field is not None and "tool_use" in held else [])]
        for name in names:
            if name not in held:
                raise ConfigurationError(
                    f"render_chat: {self.tokenizer_dir!r} holds no chat template named {name!r}, only "
                    f"{sorted(held)}: name the one to render with, template_name=")
            check_template(held[name], self.today)
        return {name: held[name] for name in names}

    @property
    def template(self) -> str:
        """The template a chat without tools is rendered with."""
        return self.templates[self.template_name or "default"]

    def build(self, on_error: str) -> RecordFn:
        field, output_field = self.field, self.output_field
        learned_roles, keep_field, tokenizer_dir = frozenset(self.learned_roles), self.keep_field, self.tokenizer_dir
        tools_field, documents_field = self.tools_field, self.documents_field
        learn_last = self.on_rewrite == "learn_last"
        kwargs_field = self.template_kwargs_field
        handed_fields = [(name, read, reader, reason) for name, read, reader, reason in (
            ("tools", tools_field, functools.partial(_dicts_of, name="tools"), "not_tools"),
            ("documents", documents_field, functools.partial(_dicts_of, name="documents"), "not_documents"),
            ("keywords", kwargs_field, _keywords_of, "not_template_kwargs")) if read is not None]
        read_messages = functools.partial(_messages_of, role_key=self.role_key, content_key=self.content_key,
                                          roles=dict(self.roles))

        prepare = prepare_with_tools = renderer(tokenizer_dir, self.template, self.today, self.template_kwargs)
        if "tool_use" in self.templates and self.template_name is None:  # a chat with tools: transformers' pick
            prepare_with_tools = renderer(tokenizer_dir, self.templates["tool_use"], self.today, self.template_kwargs)

        def outcome(record: dict) -> tuple[str | None, object]:
            handed = {}
            for name, read, reader, reason in handed_fields:
                try:
                    handed[name] = reader(record.get(read))
                except ValueError as why:
                    return reason, f"field {read!r} {why}"
            chosen = prepare_with_tools if handed.get("tools") is not None else prepare
            return _chat_segments(record.get(field), read_messages, functools.partial(chosen, **handed),
                                  learned_roles, _control_strings(tokenizer_dir), learn_last)

        def render_chat(batch: ChunkRecords) -> ChunkRecords:
            outcomes = [outcome(record) for record in batch.records]
            reasons = [reason for reason, _ in outcomes]
            details = {id(record): detail for record, (_, detail) in zip(batch.records, outcomes)}
            detail = functools.partial(_detail, field, details)
            if on_error == "raise":
                for reason, address, record in zip(reasons, batch.addresses, batch.records):
                    if reason is not None:
                        raise BadRecordError(address, reason, detail(reason, record))
            kept = [detail_or_segments for reason, detail_or_segments in outcomes if reason is None]
            batch.skip(reasons, detail)
            for record, segments in zip(batch.records, kept):
                record[output_field] = segments
                if not keep_field:
                    for used in (field, tools_field, documents_field, kwargs_field):
                        if used is not None and used != output_field:
                            record.pop(used, None)
            return batch

        return scoped(render_chat, self.datasets)

    def fingerprint(self) -> dict:
        """What decides the segments: the templates' texts (and the name of the one named) and the
        special tokens' strings they are given (`bos_token`, ...; not the directory's path: a copy
        of the model elsewhere renders alike), the fields, the learned roles, the date a template
        that reads the clock writes and the template's own switches."""
        specials = transformers_tokenizer(self.tokenizer_dir).special_tokens_map
        out = {"op": self.name, "template": sha256(self.template.encode()).hexdigest(),
               "special_tokens": sorted((name, str(value)) for name, value in specials.items()), "field": self.field,
               "output_field": self.output_field, "learned_roles": sorted(self.learned_roles),
               "rendering": 2}  # 2: the template handed the chat as transformers hands it, its prefixes compiled
        if self.keep_field:
            out["keep_field"] = True
        if (self.role_key, self.content_key) != ("role", "content"):
            out["keys"] = [self.role_key, self.content_key]
        if self.roles:
            out["roles"] = sorted(self.roles)
        if self.tools_field is not None:
            out["tools_field"] = self.tools_field
        if self.documents_field is not None:
            out["documents_field"] = self.documents_field
        if self.on_rewrite != "skip":
            out["on_rewrite"] = self.on_rewrite
        if "tool_use" in self.templates and self.template_name is None:
            out["tool_use_template"] = sha256(self.templates["tool_use"].encode()).hexdigest()
        if self.template_name is not None:
            out["template_name"] = self.template_name
        if self.today is not None and any(map(reads_clock, self.templates.values())):  # else it changes nothing
            out["today"] = self.today
        if self.template_kwargs:
            out["template_kwargs"] = [list(pair) for pair in self.template_kwargs]
        if self.template_kwargs_field is not None:
            out["template_kwargs_field"] = self.template_kwargs_field
        return with_scope(out, self.datasets)


def _detail(field: str, details: dict, reason: str, record: dict) -> str:
    """What was wrong with a skipped record, for `stats()["skipped_examples"]`."""
    if reason == "missing_field":
        return f"field {field!r}; {fields_it_has(field, record)}"
    return details[id(record)]


def _chat_segments(value: object, read_messages, prepare, learned_roles: frozenset, controls: tuple[str, ...],
                   learn_last: bool) -> tuple[str | None, object]:
    """(None, segments) of a chat, or (reason, detail) where it is skipped; the last turn alone
    learned where the template rewrites earlier turns and `learn_last`. `prepare` gives the
    messages as the template is handed them, and their renderer (`zephon._chat_render`)."""
    if value is None:
        return "missing_field", ""
    messages = read_messages(value)
    if isinstance(messages, str):
        return "not_messages", messages
    try:
        messages, render = prepare(messages)
    except Exception as error:  # what transformers refuses to hand a template
        return "chat_template_error", f"handing the chat to the template: {type(error).__name__}: {error}"
    reason, detail = _turn_segments(messages, render, learned_roles, controls)
    if reason == "chat_template_not_prefix" and learn_last:
        return _last_turn_segments(messages, render, learned_roles, controls, detail)
    return reason, detail


def _turn_segments(messages: list[dict], render, learned_roles: frozenset,
                   controls: tuple[str, ...]) -> tuple[str | None, object]:
    """(None, segments) of a chat's every turn, found by rendering its prefixes (module
    docstring), or (reason, detail) where they cannot be."""
    segments: list[list] = []
    written = ""
    quoting = [_quotes(message, controls) for message in messages]  # asked at each message's two ends
    for k, message in enumerate(messages):
        learned = message["role"] in learned_roles
        try:
            if learned and message["role"] == "assistant":
                prompted = render(messages[:k], generation_prompt=True) if k else _generation_prompt(render)
                if not prompted.startswith(written):
                    return "chat_template_not_prefix", _not_prefix(k, message, "its generation prompt")
                segments += _template_text(prompted[len(written):], False)
                written = prompted
            if not _ends_a_segment(messages, k, learned_roles, quoting):
                continue  # its text goes with the next message's: one segment, one rendering fewer
            rendered = render(messages[: k + 1])
            marked, quoted = _marked(message, controls)
            # Where its quoting texts stand: the message rendered again with each one a mark.
            with_marks = render([*messages[:k], marked]) if quoted else rendered
        except Exception as error:  # a template's raise_exception, an undefined name, a type it cannot take
            return "chat_template_error", (
                f"rendering message {k} ({message['role']!r}): {type(error).__name__}: {error}"
            )
        if not rendered.startswith(written) or not with_marks.startswith(written):
            return "chat_template_not_prefix", _not_prefix(k, message, "the chat before it")
        text = rendered[len(written):]
        cut = _cut_out(text, with_marks[len(written):], quoted, learned)  # each quoting text apart, as text
        if isinstance(cut, str):
            return "chat_content_not_found", (
                f"message {k} ({message['role']!r}): the template writes {_sample(text)} for its content {cut}"
            )
        segments += cut
        written = rendered
    return None, _spaces_forward(segments, controls)


def _ends_a_segment(messages: list[dict], k: int, learned_roles: frozenset, quoting: list[bool]) -> bool:
    """Whether message k's text is rendered apart from what follows it: it is the last; it or the
    next one quotes a control token (`quoting`, by message: cut out as text); or what follows is
    learned otherwise (the next message's text, or, before a learned assistant's, its generation
    prompt, not learned). Otherwise the two go in one segment, rendered once."""
    if k + 1 == len(messages) or quoting[k] or quoting[k + 1]:
        return True
    following = messages[k + 1]["role"]
    follows_learned = following in learned_roles and following != "assistant"
    return follows_learned != (messages[k]["role"] in learned_roles)


def _quotes(message: dict, controls: tuple[str, ...]) -> bool:
    """Whether a text of the message (`_marked`) holds a special token's string."""
    content, calls = message.get("content"), message.get("tool_calls")
    texts = [content] if isinstance(content, str) else [
        part["text"] for part in content or () if part["type"] == "text"]
    if calls:
        texts += _strings_in(calls)
    return any(control in text for text in texts for control in controls)


def _strings_in(value: object) -> list[str]:
    """Every str inside a message's tool calls (names, arguments as a JSON str or as values)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [text for item in value for text in _strings_in(item)] if isinstance(value, (list, tuple)) else []


_MARK = "\ue000zephon-quote-{}\ue001"
"""What stands for a message's n-th quoting text when it is rendered to find where that stands:
private-use characters, which no tokenizer's text holds and which a template writes as they are
(`trim` and `tojson` keep them)."""


def _marked(message: dict, controls: tuple[str, ...], first: int = 0) -> tuple[dict, list[str]]:
    """The message with each of its texts that hold a special token's string (its content, its
    content's text parts, then every str of its tool calls) replaced by a mark of its own
    (`_MARK`, numbered from `first`), and those texts, in order."""
    if not _quotes(message, controls):
        return message, []
    quoted: list[str] = []

    def mark(text: str) -> str:
        if not any(control in text for control in controls):
            return text
        quoted.append(text)
        return _MARK.format(first + len(quoted) - 1)

    def walk(value):
        if isinstance(value, str):
            return mark(value)
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        return [walk(item) for item in value] if isinstance(value, (list, tuple)) else value

    out = dict(message)
    content = message.get("content")  # left out beside tool calls, as transformers hands such a message on
    if isinstance(content, str):
        out["content"] = mark(content)
    elif content is not None:
        out["content"] = [{**part, "text": mark(part["text"])} if part["type"] == "text" else part
                          for part in content]
    if "tool_calls" in message:
        out["tool_calls"] = walk(message["tool_calls"])
    return out, quoted


def _cut_out(text: str, with_marks: str, quoted: list[str], learned: bool, first: int = 0) -> list[list] | str:
    """The segments of `text`, a message's as the template wrote it, with each of its `quoted`
    texts (marked from `first`) cut out as text and the rest the template's: each stands where
    its mark stands in `with_marks` (the message rendered with its marks), past the texts before
    it, as given or stripped (a template's `| trim`); where one does not, a sample of it."""
    segments: list[list] = []
    at = shift = 0
    for n, piece in enumerate(quoted, start=first):
        mark = _MARK.format(n)
        start = with_marks.find(mark) + shift
        spelled = next((s for s in (piece, piece.strip()) if text.startswith(s, start)), None)
        if start < shift or spelled is None:
            return _sample(piece)
        segments += [*_template_text(text[at:start], learned), [spelled, learned]]
        at = start + len(spelled)
        shift += len(spelled) - len(mark)
    return segments + _template_text(text[at:], learned)


def _spaces_forward(segments: list[list], controls: tuple[str, ...]) -> list[list]:
    """The segments with the spaces that end one moved to the start of the next where that starts
    with a word: a byte-level tokenizer writes a word's leading space into its first token (`Bot: `
    and `fine` are `Bot`, `:`, ` fine`). `tokenize` encodes the segments joined, but a content
    quoting a control token apart from the template's text around it (`zephon._segment_encoding`),
    and there the generation prompt `Bot: ` would make a token of the space alone, which the whole
    chat encoded never holds. The answer's first token carries the space, and is learned with it,
    as transformers' assistant mask has it. Before a space or a control token a space is a token
    of its own: it stays."""
    out: list[list] = []
    for segment in segments:
        text = segment[0]
        if out and out[-1][0].endswith(" ") and text[:1].strip() and not text.startswith(controls):
            kept = out[-1][0].rstrip(" ")
            segment = [out[-1][0][len(kept):] + segment[0], *segment[1:]]
            if kept:
                out[-1] = [kept, *out[-1][1:]]
            else:
                out.pop()
        out.append(segment)
    return out


def _last_turn_segments(messages: list[dict], render, learned_roles: frozenset, controls: tuple[str, ...],
                        rewritten: str) -> tuple[str | None, object]:
    """(None, segments) of a chat whose template rewrites earlier turns once later ones follow
    (`rewritten` says where), learning its last message alone: the chat before it as the template
    writes it when that message is to come (with its generation prompt, for an assistant's), not
    learned, then that message's text as the whole chat ends with it. What a reasoning model's
    template keeps of earlier turns (not their thinking) is the context, as at inference. Where
    the last message is not learned, or the chat before it is no prefix of the whole, (reason,
    detail)."""
    last = len(messages) - 1
    role = messages[last]["role"]
    if role not in learned_roles:
        return "chat_template_not_prefix", f"{rewritten}; its last message ({role!r}) is not learned"
    marked, quoted = [], []
    for message in messages:
        before = len(quoted)  # the marks before the last message's, once the loop is done
        with_marks, texts = _marked(message, controls, first=before)
        marked.append(with_marks)
        quoted += texts
    prompted = role == "assistant"
    try:
        context = (render(messages[:last], generation_prompt=prompted) if last else
                   _generation_prompt(render) if prompted else "")
        context_marks = render(marked[:last], generation_prompt=prompted) if last and before else context
        whole = render(messages)
        whole_marks = render(marked) if quoted else whole
    except Exception as error:
        return "chat_template_error", f"rendering the chat for its last message: {type(error).__name__}: {error}"
    if not whole.startswith(context) or not whole_marks.startswith(context_marks):
        return "chat_template_not_prefix", f"{rewritten}; and the chat before its last message is no prefix of it"
    heads = _cut_out(context, context_marks, quoted[:before], False)
    tail = _cut_out(whole[len(context):], whole_marks[len(context_marks):], quoted[before:], True, first=before)
    for cut in (heads, tail):
        if isinstance(cut, str):
            return "chat_content_not_found", f"the template writes {_sample(whole)} for a content {cut}"
    return None, _spaces_forward(heads + tail, controls)


def _generation_prompt(render) -> str:
    """The generation prompt before a chat's first message, where that one is learned: rendered
    for no message, or nothing where the template refuses an empty chat."""
    try:
        return render([], generation_prompt=True)
    except Exception:
        return ""


def _template_text(text: str, learned: bool) -> list[list]:
    """The template's own text as a segment ([text, learned, True]), none where it wrote none."""
    return [[text, learned, True]] if text else []


def _messages_of(value: object, role_key: str, content_key: str, roles: dict[str, str]) -> list[dict] | str:
    """The chat `value` holds, as {"role", "content", ...} messages in the template's roles; or why
    it holds none. A content is a str, or a list of parts as processors' templates take them
    (`[{"type": "image"}, {"type": "text", "text": "What is this?"}]`), handed to the template as
    they are; an assistant's that calls tools (`tool_calls`) may be None or left out, as OpenAI's
    chats have it (elsewhere a template would write None as `None`). A message's other keys
    (`tool_calls`, `tool_call_id`, `name`, ...) are handed on as they are."""
    if not isinstance(value, (list, tuple)) or not value:
        return f"holds {_sample(value)}, not a list of messages"
    messages = []
    for k, message in enumerate(value):
        content = message.get(content_key) if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get(role_key), str) \
                or not (isinstance(content, (str, list, tuple)) or (content is None and message.get("tool_calls"))):
            return (f"message {k} is {_sample(message)}, not a {{{role_key!r}: str, {content_key!r}: str or a list "
                    "of parts} message")
        for j, part in enumerate(content if isinstance(content, (list, tuple)) else ()):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str) \
                    or (part["type"] == "text" and not isinstance(part.get("text"), str)):
                return (f"message {k}'s part {j} is {_sample(part)}, not a {{'type': 'text', 'text': str}} part "
                        "nor another {'type': str} one")
        role = message[role_key]
        others = {key: item for key, item in message.items() if key not in (role_key, content_key)}
        messages.append({**others, "role": roles.get(role, role), "content": content})
    return messages


_WHAT_THEY_ARE = {"tools": "tools' schemas", "documents": "documents ({'title': ..., 'text': ...})"}


def _parsed(value: object) -> object:
    """A record's field as it is handed to the template: a str read as the JSON it stores
    (`tools_field`, `documents_field`, `template_kwargs_field`); a ValueError where it is no JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as error:
        raise ValueError(f"holds {_sample(value)}, not JSON: {error}") from None


def _dicts_of(value: object, name: str) -> list | None:
    """The tools (their JSON schemas) or the documents a record offers the template as `name`
    (`tools_field`, `documents_field`): a list of dicts, or one stored as a JSON str; None for a
    record that offers none; else a ValueError saying why not."""
    value = _parsed(value)
    if value is None or (isinstance(value, (list, tuple)) and all(isinstance(item, dict) for item in value)):
        return None if value is None else list(value)
    raise ValueError(f"holds {_sample(value)}, not a list of {_WHAT_THEY_ARE[name]}")


def _keywords_of(value: object) -> dict | None:
    """A record's keywords for the template (`template_kwargs_field`): a dict, or one stored as a
    JSON str; None for a record that gives none; else a ValueError saying why not
    (`keyword_as_json`)."""
    value = _parsed(value)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"holds {_sample(value)}, not a dict of the template's keywords")
    try:
        for name, item in value.items():
            keyword_as_json(name, item, "its keywords")
    except ValueError as error:
        raise ValueError(f"holds {_sample(value)}: {error}") from None
    return value


def _not_prefix(k: int, message: dict, what: str) -> str:
    return (f"message {k} ({message['role']!r}): {what} renders otherwise once the message follows, so its text "
            "cannot be told apart (a template that rewrites earlier messages)")


def check_chat_options(tokenizer_dir: object, field: object, output_field: object, learned_roles: object,
                       role_key: object, content_key: object, roles: object, tools_field: object = None,
                       on_rewrite: object = "skip", documents_field: object = None, template_name: object = None,
                       template_kwargs_field: object = None) -> tuple[str, tuple[tuple[str, str], ...]]:
    """Refuse `render_chat`'s arguments as it is called; returns the directory as a str and the
    roles' renaming as sorted pairs."""
    if isinstance(tokenizer_dir, os.PathLike):
        tokenizer_dir = os.fspath(tokenizer_dir)
    if not isinstance(tokenizer_dir, str) or not tokenizer_dir:
        raise ConfigurationError(f"render_chat: tokenizer_dir must name a tokenizer's directory, got {tokenizer_dir!r}")
    if roles is None:
        roles = {}
    if not isinstance(roles, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in roles.items()):
        raise ConfigurationError(f"render_chat: roles must map the data's roles to the template's (str to str), "
                                 f"got {roles!r}")
    for name, value in (("field", field), ("output_field", output_field), ("role_key", role_key),
                        ("content_key", content_key)):
        check_field_name(value, f"render_chat: {name}")
    if isinstance(learned_roles, str) or not isinstance(learned_roles, (list, tuple)) or not learned_roles \
            or not all(isinstance(role, str) for role in learned_roles):
        raise ConfigurationError(f"render_chat: learned_roles must be a list of roles, got {learned_roles!r}")
    if role_key == content_key:
        raise ConfigurationError(f"render_chat: role_key and content_key are both {role_key!r}; give each its own")
    if template_name is not None and (not isinstance(template_name, str) or not template_name):
        raise ConfigurationError(f"render_chat: template_name must name one of the directory's chat templates, "
                                 f"got {template_name!r}")
    if on_rewrite not in ("skip", "learn_last"):
        raise ConfigurationError(f"render_chat: on_rewrite must be 'skip' or 'learn_last', got {on_rewrite!r}")
    taken = {field: "the chat's field", output_field: "the segments' field"}
    for name, value, what in (("tools_field", tools_field, "the tools"),
                              ("documents_field", documents_field, "the documents"),
                              ("template_kwargs_field", template_kwargs_field, "the template's keywords")):
        if value is None:
            continue
        check_field_name(value, f"render_chat: {name}")
        if value in taken:
            raise ConfigurationError(f"render_chat: {name}={value!r} is also {taken[value]}; give {what} a field of "
                                     "their own")
        taken[value] = name
    return tokenizer_dir, tuple(sorted(roles.items()))
