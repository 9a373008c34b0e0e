"""``specexec generate``: one prompt in, streamed text (or one JSON object) out."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Optional

import typer

from specexec.cli.common import early_stop_option, guarded, setup_logging
from specexec.config import METHODS, ChainConfig, SamplingConfig, TreeConfig
from specexec.errors import SpecexecError

DEMO_TARGET = "qwen2.5-coder-1.5b"


def read_prompt(prompt: str) -> str:
    """``-`` reads the prompt from stdin (must be UTF-8)."""
    if prompt != "-":
        return prompt
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecexecError(f"the prompt on stdin is not valid UTF-8 (byte {e.start})") from None


def tree_config(budget: str, max_budget: int, max_beams: int, max_branch: int, max_depth: int,
                early_stop: bool | None = None) -> TreeConfig:
    """``--budget auto|N`` and friends → TreeConfig (auto starts at 64, capped by --max-budget)."""
    if budget == "auto":
        return TreeConfig(budget=min(64, max_budget), auto=True, max_budget=max_budget, max_beams=max_beams,
                          max_branch=max_branch, max_depth=max_depth, early_stop=early_stop)
    try:
        b = int(budget)
    except ValueError:
        raise SpecexecError(f"--budget must be a positive integer or 'auto', got {budget!r}") from None
    return TreeConfig(budget=b, max_beams=max_beams, max_branch=max_branch, max_depth=max_depth,
                      early_stop=early_stop)


def offload_config(mode: str, gpu_memory: float | None, target_dtype: str):
    """``--offload/--gpu-memory/--target-dtype`` → OffloadConfig (validated there)."""
    from offload import OffloadConfig

    return OffloadConfig(mode=mode, gpu_memory_gb=gpu_memory, target_dtype=target_dtype)


def stats_line(stats: dict) -> str:
    s = stats
    auto = "auto→" if s.get("budget_auto") else ""
    extra = f" budget={auto}{s['budget']}" if s.get("budget") else (f" gamma={s['gamma']}" if s.get("gamma") else "")
    return (f"[{s['method']}{extra}] {s['new_tokens']} tokens in {s['steps']} steps "
            f"({s['tokens_per_step']:.2f} tok/step), {s['tokens_per_s']:.2f} tok/s, "
            f"draft {s['draft_s']:.2f}s, target {s['target_s']:.2f}s, prefill {s['prefill_s']:.2f}s, "
            f"wall {s['wall_s']:.2f}s")


def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (raw unless --chat); '-' reads stdin."),
    target: str = typer.Option(DEMO_TARGET, "--target", "-t", help="Target model: alias, HF id or local path."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model (alias, HF id or path)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Stop after this many new tokens."),
    method: Optional[str] = typer.Option(
        None, "--method", "-m", help=f"One of {', '.join(METHODS)} (default: specexec with a draft, else ar)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (exactly the target's greedy output)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min-p x the top probability (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (same seed, same output)."),
    samples: int = typer.Option(
        1, "--samples", help="Draw N independent samples in one run (models load once); sample i uses seed + i "
        "when --seed is given. With --json and N > 1: JSON Lines, one object per sample per line."),
    budget: str = typer.Option(
        "auto", "--budget", help="SpecExec: draft tokens per tree, or 'auto' (best expected tokens/s, measured)."),
    max_budget: int = typer.Option(2048, "--max-budget", help="SpecExec: upper limit for --budget auto."),
    max_beams: int = typer.Option(128, "--max-beams", help="SpecExec: nodes expanded per draft pass."),
    max_branch: int = typer.Option(32, "--max-branch", help="SpecExec: children proposed per expanded node."),
    max_depth: int = typer.Option(32, "--max-depth", help="SpecExec: most draft passes per tree."),
    early_stop: Optional[bool] = early_stop_option(),
    gamma: int = typer.Option(4, "--gamma", help="Chain: draft tokens per step."),
    context: int = typer.Option(4096, "--context", help="Longest prompt + answer the KV caches hold (tokens)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto (bf16 on GPU, fp32 on CPU), fp32, bf16, fp16."),
    offload: str = typer.Option("auto", "--offload", help="Target placement: auto, none (all on GPU), ram, ssd."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", help="Cap on the GPU memory used, in GB."),
    target_dtype: str = typer.Option("auto", "--target-dtype", help="Target weights: auto, bf16, fp16, nf4."),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype", help="Draft dtype (default: --dtype)."),
    as_json: bool = typer.Option(
        False, "--json", help="Print exactly one JSON object on stdout (with --samples N: one per line)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars or stats line."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Generate a continuation of one prompt."""
    setup_logging(verbose, quiet)

    def run() -> None:
        import specexec.api as api

        text = read_prompt(prompt)
        samp = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        tree = tree_config(budget, max_budget, max_beams, max_branch, max_depth, early_stop)
        chain_cfg = ChainConfig(gamma=gamma)
        if method is not None and method not in METHODS:
            raise SpecexecError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        if samples < 1:
            raise SpecexecError(f"--samples must be >= 1, got {samples}")
        engine = api.load(target, draft, device=device, dtype=dtype, draft_dtype=draft_dtype, context=context,
                          offload=offload_config(offload, gpu_memory, target_dtype), tree=tree,
                          progress=not quiet and not as_json)
        for i in range(samples):
            samp_i = replace(samp, seed=None if seed is None else seed + i)
            if samples > 1 and not as_json:
                sys.stdout.write(f"----- sample {i + 1} of {samples} -----\n")
            g = engine.stream(text, max_new_tokens, method=method, sampling_cfg=samp_i, tree=tree, chain=chain_cfg,
                              chat=chat)
            for piece in g:
                if not as_json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            assert g.result is not None
            if as_json:
                sys.stdout.write(json.dumps(g.result.to_json()) + "\n")
                sys.stdout.flush()
            else:
                sys.stdout.write("\n")
                if not quiet:
                    typer.echo(stats_line(g.result.stats.to_json()), err=True)

    guarded(run)
