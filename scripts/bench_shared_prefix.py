#!/usr/bin/env python
"""A self-derived draft with the target's KV prefix vs its own: prefill time, time to first token, decode speed.

``--draft self`` reads the keys/values of everything committed from the target's cache
(:class:`specexec.propose.draft_model.TargetPrefix`) instead of running the prompt and the accepted tokens through
the draft. This measures what that changes end to end, in one run, on the real engine: one :func:`specexec.api.load`
(target + self draft), then for each prompt both settings back to back (``Engine.set_share_prefix``; which goes
first alternates, so load from other processes hits both alike), each after a warm-up call, greedy, a fixed tree
budget. Reported per prompt length: prefill seconds (the target's prefill + the draft's: run, or copied), time to
the first token, decode tokens/s and tokens per target pass, with the ratio shared/own; both outputs must equal
the target's AR tokens.

Prompts are long real text cut to ``--prompt-tokens`` tokens: this repository's own source (code) and its docs
(prose), read at run time. Needs a quiet machine (it times)::

    flock /tmp/realpair.lock python scripts/bench_shared_prefix.py --out bench_out/shared_prefix_timing.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

SOURCES = {"code": ROOT / "specexec" / "tree.py", "prose": ROOT / "docs" / "ARCHITECTURE.md"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target alias or path")
    p.add_argument("--draft-dtype", default="int8", help="the self draft's weight format")
    p.add_argument("--draft-layers", default=None, help="a partial self draft (the library's draft_layers spec)")
    p.add_argument("--prompt-tokens", default="128,512", help="prompt lengths in tokens (comma-separated)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=8, help="fixed tree budget (no early stop)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and setting")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.prompt_tokens.split(",")]
        if any(n < 2 for n in args.lengths):
            raise ValueError
    except ValueError:
        p.error(f"--prompt-tokens: comma-separated lengths >= 2, not {args.prompt_tokens!r}")
    return args


def prompts(engine: Any, lengths: list[int]) -> list[tuple[str, int, list[int]]]:
    """(kind, length, ids): each source's first ``length`` tokens. A tokenizer that reads too little of a source
    (a test model's) gets fixed pseudo-random ids of that length instead, and the kind says so."""
    import torch

    out = []
    for kind, path in SOURCES.items():
        ids = engine.encode(path.read_text())
        for n in lengths:
            if len(ids) >= n:
                out.append((kind, n, ids[:n]))
                continue
            print(f"{path.name}: only {len(ids)} tokens, using {n} pseudo-random ids", file=sys.stderr)
            gen = torch.Generator().manual_seed(n)
            fake = torch.randint(3, engine.target.cfg.vocab_size, (n,), generator=gen).tolist()
            out.append((f"{kind}-random", n, fake))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from specexec import api
    from specexec.config import TreeConfig

    ctx = max(args.lengths) + args.new_tokens + 64
    engine = api.load(
        args.target, "self", device="cpu", dtype="fp32", draft_dtype=args.draft_dtype, context=ctx,
        draft_layers=args.draft_layers, progress=False,
    )  # fmt: skip
    tree = TreeConfig(budget=args.budget, early_stop=False)
    rows: list[dict[str, Any]] = []
    for k, (kind, n, ids) in enumerate(prompts(engine, args.lengths)):
        engine.set_share_prefix(True)
        want = engine.generate(ids, args.new_tokens, method="ar").tokens
        runs: dict[bool, list[Any]] = {True: [], False: []}
        for share in (True, False):  # warm-up, one each
            engine.set_share_prefix(share)
            engine.reset()
            engine.generate(ids, 4, method="specexec", tree=tree)
        order = (True, False) if k % 2 == 0 else (False, True)
        for _ in range(args.repeats):
            for share in order:
                engine.set_share_prefix(share)
                engine.reset()  # the whole prompt is prefilled every time
                first: list[float] = []
                t0 = time.perf_counter()
                r = engine.generate(
                    ids, args.new_tokens, method="specexec", tree=tree,
                    on_step=lambda _info: first.append(time.perf_counter()) if not first else None,
                )  # fmt: skip
                s = r.stats
                runs[share].append(
                    dict(
                        prefill_s=s.prefill_s,
                        ttft_s=(first[0] if first else time.perf_counter()) - t0,
                        decode_tok_s=s.tokens_per_s,
                        tokens_per_step=s.tokens_per_step,
                        draft_passes=s.draft_passes,
                        exact=r.tokens == want,
                    )
                )
        row: dict[str, Any] = {"kind": kind, "prompt_tokens": n}
        for share, name in ((True, "shared"), (False, "own")):
            rs = runs[share]
            row[name] = {
                key: statistics.median(x[key] for x in rs)
                for key in ("prefill_s", "ttft_s", "decode_tok_s", "tokens_per_step", "draft_passes")
            }
            row[name]["exact"] = all(x["exact"] for x in rs)
        sh, own = row["shared"], row["own"]
        row["prefill_ratio"] = sh["prefill_s"] / own["prefill_s"]
        row["ttft_ratio"] = sh["ttft_s"] / own["ttft_s"]
        row["decode_ratio"] = sh["decode_tok_s"] / own["decode_tok_s"] if own["decode_tok_s"] else None
        rows.append(row)
        print(
            f"{kind:5s} {n:5d} tok  prefill {own['prefill_s']:6.2f} -> {sh['prefill_s']:6.2f} s "
            f"({row['prefill_ratio']:.2f}x)  ttft {own['ttft_s']:6.2f} -> {sh['ttft_s']:6.2f} s "
            f"({row['ttft_ratio']:.2f}x)  decode {own['decode_tok_s']:5.2f} -> {sh['decode_tok_s']:5.2f} tok/s  "
            f"tok/pass {own['tokens_per_step']:.2f} -> {sh['tokens_per_step']:.2f}  "
            f"exact {own['exact'] and sh['exact']}",
            flush=True,
        )
    report = {
        "target": args.target,
        "draft": f"self {args.draft_dtype}" + (f", layers {args.draft_layers}" if args.draft_layers else ""),
        "budget": args.budget,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "rows": rows,
        "all_exact": all(r["shared"]["exact"] and r["own"]["exact"] for r in rows),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    return 0 if run(parse_args(argv))["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
