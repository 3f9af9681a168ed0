"""`Model`: a decoder plus its tokenizer, and `load_model` that finds and loads one."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from speculant import native
from speculant.cache import KVCache
from speculant.models import weight_cache
from speculant.models.config import ModelConfig
from speculant.models.decoder import Transformer, Weights
from speculant.models.integrity import check_folder_integrity, check_integrity, file_sha256
from speculant.models.loader import (
    ModelLoadError,
    builtin_model_path,
    load_gguf,
    load_gguf_native,
    load_hf_dir,
)
from speculant.models.segment import Segment
from speculant.models.tokenizer import NoTokenizerError, Tokenizer

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# Weight-only formats with bfloat16 activations: int8 (per-channel scales, half the
# bytes of bf16 per token, the format of choice for a draft model on CPU) and int4
# (group-wise, 5 bits a weight).
QUANTIZED = {"int8": torch.bfloat16, "int4": torch.bfloat16, "gguf": torch.float32}
# "gguf": the file's own quantized blocks executed as stored by the native kernels
# (speculant.native), float32 activations; falls back to int8 when the kernels are missing.
DTYPE_NAMES = ("bfloat16", "float32", "int8", "int4", "gguf")
KV_DTYPE_NAMES = ("auto", "float32", "float16")  # the caches' element types (load_model)


class Model:
    """A loaded model: `net` runs tokens, `tokenizer` (may be None for a bare HF folder)."""

    def __init__(
        self,
        name: str,
        config: ModelConfig,
        net: Transformer,
        tokenizer: Tokenizer | None,
        source: Path | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.net = net
        self.tokenizer = tokenizer
        self.source = source
        self.weight_format = net.weights.weight_format  # "int8", "int4" or None
        self.int8 = self.weight_format is not None  # quantized weights (int8 or int4)

    @property
    def dtype_name(self) -> str:
        """The weights' format: int8, int4, or the activation dtype's name."""
        return self.weight_format or str(self.dtype).removeprefix("torch.")

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({self.name!r}, arch={c.arch}, layers={c.n_layers}, dim={c.dim}, "
            f"dtype={self.dtype_name})"
        )

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype (bfloat16 for int8-weight models)."""
        return self.net.dtype

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, capacity: int, kv_dtype: torch.dtype | None = None) -> KVCache:
        return self.net.new_cache(capacity, kv_dtype)

    def forward(self, token_ids: Sequence[int] | Tensor, cache: KVCache, start: int) -> Tensor:
        """Logits [T, vocab] float32 for tokens at positions start .. start+T-1."""
        tokens = torch.as_tensor(token_ids, dtype=torch.long)
        logits, _ = self.net.forward(tokens, cache, start)
        assert logits is not None
        return logits

    def forward_batch(self, batch: Sequence[tuple[Sequence[int], KVCache, int]]) -> list[Tensor]:
        """Several sequences in one pass: (token_ids, cache, start) each, logits
        [T_i, vocab] float32 each; bitwise the same as running each alone."""
        segments = [
            Segment(torch.as_tensor(list(ids), dtype=torch.long), cache, start)
            for ids, cache, start in batch
        ]
        logits, _ = self.net.forward_batch(segments)
        assert logits is not None
        return logits

    def verify(
        self, segments: Sequence[Segment], *, features: bool = False
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        """The scheduler's one target pass: every running sequence's verify segment (the
        last committed token and its drafts, a chain or a tree) and prompt chunks
        (`Segment.logits=False`), each against its own cache, in one batched pass.

        Returns (logits [T_i, vocab] float32 per segment, empty for prompt chunks; with
        `features`, the final-normed hidden states [T_i, dim] per segment, else None).
        A chain segment's cache then holds its T_i rows; a tree segment's keeps its
        earlier rows and leaves the nodes' keys and values in `tree_kv`: commit the
        accepted rows with `KVCache.commit`."""
        logits, hidden = self.net.forward_batch(list(segments), return_hidden=features)
        assert logits is not None
        return logits, hidden

    def prefill(
        self,
        token_ids: Sequence[int],
        cache: KVCache,
        start: int = 0,
        chunk: int = 256,
        *,
        return_hidden: bool = False,
    ) -> Tensor | None:
        """Write the cache for token_ids at start.. without computing logits; with
        return_hidden, return their final-normed features [n, dim] (EAGLE drafting)."""
        hidden = []
        for i in range(0, len(token_ids), chunk):
            part = torch.as_tensor(token_ids[i : i + chunk], dtype=torch.long)
            _, h = self.net.forward(
                part, cache, start + i, logits=False, return_hidden=return_hidden
            )
            if h is not None:
                hidden.append(h)
        if not return_hidden:
            return None
        if not hidden:
            return torch.zeros(0, self.config.dim, dtype=self.dtype)
        return torch.cat(hidden)


def parse_dtype(dtype: str | torch.dtype) -> tuple[torch.dtype, str | None]:
    """(activation dtype, weight format "int8" / "int4" or None) for a dtype name."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype, None
        raise ValueError(f"dtype {dtype} is not supported: use one of {', '.join(DTYPE_NAMES)}")
    if dtype in QUANTIZED:
        return QUANTIZED[dtype], dtype
    if dtype == "auto":
        return torch.float32, "auto"  # resolved against the source in load_model
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported: use one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[dtype], None


def load_model(
    name_or_path: str | Path,
    dtype: str | torch.dtype = "auto",
    progress: bool = True,
    trust_unverified: bool = False,
    auto_fallback: str = "bfloat16",
    kv_dtype: str = "auto",
) -> Model:
    """Load a registry name (pulled on first use), a .gguf file or a Hugging Face folder.

    dtype "auto" (the default, as on the command line) is "gguf" for a .gguf source (its
    own quantized blocks on the native kernels, or int8 where they are unavailable) and
    `auto_fallback` for a folder; "bfloat16", "float32", "int8" and "int4" choose.

    kv_dtype is the key/value caches' element type: "auto" (the activations' dtype),
    "float32", or "float16" (native kernels only: keys and values rounded to float16 as
    they are written, attention computing in float32 over them).

    A GGUF file that the registry or a manifest.json beside it vouches for is checked
    against that SHA-256 before loading; a mismatch is refused unless trust_unverified."""
    torch_dtype, quant = parse_dtype(dtype)
    if kv_dtype not in KV_DTYPE_NAMES:
        raise ValueError(f"kv_dtype={kv_dtype!r}: use one of {', '.join(KV_DTYPE_NAMES)}")
    if auto_fallback not in DTYPE_NAMES:
        raise ValueError(f"auto_fallback={auto_fallback!r}: use one of {', '.join(DTYPE_NAMES)}")
    path = Path(name_or_path).expanduser()
    if path.exists():
        return _load_path(
            path, torch_dtype, quant, progress, path.name, trust_unverified, auto_fallback, kv_dtype
        )
    text = str(name_or_path)
    gguf_path = builtin_model_path(text, progress)  # pulled on first use
    return _load_path(
        gguf_path, torch_dtype, quant, progress, text, trust_unverified, auto_fallback, kv_dtype
    )


def _load_path(
    path: Path,
    dtype: torch.dtype,
    quant: str | None,
    progress: bool,
    name: str,
    trust: bool,
    auto_fallback: str = "bfloat16",
    kv_dtype: str = "auto",
) -> Model:
    t0 = time.perf_counter()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            path = ggufs[0]
    if quant == "auto":
        dtype, quant = parse_dtype("gguf" if path.suffix == ".gguf" else auto_fallback)
    kernels = ""
    if quant == "gguf":
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"dtype gguf runs a .gguf file's own blocks; {path} is not a .gguf file: "
                f"use one of {', '.join(d for d in DTYPE_NAMES if d != 'gguf')}"
            )
        if native.available():
            from speculant.native import autotune

            tuned = autotune.apply_saved()  # this CPU's `speculant tune` result, if any
            notes = [native.n_threads(native.THREADS)]
            if tuned:
                notes.append(f"tuned: {autotune.describe(tuned)}")
            kernels = f", native {native.kernel_label()} kernels ({'; '.join(notes)})"
        else:
            dtype, quant = QUANTIZED["int8"], "int8"
            if progress:
                print(
                    f"native kernels unavailable ({native.why_missing()}): "
                    "running int8 weights through PyTorch instead",
                    file=sys.stderr,
                )
    tokenizer: Tokenizer | None
    if quant == "gguf":
        verified = check_integrity(path, trust_unverified=trust, progress=progress)
        config, weights = load_gguf_native(path)  # memory-mapped: nothing to wait for
        tokenizer = _gguf_tokenizer(path, _source_digest(path, progress))
    elif path.is_dir():
        verified = check_folder_integrity(path, trust_unverified=trust, progress=progress)
        config, weights = load_hf_dir(path, dtype)
        tokenizer = Tokenizer.from_hf_dir(path)
    elif path.suffix == ".gguf":
        verified = check_integrity(path, trust_unverified=trust, progress=progress)
        # The caches derived from the GGUF are bound to its digest and hashed before use.
        digest = _source_digest(path, progress)
        label = weight_cache.dtype_label(dtype, quant)
        cached = weight_cache.load(path, label, digest)
        if cached is not None:
            config, weights = cached
        else:
            config, weights = _load_gguf_with_progress(path, dtype, progress, name)
            if quant:
                weights.quantize(quant)
            weight_cache.save(path, label, config, weights, digest)
        tokenizer = _gguf_tokenizer(path, digest)
    else:
        raise ModelLoadError(f"{path} is neither a .gguf file nor a Hugging Face folder")
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{config.vocab_size} embeddings"
        )
    if quant in ("int8", "int4") and weights.weight_format != quant:
        weights.quantize(quant)
    net = Transformer(config, weights, dtype)
    if kv_dtype != "auto":
        try:
            net.set_kv_dtype(getattr(torch, kv_dtype))
        except ValueError as e:
            raise ModelLoadError(f"{name}: {e}") from None
    if net.kv_dtype != dtype:
        kernels += f", {str(net.kv_dtype).removeprefix('torch.')} KV cache"
    label = quant or str(dtype).removeprefix("torch.")
    if progress:
        print(
            f"loaded {name} ({config.arch}, {weights.nbytes() / 1e9:.2f} GB {label}{kernels}, "
            f"{_integrity_label(path, verified)}) "
            f"in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
    return Model(name, config, net, tokenizer, source=path)


def _gguf_tokenizer(path: Path, digest: str) -> Tokenizer | None:
    """The file's tokenizer (from its cache when converted before); None for a file that
    carries none (synthetic weights): the model then runs on ids."""
    try:
        return Tokenizer.from_gguf(path, source_sha256=digest)
    except NoTokenizerError:
        return None


def _integrity_label(path: Path, verified: bool) -> str:
    """The load line's word on the file: verified, nothing vouches for it, or (loaded
    with trust_unverified) it failed its check."""
    from speculant.models.integrity import expected_digest, read_manifest

    if verified:
        return "sha256 verified"
    vouched = bool(read_manifest(path)) if path.is_dir() else expected_digest(path) is not None
    if vouched:
        return "UNVERIFIED: it fails its sha256 check, loaded as --trust-unverified asked"
    return "unverified: no manifest"


def _source_digest(path: Path, progress: bool) -> str:
    """The GGUF's SHA-256, which the caches derived from it are bound to: the digest
    check_integrity has just verified (remembered beside the file, so no second hash),
    or, for a file nothing vouches for, its own (hashed once, then remembered)."""
    return file_sha256(path, progress=progress)


def _load_gguf_with_progress(
    path: Path, dtype: torch.dtype, progress: bool, name: str
) -> tuple[ModelConfig, Weights]:
    if not progress:
        return load_gguf(path, dtype)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn(f"dequantizing {name}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("tensors", total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return load_gguf(path, dtype, progress=tick)
