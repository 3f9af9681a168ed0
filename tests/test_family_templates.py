"""Each family's published chat template, read from a GGUF file's metadata, renders
exactly as transformers renders it: Llama 3.1, Qwen3 (thinking on and off, and an
assistant turn with its reasoning), Phi-3.5, Gemma 2 (which refuses a system turn),
Granite 3.3 and SmolLM3 (its /think and /no_think system flags).

The templates are the model authors' own, held as files in tests/templates/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_writer import write_gguf

from speculant.models.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = ["llama3", "qwen3", "phi3", "gemma2", "granite", "smollm3"]

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Write add(a, b) in Python."}
ANSWER = {"role": "assistant", "content": "def add(a, b):\n    return a + b"}
AGAIN = {"role": "user", "content": "Now subtract."}
THOUGHT = {**ANSWER, "reasoning_content": "Two numbers in, their sum out."}
CHATS: dict[str, list[dict[str, Any]]] = {
    "one turn": [USER],
    "with system": [SYSTEM, USER],
    "multi-turn": [SYSTEM, USER, ANSWER, AGAIN],
    "no system multi-turn": [USER, ANSWER, AGAIN],
    "reasoning turn": [USER, THOUGHT, AGAIN],
}
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "qwen3": [{}, {"enable_thinking": False}, {"enable_thinking": True}],
    "smollm3": [{}, {"enable_thinking": False}],
}


@pytest.fixture(scope="module")
def tokenizers_by_family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    from test_archs import hf_model

    model = hf_model("qwen3")
    root = tmp_path_factory.mktemp("templates")
    out = {}
    for family in FAMILIES:
        template = (TEMPLATES / f"{family}.jinja").read_text()
        path = write_gguf(model, root / f"{family}.gguf", "F32", chat_template=template)
        out[family] = Tokenizer.from_gguf(path, use_cache=False)
    return out


def transformers_render(
    template: str, chat: list[dict[str, Any]], specials: dict[str, str], **kwargs: Any
) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[chat], chat_template=template, **specials, **kwargs
    )
    return str(rendered[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_template_renders_like_transformers(
    family: str, tokenizers_by_family: dict[str, Tokenizer]
) -> None:
    import jinja2

    tok = tokenizers_by_family[family]
    template = (TEMPLATES / f"{family}.jinja").read_text()
    assert tok.chat_template == template  # read from the file's metadata, unchanged
    specials = dict(tok.special_tokens_map)
    rendered = 0
    for name, chat in CHATS.items():
        for variables in VARIANTS.get(family, [{}]):
            for prompt in (True, False):
                try:
                    want = transformers_render(
                        template, chat, specials, add_generation_prompt=prompt, **variables
                    )
                except jinja2.TemplateError as exc:  # the template refuses this chat
                    with pytest.raises(jinja2.TemplateError, match=str(exc)[:40]):
                        tok.apply_chat_template(chat, add_generation_prompt=prompt, **variables)
                    continue
                got = tok.apply_chat_template(chat, add_generation_prompt=prompt, **variables)
                assert got == want, (name, variables, prompt)
                rendered += 1
    assert rendered >= 6  # most chats render: the comparison is not vacuous


def test_thinking_switch_changes_qwen3_and_smollm3(
    tokenizers_by_family: dict[str, Tokenizer],
) -> None:
    """The variables reach the template: thinking off renders differently."""
    for family in ("qwen3", "smollm3"):
        tok = tokenizers_by_family[family]
        on = tok.apply_chat_template([USER], enable_thinking=True)
        off = tok.apply_chat_template([USER], enable_thinking=False)
        assert on != off, family
    assert "<think>\n\n</think>" in tokenizers_by_family["qwen3"].apply_chat_template(
        [USER], enable_thinking=False
    )


def test_gemma2_refuses_a_system_turn(tokenizers_by_family: dict[str, Tokenizer]) -> None:
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="System role not supported"):
        tokenizers_by_family["gemma2"].apply_chat_template([SYSTEM, USER])
