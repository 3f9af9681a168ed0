"""Tokenizer for the speculant inference engine.

The decoder is our own; this module only turns text into token ids and back, and renders chat
templates (`chat_template`). Two sources are supported:

* GGUF files: the tokenizer lives in the ``tokenizer.ggml.*`` metadata and
  ``tokenizer.chat_template``. The first load converts it with transformers' own GGUF tokenizer
  conversion (metadata only, tensors are never read), so ids match
  ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` exactly. The result is cached next to
  the GGUF file (`tokenizer_cache`); later loads only need the ``tokenizers`` library and take a
  fraction of a second.
* Hugging Face model directories (``tokenizer.json``, ``tokenizer_config.json``, ...), loaded
  through ``AutoTokenizer`` when transformers is installed, else straight from ``tokenizer.json``.

Decoding, encoding and chat rendering follow transformers' semantics, but at run time only
``tokenizers`` and ``jinja2`` are used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers

from speculant.models import chat_template as templates
from speculant.models import tokenizer_cache
from speculant.models.integrity import file_sha256

__all__ = ["Tokenizer", "TokenizerError"]

logger = logging.getLogger(__name__)

# Tokens that end a turn/generation in common chat formats. llama.cpp treats the same set as
# end-of-generation when the vocabulary has them as control tokens; we add them when they are
# special (added) tokens of the vocabulary.
_END_OF_TURN_TOKENS = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "<|end\u2581of\u2581sentence|>",
)

# Attributes transformers exposes to chat templates as variables (special_tokens_map).
_SPECIAL_TOKEN_ATTRS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Files whose presence means a directory carries a tokenizer.
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)


class TokenizerError(RuntimeError):
    """A tokenizer could not be loaded or used."""


class NoTokenizerError(TokenizerError):
    """A GGUF file that carries no tokenizer (`tokenizer.ggml.model` "none", or no token
    list): its model runs on token ids."""


class Tokenizer:
    """Text <-> token ids, with transformers-compatible semantics.

    Build with :meth:`from_gguf` or :meth:`from_hf_dir`.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    eos_token_ids: frozenset[int]
    chat_template: str | None
    special_tokens_map: dict[str, str]

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens_map: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        source: str = "",
        vocab_size: int | None = None,
        fingerprint: str | None = None,
    ) -> None:
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self.source = source
        self.special_tokens_map = {
            k: str(v) for k, v in (special_tokens_map or {}).items() if v is not None
        }
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces

        if vocab_size is None:
            vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.vocab_size = int(vocab_size)
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.pad_token_id = self._special_id("pad_token")
        self.unk_token_id = self._special_id("unk_token")

        eos = {int(i) for i in eos_token_ids if 0 <= int(i) < self.vocab_size}
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids = frozenset(eos)

        self._fingerprint: str | None = fingerprint
        self._template_lock = threading.Lock()
        self._compiled_template: Any = None

    # ------------------------------------------------------------------ basics

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos_token_id={self.bos_token_id}, eos_token_ids={sorted(self.eos_token_ids)})"
        )

    def __len__(self) -> int:
        return self.vocab_size

    def _special_id(self, attr: str) -> int | None:
        token = self.special_tokens_map.get(attr)
        if token is None:
            return None
        return self._backend.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (what ``skip_special_tokens`` drops)."""
        return frozenset(
            i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; same as transformers' ``tokenizer.encode``."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encs = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; same as transformers' ``tokenizer.decode``."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = _clean_up_tokenization(text)
        return text

    def tokens(self) -> list[str | None]:
        """The vocabulary in id order: token i's string (None for an id without one)."""
        by_id: list[str | None] = [None] * self.vocab_size
        for token, idx in self._backend.get_vocab(with_added_tokens=True).items():
            by_id[idx] = token
        return by_id

    def fingerprint(self) -> str:
        """sha256 (hex) of the full ordered vocabulary, id -> token string (an EAGLE head
        records its target's)."""
        if self._fingerprint is None:
            blob = json.dumps(self.tokens(), ensure_ascii=False, separators=(",", ":"))
            self._fingerprint = hashlib.sha256(blob.encode("utf-8")).hexdigest()
        return self._fingerprint

    # ------------------------------------------------------------ chat template

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` like transformers' ``apply_chat_template(..., tokenize=False)``.

        Extra keyword arguments become template variables (e.g. ``enable_thinking=False``).
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise TokenizerError(f"{self.source or 'this tokenizer'} has no chat template")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        source = (
            f"the chat template of {self.source or 'this tokenizer'}"
            if chat_template is None
            else "the chat template given"
        )
        try:
            if chat_template is None:
                with self._template_lock:
                    if self._compiled_template is None:
                        self._compiled_template = templates.compile_template(template)
                    compiled = self._compiled_template
            else:
                compiled = templates.compile_template(template)
            return templates.render(
                compiled,
                messages,
                special_tokens_map=self.special_tokens_map,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                variables=kwargs,
            )
        except jinja2.TemplateError as exc:  # one line naming the template
            raise templates.ChatTemplateError(f"{source} failed: {exc}") from None

    # ----------------------------------------------------------------- loaders

    @classmethod
    def from_gguf(
        cls, path: str | Path, *, use_cache: bool = True, source_sha256: str | None = None
    ) -> Tokenizer:
        """Tokenizer stored in a GGUF file's metadata (cached in ``<stem>.tokenizer/``).

        The cache files are bound to ``source_sha256``, the GGUF's digest (the verified one
        when the caller checked it; by default the file's own, remembered beside it by size
        and mtime), and checked against their digest records before they are read."""
        path = Path(path)
        try:
            st = path.stat()
        except OSError as e:
            raise TokenizerError(f"cannot read GGUF file {path}: {e}") from e
        if not use_cache:
            backend_json, meta = _convert_gguf(path)
            return _from_meta(tokenizers.Tokenizer.from_str(backend_json), meta, source=str(path))
        if source_sha256 is None:
            source_sha256 = file_sha256(path, progress=False)
        cache_dir = tokenizer_cache.cache_dir(path)
        key = tokenizer_cache.cache_key(st)
        cached = tokenizer_cache.load(cache_dir, key, path, source_sha256)
        if cached is not None:
            return _from_meta(*cached, source=str(path))
        backend_json, meta = _convert_gguf(path)
        tok = _from_meta(tokenizers.Tokenizer.from_str(backend_json), meta, source=str(path))
        full_meta = {**meta, "vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint()}
        tokenizer_cache.write(cache_dir, key, backend_json, full_meta, path, source_sha256)
        return tok

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer | None:
        """Tokenizer of a Hugging Face model directory, or None if it has no tokenizer files."""
        path = Path(path)
        if not path.is_dir() or not any((path / f).is_file() for f in _HF_TOKENIZER_FILES):
            return None
        extra_eos = _hf_config_eos_ids(path)
        try:
            hf_tok = _auto_tokenizer(str(path))
        except ImportError:
            hf_tok = None
        except Exception as e:
            if not (path / "tokenizer.json").is_file():
                raise TokenizerError(f"cannot load the tokenizer of {path}: {e}") from e
            logger.warning("transformers could not load %s (%s); using tokenizer.json", path, e)
            hf_tok = None
        if hf_tok is not None:
            backend_json, meta = _meta_from_hf_tokenizer(hf_tok, extra_eos)
            return _from_meta(tokenizers.Tokenizer.from_str(backend_json), meta, source=str(path))
        return _hf_dir_without_transformers(path, extra_eos)


# ====================================================================== helpers


def _clean_up_tokenization(text: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and "content" in value:
        return str(value["content"])
    content = getattr(value, "content", None)
    return str(content) if content is not None else str(value)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _hf_config_eos_ids(path: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(path / name) or {}
        ids += _as_id_list(cfg.get("eos_token_id"))
        text_cfg = cfg.get("text_config")
        if isinstance(text_cfg, dict):
            ids += _as_id_list(text_cfg.get("eos_token_id"))
    return ids


def _end_of_turn_ids(backend: tokenizers.Tokenizer) -> list[int]:
    """Ids of well-known end-of-turn tokens that are special tokens of this vocabulary."""
    special = {
        tok.content: i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
    }
    return [special[t] for t in _END_OF_TURN_TOKENS if t in special]


def _from_meta(backend: tokenizers.Tokenizer, meta: Mapping[str, Any], source: str) -> Tokenizer:
    return Tokenizer(
        backend,
        special_tokens_map=meta.get("special_tokens_map") or {},
        eos_token_ids=meta.get("eos_token_ids") or (),
        chat_template=meta.get("chat_template"),
        clean_up_tokenization_spaces=bool(meta.get("clean_up_tokenization_spaces", False)),
        source=source,
        vocab_size=meta.get("vocab_size"),
        fingerprint=meta.get("fingerprint"),
    )


def _hf_dir_without_transformers(path: Path, extra_eos: Sequence[int]) -> Tokenizer:
    """Load ``tokenizer.json`` + ``tokenizer_config.json`` without transformers (fallback)."""
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise TokenizerError(
            f"{path} has no tokenizer.json; transformers is needed to convert its tokenizer"
        )
    backend = tokenizers.Tokenizer.from_file(str(tj))
    cfg = _read_json(path / "tokenizer_config.json") or {}
    special: dict[str, str] = {}
    for attr in _SPECIAL_TOKEN_ATTRS:
        tok = _token_content(cfg.get(attr))
        if tok is not None:
            special[attr] = tok
    template = templates.pick_template(cfg.get("chat_template"))
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        tj_cfg = _read_json(path / "chat_template.json") or {}
        template = templates.pick_template(tj_cfg.get("chat_template"))
    meta = {
        "special_tokens_map": special,
        "eos_token_ids": sorted(set(extra_eos) | set(_end_of_turn_ids(backend))),
        "chat_template": template,
        "clean_up_tokenization_spaces": bool(cfg.get("clean_up_tokenization_spaces", False))
        and type(backend.model).__name__ != "BPE",
    }
    return _from_meta(backend, meta, source=str(path))


# ------------------------------------------------------------ transformers route


def _auto_tokenizer(path: str, gguf_file: str | None = None) -> Any:
    """``AutoTokenizer.from_pretrained`` for a local dir (raises ImportError without it)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except ValueError as e:
        # transformers reads a GGUF file's model config to pick a tokenizer class and
        # refuses architectures it cannot load (granite, smollm3, olmo2): the generic
        # fast tokenizer reads the same tokenizer metadata without it.
        if gguf_file is None or "is not supported" not in str(e):
            raise
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)


def _meta_from_hf_tokenizer(hf_tok: Any, extra_eos: Sequence[int]) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, meta) from a transformers fast tokenizer."""
    backend = getattr(hf_tok, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(f"{type(hf_tok).__name__} is not backed by a `tokenizers` tokenizer")
    backend_json: str = backend.to_str()
    special = {
        attr: str(v) for attr, v in dict(hf_tok.special_tokens_map).items() if isinstance(v, str)
    }
    clean_up = bool(getattr(hf_tok, "clean_up_tokenization_spaces", False))
    if clean_up and type(backend.model).__name__ == "BPE":
        # transformers ignores the clean-up for BPE models unless forced
        clean_up = bool(
            getattr(
                hf_tok,
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                False,
            )
        )
    template = hf_tok.chat_template
    if not isinstance(template, str):
        template = templates.pick_template(template)
    eos = list(extra_eos) + list(_end_of_turn_ids(backend))
    if hf_tok.eos_token_id is not None:
        eos.append(int(hf_tok.eos_token_id))
    meta: dict[str, Any] = {
        "special_tokens_map": special,
        "eos_token_ids": sorted(set(eos)),
        "chat_template": template,
        "clean_up_tokenization_spaces": clean_up,
    }
    return backend_json, meta


def _convert_gguf(path: Path) -> tuple[str, dict[str, Any]]:
    """Convert a GGUF file's tokenizer with transformers (metadata only)."""
    md = read_gguf_metadata(path)
    if md.get("tokenizer.ggml.model") == "none" or "tokenizer.ggml.tokens" not in md:
        raise NoTokenizerError(f"{path} has no tokenizer in its metadata")
    extra_eos: list[int] = []
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        extra_eos += _as_id_list(md.get(key))
    # Load from a private dir holding only a link to the file, so that stray config or tokenizer
    # files next to the GGUF cannot leak into the conversion.
    with tempfile.TemporaryDirectory(prefix="speculant-gguf-") as tmp:
        link = Path(tmp) / path.name
        try:
            os.symlink(path.resolve(), link)
            where, name = tmp, path.name
        except OSError:
            where, name = str(path.parent), path.name
        try:
            hf_tok = _auto_tokenizer(where, gguf_file=name)
        except ImportError as e:
            raise TokenizerError(
                "transformers is needed to convert a GGUF tokenizer the first time"
            ) from e
        except Exception as e:  # the conversion's own errors, of any type: one line
            raise TokenizerError(
                f"{path}: its tokenizer metadata cannot be converted: {type(e).__name__}: {e}"
            ) from None
    backend_json, meta = _meta_from_hf_tokenizer(hf_tok, extra_eos)
    if meta["chat_template"] is None and isinstance(md.get("tokenizer.chat_template"), str):
        meta["chat_template"] = md["tokenizer.chat_template"]
    return backend_json, meta


# ----------------------------------------------------------- GGUF metadata


def read_gguf_metadata(path: str | Path, string_arrays: bool = False) -> dict[str, Any]:
    """The key/value metadata of a GGUF file, without touching tensor data. String
    arrays are returned as lists when ``string_arrays`` is set, else as their length."""
    from speculant.models.gguf_file import GGUFError, read_gguf

    try:
        return read_gguf(path, string_arrays=string_arrays).metadata
    except GGUFError as exc:
        raise TokenizerError(str(exc)) from exc
