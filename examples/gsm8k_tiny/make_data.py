"""Write a tiny GSM8K-format dataset: arithmetic word problems with numeric answers, laid out as
verl's ``examples/data_preprocess/gsm8k.py`` writes GSM8K (one Parquet file per split)::

    {"data_source": "gsm8k_tiny",
     "prompt": [{"role": "user", "content": "tom has 3 apples and gets 4 more . how many apples ..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "7"},
     "extra_info": {"split": "train", "index": 0, "question": "...", "answer": "3 plus 4 is 7 . #### 7"}}

The problems are small enough for examples/gsm8k_tiny.yaml's tiny model to learn from scratch on a
CPU in a few minutes: two numbers whose sum is at most ``--max-sum`` (default 5; every sum equally
likely, so no one answer pays off everywhere, and the answer is one word), three sentence
templates, four names and four objects (a vocabulary of about 40 words). The validation split is
drawn with another seed from the same problems.

    python examples/gsm8k_tiny/make_data.py --out data/gsm8k_tiny
    rlcore train examples/gsm8k_tiny.yaml --output runs/gsm8k_tiny

Needs pyarrow (``pip install "rlcore[data]"``).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DATA_SOURCE = "gsm8k_tiny"
NAMES = ["tom", "ana", "sam", "mia"]
THINGS = ["apples", "books", "coins", "cards"]
TEMPLATES = [
    "what is {a} plus {b} ?",
    "{name} has {a} {things} and gets {b} more . how many {things} does {name} have ?",
    "{name} buys {a} {things} and then {b} {things} . how many {things} in all ?",
]


def problem(rng: random.Random, max_sum: int, templates: int = len(TEMPLATES)) -> tuple[str, int, int]:
    """One question (one of the first ``templates`` templates) and its two numbers (``a + b <= max_sum``)."""
    total = rng.randint(0, max_sum)  # every answer equally likely: no one answer pays off everywhere
    a = rng.randint(0, total)
    b = total - a
    text = rng.choice(TEMPLATES[:templates]).format(a=a, b=b, name=rng.choice(NAMES), things=rng.choice(THINGS))
    return text, a, b


def rows(split: str, count: int, seed: int, max_sum: int) -> list[dict]:
    rng = random.Random(f"{DATA_SOURCE}:{split}:{seed}")
    out = []
    for i in range(count):
        question, a, b = problem(rng, max_sum)
        answer = str(a + b)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": i, "question": question,
                           "answer": f"{a} plus {b} is {answer} . #### {answer}"},
        })
    return out


def write(out_dir: Path | str, train: int = 2000, val: int = 64, seed: int = 0, max_sum: int = 5) -> dict[str, Path]:
    """``train.parquet`` and ``val.parquet`` in ``out_dir``; their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, count in (("train", train), ("val", val)):
        paths[split] = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows(split, count, seed, max_sum)), paths[split])
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/gsm8k_tiny", help="output directory (default data/gsm8k_tiny)")
    ap.add_argument("--train", type=int, default=2000, help="train rows (default 2000)")
    ap.add_argument("--val", type=int, default=64, help="validation rows (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-sum", type=int, default=5, help="the largest answer (default 5)")
    args = ap.parse_args(argv)
    for split, path in write(args.out, args.train, args.val, args.seed, args.max_sum).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
