"""`-k auto` where drafts are always rejected: layer-skip with 75% of layers skipped on a
creative prompt, a fresh engine per repeat (first-request condition), against plain runs
just before and after in the same process.

    python scripts/bench_auto_rejected.py
"""

import statistics

from speculant import Engine, SamplingParams, load_model

t = load_model("qwen2.5-coder-1.5b-instruct", progress=False)
tok = t.tokenizer
ids = tok.encode(
    tok.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Write a short, surprising story about a lighthouse keeper "
                "and a migrating whale.",
            }
        ]
    ),
    add_special_tokens=False,
)
params = SamplingParams(max_tokens=128)
plain = Engine(t)
plain.generate(ids[:8], SamplingParams(max_tokens=4))
ratios = []
for rep in range(3):
    a = plain.generate(ids, params)
    e = Engine(
        t, method="layer-skip", num_speculative_tokens="auto", proposer_options={"skip_ratio": 0.75}
    )
    b = e.generate(ids, params)
    c = plain.generate(ids, params)
    base = (a.stats.tokens_per_second + c.stats.tokens_per_second) / 2
    ratios.append(b.stats.tokens_per_second / base)
    print(
        rep,
        round(a.stats.tokens_per_second, 2),
        round(b.stats.tokens_per_second, 2),
        round(c.stats.tokens_per_second, 2),
        "ratio",
        round(ratios[-1], 3),
        "history head",
        list(e.policy.history)[:12],
        "drafted",
        b.stats.num_drafted,
        flush=True,
    )
print("median ratio", statistics.median(ratios))
