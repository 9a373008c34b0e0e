#!/usr/bin/env python
"""``specexec bench`` of an older revision and of this checkout, in one run: speed side by side, tokens compared.

A refactor must not move speed beyond noise nor change a single greedy token. This script checks both at once:
it makes a git worktree of ``--before`` (default ``HEAD``: this checkout's uncommitted changes against their base;
name an older revision to compare a range of commits), then runs the ``specexec bench`` CLI of each checkout in
turn with the same arguments, in ABBA order (before, after, after, before by default: a machine that drifts slower
or faster during the run favours neither), each run in a fresh process. Every (method, parameter, prompt) run's
tokens are recorded (a thin wrapper around each checkout's own ``specexec.bench._one``; the code under test is
untouched) and compared across the two revisions and across repeats. Prints a table (tokens/s per method, median
of the repeats, after/before ratio) and writes JSON.

    python scripts/bench_before_after.py --before v0.3 --out bench_out/before_after.json -- \
        --methods ar,chain,specexec --budgets 16 --gammas 3 --num-prompts 4 -n 32

Arguments after ``--`` go to both ``specexec bench`` runs unchanged; ``--after-args`` adds arguments the older
revision does not know (e.g. ``--draft-dtype fp32``) to this checkout's runs only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "HEAD"

# Runs inside each checkout's process: records tokens of every timed run, then runs that checkout's CLI.
WRAPPER = """
import json, sys
import specexec.bench as b
orig, rec = b._one, []
def one(engine, prompt, method, param, cfg, max_new=None):
    r = orig(engine, prompt, method, param, cfg, max_new)
    if max_new is None:  # not the warm-up
        rec.append({"prompt": prompt.name, "method": method, "param": param, "tokens": [int(t) for t in r.tokens]})
    return r
b._one = one
from specexec.cli import main
sys.argv = ["specexec", "bench"] + json.loads(sys.argv[1])
try:
    main()
finally:
    with open(TOKENS, "w") as f:
        json.dump(rec, f)
"""


def run_one(checkout: Path, bench_args: list[str], workdir: Path, tag: str) -> dict[str, Any]:
    out, tokens = workdir / f"{tag}.json", workdir / f"{tag}.tokens.json"
    code = WRAPPER.replace("TOKENS", repr(str(tokens)))
    env = dict(os.environ, PYTHONPATH=str(checkout))
    args = bench_args + ["--out", str(out), "--quiet"]
    print(f"[{tag}] {checkout}: specexec bench {shlex.join(args)}", flush=True)
    r = subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=checkout, env=env, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: specexec bench failed in {checkout} (exit {r.returncode})")
    report = json.loads(out.read_text())
    report["tokens"] = json.loads(tokens.read_text())
    return report


def _key(row: dict[str, Any]) -> str:
    return f"{row['method']} {row['param'] or ''}".strip()


def compare(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per method: tok/s of every run, median per revision, after/before; token mismatches across everything."""
    speeds: dict[str, dict[str, list[float]]] = {}
    steps: dict[str, dict[str, list[float]]] = {}
    for rev, rep in runs:
        for row in rep["rows"]:
            speeds.setdefault(_key(row), {}).setdefault(rev, []).append(row["tokens_per_s"])
            steps.setdefault(_key(row), {}).setdefault(rev, []).append(row["tokens_per_step"])
    ref: dict[tuple, list[int]] = {}
    mismatches: list[dict[str, Any]] = []
    compared = 0
    for rev, rep in runs:
        for t in rep["tokens"]:
            k = (t["prompt"], t["method"], t["param"])
            ar = next(x["tokens"] for x in rep["tokens"] if x["prompt"] == t["prompt"] and x["method"] == "ar")
            for name, want in (("first run", ref.setdefault(k, t["tokens"])), ("this run's ar", ar)):
                compared += 1
                if t["tokens"] != want:
                    mismatches.append({"rev": rev, "run": k, "against": name})
    seen: dict[str, set[tuple]] = {}
    for rev, rep in runs:
        seen.setdefault(rev, set()).update((t["prompt"], t["method"], t["param"]) for t in rep["tokens"])
    both = len(seen.get("before", set()) & seen.get("after", set()))  # runs whose tokens are compared across revs
    rows = []
    for key, by_rev in speeds.items():
        b = statistics.median(by_rev.get("before", [0.0]))
        a = statistics.median(by_rev.get("after", [0.0]))
        rows.append(
            {
                "config": key,
                "before_tok_s": by_rev.get("before", []),
                "after_tok_s": by_rev.get("after", []),
                "before_median": b,
                "after_median": a,
                "after_over_before": a / b if b else None,
                "tokens_per_step_before": statistics.median(steps[key].get("before", [0.0])),
                "tokens_per_step_after": statistics.median(steps[key].get("after", [0.0])),
            }
        )
    return {"rows": rows, "token_comparisons": compared, "cross_revision_runs": both, "mismatches": mismatches}


def markdown(summary: dict[str, Any], before: str, after: str) -> str:
    lines = [
        f"`specexec bench` before ({before}) and after ({after}), ABBA, decode tok/s (median of the repeats)",
        "",
        "| config | before tok/s | after tok/s | after / before | tokens/step before | after | runs (before; after) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        ratio = f"{r['after_over_before']:.2f}×" if r["after_over_before"] else "-"
        runs = ", ".join(f"{x:.2f}" for x in r["before_tok_s"]) + "; " + ", ".join(f"{x:.2f}" for x in r["after_tok_s"])
        lines.append(
            f"| {r['config']} | {r['before_median']:.2f} | {r['after_median']:.2f} | {ratio} | "
            f"{r['tokens_per_step_before']:.2f} | {r['tokens_per_step_after']:.2f} | {runs} |"
        )
    n, bad = summary["token_comparisons"], len(summary["mismatches"])
    lines += ["", f"Token comparisons (every run vs the first run of the same config, and vs its own AR): {n}, "]
    lines[-1] += f"mismatches: {bad}; (prompt, config) runs present in both revisions: {summary['cross_revision_runs']}"
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=BEFORE, help=f"git revision to compare with (default {BEFORE})")
    p.add_argument("--order", default="ABBA", help="run order, A = before, B = after (default ABBA)")
    p.add_argument("--after-args", default="", help="extra bench arguments for this checkout only (shell-quoted)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    if set(args.order) - {"A", "B"} or not {"A", "B"} <= set(args.order):
        p.error("--order: A and B only, each at least once")
    after_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="specexec-before-") as tmp:
        work = Path(tmp)
        before_dir = work / "before"
        known = subprocess.run(["git", "cat-file", "-e", f"{args.before}^{{commit}}"], cwd=ROOT, capture_output=True)
        if known.returncode != 0:
            print(
                f"error: --before {args.before}: no such commit in this clone (a shallow clone lacks history)",
                file=sys.stderr,
            )
            return 2
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(before_dir), args.before],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            runs: list[tuple[str, dict[str, Any]]] = []
            for i, which in enumerate(args.order):
                if which == "A":
                    runs.append(("before", run_one(before_dir, bench_args, work, f"{i}-before")))
                else:
                    extra = shlex.split(args.after_args)
                    runs.append(("after", run_one(ROOT, bench_args + extra, work, f"{i}-after")))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_dir)], cwd=ROOT, check=False)
    summary = compare(runs)
    md = markdown(summary, args.before, after_rev)
    print(md)
    if args.out:
        report = {
            "before": args.before,
            "after": after_rev,
            "order": args.order,
            "bench_args": bench_args,
            "after_args": args.after_args,
            **summary,
            "runs": [{"rev": rev, **{k: v for k, v in rep.items() if k != "tokens"}} for rev, rep in runs],
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if summary["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
