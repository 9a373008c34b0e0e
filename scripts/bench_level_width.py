#!/usr/bin/env python
"""How wide a draft level must be: tokens a step against the rows each level expands (``TreeConfig.max_beams``),
counted on a CPU.

A GPU grows its trees in fixed-width levels of ``max_beams`` rows (128 by default): each level's draft pass runs
that many rows, open or padding. A pass's cost grows with its rows (bitsandbytes' int8 linears of a 7B layer: 138
µs at 16 rows, 175 at 128; the fused kernel 79 against 262, docs/BENCHMARKS.md), so narrower levels are cheaper,
and the question is what they cost in acceptance. That depends on the draft's and the target's distributions, not
on the device, so it is counted here, greedy, with the real engine (every text checked against the target's AR):

* ``--pair planted`` (default): the planted-agreement bigram pair the GPU benchmark times (specexec.model.synthetic;
code
  or prose agreement), at small sizes;
* ``--pair real``: the Qwen2.5-Coder 0.5B / 1.5B demo pair on the same prompts as bench_overlap (slow: minutes per
  width at budget 256).

Growth is "static" by default (the same trees as the GPU's "ahead", without its late pass; ``--grow``) with the
cost-based early stop deciding on the step costs given (``--pass-ms``, ``--verify-s``; default: an H200's measured
70B NF4 verify and int8 7B pass, the same for every width so that only acceptance differs). Reported per domain,
budget and width: tokens per step, draft passes per step (the critical path), the mean open rows per pass and the
row buckets a pass would need. Counts, not times.

    python scripts/bench_level_width.py --out docs/bench_level_width_planted.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scripts.report import finish  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _ints(p: argparse.ArgumentParser, name: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{name} takes comma-separated positive integers, not {text!r}")
    if not out or min(out) < 1:
        p.error(f"{name} takes comma-separated positive integers, not {text!r}")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=("planted", "real"), default="planted")
    p.add_argument("--domains", default="code,prose", help="planted agreement (planted) or prompt kind (real)")
    p.add_argument("--budgets", default="256,1024")
    p.add_argument("--max-beams", default="16,32,64,128", help="level widths to compare")
    p.add_argument("--prompts", type=int, default=3, help="prompts per domain (real: at most 3)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="planted prompts' length")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--vocab",
        type=int,
        default=8192,
        help="planted pair's vocabulary (the GPU runs use 32000; 8192 keeps a CPU verify of 1024 nodes short, and the "
        "realised agreement is reported)",
    )
    p.add_argument(
        "--hidden", default="4096,2048", help="planted target,draft hidden sizes (cross-talk shrinks with them)"
    )
    p.add_argument("--pass-ms", type=float, default=10.3, help="the early stop's draft pass cost (ms)")
    p.add_argument("--verify-s", type=float, default=0.524, help="the early stop's verify cost (s)")
    p.add_argument("--no-early-stop", action="store_true", help="grow every level up to max_depth")
    p.add_argument(
        "--grow",
        choices=("static", "ahead", "captured"),
        default="static",
        help="fixed-width growth mode (ahead and captured read each level's count a level late: the same trees, one "
        "pass more when growth ends or stops early)",
    )
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="real pair: target alias or path")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="real pair: draft alias or path")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    args.domain_list = [d.strip() for d in args.domains.split(",") if d.strip()]
    if not args.domain_list or any(d not in ("code", "prose") for d in args.domain_list):
        p.error(f"--domains takes code and/or prose, not {args.domains!r}")
    args.budget_list = _ints(p, "--budgets", args.budgets)
    args.beam_list = _ints(p, "--max-beams", args.max_beams)
    hidden = _ints(p, "--hidden", args.hidden)
    if len(hidden) != 2:
        p.error(f"--hidden takes two sizes (target,draft), not {args.hidden!r}")
    args.hidden_pair = hidden
    for name in ("prompts", "prompt_tokens", "new_tokens", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pass_ms <= 0 or args.verify_s <= 0:
        p.error("--pass-ms and --verify-s must be > 0")
    return args


def _planted(args: argparse.Namespace, domain: str) -> tuple[Any, list[list[int]], dict[str, float]]:
    import torch

    from specexec.decoding.engine import Engine
    from specexec.model import synthetic
    from specexec.model.transformer import ModelConfig

    def cfg(hidden: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=args.vocab,
            hidden_size=hidden,
            intermediate_size=128,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            max_position_embeddings=args.prompt_tokens + args.new_tokens + 4096,
        )

    ht, hd = args.hidden_pair
    agree, cover = synthetic.CODE if domain == "code" else synthetic.PROSE
    planted = synthetic.plant(args.vocab, agree, cover, hidden=(ht, hd))
    f32, cpu = torch.float32, torch.device("cpu")
    tg = synthetic.planted_globals(planted, planted.z_target, ht, f32, cpu, seed=1, margin=synthetic.TARGET_MARGIN)
    dg = synthetic.planted_globals(planted, planted.z_draft, hd, f32, cpu, seed=2)
    realised = synthetic.realised(tg, dg)
    target = synthetic.resident_model(cfg(ht), tg, f32, cpu, seed=10)
    draft = synthetic.resident_model(cfg(hd), dg, f32, cpu, seed=20, distinct=1)
    context = args.prompt_tokens + args.new_tokens + 64
    engine = Engine(target, synthetic.tokenizer_info(args.vocab), draft, context=context)
    return engine, synthetic.prompts(planted, args.prompts, args.prompt_tokens), realised


def _real(args: argparse.Namespace) -> tuple[Any, dict[str, list[list[int]]]]:
    from scripts.bench_self_draft import PROMPTS
    from specexec import api

    engine = api.load(
        args.target,
        draft=args.draft,
        device="cpu",
        dtype="fp32",
        draft_dtype="fp32",
        context=1024 + max(args.budget_list),
        progress=False,
        draft_vocab=0,  # the draft's whole vocabulary, as a GPU runs it
    )
    return engine, {k: [engine.encode(p) for p in PROMPTS[k][: args.prompts]] for k in args.domain_list}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from specexec.config import TreeConfig
    from specexec.propose import GrowCost
    from specexec.propose import best_first as tree

    cost = None if args.no_early_stop else GrowCost(args.pass_ms / 1e3, args.verify_s)
    beams: list[list[int]] = []
    original = tree.TreeDraft.propose

    def propose(self, seq, ctx):  # the early stop's costs as given; each proposal's rows per pass recorded
        prop = original(self, seq, replace(ctx, cost=cost))
        beams.append(list(prop.beams))
        return prop

    report: dict[str, Any] = {
        "pair": args.pair,
        "note": "counts on a CPU (acceptance does not depend on the device), greedy, every text checked against the "
        "target's AR; the early stop decides with the costs given, the same for every width",
        "early_stop": None if cost is None else {"pass_ms": args.pass_ms, "verify_s": args.verify_s},
        "grow": args.grow,
        "rows": [],
    }
    real = _real(args) if args.pair == "real" else None
    tree.TreeDraft.propose = propose  # type: ignore[method-assign]
    try:
        for domain in args.domain_list:
            if real is not None:
                engine, prompts = real[0], real[1][domain]
                realised: dict[str, float] = {}
            else:
                engine, prompts, realised = _planted(args, domain)
                report.setdefault("planted", {})[domain] = realised
            ar = [engine.generate(p, args.new_tokens, method="ar").tokens for p in prompts]
            for budget in args.budget_list:
                for w in args.beam_list:
                    cfg = TreeConfig(budget=budget, max_beams=w, grow=args.grow, early_stop=cost is not None)
                    beams.clear()
                    toks = steps = same = 0
                    t0 = time.perf_counter()
                    for p, want in zip(prompts, ar):
                        r = engine.generate(p, args.new_tokens, method="specexec", tree=cfg)
                        toks += len(r.tokens)
                        steps += r.stats.steps
                        same += r.tokens == want
                    rows = [b for per in beams for b in per[1:]]  # the levels after the root's catch-up pass
                    hist = Counter(next(x for x in BUCKETS if x >= b) for b in rows if b <= BUCKETS[-1])
                    row = {
                        "domain": domain,
                        "budget": budget,
                        "max_beams": w,
                        "tok_per_step": toks / max(1, steps),
                        "passes_per_step": sum(len(b) for b in beams) / max(1, len(beams)),
                        "mean_rows": sum(rows) / max(1, len(rows)),
                        "row_buckets": {str(k): hist[k] for k in sorted(hist)},
                        "exact": same == len(prompts),
                        "seconds": time.perf_counter() - t0,
                    }
                    report["rows"].append(row)
                    print(
                        f"{domain:5s} budget {budget:5d} width {w:4d}: {row['tok_per_step']:6.2f} tok/step, "
                        f"{row['passes_per_step']:5.1f} passes/step, {row['mean_rows']:6.1f} rows/pass, "
                        f"buckets {row['row_buckets']}, exact {same}/{len(prompts)}",
                        flush=True,
                    )
    finally:
        tree.TreeDraft.propose = original  # type: ignore[method-assign]
    report["all_exact"] = all(r["exact"] for r in report["rows"])
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return finish(run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
