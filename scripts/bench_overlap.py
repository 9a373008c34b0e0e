#!/usr/bin/env python
"""How much of the draft overlapped growth takes off the critical path, with the real pair's acceptance (counts).

Overlapped growth (``TreeConfig.overlap`` N, ``--overlap N``) grows N more fixed-width levels of the draft tree
while the target verifies (a side CUDA stream on a GPU), and the next step starts from the subtree under the
accepted path + bonus token. Its value on a GPU is the draft passes it removes from each step's critical path.
That number depends on acceptance, not on the device, so it is counted here on the real demo pair (CPU): per
overlap N, greedy, at a fixed budget (no early stop, so tree sizes do not depend on timings):

* tokens per step (acceptance: overlap never changes the text, and the tokens must equal the target's AR output);
* critical-path draft passes per step (the passes ``propose`` ran: what a step waits for), background passes per
  step (run beside the target's pass), nodes and passes carried over per step.

With the draft pass and verify times an H100 run measured (``--gpu-costs``, docs/bench_e2e_h100.json: 70B NF4
target, graphed 7B draft), it then PROJECTS the GPU step (named ``projected_*``: replayed costs, not a
measurement): step = verify + critical passes x (pass + bookkeeping per level); tok/s = tokens per step / step.
The measurement of the same runs on a GPU is ``scripts/bench_gpu.py``.

    flock /tmp/realpair.lock python scripts/bench_overlap.py --out docs/bench_overlap_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scripts.bench_self_draft import PROMPTS  # noqa: E402 - the same 3 code + 3 prose prompts
from scripts.report import finish  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target alias or path")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft alias or path")
    p.add_argument("--dtype", default="fp32", help="compute dtype of both (counts barely depend on it)")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--max-beams", type=int, default=64, help="rows per fixed-width level")
    p.add_argument("--overlaps", default="0,4,8", help="overlap levels to compare (0: reuse alone)")
    p.add_argument(
        "--aims", default="carried,frontier", help="where overlapped levels aim (TreeConfig.overlap_aim), compared"
    )
    p.add_argument(
        "--aim-rel",
        type=float,
        default=None,
        help="the 'carried' aim's weight of relative log-prob (fixed_grow.AIM_REL; default: its value)",
    )
    p.add_argument("--grow", default="static", choices=("static", "ahead"), help="fixed-width growth mode")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-prompts", type=int, default=2, help="prompts per kind (code, prose), at most 3")
    p.add_argument("--gpu-costs", type=Path, default=Path("docs/bench_e2e_h100.json"), help="an H100 bench_e2e JSON")
    p.add_argument("--gpu-format", default="nf4", help="which target format's verify time to project with")
    p.add_argument(
        "--early-stop",
        action="store_true",
        help="the cost-based early stop on the levels a step waits for, decided with the replayed H100 costs "
        "(--gpu-costs: the pass at --max-beams rows + bookkeeping, the verify) and the engine's learnt accuracy "
        "scale, as a GPU run would decide it (default: off, every level up to max_depth)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    return args


def gpu_costs(path: Path, fmt: str, budget: int) -> dict[str, Any] | None:
    """Measured H100 costs: graphed draft pass seconds by rows, bookkeeping per level, verify at ``budget``."""
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    runs = [r for r in d.get("runs", []) if r.get("format") == fmt]
    if not runs:
        return None
    verify = min(runs, key=lambda r: abs(r["budget"] - budget))
    return {
        "source": str(path),
        "device": d.get("device"),
        "pass_s": {int(k): v for k, v in d["draft_pass_s_graphed"].items()},
        "bookkeeping_s": d["bookkeeping_s_per_level"],
        "verify_s": verify["verify_s"],
        "verify_budget": verify["budget"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from specexec import api
    from specexec.config import TreeConfig
    from specexec.propose import fixed_grow

    if args.aim_rel is not None:
        fixed_grow.AIM_REL = args.aim_rel

    # the draft as a GPU runs it: same dtype as the target, its full output vocabulary (no CPU FR-Spec head)
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
    prompts = [(kind, p) for kind, ps in PROMPTS.items() for p in ps[: args.num_prompts]]
    ids = [engine.encode(p) for _, p in prompts]
    ar = [engine.generate(x, args.max_new_tokens, method="ar").tokens for x in ids]
    costs = gpu_costs(args.gpu_costs, args.gpu_format, args.budget)
    if args.early_stop:
        if costs is None:
            raise SystemExit(f"--early-stop needs the H100 costs in --gpu-costs ({args.gpu_costs})")
        from specexec.propose import GrowCost

        rows = min((k for k in costs["pass_s"] if k >= args.max_beams), default=max(costs["pass_s"]))
        pass_s = costs["pass_s"][rows] + costs["bookkeeping_s"]
        learnt = engine._costs  # the fixed-budget policy's costs: keep its learnt accuracy scale, replay the times
        learnt.grow_cost = lambda budget: GrowCost(pass_s, costs["verify_s"], learnt.acc_scale)  # type: ignore
    report: dict[str, Any] = {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "budget": args.budget,
        "max_beams": args.max_beams,
        "grow": args.grow,
        "aim_rel": fixed_grow.AIM_REL,
        "max_new_tokens": args.max_new_tokens,
        "note": "counts on a CPU (acceptance does not depend on the device); projected_* replay measured H100 costs",
        "early_stop": "replayed H100 costs" if args.early_stop else False,
        "gpu_costs": costs,
        "prompts": [{"kind": k, "prompt": p} for k, p in prompts],
        "configs": [],
    }
    aims = args.aims.split(",")
    runs = [(int(x), a) for x in args.overlaps.split(",") for a in (aims if int(x) else aims[:1])]
    for n, aim in runs:
        tree = TreeConfig(
            budget=args.budget,
            max_beams=args.max_beams,
            early_stop=args.early_stop,
            grow=args.grow,
            reuse=True,
            overlap=n,
            overlap_aim=aim,
        )
        per: list[dict[str, Any]] = []
        for (kind, _), x, want in zip(prompts, ids, ar, strict=True):
            engine.reset()
            g = engine.stream(x, args.max_new_tokens, method="specexec", tree=tree)
            for _ in g:
                pass
            assert g.result is not None
            s = g.result.stats
            per.append(
                {
                    "kind": kind,
                    "tokens": s.new_tokens,
                    "steps": s.steps,
                    "critical_passes": s.draft_passes,
                    "early_stops": s.early_stops,
                    "background_passes": getattr(g.proposer, "background_passes", 0),
                    "reused_nodes": s.reused_nodes,
                    "reused_passes": s.reused_passes,
                    "shapes": s.tree_shapes,
                    "exact": g.result.tokens == want,
                }
            )
        steps = max(1, sum(q["steps"] for q in per))
        row: dict[str, Any] = {
            "overlap": n,
            "aim": aim if n else None,
            "per_prompt": per,
            "exact": all(q["exact"] for q in per),
            "tokens_per_step": sum(q["tokens"] for q in per) / steps,
            "critical_passes_per_step": sum(q["critical_passes"] for q in per) / steps,
            "background_passes_per_step": sum(q["background_passes"] for q in per) / steps,
            "reused_nodes_per_step": sum(q["reused_nodes"] for q in per) / steps,
            "reused_passes_per_step": sum(q["reused_passes"] for q in per) / steps,
        }
        for kind in ("code", "prose"):
            sel = [q for q in per if q["kind"] == kind]
            row[f"tokens_per_step_{kind}"] = sum(q["tokens"] for q in sel) / max(1, sum(q["steps"] for q in sel))
        if costs is not None:  # PROJECTION from replayed H100 costs: the critical-path passes at their row counts
            sizes = sorted(costs["pass_s"])
            draft = 0.0
            for q in per:
                for shape in q["shapes"]:
                    for rows in shape:
                        k = min((s for s in sizes if s >= rows), default=sizes[-1])
                        draft += costs["pass_s"][k] + costs["bookkeeping_s"]
            draft /= steps
            step = costs["verify_s"] + draft
            row.update(
                projected_draft_s_per_step=draft,
                projected_step_s=step,
                projected_step_over_verify=step / costs["verify_s"],
                projected_tok_s=row["tokens_per_step"] / step,
            )
        report["configs"].append(row)
        print(
            f"overlap {n}{' ' + aim if n else ''}: "
            f"{row['tokens_per_step']:.2f} tok/step (code {row['tokens_per_step_code']:.2f}, prose "
            f"{row['tokens_per_step_prose']:.2f}); critical passes/step {row['critical_passes_per_step']:.2f}, "
            f"background {row['background_passes_per_step']:.2f}, carried nodes/step "
            f"{row['reused_nodes_per_step']:.1f}; exact={row['exact']}"
            + (
                f"; projected H100 step/verify {row['projected_step_over_verify']:.2f}, "
                f"{row['projected_tok_s']:.2f} tok/s"
                if costs is not None
                else ""
            ),
            flush=True,
        )
    report["all_exact"] = all(c["exact"] for c in report["configs"])
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return finish(run(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
