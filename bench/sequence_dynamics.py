"""Learning dynamics of the ``sequence`` task without the pipeline: on-policy GRPO in one process.

What ``ferryman train`` does per step, stripped to the arithmetic that decides whether the
reward rises: sample ``--tasks`` prompts of the core ``sequence`` env, ``--n`` answers each from
the current policy (plain torch sampling with a KV cache, at ``--temperature``), score them with
the env's own ``score_sequence``, GRPO advantages and the clipped PPO loss from
``ferryman.algorithms`` (token-mean, the entropy bonus as the FSDP trainer adds it), one AdamW
step (linear warmup, gradient clip 1.0, the trainer's defaults). It leaves out what the pipeline
adds on top: staleness (samples up to one version old), several engine replicas, the weight
sync. So it is a fast way (under a minute per hundred steps on a CPU for the tiny shape, 256
answers a step) to compare learning rates, entropy bonuses, group sizes and task variants, and
(``--preset``) to measure how far one step moves a real shape's policy, before a GPU run
(``bench/results/sequence_cpu.md``). What it finds is a claim about the arithmetic; the
pipeline's run on the GPU is what tests it.

    python bench/sequence_dynamics.py --steps 300 --lr 1e-3 --entropy 0.01 --out /tmp/dyn.jsonl

Printed every ``--log-every`` steps and written per step (``--out``): ``reward`` (mean),
``first`` (share of answers whose first digit is the target's), ``exact``, ``entropy`` (mean
per generated token), ``agnostic`` (share of steps' prompts whose most common first digit is
the same one: 1.0 means every prompt gets the same answer, the collapse), ``kl`` (mean
``log p_old - log p_new`` over the batch's tokens after the step: how far one update moves the
policy), ``length`` (mean answer tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from ferryman.algorithms import agg_loss, compute_grpo_advantages, entropy_from_logits, ppo_policy_loss
from ferryman.envs.sequence import common_prefix, make_prompt, make_target, score_sequence
from ferryman.tiny import build_tiny_model


def _load(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw: dict = dict(seed=args.seed, init_std=args.init_std)
    if args.preset:
        kw.update(preset=args.preset)
        if args.layers:
            kw.update(num_layers=args.layers)
    else:
        kw.update(hidden_size=args.hidden, num_layers=args.layers or 2)
        if args.heads:
            kw.update(num_heads=args.heads, num_kv_heads=max(1, args.heads // 2))
    path = build_tiny_model(args.model_dir, **kw)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return tok, model


@torch.no_grad()
def sample(model, prompt: torch.Tensor, max_tokens: int, temperature: float, eos: int, gen: torch.Generator):
    """``[B, P]`` prompts (all the same length) → ``[B, max_tokens]`` tokens and a ``[B, max_tokens]``
    mask (1 up to and including the first EOS)."""
    B = prompt.shape[0]
    out = model(prompt, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    toks = torch.full((B, max_tokens), eos, dtype=torch.long)
    mask = torch.zeros(B, max_tokens)
    alive = torch.ones(B, dtype=torch.bool)
    for t in range(max_tokens):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, eos))
        toks[:, t] = nxt
        mask[:, t] = alive.float()
        alive = alive & (nxt != eos)
        if not alive.any():
            break
        out = model(nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    return toks, mask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="a ferryman.tiny shape preset (e.g. qwen2.5-0.5b)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--model-dir", default="/tmp/ferryman-dyn/model")
    ap.add_argument("--pattern", default="repeat", choices=["repeat", "count", "copy"])
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--digit-credit", type=float, default=0.1)
    ap.add_argument("--score", choices=["positions", "prefix"], default="positions",
                    help="positions: the env's score_sequence; prefix: the share of the target matched from the start")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: length + 8")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--num-tasks", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--entropy", type=float, default=0.0)
    ap.add_argument("--clip-low", type=float, default=0.2)
    ap.add_argument("--clip-high", type=float, default=0.28)
    ap.add_argument("--no-std", action="store_true", help="advantages not divided by the group's std (Dr. GRPO)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--kl-every", type=int, default=1, help="measure kl (one more forward pass) every this many steps; 0: never")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    max_tokens = args.max_tokens or args.length + 8
    tok, model = _load(args)
    eos = int(tok.eos_token_id)
    rng = random.Random(args.seed)
    tasks = []
    for _ in range(args.num_tasks):
        start = rng.randrange(10)
        digits = "".join(str(rng.randrange(10)) for _ in range(args.length)) if args.pattern == "copy" else ""
        ids = tok.apply_chat_template([{"role": "user", "content": make_prompt(args.pattern, start, args.length, digits)}], add_generation_prompt=True, tokenize=True, return_dict=False)
        tasks.append((list(ids), make_target(args.pattern, start, args.length, digits), start))
    if len({len(t[0]) for t in tasks}) != 1:
        raise SystemExit("sequence_dynamics: the prompts differ in length; this harness batches equal lengths only")
    P = len(tasks[0][0])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 if args.warmup <= 0 else min(1.0, (s + 1) / args.warmup))
    gen = torch.Generator().manual_seed(args.seed)
    out = open(args.out, "w") if args.out else None
    t0 = time.time()
    window: list[dict] = []
    for step in range(1, args.steps + 1):
        chosen = [tasks[rng.randrange(len(tasks))] for _ in range(args.tasks)]
        prompt = torch.tensor([c[0] for c in chosen for _ in range(args.n)])
        model.eval()
        toks, gmask = sample(model, prompt, max_tokens, args.temperature, eos, gen)
        texts = [tok.decode([i for i, m in zip(row.tolist(), mrow.tolist()) if m], skip_special_tokens=True) for row, mrow in zip(toks, gmask)]
        targets = [c[1] for c in chosen for _ in range(args.n)]
        if args.score == "prefix":
            scores = torch.tensor([common_prefix(x.strip(), y) / len(y) for x, y in zip(texts, targets)])
        else:
            scores = torch.tensor([score_sequence(x, y, args.digit_credit) for x, y in zip(texts, targets)])
        first = [x.strip()[:1] == y[:1] for x, y in zip(texts, targets)]
        exact = [x.strip() == y for x, y in zip(texts, targets)]
        firsts = [Counter(x.strip()[:1] for x in texts[i * args.n:(i + 1) * args.n]).most_common(1)[0][0] for i in range(args.tasks)]
        agnostic = Counter(firsts).most_common(1)[0][1] / args.tasks
        # the trainer's view: prompt + answer, mask on the generated tokens
        ids = torch.cat([prompt, toks], dim=1)
        mask = torch.cat([torch.zeros(prompt.shape), gmask], dim=1)
        group = torch.arange(args.tasks).repeat_interleave(args.n)
        adv = compute_grpo_advantages(scores, group, mask, norm_by_std=not args.no_std)
        model.train()
        logits = model(ids).logits[:, :-1].float() / args.temperature
        lp_all = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp = torch.cat([torch.zeros(ids.shape[0], 1), lp_all], dim=1)
        ent = torch.cat([torch.zeros(ids.shape[0], 1), entropy_from_logits(logits)], dim=1)
        pg, _ = ppo_policy_loss(lp, lp.detach(), adv, mask, clip_low=args.clip_low, clip_high=args.clip_high, agg="token-mean")
        ent_loss = agg_loss(ent, mask, "token-mean")
        loss = pg - args.entropy * ent_loss if args.entropy else pg
        optim.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optim.step()
        sched.step()
        kl = float("nan")
        if args.kl_every and step % args.kl_every == 0:
            with torch.no_grad():
                model.eval()
                new = torch.log_softmax(model(ids).logits[:, :-1].float() / args.temperature, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                kl = float(((lp_all.detach() - new) * mask[:, 1:]).sum() / mask[:, 1:].sum())
        row = {
            "step": step, "reward": float(scores.mean()), "first": sum(first) / len(first), "exact": sum(exact) / len(exact),
            "entropy": float(ent_loss.detach()), "agnostic": agnostic, "kl": kl, "length": float(gmask.sum(1).mean()),
            "grad_norm": gnorm, "time": round(time.time() - t0, 2),
        }
        if not math.isfinite(row["reward"]):  # (kl is nan on the steps it is not measured)
            raise SystemExit(f"step {step}: non-finite reward")
        window.append(row)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        if step % args.log_every == 0 or step == args.steps:
            avg = {k: sum(r[k] for r in window) / len(window) for k in ("reward", "first", "exact", "entropy", "agnostic", "length")}
            kls = [r["kl"] for r in window if r["kl"] == r["kl"]]
            avg["kl"] = sum(kls) / len(kls) if kls else float("nan")
            print(f"steps {step - len(window) + 1:4d}-{step:4d} " + " ".join(f"{k} {v:.4g}" for k, v in avg.items()) + f"  t {row['time']:.0f}s", flush=True)
            window = []
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
