"""Train an EAGLE head for a target: build data by running the target, then regress.

1. Corpus: built-in sources (`humaneval`: HumanEval prompts with their reference
   solutions as a chat exchange, minus the problems the benchmark uses; `mtbench`:
   MT-bench questions, minus the benchmark's; `pycode`: Python's standard library
   sources, read from this machine) and/or files (.txt, or .jsonl rows with
   "text", or "turns" and optional "answers"). `self_distill` N adds the target's own
   greedy answers to N of the corpus prompts, as EAGLE does, so the head learns the
   text the target actually writes.
2. Features: the target runs over every sequence once; its final-normed features f_i
   and its greedy next tokens y_i are stored (bf16 / int32) in DIR/data.pt.
3. Training, teacher-forced: the head reads (embed(x_{i+1}), f_i + noise) and predicts
   f_{i+1}. Loss = smooth-L1(f_hat, f_{i+1}) + w_tok * CE(lm(f_hat), y_{i+1}) over the
   draft vocabulary (the `draft_vocab` most frequent target tokens of the corpus).
   AdamW, warmup then cosine decay, gradient clipping. Checkpoints go to
   DIR/checkpoint.pt every `save_every` steps and training resumes from there.
4. The head is written with config.json and a manifest.json of SHA-256 digests.

Steps 1 and 2 (the corpus and the features) live in eagle/data.py; this module holds
the options, the training loop and the driver.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from speculant.eagle.data import (
    FeatureData,
    TrainError,
    extract_features,
    load_source,
    self_distill,
    sequences,
)
from speculant.eagle.head import EagleHead, HeadConfig, save_head
from speculant.models import archs
from speculant.models.decoder import GGUFWeight
from speculant.models.model import Model


@dataclass(frozen=True)
class TrainOptions:
    seq_len: int = 512
    max_data_tokens: int = 100_000
    draft_vocab: int = 16384
    steps: int = 600
    batch: int = 4
    lr: float = 1e-3
    warmup: int = 30
    token_weight: float = 0.1
    noise: float = 0.05  # uniform feature noise, as EAGLE: robustness to its own drafts
    save_every: int = 100
    seed: int = 0
    self_distill: int = 0  # generate the target's answers to this many corpus prompts
    distill_tokens: int = 192


# ------------------------------------------------------------------------ training
def lr_at(step: int, opts: TrainOptions) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _batch(data: FeatureData, idx: list[int], embed: Tensor) -> tuple[Tensor, ...]:
    """Padded teacher-forcing batch: (embeds of x_{i+1}, f_i, f_{i+1}, y_{i+1}, mask)."""
    length = max(int(data.tokens[i].numel()) - 1 for i in idx)
    b, dim = len(idx), embed.shape[1]
    emb = torch.zeros(b, length, dim)
    feat = torch.zeros(b, length, dim)
    nxt = torch.zeros(b, length, dim)
    lab = torch.full((b, length), -100, dtype=torch.long)
    mask = torch.zeros(b, length, dtype=torch.bool)
    for r, i in enumerate(idx):
        t = data.tokens[i]
        n = t.numel() - 1
        emb[r, :n] = embed[t[1:]].float()
        f = data.features[i].float()
        feat[r, :n] = f[:-1]
        nxt[r, :n] = f[1:]
        lab[r, :n] = data.labels[i][1:]
        mask[r, :n] = True
    return emb, feat, nxt, lab, mask


def train_head(
    head: EagleHead,
    data: FeatureData,
    embed: Tensor,
    lm_rows: Tensor,
    opts: TrainOptions,
    checkpoint: Path | None,
    on_step: Callable[[int, dict[str, float]], None],
) -> list[dict[str, float]]:
    """Train in place; resumes from `checkpoint` when it exists. Returns the log."""
    torch.manual_seed(opts.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, log = 0, []
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"])
        optim.load_state_dict(state["optim"])
        start, log = int(state["step"]), list(state["log"])
    # target id -> draft-vocabulary row (-100: not draftable, ignored by the token loss)
    to_row = torch.full((int(embed.shape[0]),), -100, dtype=torch.long)
    to_row[data.draft_vocab] = torch.arange(len(data.draft_vocab))
    rng = random.Random(opts.seed * 1_000_003 + start)
    order: list[int] = []
    head.train()
    for step in range(start, opts.steps):
        if len(order) < opts.batch:
            order = list(range(len(data.tokens)))
            rng.shuffle(order)
        idx, order = order[: opts.batch], order[opts.batch :]
        emb, feat, nxt, lab, mask = _batch(data, idx, embed)
        if opts.noise:
            feat = feat + (torch.rand_like(feat) - 0.5) * 2 * opts.noise
        for group in optim.param_groups:
            group["lr"] = lr_at(step, opts)
        pred = head(emb, feat)  # [B, T, dim]
        m = mask[..., None].float()
        reg = (F.smooth_l1_loss(pred, nxt, reduction="none") * m).sum() / (m.sum() * pred.shape[-1])
        logits = pred[mask] @ lm_rows.T  # [N, V]
        rows = to_row[lab[mask].clamp_min(0)]
        tok = F.cross_entropy(logits, rows, ignore_index=-100)
        loss = reg + opts.token_weight * tok
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optim.step()
        with torch.no_grad():
            valid = rows != -100
            acc = (logits.argmax(-1)[valid] == rows[valid]).float().mean().item()
        entry = {
            "step": step + 1,
            "loss": loss.item(),
            "reg": reg.item(),
            "token": tok.item(),
            "top1": acc,
        }
        log.append(entry)
        on_step(step + 1, entry)
        last = step + 1 == opts.steps
        if checkpoint is not None and ((step + 1) % opts.save_every == 0 or last):
            tmp = checkpoint.with_suffix(".tmp")
            torch.save(
                {
                    "head": head.state_dict(),
                    "optim": optim.state_dict(),
                    "step": step + 1,
                    "log": log,
                },
                tmp,
            )
            tmp.replace(checkpoint)
    head.eval()
    return log


# ------------------------------------------------------------------------ driver
def _advance(bar: Any, task: Any, n: int, live: bool, console: Any, t0: float) -> None:
    """Move a progress bar; without a live bar (a log file), print a line per tenth."""
    bar.advance(task, n)
    if live:
        return
    t = next(t for t in bar.tasks if t.id == task)
    step = max(1, int((t.total or 1) / 10))
    if int(t.completed) // step != int(t.completed - n) // step or t.completed >= (t.total or 0):
        elapsed = time.perf_counter() - t0
        console.print(f"{t.description}: {int(t.completed)}/{int(t.total or 0)} ({elapsed:.0f} s)")


def run(
    target: Model,
    target_name: str,
    sources: Sequence[str],
    out: Path,
    opts: TrainOptions,
    *,
    progress: bool = True,
    generator_model: Model | None = None,
) -> dict[str, Any]:
    """The whole `speculant train eagle` job; returns a summary (also DIR/train.json).

    `generator_model` (the same target in a faster dtype, e.g. int8) writes the
    self-distilled answers; the features always come from `target`."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from speculant.proposers.eagle import dense_rows

    try:
        archs.check_eagle_target(target.config)
    except archs.ArchError as exc:
        raise TrainError(str(exc)) from None
    if target.tokenizer is None:
        raise TrainError(f"target {target_name!r} has no tokenizer to render the corpus with")
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    t0 = time.perf_counter()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )
    data_path = out / "data.pt"
    with Progress(*columns, console=console, disable=not progress) as bar:
        if data_path.exists():
            data = FeatureData.load(data_path)
            console.print(f"reusing {data_path} ({data.num_tokens:,} tokens)")
        else:
            groups = [load_source(source) for source in sources]
            if opts.self_distill:
                task = bar.add_task("self-distilling", total=opts.self_distill, info="")
                distilled = self_distill(
                    generator_model or target,
                    [c for g in groups for c in g],
                    opts.self_distill,
                    opts.distill_tokens,
                    lambda: _advance(bar, task, 1, progress, console, t0),
                )
                groups.insert(0, distilled)  # the target's own words come first
                # kept for reuse: --data DIR/distilled.jsonl
                tmp = out / "distilled.jsonl.tmp"
                tmp.write_text(
                    "".join(
                        json.dumps({"turns": c.turns, "answers": c.answers}) + "\n"
                        for c in distilled
                    )
                )
                tmp.replace(out / "distilled.jsonl")
            kept, total = sequences(groups, target, opts.seq_len, opts.max_data_tokens, opts.seed)
            if not kept:
                raise TrainError(f"the corpus {list(sources)} gave no sequence of 8+ tokens")
            task = bar.add_task("target features", total=total, info="")
            data = extract_features(
                target,
                kept,
                opts.draft_vocab,
                lambda n: _advance(bar, task, n, progress, console, t0),
            )
            data.save(data_path)
        t_data = time.perf_counter() - t0
        name = target_name
        fingerprint = target.tokenizer.fingerprint()
        cfg = HeadConfig.for_target(name, fingerprint, target.config, len(data.draft_vocab))
        head = EagleHead(cfg)
        head.draft_vocab.copy_(data.draft_vocab)  # type: ignore[operator]
        w = target.net.weights
        table = w.tok_embeddings
        embed = (
            table.rows(torch.arange(table.out_features))
            if isinstance(table, GGUFWeight)
            else table.float()
        )
        lm_rows = dense_rows(w.output, data.draft_vocab)
        task = bar.add_task("training", total=opts.steps, info="")

        def on_step(step: int, entry: dict[str, float]) -> None:
            info = f"loss {entry['loss']:.3f} top-1 {entry['top1']:.0%}"
            bar.update(task, completed=step, info=info)
            if not progress and (step % 25 == 0 or step == opts.steps):
                # no live bar (a log file): a line now and then
                elapsed = time.perf_counter() - t0
                console.print(f"step {step}/{opts.steps} {info} ({elapsed:.0f} s)")

        log = train_head(head, data, embed, lm_rows, opts, out / "checkpoint.pt", on_step)
    save_head(head, out)
    t_total = time.perf_counter() - t0
    first = log[: max(1, len(log) // 10)]
    last = log[-max(1, len(log) // 10) :]
    summary = {
        "target": target_name,
        "target_dtype": target.dtype_name,
        "sources": list(sources),
        "sequences": len(data.tokens),
        "data_tokens": data.num_tokens,
        "draft_vocab": len(data.draft_vocab),
        "options": asdict(opts),
        "data_seconds": round(t_data, 1),
        "total_seconds": round(t_total, 1),
        "loss_first": sum(e["loss"] for e in first) / len(first),
        "loss_last": sum(e["loss"] for e in last) / len(last),
        "top1_last": sum(e["top1"] for e in last) / len(last),
    }
    tmp = out / "train.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(out / "train.json")
    return summary
