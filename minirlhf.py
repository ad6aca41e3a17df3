"""minirlhf: DeepSpeed-Chat's three-phase RLHF in one readable file.

    python minirlhf.py --phase all          # SFT -> reward model -> PPO on the embedded default, a few minutes on a CPU
    python minirlhf.py --phase 3 --help     # every flag, with DeepSpeed-Chat's name and our CPU default
    python -m pytest                        # numerical tests + the doctests in this file

Read it beside the blog posts in ../shared/seeds/ (000 is the map; section numbers
in the comments are 000's, whose §0 is data, §1 SFT, §2 the reward model and §3 PPO).  The file runs top to bottom in the order the blog teaches:

    §0  data: raw datasets, the 2,4,4 split, the phase formats, the collators   (DSC dschat/utils/data/)
    §1  models: tokenizer, create_hf_model, LoRA, RewardModel                    (DSC dschat/utils/model, module/lora.py)
    §2  phase 1, supervised fine-tuning                                          (DSC step1_supervised_finetuning/main.py)
    §3  phase 2, the reward model                                                (DSC step2_reward_model_finetuning/main.py)
    §4  phase 3, PPO: experience, rewards, GAE, losses, train_rlhf, the loop     (DSC dschat/rlhf/ppo_trainer.py, step3 main.py)
    §5  plumbing: engines (plain or DeepSpeed), checkpoints, metrics, plots, main()

Notation (shape comments use these letters):
    B  sequences in a batch          P  prompt width (fixed, left-padded)     A  answer width
    T  = P + A, full sequence         V  vocabulary size
    Index t of log_probs / values / action_mask (all (B, T-1)) is the action "emit token t+1
    after the prefix ending at token t".  start = P - 1 is therefore the first answer action.

Implementation details, numbered as they are tagged in the code ([D1] ...):
    [D1]  Separate pad and eos tokens; the attention mask keeps the EOS, so the model learns to stop.
    [D2]  Prompts are left-padded to a fixed width (DataCollatorRLHF); positions come from the mask.
    [D3]  Rollouts sample from the plain categorical (top_k=0, top_p=1) at --temperature.
    [D4]  Log-probs are taken from logits / temperature, the distribution that was sampled.
    [D5]  The reward model reads the score at the last real token (the EOS when the answer ended).
    [D6]  Per-token KL penalty -kl_ctl·(log π - log π_ref) on every action, the clipped score on the last.
    [D7]  Nothing after the answer carries reward or value: GAE bootstraps with 0 after the last action.
    [D8]  GAE with γ=1, λ=0.95 (trlx / DSC), advantages not whitened (as DSC).
    [D9]  Clipped policy loss and clipped value loss, both masked means over answer actions.
    [D10] Dropout is 0 in the embedded model, so the PPO ratio is exactly 1 on the first micro-step.
    [D11] The critic starts as the reward model (InstructGPT, DSC).
    [D12] Gradient clipping 1.0 and AdamW betas (0.9, 0.95), as DSC's DeepSpeed config.
    [D13] SFT puts no loss on the prompt by default (--sft_mask_prompt; DSC trains on it).

How minirlhf differs from DeepSpeed-Chat, in short (each is a `DIFF:` comment at its line):
    1. The clipped score lands on the last answer action, not one slot later (DSC PR #672).
    2. pad != eos, so the EOS is kept in the mask and trained; DSC sets pad = eos.
    3. Every phase ends texts with tokenizer.eos_token; DSC's phase 2 uses the literal "<|endoftext|>".
    4. Rollouts sample at --temperature; DSC's OPT rollouts are greedy.
    5. Position ids come from the attention mask on every forward; DSC passes none.
    6. A bare-EOS answer is scored and trained on; DSC drops answers of <= 1 token, which lets the
       policy escape every penalty (--drop_short_answers restores DSC).
    7. Phase 2 starts from phase 1's SFT model (InstructGPT); DSC starts from a pretrained LM.
    8. SFT puts no loss on the prompt by default; DSC trains on it.
    9. The reward clip defaults to ±20, not ±5: our reward model's scores span about ±14, and at ±5
       every good answer earns the same reward.
What DSC does is tagged `DSC:`.  Code a learner may skip is tagged `[plumbing]`.
"""
import argparse
import copy
import csv
import glob
import json
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

# transformers, datasets, tokenizers, tqdm and deepspeed are imported inside the functions that
# need them, so `import minirlhf` (and its doctests) costs only torch.

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "data", "preference_task.jsonl")
TINY = "tiny"  # the --model_name_or_path that means "build the embedded default model"


# ======================================================================================
# §0  Data (seed 000 §0.1-§0.2.2, §2.3.2, §3.2): from raw rows to the three phase formats
# ======================================================================================
# Every phase reads the same preference rows (prompt, chosen, rejected).  Phase 1 trains on
# prompt+chosen, phase 2 on the (chosen, rejected) pair, phase 3 on the prompt alone.
# `--data_split 2,4,4` hands each phase its own disjoint slice of the rows.

# --------------------------------------------------------------------------------------
# §0.0  The shipped task and its gold rule (used only to *measure*; nothing trains on it)
# --------------------------------------------------------------------------------------
# data/make_data.py writes four families of questions that each ask for a number on one side of a
# bound.  The bound is a number (compare), a sum (arithmetic), or a value that the prompt itself
# assigns to a name (lookup):
#
#   more    "Human: Say a number larger than 537. Assistant:"                    " 812"
#   less    "Human: Name a number lower than 90. Assistant:"                     " 17"
#   sum     "Human: Give a number greater than 288 + 118. Assistant:"            " 894"
#   lookup  "Human: Fay has 634. Cid has 296. Say a number lower than Cid's. Assistant:"   " 160"
#
# Many answers are right, and the demonstrations (`chosen`) are spread over all of them, as human
# demonstrators would be.  So the SFT model learns a *wide* distribution: its greedy answer is
# nearly always right, but at temperature 1 it often strays across the bound.  That gap is what
# RLHF can close, and only if the reward model has learned where the bound is.
# gold_score says whether an answer is right.  The reward model never sees it: it learns from the
# chosen/rejected pairs.
GOLD_MAX = 999                 # answers are integers 0..999 written plainly ("042" is wrong)
GOLD_VERBS = ("Say", "Name", "Give", "Write")
GOLD_UP = {"larger": True, "bigger": True, "greater": True, "smaller": False, "less": False, "lower": False}
_GOLD_ASK = r"(?:%s) a number (%s) than " % ("|".join(GOLD_VERBS), "|".join(GOLD_UP))


def gold_bound(prompt):
    """(bound, up) for a shipped-task prompt: the answer must be > bound (up) or < bound; None
    for any other prompt.

    >>> gold_bound("Human: Give a number greater than 288 + 118. Assistant:")
    (406, True)
    >>> gold_bound("Human: Fay has 634. Cid has 296. Say a number lower than Cid's. Assistant:")
    (296, False)
    >>> gold_bound("Human: hi Assistant:") is None
    True
    """
    q = prompt.replace("Human:", "").replace("Assistant:", "").strip()
    m = re.fullmatch(_GOLD_ASK + r"(\d+)(?: \+ (\d+))?\.", q)                       # more, less, sum
    if m:
        return int(m.group(2)) + int(m.group(3) or 0), GOLD_UP[m.group(1)]
    m = re.fullmatch(r"(\w+) has (\d+)\. (\w+) has (\d+)\. " + _GOLD_ASK + r"(\w+)'s\.", q)     # lookup
    if m:
        n1, v1, n2, v2, word, ask = m.groups()
        if ask in (n1, n2):
            return int(v1 if ask == n1 else v2), GOLD_UP[word]
    return None


def gold_score(prompt, answer):
    """1.0 if `answer` is right for a shipped-task `prompt`, 0.0 if wrong, nan for any other prompt.

    >>> p = "Human: Say a number larger than 537. Assistant:"
    >>> gold_score(p, " 540"), gold_score(p, " 537"), gold_score(p, " 0999"), gold_score(p, " 999 cats")
    (1.0, 0.0, 0.0, 0.0)
    >>> gold_score("Human: hi Assistant:", " 5")
    nan
    """
    bound = gold_bound(prompt)
    if bound is None:
        return float("nan")
    a = answer.strip()
    if not re.fullmatch(r"0|[1-9]\d*", a) or int(a) > GOLD_MAX:                       # 0..999, plainly
        return 0.0
    x, (n, up) = int(a), bound
    return float(x > n if up else x < n)


# --------------------------------------------------------------------------------------
# §0.1  Raw datasets: five getters per source (DSC raw_datasets.py, seed 000 §0.2.1)
# --------------------------------------------------------------------------------------
class PromptRawDataset:
    """One preference source.  Subclasses say where the rows are and how to read a row.

    The five getters return strings (or None when a row has no such field); a prompt ends with
    "Assistant:" and an answer starts with a space, so prompt + answer is the dialogue.
    """
    dataset_name = "base"

    def __init__(self, seed=1234):
        self.seed = seed
        self.raw_datasets = None

    def get_train_data(self):
        return self.raw_datasets["train"]

    def get_eval_data(self):
        return self.raw_datasets["test"]

    def get_prompt(self, sample):
        return sample["prompt"]

    def get_chosen(self, sample):
        return sample["chosen"]

    def get_rejected(self, sample):
        return sample["rejected"]

    def get_prompt_and_chosen(self, sample):
        return self.get_prompt(sample) + self.get_chosen(sample)

    def get_prompt_and_rejected(self, sample):
        return self.get_prompt(sample) + self.get_rejected(sample)


def _hub_dataset(name):
    """datasets.load_dataset, or load_from_disk when `name` is a saved dataset folder (as DSC)."""
    import datasets
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_dict.json")):
        return datasets.load_from_disk(name)
    return datasets.load_dataset(name)


def _carve_test_split(dataset, seed):
    """DSC: sources without a test split carve one with a fixed 9:1 split of train."""
    parts = dataset["train"].train_test_split(test_size=0.1, seed=seed, shuffle=True)
    return {"train": parts["train"], "test": parts["test"]}


class DahoasRmstaticDataset(PromptRawDataset):
    """Dahoas/rm-static: columns prompt, response, chosen, rejected; train and test splits."""
    dataset_name = "Dahoas/rm-static"

    def __init__(self, seed=1234, path="Dahoas/rm-static"):
        super().__init__(seed)
        self.raw_datasets = _hub_dataset(path)


class DahoasFullhhrlhfDataset(DahoasRmstaticDataset):
    """Dahoas/full-hh-rlhf: same columns as rm-static."""
    dataset_name = "Dahoas/full-hh-rlhf"

    def __init__(self, seed=1234, path="Dahoas/full-hh-rlhf"):
        super().__init__(seed, path)


class DahoasSyntheticinstructgptjpairwiseDataset(PromptRawDataset):
    """Dahoas/synthetic-instruct-gptj-pairwise: columns prompt, chosen, rejected; train only."""
    dataset_name = "Dahoas/synthetic-instruct-gptj-pairwise"

    def __init__(self, seed=1234, path="Dahoas/synthetic-instruct-gptj-pairwise"):
        super().__init__(seed)
        self.raw_datasets = _carve_test_split(_hub_dataset(path), seed)

    def get_prompt(self, sample):
        return " Human: " + sample["prompt"] + " Assistant:"

    def get_chosen(self, sample):
        return " " + sample["chosen"]

    def get_rejected(self, sample):
        return " " + sample["rejected"]


class YitingxieRlhfrewarddatasetsDataset(PromptRawDataset):
    """yitingxie/rlhf-reward-datasets: prompt ends with "Assistant:", chosen/rejected start with
    the "Assistant:" prefix again, which we cut (as DSC does)."""
    dataset_name = "yitingxie/rlhf-reward-datasets"

    def __init__(self, seed=1234, path="yitingxie/rlhf-reward-datasets"):
        super().__init__(seed)
        self.raw_datasets = _hub_dataset(path)

    def get_prompt(self, sample):
        return sample["prompt"] + "Assistant:"

    def get_chosen(self, sample):
        return sample["chosen"].split("Assistant:")[-1]

    def get_rejected(self, sample):
        return sample["rejected"].split("Assistant:")[-1]


class LocalPreferenceDataset(PromptRawDataset):
    """Local json / jsonl / csv / parquet files, or a folder of them, with columns
    prompt, chosen, rejected (`response` is optional, as in rm-static; other columns are ignored).

    A folder whose file names contain "train" and "eval"/"test" gives those splits; otherwise the
    rows are split 9:1 with a seeded shuffle, like DSC's sources that lack a test split.
    DIFF: DSC's LocalJsonFile wants exactly data/train.json and data/eval.json.
    Every bad row is reported with its file, line (or row) and field, and nothing is dropped silently.
    """
    dataset_name = "local"
    EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet")

    def __init__(self, seed=1234, path="data"):
        super().__init__(seed)
        import datasets
        files = self._files(path)
        train_files = [f for f in files if "train" in os.path.basename(f).lower()]
        eval_files = [f for f in files if re.search(r"eval|test", os.path.basename(f).lower())]
        if train_files and eval_files:
            train, test = self._rows(train_files), self._rows(eval_files)
        else:
            rows = self._rows(files)
            if len(rows) < 2:
                raise ValueError(f"{path}: needs at least 2 rows to make a train and an eval split, found {len(rows)}")
            order = list(range(len(rows)))
            random.Random(seed).shuffle(order)
            n_test = max(1, len(rows) // 10)
            test = [rows[i] for i in order[:n_test]]
            train = [rows[i] for i in order[n_test:]]
        self.raw_datasets = {"train": datasets.Dataset.from_list(train),
                             "test": datasets.Dataset.from_list(test)}

    def _files(self, path):
        if os.path.isdir(path):
            files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                           if f.lower().endswith(self.EXTENSIONS))
            if not files:
                raise ValueError(f"{path}: folder has no {'/'.join(self.EXTENSIONS)} files")
            return files
        if not path.lower().endswith(self.EXTENSIONS):
            raise ValueError(f"{path}: unknown file type; use one of {', '.join(self.EXTENSIONS)}")
        return [path]

    @staticmethod
    def _read(path):
        """Yield (where, row) with `where` naming the file and line/row for error messages."""
        low = path.lower()
        if low.endswith(".jsonl") or low.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if low.endswith(".json") and text.lstrip().startswith("["):
                try:
                    rows = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {e.lineno}: invalid JSON: {e.msg}") from None
                for i, row in enumerate(rows):
                    yield f"{path} item {i}", row
                return
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path} line {lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {lineno}: invalid JSON: {e.msg}") from None
        elif low.endswith(".csv"):
            with open(path, encoding="utf-8", newline="") as f:
                for lineno, row in enumerate(csv.DictReader(f), 2):  # line 1 is the header
                    yield f"{path} line {lineno}", row
        else:
            import pyarrow.parquet as pq
            for i, row in enumerate(pq.read_table(path).to_pylist()):
                yield f"{path} row {i}", row

    def _rows(self, files):
        rows = []
        for path in files:
            for where, row in self._read(path):
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected an object with prompt/chosen/rejected, got {type(row).__name__}")
                for field in ("prompt", "chosen", "rejected"):
                    if field not in row or row[field] is None:
                        raise ValueError(f"{where}: field '{field}' is missing")
                    if not isinstance(row[field], str) or not row[field].strip():
                        raise ValueError(f"{where}: field '{field}' must be a non-empty string, got {row[field]!r}")
                rows.append({k: row[k] for k in ("prompt", "chosen", "rejected")})
        if not rows:
            raise ValueError(f"{', '.join(files)}: no rows")
        return rows


def get_raw_dataset(dataset_name, seed=1234):
    """Pick the PromptRawDataset for a --data_path entry: an existing local path, or a hub name."""
    if os.path.exists(dataset_name) and not os.path.exists(os.path.join(dataset_name, "dataset_dict.json")):
        return LocalPreferenceDataset(seed, dataset_name)
    for cls in (DahoasRmstaticDataset, DahoasFullhhrlhfDataset,
                DahoasSyntheticinstructgptjpairwiseDataset, YitingxieRlhfrewarddatasetsDataset):
        if cls.dataset_name in dataset_name:   # DSC dispatches by substring, so local copies work too
            return cls(seed, dataset_name)
    raise ValueError(f"--data_path {dataset_name!r}: not a local file/folder and not one of the supported hub sets "
                     "(Dahoas/rm-static, Dahoas/full-hh-rlhf, Dahoas/synthetic-instruct-gptj-pairwise, "
                     "yitingxie/rlhf-reward-datasets)")


# --------------------------------------------------------------------------------------
# §0.2  The 2,4,4 split: each phase gets its own slice (DSC data_utils.py, seed 000 §0.2.1)
# --------------------------------------------------------------------------------------
# Why disjoint slices?  If the reward model were trained on the SFT rows, it would have seen the
# exact answers the actor memorised, and would score them well for that reason alone; if PPO ran
# on the RM's rows, the RM would judge prompts it has already fitted.  Each phase on fresh rows
# makes every phase's held-out figure honest.  The split is by row index, after one shuffle with
# --seed, so the three phases of one run agree on who gets what.
def get_raw_dataset_split_index(data_split, data_size, seed=1234):
    """Split `data_size` rows into len(data_split) disjoint index lists, after one seeded shuffle.

    Boundaries are the cumulative round(fraction · N), the last forced to N, as in DSC.
    >>> [len(ix) for ix in get_raw_dataset_split_index("2,4,4", 10)]
    [2, 4, 4]
    >>> sorted(sum(get_raw_dataset_split_index("6,2,2", 7), []))
    [0, 1, 2, 3, 4, 5, 6]
    """
    try:
        fracs = [float(s) for s in str(data_split).split(",")]
    except ValueError:
        raise ValueError(f"--data_split {data_split!r}: expected comma-separated numbers like 2,4,4") from None
    if len(fracs) != 3 or min(fracs) < 0 or sum(fracs) <= 0:
        raise ValueError(f"--data_split {data_split!r}: expected three non-negative numbers like 2,4,4")
    total = sum(fracs)
    bounds = [0]
    for f in fracs:
        bounds.append(bounds[-1] + int(round(f / total * data_size)))
    bounds[-1] = data_size                       # DSC corrects rounding so the last boundary is N
    bounds = [min(b, data_size) for b in bounds]
    shuffle = list(range(data_size))
    random.Random(seed).shuffle(shuffle)         # DSC: np.random.RandomState(seed).shuffle
    return [shuffle[bounds[i]:bounds[i + 1]] for i in range(3)]


# --------------------------------------------------------------------------------------
# §0.3  The phase formats (DSC create_dataset_split, seed 000 §0.2.2)
# --------------------------------------------------------------------------------------
class PromptDataset(torch.utils.data.Dataset):
    """Phase 1 rows are dicts, phase 2 rows (chosen_ids, chosen_mask, rejected_ids, rejected_mask),
    phase 3 rows (prompt_ids_flipped, prompt_mask_flipped, pad_token_id)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def create_dataset_split(current_dataset, raw_dataset, train_phase, tokenizer, end_of_conversation_token,
                         max_seq_len, max_prompt_seq_len=None, mask_prompt=False):
    """Tokenize one slice for one phase.

    Phase 1: prompt + chosen + eos, padded to max_seq_len; labels are the ids with -100 on padding.
    Phase 2: chosen and rejected, each + eos, padded to max_seq_len.
    Phase 3: the prompt alone, reversed (flip(0)) so DataCollatorRLHF can left-pad it; prompts
             longer than max_prompt_seq_len (default: max_seq_len, which is what DSC's step 3
             passes) are dropped (DSC today; the seed-000 code truncated).
    DSC: phase 1 trains on the prompt tokens too (PR #762, which masks them, was not merged); that is
    this function's default.  mask_prompt=True sets the prompt's labels to -100 as well; the CLI
    passes --sft_mask_prompt, which is on by default [D13].
    DIFF: phases 2 and 3 use tokenizer.eos_token too; DSC appends the literal "<|endoftext|>" in
    phase 2, which OPT splits into 7 sub-tokens, so its RM scores a different token than phase 3 ends on.
    """
    rows, dropped = [], 0
    max_prompt_seq_len = max_prompt_seq_len or max_seq_len
    tok = lambda text: tokenizer(text, max_length=max_seq_len, padding="max_length", truncation=True,
                                 return_tensors="pt")
    for sample in current_dataset:
        if train_phase == 1:
            enc = tok(raw_dataset.get_prompt_and_chosen(sample) + end_of_conversation_token)
            ids, mask = enc["input_ids"].squeeze(0), enc["attention_mask"].squeeze(0)
            labels = ids.masked_fill(mask == 0, -100)        # no loss on padding (DSC PR #819)
            if mask_prompt:
                labels[: len(tokenizer(raw_dataset.get_prompt(sample))["input_ids"])] = -100   # [D13]
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        elif train_phase == 2:
            c = tok(raw_dataset.get_prompt_and_chosen(sample) + end_of_conversation_token)
            r = tok(raw_dataset.get_prompt_and_rejected(sample) + end_of_conversation_token)
            rows.append((c["input_ids"].squeeze(0), c["attention_mask"].squeeze(0),
                         r["input_ids"].squeeze(0), r["attention_mask"].squeeze(0)))
        else:
            enc = tokenizer(raw_dataset.get_prompt(sample), return_tensors="pt")
            ids, mask = enc["input_ids"].squeeze(0), enc["attention_mask"].squeeze(0)
            if ids.numel() > max_prompt_seq_len:
                dropped += 1
                continue
            rows.append((ids.flip(0), mask.flip(0), tokenizer.pad_token_id))
    if dropped:
        print(f"phase 3: dropped {dropped} prompts longer than --max_prompt_seq_len {max_prompt_seq_len}")
    return PromptDataset(rows)


def create_prompt_dataset(local_rank, data_path, data_split, output_path, train_phase, seed, tokenizer,
                          max_seq_len, end_of_conversation_token=None, sft_only_data_path=(), reload=False,
                          max_prompt_seq_len=None, return_raw=False, mask_prompt=False):
    """Load every --data_path source, take this phase's slice of train and eval, tokenize, concatenate.

    Returns (train_dataset, eval_dataset), or with return_raw=True also the raw eval samples as
    (raw_dataset, sample) pairs, which phase 3 uses to measure held-out prompts.
    `sft_only_data_path` sources go whole ("10,0,0") to phase 1 only, as in DSC.
    DIFF: DSC caches the tokenized data under --data_output_path with a key that ignores the end
    token (a stale-cache trap); at this size tokenizing is fast, so we never cache: output_path and
    reload are accepted for DSC's signature and unused.
    """
    end = end_of_conversation_token if end_of_conversation_token is not None else tokenizer.eos_token
    paths = [data_path] if isinstance(data_path, str) else list(data_path)
    trains, evals, raw_eval = [], [], []
    for path in paths:
        raw = get_raw_dataset(path, seed)
        parts = []
        for split, data in (("train", raw.get_train_data()), ("eval", raw.get_eval_data())):
            index = get_raw_dataset_split_index(data_split, len(data), seed)[train_phase - 1]
            subset = data.select(index) if hasattr(data, "select") else [data[i] for i in index]
            parts.append(create_dataset_split(subset, raw, train_phase, tokenizer, end, max_seq_len,
                                              max_prompt_seq_len, mask_prompt))
            if split == "eval":
                raw_eval += [(raw, s) for s in subset]
        trains.append(parts[0])
        evals.append(parts[1])
    if train_phase == 1:
        for path in sft_only_data_path or ():
            raw = get_raw_dataset(path, seed)
            trains.append(create_dataset_split(raw.get_train_data(), raw, 1, tokenizer, end, max_seq_len,
                                               mask_prompt=mask_prompt))
    # DSC blends several sources by concatenating and reshuffling with the seed.
    train_rows = sum((d.rows for d in trains), [])
    if len(trains) > 1:
        random.Random(seed).shuffle(train_rows)
    out = (PromptDataset(train_rows), PromptDataset(sum((d.rows for d in evals), [])))
    return out + (raw_eval,) if return_raw else out


# --------------------------------------------------------------------------------------
# §0.4  Collators (DSC data_utils.py, seed 000 §2.3.2 and §3.2)
# --------------------------------------------------------------------------------------
class DataCollatorReward:
    """Stack a batch of pairs as [all chosen rows; all rejected rows] -> (2B, T)."""

    def __call__(self, data):
        return {"input_ids": torch.stack([f[0] for f in data] + [f[2] for f in data]),
                "attention_mask": torch.stack([f[1] for f in data] + [f[3] for f in data])}


class DataCollatorRLHF:
    """Left-pad flipped prompts to exactly max_token_len [D2] (seed 000 §3.2's flip example):

    >>> c = DataCollatorRLHF(max_token_len=5, inference_tp_size=1)
    >>> ids = torch.tensor([233, 11, 22])
    >>> b = c([(ids.flip(0), torch.ones(3, dtype=torch.long), 0)])
    >>> b["prompt"].tolist(), b["prompt_att_mask"].tolist()
    ([[0, 0, 233, 11, 22]], [[0, 0, 1, 1, 1]])

    The reversed prompts are right-padded ([22, 11, 233, 0, 0]) and flipped back, so the pads land
    on the left and generation continues right after the last prompt token.
    `inference_tp_size` is stored and unused, as in DSC (it only mattered for the Hybrid Engine).
    """

    def __init__(self, max_token_len, inference_tp_size=1):
        self.max_token_len = max_token_len
        self.inference_tp_size = inference_tp_size

    def __call__(self, data):
        # Why left padding: `generate` appends every row's next token at the same column, so all
        # prompts must end at the same column, P - 1.  Pads therefore go on the left, and the
        # attention mask (and positions_from_mask) make the model ignore them.  pad_sequence only
        # pads on the right, hence the flip: right-pad the reversed prompts, then reverse the rows.
        pad_token_id = data[-1][-1]
        prompt = nn.utils.rnn.pad_sequence([f[0] for f in data], batch_first=True, padding_value=pad_token_id)
        mask = nn.utils.rnn.pad_sequence([f[1] for f in data], batch_first=True, padding_value=0)
        extra = self.max_token_len - prompt.size(1)
        if extra > 0:
            prompt = F.pad(prompt, (0, extra), value=pad_token_id)
            mask = F.pad(mask, (0, extra), value=0)
        return {"prompt": prompt.flip(1), "prompt_att_mask": mask.flip(1)}    # (B, P), left-padded


# Why a buffer?  Generation is cheapest in large batches; a PPO step may want smaller ones, or
# several generation batches collected before training.  MiniDataset decouples the two sizes:
# --per_device_generation_batch_size × --generation_batches rollouts, cut into micro-batches of
# --per_device_training_batch_size, each trained --ppo_epochs times.
class MiniDataset:
    """Buffer `max_size` experience batches, then cut them into micro-batches of small_batch_size.

    `add` returns None until the buffer is full, then the list of micro-batches (seed 000 §3.3.3):
    >>> for n in (3, 5, 9):
    ...     print(n, [b.tolist() for b in MiniDataset(1, 4).add(torch.arange(n))])
    3 [[0, 1, 2]]
    5 [[0, 1, 2, 3], [4]]
    9 [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    >>> m = MiniDataset(2, 2)
    >>> m.add({"x": torch.arange(3)}) is None, [b["x"].tolist() for b in m.add({"x": torch.arange(3, 5)})]
    (True, [[0, 1], [2], [3, 4]])
    """

    def __init__(self, max_size, small_batch_size):
        self.dataset = []
        self.max_size = max_size
        self.small_batch_size = small_batch_size

    def seperate(self):  # sic: DSC's spelling, kept so the blog's name finds this method
        small_dataset = []
        for large_batch in self.dataset:
            if isinstance(large_batch, dict):
                large_size = len(next(iter(large_batch.values())))
            elif isinstance(large_batch, (list, tuple)):
                large_size = len(large_batch[0])
            else:
                large_size = len(large_batch)
            for i in range(0, large_size, self.small_batch_size):
                sl = slice(i, i + self.small_batch_size)
                if isinstance(large_batch, dict):
                    small_dataset.append({k: v[sl] for k, v in large_batch.items()})
                elif isinstance(large_batch, (list, tuple)):
                    small_dataset.append([x[sl] for x in large_batch])
                else:
                    small_dataset.append(large_batch[sl])
        self.free()
        return small_dataset

    def add(self, data):
        if len(self.dataset) >= self.max_size:
            raise ValueError("MiniDataset is full; the caller forgot to consume it")
        self.dataset.append(data)
        return self.seperate() if len(self.dataset) == self.max_size else None

    def free(self):
        self.dataset = []


def get_unsupervised_data(args, tokenizer):
    """Pre-training text for the PTX term: --unsupervised_dataset_name is a hub name (with
    --unsupervised_dataset_config_name) or a local .txt/.json/.jsonl file with a `text` field.
    Tokenize, concatenate, cut into blocks of max_prompt_seq_len + max_answer_seq_len; labels = ids."""
    import datasets
    name = args.unsupervised_dataset_name
    if os.path.exists(name):
        kind = "text" if name.endswith(".txt") else "json"
        raw = datasets.load_dataset(kind, data_files={"train": name})
    else:
        raw = datasets.load_dataset(name, args.unsupervised_dataset_config_name)
    texts = raw["train"]["text"]
    ids = sum((tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts if t.strip()), [])
    block = args.max_prompt_seq_len + args.max_answer_seq_len
    n = len(ids) // block
    if n == 0:
        raise ValueError(f"{name}: fewer than {block} tokens of text, not one PTX block")
    blocks = torch.tensor(ids[: n * block]).view(n, block)
    return PromptDataset([{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b.clone()}
                          for b in blocks])


# ======================================================================================
# §1  Models (seed 000 §1.2, §2.3.1): tokenizer, the causal LM, LoRA, the reward model
# ======================================================================================

# --------------------------------------------------------------------------------------
# §1.1  Tokenizer and the embedded default model (no download, ever)
# --------------------------------------------------------------------------------------
def train_default_tokenizer(texts, vocab_size=512):
    """A byte-level BPE trained on `texts` with `tokenizers`; digits are split one per token so
    arithmetic stays learnable.  Separate <pad> (id 0) and </s> (id 1) tokens [D1]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="right")


def load_hf_tokenizer(model_name_or_path):
    """AutoTokenizer by path or hub name, right padding, and a real pad token.

    DIFF: DSC sets pad = eos for every non-llama model, so the attention mask hides the EOS and the
    actor never learns to stop (N+ paper).  We add a separate <pad> when the tokenizer has none.
    """
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    tokenizer.padding_side = "right"
    if tokenizer.eos_token is None:
        raise ValueError(f"{model_name_or_path}: the tokenizer has no eos_token; RLHF needs one to end answers")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return tokenizer


def build_default_model(tokenizer, hidden_size=192, num_layers=3, num_heads=6, max_positions=128):
    """An OPT-style causal LM of about 1.5M parameters, built from a config (OPT, as DSC's demos).
    OPT derives positions from the attention mask, so left-padded prompts work [D2]."""
    from transformers import OPTConfig, OPTForCausalLM
    config = OPTConfig(vocab_size=_round8(len(tokenizer)), hidden_size=hidden_size, num_hidden_layers=num_layers,
                       ffn_dim=4 * hidden_size, num_attention_heads=num_heads, max_position_embeddings=max_positions,
                       word_embed_proj_dim=hidden_size, dropout=0.0, attention_dropout=0.0,  # [D10]
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.eos_token_id)
    return OPTForCausalLM(config)


def _round8(n):
    return int(8 * math.ceil(n / 8))   # DSC resizes embeddings to a multiple of 8


def create_hf_model(model_class, model_name_or_path, tokenizer, ds_config=None, rlhf_training=False, dropout=None):
    """Build (model_name_or_path == "tiny") or load (`from_pretrained`, a path or hub name) a model.

    DIFF: DSC sets config.pad_token_id = eos_token_id; we keep the tokenizer's own pad [D1].
    `ds_config` and `rlhf_training` are DSC's arguments for ZeRO-3 init and for building the critic
    from a config before loading its weights; here from_pretrained handles both.
    """
    if model_name_or_path == TINY:
        model = build_default_model(tokenizer)
        if model_class.__name__ != "AutoModelForCausalLM":
            model = model.model           # the backbone, as AutoModel would load it
    else:
        kwargs = {}
        if dropout is not None:
            kwargs = {k: dropout for k in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout")}
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(model_name_or_path)
        for k, v in kwargs.items():
            if hasattr(config, k):
                setattr(config, k, v)
        model = model_class.from_pretrained(model_name_or_path, config=config)
    model.config.end_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        model.resize_token_embeddings(_round8(len(tokenizer)))
    return model


# --------------------------------------------------------------------------------------
# §1.2  LoRA (DSC dschat/utils/module/lora.py, seed 000 §1.2)
# --------------------------------------------------------------------------------------
class LinearLayer_LoRA(nn.Module):
    """y = x·Wᵀ + b + (dropout(x) · R · L) · (lora_scaling / lora_dim)

    R = lora_right_weight (in × r, Kaiming-uniform), L = lora_left_weight (r × out, zeros), so the
    branch starts at exactly zero and the model's outputs are unchanged.  The base weight is frozen.
    >>> base = nn.Linear(4, 3)
    >>> lora = LinearLayer_LoRA(base.weight, lora_dim=2, bias=base.bias)
    >>> x = torch.randn(5, 4)
    >>> torch.equal(lora(x), base(x)), list(lora.lora_right_weight.shape), list(lora.lora_left_weight.shape)
    (True, [4, 2], [2, 3])
    """

    def __init__(self, weight, lora_dim=0, lora_scaling=1, lora_dropout=0, bias=None):
        super().__init__()
        if lora_dim <= 0:
            raise ValueError("lora_dim must be > 0 to build a LoRA layer")
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)   # (out, in), frozen
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        out_features, in_features = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(in_features, lora_dim))   # (in, r)
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, out_features))   # (r, out)
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        self.lora_scaling = lora_scaling / lora_dim
        self.lora_dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()

    def forward(self, x):
        lora = self.lora_dropout(x) @ self.lora_right_weight @ self.lora_left_weight
        return F.linear(x, self.weight, self.bias) + lora * self.lora_scaling

    def fused_linear(self):
        """A plain nn.Linear with W ← W + scale · Lᵀ Rᵀ, which computes the same outputs."""
        out_features, in_features = self.weight.shape
        lin = nn.Linear(in_features, out_features, bias=self.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(self.weight + self.lora_scaling * (self.lora_left_weight.t() @ self.lora_right_weight.t()))
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin.to(self.weight.device, self.weight.dtype)


def _replace_module(model, name, new):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def convert_linear_layer_to_lora(model, part_module_name, lora_dim=0, lora_scaling=1, lora_dropout=0):
    """Wrap every nn.Linear whose name contains `part_module_name` (e.g. "decoder.layers.")."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and part_module_name in n]
    if not names:
        raise ValueError(f"LoRA: no nn.Linear module name contains {part_module_name!r}")
    for name in names:
        lin = model.get_submodule(name)
        _replace_module(model, name, LinearLayer_LoRA(lin.weight, lora_dim, lora_scaling, lora_dropout, lin.bias))
    return model


def only_optimize_lora_parameters(model, force_optimize_params=()):
    """Freeze everything except the LoRA factors (and names in force_optimize_params, e.g. v_head)."""
    for name, p in model.named_parameters():
        p.requires_grad = "lora_right_weight" in name or "lora_left_weight" in name or \
            any(f in name for f in force_optimize_params)
    return model


def convert_lora_to_linear_layer(model):
    """Fuse every LoRA layer back into a plain nn.Linear (before saving: the checkpoint is pure HF).
    DIFF: DSC fuses in place but keeps the LoRA module and then drops "lora" keys at save time."""
    for name in [n for n, m in model.named_modules() if isinstance(m, LinearLayer_LoRA)]:
        _replace_module(model, name, model.get_submodule(name).fused_linear())
    return model


# --------------------------------------------------------------------------------------
# §1.3  The reward model (DSC reward_model.py, seed 000 §2.3.1-§2.3.3)
# --------------------------------------------------------------------------------------
def reward_pairwise_loss(chosen_ids, rejected_ids, chosen_rewards, rejected_rewards, pad_token_id,
                         num_padding_at_beginning=0):
    """DSC's pairwise loss, exactly: for each pair, the mean over the divergent span of
    -log σ(r_c[t] - r_r[t]), and the scores read at the token before the first (real) pad.

    c_ind / r_ind: index of the (num_padding_at_beginning)-th pad in chosen / rejected, or T.
    divergence_ind: first index where chosen and rejected differ; end_ind = max(c_ind, r_ind).
    A margin of 1 on a one-token span costs -log σ(1) = 0.3133 (seed 000 §2.3.3.1):
    >>> c = torch.tensor([[5, 6, 7, 0]]); r = torch.tensor([[5, 6, 9, 0]])
    >>> loss, cs, rs = reward_pairwise_loss(c, r, torch.tensor([[0., 0., 1., 0.]]), torch.zeros(1, 4), pad_token_id=0)
    >>> round(loss.item(), 4), cs.tolist(), rs.tolist()
    (0.3133, [1.0], [0.0])
    """
    # Why a *span* and not only the end scores?  A causal backbone gives chosen and rejected the same
    # value at every token before they first differ (same prefix, same hidden state), so those
    # positions would add a constant log 2 and no gradient: the span starts at the divergence.
    # From there to the later of the two ends, every position compares the two answers so far.
    # InstructGPT (and TRL, OpenRLHF) compare the end scores only; DSC's span loss is what its
    # blog teaches, and the end scores it returns are what phase 3 reads.
    bs, seq_len = chosen_ids.shape
    loss = 0.0
    chosen_scores, rejected_scores = [], []
    for i in range(bs):
        c_id, r_id = chosen_ids[i], rejected_ids[i]                    # (T,)
        c_rew, r_rew = chosen_rewards[i], rejected_rewards[i]          # (T,)
        c_inds = (c_id == pad_token_id).nonzero()
        c_ind = c_inds[num_padding_at_beginning].item() if len(c_inds) > num_padding_at_beginning else seq_len
        check_divergence = (c_id != r_id).nonzero()
        if len(check_divergence) == 0:         # identical answers: only the last position, loss log 2
            end_ind = seq_len
            divergence_ind = end_ind - 1
            r_ind = c_ind
        else:
            r_inds = (r_id == pad_token_id).nonzero()
            r_ind = r_inds[num_padding_at_beginning].item() if len(r_inds) > num_padding_at_beginning else seq_len
            end_ind = max(c_ind, r_ind)
            divergence_ind = check_divergence[0].item()
        assert divergence_ind > 0, "chosen and rejected differ at token 0: they must share the prompt"
        # Both rows are padded to T; past its own end a row's values are the pad's, which the loss
        # compares too when one answer is longer (DSC does the same; the span is what it is).
        c_truncated = c_rew[divergence_ind:end_ind]
        r_truncated = r_rew[divergence_ind:end_ind]
        chosen_scores.append(c_rew[c_ind - 1])       # [D5] the last real token (the EOS)
        rejected_scores.append(r_rew[r_ind - 1])
        loss = loss + -F.logsigmoid(c_truncated.float() - r_truncated.float()).mean()
    return loss / bs, torch.stack(chosen_scores), torch.stack(rejected_scores)


class RewardModel(nn.Module):
    """A transformer backbone plus v_head: hidden -> one score per token.

    forward(input_ids, attention_mask): 2B rows (B chosen then B rejected) -> pairwise loss + scores.
    forward_value(...): per-token values (B, T), or also the end score after the prompt (phase 3).
    DSC: the backbone attribute is `rwtransformer` (it was `rwtranrsformer` in the seed-000 code).
    """

    def __init__(self, base_model, tokenizer, num_padding_at_beginning=0, compute_fp32_loss=False):
        super().__init__()
        self.config = base_model.config
        self.num_padding_at_beginning = num_padding_at_beginning
        hidden = getattr(self.config, "word_embed_proj_dim", None) or getattr(self.config, "hidden_size", None) \
            or self.config.n_embd                            # OPT projects to word_embed_proj_dim
        self.v_head = nn.Linear(hidden, 1, bias=False)
        self.rwtransformer = base_model
        self.PAD_ID = tokenizer.pad_token_id
        self.compute_fp32_loss = compute_fp32_loss

    # The v_head reads every position, so one forward gives a value for every prefix: the reward
    # model uses only the last real token's (the whole answer), the critic uses them all (V_t).
    def _values(self, input_ids, attention_mask):
        position_ids = positions_from_mask(attention_mask)
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False)[0]                              # (B, T, H)
        return self.v_head(hidden).squeeze(-1)                                       # (B, T)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        rewards = self._values(input_ids, attention_mask)                            # (2B, T)
        bs = input_ids.shape[0] // 2
        loss, chosen, rejected = reward_pairwise_loss(
            input_ids[:bs], input_ids[bs:], rewards[:bs], rewards[bs:], self.PAD_ID, self.num_padding_at_beginning)
        return {"loss": loss, "chosen_mean_scores": chosen, "rejected_mean_scores": rejected}

    def forward_value(self, input_ids, attention_mask=None, return_value_only=False, prompt_length=0, **kwargs):
        """Values (B, T); or {"values", "chosen_end_scores"} where the end score is the value at the
        last non-pad token at or after `prompt_length` (the last prompt token if the answer is empty).

        DSC finds the first pad id after the prompt; we read the last 1 of the attention mask, which is
        the same for right-padded answers and stays right if an answer ever contained a pad id.
        """
        if attention_mask is None:
            attention_mask = (input_ids != self.PAD_ID).long()
        values = self._values(input_ids, attention_mask)                             # (B, T)
        if return_value_only:
            return values
        real = (attention_mask != 0) & (input_ids != self.PAD_ID)                    # (B, T) non-pad tokens
        end = last_true_index(real, prompt_length)                                   # (B,)
        chosen_end_scores = values.gather(1, end.unsqueeze(1)).squeeze(1)            # (B,)
        return {"values": values, "chosen_end_scores": chosen_end_scores}


def positions_from_mask(attention_mask):
    """Position ids that start at 0 on the first real token of a left-padded row [D2].
    >>> positions_from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])).tolist()
    [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    """
    if attention_mask is None:
        return None
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def last_true_index(mask, start=0):
    """Index of the last 1 at or after `start` in each row, or start - 1 (clamped to 0) if none.
    >>> last_true_index(torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 0, 0, 0]]), 2).tolist()
    [2, 4, 1]
    """
    T = mask.size(1)
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    hit = (mask != 0) & (pos >= start)
    last = torch.where(hit, pos, torch.full_like(pos, -1)).max(1).values
    return torch.where(last >= 0, last, torch.full_like(last, max(start - 1, 0)))


V_HEAD_FILE = "v_head.safetensors"


def create_critic_model(model_name_or_path, tokenizer, ds_config=None, num_padding_at_beginning=0,
                        rlhf_training=False, dropout=None, compute_fp32_loss=False):
    """RewardModel(AutoModel backbone).  From a phase-2 folder the v_head is loaded too; from a
    causal-LM folder (phase 1) the backbone is the LM without its lm_head and v_head starts fresh."""
    from transformers import AutoModel
    base = create_hf_model(AutoModel, model_name_or_path, tokenizer, ds_config, rlhf_training, dropout)
    model = RewardModel(base, tokenizer, num_padding_at_beginning, compute_fp32_loss)
    head = os.path.join(model_name_or_path, V_HEAD_FILE)
    if os.path.exists(head):
        from safetensors.torch import load_file
        model.v_head.load_state_dict(load_file(head))
    elif rlhf_training:
        raise FileNotFoundError(f"{model_name_or_path}: no {V_HEAD_FILE}; phase 3 needs a trained reward model "
                                "(run --phase 2 first or pass --critic_model_name_or_path)")
    return model


# ======================================================================================
# §2  Phase 1: supervised fine-tuning (seed 000 §1.1-§1.2, DSC step1_supervised_finetuning/main.py)
# ======================================================================================
# Next-token cross-entropy on prompt + chosen + eos.  The metric is perplexity on the held-out
# slice, before training and after each epoch: ppl = exp(mean over eval batches of the loss).
#
# SFT's job in RLHF is the *format* and a sensible starting distribution: the actor learns to answer
# in the demonstrators' way and to stop with EOS.  It imitates; it does not learn which answers are
# better, because every demonstration counts the same.  On the shipped task the demonstrations are
# spread over all right answers, so the SFT model learns a wide distribution whose samples often
# stray across the bound.  Perplexity says how well it imitates, not how often it is right.

def evaluation(model, eval_dataloader, device="cpu", eval_iters=None):
    """Perplexity = exp(mean batch loss) on held-out data (DSC step 1)."""
    model.eval()
    losses = []
    with torch.no_grad():
        for step, batch in enumerate(eval_dataloader):
            if eval_iters and step >= eval_iters:
                break
            batch = to_device(batch, device)
            out = model(**batch, position_ids=positions_from_mask(batch["attention_mask"]), use_cache=False)
            losses.append(out.loss.float().item())
    model.train()
    mean = sum(losses) / max(1, len(losses))
    return math.exp(min(mean, 50.0)), mean


def default_tokenizer_texts(args):
    """The text the embedded tokenizer is trained on: every train row of every --data_path."""
    texts = []
    for path in args.data_path:
        raw = get_raw_dataset(path, args.seed)
        for s in raw.get_train_data():
            texts += [raw.get_prompt_and_chosen(s), raw.get_prompt_and_rejected(s)]
    return texts


def train_phase1(args):
    """SFT.  Returns the summary dict that is also written to <output_dir>/phase1/summary.json."""
    from transformers import AutoModelForCausalLM
    set_random_seed(args.seed)
    path = args.model_name_or_path or TINY
    tokenizer = train_default_tokenizer(default_tokenizer_texts(args)) if path == TINY else load_hf_tokenizer(path)
    model = create_hf_model(AutoModelForCausalLM, path, tokenizer, dropout=args.dropout)
    if args.lora_dim > 0:
        model = convert_linear_layer_to_lora(model, args.lora_module_name, args.lora_dim)
        if args.only_optimize_lora:
            model = only_optimize_lora_parameters(model)
    train_ds, eval_ds = create_prompt_dataset(args.local_rank, args.data_path, args.data_split, None, 1, args.seed,
                                              tokenizer, args.max_seq_len, sft_only_data_path=args.sft_only_data_path,
                                              mask_prompt=args.sft_mask_prompt)
    train_loader = make_loader(train_ds, args.per_device_train_batch_size, args.seed, shuffle=True)
    eval_loader = make_loader(eval_ds, args.per_device_eval_batch_size, args.seed)
    total = total_steps(len(train_loader), args)
    print_batch_arithmetic(1, args, len(train_ds), len(train_loader), total)
    engine = make_engine(model, args, args.learning_rate, args.weight_decay, args.lora_learning_rate, total)

    # DSC evaluates perplexity before training and after every epoch; so do we, on the held-out
    # slice of this phase (the 2,4,4 split gives phase 1 its own eval rows too).
    stage, log = begin_phase(args, "phase1")
    ppl_before, _ = evaluation(model, eval_loader, args.device)
    print(f"phase 1: perplexity before training {ppl_before:.2f}")
    log.log(step=0, **{"eval/perplexity": ppl_before})
    losses = []
    for epoch in range(args.num_train_epochs):
        bar = tqdm_bar(train_loader, f"phase 1 SFT epoch {epoch + 1}/{args.num_train_epochs}")
        for batch in bar:
            batch = to_device(batch, args.device)
            # HF shifts inside: loss = mean over labels ≠ -100 of −log p(x_{t+1} | x_{≤t}).
            loss = engine(**batch, position_ids=positions_from_mask(batch["attention_mask"]), use_cache=False).loss
            engine.backward(loss)
            if engine.step():
                losses.append(loss.item())
                bar.set_postfix(loss=f"{loss.item():.3f}")
                log.log(step=engine.global_steps, epoch=epoch, **{"loss/sft": loss.item(), "lr": engine.lr()})
            if reached(engine, args):
                break
        ppl, _ = evaluation(model, eval_loader, args.device)
        print(f"phase 1: epoch {epoch + 1} perplexity {ppl:.2f}")
        log.log(step=engine.global_steps, epoch=epoch, **{"eval/perplexity": ppl})
        if reached(engine, args):
            break
    summary = {"perplexity_before": ppl_before, "perplexity_after": ppl, "loss_first": first(losses),
               "loss_last": first(losses[::-1]), "steps": engine.global_steps, "train_rows": len(train_ds),
               "eval_rows": len(eval_ds)}
    if args.lora_dim > 0:
        convert_lora_to_linear_layer(model)
    save_hf_format(model, tokenizer, stage)
    return end_phase(args, "phase1", stage, log, summary)


# ======================================================================================
# §3  Phase 2: the reward model (seed 000 §2.1-§2.3.4, DSC step2_reward_model_finetuning/main.py)
# ======================================================================================
# Pairs (chosen, rejected) go through RewardModel.forward as one batch of 2B rows.  The metric is
# accuracy = fraction of held-out pairs with end score(chosen) > end score(rejected), plus the mean
# end scores.  DIFF: DSC's phase 2 starts from a pretrained LM (OPT-350m); our tiny default has no
# pretraining, and a reward model trained from scratch cannot judge correctness, so phase 2 starts
# from phase 1's SFT model by default, as InstructGPT does.
#
# What a score means.  The loss is Bradley-Terry's: P(chosen ≻ rejected) = σ(r_c − r_r).  Only the
# *difference* of two scores is trained, so adding a constant to every score changes nothing, and
# the scale grows for as long as training keeps widening the margins (ours reach about ±14 after
# three epochs).  Phase 3 inherits both: the constant is why PPO needs a critic (a baseline), and
# the scale is why the reward clip must suit the reward model (see --clip_reward_value).

def evaluation_reward(model, eval_dataloader, device="cpu", eval_iters=None):
    """Held-out accuracy and mean chosen/rejected end scores.  Ties count as wrong, as in DSC."""
    model.eval()
    correct = total = 0
    chosen_sum = rejected_sum = 0.0
    with torch.no_grad():
        for step, batch in enumerate(eval_dataloader):
            if eval_iters and step >= eval_iters:
                break
            out = model(**to_device(batch, device))
            c, r = out["chosen_mean_scores"], out["rejected_mean_scores"]              # (B,), (B,)
            correct += (c > r).sum().item()
            total += c.numel()
            chosen_sum += c.sum().item()
            rejected_sum += r.sum().item()
    model.train()
    n = max(1, total)
    return correct / n, chosen_sum / n, rejected_sum / n


def train_phase2(args):
    """Reward-model training.  Returns the summary written to <output_dir>/phase2/summary.json."""
    set_random_seed(args.seed)
    path = args.model_name_or_path or phase_dir(args, "phase1", "--model_name_or_path")
    tokenizer = load_hf_tokenizer(path)
    model = create_critic_model(path, tokenizer, num_padding_at_beginning=args.num_padding_at_beginning,
                                dropout=args.dropout)
    if args.lora_dim > 0:
        model = convert_linear_layer_to_lora(model, args.lora_module_name, args.lora_dim)
        if args.only_optimize_lora:
            model = only_optimize_lora_parameters(model, force_optimize_params=["v_head.weight"])
    train_ds, eval_ds = create_prompt_dataset(args.local_rank, args.data_path, args.data_split, None, 2, args.seed,
                                              tokenizer, args.max_seq_len)
    collator = DataCollatorReward()
    train_loader = make_loader(train_ds, args.per_device_train_batch_size, args.seed, shuffle=True, collate_fn=collator)
    eval_loader = make_loader(eval_ds, args.per_device_eval_batch_size, args.seed, collate_fn=collator)
    total = total_steps(len(train_loader), args)
    print_batch_arithmetic(2, args, len(train_ds), len(train_loader), total)
    engine = make_engine(model, args, args.learning_rate, args.weight_decay, args.lora_learning_rate, total)

    stage, log = begin_phase(args, "phase2")
    before = evaluation_reward(model, eval_loader, args.device, args.eval_iters)
    print("phase 2: before training acc {:.3f}  chosen {:.3f}  rejected {:.3f}".format(*before))
    log.log(step=0, **{"eval/acc": before[0], "eval/chosen_score": before[1], "eval/rejected_score": before[2]})
    # Watch train/acc climb and loss/reward fall from log 2 = 0.693 (an untrained RM cannot rank).
    # A held-out accuracy well below the training one means the RM learned the rows, not the rule;
    # PPO will then exploit whatever it learned instead.
    for epoch in range(args.num_train_epochs):
        bar = tqdm_bar(train_loader, f"phase 2 RM epoch {epoch + 1}/{args.num_train_epochs}")
        for batch in bar:
            # batch["input_ids"] is (2B, T): rows 0..B-1 chosen, rows B..2B-1 the matching rejected.
            out = engine(**to_device(batch, args.device))
            engine.backward(out["loss"])
            if engine.step():
                acc = (out["chosen_mean_scores"] > out["rejected_mean_scores"]).float().mean().item()
                bar.set_postfix(loss=f"{out['loss'].item():.3f}", acc=f"{acc:.2f}")
                log.log(step=engine.global_steps, epoch=epoch, **{"loss/reward": out["loss"].item(),
                                                                  "train/acc": acc, "lr": engine.lr()})
                if args.eval_interval and engine.global_steps % args.eval_interval == 0:
                    mid = evaluation_reward(model, eval_loader, args.device, args.eval_iters)
                    log.log(step=engine.global_steps, **{"eval/acc": mid[0], "eval/chosen_score": mid[1],
                                                         "eval/rejected_score": mid[2]})
            if reached(engine, args):
                break
        after = evaluation_reward(model, eval_loader, args.device, args.eval_iters)
        print("phase 2: epoch {} acc {:.3f}  chosen {:.3f}  rejected {:.3f}".format(epoch + 1, *after))
        log.log(step=engine.global_steps, epoch=epoch, **{"eval/acc": after[0], "eval/chosen_score": after[1],
                                                           "eval/rejected_score": after[2]})
        if reached(engine, args):
            break
    summary = {"acc_before": before[0], "acc_after": after[0], "chosen_score_before": before[1],
               "rejected_score_before": before[2], "chosen_score_after": after[1], "rejected_score_after": after[2],
               "steps": engine.global_steps, "train_pairs": len(train_ds), "eval_pairs": len(eval_ds)}
    if args.lora_dim > 0:
        convert_lora_to_linear_layer(model)
    save_reward_model(model, tokenizer, stage)
    return end_phase(args, "phase2", stage, log, summary)


# ======================================================================================
# §4  Phase 3: RLHF with PPO (seed 000 §3, seed 003; DSC dschat/rlhf/ppo_trainer.py, step3 main.py)
# ======================================================================================
# Four models: the actor (trained, from phase 1), the reference (frozen copy of phase 1), the
# critic (trained, from phase 2) and the reward model (frozen, phase 2).  Each step:
#   1. generate_experience: sample answers, score them, record old log-probs and values;
#   2. compute_rewards: per-token KL penalty + the clipped score on the last answer action;
#   3. get_advantages_and_returns: GAE backwards over the answer;
#   4. train_rlhf: one clipped policy step on the actor, one clipped value step on the critic.
#
# The tensors of one experience batch (what generate_experience returns, and train_rlhf reads):
#
#   name             shape     meaning
#   prompts          (B, P)    left-padded prompt ids; start = P - 1 is the first answer action
#   input_ids (seq)  (B, T)    prompt + sampled answer (+ pads after the EOS)
#   attention_mask   (B, T)    1 on real prompt tokens and on the answer up to and including the EOS
#   action_mask      (B, T-1)  attention_mask[:, 1:]: 1 where action t (emit token t+1) is real
#   logprobs         (B, T-1)  log π_old(token t+1 | prefix ≤ t), from the actor at sampling time
#   ref_logprobs     (B, T-1)  log π_ref(...), from the frozen phase-1 model
#   value            (B, T-1)  V_old(prefix ≤ t), from the critic at sampling time
#   rewards          (B,)      the reward model's end score of the whole answer (raw, not clipped)
#
# Worked through on one row with P = 3 and the answer "5 6 </s>" (T = 6, actions 0..4):
#   tokens   [pad, 7, 8, 5, 6, </s>]          attention_mask [0, 1, 1, 1, 1, 1]
#   actions   0: pad→7   1: 7→8   2: 8→5   3: 5→6   4: 6→</s>      start = 2
#   action_mask[:, start:] = [1, 1, 1]: three answer actions; the score lands on action 4 (the EOS).

# --------------------------------------------------------------------------------------
# §4.1  The numerics, as pure tensor functions (seed 000 §3.3.2.3, §3.3.4.1-§3.3.4.4)
# --------------------------------------------------------------------------------------
def gather_log_probs(logits, labels):
    """log softmax(logits)[label] at each position: (B, T, V), (B, T) -> (B, T).

    Seed 000 §3.3.2.3: logits[:, :-1] predict seq[:, 1:] = [2, 0, 1].  The raw logits at those
    labels are [-0.56, -1.52, 0.13]; the *log-probabilities* RLHF needs are:
    >>> logits = torch.tensor([[[1.23, 2.11, -0.56], [-1.52, -1.11, 1.66], [0.32, 0.13, 1.55], [-0.55, -0.23, -1.62]]])
    >>> seq = torch.tensor([[2, 2, 0, 1]])
    >>> [round(x, 4) for x in gather_log_probs(logits[:, :-1, :], seq[:, 1:])[0].tolist()]
    [-3.0648, -3.2792, -1.8479]
    """
    # Row b, position t of the result is log π(labels[b, t] | tokens ≤ t).  The softmax runs over
    # the vocabulary V, then `gather` keeps the one entry each label points at.  float() first:
    # a log-softmax in fp16 loses the small probabilities that the KL and the ratio depend on.
    log_probs = F.log_softmax(logits.float(), dim=-1)                              # (B, T, V)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)        # (B, T)


def compute_rewards(prompts, log_probs, ref_log_probs, reward_score, action_mask, kl_ctl=0.1, clip_reward_value=5.0):
    """Per-action rewards (B, T-1) [D6]:

        r_t = -kl_ctl · (log π(a_t) - log π_ref(a_t))               on every answer action
        r_last += clip(score, -clip_reward_value, clip_reward_value)  on the last action with mask 1

    The last action is the one that emitted EOS when the answer ended, else the last token of a
    truncated answer.  Positions with action_mask 0 (padding after the answer) get 0 [D7].
    DIFF: DSC's `ends = start + mask.sum() + 1` puts the score one slot *after* the last action
    (for OPT, on the masked EOS/pad action; DeepSpeedExamples PR #672).  We put it on the last action.

    >>> prompts = torch.zeros(1, 2, dtype=torch.long)            # P = 2, so start = 1
    >>> lp = torch.tensor([[0.0, -1.0, -1.0, -1.0, -1.0]]); ref = torch.tensor([[0.0, -2.0, -1.0, -0.5, -3.0]])
    >>> mask = torch.tensor([[1, 1, 1, 1, 0]])                  # 3 answer actions, then one pad
    >>> [round(x, 4) + 0.0 for x in compute_rewards(prompts, lp, ref, torch.tensor([7.0]), mask)[0].tolist()]
    [0.0, -0.1, 0.0, 5.05, 0.0]
    """
    start = prompts.shape[1] - 1
    # log π(a_t) − log π_ref(a_t) of the sampled token is a one-sample estimate of the KL at step t
    # (the "k1" estimator): its expectation under π is KL(π‖π_ref), and its sum over the answer
    # estimates the KL of the whole answer.  It can be negative on a single token; only the mean is
    # a KL.  As a *reward* it makes PPO trade score against drift from the SFT model.
    kl_divergence_estimate = -kl_ctl * (log_probs - ref_log_probs)                 # (B, T-1)
    rewards = kl_divergence_estimate * action_mask                                 # nothing after the answer
    # The reward model judges the whole answer, so its score is a single reward at the end: the
    # action that emitted EOS (or the last token of a cut answer).  GAE then carries it backwards.
    last = last_true_index(action_mask, start)                                     # (B,)
    reward_clip = torch.clamp(reward_score, -clip_reward_value, clip_reward_value)  # (B,)
    rewards = rewards.clone()
    rewards[torch.arange(rewards.size(0)), last] += reward_clip.to(rewards.dtype)
    return rewards


def get_advantages_and_returns(values, rewards, start, gamma=1.0, lam=0.95):
    """GAE over the answer, from the last action back to `start` [D8]:

        δ_t = r_t + γ·V_{t+1} − V_t        (V after the last index is 0)
        A_t = δ_t + γ·λ·A_{t+1}            returns R_t = A_t + V_t

    Inputs (B, T-1); outputs (B, T-1-start).  Seed 000 §3.3.4.2's example (γ=0.9, λ=0.95, start=3):
    >>> v = torch.tensor([[-0.2761, -2.3945, 0.1729, -0.0919, -0.0867, -0.0818, -0.0758]])
    >>> r = torch.tensor([[-4.6873e-04, -3.1257e-04, 5.8591e-05, -5.5084e-03, -4.0741e-03, -5.5275e-03, -8.5999e-02]])
    >>> adv, ret = get_advantages_and_returns(v, r, 3, gamma=0.9, lam=0.95)
    >>> [round(x, 4) for x in adv[0].tolist()], [round(x, 4) for x in ret[0].tolist()]
    ([0.0156, 0.0084, -0.0007, -0.0102], [-0.0763, -0.0783, -0.0825, -0.086])
    """
    # Backwards, because A_t needs A_{t+1}.  Two things make the loop short and exact:
    #  * actions before `start` are the prompt's, which the policy did not choose: skipped;
    #  * after the last answer action the rewards and values are 0 (compute_rewards and the masked
    #    old values), so pads add δ = 0 and the bootstrap past the end of the row is 0 [D7].
    # γ = 1 (DSC): within an 8-token answer there is nothing to discount.  λ < 1 trades the
    # critic's bias (λ = 0: A = δ, the TD error) against the variance of the sampled return (λ = 1).
    lastgaelam = 0
    advantages_reversed = []
    length = rewards.size(-1)
    for t in reversed(range(start, length)):
        nextvalues = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]                  # (B,)
        lastgaelam = delta + gamma * lam * lastgaelam                              # (B,)
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)                     # (B, T-1-start)
    returns = advantages + values[:, start:]                                       # (B, T-1-start)
    return advantages.detach(), returns


def actor_loss_fn(logprobs, old_logprobs, advantages, mask, cliprange=0.2):
    """Clipped surrogate [D9]: mean over masked actions of max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)),
    ρ = exp(log π − log π_old).  Equal log-probs give ρ = 1 and loss = −mean(A):
    >>> a = torch.tensor([[1.0, -2.0, 5.0]]); m = torch.tensor([[1, 1, 0]])
    >>> actor_loss_fn(torch.zeros(1, 3), torch.zeros(1, 3), a, m).item()
    0.5
    >>> round(actor_loss_fn(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)).item(), 4)
    -1.2
    """
    # The PPO surrogate.  ρ·A is the policy gradient's objective near π_old; the clip removes the
    # incentive to push ρ beyond [1−ε, 1+ε], and the max of the two *losses* (the min of the two
    # objectives) makes the bound pessimistic: clipping can only lower the objective, never raise it.
    # The mask multiplies the log-ratio first, so a masked position has ρ = 1 and cannot overflow.
    log_ratio = (logprobs - old_logprobs) * mask                                   # (B, A)
    ratio = torch.exp(log_ratio)                                                   # ρ
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.sum(torch.max(pg_loss1, pg_loss2) * mask) / mask.sum()


def critic_loss_fn(values, old_values, returns, mask, cliprange_value=0.2):
    """Clipped value loss [D9]: ½ · mean over masked actions of max((V−R)², (V_clip−R)²),
    V_clip = clamp(V, V_old − ε, V_old + ε).
    >>> round(critic_loss_fn(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1)).item(), 4)
    0.845
    """
    # The same pessimism for the critic: a value may move at most ε from the one recorded at
    # sampling time before the loss stops rewarding the move.  ε = 0.2 is in reward units, so with
    # scores of several units the critic learns slowly at first (see "The value loss starts high").
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    vf_loss1 = (values.float() - returns) ** 2
    vf_loss2 = (values_clipped.float() - returns) ** 2
    return 0.5 * torch.sum(torch.max(vf_loss1, vf_loss2) * mask) / mask.sum()


def experience_attention_mask(seq, prompt_mask, eos_token_id):
    """The mask of a generated batch: the prompt's own mask, then every answer token up to and
    *including* the first EOS [D1]; what `generate` appended after the EOS is padding.
    DSC builds `seq != pad_id`, which with OPT (pad == eos) hides the EOS itself.
    >>> seq = torch.tensor([[0, 7, 5, 1, 0, 0], [8, 7, 5, 6, 4, 3]])     # P = 2, eos = 1
    >>> experience_attention_mask(seq, torch.tensor([[0, 1], [1, 1]]), eos_token_id=1).tolist()
    [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    """
    answer = seq[:, prompt_mask.size(1):]                                          # (B, A)
    is_eos = (answer == eos_token_id).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0                                    # strictly after the first EOS
    return torch.cat([prompt_mask.long(), (~after_eos).long()], dim=1)             # (B, T)


def moving_average(model, model_ema, beta=0.992, device=None, zero_stage=0):
    """EMA of the actor's weights: ema ← β·ema + (1−β)·θ, after every train_rlhf micro-step (DSC)."""
    with torch.no_grad():
        for param, param_ema in zip(model.parameters(), model_ema.parameters()):
            param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))


# --------------------------------------------------------------------------------------
# §4.2  The four models (DSC rlhf_engine.py, seed 000 §3.3.1)
# --------------------------------------------------------------------------------------
# Why four?  The actor is the policy being trained.  The reference is the frozen SFT model the
# KL penalty measures drift from; without it the actor may leave language behind to please the
# reward model.  The reward model is the frozen judge from phase 2.  The critic estimates V(prefix),
# the baseline that turns one end-of-answer score into a per-token advantage; it starts as a copy
# of the reward model [D11], the nearest thing we have to a value function.  Two are trained (with
# optimizers, hence "engines"), two only run forward: on a GPU this is where RLHF's memory goes,
# and why DSC offers ZeRO, LoRA and its hybrid engine.
class DeepSpeedRLHFEngine:
    """actor + ref (from phase 1), critic + reward (from phase 2), and the optional EMA actor.
    The actor and critic are wrapped in engines (plain PyTorch, or DeepSpeed with --deepspeed)."""

    def __init__(self, actor_model_name_or_path, critic_model_name_or_path, tokenizer, args, num_total_iters):
        from transformers import AutoModelForCausalLM
        self.args, self.tokenizer = args, tokenizer
        actor = create_hf_model(AutoModelForCausalLM, actor_model_name_or_path, tokenizer, dropout=args.actor_dropout)
        if args.actor_lora_dim > 0:
            actor = convert_linear_layer_to_lora(actor, args.actor_lora_module_name, args.actor_lora_dim)
            if args.only_optimize_lora:
                actor = only_optimize_lora_parameters(actor)
        self.ref = freeze(create_hf_model(AutoModelForCausalLM, actor_model_name_or_path, tokenizer))
        self.actor_ema = freeze(copy.deepcopy(actor)) if args.enable_ema else None
        critic = create_critic_model(critic_model_name_or_path, tokenizer, num_padding_at_beginning=args.num_padding_at_beginning,
                                     rlhf_training=True, dropout=args.critic_dropout)          # [D11]
        if args.critic_lora_dim > 0:
            critic = convert_linear_layer_to_lora(critic, args.critic_lora_module_name, args.critic_lora_dim)
            if args.only_optimize_lora:
                critic = only_optimize_lora_parameters(critic, force_optimize_params=["v_head.weight"])
        self.reward = freeze(create_critic_model(critic_model_name_or_path, tokenizer, rlhf_training=True,
                                                 num_padding_at_beginning=args.num_padding_at_beginning))
        self.actor = make_engine(actor, args, args.actor_learning_rate, args.actor_weight_decay,
                                 args.actor_lora_learning_rate, num_total_iters)
        self.critic = make_engine(critic, args, args.critic_learning_rate, args.critic_weight_decay,
                                  args.critic_lora_learning_rate, num_total_iters)
        for m in (self.ref, self.reward, self.actor_ema):
            if m is not None:
                m.to(args.device)


def freeze(model):
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# --------------------------------------------------------------------------------------
# §4.3  Experience and one PPO step (DSC ppo_trainer.py, seed 000 §3.3.2, §3.3.4)
# --------------------------------------------------------------------------------------
def sample_answers(model, prompts, prompt_mask, tokenizer, max_answer_seq_len, temperature=1.0):
    """Sample answers [D3]: plain categorical at `temperature` (top_k=0, top_p=1), stop at EOS.

    DSC: no sampling flags, so OPT decodes greedily from its checkpoint's config.  Greedy rollouts
    give PPO no exploration, so we sample.  The pad token is suppressed: an answer never contains
    a pad id, and the mask built from the EOS is exact.
    """
    with torch.no_grad():
        return model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=max_answer_seq_len,
                              do_sample=True, top_k=0, top_p=1.0, temperature=temperature,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                              suppress_tokens=[tokenizer.pad_token_id])            # (B, P + A)


def decode_answers(tokenizer, seq, attention_mask, prompt_length):
    """Answer texts (what follows the prompt, up to the EOS, special tokens dropped)."""
    return [tokenizer.decode(s[prompt_length:][m[prompt_length:].bool()], skip_special_tokens=True)
            for s, m in zip(seq, attention_mask)]


class DeepSpeedPPOTrainer:
    """PPO over the four models; the method names are DSC's."""

    def __init__(self, rlhf_engine, args):
        self.rlhf_engine = rlhf_engine
        self.actor_model, self.critic_model = rlhf_engine.actor, rlhf_engine.critic
        self.ref_model, self.reward_model = rlhf_engine.ref, rlhf_engine.reward
        self.tokenizer = rlhf_engine.tokenizer
        self.args = args
        self.max_answer_seq_len = args.max_answer_seq_len
        # DSC hard-codes these five in ppo_trainer.py; here they are flags with DSC's values as defaults,
        # except the reward clip.  DIFF: DSC clips at ±5, a guard sized for its OPT reward models.  Ours
        # score up to about ±14, and at ±5 every good answer earns the same 5: over seeds 0, 1, 2 the
        # gold gain was +0.22 on average at ±20 and +0.18 at ±5.  At ±20 it guards against outliers only.
        self.kl_ctl = args.kl_ctl                        # 0.1
        self.clip_reward_value = args.clip_reward_value  # 5 (ours 20: see --help)
        self.cliprange = args.cliprange                  # 0.2
        self.cliprange_value = args.cliprange_value      # 0.2
        self.gamma, self.lam = args.gamma, args.lam      # 1.0, 0.95
        self.temperature = args.temperature
        self.last_stats = {}
        self.last_dropped = 0

    def _generate_sequence(self, prompts, mask, step):
        """Sample answers.  Returns (seq, attention_mask) of the kept rows, the mask keeping the
        EOS [D1], or None when every answer was dropped.

        DIFF: DSC drops every answer of <= 1 token (with pad = eos a bare EOS has no unmasked action
        to carry the score).  A dropped answer is never penalised, so the policy can flee into a bare
        EOS on the prompts it finds hard: measured here, the held-out gold rate fell 0.70 -> 0.45 with
        `objective/dropped` near 35 of 64.  Our mask keeps the EOS, so a bare EOS is one action that
        the reward model scores like any answer.  --drop_short_answers restores DSC."""
        seq = sample_answers(self.actor_model.module, prompts, mask, self.tokenizer, self.max_answer_seq_len,
                             self.temperature)
        full_mask = experience_attention_mask(seq, mask, self.tokenizer.eos_token_id)
        valid_ans_len = full_mask[:, prompts.shape[1]:].sum(-1)                    # (B,) tokens incl. EOS
        keep = valid_ans_len > (1 if self.args.drop_short_answers else 0)
        self.last_dropped = int((~keep).sum())
        if self.args.print_answers and step % self.args.print_answers_interval == 0:
            texts = decode_answers(self.tokenizer, seq[:2], full_mask[:2], prompts.shape[1])
            for p, a in zip(self.tokenizer.batch_decode(prompts[:2], skip_special_tokens=True), texts):
                print(f"--- step {step}\nprompt: {p}\nanswer: {a}")
        if keep.sum() == 0:
            return None
        return seq[keep], full_mask[keep]

    def generate_experience(self, prompts, mask, step):
        """Sample answers and record everything PPO needs, with the mask that keeps the EOS.

        DIFF: DSC scores in train mode and, when every answer is dropped, reuses the previous batch;
        we score in eval mode (identical with dropout 0 [D10]) and return None so the loop skips.
        """
        # Everything recorded here is a *constant* of the PPO step that follows: the log-probs of the
        # sampling policy (π_old), of the reference, the critic's values and the RM score.  Hence
        # no_grad, and eval mode so that dropout (if a loaded model has any) does not perturb them.
        self.eval()
        out = self._generate_sequence(prompts, mask, step)
        if out is None:
            warnings.warn(f"step {step}: every answer had <= 1 token; skipping this batch")
            self.train()
            return None
        seq, attention_mask = out                                                  # (B, T), (B, T)
        pos = positions_from_mask(attention_mask)
        with torch.no_grad():
            logits = self.actor_model(seq, attention_mask=attention_mask, position_ids=pos).logits
            logits_ref = self.ref_model(seq, attention_mask=attention_mask, position_ids=pos).logits
            reward_score = self.reward_model.forward_value(seq, attention_mask,
                                                           prompt_length=prompts.shape[1])["chosen_end_scores"]
            values = self.critic_model.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
        self.train()
        return {
            "prompts": seq[:, :prompts.shape[1]],                                              # (B, P) kept rows
            "logprobs": gather_log_probs(logits[:, :-1] / self.temperature, seq[:, 1:]),        # (B, T-1) [D4]
            "ref_logprobs": gather_log_probs(logits_ref[:, :-1] / self.temperature, seq[:, 1:]),  # (B, T-1)
            "value": values,                                                                   # (B, T-1)
            "rewards": reward_score,                                                           # (B,)
            "input_ids": seq,                                                                  # (B, T)
            "attention_mask": attention_mask,                                                  # (B, T)
        }

    def compute_rewards(self, prompts, log_probs, ref_log_probs, reward_score, action_mask):
        return compute_rewards(prompts, log_probs, ref_log_probs, reward_score, action_mask,
                               self.kl_ctl, self.clip_reward_value)

    def train_rlhf(self, inputs):
        """One PPO micro-step: rewards and advantages from the stored experience, then one actor
        and one critic backward/step.  Returns (actor_loss, critic_loss); stats in self.last_stats."""
        prompts, seq = inputs["prompts"], inputs["input_ids"]
        log_probs, ref_log_probs = inputs["logprobs"], inputs["ref_logprobs"]                  # (B, T-1)
        reward_score, values = inputs["rewards"], inputs["value"]                              # (B,), (B, T-1)
        attention_mask = inputs["attention_mask"]                                              # (B, T)
        start = prompts.size(1) - 1                      # first answer action
        action_mask = attention_mask[:, 1:]                                                    # (B, T-1)

        # (1) Rewards and advantages come from the *stored* experience only, so they are constants
        #     of this step (no gradient): r_t = -β·(log π_old - log π_ref) + clipped score on the last action.
        with torch.no_grad():
            old_rewards = self.compute_rewards(prompts, log_probs, ref_log_probs, reward_score, action_mask)
            # [D7] DSC zeroes old_values[i, ends:]; masking does the same without the off-by-one.
            old_values = values * action_mask                                                  # (B, T-1)
            advantages, returns = get_advantages_and_returns(old_values, old_rewards, start, self.gamma, self.lam)

        # (2) The actor: new log-probs of the same tokens, ρ = π_θ / π_old, clipped surrogate, one step.
        #     Only answer actions (index ≥ start, mask 1) count; the prompt is context, not an action.
        pos = positions_from_mask(attention_mask)
        actor_logits = self.actor_model(seq, attention_mask=attention_mask, position_ids=pos, use_cache=False).logits
        actor_log_prob = gather_log_probs(actor_logits[:, :-1] / self.temperature, seq[:, 1:])  # (B, T-1)
        mask = action_mask[:, start:].float()                                                  # (B, A)
        actor_loss = actor_loss_fn(actor_log_prob[:, start:], log_probs[:, start:], advantages, mask, self.cliprange)
        self.actor_model.backward(actor_loss)
        self.actor_model.step()

        # (3) The critic: new values regress onto the GAE returns, clipped around the old values.
        #     DSC: the actor steps before the critic's forward; the two models share no weights, so
        #     the order does not change the numbers.  values[:, :-1]: no action follows the last token.
        value = self.critic_model.forward_value(seq, attention_mask, return_value_only=True, use_cache=False)[:, :-1]
        critic_loss = critic_loss_fn(value[:, start:], old_values[:, start:], returns, mask, self.cliprange_value)
        self.critic_model.backward(critic_loss)
        self.critic_model.step()

        # (4) Diagnostics DSC does not log: how often the clip acts, the approximate KL between old and
        #     new policy (½·E[(log ρ)²]), and how much of the returns' variance the critic explains.
        with torch.no_grad():
            n = mask.sum()
            ratio = torch.exp((actor_log_prob[:, start:] - log_probs[:, start:]) * mask)
            clipped = ((ratio - 1.0).abs() > self.cliprange).float()
            v, ret = value[:, start:][mask.bool()], returns[mask.bool()]
            self.last_stats = {
                "policy/clipfrac": (clipped * mask).sum().item() / n.item(),
                "policy/approxkl": (0.5 * ((actor_log_prob[:, start:] - log_probs[:, start:]) ** 2) * mask).sum().item() / n.item(),
                "val/clipfrac": (((value[:, start:] - old_values[:, start:]).abs() > self.cliprange_value).float() * mask).sum().item() / n.item(),
                "val/explained_variance": (1 - (ret - v).var() / ret.var().clamp(min=1e-8)).item() if ret.numel() > 1 else 0.0,
                "val/mean": v.mean().item(),
                "objective/advantage_mean": advantages[mask.bool()].mean().item(),
            }
        return actor_loss, critic_loss

    def train_unsupervised(self, inputs, unsup_coef):
        """PTX: unsup_coef · language-model loss on pre-training text, its own actor step (DSC)."""
        loss = self.actor_model(**inputs, use_cache=False).loss
        self.actor_model.backward(unsup_coef * loss)
        self.actor_model.step()
        return loss

    def train(self):
        self.actor_model.train()
        self.critic_model.train()

    def eval(self):
        for m in (self.actor_model, self.critic_model, self.ref_model, self.reward_model):
            m.eval()


# --------------------------------------------------------------------------------------
# §4.4  Measuring on held-out prompts: RM score and the gold rate of sampled answers
# --------------------------------------------------------------------------------------
# The gold rate is measured on answers *sampled* at the training temperature, not greedy ones:
# PPO changes the distribution the actor samples from, and greedy decoding hides most of that
# (the SFT model's greedy answers are already nearly always right here; its samples are not).
# Before and after use the same prompts and the same seed, so the two figures are a paired
# comparison, and the RNG is forked so that measuring never changes what training samples next.
def evaluate_samples(actor, reward_model, tokenizer, raw_eval, args, seed):
    """Sample one answer per held-out prompt (same prompts, seed and temperature every call) and
    return {"reward": mean RM score, "gold": fraction right (None off the shipped task), "rows": [...]}.
    The RNG is forked, so measuring never changes what training samples next."""
    prompts = [raw.get_prompt(s) for raw, s in raw_eval][: args.gold_eval_prompts]
    if not prompts:
        return {"reward": float("nan"), "gold": None, "rows": []}
    collator = DataCollatorRLHF(args.max_prompt_seq_len)
    items = []
    for p in prompts:
        enc = tokenizer(p, return_tensors="pt")
        ids, m = enc["input_ids"][0][-args.max_prompt_seq_len:], enc["attention_mask"][0][-args.max_prompt_seq_len:]
        items.append((ids.flip(0), m.flip(0), tokenizer.pad_token_id))
    rows, rewards = [], []
    actor.eval()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for i in range(0, len(items), args.per_device_eval_batch_size):
            batch = to_device(collator(items[i:i + args.per_device_eval_batch_size]), args.device)
            P = batch["prompt"].shape[1]
            seq = sample_answers(actor, batch["prompt"], batch["prompt_att_mask"], tokenizer,
                                 args.max_answer_seq_len, args.temperature)
            mask = experience_attention_mask(seq, batch["prompt_att_mask"], tokenizer.eos_token_id)
            with torch.no_grad():
                score = reward_model.forward_value(seq, mask, prompt_length=P)["chosen_end_scores"]
            for j, ans in enumerate(decode_answers(tokenizer, seq, mask, P)):
                prompt = prompts[i + j]
                rows.append({"prompt": prompt, "answer": ans, "score": score[j].item(), "gold": gold_score(prompt, ans)})
            rewards += score.tolist()
    actor.train()
    golds = [r["gold"] for r in rows if not math.isnan(r["gold"])]
    return {"reward": sum(rewards) / len(rewards), "gold": sum(golds) / len(golds) if golds else None, "rows": rows}


# --------------------------------------------------------------------------------------
# §4.5  The phase-3 loop (DSC step3_rlhf_finetuning/main.py, seed 000 §3.2, §3.3.3)
# --------------------------------------------------------------------------------------
def train_phase3(args):
    """PPO.  Returns the summary written to <output_dir>/phase3/summary.json."""
    set_random_seed(args.seed)
    actor_path = args.actor_model_name_or_path or phase_dir(args, "phase1", "--actor_model_name_or_path")
    critic_path = args.critic_model_name_or_path or phase_dir(args, "phase2", "--critic_model_name_or_path")
    tokenizer = load_hf_tokenizer(actor_path)
    prompt_train, _, raw_eval = create_prompt_dataset(args.local_rank, args.data_path, args.data_split, None, 3,
                                                      args.seed, tokenizer, args.max_seq_len,
                                                      max_prompt_seq_len=args.max_prompt_seq_len, return_raw=True)
    if len(prompt_train) == 0:
        raise ValueError(f"phase 3: no prompts left in {args.data_path} (split {args.data_split}, "
                         f"--max_prompt_seq_len {args.max_prompt_seq_len})")
    prompt_loader = make_loader(prompt_train, args.per_device_generation_batch_size, args.seed, shuffle=True,
                                collate_fn=DataCollatorRLHF(args.max_prompt_seq_len, args.inference_tp_size))
    unsup_loader = None
    if args.unsupervised_dataset_name:
        unsup_ds = get_unsupervised_data(args, tokenizer)
        unsup_loader = make_loader(unsup_ds, args.per_device_generation_batch_size, args.seed, shuffle=True)
    n_batches = len(prompt_loader) if unsup_loader is None else min(len(prompt_loader), len(unsup_loader))
    # DSC: num_total_iters = batches · (gen_bs / train_bs) · ppo_epochs / GAS · epochs
    num_total_iters = int(n_batches * math.ceil(args.per_device_generation_batch_size / args.per_device_training_batch_size)
                          * args.ppo_epochs / args.gradient_accumulation_steps * args.num_train_epochs)
    if args.max_steps:
        num_total_iters = min(num_total_iters, args.max_steps)
    print_batch_arithmetic(3, args, len(prompt_train), n_batches, num_total_iters)
    rlhf_engine = DeepSpeedRLHFEngine(actor_path, critic_path, tokenizer, args, num_total_iters)
    trainer = DeepSpeedPPOTrainer(rlhf_engine, args)
    exp_mini_dataset = MiniDataset(args.generation_batches, args.per_device_training_batch_size)
    unsup_mini_dataset = MiniDataset(args.generation_batches, args.per_device_training_batch_size)

    stage, log = begin_phase(args, "phase3")
    before = evaluate_samples(rlhf_engine.actor.module, rlhf_engine.reward, tokenizer, raw_eval, args, args.seed)
    print(f"phase 3: held-out before PPO  reward {before['reward']:.3f}  gold {_fmt(before['gold'])}")
    log.log(step=0, **{"eval/reward": before["reward"], "eval/gold": before["gold"]})
    # The loop is on-policy: each batch of prompts is answered by the current actor, trained on at
    # once, then thrown away.  With the defaults (generation batch = training batch = 64, one PPO
    # epoch) every rollout gives exactly one actor step and one critic step, as in DSC.
    history, step, done = [], 0, False
    for epoch in range(args.num_train_epochs):
        unsup_iter = iter(unsup_loader) if unsup_loader is not None else None
        bar = tqdm_bar(None, f"phase 3 PPO epoch {epoch + 1}/{args.num_train_epochs}", total=n_batches)
        for batch_prompt in _take(prompt_loader, n_batches, bar):
            batch_prompt = to_device(batch_prompt, args.device)
            out = trainer.generate_experience(batch_prompt["prompt"], batch_prompt["prompt_att_mask"], step)
            step += 1
            if out is None:
                continue
            batch_unsup = to_device(next(unsup_iter), args.device) if unsup_iter is not None else None
            stats = experience_stats(out, tokenizer)
            stats["objective/dropped"] = trainer.last_dropped          # 0 unless --drop_short_answers
            # MiniDataset buffers --generation_batches batches of experience, then hands them back
            # cut into micro-batches of --per_device_training_batch_size (seed 000 §3.3.3).
            exp_dataset = exp_mini_dataset.add(out)
            unsup_dataset = unsup_mini_dataset.add(batch_unsup) if unsup_iter is not None else None
            if exp_dataset is None:
                continue
            actor_losses, critic_losses, unsup_losses, ppo_stats = [], [], [], []
            # Every micro-batch of the buffer, --ppo_epochs times.  With DSC's defaults (one batch,
            # one epoch, generation bs = training bs) there is one update per rollout and ratio = 1.
            for ppo_ep in range(args.ppo_epochs):
                for i, exp_data in enumerate(exp_dataset):
                    actor_loss, critic_loss = trainer.train_rlhf(exp_data)
                    actor_losses.append(actor_loss.item())
                    critic_losses.append(critic_loss.item())
                    ppo_stats.append(trainer.last_stats)
                    if unsup_dataset is not None:
                        unsup_losses.append(trainer.train_unsupervised(unsup_dataset[i], args.unsup_coef).item())
                    if rlhf_engine.actor_ema is not None:
                        moving_average(rlhf_engine.actor.module, rlhf_engine.actor_ema)
                    if reached(rlhf_engine.actor, args):
                        break
                if reached(rlhf_engine.actor, args):
                    break
                random.shuffle(exp_dataset)      # a fresh order every PPO epoch
            row = {"loss/policy": _mean(actor_losses), "loss/value": _mean(critic_losses),
                   **{k: _mean([s[k] for s in ppo_stats]) for k in ppo_stats[0]}, **stats,
                   "lr": rlhf_engine.actor.lr()}
            if unsup_losses:
                row["loss/unsup"] = _mean(unsup_losses)
            history.append(row)
            log.log(step=rlhf_engine.actor.global_steps, epoch=epoch, **row)
            bar.set_postfix(reward=f"{row['objective/scores']:.2f}", kl=f"{row['objective/kl']:.3f}",
                            gold=_fmt(row.get("gold/train")))
            if reached(rlhf_engine.actor, args):
                done = True
                break
        if done:
            break
    if not history:
        raise RuntimeError("phase 3: no PPO step ran (every generated batch was dropped, or the data is empty)")
    after = evaluate_samples(rlhf_engine.actor.module, rlhf_engine.reward, tokenizer, raw_eval, args, args.seed)
    print(f"phase 3: held-out after PPO   reward {after['reward']:.3f}  gold {_fmt(after['gold'])}")
    log.log(step=rlhf_engine.actor.global_steps, **{"eval/reward": after["reward"], "eval/gold": after["gold"]})
    tenth = max(1, len(history) // 10)
    summary = {"reward_first": _mean([h["objective/scores"] for h in history[:tenth]]),
               "reward_last": _mean([h["objective/scores"] for h in history[-tenth:]]),
               "kl_last": _mean([h["objective/kl"] for h in history[-tenth:]]),
               "gold_before": before["gold"], "gold_after": after["gold"],
               "eval_reward_before": before["reward"], "eval_reward_after": after["reward"],
               "steps": rlhf_engine.actor.global_steps, "ppo_iterations": len(history),
               "samples_after": after["rows"][:8]}
    for name, model, save in (("actor", rlhf_engine.actor.module, save_hf_format),
                              ("critic", rlhf_engine.critic.module, save_reward_model),
                              ("actor_ema", rlhf_engine.actor_ema, save_hf_format)):
        if model is not None:
            convert_lora_to_linear_layer(model)
            save(model, tokenizer, os.path.join(stage, name))
    return end_phase(args, "phase3", stage, log, summary)


# What to watch in metrics.jsonl during PPO (TRL's names):
#   objective/scores   the raw RM score of the batch; it should rise.  If it rises while gold/train
#                      does not, PPO is exploiting the reward model.
#   objective/kl       Σ_t (log π − log π_ref) per answer: how far the actor has moved.  It grows
#                      early and should level off; β = --kl_ctl sets where.
#   policy/clipfrac    how often the PPO clip acts: 0 with one update per rollout (ratio = 1).
#   val/explained_variance   1 − Var(R − V)/Var(R): near 1 when the critic predicts the returns.
#   gold/train         the gold rule on the training samples (measured only; nothing trains on it).
def experience_stats(out, tokenizer):
    """What one batch of experience says: raw RM score (DSC's "average reward", before clipping),
    KL to the reference, answer length, and the gold rate of the samples (measured, never trained on)."""
    P = out["prompts"].shape[1]
    start = P - 1                                                                           # first answer action
    mask = out["attention_mask"][:, 1:][:, start:].float()                                  # (B, A)
    kl = ((out["logprobs"][:, start:] - out["ref_logprobs"][:, start:]) * mask).sum(1)       # (B,) Σ_t log π/π_ref
    stats = {"objective/scores": out["rewards"].mean().item(), "objective/kl": kl.mean().item(),
             "objective/entropy_proxy": -(out["logprobs"][:, start:] * mask).sum().item() / mask.sum().item(),
             "response_length": mask.sum(1).mean().item()}
    prompts = tokenizer.batch_decode(out["prompts"], skip_special_tokens=True)
    answers = decode_answers(tokenizer, out["input_ids"], out["attention_mask"], P)
    golds = [g for g in (gold_score(p, a) for p, a in zip(prompts, answers)) if not math.isnan(g)]
    if golds:
        stats["gold/train"] = sum(golds) / len(golds)
    return stats


def _take(loader, n, bar):
    for i, batch in enumerate(loader):
        if i >= n:
            return
        yield batch
        bar.update(1)


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _fmt(x):
    return "n/a" if x is None else f"{x:.3f}"


# ======================================================================================
# §5  [plumbing] engines, DeepSpeed, checkpoints, metrics, plots, the CLI
# ======================================================================================
# Nothing here changes the math.  A learner may skip to main() at the bottom.

def set_random_seed(seed):
    """Seed python, numpy and torch (DSC set_random_seed)."""
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def to_device(batch, device):
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch.to(device) if torch.is_tensor(batch) else batch


def make_loader(dataset, batch_size, seed, shuffle=False, collate_fn=None):
    """A DataLoader whose shuffle order depends only on --seed."""
    from torch.utils.data import DataLoader
    g = torch.Generator()
    g.manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=g if shuffle else None,
                      collate_fn=collate_fn)


def total_steps(batches_per_epoch, args):
    """Optimizer steps in a phase: epochs · ceil(batches / GAS), capped by --max_steps."""
    n = args.num_train_epochs * math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    return min(n, args.max_steps) if args.max_steps else n


def reached(engine, args):
    return bool(args.max_steps) and engine.global_steps >= args.max_steps


def first(xs):
    return xs[0] if xs else None


def tqdm_bar(iterable=None, desc="", total=None):
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, dynamic_ncols=True, leave=True)


def print_batch_arithmetic(phase, args, rows, batches, steps):
    """nanoGPT-style startup line: how data becomes optimizer steps."""
    if phase == 3:
        micro = math.ceil(args.per_device_generation_batch_size / args.per_device_training_batch_size)
        print(f"phase 3: {rows} prompts -> {batches} generation batches of {args.per_device_generation_batch_size} "
              f"prompts x 1 answer; every {args.generation_batches} batch(es) -> "
              f"{micro * args.generation_batches} micro-batches of {args.per_device_training_batch_size} "
              f"x {args.ppo_epochs} PPO epoch(s) / GAS {args.gradient_accumulation_steps} = {steps} optimizer steps")
    else:
        print(f"phase {phase}: {rows} rows -> {batches} batches of {args.per_device_train_batch_size} x "
              f"{args.num_train_epochs} epoch(s) / GAS {args.gradient_accumulation_steps} = {steps} optimizer steps")


def get_optimizer_grouped_parameters(model, weight_decay, lora_lr=5e-4,
                                     no_decay_name_list=("bias", "layer_norm.weight", "layernorm.weight",
                                                         "norm.weight", "ln_f.weight"),
                                     lora_name_list=("lora_right_weight", "lora_left_weight")):
    """DSC's three groups: decayed weights, decayed LoRA factors (own lr), no-decay names.  Empty
    groups are dropped (else the scheduler and DeepSpeed disagree on the group count)."""
    groups = [{"params": [], "weight_decay": weight_decay},
              {"params": [], "weight_decay": weight_decay, "lr": lora_lr},
              {"params": [], "weight_decay": 0.0}]
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if any(nd in n.lower() for nd in no_decay_name_list):
            groups[2]["params"].append(p)
        elif any(ln in n for ln in lora_name_list):
            groups[1]["params"].append(p)
        else:
            groups[0]["params"].append(p)
    return [g for g in groups if g["params"]]


class PlainEngine:
    """The subset of DeepSpeedEngine that the loops use, in plain PyTorch: engine(...) runs the
    model, backward(loss) scales by 1/GAS, step() steps the optimizer and scheduler at GAS
    boundaries with gradient clipping 1.0 [D12], and returns True when it did."""

    def __init__(self, model, optimizer, lr_scheduler, gradient_accumulation_steps=1, gradient_clipping=1.0):
        self.module, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.gas, self.clip = gradient_accumulation_steps, gradient_clipping
        self.micro_steps = self.global_steps = 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name):            # forward_value, generate, ... reach the wrapped model
        return getattr(self.__dict__["module"], name)

    def backward(self, loss):
        (loss / self.gas).backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.gas:
            return False
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.clip:
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1
        return True

    def lr(self):
        return self.optimizer.param_groups[0]["lr"]

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()


def make_engine(model, args, lr, weight_decay, lora_lr, num_training_steps):
    """AdamW (betas 0.9, 0.95) + HF scheduler, wrapped in PlainEngine or, with --deepspeed, in
    deepspeed.initialize.  Both expose the same backward/step/global_steps."""
    from transformers import get_scheduler
    model.to(args.device)
    params = get_optimizer_grouped_parameters(model, weight_decay, lora_lr)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95))
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=max(1, num_training_steps))
    if not args.deepspeed:
        return PlainEngine(model, optimizer, scheduler, args.gradient_accumulation_steps)
    return DeepSpeedEngineAdapter(model, optimizer, scheduler, args)


def get_train_ds_config(args, offload=False, stage=0):
    """DSC's train config, trimmed to what applies here: ZeRO stage, optional CPU offload, dtype,
    gradient clipping 1.0.  train_batch_size = micro · world · GAS."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    zero = {"stage": stage, "overlap_comm": False}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
              "train_batch_size": args.per_device_train_batch_size * world * args.gradient_accumulation_steps,
              "gradient_accumulation_steps": args.gradient_accumulation_steps,
              "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 10 ** 9,
              "zero_allow_untested_optimizer": True}
    if args.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale_window": 100}
    elif args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class DeepSpeedEngineAdapter(PlainEngine):
    """[plumbing] --deepspeed: deepspeed.initialize owns the optimizer step, loss scaling, GAS and
    ZeRO partitioning; this adapter only keeps PlainEngine's names (global_steps, step() -> bool).
    Launch several processes with the `deepspeed` launcher; one process works as is."""

    def __init__(self, model, optimizer, scheduler, args):
        import deepspeed
        if not torch.distributed.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("LOCAL_RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            deepspeed.init_distributed(dist_backend="gloo" if args.device == "cpu" else "nccl")
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=get_train_ds_config(args, args.offload, args.zero_stage))
        super().__init__(engine, optimizer, scheduler, args.gradient_accumulation_steps, gradient_clipping=0)
        self.engine = engine
        self.module = engine.module

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        if boundary:
            self.global_steps += 1
        return boundary


# --------------------------------------------------------------------------------------
# Checkpoints and metrics: every phase writes into a temp dir, renamed into place at the end
# --------------------------------------------------------------------------------------
def save_hf_format(model, tokenizer, output_dir):
    """A causal LM that plain `transformers` loads by path (LoRA already fused)."""
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


def save_reward_model(model, tokenizer, output_dir):
    """The backbone in HF format (AutoModel loads it) + v_head.safetensors + reward_model.json."""
    from safetensors.torch import save_file
    save_hf_format(model.rwtransformer, tokenizer, output_dir)
    save_file({k: v.contiguous() for k, v in model.v_head.state_dict().items()}, os.path.join(output_dir, V_HEAD_FILE))
    with open(os.path.join(output_dir, "reward_model.json"), "w") as f:
        json.dump({"num_padding_at_beginning": model.num_padding_at_beginning, "v_head": V_HEAD_FILE}, f)


class MetricsLogger:
    """One JSON object per line: {"step": ..., "loss/policy": ..., ...}."""

    def __init__(self, path):
        self.path = path
        self.f = open(path, "w", encoding="utf-8")

    def log(self, **row):
        self.f.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


def phase_dir(args, name, flag):
    path = os.path.join(args.output_dir, name)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist: run the previous phase first "
                                f"(python minirlhf.py --phase {int(name[-1])}) or pass {flag}")
    return path


def begin_phase(args, name):
    """A fresh staging dir <output_dir>/.<name>.tmp and its metrics.jsonl."""
    stage = os.path.join(args.output_dir, f".{name}.tmp")
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    return stage, MetricsLogger(os.path.join(stage, "metrics.jsonl"))


def end_phase(args, name, stage, log, summary):
    """Write summary.json, then atomically swap the staging dir into <output_dir>/<name>."""
    log.close()
    summary = {"phase": name, **summary, "seconds": round(time.time() - args._phase_start, 1)}
    with open(os.path.join(stage, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    final = os.path.join(args.output_dir, name)
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(stage, final)
    shutil.rmtree(old, ignore_errors=True)
    return summary


def plot_curves(output_dir):
    """--plot: draw <output_dir>/curves.png from the three metrics.jsonl files."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install -r requirements-extra.txt")
        return None
    panels = [("phase1", "loss/sft", "SFT loss"), ("phase1", "eval/perplexity", "SFT held-out perplexity"),
              ("phase2", "loss/reward", "RM loss"), ("phase2", "train/acc", "RM accuracy (train batch)"),
              ("phase3", "objective/scores", "PPO reward (RM score)"), ("phase3", "objective/kl", "PPO KL to ref"),
              ("phase3", "loss/policy", "policy loss"), ("phase3", "loss/value", "value loss"),
              ("phase3", "policy/clipfrac", "clip fraction"), ("phase3", "gold/train", "gold rate of samples")]
    rows = {}
    for phase in ("phase1", "phase2", "phase3"):
        path = os.path.join(output_dir, phase, "metrics.jsonl")
        rows[phase] = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    fig, axes = plt.subplots(2, 5, figsize=(20, 7))
    for ax, (phase, key, title) in zip(axes.flat, panels):
        pts = [(r["step"], r[key]) for r in rows[phase] if key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(pts) < 30 else None, alpha=0.4 if len(pts) >= 30 else 1.0)
            w = max(1, len(ys) // 15)
            if w > 1:                                    # a moving average, so the trend shows
                ax.plot(xs[w - 1:], [sum(ys[i - w + 1:i + 1]) / w for i in range(w - 1, len(ys))])
        if key == "eval/perplexity":
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
    fig.tight_layout()
    out = os.path.join(output_dir, "curves.png")
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")
    return out


# --------------------------------------------------------------------------------------
# The CLI: DSC's flag names; defaults are DSC's unless the CPU demo needs others (said in --help)
# --------------------------------------------------------------------------------------
# Flags whose default depends on the phase, as each DSC step has its own main.py:
#                          phase 1   phase 2   (DSC step 1, step 2)
PHASE_DEFAULTS = {"learning_rate": (1e-3, 3e-4),        # DSC 1e-3, 5e-5: our RM is tiny and starts from SFT
                  "num_train_epochs": (2, 3)}           # DSC 1, 1: the tiny RM needs three passes


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="minirlhf: DeepSpeed-Chat's SFT -> reward model -> PPO in one file. "
                    "Defaults run the embedded tiny model on data/ offline in a few minutes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--phase", default="all", choices=["1", "2", "3", "all"], help="which phase(s) to run")
    p.add_argument("--plot", metavar="OUTPUT_DIR", help="draw OUTPUT_DIR/curves.png from metrics.jsonl and exit")
    # data
    p.add_argument("--data_path", nargs="*", default=[DEFAULT_DATA],
                   help="local json/jsonl/csv/parquet files or folders (prompt, chosen, rejected), "
                        "or hub sets such as Dahoas/rm-static")
    p.add_argument("--sft_only_data_path", nargs="*", default=[], help="extra sources used whole, in phase 1 only")
    p.add_argument("--data_split", default="2,4,4", help="phase 1,2,3 shares of every data set (disjoint)")
    p.add_argument("--max_seq_len", type=int, default=36, help="phase 1/2 sequence length (DSC 512)")
    p.add_argument("--max_prompt_seq_len", type=int, default=28, help="phase 3 prompt width P (DSC 256)")
    p.add_argument("--max_answer_seq_len", type=int, default=8, help="phase 3 answer length A (DSC 256)")
    p.add_argument("--sft_mask_prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="phase 1: no loss (and no perplexity) on prompt tokens. DSC trains on them "
                        "(--no-sft_mask_prompt); its unmerged PR #762 masks them. Masking doubled the "
                        "held-out gold rate of the SFT model here.")
    p.add_argument("--unsupervised_dataset_name", default=None, help="PTX text: hub name or local .txt/.jsonl")
    p.add_argument("--unsupervised_dataset_config_name", default=None)
    p.add_argument("--unsup_coef", type=float, default=27.8, help="PTX coefficient (γ of InstructGPT eq. 2)")
    # models
    p.add_argument("--model_name_or_path", default=None,
                   help=f"phase 1: '{TINY}' (embedded default), a local path or a hub name; "
                        "phase 2: defaults to <output_dir>/phase1")
    p.add_argument("--actor_model_name_or_path", default=None, help="phase 3 actor/ref (default <output_dir>/phase1)")
    p.add_argument("--critic_model_name_or_path", default=None, help="phase 3 critic/reward (default <output_dir>/phase2)")
    p.add_argument("--num_padding_at_beginning", type=int, default=0,
                   help="pads before the text in phase 2 (DSC 1 = OPT's BOS, which is its pad id)")
    p.add_argument("--dropout", type=float, default=None, help="phase 1/2 dropout (None keeps the config)")
    p.add_argument("--actor_dropout", type=float, default=None)
    p.add_argument("--critic_dropout", type=float, default=None)
    # batching
    p.add_argument("--per_device_train_batch_size", type=int, default=32, help="phase 1/2 (DSC 16)")
    p.add_argument("--per_device_eval_batch_size", type=int, default=64, help="(DSC 16)")
    p.add_argument("--per_device_generation_batch_size", type=int, default=64, help="phase 3 prompts per generation (DSC 16)")
    p.add_argument("--per_device_training_batch_size", type=int, default=64, help="phase 3 PPO micro-batch (DSC 16)")
    p.add_argument("--generation_batches", type=int, default=1)
    p.add_argument("--ppo_epochs", type=int, default=1)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--num_train_epochs", type=int, default=None,
                   help="default: phase 1 %d, phase 2 %d, phase 3 1" % PHASE_DEFAULTS["num_train_epochs"])
    p.add_argument("--max_steps", type=int, default=None, help="stop each phase after N optimizer steps")
    # optimisation
    p.add_argument("--learning_rate", type=float, default=None,
                   help="phase 1/2 lr; default: phase 1 %g (DSC 1e-3), phase 2 %g (DSC 5e-5)" % PHASE_DEFAULTS["learning_rate"])
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--actor_learning_rate", type=float, default=3e-4, help="(DSC 9.65e-6, for a pretrained 1.3B)")
    p.add_argument("--critic_learning_rate", type=float, default=3e-4, help="(DSC 5e-6)")
    p.add_argument("--actor_weight_decay", type=float, default=0.0)
    p.add_argument("--critic_weight_decay", type=float, default=0.0)
    p.add_argument("--lr_scheduler_type", default="cosine",
                   choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"])
    p.add_argument("--num_warmup_steps", type=int, default=0, help="(DSC 0 in phases 1/2, 100 in phase 3)")
    p.add_argument("--seed", type=int, default=1234)
    # PPO (hard-coded in DSC's ppo_trainer.py; the defaults are DSC's values)
    p.add_argument("--kl_ctl", type=float, default=0.1, help="β of the per-token KL penalty")
    p.add_argument("--clip_reward_value", type=float, default=20.0,
                   help="RM score clipped to ±this (DSC 5, OpenRLHF 10). Our RM scores span about ±14; at ±5 "
                        "40%% of the SFT model's samples score above +5, so PPO cannot tell good from better")
    p.add_argument("--drop_short_answers", action="store_true",
                   help="DSC: drop answers of <= 1 token instead of scoring them (a bare EOS then escapes "
                        "every penalty); default: score them")
    p.add_argument("--cliprange", type=float, default=0.2, help="policy ratio clip ε")
    p.add_argument("--cliprange_value", type=float, default=0.2, help="value clip ε")
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature (DSC: greedy)")
    p.add_argument("--enable_ema", action="store_true", help="keep an EMA (β=0.992) copy of the actor")
    p.add_argument("--print_answers", action="store_true")
    p.add_argument("--print_answers_interval", type=int, default=1)
    p.add_argument("--gold_eval_prompts", type=int, default=512, help="held-out prompts sampled before/after PPO")
    # LoRA
    p.add_argument("--lora_dim", type=int, default=0, help="phase 1/2 LoRA rank (0 = off)")
    p.add_argument("--lora_module_name", default="decoder.layers.")
    p.add_argument("--lora_learning_rate", type=float, default=5e-4)
    p.add_argument("--actor_lora_dim", type=int, default=0)
    p.add_argument("--actor_lora_module_name", default="decoder.layers.")
    p.add_argument("--actor_lora_learning_rate", type=float, default=5e-4)
    p.add_argument("--critic_lora_dim", type=int, default=0)
    p.add_argument("--critic_lora_module_name", default="decoder.layers.")
    p.add_argument("--critic_lora_learning_rate", type=float, default=5e-4)
    p.add_argument("--only_optimize_lora", action="store_true")
    # DeepSpeed [plumbing]
    p.add_argument("--deepspeed", action="store_true", help="wrap models with deepspeed.initialize")
    p.add_argument("--zero_stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--offload", action="store_true")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="(DSC fp16; CPU wants fp32)")
    p.add_argument("--inference_tp_size", type=int, default=1)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--eval_interval", type=int, default=0, help="phase 2: evaluate every N steps (0 = per epoch)")
    p.add_argument("--eval_iters", type=int, default=100, help="phase 2: max eval batches")
    # logging / output
    p.add_argument("--output_dir", default="output", help="holds phase1/, phase2/, phase3/")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if not args.data_path:
        p.error("--data_path needs at least one source")
    for k in ("max_seq_len", "max_prompt_seq_len", "max_answer_seq_len", "per_device_train_batch_size",
              "per_device_eval_batch_size", "per_device_generation_batch_size", "per_device_training_batch_size",
              "generation_batches", "ppo_epochs", "gradient_accumulation_steps"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    return args


def run_phase(args, phase):
    """Fill in the phase-dependent defaults, run one phase, print its summary."""
    a = argparse.Namespace(**vars(args))
    for k, per_phase in PHASE_DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, per_phase[phase - 1] if phase < 3 else 1)
    if phase == 2 and args.phase == "all":
        a.model_name_or_path = None      # in a full run phase 2 always starts from this run's phase 1
    a._phase_start = time.time()
    keys = {1: ["model_name_or_path", "learning_rate", "num_train_epochs", "max_seq_len", "lora_dim"],
            2: ["model_name_or_path", "learning_rate", "num_train_epochs", "max_seq_len", "lora_dim"],
            3: ["actor_model_name_or_path", "critic_model_name_or_path", "actor_learning_rate",
                "critic_learning_rate", "kl_ctl", "clip_reward_value", "cliprange", "cliprange_value",
                "gamma", "lam", "temperature", "max_prompt_seq_len", "max_answer_seq_len"]}[phase]
    defaults = {"model_name_or_path": TINY if phase == 1 else os.path.join(a.output_dir, "phase1"),
                "actor_model_name_or_path": os.path.join(a.output_dir, "phase1"),
                "critic_model_name_or_path": os.path.join(a.output_dir, "phase2")}
    config_line = ", ".join(f"{k}={getattr(a, k) if getattr(a, k) is not None else defaults.get(k)}"
                            for k in keys + ["seed", "data_split"])
    print(f"phase {phase} config: {config_line}")
    summary = {1: train_phase1, 2: train_phase2, 3: train_phase3}[phase](a)
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items() if k != "samples_after"}
    print(f"phase {phase} summary: {json.dumps(shown)}")
    return summary


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        return plot_curves(args.plot)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    os.makedirs(args.output_dir, exist_ok=True)
    t0 = time.time()
    phases = [1, 2, 3] if args.phase == "all" else [int(args.phase)]
    summaries = {p: run_phase(args, p) for p in phases}
    print(f"done in {time.time() - t0:.0f}s; outputs in {args.output_dir}/")
    return summaries


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:     # bad input: one clear line, not a traceback
        sys.exit(f"minirlhf: error: {e}")
