"""SPEED-Bench files as the peers' prepare steps write them, made by the tests (the data cannot be shipped): rows in
the schema, over the test vocabulary (`t0` ... words), some multi-turn, some with a source not fetched."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flashdraft.data.speed_bench import PLACEHOLDER


def _text(seed: int, words: int) -> str:
    return " ".join(f"t{(seed * 7 + 3 * j) % 50}" for j in range(words))


def speed_bench_rows(
    categories: tuple[str, ...] = ("coding", "math", "writing"), per_category: int = 2, placeholders: int = 0
) -> list[dict]:
    """Rows of a split: `per_category` per category, every second one two turns; the last `placeholders` rows hold
    the text of a source that was not fetched."""
    rows = []
    for c, category in enumerate(categories):
        for k in range(per_category):
            n = c * per_category + k
            turns = [_text(n, 6 + n % 4)] + ([_text(n + 20, 5)] if k % 2 else [])
            rows.append(
                {
                    "question_id": f"{n:032x}",
                    "category": category,
                    "sub_category": f"{category}-sub",
                    "source": "test",
                    "src_id": str(n),
                    "difficulty": "easy",
                    "multiturn": len(turns) > 1,
                    "messages": [{"role": "user", "content": t} for t in turns],
                }
            )
    for row in rows[len(rows) - placeholders :] if placeholders else []:
        row["messages"] = [{"role": "user", "content": PLACEHOLDER}]
    return rows


def write_nemo_skills(directory: Path, splits: dict[str, list[dict]]) -> Path:
    """NeMo-Skills' layout: `<split>.jsonl` per split in one directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def write_model_optimizer(directory: Path, splits: dict[str, list[dict]]) -> Path:
    """Model Optimizer's layout: `data/speed/<config>/test.parquet`, each row's user turns as `turns`."""
    for split, rows in splits.items():
        out = directory / "data" / "speed" / split
        out.mkdir(parents=True, exist_ok=True)
        table = [
            {k: v for k, v in r.items() if k != "messages"} | {"turns": [m["content"] for m in r["messages"]]}
            for r in rows
        ]
        pq.write_table(pa.Table.from_pylist(table), out / "test.parquet")
    return directory
