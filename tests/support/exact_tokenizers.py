"""Small Hugging Face tokenizers (and chat templates) that the tests and the gateway benchmark build
themselves, no downloads: a word-level one and a byte-level BPE trained on a fixed corpus.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WORDS = ["the", "sky", "is", "blue", "why", "be", "brief", "once", "upon", "a", "time", "tool", "call", "weather", "in", "paris"]

# The word-level tokenizer's template in tests/gateway/test_pd.py.
SIMPLE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# ChatML with a default system prompt, tools as JSON, .strip() and loop variables.
CHATML = """{%- if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are helpful.{% endif %}

Tools: {{ tools | tojson }}<|im_end|>
{% elif messages[0]['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if not (message.role == 'system' and loop.first and tools) %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}{{ message.content.strip() }}{% endif %}
{%- if message.tool_calls is defined and message.tool_calls %}
{%- for tc in message.tool_calls %}
<tool_call>{{ tc.function | tojson(indent=2) }}</tool_call>
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Llama 2 style: alternating roles enforced with raise_exception, bos/eos tokens, namespace.
LLAMA2 = """{%- set ns = namespace(sys='') %}
{%- if messages[0]['role'] == 'system' %}{% set ns.sys = '<<SYS>>\\n' + messages[0]['content'] | trim + '\\n<</SYS>>\\n\\n' %}{% set msgs = messages[1:] %}
{%- else %}{% set msgs = messages %}{% endif %}
{%- for message in msgs %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- if message['role'] == 'user' %}
{{- bos_token + '[INST] ' + (ns.sys if loop.first else '') + message['content'] | trim + ' [/INST]' }}
{%- elif message['role'] == 'assistant' %}
{{- ' ' + message['content'] | trim + ' ' + eos_token }}
{%- endif %}
{%- endfor %}
{%- if enable_thinking is defined and enable_thinking %}<think>{% endif %}"""


def build_word_level(path: Path, template: Any = SIMPLE) -> str:
    """The word-level tokenizer of the exact-mode gateway tests (whitespace split, [UNK] for the rest)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    words = ["<s>", "</s>", "[UNK]", "<|user|>", "<|assistant|>", "<|system|>", *WORDS]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
    return str(path)


def build_byte_level_bpe(path: Path, template: Any = CHATML, vocab_size: int = 400, corpus: Sequence[str] = ()) -> str:
    """A byte-level BPE (GPT-2 style pre-tokenizer regex, NFC normalizer, special tokens, a BOS
    post-processor so completions prompts get one) trained on a fixed corpus (plus ``corpus``): deterministic."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [*corpus] + [
        " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) + f" {i} {i * 31 % 97}, é ü 日本 😀 \n\t<tool_call>"
        for i in range(200)
    ]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path / "tokenizer.json"))
    cfg = {"chat_template": template, "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(path)
