#!/usr/bin/env python
"""How often the target keeps a sampled draft token, by how the draft picks it (teacher-forced, no timing).

On the target's own samples (``--temperature``, seeded AR through our engine), both models score every position
once; with p the target's and q the draft's next-token distributions after the sampling filters:

  argmax     p(argmax q): the draft proposes its most likely token (the CPU policy's chains before coupling)
  coupled    P(argmax(log q + g) = argmax(log p + g)) over the walk's own Gumbel noise g
             (``sampling.gumbels`` for seeds 0..K-1): the coupled draw the CPU policy's chains and sampled
             trees propose now (``sampling.coupled_choice``)
  chain rule sum_v min(p, q): speculative sampling's acceptance of x ~ q (Leviathan et al. 2023)

It also bins the coupled token's score (``sampling.coupled_logprobs``, what the chains' stop and the trees' best-
first order use) against how often the target kept it: a calibrated score predicts acceptance.

    python scripts/bench_coupling.py --out docs/bench_coupling.json

``--smoke`` (tiny models via --target/--draft) checks the logic; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

BINS = 5


def _logits(model: Any, ids: list[int], first: int) -> Any:
    """Next-token logits (len(ids) - first, V) fp32 at positions ``first``... of ``ids`` (one causal pass, a fresh
    cache)."""
    import torch

    dev = model.device
    n = len(ids)
    pos = torch.arange(n, device=dev)
    mask = pos[None, :] <= pos[:, None]
    cache = model.new_cache(n)
    with torch.no_grad():
        return model.forward(torch.tensor(ids, device=dev), pos, pos, mask, cache, logits_rows=slice(first, None))


def measure(
    engine: Any, prompts: dict[str, list[tuple[str, bool]]], new: int, temperature: float, draws: int
) -> dict[str, Any]:
    import numpy as np
    import torch

    from specexec.config import SamplingConfig
    from specexec.decoding import sampling

    samp = SamplingConfig(temperature=temperature)
    out: dict[str, Any] = {}
    for set_name, texts in prompts.items():
        acc = {"argmax": 0.0, "coupled": 0.0, "chain_rule": 0.0}
        bins = [[0, 0] for _ in range(BINS)]  # per score bin: [positions, kept]
        positions = 0
        for k, (text, chat) in enumerate(texts):
            ids = engine.encode(text, chat=chat)
            engine.reset()
            r = engine.generate(ids, new, method="ar", sampling_cfg=SamplingConfig(temperature=temperature, seed=k))
            seq = ids + r.tokens
            lo = len(ids) - 1  # the row predicting the first new token
            lt = _logits(engine.target, seq[:-1], lo)
            ld = _logits(engine.draft, seq[:-1], lo)
            V = min(lt.shape[-1], ld.shape[-1])
            lp, lq = sampling.logprobs(lt[:, :V], samp), sampling.logprobs(ld[:, :V], samp)
            p, q = lp.exp(), lq.exp()
            acc["argmax"] += float(p.gather(-1, q.argmax(-1, keepdim=True)).sum())
            acc["chain_rule"] += float(torch.minimum(p, q).sum())
            pos = torch.arange(len(ids), len(ids) + lp.shape[0])  # output positions of the new tokens
            for seed in range(draws):
                rows, index = sampling.noise_at(seed, pos, V)
                want = sampling.gumbel_max(lp, rows, index)
                score = sampling.coupled_logprobs(lq, seed, pos)
                mine = score.argmax(-1)
                kept = (mine == want).cpu().numpy()
                acc["coupled"] += float(kept.sum()) / draws
                conf = score.gather(-1, mine[:, None]).squeeze(-1).exp().cpu().numpy()
                for b, hit in zip(np.minimum((conf * BINS).astype(int), BINS - 1), kept):
                    bins[b][0] += 1
                    bins[b][1] += int(hit)
            positions += lp.shape[0]
        out[set_name] = {
            "positions": positions,
            **{k: v / max(positions, 1) for k, v in acc.items()},
            "coupled_score_bins": [
                {"score": f"[{i / BINS:.1f}, {(i + 1) / BINS:.1f})", "tokens": n, "kept": h / n if n else None}
                for i, (n, h) in enumerate(bins)
            ],
        }
    return out


def prompts_for(sets: list[str], n: int, smoke: bool) -> dict[str, list[tuple[str, bool]]]:
    """(text, chat) per set: bench_cpu's prompts (grounded ones go through the chat template)."""
    if smoke:
        return {s: [("t5 t6 t7", False)] * n for s in sets}
    from scripts.bench_cpu import build_prompts

    built = build_prompts(tuple(sets), n)
    return {s: [(p.text, p.chat) for p in built[s]] for s in sets}


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [
        f"Teacher-forced on the target's own samples: {m['target']} + {m['draft']}, temperature "
        f"{m['temperature']}, {m['prompts_per_set']} prompts per set x {m['new_tokens']} tokens, "
        f"{m['noise_draws']} noise draws per position; dtypes: target {m['target_dtype']}, draft {m['draft_dtype']}.",
        "",
        "| set | positions | argmax kept | coupled kept | chain rule (sum min(p, q)) |",
        "|---|---|---|---|---|",
    ]
    for s, d in report["sets"].items():
        lines.append(f"| {s} | {d['positions']} | {d['argmax']:.3f} | {d['coupled']:.3f} | {d['chain_rule']:.3f} |")
    lines += ["", "Coupled score (exp of `coupled_logprobs` at the coupled token) against how often it was kept:", ""]
    for s, d in report["sets"].items():
        cells = ", ".join(
            f"{b['score']}: {b['kept']:.2f} ({b['tokens']})" for b in d["coupled_score_bins"] if b["tokens"]
        )
        lines.append(f"- {s}: {cells}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--sets", default="prose,code", help="from code, prose, grounded")
    p.add_argument("--prompts-per-set", type=int, default=None, help="default 4 (1 with --smoke)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (8 with --smoke)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--noise-draws", type=int, default=16)
    p.add_argument("--dtype", default="auto", help="our engine's dtype (auto: what generate uses)")
    p.add_argument("--out", type=Path)
    p.add_argument("--smoke", action="store_true", help="logic check on tiny models (give --target/--draft)")
    args = p.parse_args(argv)
    if args.temperature <= 0:
        p.error("--temperature must be > 0 (greedy has nothing to couple)")
    n = args.prompts_per_set or (1 if args.smoke else 4)
    new = args.new_tokens or (8 if args.smoke else 64)
    draws = 2 if args.smoke else args.noise_draws
    from specexec import api

    engine = api.load(args.target, args.draft, device="cpu", dtype=args.dtype, progress=False)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    report = {
        "meta": {
            "target": args.target,
            "draft": args.draft,
            "temperature": args.temperature,
            "prompts_per_set": n,
            "new_tokens": new,
            "noise_draws": draws,
            "target_dtype": str(engine.target.dtype).removeprefix("torch."),
            "draft_dtype": str(engine.draft.dtype).removeprefix("torch.") if engine.draft is not None else None,
            "command": "python scripts/bench_coupling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "sets": measure(engine, prompts_for(sets, n, args.smoke), new, args.temperature, draws),
    }
    print(markdown(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
