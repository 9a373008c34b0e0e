#!/usr/bin/env python
"""Acceptance of self-derived drafts (the target's own weights in low bit) vs a separate small draft, in counts.

Loads the target once (fp32, CPU) and pairs it with each draft of ``--drafts`` in turn:

- ``self-<fmt>``: the target's own checkpoint in a low-bit weight format (what :func:`specexec.api.load` with
  ``draft="self", draft_dtype=<fmt>`` loads): ``int8`` (per-channel), ``nf4`` (bitsandbytes), or the group-wise
  ``q4`` / ``q3`` / ``q2`` (:mod:`specexec.formats.groupquant`); ``self`` is ``self-int8``;
- ``<fmt>``: the separate draft (``--draft``, the demo's 0.5B) in ``fp32`` or any of those formats.

Every draft keeps its full vocabulary (no reduced head), so the formats are compared on their weights alone. NF4 and
group-wise weights are dequantized once after loading (:func:`specexec.formats.groupquant.dequantize_resident`): on a
CPU
those formats compute "dequantize, then the dense linear" every pass, so the counts are the same bit for bit, only
without re-dequantizing 1.5B weights per draft pass. For every draft: greedy SpecExec trees at fixed budgets (8 and
32 by default; no early stop, so tree sizes do not depend on timings) and a chain of ``gamma`` tokens, over code and
prose prompts. Reports accepted tokens per target pass (tokens per step) and checks that every configuration's
tokens equal the target's own greedy (AR) output.

Counts only: no timing is taken or reported (wall-clock on a shared machine says nothing). The real pair needs
~10 GB of RAM (~14 GB with a dequantized 1.5B draft); run it under the team's lock::

    flock /tmp/realpair.lock python scripts/bench_self_draft.py --out bench_out/self_draft.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

FORMATS = ("fp32", "int8", "nf4", "q4", "q3", "q2")
REFINED = ("q4r", "q3r", "q2r")  # group-wise with GroupQuantLinear.quantize(refine=True)
DEFAULT_DRAFTS = "self-int8,self-nf4,self-q4,self-q3,self-q2,fp32,int8"

PROMPTS = {
    "code": [
        "def quicksort(arr):",
        "class LRUCache:\n    def __init__(self, capacity):",
        'import json\n\n\ndef load_config(path):\n    """Read a JSON config file and',
    ],
    "prose": [
        "The history of the printing press begins",
        "Once upon a time, in a small village by the sea,",
        "Photosynthesis is the process by which plants",
    ],
}


def parse_draft(name: str) -> tuple[bool, str, bool, str | None, bool]:
    """``self-<fmt>[@<layers>][/own]`` / ``self`` / ``<fmt>`` -> (self-derived, weight format, refined, layers,
    shared prefix); a q4/q3/q2
    name with an ``r`` suffix (``self-q2r``) asks for the refined quantization. ``@<layers>``: a partial self draft,
    the library's ``draft_layers`` spec (``@0.5``: half the layers by block influence, ``@0-13,27``) or an
    experiment rule, ``@even:N`` (N layers evenly spaced, first and last kept), ``@tail:N`` (the first N-1 and
    the last: skip one block just before the end) or ``@agree:N`` (greedy elimination by top-1 agreement with the
    target on calibration text); ``self-fp32@...`` is a dense partial draft (isolates the skip). A self draft reads
    the target's KV prefix (:class:`specexec.propose.draft_model.TargetPrefix`, the library's default) unless
    ``/own`` ends its name: then it computes its own prefix (how every draft worked before).
    A bad name raises ``ValueError``."""
    full = name
    name, _, opt = name.partition("/")
    name, _, layers = name.partition("@")
    self_draft, fmt = (True, name.removeprefix("self-")) if name.startswith("self") else (False, name)
    if name == "self":
        fmt = "int8"
    refine = fmt in REFINED
    fmt = fmt.removesuffix("r") if refine else fmt
    bad_opt = opt not in ("", "own") or (opt and not self_draft)
    if fmt not in FORMATS or (self_draft and fmt == "fp32" and not layers) or (layers and not self_draft) or bad_opt:
        raise ValueError(
            f"unknown draft {full!r}: self-<int8|nf4|q4|q3|q2|q4r|q3r|q2r>[@layers][/own], self-fp32@layers[/own] "
            f"or <{'|'.join(FORMATS)}>"
        )
    return self_draft, fmt, refine, layers or None, self_draft and opt != "own"


def kept_layers(spec: str, target: Any, encode: Any) -> list[int] | None:
    """A partial self draft's layers (None: all): the experiment rules ``even:N`` / ``tail:N``, else the
    library's spec (:mod:`specexec.loading.layer_select`)."""
    from specexec.loading import layer_select

    L = target.cfg.num_layers
    rule, _, n = spec.partition(":")
    if rule == "even":
        return sorted({round(i * (L - 1) / (int(n) - 1)) for i in range(int(n))})
    if rule == "tail":
        return [*range(int(n) - 1), L - 1]
    if rule == "agree":
        return greedy_agreement(target, int(n), encode)
    return layer_select.resolve(layer_select.parse(spec, L), target, encode)


def greedy_agreement(target: Any, n: int, encode: Any, tokens: int = 128) -> list[int]:
    """Experiment rule ``agree:N``: drop layers one at a time, each time the one whose removal keeps the most
    top-1 agreement with the whole target on the first ``tokens`` calibration tokens (the target's own layers,
    shared, not copied)."""
    from dataclasses import replace

    import torch

    from specexec.loading import layer_select
    from specexec.model.transformer import ResidentLayers, Transformer

    ids = layer_select.calibration_tokens(encode, target.cfg.vocab_size)[:tokens]
    T = len(ids)
    x = torch.tensor(ids)
    pos = torch.arange(T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    layers = target.layers.layers

    def top1(keep: list[int]) -> torch.Tensor:
        m = Transformer(
            cfg=replace(target.cfg, num_layers=len(keep)),
            globals=target.globals,
            layers=ResidentLayers([layers[i] for i in keep]),
            device=target.device,
            dtype=target.dtype,
        )
        return m.forward(x, pos, pos, mask, m.new_cache(T)).argmax(-1)

    want = top1(list(range(target.cfg.num_layers)))
    keep = list(range(target.cfg.num_layers))
    while len(keep) > n:
        scores = {i: float((top1([j for j in keep if j != i]) == want).float().mean()) for i in keep}
        drop = max(scores, key=lambda i: (scores[i], -i))
        keep.remove(drop)
        print(f"agree: dropped layer {drop} (agreement {scores[drop]:.3f}), {len(keep)} left", flush=True)
    return keep


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target alias or path")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the separate draft to compare with")
    p.add_argument("--budgets", default="8,32", help="fixed SpecExec tree budgets (comma-separated)")
    p.add_argument("--gamma", type=int, default=4, help="chain length")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=3, help="prompts per kind (code, prose), at most 3")
    p.add_argument(
        "--drafts",
        default=DEFAULT_DRAFTS,
        help="comma-separated (semicolons when a layer list has commas): self-<int8|nf4|q4|q3|q2>[@layers][/own], "
        "self-fp32@layers[/own] and <fp32|int8|...> (/own: the self draft computes its own KV prefix)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    try:
        args.draft_list = [
            (d.strip(), *parse_draft(d.strip())) for d in args.drafts.split(";" if ";" in args.drafts else ",")
        ]
    except ValueError as e:
        p.error(str(e))
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from specexec import api
    from specexec.config import ChainConfig, TreeConfig
    from specexec.decoding.engine import Engine
    from specexec.formats.groupquant import dequantize_resident
    from specexec.loading import hub
    from specexec.loading.checkpoint import load_model, model_dir

    cpu = torch.device("cpu")
    budgets = [int(b) for b in args.budgets.split(",")]
    prompts = [(kind, p) for kind, ps in PROMPTS.items() for p in ps[: args.num_prompts]]
    ctx = 1024
    engine = api.load(args.target, device="cpu", dtype="fp32", context=ctx, progress=False)
    target, tok = engine.target, engine.tokenizer
    ids = [engine.encode(p) for _, p in prompts]
    ar = [engine.generate(x, args.max_new_tokens, method="ar").tokens for x in ids]
    report: dict[str, Any] = {
        "target": args.target,
        "note": "counts only (tokens per target pass); no timings; every draft with its full vocabulary",
        "max_new_tokens": args.max_new_tokens,
        "budgets": budgets,
        "gamma": args.gamma,
        "prompts": [{"kind": k, "prompt": p} for k, p in prompts],
        "configs": [],
    }
    t_path = model_dir(hub.resolve(args.target, progress=False))
    d_path = model_dir(hub.resolve(args.draft, progress=False))
    encode = engine.encode
    for name, self_draft, fmt, refine, layers, share in args.draft_list:
        del engine
        gc.collect()
        path = t_path if self_draft else d_path
        keep = kept_layers(layers, target, encode) if layers else None
        draft = load_model(
            path, cpu, torch.float32, fmt="dense" if fmt == "fp32" else fmt, refine=refine, keep_layers=keep
        )
        dequantize_resident(draft)  # nf4 / q*: the same outputs, without dequantizing every pass
        if self_draft:  # its layer i is the target's layer keep[i] (what api.load records for draft="self")
            draft.source_layers = tuple(keep) if keep is not None else tuple(range(target.cfg.num_layers))
        engine = Engine(target, tok, draft, context=ctx, share_prefix=share)
        fmt_name = f"{fmt} refined" if refine else fmt
        label = f"self ({args.target} in {fmt_name})" if self_draft else f"{args.draft} {fmt_name}"
        if keep is not None:
            label += f", layers {keep} ({len(keep)} of {target.cfg.num_layers})"
        if self_draft:
            label += ", the target's KV prefix" if share else ", its own KV prefix"
        methods: list[tuple[str, dict[str, Any]]] = [
            (f"specexec b={b}", dict(method="specexec", tree=TreeConfig(budget=b, early_stop=False))) for b in budgets
        ]
        methods.append((f"chain g={args.gamma}", dict(method="chain", chain=ChainConfig(gamma=args.gamma))))
        for mname, kw in methods:
            per_prompt: list[dict[str, Any]] = []
            for (kind, _), x, want in zip(prompts, ids, ar, strict=True):
                r = engine.generate(x, args.max_new_tokens, **kw)
                q: dict[str, Any] = {
                    "kind": kind,
                    "tokens": r.stats.new_tokens,
                    "steps": r.stats.steps,
                    "exact": r.tokens == want,
                }
                if not q["exact"]:
                    q["first_divergence"] = next(
                        (i for i, (a, b) in enumerate(zip(r.tokens, want, strict=False)) if a != b),
                        min(len(r.tokens), len(want)),
                    )
                per_prompt.append(q)
            row: dict[str, Any] = {"draft": name, "label": label, "method": mname, "per_prompt": per_prompt}
            if keep is not None:
                row["layers"] = keep
            if self_draft:
                row["shared_prefix"] = share
            for kind in ("code", "prose", "all"):
                sel = [q for q in per_prompt if kind in ("all", q["kind"])]
                row[f"tokens_per_step_{kind}"] = sum(q["tokens"] for q in sel) / max(1, sum(q["steps"] for q in sel))
            row["exact"] = all(q["exact"] for q in per_prompt)
            report["configs"].append(row)
            print(
                f"{name:10s} {mname:14s} code {row['tokens_per_step_code']:5.2f}  prose "
                f"{row['tokens_per_step_prose']:5.2f}  all {row['tokens_per_step_all']:5.2f}  "
                f"exact={row['exact']}",
                flush=True,
            )
        del draft
        report["all_exact"] = all(c["exact"] for c in report["configs"])
        if args.out is not None:  # after every draft: a long run that is stopped keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    return 0 if report["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
