"""How `render_chat` renders a chat's prefixes: with the template transformers compiled, on the chat
as transformers hands it to the template, and with the recipe's date for the template's clock.

Why not `apply_chat_template` at each rendering: `zephon._chat` renders a chat once for each of its
turns, and every call converts the whole prefix again (messages to plain data, reasoning fields
aliased, keys holding None dropped). At 128 messages that conversion was 13 times the template's
own work (`benchmarks/README.md`, `test_chat_bench.py`). So transformers converts a chat once,
through `apply_chat_template` itself with a template that writes what it was handed as JSON, and
each prefix of that is rendered by the compiled template as `apply_chat_template` renders it (the
same arguments: the messages, `tools`, `documents`, `add_generation_prompt`, the tokenizer's
special tokens and the keyword arguments, `template_kwargs`).

Why a date: templates read the clock (`strftime_now`: Llama 3.1's "Today Date: ..."), which would
make a chat rendered today and one rendered tomorrow, or by a run resumed on another day, other
ids. Here the clock reads `today`, the recipe's date, at midnight; a template that reads the clock
is refused without one (`check_template`).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Callable, Mapping

from ._errors import ConfigurationError

__all__ = ["Renderer", "check_template", "check_template_kwargs", "check_today", "keyword_as_json", "reads_clock",
           "renderer", "transformers_tokenizer"]

Renderer = Callable[..., str]
"""`render(messages, generation_prompt=False)`: what the template writes for `messages`."""

_AS_HANDED = "{{ {'messages': messages, 'tools': tools, 'documents': documents} | tojson }}"
"""A template that writes what `apply_chat_template` hands a template, as JSON (its `tojson`
writes it as `json.dumps` does, which `json.loads` reads back as it was)."""

_CLOCK = "strftime_now"


@functools.lru_cache(maxsize=8)
def transformers_tokenizer(tokenizer_dir: str):
    """transformers' tokenizer of `tokenizer_dir`, once per process: it renders the template."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ModuleNotFoundError("render_chat needs transformers: pip install 'zephon[chat]'",
                                  name="transformers") from exc
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _compiled(template: str):
    """The template as transformers compiles it for `apply_chat_template` (its sandbox, `tojson`,
    `raise_exception`, the `{% generation %}` tag), cached there."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError as exc:
        raise ModuleNotFoundError(
            "render_chat renders with the chat templates transformers compiles "
            "(transformers.utils.chat_template_utils, transformers 4.45 and later), which this transformers lacks",
            name="transformers") from exc
    return _compile_jinja_template(template)


def check_today(today: object) -> str | None:
    """`render_chat(today=...)` as an ISO date str ("2026-12-06"), or None; refused by name otherwise."""
    if isinstance(today, datetime.date) and not isinstance(today, datetime.datetime):
        today = today.isoformat()
    if today is None:
        return None
    try:
        if isinstance(today, str) and datetime.date.fromisoformat(today).isoformat() == today:
            return today
    except ValueError:
        pass
    raise ConfigurationError(f"render_chat: today must be a date, as 'YYYY-MM-DD', got {today!r}")


def check_template(template: str, today: str | None) -> None:
    """Refuse, as the pipeline is built, a template transformers cannot compile, and one that reads
    the clock where the recipe gives it no date (module docstring)."""
    try:
        _compiled(template)
    except ModuleNotFoundError:
        raise
    except Exception as error:  # jinja2's TemplateSyntaxError, or a sandbox refusal
        raise ConfigurationError(f"render_chat: the chat template does not compile: {type(error).__name__}: {error}")
    if today is None and reads_clock(template):
        raise ConfigurationError(
            f"render_chat: the chat template reads today's date ({_CLOCK}), so its chats would differ from one day "
            "to the next; give render_chat the date it is to write: today='YYYY-MM-DD'"
        )


def reads_clock(template: str) -> bool:
    """Whether the template reads today's date: loads transformers' `strftime_now` anywhere in it,
    a branch it may never take included. Asked of the template as jinja2 parses it, so the name in a
    comment or a quoted text is no reading."""
    from jinja2 import nodes

    parsed = _compiled(template).environment.parse(template)
    return any(node.name == _CLOCK and node.ctx == "load" for node in parsed.find_all(nodes.Name))


def _clock(today: str) -> Callable[[str], str]:
    midnight = datetime.datetime.combine(datetime.date.fromisoformat(today), datetime.time())

    def strftime_now(format: str) -> str:
        return midnight.strftime(format)

    return strftime_now


_HANDED_BY_ZEPHON = frozenset({"messages", "tools", "documents", "add_generation_prompt", _CLOCK})


def keyword_as_json(name: object, value: object, given_as: str) -> str:
    """A keyword the template is handed (`name` = `value`), as JSON; a ValueError saying, of
    `given_as`, why it cannot be: a name that is no Jinja name or is one Zephon hands the template
    itself, a value that is no JSON value (a recipe holds it as JSON)."""
    if not isinstance(name, str) or not name.isidentifier() or name in _HANDED_BY_ZEPHON:
        raise ValueError(f"{given_as} may not name {name!r}: a name the template reads, not one of "
                         f"{sorted(_HANDED_BY_ZEPHON)} (render_chat hands those itself; today is the clock's date)")
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        text = None
    if text is None or json.loads(text) != value:
        raise ValueError(f"{given_as}[{name!r}] must be a JSON value, got {value!r}")
    return text


def check_template_kwargs(value: object) -> tuple[tuple[str, str], ...]:
    """`render_chat(template_kwargs=...)`, the template's own switches (Qwen3's `enable_thinking`),
    as (name, value as JSON) pairs sorted by name: one recipe for one setting; refused by name as
    `keyword_as_json` says."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"render_chat: template_kwargs must map names to values, got {value!r}")
    try:
        return tuple(sorted((name, keyword_as_json(name, item, "template_kwargs")) for name, item in value.items()))
    except ValueError as error:
        raise ConfigurationError(f"render_chat: {error}") from None


def renderer(tokenizer_dir: str, template: str, today: str | None,
             template_kwargs: tuple[tuple[str, str], ...] = ()) -> Callable[..., tuple[list[dict], Renderer]]:
    """`prepare(messages, tools=None, documents=None, keywords=None)`: the messages as transformers
    hands them to the template, and how to render them and their prefixes (module docstring),
    given the tokenizer's special tokens, `template_kwargs` over them and a record's `keywords`
    over those, as `apply_chat_template` gives its keyword arguments. Raises what the template
    raises."""

    @functools.cache
    def compiled_and_constants():  # on first use: in the worker that renders, not where the pipeline is built
        constants = dict(transformers_tokenizer(tokenizer_dir).special_tokens_map)
        constants.update((name, json.loads(text)) for name, text in template_kwargs)
        if today is not None:
            constants[_CLOCK] = _clock(today)
        return _compiled(template), constants

    def prepare(messages: list[dict], tools: list | None = None, documents: list | None = None,
                keywords: dict | None = None) -> tuple[list[dict], Renderer]:
        compiled, constants = compiled_and_constants()
        if keywords:
            constants = {**constants, **keywords}
        as_handed = transformers_tokenizer(tokenizer_dir).apply_chat_template(
            messages, chat_template=_AS_HANDED, tools=tools, documents=documents, tokenize=False)
        handed = json.loads(as_handed)
        handed_tools, handed_documents = handed["tools"], handed["documents"]

        def render(prefix: list[dict], generation_prompt: bool = False) -> str:
            return compiled.render(messages=prefix, tools=handed_tools, documents=handed_documents,
                                   add_generation_prompt=generation_prompt, **constants)

        return handed["messages"], render

    return prepare
