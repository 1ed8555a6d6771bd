"""What rendering chats with the model's template costs (`render_chat`), against tokenizing the
segments it writes: the renderer's work runs on the runner's workers beside tokenize's.

200 chats of 2 to 8 messages (a system prompt, then alternating user and assistant turns of 5 to 60
words) in ChatML, with the shipped tokenizer given ChatML's control tokens. Each round runs
`render_chat` on the chats as one chunk, then `tokenize(segments=True)` on what it wrote;
`extra_info` records µs per chat and ns per token of each, the fastest of 5 rounds.
`test_long_chats` does the same on 20 chats of 8, 32 and 128 messages.

    pytest benchmarks/test_chat_bench.py --benchmark-only
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from zephon._chat import RenderChatOp
from zephon._record_ops import TokenizeOp
from zephon._records import Chunk, ChunkRecords, RecordAddress

DATA = Path(__file__).resolve().parent.parent / "zephon" / "data"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATS = 200
LONG_CHATS = 20
ROUNDS = 5
WORDS = "lane shard chunk token pack shuffle batch flush replay seed mixture rank epoch record row".split()


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chatml")
    tokenizer = Tokenizer.from_file(str(DATA / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in ("<|im_start|>", "<|im_end|>")])
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "chat_template": CHATML, "eos_token": "<|eos|>"}))
    return root


def _chats() -> list[dict]:
    rng = random.Random(5)
    out = []
    for _ in range(CHATS):
        messages = [{"role": "system", "content": "Answer briefly."}]
        for turn in range(rng.randint(1, 7)):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
            messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": words.capitalize() + "."})
        out.append({"messages": messages})
    return out


def _chunk(records: list[dict]) -> ChunkRecords:
    return ChunkRecords(Chunk("d", 0, 0, len(records)), [dict(r) for r in records],
                        [RecordAddress("d", "s", i) for i in range(len(records))])


def _render_then_tokenize(benchmark, record_build, chatml_dir: Path, chats: list[dict]) -> None:
    """Times `render_chat` then `tokenize(segments=True)` on `chats` as one chunk."""
    render = RenderChatOp(str(chatml_dir)).build("skip")
    tokenize = TokenizeOp(str(chatml_dir / "tokenizer.json"), field="segments", segments=True).build("skip")
    rendering, tokenizing, tokens = [], [], []

    def run():
        started = time.perf_counter()
        rendered = render(_chunk(chats))
        between = time.perf_counter()
        tokenized = tokenize(rendered)
        rendering.append(between - started)
        tokenizing.append(time.perf_counter() - between)
        tokens.append(sum(len(r["input_ids"]) for r in tokenized.records))

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    assert len(set(tokens)) == 1
    record_build.update(
        chats=len(chats), tokens=tokens[0],
        render_us_per_chat=min(rendering) / len(chats) * 1e6, tokenize_us_per_chat=min(tokenizing) / len(chats) * 1e6,
        render_ns_per_token=min(rendering) / tokens[0] * 1e9, tokenize_ns_per_token=min(tokenizing) / tokens[0] * 1e9,
    )


def test_render_chat_then_tokenize(benchmark, record_build, chatml_dir) -> None:
    _render_then_tokenize(benchmark, record_build, chatml_dir, _chats())


@pytest.mark.parametrize("messages", [8, 32, 128])
def test_long_chats(benchmark, record_build, chatml_dir, messages: int) -> None:
    """20 chats of `messages` alternating turns of 60 words: rendering renders ~1.5 prefixes a
    message, each through the whole prefix, so its cost a chat grows with the square of the
    messages, tokenizing's with their number."""
    rng = random.Random(messages)
    chats = [{"messages": [{"role": ("user", "assistant")[turn % 2],
                            "content": " ".join(rng.choice(WORDS) for _ in range(60)).capitalize() + "."}
                           for turn in range(messages)]} for _ in range(LONG_CHATS)]
    _render_then_tokenize(benchmark, record_build, chatml_dir, chats)
