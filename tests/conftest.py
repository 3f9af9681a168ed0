"""Shared fixtures: tiny random models (built in code) and access to pulled real models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# A `speculant tune` result saved on this machine would change the kernels' knobs under
# the tests (never a result, but tests check the defaults): the tests ignore it.
os.environ["SPECULANT_TUNING"] = "0"

from tiny import save_tiny  # noqa: E402

from speculant.models.model import Model, load_model  # noqa: E402


def real_model_path(name: str) -> Path:
    """Path of a pulled registry model; skip the test if absent, unless CI requires it
    (SPECULANT_REQUIRE_REAL=1, set by .ci/run after `speculant models pull`)."""
    home = Path(os.environ.get("SPECULANT_HOME", Path.home() / ".cache" / "speculant"))
    found = sorted((home / "models" / name).glob("*.gguf"))
    if found:
        return found[0]
    msg = f"real model {name} is not pulled (run: speculant models pull {name})"
    if os.environ.get("SPECULANT_REQUIRE_REAL") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


_CACHE: dict[tuple[str, str, int, str], Model] = {}


def tiny_model(
    tmp_root: Path, arch: str = "llama", seed: int = 0, dtype: str = "float32", **overrides: int
) -> Model:
    key = (arch, dtype, seed, repr(sorted(overrides.items())))
    if key not in _CACHE:
        path = tmp_root / f"{arch}-{seed}-{abs(hash(key[3]))}"
        if not path.exists():
            save_tiny(arch, path, seed=seed, **overrides)
        _CACHE[key] = load_model(path, dtype=dtype, progress=False)
    return _CACHE[key]


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def smollm2() -> Model:
    path = real_model_path("smollm2-135m-instruct")
    return load_model(path, dtype="bfloat16", progress=False)


def tiny_eagle_options(model: Model, tree_topk: int = 3, seed: int = 0) -> dict[str, object]:
    """proposer_options for method eagle on a tiny model: an untrained head (its drafts
    are mostly rejected, which is what equivalence tests need to exercise)."""
    import torch

    from speculant.eagle.head import EagleHead, HeadConfig

    torch.manual_seed(seed)
    head = EagleHead(HeadConfig.for_target("tiny", "", model.config, model.vocab_size))
    return {"eagle_head": head, "tree_topk": tree_topk, "tree_tokens": 8, "eagle_dtype": "float32"}
