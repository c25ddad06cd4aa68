"""Writes the bundled sample (data/train.jsonl, data/test.jsonl): 50 grade-school word problems in GSM8K's
format, made here (GSM8K itself cannot be downloaded on this machine). Each row is GSM8K's
``{"question": ..., "answer": "<worked solution with <<a*b=c>> calculator notes>\\n#### <number>"}``.

    python examples/gsm8k/make_sample.py   # the committed files; deterministic
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = [("Natalia", "she"), ("Tom", "he"), ("Priya", "she"), ("Mateo", "he"), ("Aiko", "she"), ("Sam", "he")]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps"]
THINGS = [("notebook", 3), ("sandwich", 7), ("ticket", 12), ("plant", 9), ("book", 15)]


def problem(rng: random.Random) -> tuple[str, str]:
    (name, pronoun), kind = rng.choice(NAMES), rng.randrange(5)
    if kind == 0:
        item, a, b = rng.choice(ITEMS), rng.randint(10, 60), rng.randint(2, 30)
        c = rng.randint(1, a + b - 1)
        q = f"{name} had {a} {item}. {pronoun.capitalize()} bought {b} more and then gave {c} to a friend. How many {item} does {name} have now?"
        steps = f"After buying, {name} had {a}+{b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n"
        steps += f"After giving some away, {pronoun} had {a + b}-{c} = <<{a + b}-{c}={a + b - c}>>{a + b - c} {item}."
        return q, f"{steps}\n#### {a + b - c}"
    if kind == 1:
        (thing, price), n = rng.choice(THINGS), rng.randint(2, 9)
        q = f"A {thing} costs ${price}. {name} buys {n} of them. How many dollars does {name} spend?"
        return q, f"{name} spends {n}*{price} = <<{n}*{price}={n * price}>>{n * price} dollars.\n#### {n * price}"
    if kind == 2:
        pages, days = rng.randint(5, 40), rng.randint(2, 14)
        q = f"{name} reads {pages} pages every day. How many pages does {pronoun} read in {days} days?"
        total = pages * days
        return (
            q,
            f"In {days} days {pronoun} reads {pages}*{days} = <<{pages}*{days}={total}>>{total} pages.\n#### {total}",
        )
    if kind == 3:
        april = 2 * rng.randint(10, 45)
        may = april // 2
        q = f"{name} sold clips to {april} of {pronoun == 'she' and 'her' or 'his'} friends in April, and then sold half as many clips in May. How many clips did {name} sell altogether in April and May?"
        steps = f"{name} sold {april}/2 = <<{april}/2={may}>>{may} clips in May.\n"
        steps += f"{name} sold {april}+{may} = <<{april}+{may}={april + may}>>{april + may} clips altogether."
        return q, f"{steps}\n#### {april + may}"
    rows, per_row = rng.randint(3, 12), rng.randint(4, 15)
    taken = rng.randint(1, rows * per_row - 1)
    q = f"A hall has {rows} rows of {per_row} chairs. {taken} chairs are taken. How many chairs are empty?"
    seats = rows * per_row
    steps = f"The hall has {rows}*{per_row} = <<{rows}*{per_row}={seats}>>{seats} chairs.\n"
    steps += f"So {seats}-{taken} = <<{seats}-{taken}={seats - taken}>>{seats - taken} chairs are empty."
    return q, f"{steps}\n#### {seats - taken}"


def main() -> None:
    rng = random.Random(8)
    rows = []
    while len(rows) < 50:
        q, a = problem(rng)
        if all(q != r["question"] for r in rows):
            rows.append({"question": q, "answer": a})
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("train", rows[:40]), ("test", rows[40:])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
