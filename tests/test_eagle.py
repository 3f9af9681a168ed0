"""EAGLE: tree verification through the engine, the head's drafting, training, export.

Greedy equivalence is checked for scripted trees (the right token at a chosen depth,
wrong siblings before and after it), for untrained heads (rejections everywhere) and a
briefly trained one (partial acceptance), in chain and tree mode, fp32 / bf16 / int8.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from oracles import plain_greedy
from test_distribution import SMALL, chi2_rejects, exact_two_token
from tiny import tiny_chat_model

from speculant import Engine, SamplingParams
from speculant.eagle.data import FeatureData, extract_features
from speculant.eagle.export import eagle_config, eagle_tensors, export_head, import_eagle
from speculant.eagle.head import EagleHead, HeadConfig, HeadLoadError, load_head, save_head
from speculant.eagle.train import TrainOptions, run, train_head
from speculant.models.model import Model
from speculant.proposers import Draft
from speculant.proposers.eagle import EagleProposer, dense_rows

PROMPT = [3, 17, 42, 5, 9, 11]


class ScriptedTree:
    """Drafts a tree whose right branch follows the reference for `right_depth` levels;
    every node also gets a wrong sibling (before or after the right one), and the
    right branch's deepest node gets wrong children only."""

    name = "scripted-tree"

    def __init__(
        self,
        prompt: Sequence[int],
        reference: Sequence[int],
        right_depth: int,
        vocab: int,
        wrong_first: bool,
    ):
        self.full = list(prompt) + list(reference)
        self.right_depth = right_depth
        self.vocab = vocab
        self.wrong_first = wrong_first

    def begin(self, prompt_ids: Sequence[int], capacity: int) -> None:
        return None

    def end(self, tokens: Sequence[int]) -> None:
        return None

    def propose(self, context, k, params, generator):  # type: ignore[no-untyped-def]
        n = len(context)
        assert list(context) == self.full[:n], "engine committed a token plain decoding would not"
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for d in range(min(k, len(self.full) - n)):
            right = self.full[n + d]
            wrong = (right + 1 + d) % self.vocab
            pair = [wrong, right] if self.wrong_first else [right, wrong]
            if d >= self.right_depth:
                pair = [wrong, (right + 2) % self.vocab]
            for t in pair:
                tokens.append(t)
                parents.append(parent)
            parent = len(tokens) - (1 if self.wrong_first else 2)
            if d >= self.right_depth:
                break
        return Draft(tokens, None, parents)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("right_depth", [0, 1, 3, 6])
def test_scripted_trees_keep_exactly_the_right_branch(
    tiny_root, dtype: str, right_depth: int
) -> None:  # type: ignore[no-untyped-def]
    m = tiny_model(tiny_root, "qwen2", seed=2, dtype=dtype)
    ref = plain_greedy(m, PROMPT, 30)
    for wrong_first in (False, True):
        prop = ScriptedTree(PROMPT, ref, right_depth, m.vocab_size, wrong_first)
        engine = Engine(m, proposer=prop, num_speculative_tokens=5)
        res = engine.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
        assert res.token_ids == ref
        per_step = min(right_depth, 5)
        # every full step keeps exactly the right branch's depth, plus one token
        assert res.stats.target_forwards == -(-30 // (per_step + 1))


def _head(model: Model, seed: int = 0, draft_vocab: int | None = None) -> EagleHead:
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target("tiny", "", model.config, draft_vocab or model.vocab_size)
    head = EagleHead(cfg)
    if draft_vocab:  # a reduced vocabulary: some of the ids, shuffled
        head.draft_vocab.copy_(torch.randperm(model.vocab_size)[:draft_vocab])  # type: ignore[operator]
    return head


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_untrained_head_greedy_equals_plain(tiny_root, arch: str, dtype: str) -> None:  # type: ignore[no-untyped-def]
    m = tiny_model(tiny_root, arch, seed=1, dtype=dtype)
    ref = plain_greedy(m, PROMPT, 40)
    for topk, k, vocab in [(1, 4, None), (3, 4, 40), (4, 6, None)]:
        head = _head(m, draft_vocab=vocab)
        for head_dtype in ("float32", "int8"):
            prop = EagleProposer(
                m, eagle_head=head, tree_topk=topk, tree_tokens=10, eagle_dtype=head_dtype
            )
            res = Engine(m, proposer=prop, num_speculative_tokens=k).generate(
                PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)
            )
            assert res.token_ids == ref, (topk, k, vocab, head_dtype)


def _tiny_data(model: Model, n_seq: int = 24, length: int = 48, seed: int = 0) -> FeatureData:
    """Sequences the target itself would write (greedy continuations of random prompts)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n_seq):
        prompt = torch.randint(0, model.vocab_size, (4,), generator=g).tolist()
        seqs.append(prompt + plain_greedy(model, prompt, length - 4))
    return extract_features(model, seqs, model.vocab_size, lambda n: None)


def test_training_lowers_the_loss_and_trained_head_stays_lossless(
    tiny_root, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    m = tiny_model(tiny_root, "llama", seed=5)
    data = _tiny_data(m)
    head = _head(m)
    w = m.net.weights
    opts = TrainOptions(steps=120, batch=4, lr=3e-3, warmup=10, save_every=60)
    ckpt = tmp_path / "checkpoint.pt"
    log = train_head(
        head,
        data,
        w.tok_embeddings.float(),
        dense_rows(w.output, data.draft_vocab),
        opts,
        ckpt,
        lambda s, e: None,
    )
    first = sum(e["loss"] for e in log[:10]) / 10
    last = sum(e["loss"] for e in log[-10:]) / 10
    assert last < 0.7 * first, (first, last)
    assert log[-1]["top1"] > log[0]["top1"]
    # the trained head drafts tokens the target accepts, and output is unchanged
    prompt = [7, 1, 30, 2]
    ref = plain_greedy(m, prompt, 40)
    for topk in (1, 4):
        prop = EagleProposer(
            m, eagle_head=head, tree_topk=topk, tree_tokens=12, eagle_dtype="float32"
        )
        res = Engine(m, proposer=prop, num_speculative_tokens=4).generate(
            prompt, SamplingParams(max_tokens=40, ignore_eos=True)
        )
        assert res.token_ids == ref
        assert res.stats.num_accepted > 0
    # resuming from the final checkpoint does no more steps and keeps the log
    head2 = _head(m, seed=9)
    log2 = train_head(
        head2,
        data,
        w.tok_embeddings.float(),
        dense_rows(w.output, data.draft_vocab),
        opts,
        ckpt,
        lambda s, e: None,
    )
    assert len(log2) == len(log)
    assert all(
        torch.equal(a, b)
        for a, b in zip(head.state_dict().values(), head2.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("topk", [1, 3])
def test_eagle_samples_follow_target(tiny_root, topk: int) -> None:  # type: ignore[no-untyped-def]
    """Chain (sampled from the head's q) and tree (top-k candidates, recursive rejection
    over siblings): emitted pairs follow the target's exact two-token distribution."""
    target = tiny_model(tiny_root, "llama", seed=11, **SMALL)
    head = _head(target, seed=3, draft_vocab=6 if topk == 1 else None)
    prop = EagleProposer(
        target, eagle_head=head, tree_topk=topk, tree_tokens=8, eagle_dtype="float32"
    )
    engine = Engine(target, proposer=prop, num_speculative_tokens=2)
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True)
    prompt = [1, 5, 2]
    n = 2500
    counts: Counter = Counter()  # type: ignore[type-arg]
    drafted = accepted = 0
    for i in range(n):
        res = engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": 31_000 + i}))
        counts[tuple(res.token_ids[:2])] += 1
        drafted += res.stats.num_drafted
        accepted += res.stats.num_accepted
    assert 0 < accepted < drafted
    rejected, stat, crit = chi2_rejects(counts, exact_two_token(target, prompt, params), n)
    assert not rejected, f"samples do not follow the target: chi2={stat:.1f} > {crit:.1f}"


def test_batched_eagle_sequences_match_solo(tiny_root) -> None:  # type: ignore[no-untyped-def]
    """Tree and chain lanes in one batched pass give each sequence its solo output."""
    m = tiny_model(tiny_root, "llama", seed=5, dtype="bfloat16")
    head = _head(m, seed=2)
    prompts = [[7, 1, 30, 2], [4, 4, 9], [11, 60, 3, 5, 8]]
    engine = Engine(
        m,
        method="eagle",
        num_speculative_tokens=4,
        proposer_options={"eagle_head": head, "tree_topk": 3, "eagle_dtype": "float32"},
    )
    solo = [plain_greedy(m, p, 20) for p in prompts]
    sched = engine.scheduler()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    seqs = [sched.add(i, p, params) for i, p in enumerate(prompts)]
    while sched.running:
        sched.step()
    assert [s.output for s in seqs] == solo


def test_head_files_are_checked(tiny_root, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    m = tiny_model(tiny_root, "llama", seed=5)
    head = _head(m)
    out = tmp_path / "head"
    save_head(head, out)
    assert set(json.loads((out / "manifest.json").read_text())["files"]) == {
        "head.safetensors",
        "config.json",
    }
    loaded = load_head(out)
    assert all(
        torch.equal(a, b)
        for a, b in zip(head.state_dict().values(), loaded.state_dict().values(), strict=True)
    )
    from speculant.cli import main

    (out / "data.pt").write_bytes(b"training leftovers are not the head")
    assert main(["models", "verify", str(out)]) == 0
    # a changed byte is refused, naming the file
    blob = bytearray((out / "head.safetensors").read_bytes())
    blob[-1] ^= 1
    (out / "head.safetensors").write_bytes(bytes(blob))
    with pytest.raises(Exception, match="head.safetensors"):
        load_head(out)
    assert main(["models", "verify", str(out)]) == 1
    with pytest.raises(HeadLoadError, match="must hold config.json"):
        load_head(tmp_path / "nowhere")
    # a head for another target is refused
    other = tiny_model(tiny_root, "llama", seed=5, vocab_size=80)
    with pytest.raises(HeadLoadError, match="vocabulary has 96 ids"):
        EagleProposer(other, eagle_head=head)
    with pytest.raises(ValueError, match="tree_topk=0 is out of range"):
        EagleProposer(m, eagle_head=head, tree_topk=0)
    with pytest.raises(ValueError, match="needs a trained head"):
        EagleProposer(m)


def test_export_round_trip(tiny_root, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The exported vLLM / SGLang folders hold the EAGLE-1 tensor names and configs, and
    reading them back rebuilds the head (bf16-rounded) tensor for tensor."""
    from safetensors.torch import load_file

    m = tiny_model(tiny_root, "qwen2", seed=5)
    head = _head(m, draft_vocab=40)
    src = tmp_path / "head"
    save_head(head, src)
    paths = export_head(src, tmp_path / "export")
    vllm = load_file(str(paths["vllm"] / "model.safetensors"))
    sglang = load_file(str(paths["sglang"] / "model.safetensors"))
    assert "fc.bias" not in vllm and torch.equal(
        sglang["fc.bias"], torch.zeros(m.config.dim, dtype=torch.bfloat16)
    )
    assert not any(k.startswith("model.") or "input_layernorm" in k or "embed" in k for k in vllm)
    assert "layers.0.self_attn.q_proj.bias" in vllm  # qwen2 heads keep q/k/v biases
    cfg_v = json.loads((paths["vllm"] / "config.json").read_text())
    cfg_s = json.loads((paths["sglang"] / "config.json").read_text())
    assert cfg_v["architectures"] == ["LlamaForCausalLM"] and cfg_v["qkv_bias"] is True
    assert cfg_s["architectures"] == ["Qwen2ForCausalLMEagle"]
    assert cfg_v["num_hidden_layers"] == 1 and cfg_v["vocab_size"] == m.vocab_size
    assert torch.equal(torch.load(paths["sglang"] / "hot_token_ids.pt"), head.draft_vocab)
    back = import_eagle(paths["vllm"], head.cfg)
    ours = eagle_tensors(head, fc_bias=False)
    theirs = eagle_tensors(back, fc_bias=False)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert eagle_config(head.cfg, "vllm")["hidden_size"] == m.config.dim


def test_train_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`run` on a tiny chat model and a .jsonl corpus: features, training, head files,
    train.json; a second run resumes (reuses data.pt and the checkpoint)."""
    from speculant.cli import main

    m = tiny_chat_model(tmp_path / "chat", seed=3, layers=2)
    corpus = tmp_path / "corpus.jsonl"
    rows = [
        {"turns": [f"say {i} apples"], "answers": [f"{i} apples and {i + 1} pears"]}
        for i in range(12)
    ]
    rows.append({"text": "plain text rows work too, " * 4})
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    opts = TrainOptions(steps=6, batch=2, warmup=2, save_every=3, draft_vocab=64)
    out = tmp_path / "head"
    summary = run(m, "tiny-chat", [str(corpus)], out, opts, progress=False)
    assert summary["sequences"] == 13 and summary["draft_vocab"] == 64
    assert {p.name for p in out.iterdir()} >= {
        "head.safetensors",
        "config.json",
        "manifest.json",
        "train.json",
        "data.pt",
        "checkpoint.pt",
    }
    head = load_head(out)
    assert head.cfg.draft_vocab_size == 64
    # generate through the CLI with the trained head
    rc = main(
        [
            "generate",
            "say 3",
            "--target",
            str(tmp_path / "chat"),
            "--method",
            "eagle",
            "--eagle-head",
            str(out),
            "--max-tokens",
            "8",
            "--dtype",
            "float32",
            "--json",
        ]
    )
    assert rc == 0
    # bad input is named
    assert (
        main(
            [
                "eagle",
                "train",
                "--target",
                str(tmp_path / "chat"),
                "--out",
                str(tmp_path / "x"),
                "--data",
                "nowhere.jsonl",
            ]
        )
        == 2
    )
    assert "deprecated" not in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "eagle",
                "--target",
                str(tmp_path / "chat"),
                "--out",
                str(tmp_path / "x"),
                "--data",
                str(corpus),
                "--lr",
                "-1",
            ]
        )
        == 2
    )
    # the old spelling `speculant train eagle` is the same command, with a note
    err = capsys.readouterr().err
    assert "--lr=-1.0 is out of range" in err, err
    assert "`speculant train eagle` is deprecated: use `speculant eagle train`" in err
