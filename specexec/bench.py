"""``specexec bench``: a prompt set through every method and tree budget / chain length, with speed, tokens per
target pass, the draft/target time split, and an exactness check for free.

Each (method, budget or gamma) runs every prompt from a cold cache (``engine.reset()``; prefill is excluded from
tokens/s anyway). ``ar`` always runs first: it is the speed reference and, when decoding is greedy, the exactness
reference — every other run's tokens must equal AR's token for token (the ``mismatches`` column counts prompts
that differ; anything but 0 is a bug). The built-in prompts are read at run time from CPython's own standard
library (function headers + docstrings for code, ``pydoc_data`` topics for prose), so they need no download.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import logging
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from specexec.config import METHODS, ChainConfig, SamplingConfig, TreeConfig
from specexec.decoding.engine import Engine, Result
from specexec.errors import ConfigError, SpecexecError, setting

# ``default``: what ``generate`` / ``chat`` do with no tuning flags (specexec with --budget auto, or n-grams without
# a draft); ``ngram``: draft-free prompt lookup with its measured (auto) size choice
BENCH_METHODS = (*METHODS, "default")

log = logging.getLogger(__name__)

CODE_SOURCES = (
    "textwrap.dedent",
    "fnmatch.translate",
    "statistics.median",
    "heapq.nsmallest",
    "shlex.quote",
    "string.capwords",
)
PROSE_TOPICS = ("for", "with", "while", "try", "lambda", "assert")
SETS = ("code", "prose", "grounded")  # the benchmark scripts' prompt sets (:func:`prompt_sets`)
# Pure-Python stdlib modules whose public functions have docstrings (missing ones are skipped).
CODE_MODULES = (
    "textwrap", "fnmatch", "statistics", "heapq", "shlex", "string", "json", "base64", "calendar", "difflib",
    "glob", "posixpath", "colorsys", "html", "ipaddress", "linecache", "mimetypes", "pprint", "quopri", "shutil",
    "tempfile", "tokenize", "urllib.parse", "uuid", "gettext", "copy", "inspect", "secrets", "dataclasses",
    "functools", "keyword", "bisect", "random", "csv", "zipfile", "locale", "ntpath", "platform", "sysconfig",
    "warnings",
)  # fmt: skip
GROUNDED_TASKS = (
    ("hints", "Add type hints to this function. Reply with the complete function.\n\n```python\n{code}\n```"),
    (
        "rename",
        "Rewrite this code with clearer variable names, keeping its behaviour the same.\n\n```python\n{code}\n```",
    ),
    ("docstring", "Write a docstring for this function and show the function with it.\n\n```python\n{code}\n```"),
    ("translate", "Translate this Python function to JavaScript.\n\n```python\n{code}\n```"),
    ("summarize", "Summarize the following text in a short paragraph.\n\n{text}"),
)


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt; ``chat`` wraps it in the tokenizer's chat template as a user message."""

    name: str
    text: str
    chat: bool = False
    set: str = ""  # the prompt set it belongs to (:func:`prompt_sets`)


# ---------------------------------------------------------------------------------------------- prompts


def _code_prompt(qualname: str) -> Prompt | None:
    """A stdlib function's header and docstring (the model writes the body); None if its source is unavailable."""
    module, _, name = qualname.rpartition(".")
    try:
        src = inspect.getsource(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    node = ast.parse(src).body[0]
    lines = src.splitlines()
    first = node.body[0]  # type: ignore[attr-defined]
    end = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else node.lineno
    return Prompt(name=qualname, text="\n".join(lines[:end]) + "\n")


def _prose_prompt(topic: str, chars: int = 400) -> Prompt | None:
    """The opening of a ``pydoc_data`` topic (title dropped), cut at a sentence end; None if unavailable."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return None
    text = topics.get(topic)
    if not text:
        return None
    body = text.split("\n\n", 1)[-1].strip()  # drop the title and its underline
    cut = body[:chars]
    end = cut.rfind(". ")
    return Prompt(name=f"pydoc:{topic}", text=cut[: end + 1] if end > 80 else cut)


def builtin_prompts(n: int = 8) -> list[Prompt]:
    """Up to ``n`` prompts alternating code and prose, taken from this Python's standard library."""
    if n < 1:
        raise ConfigError("num_prompts", n, "must be >= 1")
    code = [p for p in map(_code_prompt, CODE_SOURCES) if p]
    prose = [p for p in map(_prose_prompt, PROSE_TOPICS) if p]
    mixed = [p for pair in zip(code, prose) for p in pair] + code[len(prose) :] + prose[len(code) :]
    if not mixed:
        raise SpecexecError(
            f"no built-in prompts: this Python lacks stdlib sources; pass {setting('prompts')} FILE.jsonl"
        )
    return mixed[:n]


def _stdlib_functions() -> list[tuple[str, Any, str]]:
    """(qualname, function, source) of public module-level pure-Python functions with a docstring, round-robin
    over CODE_MODULES so consecutive picks come from different modules."""
    per_module: list[list[tuple[str, Any, str]]] = []
    for modname in CODE_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        found = []
        for name, fn in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__ or not fn.__doc__:
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            found.append((f"{modname}.{name}", fn, src))
        if found:
            per_module.append(found)
    out = []
    for i in range(max((len(f) for f in per_module), default=0)):
        out += [f[i] for f in per_module if i < len(f)]
    return out


def _header_and_docstring(src: str) -> str | None:
    """A function's signature and docstring (the model writes the body); None when it has no body after them."""
    src = textwrap.dedent(src)
    try:
        node = ast.parse(src).body[0]
    except SyntaxError:
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
        return None
    first = node.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return None
    return "\n".join(src.splitlines()[: first.end_lineno]) + "\n"


def _without_docstring(src: str) -> str:
    """A function's source (from :func:`_header_and_docstring`'s checks) with its docstring cut out."""
    src = textwrap.dedent(src)
    node = ast.parse(src).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    first = node.body[0]
    lines = src.splitlines()
    return "\n".join(lines[: first.lineno - 1] + lines[first.end_lineno :])


def _pydoc_texts(chars: int) -> list[tuple[str, str]]:
    """(topic, text) from ``pydoc_data``: each topic's opening (title dropped) cut at a sentence end."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    out = []
    for topic in sorted(topics):
        body = topics[topic].split("\n\n", 1)[-1].strip()
        if len(body) < 300:
            continue
        cut = body[:chars]
        end = cut.rfind(". ")
        out.append((topic, cut[: end + 1] if end > chars // 3 else cut))
    return out


def _spread(items: list, n: int) -> list:
    """``n`` items spread evenly over the list (deterministic)."""
    if len(items) <= n:
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def prompt_sets(sets: tuple[str, ...], n: int) -> dict[str, list[Prompt]]:
    """Up to ``n`` prompts of each of ``sets`` (from :data:`SETS`), built from this Python's standard library:
    ``code`` (function headers + docstrings, raw completion), ``prose`` (``pydoc_data`` topic openings, raw
    completion), ``grounded`` (chat requests that carry the material to work on: a function to annotate, rename,
    document or translate, a text to summarize). The same prompts on every run of one Python."""
    funcs = _stdlib_functions()
    out: dict[str, list[Prompt]] = {}
    code = [Prompt(q, h, set="code") for q, _, s in funcs if (h := _header_and_docstring(s))][:n]
    if "code" in sets:
        out["code"] = code
    if "prose" in sets:
        out["prose"] = [Prompt(f"pydoc:{t}", x, set="prose") for t, x in _spread(_pydoc_texts(500), n)]
    if "grounded" in sets:
        # whole functions of moderate size (at least 5 lines of code besides the docstring), not in the code set
        used = {p.name for p in code}  # the same choice whichever sets run
        bodies = [
            (q, s)
            for q, _, s in funcs
            if q not in used
            and len(s) <= 2000
            and _header_and_docstring(s)
            and _without_docstring(s).strip().count("\n") >= 5
        ]
        texts = _pydoc_texts(1500)
        texts = texts[len(texts) // 2 :] + texts[: len(texts) // 2]  # not the same openings as the prose set
        grounded, bi, ti = [], 0, 0
        for i in range(n):
            kind, template = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
            if kind == "summarize":
                if ti >= len(texts):
                    continue
                topic, text = texts[ti]
                ti += 1
                grounded.append(Prompt(f"{kind}:pydoc:{topic}", template.format(text=text), True, "grounded"))
            else:
                if bi >= len(bodies):
                    continue
                q, src = bodies[bi]
                bi += 1
                given = _without_docstring(src) if kind == "docstring" else textwrap.dedent(src)
                grounded.append(Prompt(f"{kind}:{q}", template.format(code=given.rstrip()), True, "grounded"))
        out["grounded"] = grounded
    for s in sets:
        if len(out.get(s, [])) < n:
            log.warning("only %d %s prompts available (asked %d)", len(out.get(s, [])), s, n)
    return out


def load_prompts(path: Path) -> list[Prompt]:
    """Prompts from a JSONL file: one ``{"prompt": str, "chat": bool?, "name": str?}`` object per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SpecexecError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SpecexecError(f"prompts file {path} is not valid UTF-8 (byte {e.start})") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecexecError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise SpecexecError(f'{path}:{i}: expected an object with a non-empty "prompt" string')
        out.append(Prompt(name=str(obj.get("name", f"line{i}")), text=obj["prompt"], chat=bool(obj.get("chat"))))
    if not out:
        raise SpecexecError(f"{path} holds no prompts")
    return out


def parse_ints(text: str, option: str) -> tuple[int, ...]:
    """``"16,64,256"`` → (16, 64, 256); a clear error for anything else."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SpecexecError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise SpecexecError(f"{option} is empty")
    return values


# ---------------------------------------------------------------------------------------------- config and results


@dataclass(frozen=True)
class BenchConfig:
    """What to run: methods × (budgets for specexec, gammas for chain), each over every prompt."""

    methods: tuple[str, ...] = ("ar", "chain", "specexec")
    budgets: tuple[int, ...] = (16, 64, 256)
    gammas: tuple[int, ...] = (2, 4)
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)  # beams/branch/depth for every budget

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in BENCH_METHODS]
        if unknown:
            raise ConfigError(
                "methods",
                ",".join(unknown),
                f"must be among {', '.join(BENCH_METHODS)}",
                f"unknown method(s) {', '.join(unknown)} in {setting('methods')}; "
                f"choose from {', '.join(BENCH_METHODS)}",
            )
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", self.max_new_tokens, "must be >= 1")
        for b in self.budgets:
            replace(self.tree, budget=b, auto=False)  # validates each budget (ValueError)
        for g in self.gammas:
            ChainConfig(gamma=g)

    def runs(self) -> list[tuple[str, int | None]]:
        """(method, budget or gamma) in order; ``ar`` first, always (the reference)."""
        out: list[tuple[str, int | None]] = [("ar", None)]
        if "chain" in self.methods:
            out += [("chain", g) for g in self.gammas]
        if "specexec" in self.methods:
            out += [("specexec", b) for b in self.budgets]
        out += [(m, None) for m in ("ngram", "default") if m in self.methods]
        return out


@dataclass
class Row:
    """One (method, budget/gamma) over all prompts. Speeds count decoding only (prefill excluded)."""

    method: str
    param: int | None  # budget (specexec) or gamma (chain)
    prompts: int
    new_tokens: int
    steps: int
    tokens_per_step: float
    tokens_per_s: float
    draft_s: float
    target_s: float
    decode_s: float
    ngram_tokens: int = 0  # of new_tokens: those from merged prompt-lookup nodes (the draft's trees lacked them)
    speedup: float | None = None  # tokens/s over AR's
    mismatches: int | None = None  # prompts whose tokens differ from AR's (greedy only; None when sampling)

    @property
    def label(self) -> str:
        if self.param is None:
            return "-"
        return f"budget {self.param}" if self.method == "specexec" else f"gamma {self.param}"


@dataclass
class BenchReport:
    target: str
    draft: str | None
    device: str
    config: dict[str, Any]
    prompts: list[dict[str, Any]]
    rows: list[Row]
    per_prompt: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for row, r in zip(d["rows"], self.rows):
            row["label"] = r.label
        return d


# ---------------------------------------------------------------------------------------------- running


def _one(
    engine: Engine, prompt: Prompt, method: str, param: int | None, cfg: BenchConfig, max_new: int | None = None
) -> Result:
    """One prompt, cold cache."""
    engine.reset()
    tree = replace(cfg.tree, budget=param, auto=False) if method == "specexec" and param else cfg.tree
    if method in ("ngram", "default"):  # their measured choice of size, as generate/chat run them
        tree = replace(cfg.tree, auto=True)
    chain = ChainConfig(gamma=param) if method == "chain" and param else ChainConfig()
    return engine.generate(
        prompt.text,
        max_new or cfg.max_new_tokens,
        method=None if method == "default" else method,
        sampling_cfg=cfg.sampling,
        tree=tree,
        chain=chain,
        chat=prompt.chat,
    )


def _row(method: str, param: int | None, results: list[Result]) -> Row:
    st = [r.stats for r in results]
    new, steps = sum(s.new_tokens for s in st), sum(s.steps for s in st)
    decode = sum(s.wall_s - s.prefill_s for s in st)
    return Row(
        method=method,
        param=param,
        prompts=len(results),
        new_tokens=new,
        steps=steps,
        tokens_per_step=new / max(steps, 1),
        tokens_per_s=new / decode if decode > 0 else 0.0,
        draft_s=sum(s.draft_s for s in st),
        target_s=sum(s.target_s for s in st),
        decode_s=decode,
        ngram_tokens=sum(s.ngram_tokens for s in st),
    )


def run_bench(
    engine: Engine,
    prompts: list[Prompt],
    cfg: BenchConfig,
    target: str = "",
    draft: str | None = None,
    on_run: Callable[[str], None] | None = None,
) -> BenchReport:
    """Run every (method, param) over every prompt; ``on_run(label)`` is called after each (method, param, prompt)."""
    runs = cfg.runs()
    if engine.draft is None and any(m in ("chain", "specexec") for m, _ in runs):
        raise SpecexecError(
            f"bench: chain and specexec need a draft model ({setting('draft')}), or use {setting('methods', 'ar')}"
        )
    for method in dict.fromkeys(m for m, _ in runs):  # warm-up: allocations, kernels, lazy imports
        _one(engine, prompts[0], method, max(cfg.budgets) if method == "specexec" else None, cfg, max_new=4)
    rows, per_prompt, ref = [], [], None
    for method, param in runs:
        results = []
        for p in prompts:
            r = _one(engine, p, method, param, cfg)
            results.append(r)
            per_prompt.append(
                {
                    "prompt": p.name,
                    "method": method,
                    "param": param,
                    "new_tokens": len(r.tokens),
                    "steps": r.stats.steps,
                    "tokens_per_s": r.stats.tokens_per_s,
                    "tokens_per_step": r.stats.tokens_per_step,
                    "match_ar": None
                    if ref is None or not cfg.sampling.greedy
                    else r.tokens == ref[len(results) - 1].tokens,
                }
            )
            if on_run:
                on_run(f"{method} {param or ''}".strip())
        row = _row(method, param, results)
        if ref is None:
            ref, ar_speed = results, row.tokens_per_s
        row.speedup = row.tokens_per_s / ar_speed if ar_speed > 0 else None
        if cfg.sampling.greedy:
            row.mismatches = sum(a.tokens != b.tokens for a, b in zip(results, ref))
        rows.append(row)
    config = {
        "methods": list(cfg.methods),
        "budgets": list(cfg.budgets),
        "gammas": list(cfg.gammas),
        "max_new_tokens": cfg.max_new_tokens,
        "sampling": asdict(cfg.sampling),
        "tree": asdict(cfg.tree),
        "context": engine.context,
    }
    return BenchReport(
        target=target,
        draft=draft,
        device=str(engine.target.device),
        config=config,
        prompts=[{"name": p.name, "chat": p.chat, "chars": len(p.text)} for p in prompts],
        rows=rows,
        per_prompt=per_prompt,
    )


def total_runs(cfg: BenchConfig, prompts: list[Prompt]) -> int:
    """How many generations :func:`run_bench` times (for progress bars)."""
    return len(cfg.runs()) * len(prompts)


# ---------------------------------------------------------------------------------------------- output


def save_json(report: BenchReport, path: Path) -> None:
    try:
        path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    except OSError as e:
        raise SpecexecError(f"cannot write {path}: {e.strerror or e}") from None


def plot(report: BenchReport, path: Path) -> None:
    """tokens/s and tokens/step vs budget (specexec), with AR and each chain gamma as horizontal lines."""
    try:
        import matplotlib
    except ImportError:
        raise SpecexecError(f"{setting('plot')} needs matplotlib (pip install 'specexec[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = sorted((r for r in report.rows if r.method == "specexec"), key=lambda r: r.param or 0)
    others = [r for r in report.rows if r.method != "specexec"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, attr, title in ((axes[0], "tokens_per_s", "tokens / s"), (axes[1], "tokens_per_step", "tokens / step")):
        if spec:
            ax.plot([r.param for r in spec], [getattr(r, attr) for r in spec], "o-", label="specexec")
            ax.set_xscale("log", base=2)
            ax.set_xticks([r.param for r in spec], [str(r.param) for r in spec])
        for i, r in enumerate(others):
            name = "ar" if r.method == "ar" else f"chain γ={r.param}"
            ax.axhline(getattr(r, attr), linestyle="--" if r.method == "ar" else ":", color=f"C{i + 1}", label=name)
        ax.set_xlabel("budget (draft tokens per tree)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report.target} + {report.draft or 'no draft'} on {report.device}", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise SpecexecError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
