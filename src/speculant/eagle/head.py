"""The EAGLE draft head: one decoder layer that drafts from the target's own features.

EAGLE (Li et al. 2024) drafts at the feature level. At position i the head reads the
target's feature f_i (the final-normed hidden state its LM head turns into the logits
for token i+1) together with the embedding of the token that actually came next,
x_{i+1}, and predicts the next feature f_{i+1}:

    h_i    = fc([embed(x_{i+1}) ; f_i])          2*dim -> dim (embedding first)
    g_i    = decoder_layer(h_i | h_<i)            causal, rotary position i
    logits = lm_head(g_i)                         the target's own LM head

The embedding and the LM head are the target's, shared and frozen; the head owns only
`fc` and the layer (EAGLE-1's layout: the layer's input norm is left out, since fc's
output is not a residual stream). Drafting beyond one token feeds the head its own
predicted feature in place of the target's.

`draft_vocab` (optional, FR-Spec style) restricts the drafting LM head to the most
frequent tokens of the training data, which cuts its cost on CPU (the 151,936-row LM
head of a Qwen model is bigger than the layer). Verification always uses the target's
full vocabulary, so this only changes which drafts are proposed, never the output.

This module is the trainable form (torch.nn, float32). `HeadRuntime` is the drafting
form: the same weights as plain tensors or weight-only int8, with a KV cache per
request and tree attention masks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speculant.models import archs
from speculant.models.config import ModelConfig
from speculant.models.decoder import (
    ROPE_BLOCK,
    GGUFWeight,
    Int8Weight,
    Linear,
    apply_rope,
    embed_rows,
    extend_rope,
    linear,
    rms_norm,
    rope_tables,
)

HEAD_FORMAT = "speculant-eagle-1"


@dataclass(frozen=True)
class HeadConfig:
    """What a head needs to know about its target (saved as config.json)."""

    target: str  # the target model's name (registry name or path)
    target_fingerprint: str  # the target tokenizer's fingerprint: heads are per target
    arch: str  # the target's family (one whose description names an EAGLE class)
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int  # rows of the drafting LM head (== vocab_size: no reduction)
    qkv_bias: bool = False
    fc_bias: bool = False  # vLLM's EAGLE layer has no fc bias (SGLang export adds zeros)
    format: str = HEAD_FORMAT

    @classmethod
    def for_target(
        cls, name: str, fingerprint: str, config: ModelConfig, draft_vocab_size: int
    ) -> HeadConfig:
        archs.check_eagle_target(config)  # an ArchError (a ValueError) names the families
        return cls(
            target=name,
            target_fingerprint=fingerprint,
            arch=config.arch,
            dim=config.dim,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            head_dim=config.head_dim,
            ffn_dim=config.ffn_dim,
            norm_eps=config.norm_eps,
            rope_theta=config.rope_theta,
            vocab_size=config.vocab_size,
            draft_vocab_size=min(draft_vocab_size, config.vocab_size),
            qkv_bias=config.qkv_bias,
        )

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> HeadConfig:
        data = json.loads(path.read_text())
        if data.get("format") != HEAD_FORMAT:
            raise ValueError(
                f"{path}: format {data.get('format')!r} is not an EAGLE head of this engine "
                f"(expected {HEAD_FORMAT!r})"
            )
        return cls(**data)


class EagleHead(nn.Module):
    """The trainable head. Embedding and LM-head rows come from the target, frozen."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.dim, cfg.head_dim
        self.fc = nn.Linear(2 * d, d, bias=cfg.fc_bias)
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(d, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, d, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # draft-vocabulary row -> target token id (the identity when not reduced)
        self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size), persistent=True)
        self.rope: Tensor
        self.register_buffer("rope", rope_tables(hd, cfg.rope_theta, 4096), persistent=False)

    def forward(self, embeds: Tensor, features: Tensor) -> Tensor:
        """Teacher-forced training pass. embeds, features: [B, T, dim] (embeds of
        x_{i+1}, features f_i) -> predicted next features [B, T, dim]."""
        cfg = self.cfg
        b, t, _ = embeds.shape
        h = self.fc(torch.cat([embeds, features], dim=-1))
        q = self.q_proj(h).view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        if t > self.rope.shape[1]:
            self.rope = rope_tables(cfg.head_dim, cfg.rope_theta, t)
        cos, sin = self.rope[0, :t], self.rope[1, :t]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = cfg.n_heads // cfg.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o_proj(att.transpose(1, 2).reshape(b, t, -1))
        x = rms_norm(h, self.post_attention_layernorm, cfg.norm_eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class HeadCache:
    """One request's head keys and values: [n_kv_heads, rows, head_dim] each, the
    committed pairs at rows [0, length), draft nodes written after them."""

    k: Tensor
    v: Tensor
    length: int = 0


class HeadRuntime:
    """The head for drafting: plain tensors (float32) or weight-only int8 (bfloat16
    activations), a KV cache per request, and arbitrary visibility masks so a whole
    frontier of tree nodes runs in one call."""

    def __init__(
        self,
        head: EagleHead,
        embeddings: Tensor | GGUFWeight,
        lm_rows: Tensor,
        dtype: str = "float32",
        max_positions: int = 4096,
    ) -> None:
        """embeddings: the target's [vocab, dim]; lm_rows: the target's LM-head rows of
        the draft vocabulary [draft_vocab, dim]."""
        if dtype not in ("float32", "int8"):
            raise ValueError(f"EAGLE head dtype {dtype!r} is not supported: use float32 or int8")
        cfg = head.cfg
        self.cfg = cfg
        self.act = torch.float32 if dtype == "float32" else torch.bfloat16
        sd = {k: v.detach().float() for k, v in head.state_dict().items()}

        def w(t: Tensor) -> Linear:
            return Int8Weight.quantize(t) if dtype == "int8" else t.contiguous()

        def cat(*names: str) -> Tensor:
            return torch.cat([sd[n] for n in names])

        self.fc = w(sd["fc.weight"])
        self.fc_b = sd["fc.bias"].to(self.act) if "fc.bias" in sd else None
        self.wqkv = w(cat("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        self.bqkv = (
            cat("q_proj.bias", "k_proj.bias", "v_proj.bias").to(self.act) if cfg.qkv_bias else None
        )
        self.wo = w(sd["o_proj.weight"])
        self.norm = sd["post_attention_layernorm"].to(self.act)
        self.w_gate_up = w(cat("gate_proj.weight", "up_proj.weight"))
        self.w_down = w(sd["down_proj.weight"])
        self.embeddings = embeddings  # the target's own table, rows cast when looked up
        self.lm = w(lm_rows.float())
        self.draft_vocab = sd["draft_vocab"].long()
        # rotary rows for the positions seen so far, grown as they come (extend_rope)
        self.rope = self._rope_rows(
            torch.empty(2, 0, cfg.head_dim, dtype=self.act), min(max_positions + 64, ROPE_BLOCK)
        )

    def _rope_rows(self, table: Tensor, n: int) -> Tensor:
        return extend_rope(
            table, n, self.act, head_dim=self.cfg.head_dim, theta=self.cfg.rope_theta
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the head's own weights (the shared embedding table excluded)."""
        total = 0
        for value in vars(self).values():
            if isinstance(value, Int8Weight):
                total += value.nbytes
            elif isinstance(value, Tensor) and value is not self.embeddings:
                total += value.numel() * value.element_size()
        return total

    def new_cache(self, rows: int) -> HeadCache:
        cfg = self.cfg
        shape = (cfg.n_kv_heads, rows, cfg.head_dim)
        return HeadCache(torch.zeros(shape, dtype=self.act), torch.zeros(shape, dtype=self.act))

    @torch.inference_mode()
    def step(
        self,
        tokens: Tensor,
        features: Tensor,
        positions: Tensor,
        cache: HeadCache,
        write_at: int,
        visible: Tensor,
    ) -> Tensor:
        """Run n (token, feature) pairs: tokens [n] (x_{i+1}), features [n, dim] (f_i),
        rotary positions [n]; their keys and values go to cache rows write_at..; each
        row attends to the cache rows `visible` [n, write_at + n] marks. Returns the
        predicted features [n, dim]."""
        cfg = self.cfg
        n = tokens.shape[0]
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        x = torch.cat(
            [embed_rows(self.embeddings, tokens).to(self.act), features.to(self.act)], dim=-1
        )
        h = linear(x, self.fc, self.fc_b)
        qkv = linear(h, self.wqkv, self.bqkv)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        self.rope = self._rope_rows(self.rope, int(positions.max()) + 1 if n else 0)
        cos, sin = self.rope[0, positions], self.rope[1, positions]
        q = apply_rope(q.view(n, nh, hd).transpose(0, 1)[None], cos, sin)[0]  # [nh, n, hd]
        k = apply_rope(k.view(n, nkv, hd).transpose(0, 1)[None], cos, sin)[0]
        v = v.view(n, nkv, hd).transpose(0, 1)
        end = write_at + n
        if end > cache.k.shape[1]:
            grow = max(end, 2 * cache.k.shape[1])
            pad = (0, 0, 0, grow - cache.k.shape[1])
            cache.k, cache.v = F.pad(cache.k, pad), F.pad(cache.v, pad)
        cache.k[:, write_at:end] = k
        cache.v[:, write_at:end] = v
        rep = nh // nkv
        qg = q.reshape(nkv, rep * n, hd)
        scores = torch.matmul(qg, cache.k[:, :end].transpose(1, 2)).float() * hd**-0.5
        scores = scores.view(nkv, rep, n, end).masked_fill(~visible, float("-inf"))
        probs = scores.softmax(-1).to(self.act).view(nkv, rep * n, end)
        att = torch.matmul(probs, cache.v[:, :end]).view(nh, n, hd).transpose(0, 1)
        h = h + linear(att.reshape(n, nh * hd), self.wo)
        y = rms_norm(h, self.norm, cfg.norm_eps)
        gate, up = linear(y, self.w_gate_up).chunk(2, dim=-1)
        out: Tensor = h + linear(F.silu(gate) * up, self.w_down)
        return out

    def logits(self, features: Tensor) -> Tensor:
        """Draft-vocabulary logits [n, draft_vocab] float32 of predicted features."""
        return linear(features.to(self.act), self.lm).float()


HEAD_FILE = "head.safetensors"
CONFIG_FILE = "config.json"


class HeadLoadError(ValueError):
    """A head folder that is missing, corrupt, or made for another target."""


def save_head(head: EagleHead, out: Path) -> Path:
    """Write head.safetensors, config.json and manifest.json (SHA-256 of both) to `out`,
    each file atomically."""
    from safetensors.torch import save_file

    from speculant.models.integrity import write_manifest

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    tmp = out / (HEAD_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": HEAD_FORMAT})
    tmp.replace(out / HEAD_FILE)
    tmp_cfg = out / (CONFIG_FILE + ".tmp")
    head.cfg.save(tmp_cfg)
    tmp_cfg.replace(out / CONFIG_FILE)
    return write_manifest(out, [out / HEAD_FILE, out / CONFIG_FILE], progress=False)


def load_head(folder: str | Path, *, trust_unverified: bool = False) -> EagleHead:
    """Load a head written by `save_head`, checked against its manifest's SHA-256."""
    from safetensors.torch import load_file

    from speculant.models.integrity import MANIFEST, IntegrityError, listing_problems, read_manifest

    path = Path(folder).expanduser()
    if not (path / CONFIG_FILE).is_file() or not (path / HEAD_FILE).is_file():
        raise HeadLoadError(
            f"EAGLE head folder {str(folder)!r} must hold {CONFIG_FILE} and {HEAD_FILE} "
            "(write one with: speculant eagle train --target NAME --out DIR)"
        )
    # The head's own files only: training leaves data.pt and checkpoint.pt beside them.
    listed = read_manifest(path)
    files = [path / HEAD_FILE, path / CONFIG_FILE]
    problems = listing_problems(files, listed, MANIFEST, progress=False)
    if listed and problems and not trust_unverified:
        raise IntegrityError(
            f"EAGLE head {path} fails its integrity check: "
            + "; ".join(problems)
            + ". Train or copy it again, or pass --trust-unverified to load it anyway"
        )
    if not listed and not trust_unverified:
        raise HeadLoadError(
            f"EAGLE head {path} has no manifest.json to check its SHA-256 against: "
            "write one with `speculant models verify DIR --write-manifest` if you trust it, "
            "or pass --trust-unverified"
        )
    try:
        cfg = HeadConfig.load(path / CONFIG_FILE)
    except (TypeError, ValueError) as exc:
        raise HeadLoadError(f"{path / CONFIG_FILE}: {exc}") from exc
    head = EagleHead(cfg)
    state = load_file(str(path / HEAD_FILE))
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:
        raise HeadLoadError(f"{path / HEAD_FILE} does not match its config: {exc}") from exc
    return head.eval()
