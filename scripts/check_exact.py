#!/usr/bin/env python
"""Is the default's greedy output the target's own greedy decoding, on every prompt of the benchmark sets?

For each prompt of bench_cpu.py's sets (code, prose, grounded), the default (what ``specexec generate`` does with
no tuning flags) generates ``--max-new-tokens`` greedy tokens. Each emitted token must be the target's argmax given
the prompt and the tokens before it: every token is checked against the engine's teacher-forced scores of the
prompt and the output (``Engine.score``: shape-invariant passes give a prefill's logits the bits of one-token
steps; tests/test_real_pair.py asserts that on the same weights). On the first ``--ar`` prompts of each set, plain
decoding (``--method ar``) also runs, and its tokens are compared with the default's directly; ``--repeat`` runs
the default a second time and compares the two.

    python scripts/check_exact.py --prompts-per-set 20 --max-new-tokens 128 --ar 2

Exits 1 on any mismatch. ``--smoke`` (with tiny models given by --target/--draft) checks the logic quickly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scripts.bench_cpu import DRAFT, SETS, TARGET, build_prompts  # noqa: E402


def greedy_mismatches(engine, ids: list[int], out: list[int]) -> list[int]:
    """Indices of ``out`` whose token is not the target's argmax after ``ids`` + the tokens before it."""
    if not out:
        return []
    choice = engine.score(ids + out, start=len(ids)).top1
    return [i for i, (a, b) in enumerate(zip(choice, out)) if a != b]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--prompts-per-set", type=int, default=20)
    p.add_argument("--first", type=int, default=0, help="skip this many prompts of each set (resume a long run)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ar", type=int, default=1, help="prompts per set also decoded with --method ar and compared")
    p.add_argument("--repeat", action="store_true", help="run the default twice per prompt and compare")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=None, help="write the table's rows as JSON here")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts_per_set, args.max_new_tokens = 1, 8
    from specexec import load

    engine = load(args.target, args.draft, device="cpu", dtype=args.dtype, progress=False)
    print(f"target {engine.target.dtype}, invariant tiling: {engine.target.tiling}", flush=True)
    prompts = {k: v[args.first :] for k, v in build_prompts(tuple(args.sets.split(",")), args.prompts_per_set).items()}
    bad = 0
    rows = []
    print("| set | prompts | tokens | not the target's greedy choice | equal to --method ar | repeat equal | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for name, ps in prompts.items():
        tokens = wrong = ar_same = ar_runs = rep_same = 0
        seconds = 0.0
        for k, prompt in enumerate(ps):
            ids = engine.encode(prompt.text, chat=prompt.chat)
            t = time.perf_counter()
            r = engine.generate(ids, args.max_new_tokens)
            seconds += time.perf_counter() - t
            tokens += len(r.tokens)
            miss = greedy_mismatches(engine, ids, r.tokens)
            wrong += bool(miss)
            if miss:
                print(f"  {name} {prompt.name}: token {miss[0]} is not the target's greedy choice", flush=True)
            if k < args.ar:
                ar_runs += 1
                ar = engine.generate(ids, args.max_new_tokens, method="ar").tokens
                ar_same += ar == r.tokens
            if args.repeat:
                rep_same += engine.generate(ids, args.max_new_tokens).tokens == r.tokens
        bad += wrong + (ar_runs - ar_same) + ((len(ps) - rep_same) if args.repeat else 0)
        rep = f"{rep_same}/{len(ps)}" if args.repeat else "-"
        rows.append(dict(set=name, prompts=len(ps), tokens=tokens, not_greedy=wrong, ar_equal=ar_same, ar_runs=ar_runs,
                         repeat_equal=rep_same if args.repeat else None, tok_s=tokens / seconds))  # fmt: skip
        print(
            f"| {name} | {len(ps)} | {tokens} | {wrong} | {ar_same}/{ar_runs} | {rep} | {tokens / seconds:.2f} |",
            flush=True,
        )
    if args.out:
        meta = dict(target=args.target, draft=args.draft, dtype=str(engine.target.dtype), tokens=args.max_new_tokens,
                    tiling=str(engine.target.tiling), mismatches=bad)  # fmt: skip
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if bad:
        print(f"error: {bad} mismatches", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
