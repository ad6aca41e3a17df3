"""Numerical tests for minirlhf.py: hand-computed numbers, loop-vs-vectorized parity, properties,
DSC side-by-side re-implementations, malformed inputs, and a micro end-to-end run through real
output directories.  Run: python -m pytest -q"""
import copy
import doctest
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import minirlhf as M

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(HERE, "data", "preference_task.jsonl")


# ----------------------------------------------------------------------------- doctests
def test_doctests_run_and_pass():
    result = doctest.testmod(M, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted >= 39, f"only {result.attempted} doctest examples ran"


# ----------------------------------------------------------------------------- gather_log_probs
def test_gather_log_probs_is_log_softmax_not_raw_logits():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    out = M.gather_log_probs(logits, labels)
    assert out.shape == (2, 5)
    for b in range(2):
        for t in range(5):
            want = logits[b, t, labels[b, t]] - torch.logsumexp(logits[b, t], 0)
            assert abs(out[b, t].item() - want.item()) < 1e-5
    assert (out <= 0).all()


# ----------------------------------------------------------------------------- compute_rewards
def dsc_compute_rewards(prompts, log_probs, ref_log_probs, reward_score, action_mask, kl_ctl, clip):
    """DeepSpeed-Chat's compute_rewards (current code), re-implemented from its description."""
    rewards = -kl_ctl * (log_probs - ref_log_probs)
    start = prompts.shape[1] - 1
    ends = start + action_mask[:, start:].sum(1) + 1
    reward_clip = torch.clamp(reward_score, -clip, clip)
    for j in range(log_probs.shape[0]):
        rewards[j, start:ends[j]][-1] += reward_clip[j]
    return rewards


def test_compute_rewards_places_score_on_last_action_and_zeroes_after():
    P, T = 3, 8                                            # actions 0..6, answer actions from start=2
    prompts = torch.zeros(3, P, dtype=torch.long)
    lp, ref = torch.full((3, T - 1), -1.0), torch.full((3, T - 1), -1.5)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0],           # left pad, answer ended (EOS at action 4)
                         [1, 1, 1, 1, 1, 1, 1],           # truncated answer: last action 6
                         [1, 1, 1, 0, 0, 0, 0]])          # 2 answer actions
    score = torch.tensor([2.0, -9.0, 0.5])
    r = M.compute_rewards(prompts, lp, ref, score, mask, kl_ctl=0.1, clip_reward_value=5.0)
    assert r.shape == (3, T - 1)
    kl = -0.1 * 0.5
    assert r[0, 4].item() == pytest.approx(kl + 2.0)
    assert r[1, 6].item() == pytest.approx(kl - 5.0)      # clipped
    assert r[2, 3 - 1].item() == pytest.approx(kl + 0.5)
    assert (r[0, 5:] == 0).all() and (r[2, 3:] == 0).all()
    assert r[0, 2].item() == pytest.approx(kl)
    # DSC puts the score one slot later for answers that ended (PR #672), the same for truncated ones.
    d = dsc_compute_rewards(prompts, lp.clone(), ref, score, mask, 0.1, 5.0)
    assert d[0, 5].item() == pytest.approx(kl + 2.0) and d[1, 6].item() == pytest.approx(kl - 5.0)


def test_compute_rewards_equal_logprobs_give_zero_kl():
    prompts = torch.zeros(2, 2, dtype=torch.long)
    lp = torch.randn(2, 5)
    mask = torch.ones(2, 5, dtype=torch.long)
    r = M.compute_rewards(prompts, lp, lp.clone(), torch.tensor([1.0, 3.0]), mask)
    assert r[:, :4].abs().max().item() == 0
    assert r[:, 4].tolist() == [1.0, 3.0]


# ----------------------------------------------------------------------------- GAE
def gae_vectorized(values, rewards, start, gamma, lam):
    """A_t = Σ_k (γλ)^k δ_{t+k}, as one matrix product."""
    v = values[:, start:]
    nxt = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)
    delta = rewards[:, start:] + gamma * nxt - v
    n = delta.size(1)
    i = torch.arange(n)
    w = torch.where(i[None, :] >= i[:, None], (gamma * lam) ** (i[None, :] - i[:, None]).double(), torch.zeros(1).double())
    adv = delta.double() @ w.t()
    return adv.float(), (adv.float() + v)


@pytest.mark.parametrize("gamma,lam,start", [(1.0, 0.95, 3), (0.9, 0.95, 0), (0.99, 0.5, 5)])
def test_gae_loop_matches_vectorized(gamma, lam, start):
    torch.manual_seed(1)
    values, rewards = torch.randn(4, 12), torch.randn(4, 12)
    adv, ret = M.get_advantages_and_returns(values, rewards, start, gamma, lam)
    adv2, ret2 = gae_vectorized(values, rewards, start, gamma, lam)
    assert adv.shape == (4, 12 - start)
    assert torch.allclose(adv, adv2, atol=1e-5) and torch.allclose(ret, ret2, atol=1e-5)


def test_gae_lambda_zero_is_td_error_and_lambda_one_is_monte_carlo():
    torch.manual_seed(2)
    values, rewards = torch.randn(2, 6), torch.randn(2, 6)
    adv, _ = M.get_advantages_and_returns(values, rewards, 1, gamma=1.0, lam=0.0)
    nxt = torch.cat([values[:, 2:], torch.zeros(2, 1)], 1)
    assert torch.allclose(adv, rewards[:, 1:] + nxt - values[:, 1:], atol=1e-6)
    _, ret = M.get_advantages_and_returns(values, rewards, 1, gamma=1.0, lam=1.0)
    mc = rewards[:, 1:].flip(1).cumsum(1).flip(1)
    assert torch.allclose(ret, mc, atol=1e-5)


def test_padding_after_answer_changes_nothing():
    """Zero rewards and zero values after the answer (what train_rlhf feeds GAE) leave the answer's
    advantages exactly as if the sequence ended there."""
    torch.manual_seed(3)
    v, r = torch.randn(1, 5), torch.randn(1, 5)
    adv, _ = M.get_advantages_and_returns(v, r, 1)
    adv_pad, _ = M.get_advantages_and_returns(torch.cat([v, torch.zeros(1, 3)], 1), torch.cat([r, torch.zeros(1, 3)], 1), 1)
    assert torch.allclose(adv, adv_pad[:, :4], atol=1e-6)


# ----------------------------------------------------------------------------- losses
def test_actor_loss_ratio_one_and_clipping_by_hand():
    a = torch.tensor([[2.0, -1.0, 0.5]])
    m = torch.tensor([[1.0, 1.0, 1.0]])
    assert M.actor_loss_fn(torch.zeros(1, 3), torch.zeros(1, 3), a, m).item() == pytest.approx(-0.5)
    # log-ratio 0.3 -> ratio 1.3499; A>0 clipped at 1.2, A<0 unclipped (max picks -A·ratio)
    lp = torch.full((1, 3), 0.3)
    want = (-2.0 * 1.2 + 1.0 * math.exp(0.3) - 0.5 * 1.2) / 3
    assert M.actor_loss_fn(lp, torch.zeros(1, 3), a, m).item() == pytest.approx(want, abs=1e-5)


def test_losses_ignore_masked_positions():
    torch.manual_seed(4)
    lp, old, adv = torch.randn(2, 6), torch.randn(2, 6), torch.randn(2, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]).float()
    lp2 = lp.clone(); lp2[mask == 0] = 99.0
    assert M.actor_loss_fn(lp, old, adv, mask).item() == pytest.approx(M.actor_loss_fn(lp2, old, adv, mask).item())
    ret = torch.randn(2, 6)
    v2 = lp.clone(); v2[mask == 0] = -50.0
    assert M.critic_loss_fn(lp, old, ret, mask).item() == pytest.approx(M.critic_loss_fn(v2, old, ret, mask).item())


def test_critic_loss_by_hand():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.1]]), torch.tensor([[2.0, 0.0]])
    # pos 0: clip(1.0)=0.7 -> max(1, 1.69) = 1.69; pos 1: clip(0)=0 within [-0.1, 0.3] -> 0
    assert M.critic_loss_fn(v, old, ret, torch.ones(1, 2)).item() == pytest.approx(0.5 * 1.69 / 2)


# ----------------------------------------------------------------------------- reward model
def dsc_reward_loss(chosen_ids, rejected_ids, c_rew, r_rew, pad, npb):
    """DSC RewardModel.forward's loop, re-implemented from its description."""
    bs, L = chosen_ids.shape
    loss, cs, rs = 0.0, [], []
    for i in range(bs):
        ci = (chosen_ids[i] == pad).nonzero()
        c_ind = ci[npb].item() if len(ci) > npb else L
        div = (chosen_ids[i] != rejected_ids[i]).nonzero()
        if len(div) == 0:
            end, d, r_ind = L, L - 1, c_ind
        else:
            ri = (rejected_ids[i] == pad).nonzero()
            r_ind = ri[npb].item() if len(ri) > npb else L
            end, d = max(c_ind, r_ind), div[0].item()
        loss += -F.logsigmoid(c_rew[i, d:end] - r_rew[i, d:end]).mean()
        cs.append(c_rew[i, c_ind - 1]); rs.append(r_rew[i, r_ind - 1])
    return loss / bs, torch.stack(cs), torch.stack(rs)


@pytest.mark.parametrize("npb", [0, 1])
def test_reward_pairwise_loss_matches_dsc(npb):
    torch.manual_seed(5)
    c = torch.tensor([[2, 5, 6, 7, 8, 1, 0, 0], [2, 5, 6, 9, 1, 0, 0, 0], [2, 5, 6, 1, 0, 0, 0, 0]])
    r = torch.tensor([[2, 5, 6, 3, 1, 0, 0, 0], [2, 5, 6, 9, 9, 9, 9, 1], [2, 5, 6, 1, 0, 0, 0, 0]])
    if npb:                      # OPT-style: a BOS with the pad id at position 0
        c[:, 0] = 0; r[:, 0] = 0
    cr, rr = torch.randn(3, 8), torch.randn(3, 8)
    ours = M.reward_pairwise_loss(c, r, cr, rr, 0, npb)
    theirs = dsc_reward_loss(c, r, cr, rr, 0, npb)
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-6)


def test_identical_pair_costs_log2():
    c = torch.tensor([[3, 4, 5, 0]])
    cr = torch.full((1, 4), 0.7)
    loss, _, _ = M.reward_pairwise_loss(c, c.clone(), cr, cr.clone(), 0)
    assert loss.item() == pytest.approx(math.log(2))


class _Backbone(torch.nn.Module):
    """A stand-in backbone: hidden state = one-hot-ish embedding, so values are predictable."""
    def __init__(self, vocab=16, hidden=4):
        super().__init__()
        self.config = type("C", (), {"hidden_size": hidden})()
        self.emb = torch.nn.Embedding(vocab, hidden)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return (self.emb(input_ids),)


def test_forward_value_end_score_is_last_real_token_after_prompt():
    tok = type("T", (), {"pad_token_id": 0})()
    rm = M.RewardModel(_Backbone(), tok)
    ids = torch.tensor([[0, 3, 4, 5, 6, 1, 0, 0],    # left-padded prompt (P=3), answer 5 6 </s>
                        [3, 3, 4, 7, 0, 0, 0, 0],    # answer of 1 token
                        [0, 0, 4, 0, 0, 0, 0, 0]])   # empty answer: last prompt token
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]])
    out = rm.forward_value(ids, mask, prompt_length=3)
    v = out["values"]
    assert v.shape == (3, 8)
    assert out["chosen_end_scores"].tolist() == pytest.approx([v[0, 5].item(), v[1, 3].item(), v[2, 2].item()])
    assert torch.equal(rm.forward_value(ids, mask, return_value_only=True), v)


# ----------------------------------------------------------------------------- LoRA
def _tiny_lm():
    tok = M.train_default_tokenizer(["Human: What is 1 + 2? Assistant: 3"] * 20, vocab_size=300)
    from transformers import AutoModelForCausalLM
    return tok, M.create_hf_model(AutoModelForCausalLM, M.TINY, tok)


def test_lora_starts_at_zero_trains_and_fuses_exactly():
    torch.manual_seed(6)
    tok, model = _tiny_lm()
    x = torch.randint(3, len(tok), (2, 9))
    base = model(x).logits.detach()
    M.convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=4)
    lora = [m for m in model.modules() if isinstance(m, M.LinearLayer_LoRA)]
    assert len(lora) == 3 * 6                                    # q k v out fc1 fc2 per layer
    assert lora[0].lora_scaling == pytest.approx(1 / 4)
    assert torch.allclose(model(x).logits, base, atol=1e-6)
    M.only_optimize_lora_parameters(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        loss = model(x, labels=x).loss
        loss.backward(); opt.step(); opt.zero_grad()
    trained = model(x).logits.detach()
    assert (trained - base).abs().max() > 1e-4
    M.convert_lora_to_linear_layer(model)
    assert not any(isinstance(m, M.LinearLayer_LoRA) for m in model.modules())
    assert torch.allclose(model(x).logits, trained, atol=1e-4)


# ----------------------------------------------------------------------------- data
def test_collators_and_minidataset():
    c = M.DataCollatorRLHF(max_token_len=6)
    b = c([(torch.tensor([3, 2, 1]).flip(0), torch.ones(3, dtype=torch.long), 0),
           (torch.tensor([9]).flip(0), torch.ones(1, dtype=torch.long), 0)])
    assert b["prompt"].tolist() == [[0, 0, 0, 3, 2, 1], [0, 0, 0, 0, 0, 9]]
    assert b["prompt_att_mask"].sum(1).tolist() == [3, 1]
    ids = [torch.tensor([1, 2]), torch.tensor([3, 4])]
    r = M.DataCollatorReward()([(ids[0], torch.ones(2), torch.tensor([5, 6]), torch.ones(2)),
                                (ids[1], torch.ones(2), torch.tensor([7, 8]), torch.ones(2))])
    assert r["input_ids"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    m = M.MiniDataset(1, 4)
    assert [len(x[0]) for x in m.add([torch.arange(9), torch.arange(9)])] == [4, 4, 1]


def test_experience_mask_keeps_eos_and_drops_what_follows():
    seq = torch.tensor([[0, 5, 7, 1, 0, 0], [5, 5, 7, 8, 9, 4]])
    m = M.experience_attention_mask(seq, torch.tensor([[0, 1], [1, 1]]), eos_token_id=1)
    assert m.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("drop, kept", [(False, [0, 1, 2]), (True, [1, 2])])
def test_bare_eos_answer_is_kept_and_scored_unless_dsc_drop(monkeypatch, drop, kept):
    from types import SimpleNamespace as NS
    # P = 2, eos = 1, pad = 0.  Row 0 answers with a bare EOS, row 1 with one token + EOS, row 2 with 3 tokens.
    seq = torch.tensor([[3, 4, 1, 0, 0], [3, 4, 7, 1, 0], [3, 4, 7, 8, 9]])
    monkeypatch.setattr(M, "sample_answers", lambda *a, **k: seq)
    trainer = NS(actor_model=NS(module=None), tokenizer=NS(eos_token_id=1, pad_token_id=0), max_answer_seq_len=3,
                 temperature=1.0, args=NS(drop_short_answers=drop, print_answers=False))
    out_seq, out_mask = M.DeepSpeedPPOTrainer._generate_sequence(trainer, torch.ones(3, 2, dtype=torch.long),
                                                                 torch.ones(3, 2, dtype=torch.long), 0)
    assert out_seq.tolist() == seq[kept].tolist()
    assert out_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]][kept[0]:]
    assert trainer.last_dropped == 3 - len(kept)
    # the bare EOS is one action (index start = P - 1 = 1), and the score lands on it
    r = M.compute_rewards(out_seq[:, :2], torch.zeros(len(kept), 4), torch.zeros(len(kept), 4),
                          torch.full((len(kept),), 2.0), out_mask[:, 1:])
    assert r[0].tolist() == ([0.0, 2.0, 0.0, 0.0] if not drop else [0.0, 0.0, 2.0, 0.0])


def test_split_is_disjoint_and_complete():
    parts = M.get_raw_dataset_split_index("2,4,4", 103, seed=7)
    flat = sum(parts, [])
    assert sorted(flat) == list(range(103)) and [len(p) for p in parts] == [21, 41, 41]
    assert parts == M.get_raw_dataset_split_index("2,4,4", 103, seed=7)
    assert parts != M.get_raw_dataset_split_index("2,4,4", 103, seed=8)


ROWS = [{"prompt": f"Human: q{i}? Assistant:", "chosen": f" a{i}", "rejected": " no", "extra": i} for i in range(20)]


@pytest.mark.parametrize("ext", ["jsonl", "json", "csv", "parquet"])
def test_local_files_load(tmp_path, ext):
    path = tmp_path / f"prefs.{ext}"
    if ext == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif ext == "json":
        path.write_text(json.dumps(ROWS))
    elif ext == "csv":
        import csv
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
            w.writeheader(); w.writerows(ROWS)
    else:
        import pyarrow as pa, pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    raw = M.get_raw_dataset(str(path), seed=1)
    train, test = raw.get_train_data(), raw.get_eval_data()
    assert len(train) == 18 and len(test) == 2
    s = train[0]
    assert raw.get_prompt_and_chosen(s) == s["prompt"] + s["chosen"]
    assert {raw.get_prompt(x) for x in train} | {raw.get_prompt(x) for x in test} == {r["prompt"] for r in ROWS}


def test_folder_with_train_and_eval_files(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS[:15]))
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS[15:]))
    raw = M.get_raw_dataset(str(tmp_path))
    assert len(raw.get_train_data()) == 15 and len(raw.get_eval_data()) == 5


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "p", "chosen": "c", "rejected": "r"}\n{"prompt": "p", "chosen": "c"}\n', "line 2: field 'rejected' is missing"),
    ('{"prompt": "p", "chosen": "c", "rejected": "r"}\n{"prompt": "p", "chosen": 3, "rejected": "r"}\n', "line 2: field 'chosen'"),
    ('{"prompt": "p", "chosen": "c", "rejected": "r"}\n{"prompt": "p", \n', "line 2: invalid JSON"),
    ('[1, 2]\n'.replace("\n", ""), "expected an object"),
])
def test_malformed_input_names_file_line_and_field(tmp_path, content, needle):
    path = tmp_path / ("bad.json" if content.startswith("[") else "bad.jsonl")
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        M.get_raw_dataset(str(path))
    assert str(path) in str(e.value) and needle in str(e.value)


def test_unknown_data_path_is_a_clear_error():
    with pytest.raises(ValueError, match="not a local file"):
        M.get_raw_dataset("nobody/nothing")


def test_hub_class_goes_through_load_from_disk(tmp_path):
    import datasets
    d = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:10]), "test": datasets.Dataset.from_list(ROWS[10:])})
    path = tmp_path / "Dahoas" / "rm-static"
    d.save_to_disk(str(path))
    raw = M.get_raw_dataset(str(path))
    assert isinstance(raw, M.DahoasRmstaticDataset) and len(raw.get_eval_data()) == 10


def test_phase_formats(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    tok = M.train_default_tokenizer([r["prompt"] + r["chosen"] for r in ROWS], vocab_size=300)
    tr1, _ = M.create_prompt_dataset(-1, [str(path)], "10,0,0", None, 1, 1, tok, 16)
    row = tr1[0]
    assert (row["labels"][row["attention_mask"] == 0] == -100).all()
    assert torch.equal(row["labels"][row["attention_mask"] == 1], row["input_ids"][row["attention_mask"] == 1])
    assert tok.eos_token_id in row["input_ids"].tolist()
    tr2, _ = M.create_prompt_dataset(-1, [str(path)], "0,10,0", None, 2, 1, tok, 16)
    assert len(tr2[0]) == 4 and tr2[0][0].shape == (16,)
    tr3, _ = M.create_prompt_dataset(-1, [str(path)], "0,0,10", None, 3, 1, tok, 16, max_prompt_seq_len=64)
    ids, mask, pad = tr3[0]
    assert pad == tok.pad_token_id and tok.decode(ids.flip(0)).startswith("Human:")
    short, _ = M.create_prompt_dataset(-1, [str(path)], "0,0,10", None, 3, 1, tok, 16, max_prompt_seq_len=2)
    assert len(short) == 0                                   # over-long prompts are dropped
    dsc_style, _ = M.create_prompt_dataset(-1, [str(path)], "0,0,10", None, 3, 1, tok, 2)
    assert len(dsc_style) == 0                               # DSC passes the prompt limit as max_seq_len
    extra = tmp_path / "sft_only.jsonl"
    extra.write_text("\n".join(json.dumps(r) for r in ROWS[:10]))
    with_extra, _ = M.create_prompt_dataset(-1, [str(path)], "10,0,0", None, 1, 1, tok, 16,
                                            sft_only_data_path=[str(extra)])
    assert len(with_extra) == len(tr1) + 9                   # 9:1 split of the 10 extra rows, train part
    mp, _ = M.create_prompt_dataset(-1, [str(path)], "10,0,0", None, 1, 1, tok, 16, mask_prompt=True)
    for row in mp.rows:
        ids = row["input_ids"][row["labels"] != -100].tolist()
        assert tok.decode(ids).strip().startswith("a") and ids[-1] == tok.eos_token_id   # " a{i}</s>" only


def test_gold_score_on_shipped_data():
    rows = [json.loads(l) for l, _ in zip(open(SHIPPED), range(400))]
    assert all(M.gold_score(r["prompt"], r["chosen"]) == 1.0 for r in rows)
    assert all(M.gold_score(r["prompt"], r["rejected"]) == 0.0 for r in rows)
    assert {r["family"] for r in rows} == {"more", "less", "sum", "lookup"}
    assert M.gold_score("Human: Ann has 7. Bob has 50. Say a number larger than Bob's. Assistant:", " 51") == 1.0
    assert M.gold_score("Human: Ann has 7. Bob has 50. Say a number larger than Bob's. Assistant:", " 8") == 0.0
    assert M.gold_score("Human: Give a number lower than 3 + 4. Assistant:", " 7") == 0.0
    p = "Human: Write a number bigger than 998. Assistant:"
    assert [M.gold_score(p, a) for a in (" 999", " 1000", " 0999", " 999 ")] == [1.0, 0.0, 0.0, 1.0]
    assert math.isnan(M.gold_score("Human: something else Assistant:", " x"))


def test_shipped_prompts_are_unique():
    prompts = [json.loads(l)["prompt"] for l in open(SHIPPED)]
    assert len(prompts) == len(set(prompts)) >= 10000


# ----------------------------------------------------------------------------- PPO step
def test_train_rlhf_first_step_has_ratio_one_and_moves_toward_advantage():
    """With old log-probs from the same weights, the first PPO step has ratio 1 (no clipping), and
    repeating it raises the log-prob of the rewarded answer."""
    torch.manual_seed(8)
    tok, actor = _tiny_lm()
    args = M.parse_args(["--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3"])
    critic = M.RewardModel(actor.model.__class__(actor.config), tok)
    eng = type("E", (), {})()
    eng.actor = M.make_engine(actor, args, 1e-3, 0.0, 5e-4, 100)
    eng.critic = M.make_engine(critic, args, 1e-3, 0.0, 5e-4, 100)
    eng.ref, eng.reward, eng.tokenizer = M.freeze(copy.deepcopy(actor)), M.freeze(copy.deepcopy(critic)), tok
    trainer = M.DeepSpeedPPOTrainer(eng, args)
    P = 4
    seq = torch.randint(3, len(tok), (4, P + 3))
    seq[:, -1] = tok.eos_token_id
    mask = torch.ones_like(seq)
    with torch.no_grad():
        lp = M.gather_log_probs(actor(seq).logits[:, :-1], seq[:, 1:])
        values = critic.forward_value(seq, mask, return_value_only=True)[:, :-1]
    exp = {"prompts": seq[:, :P], "logprobs": lp, "ref_logprobs": lp.clone(), "value": values,
           "rewards": torch.full((4,), 3.0), "input_ids": seq, "attention_mask": mask}
    trainer.train_rlhf(exp)
    assert trainer.last_stats["policy/clipfrac"] == 0.0 and trainer.last_stats["policy/approxkl"] == 0.0
    for _ in range(5):
        trainer.train_rlhf(exp)
    with torch.no_grad():
        new = M.gather_log_probs(actor(seq).logits[:, :-1], seq[:, 1:])
    assert (new[:, P - 1:].sum() - lp[:, P - 1:].sum()).item() > 0.5


# ----------------------------------------------------------------------------- end to end
def _micro_args(tmp_path, data, *extra):
    return ["--data_path", str(data), "--output_dir", str(tmp_path / "out"), "--max_steps", "3",
            "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16",
            "--per_device_generation_batch_size", "8", "--per_device_training_batch_size", "4",
            "--gold_eval_prompts", "8", "--eval_iters", "2", "--seed", "3", *extra]


@pytest.fixture(scope="module")
def micro_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    with open(SHIPPED) as f:
        path.write_text("".join(l for l, _ in zip(f, range(600))))
    return path


def test_micro_end_to_end_and_reload_by_path(tmp_path, micro_data):
    s = M.main(_micro_args(tmp_path, micro_data, "--phase", "all"))
    out = tmp_path / "out"
    for phase, keys in ((1, ["perplexity_before", "perplexity_after"]), (2, ["acc_before", "acc_after"]),
                        (3, ["reward_first", "reward_last", "kl_last", "gold_before", "gold_after"])):
        summary = json.loads((out / f"phase{phase}" / "summary.json").read_text())
        assert all(k in summary for k in keys), summary
        assert summary == json.loads(json.dumps(s[phase]))
        assert (out / f"phase{phase}" / "metrics.jsonl").read_text().strip()
    assert s[1]["perplexity_after"] < s[1]["perplexity_before"]
    assert s[3]["steps"] == 3 and math.isfinite(s[3]["kl_last"])
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    for d in ("phase1", "phase3/actor"):
        AutoModelForCausalLM.from_pretrained(out / d)
        tok = AutoTokenizer.from_pretrained(out / d)
        assert tok.pad_token_id != tok.eos_token_id
    for d in ("phase2", "phase3/critic"):
        AutoModel.from_pretrained(out / d)
        rm = M.create_critic_model(str(out / d), M.load_hf_tokenizer(str(out / d)), rlhf_training=True)
        assert rm.v_head.weight.abs().sum() > 0
    assert not [p for p in os.listdir(out) if p.startswith(".")]          # no staging dirs left
    # rerunning a phase replaces its output atomically, and phase 3 finds phase 2's by default
    text = tmp_path / "ptx.txt"
    text.write_text("Human: hello Assistant: hi\n" * 200)
    s3 = M.main(_micro_args(tmp_path, micro_data, "--phase", "3", "--max_steps", "2", "--enable_ema",
                            "--unsupervised_dataset_name", str(text), "--unsup_coef", "0.5"))[3]
    assert s3["steps"] == 2 and json.loads((out / "phase3" / "summary.json").read_text())["steps"] == 2
    rows = [json.loads(l) for l in (out / "phase3" / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/unsup" in r for r in rows)
    AutoModelForCausalLM.from_pretrained(out / "phase3" / "actor_ema")
    # buffered experience, several PPO epochs on smaller micro-batches, LoRA on actor and critic
    s3 = M.main(_micro_args(tmp_path, micro_data, "--phase", "3", "--max_steps", "6", "--generation_batches", "2",
                            "--ppo_epochs", "2", "--actor_lora_dim", "2", "--critic_lora_dim", "2",
                            "--only_optimize_lora", "--print_answers"))[3]
    assert s3["steps"] == 6 and s3["ppo_iterations"] == 1     # 2 batches x 2 micro x 2 epochs, capped at 6
    rows = [json.loads(l) for l in (out / "phase3" / "metrics.jsonl").read_text().splitlines()]
    assert "policy/clipfrac" in rows[1] and rows[1]["policy/approxkl"] > 0    # later micro-steps are off-policy
    actor = AutoModelForCausalLM.from_pretrained(out / "phase3" / "actor")
    assert not any("lora" in n for n, _ in actor.named_parameters())


def test_model_name_or_path_loads_a_saved_model(tmp_path, micro_data):
    tok, model = _tiny_lm()
    src = tmp_path / "my_model"
    model.save_pretrained(src); tok.save_pretrained(src)
    s = M.main(_micro_args(tmp_path, micro_data, "--phase", "1", "--model_name_or_path", str(src),
                           "--lora_dim", "2", "--only_optimize_lora"))
    assert s[1]["steps"] == 3
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "phase1")
    assert loaded.config.vocab_size == model.config.vocab_size


def test_missing_previous_phase_is_a_clear_error(tmp_path, micro_data):
    with pytest.raises(FileNotFoundError, match="run the previous phase first"):
        M.main(_micro_args(tmp_path, micro_data, "--phase", "3"))
