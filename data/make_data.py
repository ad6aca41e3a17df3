"""Generate the shipped preference task: data/preference_task.jsonl.

    python data/make_data.py          # rewrites data/preference_task.jsonl, byte for byte the same

Four families of *checkable* questions.  Each asks for a number on one side of a bound; the bound
is a plain number, a sum, or a value the prompt itself gives to a name.  Each row has the DSC
schema `prompt` / `chosen` / `rejected` (+ a `family` column that the loaders ignore):

  more    "Human: Say a number larger than 537. Assistant:"                                 " 812"
  less    "Human: Name a number lower than 90. Assistant:"                                  " 17"
  sum     "Human: Give a number greater than 288 + 118. Assistant:"                         " 894"
  lookup  "Human: Fay has 634. Cid has 296. Say a number lower than Cid's. Assistant:"      " 160"

Why this task.  Many answers are right, and `chosen` is spread evenly over all of them, the way
different human demonstrators would answer.  The SFT model learns that wide distribution: its
greedy answer is almost always right, but sampled at temperature 1 it often lands on the wrong
side of the bound.  The reward model can learn the rule from the pairs, and PPO can then move the
policy toward answers that are safely right.  That is the gap RLHF closes on this task.

Every prompt occurs once in the file, so held-out prompts are really new.  The gold rule is
`minirlhf.gold_score(prompt, answer)`; this script asserts that every `chosen` scores 1 and every
`rejected` scores 0.

`rejected` answers are the mistakes a half-trained actor makes when it samples: the bound itself,
a number just across it or anywhere on the wrong side, the other name's number (lookup), an addend
(sum), and mistakes of form: a cut or repeated answer, junk after it, a leading zero, a refusal.
"""
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from minirlhf import GOLD_MAX, GOLD_UP, GOLD_VERBS, gold_score  # noqa: E402

ROWS_PER_FAMILY = {"more": 4500, "less": 4500, "sum": 4500, "lookup": 4500}
SEED = 20231122
NAMES = ["Ann", "Bob", "Cid", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon", "Kim", "Lou"]
WORDS = ["red", "tea", "cake", "cat", "dog", "sun", "box", "cup", "hat", "map", "pen", "key"]
UP_WORDS = [w for w, up in GOLD_UP.items() if up]              # larger, bigger, greater
DOWN_WORDS = [w for w, up in GOLD_UP.items() if not up]        # smaller, less, lower


def one_side(rng, bound, up):
    """A right answer (uniform over the whole right side) and typical wrong ones for `bound`."""
    if up:
        right = rng.randrange(bound + 1, GOLD_MAX + 1)
        wrong = [bound, max(0, bound - rng.randint(1, 9))] + [rng.randrange(bound + 1) for _ in range(3)]
    else:
        right = rng.randrange(bound)
        wrong = [bound, min(GOLD_MAX, bound + rng.randint(1, 9))] + [rng.randrange(bound, GOLD_MAX + 1) for _ in range(3)]
    return str(right), [str(w) for w in wrong]


def ask(rng, up):
    return "%s a number %s than" % (rng.choice(GOLD_VERBS), rng.choice(UP_WORDS if up else DOWN_WORDS))


def make_compare(rng, up):
    """more (up) and less: a bound with room on the right side (more: 0..998, less: 1..999)."""
    n = rng.randrange(GOLD_MAX) if up else rng.randrange(1, GOLD_MAX + 1)
    right, wrong = one_side(rng, n, up)
    return "%s %d." % (ask(rng, up), n), right, wrong


def make_sum(rng):
    a, b = rng.randrange(500), rng.randrange(500)
    n = a + b
    up = n == 0 or rng.random() < 0.5
    right, wrong = one_side(rng, n, up)
    if up:
        wrong += [str(max(a, b))] * 2                           # larger than one addend, not the sum
    return "%s %d + %d." % (ask(rng, up), a, b), right, wrong


def make_lookup(rng):
    n1, n2 = rng.sample(NAMES, 2)
    v1, v2 = rng.randrange(1, GOLD_MAX), rng.randrange(1, GOLD_MAX)
    who = rng.choice([n1, n2])
    n, other = (v1, v2) if who == n1 else (v2, v1)
    up = rng.random() < 0.5
    right, wrong = one_side(rng, n, up)
    wrong += [str(other)] * 3                                   # the other name's number (kept if wrong)
    return "%s has %d. %s has %d. %s %s's." % (n1, v1, n2, v2, ask(rng, up), who), right, wrong


def garble(rng, ans):
    """Mistakes of form, not of the task's logic."""
    kind = rng.randrange(6)
    if kind == 0 and len(ans) > 1:                       # cut short
        return ans[: rng.randrange(1, len(ans))]
    if kind == 1:                                        # repeated
        return " ".join([ans] * rng.randint(2, 3))
    if kind == 2:                                        # junk after the answer
        return ans + " " + rng.choice(WORDS + NAMES)
    if kind == 3:                                        # a leading zero: not a plain number
        return "0" + ans
    if kind == 4:                                        # refusal / unhelpful
        return rng.choice(["I don't know.", "Maybe.", "No.", "Assistant:", "Human:"])
    return " ".join(rng.choice(WORDS + NAMES) for _ in range(rng.randint(1, 3)))   # word salad


def main(path=os.path.join(HERE, "preference_task.jsonl")):
    rng = random.Random(SEED)
    rows, seen = [], set()
    families = [("more", lambda r: make_compare(r, True)), ("less", lambda r: make_compare(r, False)),
                ("sum", make_sum), ("lookup", make_lookup)]
    for family, make in families:
        n = tries = 0
        while n < ROWS_PER_FAMILY[family]:
            tries += 1
            assert tries < 50 * ROWS_PER_FAMILY[family], f"{family}: too few distinct prompts"
            question, ans, wrong = make(rng)
            prompt = "Human: " + question + " Assistant:"
            # Two thirds mistakes of logic, one third mistakes of form.
            bad = rng.choice(wrong) if rng.random() < 0.65 else garble(rng, ans)
            # Every prompt once (held-out means unseen); a "mistake" that happens to be right is redrawn.
            if prompt in seen or gold_score(prompt, " " + bad) != 0.0:
                continue
            seen.add(prompt)
            row = {"prompt": prompt, "chosen": " " + ans, "rejected": " " + bad, "family": family}
            assert gold_score(prompt, row["chosen"]) == 1.0, row
            rows.append(row)
            n += 1
    rng.shuffle(rows)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
