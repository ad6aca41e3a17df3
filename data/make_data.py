"""Generate the shipped preference task: data/preference_task.jsonl.

    python data/make_data.py          # rewrites data/preference_task.jsonl, byte for byte the same

Four families of simple, *checkable* questions.  Each row has the DSC schema
`prompt` / `chosen` / `rejected` (+ a `family` column that the loaders ignore):

  add      "Human: What is 23 + 14? Assistant:"                       -> " 37"
  compare  "Human: Which is larger, 61 or 58? Assistant:"             -> " 61"
  lookup   "Human: Ann likes red. Bob likes tea. What does Bob like? Assistant:" -> " tea"
  reverse  "Human: Reverse the words: cat sun map Assistant:"         -> " map sun cat"

The facts of `lookup` are defined by the prompt itself, so every family is a
general skill, not a table to memorise, and held-out prompts really are new:
every prompt occurs once in the file.  The gold rule that checks an answer is
`minirlhf.gold_score(prompt, answer)`; this script imports it and asserts that
every `chosen` scores 1 and every `rejected` scores 0.

`rejected` answers are the kinds of mistakes a half-trained actor makes when it
samples at temperature 1: a near-miss number, the wrong operand, a truncated
answer, a repeated or garbled one, an answer from the wrong family, a refusal.
A reward model that has seen these can score the actor's real errors low.
"""
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from minirlhf import GOLD_NAMES, GOLD_WORDS, gold_score  # noqa: E402

ROWS_PER_FAMILY = {"add": 3000, "compare": 5000, "lookup": 5000, "reverse": 5000}
SEED = 20231122


def garble(rng, ans):
    """Mistakes that are not about the task's logic: cut, repeated, shuffled, noise."""
    toks = ans.split()
    kind = rng.randrange(5)
    if kind == 0 and len(ans) > 1:                       # truncated answer
        return ans[: rng.randrange(1, len(ans))].strip() or ans[0]
    if kind == 1:                                        # repeated answer
        return " ".join([ans] * rng.randint(2, 3))
    if kind == 2:                                        # answer plus junk
        return ans + " " + rng.choice(GOLD_WORDS + GOLD_NAMES + [str(rng.randrange(100))])
    if kind == 3:                                        # refusal / unhelpful
        return rng.choice(["I don't know.", "Maybe.", "No.", "Assistant:", "Human:"])
    # word salad from the task's own vocabulary
    pool = GOLD_WORDS + GOLD_NAMES + [str(rng.randrange(100)) for _ in range(5)]
    return " ".join(rng.choice(pool) for _ in range(rng.randint(1, max(2, len(toks) + 1))))


def near_miss(rng, ans):
    """The actor's most common slip: the right answer with one piece changed.  A number gets one
    digit replaced; words get one word replaced, dropped, or a digit glued on."""
    if ans.isdigit():
        i = rng.randrange(len(ans))
        d = rng.choice([c for c in "0123456789" if c != ans[i]])
        return ans[:i] + d + ans[i + 1:]
    ws = ans.split()
    i = rng.randrange(len(ws))
    kind = rng.randrange(3)
    if kind == 0:
        ws[i] = rng.choice([w for w in GOLD_WORDS if w != ws[i]])
    elif kind == 1 and len(ws) > 1:
        del ws[i]
    else:
        ws[i] = ws[i] + str(rng.randrange(10))
    return " ".join(ws)


def make_add(rng):
    a, b = rng.randrange(300), rng.randrange(1, 4)
    if rng.random() < 0.5:
        a, b = b, a
    tpl = rng.choice(["What is {a} + {b}?", "Add {a} and {b}."])
    ans = str(a + b)
    wrong = [str(a + b + d) for d in (-10, -2, -1, 1, 2, 10) if a + b + d >= 0]
    wrong += [str(max(a, b)), str(max(a, b)), ans[::-1], near_miss(rng, ans), near_miss(rng, ans)]
    return tpl.format(a=a, b=b), ans, wrong


def make_compare(rng):
    a, b = rng.sample(range(100), 2)
    tpl = rng.choice(["Which is larger, {a} or {b}?", "Which is bigger: {a} or {b}?"])
    ans = str(max(a, b))
    hi, lo = max(a, b), min(a, b)
    mixes = [str(10 * (hi // 10) + lo % 10), str(10 * (lo // 10) + hi % 10)]      # digits of both
    wrong = [str(lo), str(lo), str(lo), str(a + b), str(hi)[::-1], near_miss(rng, ans)] + mixes * 2
    return tpl.format(a=a, b=b), ans, wrong


def make_lookup(rng):
    n1, n2 = rng.sample(GOLD_NAMES, 2)
    w1, w2 = rng.sample(GOLD_WORDS, 2)
    ask = rng.choice([n1, n2])
    tpl = rng.choice(["{n1} likes {w1}. {n2} likes {w2}. What does {q} like?",
                      "{n1} has a {w1}. {n2} has a {w2}. What does {q} have?"])
    prompt = tpl.format(n1=n1, n2=n2, w1=w1, w2=w2, q=ask)
    ans = w1 if ask == n1 else w2
    other = w2 if ask == n1 else w1
    wrong = [other, other, other, ask, rng.choice([w for w in GOLD_WORDS if w not in (w1, w2)]),
             near_miss(rng, ans)]
    return prompt, ans, wrong


def make_reverse(rng):
    ws = rng.sample(GOLD_WORDS, 3)
    prompt = "Reverse the words: " + " ".join(ws)
    ans = " ".join(ws[::-1])
    wrong = [" ".join(ws), " ".join([ws[2], ws[0], ws[1]]), " ".join([ws[1], ws[2], ws[0]]),
             near_miss(rng, ans), near_miss(rng, ans)]
    return prompt, ans, wrong


def main(path=os.path.join(HERE, "preference_task.jsonl")):
    rng = random.Random(SEED)
    rows, seen = [], set()
    for family, make in [("add", make_add), ("compare", make_compare),
                         ("lookup", make_lookup), ("reverse", make_reverse)]:
        n = tries = 0
        while n < ROWS_PER_FAMILY[family]:
            tries += 1
            assert tries < 50 * ROWS_PER_FAMILY[family], f"{family}: too few distinct prompts"
            question, ans, wrong = make(rng)
            prompt = "Human: " + question + " Assistant:"
            # Two thirds task-logic mistakes, one third form mistakes (truncation, junk, refusals).
            bad = rng.choice(wrong) if rng.random() < 0.65 else garble(rng, ans)
            if prompt in seen or bad.strip() == ans:     # every prompt once: held-out means unseen
                continue
            seen.add(prompt)
            row = {"prompt": prompt, "chosen": " " + ans, "rejected": " " + bad, "family": family}
            assert gold_score(prompt, row["chosen"]) == 1.0, row
            assert gold_score(prompt, row["rejected"]) == 0.0, row
            rows.append(row)
            n += 1
    rng.shuffle(rows)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
