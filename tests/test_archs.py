"""Every implemented architecture against transformers' own implementation.

For each, a tiny random model is built in code (a seeded transformers config, 4 layers,
width 128), saved as a Hugging Face folder and written to GGUF by the tests' writer
(gguf_writer.py, which follows llama.cpp's converter). Checked, for each:
- the folder and the GGUF file (float32 blocks, the PyTorch path) give transformers'
  logits within 1e-4 and its greedy tokens, at a short context and after 4,100 tokens;
- the GGUF file in Q8_0 blocks (the native kernels, activations rounded to 8 bits as
  llama.cpp does) tracks the logits of transformers running the same dequantized
  weights, short and long (a bound, and argmax agreement but for near-ties);
- greedy speculation equals plain decoding for every proposer, drafts rejected at
  every position, and a tree's nodes equal their chains.
A setting that changes the math is also shown to matter (its logits differ without it),
so a loader that ignored it would fail.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_writer import write_gguf
from oracles import plain_greedy
from test_native import _speculation_equals_plain, _tree_nodes_equal_chains

from speculant import Engine, SamplingParams, load_model
from speculant.models.archs import ARCHS
from speculant.models.loader import ModelLoadError
from speculant.models.model import Model

TINY: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 512,
}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,  # Phi-4-mini's share: 24 of 32 dimensions rotate
    "original_max_position_embeddings": 256,
    "short_factor": [1.0 + 0.05 * i for i in range(12)],
    "long_factor": [1.0 + 0.8 * i for i in range(12)],
}
# name -> (transformers class prefix, config overrides, the ModelConfig field that a
# loader ignoring the setting would leave at its neutral value)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama3-rope": ("Llama", {"rope_parameters": LLAMA3}, {"rope_inv_freq": ()}),
    "llama-yarn": (
        "Llama",
        {"rope_parameters": YARN},
        {"rope_inv_freq": (), "rope_attn_factor": 1.0},
    ),
    "qwen2": ("Qwen2", {}, {"qkv_bias": False}),
    "qwen3": ("Qwen3", {}, {"qk_norm": False}),
    "granite": (
        "Granite",
        {
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.0625,
            "logits_scaling": 4.0,
        },
        {"embed_scale": 1.0, "residual_scale": 1.0, "logit_scale": 1.0, "query_scale": None},
    ),
    "smollm3": ("SmolLM3", {}, {"no_rope_layers": ()}),
    "phi3": (
        "Phi3",
        {
            "rope_parameters": LONGROPE,
            "original_max_position_embeddings": 256,
            "sliding_window": 1000,
        },
        {"rope_inv_freq_long": ()},
    ),
    "gemma2": (
        "Gemma2",
        {
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 8.0,
            "query_pre_attn_scalar": 32,  # GGUF files keep no scalar: llama.cpp's is head_dim
            "sliding_window": 64,
            "tie_word_embeddings": True,  # the converter drops the LM head
        },
        {"attn_softcap": None},
    ),
    "olmo2": ("Olmo2", {}, {"qk_norm": False}),
}
LONG = 4100


def hf_model(name: str, seed: int = 0) -> Any:
    import transformers as tf

    prefix, overrides, _ = CASES[name]
    torch.manual_seed(seed)
    cfg = getattr(tf, f"{prefix}Config")(**{**TINY, "tie_word_embeddings": False, **overrides})
    model = getattr(tf, f"{prefix}ForCausalLM")(cfg)
    with torch.no_grad():  # larger weights: sharper, more varied distributions
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.2)  # non-trivial norms (a swapped pair would show)
            elif p.dim() == 2:
                p.mul_(2.5)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.5)  # transformers starts biases at zero
    return model.eval()


@dataclasses.dataclass
class Built:
    ref: Any  # the transformers model (weights as the GGUF's Q8_0 blocks dequantized)
    folder: Path
    f32: Path
    q8: Path


_BUILT: dict[str, Built] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("archs")


def built(name: str, root: Path) -> Built:
    if name not in _BUILT:
        ref = hf_model(name)
        q8 = write_gguf(ref, root / f"{name}-q8_0.gguf", "Q8_0")  # ref now holds its values
        folder = root / name
        ref.save_pretrained(folder)
        f32 = write_gguf(ref, root / f"{name}-f32.gguf", "F32")
        _BUILT[name] = Built(ref, folder, f32, q8)
    return _BUILT[name]


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(ref: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None
        )
    return out[0, len(ids) :].tolist()


def hf_logits(ref: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def our_logits(model: Model, ids: list[int]) -> torch.Tensor:
    return model.forward(ids, model.new_cache(len(ids) + 8), 0)


@pytest.mark.parametrize("name", list(CASES))
def test_folder_and_float_gguf_match_transformers(name: str, root: Path) -> None:
    b = built(name, root)
    ids = ids_of(24, 1)
    want = hf_logits(b.ref, ids)
    for source in (b.folder, b.f32):
        model = load_model(source, dtype="float32", progress=False)
        assert model.config.arch == name.split("-")[0].replace("llama3", "llama")
        torch.testing.assert_close(our_logits(model, ids), want, rtol=1e-4, atol=1e-4)
        assert plain_greedy(model, ids, 12) == hf_greedy(b.ref, ids, 12), source.name
    # The setting matters: without it the logits are not transformers'.
    _, _, neutral = CASES[name]
    model = load_model(b.folder, dtype="float32", progress=False)
    plain = dataclasses.replace(model.config, **neutral)
    from speculant.models.decoder import Transformer

    weights = model.net.weights
    if "qk_norm" in neutral:  # the decoder applies the norms it is given
        layers = [dataclasses.replace(lw, q_norm=None, k_norm=None) for lw in weights.layers]
        weights = dataclasses.replace(weights, layers=layers)
    if "qkv_bias" in neutral:  # ... and the biases
        layers = [dataclasses.replace(lw, bqkv=None) for lw in weights.layers]
        weights = dataclasses.replace(weights, layers=layers)
    ignored = Transformer(plain, weights, torch.float32)
    long_ids = ids_of(700, 5)  # past the tiny rope scalings' original contexts
    with torch.no_grad():
        got, _ = ignored.forward(torch.tensor(long_ids), ignored.new_cache(720), 0)
    assert got is not None
    assert not torch.allclose(got, hf_logits(b.ref, long_ids), atol=1e-3)


def assert_native_tracks(got: torch.Tensor, want: torch.Tensor) -> None:
    """The native kernels round activations to 8 bits per block (as llama.cpp does), so
    their logits follow the float reference within a bound, and their argmax agrees
    except at near-ties (random tiny models have many)."""
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("name", list(CASES))
def test_long_context_matches_transformers(name: str, root: Path) -> None:
    """After a 4,100-token prompt: the folder (PyTorch, float32) gives transformers'
    greedy tokens; the Q8_0 file on the native kernels tracks its logits."""
    b = built(name, root)
    ids = ids_of(LONG, 2)
    model = load_model(b.folder, dtype="float32", progress=False)
    assert plain_greedy(model, ids, 8) == hf_greedy(b.ref, ids, 8)
    native = load_model(b.q8, dtype="gguf", progress=False)
    cache = native.new_cache(LONG + 8)
    native.prefill(ids[:-48], cache)
    got = native.forward(ids[-48:], cache, LONG - 48)
    assert_native_tracks(got, hf_logits(b.ref, ids)[-48:])


@pytest.mark.parametrize("name", list(CASES))
def test_native_q8_file_tracks_transformers(name: str, root: Path) -> None:
    b = built(name, root)
    model = load_model(b.q8, dtype="gguf", progress=False)
    assert model.net.native_ops
    # plain pre-norm layers (a window shared by every layer included) run in one call
    assert model.net._fusable() == (name in ("llama3-rope", "llama-yarn", "qwen2", "phi3"))
    ids = ids_of(48, 3)
    assert_native_tracks(our_logits(model, ids), hf_logits(b.ref, ids))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["gguf", "float32"])
def test_speculation_equals_plain(name: str, dtype: str, root: Path) -> None:
    """Every proposer's greedy output equals plain decoding, drafts rejected at every
    position; a tree's nodes equal their chains; two sequences batched with chunked
    prefill equal plain decoding too."""
    from conftest import tiny_eagle_options

    from speculant.proposers import available_methods

    b = built(name, root)
    model = load_model(b.q8 if dtype == "gguf" else b.folder, dtype=dtype, progress=False)
    ids = ids_of(20, 4) + ids_of(6, 4)  # a repeat: prompt lookup finds drafts
    _speculation_equals_plain(model, ids)
    _tree_nodes_equal_chains(model, ids)
    reference = plain_greedy(model, ids, 24)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for method in [m for m in available_methods() if m not in ("none", "draft")]:
        options = None
        if method == "eagle":
            if ARCHS[model.config.arch].eagle_class is None:
                continue  # EAGLE heads are built for the families that name a class
            options = tiny_eagle_options(model)
        engine = Engine(
            model,
            method=method,
            num_speculative_tokens=3 if method == "layer-skip" else 5,
            proposer_options=options,
        )
        assert engine.generate(ids, params).token_ids == reference, method
    # two sequences in one scheduler, their prompts prefilled in chunks of 8 rows
    other = ids_of(30, 6)
    sched = Engine(model, method="ngram", num_speculative_tokens=4).scheduler(8)
    sched.add(0, ids, params)
    sched.add(1, other, params)
    done = {}
    while sched.busy:
        for event in sched.step():
            if event.result is not None:
                done[event.seq.request_id] = event.result.token_ids
    assert done == {0: reference, 1: plain_greedy(model, other, 24)}


def test_unimplemented_settings_are_refused_by_name(root: Path, tmp_path: Path) -> None:
    import json

    b = built("llama3-rope", root)
    cfg = json.loads((b.folder / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in b.folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cases = [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "dynamic"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
        # the published Llama 3.1 form (`rope_scaling`) is read, not ignored
        ({"rope_parameters": None, "rope_scaling": {"rope_type": "longrope"}}, "longrope"),
    ]
    for change, match in cases:
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelLoadError, match=match):
            load_model(bad, dtype="float32", progress=False)


def test_llama31_rope_scaling_form_is_read(root: Path, tmp_path: Path) -> None:
    """The published Llama 3.1-3.3 configs say `rope_theta` + `rope_scaling`: the same
    model as transformers 5's `rope_parameters`."""
    import json

    b = built("llama3-rope", root)
    cfg = json.loads((b.folder / "config.json").read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    old = tmp_path / "old"
    old.mkdir()
    for f in b.folder.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    (old / "config.json").write_text(json.dumps(cfg))
    a = load_model(b.folder, dtype="float32", progress=False).config
    c = load_model(old, dtype="float32", progress=False).config
    assert a.rope_inv_freq and a == c


def test_unknown_gguf_key_is_refused(root: Path, tmp_path: Path) -> None:
    import gguf

    from speculant.models.gguf_file import read_gguf

    b = built("qwen3", root)
    index = read_gguf(b.f32, string_arrays=True)
    out = tmp_path / "extra.gguf"
    w = gguf.GGUFWriter(str(out), "qwen3")
    for key, value in index.metadata.items():
        if key.startswith("qwen3."):
            w.add_key_value(key, value, _gguf_type(value))
    w.add_float32("qwen3.attn_logit_softcapping", 50.0)
    w.add_tensor("token_embd.weight", torch.zeros(320, 128).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="qwen3.attn_logit_softcapping"):
        load_model(out, dtype="float32", progress=False)


def _gguf_type(value: Any) -> Any:
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    return GGUFValueType.STRING


def test_longrope_table_is_chosen_per_sequence(root: Path) -> None:
    """Phi-3's LongRoPE: a sequence whose context exceeds the original one rotates with
    the long factors (its cache says so, as llama.cpp decides by its context); a cached
    prefix is reused only into a cache of the same table."""
    from speculant.prefix_cache import BLOCK, PrefixCache

    b = built("phi3", root)
    model = load_model(b.folder, dtype="float32", progress=False)
    short, long = model.new_cache(200), model.new_cache(300)
    assert (short.rope_variant, long.rope_variant) == (0, 1)
    ids = ids_of(2 * BLOCK, 9)
    a = model.forward(ids, short, 0)
    c = model.forward(ids, long, 0)
    assert not torch.allclose(a, c, atol=1e-3)  # the tables differ from position 1
    prefixes = PrefixCache(1 << 26)
    prefixes.store(ids, short)
    assert prefixes.lookup(ids, model.new_cache(300), len(ids)) == 0
    assert prefixes.lookup(ids, model.new_cache(200), len(ids)) == 2 * BLOCK


def test_any_pair_of_files_whose_vocabularies_agree(root: Path, tmp_path: Path) -> None:
    """A draft of another family pairs with the target when their token lists agree (a
    larger draft vocabulary too: its extra ids are never drafted), and greedy speculation
    equals plain; a vocabulary that differs at one id is refused, naming it."""
    import transformers as tf

    from speculant.proposers import TokenizerMismatchError

    target = load_model(built("qwen3", root).q8, dtype="gguf", progress=False)
    torch.manual_seed(7)
    cfg = tf.LlamaConfig(**{**TINY, "vocab_size": 352, "num_hidden_layers": 1})
    small = tf.LlamaForCausalLM(cfg).eval()
    superset = write_gguf(small, tmp_path / "draft-superset.gguf", "Q8_0")
    draft = load_model(superset, dtype="gguf", progress=False)
    assert draft.tokenizer is not None and draft.tokenizer.vocab_size > 320
    ids = ids_of(20, 4) + ids_of(6, 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = Engine(target, draft=draft, num_speculative_tokens=4)
    assert engine.generate(ids, params).token_ids == plain_greedy(target, ids, 24)
    other = write_gguf(small, tmp_path / "draft-other.gguf", "Q8_0", renamed={40: "zzz"})
    with pytest.raises(TokenizerMismatchError, match="token id 40 is 'zzz' in the draft"):
        Engine(target, draft=load_model(other, dtype="gguf", progress=False))


def test_shape_settings_are_bounded_and_named(root: Path, tmp_path: Path) -> None:
    """A config whose heads do not divide its width, or whose layer interval is 0 (a
    division by zero before), is refused naming the key that is wrong."""
    import json
    import re

    cases = [
        (
            "llama3-rope",
            {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
            "num_attention_heads=3 is not supported: a divisor of width 128",
        ),
        ("llama3-rope", {"num_key_value_heads": 3}, "num_key_value_heads=3"),
        (
            "smollm3",
            {"no_rope_layers": None, "no_rope_layer_interval": 0},
            "no_rope_layer_interval=0",
        ),
        ("llama3-rope", {"sliding_window": [64]}, "sliding_window=[64]"),
    ]
    for name, change, match in cases:
        b = built(name, root)
        cfg = json.loads((b.folder / "config.json").read_text())
        bad = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}"
        bad.mkdir()
        for f in b.folder.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        cfg.update(change)
        (bad / "config.json").write_text(
            json.dumps({k: v for k, v in cfg.items() if v is not None})
        )
        with pytest.raises(ModelLoadError, match=re.escape(match)):
            load_model(bad, dtype="float32", progress=False)
