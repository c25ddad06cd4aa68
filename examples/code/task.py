"""The code recipe's task: small programs that read stdin and print an answer, each with stdin/stdout tests
(the APPS / CodeContests format the `code` reward runs in its sandbox). ``solutions`` gives, per problem, a
correct program and two wrong ones; the policy's warm start (prepare.py) writes the correct one a third of
the time, and GRPO with the code reward raises that."""

from __future__ import annotations

import json
import random
from pathlib import Path

# (statement, correct program, wrong programs, [(stdin, stdout)])
PROBLEMS = [
    ("Read two integers on one line and print their sum.", "a, b = map(int, input().split())\nprint(a + b)",
     ["a, b = map(int, input().split())\nprint(a - b)", "a, b = map(int, input().split())\nprint(a * b)"],
     [("1 2", "3"), ("10 -4", "6"), ("0 0", "0")]),
    ("Read two integers on one line and print their product.", "a, b = map(int, input().split())\nprint(a * b)",
     ["a, b = map(int, input().split())\nprint(a + b)", "a, b = map(int, input().split())\nprint(a // b)"],
     [("3 4", "12"), ("-2 5", "-10"), ("7 1", "7")]),
    ("Read a line and print it reversed.", "print(input()[::-1])",
     ["print(input())", "print(input()[1:])"], [("abc", "cba"), ("tauflow", "wolfuat"), ("x", "x")]),
    ("Read a line and print it in upper case.", "print(input().upper())",
     ["print(input().lower())", "print(input())"], [("abc", "ABC"), ("Hi there", "HI THERE")]),
    ("Read an integer n and print the numbers 1 to n on one line.", "n = int(input())\nprint(*range(1, n + 1))",
     ["n = int(input())\nprint(*range(n))", "n = int(input())\nprint(n)"], [("3", "1 2 3"), ("1", "1"), ("5", "1 2 3 4 5")]),
    ("Read an integer and print yes if it is even, else no.", "print('yes' if int(input()) % 2 == 0 else 'no')",
     ["print('no' if int(input()) % 2 == 0 else 'yes')", "print('yes')"], [("4", "yes"), ("7", "no"), ("0", "yes")]),
    ("Read integers on one line and print the largest.", "print(max(map(int, input().split())))",
     ["print(min(map(int, input().split())))", "print(input().split()[0])"], [("3 9 2", "9"), ("-1 -5", "-1")]),
    ("Read a line and print how many words it has.", "print(len(input().split()))",
     ["print(len(input()))", "print(input().count(' '))"], [("a b c", "3"), ("hello", "1"), ("one two", "2")]),
    ("Read an integer n and print n squared.", "n = int(input())\nprint(n * n)",
     ["n = int(input())\nprint(n * 2)", "n = int(input())\nprint(n + n)"], [("3", "9"), ("-4", "16"), ("0", "0")]),
    ("Read integers on one line and print their sum.", "print(sum(map(int, input().split())))",
     ["print(len(input().split()))", "print(max(map(int, input().split())))"], [("1 2 3", "6"), ("5", "5"), ("-1 1", "0")]),
    ("Read a word and print its first letter.", "print(input()[0])",
     ["print(input()[-1])", "print(input()[:2])"], [("apple", "a"), ("zebra", "z")]),
    ("Read an integer n and print n factorial.", "import math\nprint(math.factorial(int(input())))",
     ["n = int(input())\nprint(n * (n - 1))", "print(int(input()))"], [("4", "24"), ("1", "1"), ("5", "120")]),
    ("Read a word and print it twice on one line.", "w = input()\nprint(w + w)",
     ["w = input()\nprint(w)", "w = input()\nprint(w, w)"], [("ab", "abab"), ("x", "xx")]),
    ("Read an integer and print its absolute value.", "print(abs(int(input())))",
     ["print(-int(input()))", "print(int(input()))"], [("-3", "3"), ("5", "5"), ("0", "0")]),
    ("Read a line and print how many vowels it has.", "print(sum(c in 'aeiou' for c in input()))",
     ["print(len(input()))", "print(sum(c not in 'aeiou' for c in input()))"], [("banana", "3"), ("sky", "0")]),
    ("Read two integers on one line and print the larger.", "print(max(map(int, input().split())))",
     ["print(min(map(int, input().split())))", "a, b = input().split()\nprint(a)"], [("3 8", "8"), ("9 2", "9")]),
]  # fmt: skip
SYSTEM = "Write a Python program that solves the task. Answer with one ```python code block."


def fenced(program: str) -> str:
    return f"```python\n{program}\n```"


def tests(cases: list[tuple[str, str]]) -> dict[str, list[str]]:
    return {"inputs": [i + "\n" for i, _ in cases], "outputs": [o + "\n" for _, o in cases]}


def corpus() -> list[str]:
    return [SYSTEM] + [t for p in PROBLEMS for t in (p[0], fenced(p[1]), *map(fenced, p[2]))]


def write_data(out: Path) -> None:
    """train.jsonl (the first 12 problems) and heldout.jsonl (all 16: whether the policy keeps the programs it
    learned, and any it finds for the 4 it never trained on), with their tests as the `tests` column."""
    rows = [{"id": f"p{i}", "prompt": p[0], "tests": tests(p[3])} for i, p in enumerate(PROBLEMS)]
    for name, part in (("train", rows[:12]), ("heldout", rows)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def warm_start_pairs(seed: int) -> list[tuple[list[dict[str, str]], str]]:
    """Per training problem: the correct program once, its two wrong ones once each."""
    rng = random.Random(seed)
    pairs = []
    for statement, good, bad, _ in PROBLEMS[:12]:
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": statement}]
        pairs += [(chat, fenced(program)) for program in (good, *bad)]
    rng.shuffle(pairs)
    return pairs
