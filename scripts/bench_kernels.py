"""Weight-only matmul kernels at the row counts a verify pass uses.

    python scripts/bench_kernels.py

Cycles through 16 distinct 1536x8960 weights (440 MB in bf16, so nothing stays in
cache) and reports the median ms per weight for bf16 `F.linear`, int8
`_weight_int8pack_mm` and int4 `_weight_int4pack_mm_for_cpu` at m = 1, 2, 4, 8, 16 rows.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from speculant.models.decoder import Int4Weight, Int8Weight, linear


def main() -> None:
    torch.manual_seed(0)
    dense = [torch.randn(8960, 1536).bfloat16() for _ in range(16)]
    formats = {
        "bf16": dense,
        "int8": [Int8Weight.quantize(w) for w in dense],
        "int4": [Int4Weight.quantize(w) for w in dense],
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per 1536x8960 weight")
    print(f"{'rows':>5} " + " ".join(f"{name:>7}" for name in formats))
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, 1536).bfloat16()
        cells = []
        for ws in formats.values():
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for w in ws:
                    (F.linear(x, w) if isinstance(w, torch.Tensor) else linear(x, w))
                times.append((time.perf_counter() - t0) / len(ws) * 1e3)
            cells.append(statistics.median(times))
        print(f"{m:>5} " + " ".join(f"{c:7.2f}" for c in cells))


if __name__ == "__main__":
    main()
