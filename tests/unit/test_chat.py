"""Chats rendered with the model's own chat template (`Pipeline.render_chat`, zephon/_chat.py) and
tokenized as segments: the ids transformers' `apply_chat_template(tokenize=True)` gives, learned
exactly where its `{% generation %}` blocks say the assistant speaks, a message quoting a control
token keeping it as text, and every chat the template cannot be split on skipped by name."""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from zephon import BadRecordError, ConfigurationError, Pipeline, RecordAddress
from zephon._chat import RenderChatOp
from zephon._record_ops import TokenizeOp
from zephon._records import Chunk, ChunkRecords
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation

CONTROLS = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# ChatML, with transformers' generation blocks around what the assistant says (its content and its
# end of turn), which give `return_assistant_tokens_mask` its reference.
CHATML = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3's layout: a header of control tokens, two newlines, the content trimmed, its end of turn.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>"
    "{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# A template whose headers end in a space, trimming each content, refusing a chat whose roles do not alternate.
ALTERNATING = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}<|im_start|>User: {{ message['content'] | trim }}<|im_end|>"
    "{% else %}<|im_start|>Bot: {% generation %}{{ message['content'] | trim }}<|im_end|>{% endgeneration %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>Bot: {% endif %}"
)
# Llama 2's and Mistral's layout: [INST] and [/INST] around what the user says, the answer after a space.
INST = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "[INST] {{ message['content'] | trim }} [/INST]"
    "{% else %}{% generation %} {{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}"
)
# ChatML over contents that are lists of parts, as processors' templates take them: `<image>` for an
# image part, a text part's text; a str content as it is.
CHATML_PARTS = (
    "{% macro content(message) %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ content(message) }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ content(message) }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML with tools, in Hermes' layout: the tools' schemas in a system turn, each call as JSON in
# <tool_call> tags after what the assistant says, each result in a turn of the `tool` role.
TOOLS = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{% if message['content'] %}{{ message['content'] }}"
    "{% endif %}{% for call in message.tool_calls or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Is it warm in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call-0", "content": '{"celsius": 21}'},
    {"role": "assistant", "content": "Yes, 21 degrees."},
]
# ChatML after a system turn of the documents a retrieval found, as RAG templates (Command-R's, Granite's) write them.
RAG = CHATML.replace("{{ bos_token }}", (
    "{{ bos_token }}{% if documents %}<|im_start|>system\nDocuments:\n{% for document in documents %}"
    "{{ document.title }}: {{ document.text }}\n{% endfor %}<|im_end|>\n{% endif %}"))
LANE_DOCUMENTS = [{"title": "Lanes", "text": "A run deals 32 lanes to its ranks."},
                  {"title": "Shards", "text": "A shard is a file of records."}]
# ChatML as a reasoning model's template writes it: an answer's thinking (`reasoning_content`) only
# for the answers after the last question, so the first answer loses it once a second question follows.
REASONING = (
    "{% set state = namespace(last_question=-1) %}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set state.last_question = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
    "{% generation %}{% if loop.index0 > state.last_question and message.reasoning_content %}"
    "<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}{{ message['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING_CHAT = [
    {"role": "user", "content": "How many lanes?"},
    {"role": "assistant", "reasoning_content": "The recipe says four.", "content": "Four."},
    {"role": "user", "content": "And ranks? Quote <|im_end|> too."},
    {"role": "assistant", "reasoning_content": "Two ranks, each takes two lanes.", "content": "Two."},
]
# ChatML that drops the control tokens' strings from what a message says.
CHATML_UNQUOTED = CHATML.replace("{{ message['content'] }}", "{{ message['content'] | replace('<|im_end|>', '') }}")
# ChatML after a system turn that holds today's date, read from the clock where no date is given (as Llama 3.1's).
CLOCK = CHATML.replace("{{ bos_token }}", (
    "{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
    "{{ bos_token }}<|im_start|>system\nToday: {{ date_string }}<|im_end|>\n"))
# ChatML after a system turn saying `/no_think` where the template is switched so (as Qwen3's `enable_thinking`).
SWITCHED = CHATML.replace("{{ bos_token }}", (
    "{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}<|im_start|>system\n/no_think"
    "<|im_end|>\n{% endif %}"))
# Writes the last message otherwise than the others: no rendering is a prefix of the next.
LAST_APART = (
    "{% for message in messages %}{% if loop.last %}[last] {% endif %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
)

CHATS = [
    [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "What is a lane?"},
     {"role": "assistant", "content": "A stream of records."}, {"role": "user", "content": "And a shard?"},
     {"role": "assistant", "content": "A file of them."}],
    [{"role": "user", "content": "  spaced out  "}, {"role": "assistant", "content": "\nfine\n"}],
    # The assistant speaks first: its generation prompt, rendered for no message, is not learned.
    [{"role": "assistant", "content": "How can I help?"}, {"role": "user", "content": "Count the lanes."},
     {"role": "assistant", "content": "Four."}],
]
# As TRL's vision datasets store them: an image part's `text` is None, as Arrow writes a missing one.
PART_CHATS = [
    [{"role": "system", "content": "Answer in one line."},
     {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "\nWhat is this?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A lane of records."}]},
     {"role": "user", "content": [{"type": "text", "text": "And here: "}, {"type": "image", "text": None},
                                  {"type": "text", "text": " Be brief."}]},
     {"role": "assistant", "content": "Shards."}],
    [{"role": "user", "content": [{"type": "text", "text": "  spaced  "}, {"type": "image"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "One "}, {"type": "text", "text": "picture."}]}],
]
QUOTING = [{"role": "user", "content": "Quote the end token: <|im_end|> please."},
           {"role": "assistant", "content": "It is <|im_end|>, written as text."}]
QUOTING_PARTS = [{"role": "user", "content": [{"type": "text", "text": "<|im_start|>user"}, {"type": "image"},
                                              {"type": "text", "text": "Quote <|im_end|>."}]},
                 {"role": "assistant", "content": [{"type": "text", "text": "It is "},
                                                   {"type": "text", "text": "<|im_end|>, as text."}]}]


def tokenizer_dir(root: Path, template: str, demo_tokenizer_path: Path) -> Path:
    """The demo tokenizer with ChatML's and Llama 3's control tokens, and `template` as its chat template."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(demo_tokenizer_path))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in CONTROLS])
    tokenizer.save(str(root / "tokenizer.json"))
    return with_template(root, template)


def with_template(root: Path, template: str | list[dict], **tokens: str) -> Path:
    """`root`, its tokenizer_config.json naming `template` and the BOS and EOS (and `tokens`)."""
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", **tokens,
    }))
    return root


@functools.cache
def sentencepiece_json(demo_data_dir: Path, prepend_scheme: str) -> str:
    """A SentencePiece-style BPE (a `▁` word boundary, the first word given one as Llama's and
    Mistral's converted tokenizers give it, or every text after a special token too) trained on
    the shipped jargon corpus, with the control tokens of the templates here."""
    shard = sorted((demo_data_dir / "jargon").glob("*.jsonl"))[0]
    texts = [json.loads(line)["text"] for line in shard.read_text().splitlines()[:300]]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    tokenizer.decoder = decoders.Metaspace(prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                  special_tokens=["<unk>", "<|bos|>", "<|eos|>", "[INST]", "[/INST]", *CONTROLS])
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str()


def sentencepiece_dir(root: Path, template: str, demo_data_dir: Path, prepend_scheme: str) -> Path:
    """`tokenizer_dir` of the SentencePiece-style tokenizer."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(sentencepiece_json(demo_data_dir, prepend_scheme))
    return with_template(root, template, unk_token="<unk>")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory, demo_tokenizer_path) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("chatml"), CHATML, demo_tokenizer_path)


def run(directory: Path, records: list[dict], on_error: str = "skip", **options) -> ChunkRecords:
    """render_chat, then tokenize(segments=True), on one chunk of `records`."""
    chunk = ChunkRecords(Chunk("d", 0, 0, len(records)), [dict(r) for r in records],
                         [RecordAddress("d", "s", i) for i in range(len(records))])
    rendered = RenderChatOp(str(directory), **options).build(on_error)(chunk)
    return TokenizeOp(str(directory / "tokenizer.json"), field="segments", segments=True).build(on_error)(rendered)


def reference(directory: Path, messages: list[dict], **options) -> tuple[list[int], list[bool]]:
    """transformers' ids of the chat and its assistant mask (a token is learned as its label)."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **options)
    return list(encoded["input_ids"]), [bool(flag) for flag in encoded["assistant_masks"]]


def rendered_as_transformers_would(directory: Path, messages: list[dict], rendered_with: dict | None = None,
                                   **options) -> dict:
    """The record `messages` make through render_chat (given `rendered_with`) and tokenize, checked
    to be the ids and the mask of `reference` (given `options`), which learns some of them and not all."""
    [record] = run(directory, [{"messages": messages}], **(rendered_with or {})).records
    ids, learned = reference(directory, messages, **options)
    assert record["input_ids"].tolist() == ids
    assert record["loss_mask"].tolist() == learned
    assert any(learned) and not all(learned)
    return record


@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_a_chat_is_the_ids_apply_chat_template_gives_learned_where_the_assistant_speaks(
    tmp_path, demo_tokenizer_path, chatml, chat, template
):
    directory = chatml if template == "chatml" else tokenizer_dir(tmp_path / "llama3", LLAMA3, demo_tokenizer_path)
    record = rendered_as_transformers_would(directory, CHATS[chat])
    assert set(record) == {"input_ids", "loss_mask"}, "the messages and the segments are dropped as tokenized"


@pytest.mark.parametrize("chat", range(len(PART_CHATS)))
def test_a_chat_of_parts_is_the_ids_apply_chat_template_gives_learned_where_the_assistant_speaks(
    tmp_path, demo_tokenizer_path, chat
):
    """Contents as lists of text and image parts, handed to the template as they are, the image
    parts written as the template writes them (`<image>`, the marker `tokenize` places pictures at)."""
    directory = tokenizer_dir(tmp_path / "parts", CHATML_PARTS, demo_tokenizer_path)
    messages = PART_CHATS[chat]
    ids = rendered_as_transformers_would(directory, messages)["input_ids"].tolist()
    written = Tokenizer.from_file(str(directory / "tokenizer.json")).decode(ids, skip_special_tokens=False)
    images = sum(part["type"] == "image" for m in messages if isinstance(m["content"], list) for part in m["content"])
    assert written.count("<image>") == images and "'type'" not in written, written


def test_a_processor_s_chat_template_json_is_read_where_the_tokenizer_holds_no_template(tmp_path, demo_tokenizer_path):
    """Many vision models' directories hold their template only as a processor saves it
    (`chat_template.json`, LLaVA's and Qwen2-VL's): the chat is the ids transformers gives with it."""
    directory = tokenizer_dir(tmp_path / "processor", "", demo_tokenizer_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHATML_PARTS}))
    rendered_as_transformers_would(directory, PART_CHATS[0], chat_template=CHATML_PARTS)
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(demo_tokenizer_path.parent / "kjv"))])
    for saved, refusal in [("{", "is no processor's chat template"), ("[]", "is no processor's chat template"),
                           ('{"template": "x"}', 'holds no "chat_template" str')]:
        (directory / "chat_template.json").write_text(saved)
        with pytest.raises(ConfigurationError, match=refusal):
            Pipeline(source).render_chat(directory)


@pytest.mark.parametrize("prepend_scheme", ["first", "always"])
@pytest.mark.parametrize("template", ["chatml", "llama3", "inst"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_a_sentencepiece_tokenizer_s_chat_is_the_ids_apply_chat_template_gives(
    tmp_path, demo_data_dir, chat, template, prepend_scheme
):
    """Its word boundary starts a text encoded alone (`▁A` where the chat holds `\nA`), and `\n`
    then `\nfine` are `\n\n` in one text: encoded apart, the segments missed both; joined, the
    ids and mask are transformers'."""
    directory = sentencepiece_dir(tmp_path / template, {"chatml": CHATML, "llama3": LLAMA3, "inst": INST}[template],
                                  demo_data_dir, prepend_scheme)
    rendered_as_transformers_would(directory, [m for m in CHATS[chat] if template != "inst" or m["role"] != "system"])


@pytest.mark.parametrize("chat", ["content", "parts"])
def test_a_control_token_quoted_in_a_message_stays_text_and_the_template_s_own_are_control_ids(
    tmp_path, demo_tokenizer_path, chat
):
    """transformers' `apply_chat_template(tokenize=True)` encodes the quoted `<|im_end|>` as the
    control token, ending the user's turn inside its content; here it is the content's text, and
    each quoting text part's, whatever stands between them."""
    directory = tokenizer_dir(tmp_path / "parts", CHATML_PARTS, demo_tokenizer_path)
    messages = QUOTING if chat == "content" else QUOTING_PARTS
    [record] = run(directory, [{"messages": messages}]).records
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    start, end = (tokenizer.token_to_id(token) for token in ("<|im_start|>", "<|im_end|>"))
    ids = record["input_ids"].tolist()
    assert ids[0] == tokenizer.token_to_id("<|bos|>")
    assert ids.count(start) == 2 and ids.count(end) == 2, "one turn each for the user and the assistant"
    tokenizer.encode_special_tokens = True
    quoted = [text for m in messages for text in ([m["content"]] if isinstance(m["content"], str) else
                                                  [part["text"] for part in m["content"] if part["type"] == "text"])]
    for text in quoted:
        content = tokenizer.encode(text, add_special_tokens=False).ids
        assert any(ids[at : at + len(content)] == content for at in range(len(ids))), text
    theirs, _ = reference(directory, messages)
    assert theirs.count(end) == 4


def test_a_template_that_trims_and_ends_its_headers_with_a_space_is_split_on_the_content_it_writes(
    tmp_path, demo_tokenizer_path
):
    rendered_as_transformers_would(tokenizer_dir(tmp_path / "alternating", ALTERNATING, demo_tokenizer_path), CHATS[1])


def test_a_quoting_answer_encoded_apart_from_a_header_ending_in_a_space_takes_the_space(
    tmp_path, demo_tokenizer_path
):
    """The one seam left (`zephon._segment_encoding`): `Bot: ` then a content quoting a control
    token. The space goes with the answer's first word (` It`), as the whole chat encodes it, and
    is learned with it; left with `Bot:`, it was a token of its own, which no chat holds."""
    directory = tokenizer_dir(tmp_path / "alternating", ALTERNATING, demo_tokenizer_path)
    messages = [{"role": "user", "content": "Quote it."}, {"role": "assistant", "content": "It is <|im_end|>."}]
    [record] = run(directory, [{"messages": messages}]).records
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    header = tokenizer.encode("<|im_start|>Bot:", add_special_tokens=False).ids
    tokenizer.encode_special_tokens = True
    answer = tokenizer.encode(" It is <|im_end|>.", add_special_tokens=False).ids
    ids, learned = record["input_ids"].tolist(), record["loss_mask"].tolist()
    at = next(at for at in range(len(ids)) if ids[at : at + len(answer)] == answer)
    assert ids[at - len(header) : at] == header
    assert learned[at - len(header) : at] == [False] * len(header) and all(learned[at : at + len(answer)])
    assert tokenizer.token_to_id("Ġ") not in ids


@pytest.mark.parametrize("stored", ["list", "json"])
def test_a_tool_calling_chat_is_the_ids_apply_chat_template_gives_with_its_tools(tmp_path, demo_tokenizer_path, stored):
    """OpenAI's layout: the call's message has no content, every key of a message reaches the
    template, and the record's tools (a list, or the list as a JSON str) are its `tools`; the
    calls are learned, the results not."""
    directory = tokenizer_dir(tmp_path / "tools", TOOLS, demo_tokenizer_path)
    tools = WEATHER if stored == "list" else json.dumps(WEATHER)
    [record] = run(directory, [{"messages": TOOL_CHAT, "tools": tools}], tools_field="tools").records
    ids, learned = reference(directory, TOOL_CHAT, tools=WEATHER)
    assert record["input_ids"].tolist() == ids
    assert record["loss_mask"].tolist() == learned
    assert set(record) == {"input_ids", "loss_mask"}, "the tools' field is dropped with the messages'"
    written = Tokenizer.from_file(str(directory / "tokenizer.json")).decode(ids, skip_special_tokens=False)
    learned_text = Tokenizer.from_file(str(directory / "tokenizer.json")).decode(
        [i for i, flag in zip(ids, learned) if flag], skip_special_tokens=False)
    assert '"description": "Today\'s weather in a city."' in written
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in learned_text
    assert "celsius" not in learned_text and "celsius" in written
    [untooled] = run(directory, [{"messages": TOOL_CHAT}], tools_field="tools").records
    assert untooled["input_ids"].tolist() == reference(directory, TOOL_CHAT)[0], "a record without tools offers none"


@pytest.mark.parametrize("stored", ["list", "json"])
def test_a_record_s_documents_are_handed_to_the_template_as_apply_chat_template_hands_them(
    tmp_path, demo_tokenizer_path, stored
):
    """`documents_field`: the ids transformers gives with `documents=`, the documents not learned;
    a field that holds no list of documents is skipped by name."""
    directory = tokenizer_dir(tmp_path / "rag", RAG, demo_tokenizer_path)
    documents = LANE_DOCUMENTS if stored == "list" else json.dumps(LANE_DOCUMENTS)
    [record] = run(directory, [{"messages": CHATS[1], "documents": documents}], documents_field="documents").records
    ids, learned = reference(directory, CHATS[1], documents=LANE_DOCUMENTS)
    assert record["input_ids"].tolist() == ids and record["loss_mask"].tolist() == learned
    assert "A run deals 32 lanes" in Tokenizer.from_file(str(directory / "tokenizer.json")).decode(ids)
    assert set(record) == {"input_ids", "loss_mask"}, "the documents' field is dropped with the messages'"
    out = run(directory, [{"messages": CHATS[1], "documents": {"title": "one"}}], documents_field="documents")
    assert [reason for _, reason in out.skipped] == ["not_documents"]
    [detail] = out.skip_details["not_documents"].values()
    assert detail.startswith("field 'documents' holds {") and detail.endswith("not a list of documents "
                                                                              "({'title': ..., 'text': ...})")


def test_a_directory_of_named_templates_renders_a_chat_with_tools_with_its_tool_use_one(tmp_path, demo_tokenizer_path):
    """Hermes' and Command-R's layout: a default template and a `tool_use` one (tokenizer_config.json's
    list of named templates). A chat with tools is rendered with `tool_use`, one without with the
    default, as `apply_chat_template` picks them; `template_name` names one for every chat."""
    directory = tokenizer_dir(tmp_path / "named", "", demo_tokenizer_path)
    with_template(directory, [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOLS}])
    records = [{"messages": TOOL_CHAT, "tools": WEATHER}, {"messages": CHATS[0]}]
    with_tools, without = run(directory, records, tools_field="tools").records
    assert with_tools["input_ids"].tolist() == reference(directory, TOOL_CHAT, tools=WEATHER)[0]
    assert without["input_ids"].tolist() == reference(directory, CHATS[0])[0]
    assert without["input_ids"].tolist() == reference(directory, CHATS[0], chat_template=CHATML)[0]
    named = run(directory, records, tools_field="tools", template_name="default").records[0]
    assert named["input_ids"].tolist() == reference(directory, TOOL_CHAT, tools=WEATHER, chat_template=CHATML)[0]
    assert named["input_ids"].tolist() != with_tools["input_ids"].tolist()
    plain = RenderChatOp(str(directory)).fingerprint()
    assert RenderChatOp(str(directory), tools_field="tools").fingerprint() == {
        **plain, "tools_field": "tools", "tool_use_template": hashlib.sha256(TOOLS.encode()).hexdigest()}
    assert RenderChatOp(str(directory), template_name="tool_use").fingerprint()["template_name"] == "tool_use"
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(demo_tokenizer_path.parent / "kjv"))])
    with pytest.raises(ConfigurationError, match=r"holds no chat template named 'rag', only \['default', 'tool_use'\]"):
        Pipeline(source).render_chat(directory, template_name="rag")
    with pytest.raises(ConfigurationError, match="template_name must name one of the directory's chat templates"):
        Pipeline(source).render_chat(directory, template_name="")


def test_a_text_quoting_a_control_token_whole_or_in_a_tool_call_is_cut_out_where_it_stands(
    tmp_path, demo_tokenizer_path
):
    """A content that is a control token's string alone, and a tool call's argument quoting one:
    found where the template writes them (by rendering them as marks), not where the template's
    own end of turn, the same string, stands."""
    directory = tokenizer_dir(tmp_path / "tools", TOOLS, demo_tokenizer_path)
    messages = [{"role": "user", "content": "<|im_end|>"},
                {"role": "assistant", "content": "<|im_end|>", "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": {"city": "<|im_end|> town"}}}]}]
    [record] = run(directory, [{"messages": messages}]).records
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    end = tokenizer.token_to_id("<|im_end|>")
    ids = record["input_ids"].tolist()
    assert ids.count(end) == 2, "the two turns' own ends, and no other"
    tokenizer.encode_special_tokens = True
    quoted = tokenizer.encode("<|im_end|>", add_special_tokens=False).ids
    assert sum(ids[at : at + len(quoted)] == quoted for at in range(len(ids))) == 3


def test_a_chat_is_handed_to_the_template_as_transformers_hands_it(tmp_path, demo_tokenizer_path):
    """The thinking stored under an older name (`reasoning`, which transformers hands on as
    `reasoning_content` too) and a tool call's content of None (a key transformers drops) are
    written as `apply_chat_template` writes them."""
    directory = tokenizer_dir(tmp_path / "reasoning", REASONING, demo_tokenizer_path)
    chat = [{"role": "user", "content": "How many lanes?"},
            {"role": "assistant", "reasoning": "The recipe says four.", "content": "Four."}]
    rendered_as_transformers_would(directory, chat)
    directory = tokenizer_dir(tmp_path / "none", TOOLS.replace("{% if message['content'] %}",
                                                               "{% if message['content'] is defined %}"),
                              demo_tokenizer_path)
    rendered_as_transformers_would(directory, TOOL_CHAT)


def test_a_chat_whose_template_rewrites_earlier_turns_learns_its_last_turn_alone_where_asked(
    tmp_path, demo_tokenizer_path
):
    """A reasoning model's template drops the first answer's thinking once a second question
    follows: no rendering of the first turns is a prefix of the chat's, so the chat is skipped;
    with `on_rewrite="learn_last"` it is the chat as the template writes it, the last answer (its
    thinking included) learned, and what comes before it the context it was answered in, as
    transformers' mask has it for that answer; the question quoting `<|im_end|>` keeps it text."""
    directory = tokenizer_dir(tmp_path / "reasoning", REASONING, demo_tokenizer_path)
    skipped = run(directory, [{"messages": THINKING_CHAT}])
    assert [reason for _, reason in skipped.skipped] == ["chat_template_not_prefix"]
    [record] = run(directory, [{"messages": THINKING_CHAT}], on_rewrite="learn_last").records
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    end = tokenizer.token_to_id("<|im_end|>")
    ids, learned = record["input_ids"].tolist(), record["loss_mask"].tolist()
    theirs, their_mask = reference(directory, THINKING_CHAT)
    first_answer_end = [at for at, i in enumerate(theirs) if i == end][1]
    assert ids.count(end) == 4 and theirs.count(end) == 5, "the quoted end stays text here"
    answer = len(ids) - learned[::-1].index(False)  # where the learned tail starts
    assert ids[answer:] == theirs[len(theirs) - (len(ids) - answer):]
    assert learned[answer:] == their_mask[len(theirs) - (len(ids) - answer):] and all(learned[answer:])
    assert not any(learned[:answer]) and their_mask[first_answer_end], "the first answer is context"
    written = tokenizer.decode(ids[answer:], skip_special_tokens=False)
    assert written.startswith("<think>\nTwo ranks") and "The recipe says" not in tokenizer.decode(ids)
    out = run(directory, [{"messages": THINKING_CHAT + [{"role": "user", "content": "?"}]}], on_rewrite="learn_last")
    [detail] = out.skip_details["chat_template_not_prefix"].values()
    assert detail.endswith("; its last message ('user') is not learned"), detail


def test_a_sharegpt_chat_read_by_its_keys_and_roles_is_the_same_chat(chatml):
    """LLaVA-Instruct's and ShareGPT's `conversations` of {"from", "value"}, their roles renamed."""
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    stored = [{"from": roles[m["role"]], "value": m["content"]} for m in CHATS[0]]
    [messages] = run(chatml, [{"messages": CHATS[0]}]).records
    [sharegpt] = run(chatml, [{"conversations": stored}], field="conversations", role_key="from",
                     content_key="value", roles=(("gpt", "assistant"), ("human", "user"))).records
    assert sharegpt["input_ids"].tolist() == messages["input_ids"].tolist()
    assert sharegpt["loss_mask"].tolist() == messages["loss_mask"].tolist()
    out = run(chatml, [{"conversations": [{"role": "user", "content": "hi"}]}], field="conversations",
              role_key="from", content_key="value")
    assert list(out.skip_details["not_messages"].values()) == [
        "message 0 is {'role': 'user', 'content': 'hi'}, not a {'from': str, 'value': str or a list of parts} message"]


def test_only_the_roles_named_are_learned(chatml):
    messages = CHATS[0]
    [both] = run(chatml, [{"messages": messages}], learned_roles=("assistant", "user")).records
    [assistant] = run(chatml, [{"messages": messages}]).records
    assert both["input_ids"].tolist() == assistant["input_ids"].tolist()
    assert both["loss_mask"].sum() > assistant["loss_mask"].sum()
    assert (both["loss_mask"] | ~assistant["loss_mask"]).all(), "what the assistant learned is learned still"


def test_chats_the_template_cannot_be_split_on_are_skipped_by_name_with_what_was_wrong(
    tmp_path, chatml, demo_tokenizer_path
):
    alternating = tokenizer_dir(tmp_path / "alternating", ALTERNATING, demo_tokenizer_path)
    out = run(alternating, [{"messages": [{"role": "assistant", "content": "first"}]}, {"messages": CHATS[1]},
                            {"messages": "hello"}, {"messages": [{"role": "user"}]}, {"text": "no chat"}])
    assert len(out.records) == 1
    assert [reason for _, reason in out.skipped] == ["chat_template_error", "not_messages", "not_messages",
                                                     "missing_field"]
    details = {reason: list(found.values()) for reason, found in out.skip_details.items()}
    assert details["chat_template_error"] == [
        "rendering message 0 ('assistant'): TemplateError: roles must alternate user/assistant"]
    assert details["not_messages"] == [
        "holds 'hello', not a list of messages",
        "message 0 is {'role': 'user'}, not a {'role': str, 'content': str or a list of parts} message"]
    tools = run(alternating, [{"messages": CHATS[1], "tools": "[{"}, {"messages": CHATS[1], "tools": {"name": "x"}},
                              {"messages": [{"role": "assistant", "content": None}]}], tools_field="tools")
    assert [reason for _, reason in tools.skipped] == ["not_tools", "not_tools", "not_messages"]
    assert list(tools.skip_details["not_tools"].values()) == [
        "field 'tools' holds '[{', not JSON: Expecting property name enclosed in double quotes: line 1 column 3 "
        "(char 2)",
        "field 'tools' holds {'name': 'x'}, not a list of tools' schemas"]
    assert list(tools.skip_details["not_messages"].values()) == [
        "message 0 is {'role': 'assistant', 'content': None}, not a {'role': str, 'content': str or a list of parts} "
        "message"], "no content without tool calls: a template would write None as 'None'"
    parts = run(alternating, [{"messages": [{"role": "user", "content": ["hi"]}]},
                              {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text"}]}]}])
    assert list(parts.skip_details["not_messages"].values()) == [
        f"message 0's part {j} is {part}, not a {{'type': 'text', 'text': str}} part nor another {{'type': str}} one"
        for j, part in ((0, "'hi'"), (1, "{'type': 'text'}"))]
    assert details["missing_field"] == ["field 'messages'; fields it has: 'text'"]

    unquoted = tokenizer_dir(tmp_path / "unquoted", CHATML_UNQUOTED, demo_tokenizer_path)
    out = run(unquoted, [{"messages": QUOTING}, {"messages": CHATS[1]}])
    assert [reason for _, reason in out.skipped] == ["chat_content_not_found"]
    assert list(out.skip_details["chat_content_not_found"].values()) == [
        "message 0 ('user'): the template writes '<|bos|><|im_start|>user\\nQuote the end token:  please.<|... "
        "for its content 'Quote the end token: <|im_end|> please.'"]
    assert out.records[0]["input_ids"].tolist() == reference(unquoted, CHATS[1])[0], "a chat quoting nothing is kept"

    last_apart = tokenizer_dir(tmp_path / "last_apart", LAST_APART, demo_tokenizer_path)
    [(_, reason)] = run(last_apart, [{"messages": CHATS[1]}]).skipped
    assert reason == "chat_template_not_prefix"
    with pytest.raises(BadRecordError, match="chat_template_not_prefix"):
        run(last_apart, [{"messages": CHATS[1]}], on_error="raise")


def test_a_directory_without_a_template_and_bad_arguments_are_refused_when_the_pipeline_is_built(
    tmp_path, chatml, demo_tokenizer_path
):
    bare = tokenizer_dir(tmp_path / "bare", "", demo_tokenizer_path)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(demo_tokenizer_path.parent / "kjv"))])
    with pytest.raises(ConfigurationError, match="holds no chat template"):
        Pipeline(source).render_chat(bare)
    unclosed = tokenizer_dir(tmp_path / "unclosed", "{% for message in messages %}{{ message.content }}",
                             demo_tokenizer_path)
    with pytest.raises(ConfigurationError, match="the chat template does not compile: TemplateSyntaxError"):
        Pipeline(source).render_chat(unclosed)
    for arguments, refusal in [({"learned_roles": "assistant"}, "learned_roles must be a list of roles"),
                               ({"field": ""}, "field must be a record field's name"),
                               ({"keep_field": "no"}, "keep_field must be True or False"),
                               ({"roles": {"gpt": 1}}, "roles must map the data's roles to the template's"),
                               ({"role_key": "text", "content_key": "text"}, "both 'text'; give each its own"),
                               ({"tools_field": "messages"}, "tools_field='messages' is also the chat's field"),
                               ({"tools_field": 3}, "tools_field must be a record field's name"),
                               ({"documents_field": "segments"}, "documents_field='segments' is also the segments'"),
                               ({"tools_field": "extra", "documents_field": "extra"},
                                "documents_field='extra' is also tools_field; give the documents a field"),
                               ({"template_kwargs_field": "messages"}, "template_kwargs_field='messages' is also the "
                                                                       "chat's field; give the template's keywords"),
                               ({"on_rewrite": "learn"}, "on_rewrite must be 'skip' or 'learn_last'")]:
        with pytest.raises(ConfigurationError, match=refusal):
            Pipeline(source).render_chat(chatml, **arguments)
    [op] = Pipeline(source).render_chat(chatml, roles={"human": "user", "gpt": "assistant"}).operators
    assert op.roles == (("gpt", "assistant"), ("human", "user")), "kept as sorted pairs: one recipe for one renaming"
    [op] = Pipeline(source).render_chat(chatml, tools_field="tools").operators
    assert op.tools_field == "tools"


def test_the_template_enters_the_recipe_and_its_directory_does_not(tmp_path, chatml, demo_tokenizer_path):
    moved = tokenizer_dir(tmp_path / "moved", CHATML, demo_tokenizer_path)
    other = tokenizer_dir(tmp_path / "other", CHATML.replace("\n{% if", "\n\n{% if"), demo_tokenizer_path)
    assert RenderChatOp(str(moved)).fingerprint() == RenderChatOp(str(chatml)).fingerprint()
    assert RenderChatOp(str(other)).fingerprint() != RenderChatOp(str(chatml)).fingerprint()
    assert RenderChatOp(str(chatml), learned_roles=("user",)).fingerprint() != RenderChatOp(str(chatml)).fingerprint()
    assert RenderChatOp(str(chatml), roles=(("gpt", "assistant"),)).fingerprint() != \
        RenderChatOp(str(chatml)).fingerprint()
    assert RenderChatOp(str(chatml), documents_field="docs").fingerprint() == {
        **RenderChatOp(str(chatml)).fingerprint(), "documents_field": "docs"}
    assert RenderChatOp(str(chatml), tools_field="tools").fingerprint() == {**RenderChatOp(str(chatml)).fingerprint(),
                                                                            "tools_field": "tools"}
    assert RenderChatOp(str(chatml), on_rewrite="learn_last").fingerprint() == {
        **RenderChatOp(str(chatml)).fingerprint(), "on_rewrite": "learn_last"}


def test_a_template_that_reads_the_clock_writes_the_recipe_s_date_and_is_refused_without_one(
    tmp_path, demo_tokenizer_path
):
    """The chat is the ids transformers gives when told that date, whatever day the test runs on;
    the date enters the recipe; without one the pipeline is refused as it is built."""
    directory = tokenizer_dir(tmp_path / "clock", CLOCK, demo_tokenizer_path)
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(demo_tokenizer_path.parent / "kjv"))])
    with pytest.raises(ConfigurationError, match=r"reads today's date \(strftime_now\).*today='YYYY-MM-DD'"):
        Pipeline(source).render_chat(directory)
    record = rendered_as_transformers_would(directory, CHATS[0], {"today": "2021-12-06"}, date_string="06 Dec 2021")
    written = Tokenizer.from_file(str(directory / "tokenizer.json")).decode(record["input_ids"].tolist())
    assert "Today: 06 Dec 2021" in written
    rendered_with_python_date = rendered_as_transformers_would(
        directory, CHATS[0], {"today": "2024-07-26"}, date_string="26 Jul 2024")
    assert rendered_with_python_date["input_ids"].tolist() != record["input_ids"].tolist()
    [op] = Pipeline(source).render_chat(directory, today=datetime.date(2021, 12, 6)).operators
    assert op.fingerprint() == RenderChatOp(str(directory), today="2021-12-06").fingerprint()
    assert op.fingerprint()["today"] == "2021-12-06"
    assert RenderChatOp(str(directory), today="2024-07-26").fingerprint() != op.fingerprint()
    chatml = tokenizer_dir(tmp_path / "chatml", CHATML, demo_tokenizer_path)
    assert RenderChatOp(str(chatml), today="2024-07-26").fingerprint() == RenderChatOp(str(chatml)).fingerprint(), \
        "a date no template writes changes nothing"
    for bad in ("06/12/2021", "2021-13-01", 20211206, datetime.datetime(2021, 12, 6)):
        with pytest.raises(ConfigurationError, match="today must be a date, as 'YYYY-MM-DD'"):
            Pipeline(source).render_chat(directory, today=bad)



def test_the_clock_is_read_where_the_template_s_code_loads_it_not_where_its_text_names_it(tmp_path, demo_tokenizer_path):
    """The clock is read where jinja2 loads `strftime_now` (in a macro, a branch, a `set`), not where
    the name is only written: a comment or a quoted text needs no `today`, and a date given then
    stays out of the recipe."""
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(demo_tokenizer_path.parent / "kjv"))])
    mentions = CHATML.replace("{{ bos_token }}", "{# no strftime_now here #}{{ bos_token }}{{ '' ~ 'strftime_now' "
                                                 "| replace('strftime_now', '') }}")
    directory = tokenizer_dir(tmp_path / "mentions", mentions, demo_tokenizer_path)
    [op] = Pipeline(source).render_chat(directory).operators
    assert "today" not in RenderChatOp(str(directory), today="2021-12-06").fingerprint()
    assert op.fingerprint() == RenderChatOp(str(directory), today="2021-12-06").fingerprint()
    rendered_as_transformers_would(directory, CHATS[0])
    in_a_macro = CHATML.replace("{{ bos_token }}", "{% macro day() %}{{ strftime_now('%d') }}{% endmacro %}"
                                                   "{% if messages | length > 99 %}{{ day() }}{% endif %}{{ bos_token }}")
    directory = tokenizer_dir(tmp_path / "macro", in_a_macro, demo_tokenizer_path)
    with pytest.raises(ConfigurationError, match=r"reads today's date \(strftime_now\)"):
        Pipeline(source).render_chat(directory)
    assert RenderChatOp(str(directory), today="2021-12-06").fingerprint()["today"] == "2021-12-06"

def test_the_template_s_own_switches_are_handed_to_it_and_enter_the_recipe(tmp_path, demo_tokenizer_path):
    """`template_kwargs`, as `apply_chat_template`'s keyword arguments: the chat is the ids
    transformers gives with them; names render_chat hands itself and values that are no JSON are refused."""
    directory = tokenizer_dir(tmp_path / "switched", SWITCHED, demo_tokenizer_path)
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(demo_tokenizer_path.parent / "kjv"))])
    [op] = Pipeline(source).render_chat(directory, template_kwargs={"enable_thinking": False}).operators
    assert op.template_kwargs == (("enable_thinking", "false"),)
    switched = rendered_as_transformers_would(directory, CHATS[0], {"template_kwargs": op.template_kwargs},
                                              enable_thinking=False)
    plain = rendered_as_transformers_would(directory, CHATS[0])
    assert "/no_think" in Tokenizer.from_file(str(directory / "tokenizer.json")).decode(switched["input_ids"].tolist())
    assert len(switched["input_ids"]) > len(plain["input_ids"])
    assert op.fingerprint() == {**RenderChatOp(str(directory)).fingerprint(),
                                "template_kwargs": [["enable_thinking", "false"]]}
    for kwargs, refusal in [({"messages": []}, "may not name 'messages'"), ({"strftime_now": 1}, "may not name"),
                            ({"not a name": 1}, "may not name 'not a name'"), ([("a", 1)], "must map names to values"),
                            ({"when": datetime.date(2021, 1, 1)}, r"template_kwargs\['when'\] must be a JSON value"),
                            ({"pair": (1, 2)}, "must be a JSON value"),
                            ({"nan": float("nan")}, "must be a JSON value")]:
        with pytest.raises(ConfigurationError, match=refusal):
            Pipeline(source).render_chat(directory, template_kwargs=kwargs)


def test_a_record_s_own_template_keywords_switch_its_chat_alone(tmp_path, demo_tokenizer_path):
    """`template_kwargs_field` (TRL's `chat_template_kwargs` column): each record's keywords, a dict
    or one as a JSON str, over `template_kwargs`, its chat the ids transformers gives with them;
    a field that holds no such dict is skipped by name."""
    directory = tokenizer_dir(tmp_path / "switched", SWITCHED, demo_tokenizer_path)
    records = [{"messages": CHATS[0], "chat_template_kwargs": {"enable_thinking": False}}, {"messages": CHATS[0]},
               {"messages": CHATS[0], "chat_template_kwargs": '{"enable_thinking": false}'},
               {"messages": CHATS[0], "chat_template_kwargs": {"enable_thinking": True}},
               {"messages": CHATS[0], "chat_template_kwargs": {"messages": []}},
               {"messages": CHATS[0], "chat_template_kwargs": ["enable_thinking"]}]
    out = run(directory, records, template_kwargs_field="chat_template_kwargs",
              template_kwargs=(("enable_thinking", "false"),))
    switched, recipe_s, from_json, own = [record["input_ids"].tolist() for record in out.records]
    assert switched == recipe_s == from_json == reference(directory, CHATS[0], enable_thinking=False)[0]
    assert own == reference(directory, CHATS[0])[0] != switched, "the record's keyword over the recipe's"
    assert all(set(record) == {"input_ids", "loss_mask"} for record in out.records)
    assert [reason for _, reason in out.skipped] == ["not_template_kwargs"] * 2
    details = list(out.skip_details["not_template_kwargs"].values())
    assert details[0].startswith("field 'chat_template_kwargs' holds {'messages': []}: its keywords may not name "
                                 "'messages': a name the template reads"), details[0]
    assert details[1] == ("field 'chat_template_kwargs' holds ['enable_thinking'], not a dict of the template's "
                          "keywords"), details[1]
    plain = RenderChatOp(str(directory)).fingerprint()
    assert RenderChatOp(str(directory), template_kwargs_field="kw").fingerprint() == {
        **plain, "template_kwargs_field": "kw"}


def write_chats(root: Path, count: int) -> Path:
    root.mkdir()
    lines = []
    for k in range(count):
        messages = [{"role": "user", "content": f"Question {k}: " + "lane " * (k % 7)},
                    {"role": "assistant", "content": f"Answer {k}." + " shard" * (k % 5)}]
        lines.append(json.dumps({"messages": messages}))
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_a_pipeline_of_chats_gives_the_same_batches_on_every_runner_and_learns_the_answers(
    tmp_path, chatml
):
    """Planned by the tokens the chats' sample renders to, on the inline, thread and process runners."""
    corpus = write_chats(tmp_path / "chats", 40)
    digests, learned = {}, {}
    for runner in ("inline", "thread", "process"):
        source = StaticMixtureWorkSource([Dataset.from_path("chats", str(corpus))], records_per_chunk=4, num_epochs=1,
                                         token_estimation=TokenEstimation(sample_records=8))
        pipeline = (Pipeline(source).options(num_lanes=2, runner=runner)
                    .render_chat(chatml, parallelism=2)
                    .tokenize(str(chatml / "tokenizer.json"), field="segments", segments=True, parallelism=2)
                    .pack_flat(64).batch(2))
        with pipeline.shard(0, 1) as loader:
            batches = list(loader)
            digests[runner] = [b.digest() for b in batches]
            learned[runner] = loader.stats()["mixture"]["chats"]["learned"]
        assert learned[runner] == sum(int((b.tokens["labels"] != -100).sum()) for b in batches)
    assert digests["inline"] == digests["thread"] == digests["process"]
    expected = sum(sum(reference(chatml, json.loads(line)["messages"])[1])
                   for line in (corpus / "chats.jsonl").read_text().splitlines())
    assert learned["inline"] == expected, "every answer token and end of turn, and nothing else"
    assert np.unique(list(learned.values())).size == 1
