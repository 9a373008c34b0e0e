#!/usr/bin/env python
"""Calibrated tree scores against the draft's raw probabilities, on the real pair (counts; no timings).

``TreeConfig.calibrate`` (``--calibrate``, the default) scores a greedy step's tree nodes by exponents fitted online to
what verification shows (specexec/propose/calibrate.py). Whether that pays is a question of acceptance, which does
not depend on the device, so it is counted here on the demo pair (CPU, fp32, the draft with its full vocabulary as
on a GPU):

1. **Reliability** along the target's own greedy text: at each position the draft's top choices and whether the
   target's token was the first / another one, binned by the draft's probability (is the draft under- or
   over-confident, and where?). One draft pass over each prompt + its AR continuation.
2. **Tokens per step**, per budget, uncalibrated then calibrated, on the same prompts at a fixed budget with the
   early stop off (tree sizes then do not depend on timings). The calibrated runs start from exponents learnt on
   ``--warm-prompts`` other prompts (a chat's earlier turns) and keep learning, as one engine does across
   generations. Every run must equal the target's AR text (exit 1 otherwise).

Prompts are the stdlib code / pydoc prose chunks of ``scripts/bench_acceptance.py``.

    flock /tmp/realpair.lock python scripts/bench_calibrate.py --out docs/bench_calibrate_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scripts.report import finish  # noqa: E402

BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0001)
KINDS = ("code", "prose")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target alias or path")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft alias or path")
    p.add_argument("--dtype", default="fp32", help="compute dtype of both (counts barely depend on it)")
    p.add_argument("--budgets", default="32,128", help="fixed budgets to compare at")
    p.add_argument(
        "--grow",
        default="dynamic",
        choices=("dynamic", "static"),
        help="tree growth: dynamic (the CPU's) or static (a GPU's fixed-width levels: a draft pass a level)",
    )
    p.add_argument("--prompts", type=int, default=4, help="measured prompts per kind (code, prose)")
    p.add_argument("--warm-prompts", type=int, default=1, help="prompts per kind the calibration learns on first")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--min-prompt-tokens", type=int, default=100)
    p.add_argument("--max-prompt-tokens", type=int, default=116)
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    try:
        args.budget_list = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets must be comma-separated integers, got {args.budgets!r}")
    if not args.budget_list or min(args.budget_list) < 1 or args.prompts < 1 or args.warm_prompts < 0:
        p.error("--budgets must be >= 1, --prompts >= 1, --warm-prompts >= 0")
    return args


def reliability(engine: Any, ids: list[list[int]], texts: list[list[int]], kinds: list[str]) -> dict[str, Any]:
    """The draft's first-choice and other-choice probabilities along the target's text, binned, with how often the
    target's token was that choice."""
    import torch

    d = engine.draft_model.model
    out: dict[str, Any] = {}
    for kind in KINDS:
        tallies = {"first": [[0, 0.0, 0] for _ in BINS[1:]], "second": [[0, 0.0, 0] for _ in BINS[1:]]}
        for x, cont, k in zip(ids, texts, kinds, strict=True):
            if k != kind:
                continue
            seq = list(x) + list(cont)
            T = len(seq)
            cache = d.new_cache(T + 1)
            mask = torch.ones(T, T, dtype=torch.bool, device=d.device).tril()
            pos = torch.arange(T, device=d.device)
            with torch.no_grad():
                lq = torch.log_softmax(d.forward(torch.tensor(seq, device=d.device), pos, pos, mask, cache).float(), -1)
            for i in range(len(x) - 1, T - 1):
                v, t = torch.topk(lq[i], 2)
                for name, r in (("first", 0), ("second", 1)):
                    q = float(v[r].exp())
                    b = next(j for j in range(len(BINS) - 1) if q < BINS[j + 1])
                    tallies[name][b][0] += 1
                    tallies[name][b][1] += q
                    tallies[name][b][2] += int(int(t[r]) == seq[i + 1])
        out[kind] = {
            name: [
                {"bin": [BINS[j], min(1.0, BINS[j + 1])], "n": n, "mean_q": s / n, "taken": h / n}
                for j, (n, s, h) in enumerate(rows)
                if n
            ]
            for name, rows in tallies.items()
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from scripts.bench_acceptance import make_prompts
    from specexec import api
    from specexec.config import TreeConfig

    engine = api.load(
        args.target,
        draft=args.draft,
        device="cpu",
        dtype=args.dtype,
        draft_dtype=args.dtype,
        context=1024,
        progress=False,
        draft_vocab=0,
    )
    tok = engine.tokenizer.tokenizer if hasattr(engine.tokenizer, "tokenizer") else engine.tokenizer
    n = args.prompts + args.warm_prompts
    every = make_prompts(tok, n, n, args.min_prompt_tokens, args.max_prompt_tokens)
    warm = [p for kind in KINDS for p in [q for q in every if q.kind == kind][args.prompts :]]
    measured = [p for kind in KINDS for p in [q for q in every if q.kind == kind][: args.prompts]]
    ar = []
    for p in measured:
        engine.reset()
        ar.append(engine.generate(list(p.ids), args.max_new_tokens, method="ar").tokens)
    report: dict[str, Any] = {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "note": "counts on a CPU (acceptance does not depend on the device); fixed budgets, early stop off",
        "grow": args.grow,
        "prompts": [{"kind": p.kind, "source": p.source, "lines": p.lines} for p in measured],
        "warm_prompts": [{"kind": p.kind, "source": p.source, "lines": p.lines} for p in warm],
        "reliability": reliability(engine, [p.ids for p in measured], ar, [p.kind for p in measured]),
        "configs": [],
    }
    for kind in KINDS:
        first = report["reliability"][kind]["first"]
        print(
            f"{kind}: the draft's first choice, q -> taken: "
            + ", ".join(f"{r['mean_q']:.2f}->{r['taken']:.2f} (n={r['n']})" for r in first),
            flush=True,
        )
    for budget in args.budget_list:
        for calibrate in (False, True):
            tree = TreeConfig(budget=budget, early_stop=False, grow=args.grow, calibrate=calibrate)
            engine.draft_model.calibration = None  # each budget's calibrated runs learn afresh
            if calibrate:
                for p in warm:
                    engine.reset()
                    engine.generate(list(p.ids), args.max_new_tokens, method="specexec", tree=tree)
            cal = engine.draft_model.calibration
            alpha_start = list(cal.alpha) if cal is not None else [1.0, 1.0]
            per = []
            for p, want in zip(measured, ar, strict=True):
                engine.reset()
                r = engine.generate(list(p.ids), args.max_new_tokens, method="specexec", tree=tree)
                s = r.stats
                per.append(
                    {
                        "kind": p.kind,
                        "tokens": s.new_tokens,
                        "steps": s.steps,
                        "passes": s.draft_passes,
                        "exact": r.tokens == want,
                    }
                )
                q = per[-1]
                print(
                    f"  {p.kind} {p.source}: {q['tokens']} tokens in {q['steps']} steps, {q['passes']} draft passes, "
                    f"exact={q['exact']}",
                    flush=True,
                )
            cal = engine.draft_model.calibration
            row: dict[str, Any] = {
                "budget": budget,
                "calibrate": calibrate,
                "alpha_start": alpha_start,
                "alpha_end": list(cal.alpha) if cal is not None and calibrate else [1.0, 1.0],
                "observed": cal.observed if cal is not None and calibrate else 0,
                "per_prompt": per,
                "exact": all(q["exact"] for q in per),
            }
            for kind in (*KINDS, "all"):
                sel = [q for q in per if kind in ("all", q["kind"])]
                steps = max(1, sum(q["steps"] for q in sel))
                row[f"tokens_per_step_{kind}"] = sum(q["tokens"] for q in sel) / steps
                row[f"passes_per_step_{kind}"] = sum(q["passes"] for q in sel) / steps
            report["configs"].append(row)
            print(
                f"budget {budget} {'calibrated' if calibrate else 'raw q     '}: tok/step code "
                f"{row['tokens_per_step_code']:.2f} prose {row['tokens_per_step_prose']:.2f} all "
                f"{row['tokens_per_step_all']:.2f}; passes/step {row['passes_per_step_all']:.2f}; alpha "
                f"{row['alpha_start'][0]:.2f}/{row['alpha_start'][1]:.2f} -> {row['alpha_end'][0]:.2f}/"
                f"{row['alpha_end'][1]:.2f}; exact={row['exact']}",
                flush=True,
            )
    report["all_exact"] = all(c["exact"] for c in report["configs"])
    print()
    print("| budget | scores | tok/step code | tok/step prose | tok/step all | passes/step | alpha (first / other) |")
    print("|---|---|---|---|---|---|---|")
    for c in report["configs"]:
        print(
            f"| {c['budget']} | {'calibrated' if c['calibrate'] else 'raw q'} | {c['tokens_per_step_code']:.2f} | "
            f"{c['tokens_per_step_prose']:.2f} | {c['tokens_per_step_all']:.2f} | {c['passes_per_step_all']:.2f} | "
            f"{c['alpha_end'][0]:.2f} / {c['alpha_end'][1]:.2f} |"
        )
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return finish(run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
