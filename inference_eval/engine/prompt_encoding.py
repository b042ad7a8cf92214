"""Turning a user's prompt (text, chat messages or token ids) into token ids."""
from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer, prompt: Any, chat: bool = True) -> list[int]:
    """str -> chat-templated (or plain) ids; [{"role","content"}...] -> chat-templated ids;
    [int, ...] -> as is. Raises ValueError on an empty or malformed prompt."""
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; this target has none (pass token ids)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        messages = [{"role": "user", "content": prompt}] if chat else None
        if messages is None:
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        messages = list(prompt)
        if not messages:
            raise ValueError("the prompt has no messages")
        for j, m in enumerate(messages):
            if not isinstance(m.get("content"), str) or "role" not in m:
                raise ValueError(f"message {j} needs a 'role' and a string 'content'")
    else:
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")
    if getattr(tokenizer, "chat_template", None) is None:
        text = "\n".join(m["content"] for m in messages)
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
