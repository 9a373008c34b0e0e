#!/usr/bin/env python
"""Our plain autoregressive decoding vs transformers' ``generate`` on the same model, CPU, one run.

Both decode greedily from the same HF-format directory in fp32 (transformers: ``AutoModelForCausalLM`` with
``dtype=torch.float32``, ``use_cache=True``, ``do_sample=False``; ours: ``Engine.generate(method="ar")``), the
same prompts, the same ``max_new_tokens``. Each prompt is run by both back to back (alternating which goes
first, so load from other processes on a shared machine hits both alike), after one warm-up call each.
Reported: tokens/s of each, measured over the whole call (prefill included, as a user sees it), their ratio,
our decode-only tokens/s from our stats, and whether the token ids are identical (they must be: same weights,
same arithmetic up to fp32 rounding).

To fit beside other work in RAM, our model by default computes from transformers' own tensors (see
:func:`shared_transformer`: one fp32 copy, ~6 GB for 1.5B, instead of two); ``--separate-weights`` loads ours
with our loader instead. Where the weights live does not change either side's arithmetic or speed.

    nice -n 10 python scripts/bench_ar.py --out docs/bench_ar.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

PROMPTS = (
    "def quicksort(arr):",
    'import json\n\n\ndef load_config(path):\n    """Read a JSON config file and return a dict."""\n',
    "The history of the printing press begins in",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="model alias, HF dir or HF id")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and implementation")
    p.add_argument("--context", type=int, default=4096, help="our engine's context (prompt + answer)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument(
        "--separate-weights",
        action="store_true",
        help="load our model with our own loader (2x the RAM) instead of sharing transformers' tensors",
    )
    p.add_argument("--out", default="docs/bench_ar.json", help="JSON output path")
    return p.parse_args(argv)


def shared_transformer(hf: Any, path: Path) -> Any:
    """Our :class:`Transformer` over the very tensors of the transformers model (no second copy in RAM).

    Our layers want fused q/k/v and gate/up matrices: each is built once and transformers' q/k/v (gate/up)
    parameters are re-pointed at row slices of it (contiguous views), so both models compute from one storage.
    Everything else is shared as is. Values are bit-identical to what our own loader produces (fp16 -> fp32).
    """
    import torch

    from specexec.loading.checkpoint import read_config
    from specexec.model.transformer import Globals, ResidentLayers, Transformer

    def share(mods: list[Any], attr: str) -> torch.Tensor:
        fused = torch.cat([getattr(m, attr).detach() for m in mods])
        start = 0
        for m in mods:
            rows = getattr(m, attr).shape[0]
            setattr(m, attr, torch.nn.Parameter(fused[start : start + rows], requires_grad=False))
            start += rows
        return fused

    cfg = read_config(path)
    layers = []
    for blk in hf.model.layers:
        a, mlp = blk.self_attn, blk.mlp
        qkv = [a.q_proj, a.k_proj, a.v_proj]
        w = {
            "attn_norm": blk.input_layernorm.weight.detach(),
            "wqkv": share(qkv, "weight"),
            "wo": a.o_proj.weight.detach(),
            "mlp_norm": blk.post_attention_layernorm.weight.detach(),
            "w13": share([mlp.gate_proj, mlp.up_proj], "weight"),
            "w2": mlp.down_proj.weight.detach(),
        }
        if cfg.qkv_bias:
            w["bqkv"] = share(qkv, "bias")
        layers.append(w)
    embed = hf.model.embed_tokens.weight.detach()
    lm = hf.lm_head.weight.detach()
    glob = Globals(embed=embed, norm=hf.model.norm.weight.detach(), lm_head=embed if cfg.tie_word_embeddings else lm)
    return Transformer(
        cfg=cfg, globals=glob, layers=ResidentLayers(layers), device=torch.device("cpu"), dtype=torch.float32
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall0 = time.perf_counter()
    load_start = os.getloadavg()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from specexec import api
    from specexec.decoding.engine import Engine
    from specexec.loading import hub
    from specexec.loading.checkpoint import load_tokenizer, model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    path = model_dir(hub.resolve(args.target))
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.separate_weights:
        engine = api.load(str(path), None, device="cpu", dtype="fp32", context=args.context, progress=False)
    else:
        engine = Engine(shared_transformer(hf, path), load_tokenizer(path), context=args.context)
    ours_load = time.perf_counter() - t0
    tok = engine.tokenizer.tokenizer
    hf.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = sorted(engine.tokenizer.eos_ids)

    def run_ours(ids: list[int], n: int) -> tuple[list[int], float, float]:
        engine.reset()
        t = time.perf_counter()
        r = engine.generate(ids, n, method="ar")
        return r.tokens, time.perf_counter() - t, r.stats.tokens_per_s

    @torch.inference_mode()
    def run_hf(ids: list[int], n: int) -> tuple[list[int], float]:
        x = torch.tensor([ids])
        t = time.perf_counter()
        out = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            use_cache=True,
            eos_token_id=eos,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        return out[0, len(ids) :].tolist(), time.perf_counter() - t

    warm = engine.encode("def f(x):")
    run_ours(warm, 4)
    run_hf(warm, 4)

    rows = []
    for i, prompt in enumerate(PROMPTS[: args.prompts]):
        ids = engine.encode(prompt)
        ours_s, hf_s, ours_dec = [], [], []
        for rep in range(args.repeats):
            order = ("ours", "hf") if (i + rep) % 2 == 0 else ("hf", "ours")
            for who in order:
                if who == "ours":
                    o_tok, s, dec = run_ours(ids, args.new_tokens)
                    ours_s.append(s)
                    ours_dec.append(dec)
                else:
                    h_tok, s = run_hf(ids, args.new_tokens)
                    hf_s.append(s)
        n = len(o_tok)
        row = {
            "prompt": prompt,
            "prompt_tokens": len(ids),
            "new_tokens": n,
            "hf_new_tokens": len(h_tok),
            "identical": o_tok == h_tok,
            "ours_s": statistics.median(ours_s),
            "hf_s": statistics.median(hf_s),
            "ours_tok_s": n / statistics.median(ours_s),
            "hf_tok_s": len(h_tok) / statistics.median(hf_s),
            "ours_decode_tok_s": statistics.median(ours_dec),
        }
        if not row["identical"]:
            k = next((j for j, (a, b) in enumerate(zip(o_tok, h_tok)) if a != b), min(len(o_tok), len(h_tok)))
            row["first_difference"] = k
        rows.append(row)
        print(
            f"[{i + 1}/{args.prompts}] ours {row['ours_tok_s']:.2f} tok/s, transformers {row['hf_tok_s']:.2f} "
            f"tok/s, identical={row['identical']}",
            flush=True,
        )

    ours_total = sum(r["new_tokens"] for r in rows) / sum(r["ours_s"] for r in rows)
    hf_total = sum(r["hf_new_tokens"] for r in rows) / sum(r["hf_s"] for r in rows)
    summary = {
        "ours_tok_s": ours_total,
        "hf_tok_s": hf_total,
        "ratio": ours_total / hf_total,
        "all_identical": all(r["identical"] for r in rows),
        "goal": "ours >= 1.0x transformers",
        "goal_met": ours_total / hf_total >= 1.0,
    }
    report: dict[str, Any] = {
        "what": "greedy AR decoding, ours (Engine method=ar) vs transformers generate(use_cache=True), fp32, CPU; "
        "tokens/s over the whole call (prefill included); median of --repeats runs",
        "target": args.target,
        "path": str(path),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_s": {"ours": ours_load, "transformers": hf_load},
        "weights": "ours loaded separately" if args.separate_weights else "ours shares transformers' tensors",
        "rows": rows,
        "summary": summary,
        "loadavg_start_end": [load_start, os.getloadavg()],
        "wall_s": time.perf_counter() - wall0,
    }

    print()
    print("| prompt | prompt tokens | new tokens | ours tok/s | transformers tok/s | ratio | identical ids |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        name = r["prompt"].splitlines()[0][:32].replace("|", "\\|")
        print(
            f"| `{name}` | {r['prompt_tokens']} | {r['new_tokens']} | {r['ours_tok_s']:.2f} | {r['hf_tok_s']:.2f} "
            f"| {r['ours_tok_s'] / r['hf_tok_s']:.2f}x | {'yes' if r['identical'] else 'NO'} |"
        )
    print(
        f"| **all** | | {sum(r['new_tokens'] for r in rows)} | **{ours_total:.2f}** | **{hf_total:.2f}** "
        f"| **{summary['ratio']:.2f}x** | {'yes' if summary['all_identical'] else 'NO'} |"
    )
    print(
        f"\ngoal ours >= 1.0x transformers: {'met' if summary['goal_met'] else 'NOT met'} "
        f"({summary['ratio']:.2f}x); token ids identical: {summary['all_identical']}"
    )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if summary["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
