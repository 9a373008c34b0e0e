"""Medusa-style heads: proposals from the target's own last hidden state, no draft model.

Head k (k = 1..K) maps the target's final (normed) hidden state h at a position to a guess of the token k + 1
places ahead: ``x_k = h + silu(h A_k B_k + c_k)`` (a low-rank residual block, Cai et al. 2024, "Medusa"), scored by
the target's own output layer restricted to a frequency-ranked token subset (``ids``; its rows are the target's,
shared, never trained). The verify pass already computes h for every node; the decode loop hands the proposer the
row of the last accepted node, whose own logits chose the pending token, so head 1 guesses the token after it.

A proposal is the tree of the ``budget`` most probable head paths (top tokens per head, a path's score the sum of
its heads' log-probs: Medusa's candidate tree, grown best-first), rooted at the pending token. The exact tree walk
verifies it, never Medusa's lossy "typical acceptance": greedy output is the target's greedy decoding, sampling
its distribution. A head proposal costs K small products and K output-layer slices, far below a draft model's pass.

Heads are trained by self-distillation (:func:`train`): over local text the frozen target computes h and its own
greedy prediction at every position; head k learns the target's prediction k places ahead. Trained heads are kept
under ``<cache home>/heads/`` keyed by the target's weights (:func:`target_key`); the demo target's heads ship in
the package (``specexec/configs/heads``).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specexec.decoding.tree import Tree
from specexec.errors import SpecexecError
from specexec.formats.dense import linear
from specexec.propose.base import Proposal, StepContext

log = logging.getLogger(__name__)

HEADS = 3  # heads: guesses 2, 3 and 4 tokens ahead (the target's own logits give the next one)
RANK = 256  # the residual block's rank
VOCAB = 16384  # the frequency-ranked token ids the heads score
TOP = 8  # candidates per head a proposal draws from
STEPS_PER_PASS = 8  # optimizer steps after each target pass over a chunk
FEATURE_BYTES = 512 << 20  # the most hidden states (bf16) a training run keeps to draw its batches from
SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "heads"


@dataclass
class Heads:
    """K heads' weights: ``a`` (K, D, r), ``b`` (K, r, D), ``c`` (K, D) and the token ids they score (V',)."""

    a: Tensor
    b: Tensor
    c: Tensor
    ids: Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def new(cls, hidden: int, ids: Tensor, heads: int = HEADS, rank: int = RANK, seed: int = 0) -> Heads:
        """Untrained heads: each block starts at the identity (``b`` zero), i.e. every head guesses what the
        target's own output layer would say at the position (Medusa's initialisation)."""
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(heads, hidden, rank, generator=gen) / math.sqrt(hidden)
        return cls(a, torch.zeros(heads, rank, hidden), torch.zeros(heads, hidden), ids.long())

    @property
    def k(self) -> int:
        return self.a.shape[0]

    def blocks(self, h: Tensor) -> Tensor:
        """h (n, D) -> every head's residual output (n, K, D)."""
        x = h.float()
        z = torch.einsum("nd,kdr->nkr", x, self.a.float())
        z = torch.einsum("nkr,krd->nkd", z, self.b.float()) + self.c.float()
        return x[:, None, :] + F.silu(z)

    def parameters(self) -> list[Tensor]:
        return [self.a, self.b, self.c]

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tensors = {
            "a": self.a.detach().to(torch.bfloat16).contiguous(),
            "b": self.b.detach().to(torch.bfloat16).contiguous(),
            "c": self.c.detach().float().contiguous(),
            "ids": self.ids.to(torch.int32).contiguous(),
        }
        save_file(tensors, str(tmp), metadata={"specexec_heads": json.dumps(self.meta)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Heads:
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("specexec_heads", "{}"))
                t = {k: f.get_tensor(k) for k in ("a", "b", "c", "ids")}
        except Exception as e:  # noqa: BLE001  (safetensors raises several types for a damaged file)
            raise SpecexecError(f"cannot read heads from {path}: {e}") from None
        return cls(t["a"].float(), t["b"].float(), t["c"].float(), t["ids"].long(), meta)


# ---------------------------------------------------------------------------------------------- where heads live


def target_key(model_dir: Path) -> str:
    """A key for a target's weights: its config's shapes and a hash of its first embedding rows (as stored), so
    heads trained on one checkpoint are never used on another."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    h = hashlib.sha256()
    for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"):
        h.update(f"{k}={cfg.get(k)};".encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.embed_tokens.weight" in st.keys():
                rows = st.get_slice("model.embed_tokens.weight")[:16]
                h.update(rows.float().numpy().tobytes())
                break
    return h.hexdigest()[:16]


def heads_path(model_dir: Path, home: Path | None = None) -> Path:
    """Where trained heads for this target are kept in the cache."""
    from specexec.home import cache_home

    return cache_home(home) / "heads" / f"{target_key(model_dir)}.safetensors"


def find_heads(model_dir: Path, home: Path | None = None) -> Path | None:
    """Trained heads for this target: the cache's, else the package's (the demo target's); None: none."""
    key = target_key(model_dir)
    for p in (heads_path(model_dir, home), *sorted(SHIPPED.glob(f"*{key}.safetensors"))):
        if p.is_file():
            return p
    return None


# ---------------------------------------------------------------------------------------------- the proposer


class HeadsDraft:
    """Proposals from :class:`Heads` on the last accepted node's hidden state (``ctx.budget`` nodes; 0: none)."""

    name = "heads"
    wants_hidden = True  # the decode loop hands :meth:`commit` the accepted node's final hidden state

    def __init__(self, heads: Heads, lm_head: Any, device: torch.device) -> None:
        self.heads = Heads(heads.a.to(device), heads.b.to(device), heads.c.to(device), heads.ids.to(device), heads.meta)
        self.device = device
        ids = self.heads.ids
        self._ids = ids
        if isinstance(lm_head, Tensor):
            self._rows: Any = lm_head[ids]
        elif hasattr(lm_head, "subset"):  # int8: the same rows, the same kernel
            self._rows = lm_head.subset(ids)
        else:  # NF4: its rows dequantized once (V' x D)
            self._rows = lm_head.dequantize()[ids]
        self._hidden: Tensor | None = None

    def begin(self, seq: list[int]) -> None:
        self._hidden = None  # the first step verifies the root alone; its pass gives the hidden state

    def guesses(self, hidden: Tensor, top: int) -> tuple[Tensor, Tensor]:
        """Each head's ``top`` most probable tokens (K, top) and their log-probs (K, top)."""
        x = self.heads.blocks(hidden[None])[0]  # (K, D)
        rows = self._rows
        if isinstance(rows, Tensor):
            x = x.to(rows.dtype)
        elif getattr(rows, "kernel", "") == "int8pack":  # a CPU target's int8 weights: bf16 activations
            x = x.to(torch.bfloat16)
        logits = linear(x, rows)
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp, idx = logp.topk(min(top, logp.shape[-1]), dim=-1)
        return self._ids[idx], lp

    def propose(self, seq: list[int], ctx: StepContext) -> Proposal:
        budget = max(ctx.budget, 0)
        tree = Tree(seq[-1], budget + 1, self.device)
        if budget == 0 or self._hidden is None:
            return Proposal(tree, budget=ctx.budget, source=self.name)
        tokens, lp = self.guesses(self._hidden, min(TOP, budget))
        tok, logp = tokens.tolist(), lp.tolist()
        parents, toks, depths, scores = _best_paths(tok, logp, budget)
        if parents:
            tree.append(parents, toks, depths, scores)
        prop = Proposal(tree, budget=ctx.budget, source=self.name)
        prop.trim(ctx.trim)
        return prop

    def commit(self, proposal: Proposal, path: list[int], seq: list[int]) -> None:
        self._hidden = getattr(proposal, "hidden", None)


def _best_paths(tok: list[list[int]], logp: list[list[float]], budget: int) -> tuple[list, list, list, list]:
    """The ``budget`` most probable paths through the heads' guesses, best first, as tree nodes below the root
    (node 0): (parents, tokens, depths, cumulative log-probs). A path's children score no more than it, so the
    set is closed under prefixes."""
    K = len(tok)
    heap: list[tuple[float, int, int, int]] = [
        (-logp[0][j], 0, 0, j) for j in range(len(tok[0]))
    ]  # (-s, parent, depth, j)
    heapq.heapify(heap)
    parents: list[int] = []
    toks: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    while heap and len(toks) < budget:
        neg, parent, d, j = heapq.heappop(heap)
        node = len(toks) + 1
        parents.append(parent)
        toks.append(tok[d][j])
        depths.append(d + 1)
        scores.append(-neg)
        if d + 1 < K:
            for jj in range(len(tok[d + 1])):
                heapq.heappush(heap, (neg - logp[d + 1][jj], node, d + 1, jj))
    return parents, toks, depths, scores


# ---------------------------------------------------------------------------------------------- training


def stdlib_texts() -> Iterable[str]:
    """Local text that needs no download: the Python standard library's sources, then pydoc's topic texts."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(root.glob("*.py")):
        try:
            yield p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    try:
        from pydoc_data.topics import topics

        yield from (topics[k] for k in sorted(topics))
    except ImportError:
        return


def path_texts(path: Path) -> Iterable[str]:
    """Text from a file, or every text file under a directory (sorted; undecodable files skipped)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        try:
            yield p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


@dataclass
class TrainState:
    """What a training run has done (saved beside the heads, so a run resumes where the last one stopped)."""

    chunks: int = 0  # text chunks the target has read
    steps: int = 0  # optimizer steps
    tokens: int = 0  # positions seen
    seconds: float = 0.0
    loss: list[float] = field(default_factory=list)  # per head, the latest EMA
    acc: list[float] = field(default_factory=list)  # per head, the EMA of top-1 agreement with the target


def train(
    model: Any,
    tokenize: Callable[[str], list[int]],
    texts: Iterable[str],
    out: Path,
    ids: Tensor,
    max_minutes: float = 20.0,
    chunk: int = 256,
    batch: int = 256,
    lr: float = 2e-3,
    progress: Callable[[TrainState, float], None] | None = None,
    key: str = "",
    max_steps: int | None = None,
) -> tuple[Heads, TrainState]:
    """Self-distil heads from ``model`` (a :class:`~specexec.model.transformer.Transformer`) over ``texts`` for at
    most ``max_minutes``, resuming from ``out`` when it holds a run for the same key; saves to ``out`` as it goes
    (every minute and at the end). Each text chunk of ``chunk`` tokens is one target pass (hidden states and the
    target's own greedy tokens); each pass is followed by optimizer steps over the positions collected so far.
    ``max_steps``: also stop once this many optimizer steps are done in all (a fixed amount of work: the same heads
    on any machine, whatever its speed). Batches are drawn from a generator seeded by the step count."""
    heads, state, opt_state = _resume(out, model.cfg.hidden_size, ids, key)
    params = [p.requires_grad_(True) for p in heads.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if opt_state is not None:
        try:
            opt.load_state_dict({**opt_state, "param_groups": opt.state_dict()["param_groups"]})
        except (ValueError, KeyError, RuntimeError):
            pass
    rows = model.globals.lm_head
    lm = (rows.subset(ids).dequantize() if hasattr(rows, "subset") else rows[ids]).float()  # (V', D), frozen
    pos_of = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)
    pos_of[ids] = torch.arange(len(ids))
    feats: list[Tensor] = []
    labels: list[Tensor] = []
    K = heads.k
    t_start, last_save = time.perf_counter(), time.perf_counter()
    budget_s = max_minutes * 60
    texts = list(texts)
    read_now = 0
    gen = torch.Generator().manual_seed(state.steps)
    for tokens in _passes(texts, tokenize, chunk, state):
        if state.seconds + time.perf_counter() - t_start >= budget_s:
            break
        if max_steps is not None and state.steps >= max_steps:
            break
        read_now += 1
        h, pred = _features(model, tokens)
        # head k at position i learns the target's prediction at i + k: the token k + 1 places after i
        T = len(tokens)
        lab = torch.full((T, K), -100, dtype=torch.long)
        for k in range(1, K + 1):
            lab[: T - k, k - 1] = pos_of[pred[k:]]
        feats.append(h.to(torch.bfloat16))
        labels.append(lab)
        state.chunks += 1
        while len(feats) > 1 and sum(f.numel() for f in feats) * 2 > FEATURE_BYTES:  # the oldest chunks go first
            feats.pop(0)
            labels.pop(0)
        H, Y = torch.cat(feats), torch.cat(labels)
        for _ in range(STEPS_PER_PASS):  # a target pass costs far more than a step: reuse what was collected
            pick = torch.randint(0, H.shape[0], (min(batch, H.shape[0]),), generator=gen)
            x = heads.blocks(H[pick].float())  # (n, K, D)
            logits = x @ lm.T  # (n, K, V')
            y = Y[pick]
            losses = [F.cross_entropy(logits[:, k], y[:, k], ignore_index=-100) for k in range(K)]
            loss = torch.stack(losses).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.steps += 1
            state.tokens += len(pick)
            with torch.no_grad():
                ok = (logits.argmax(-1) == y).float()
                valid = (y >= 0).float()
                acc = [float((ok[:, k] * valid[:, k]).sum() / valid[:, k].sum().clamp(min=1)) for k in range(K)]
            state.loss = [_ema_list(state.loss, k, v.item()) for k, v in enumerate(losses)]
            state.acc = [_ema_list(state.acc, k, a) for k, a in enumerate(acc)]
        elapsed = state.seconds + time.perf_counter() - t_start
        if progress is not None:
            progress(state, min(elapsed / budget_s, 1.0))
        if time.perf_counter() - last_save > 60:
            _save(out, heads, state, opt, key, elapsed)
            last_save = time.perf_counter()
    state.seconds += time.perf_counter() - t_start
    _save(out, heads, state, opt, key, state.seconds)
    for p in params:
        p.requires_grad_(False)
    return heads, state


def _ema_list(old: list[float], k: int, v: float) -> float:
    return v if k >= len(old) or math.isnan(old[k]) else 0.9 * old[k] + 0.1 * v


def _passes(
    texts: list[str], tokenize: Callable[[str], list[int]], chunk: int, state: TrainState
) -> Iterable[list[int]]:
    """The text's chunks not read yet (``state.chunks`` counts those read), then pass after pass over all of them
    again while the caller keeps asking (the time limit ends training, not the data)."""
    skip = state.chunks
    while True:
        n = 0
        for tokens in _chunks(texts, tokenize, chunk):
            n += 1
            if skip > 0:
                skip -= 1
                continue
            yield tokens
        if n == 0:
            return
        skip = 0


def _chunks(texts: Iterable[str], tokenize: Callable[[str], list[int]], chunk: int) -> Iterable[list[int]]:
    buf: list[int] = []
    for t in texts:
        buf.extend(tokenize(t))
        while len(buf) >= chunk:
            yield buf[:chunk]
            buf = buf[chunk:]


@torch.inference_mode()
def _features(model: Any, tokens: list[int]) -> tuple[Tensor, Tensor]:
    """The target's final hidden states (T, D) and greedy tokens (T,) over one causal pass."""
    ids = torch.tensor(tokens, device=model.device)
    pos = torch.arange(len(tokens), device=model.device)
    hidden: list[Tensor] = []
    logits = model.forward(ids, pos, pos, pos[None, :] <= pos[:, None], model.new_cache(len(tokens)), hidden=hidden)
    return torch.cat(hidden).float().cpu().clone(), logits.argmax(-1).cpu()


def _save(out: Path, heads: Heads, state: TrainState, opt: Any, key: str, seconds: float) -> None:
    from dataclasses import asdict, replace

    from safetensors.torch import save_file

    heads.meta = {"key": key, "train": asdict(replace(state, seconds=round(seconds, 1)))}
    heads.save(out)
    moments = {
        f"{i}.{name}": t.detach().float().reshape(-1) if name == "step" else t.detach().contiguous()
        for i, st in opt.state_dict()["state"].items()
        for name, t in st.items()
        if isinstance(t, Tensor)
    }  # the optimizer's moments as safetensors (nothing is ever unpickled)
    save_file(moments, str(out.with_suffix(".optim")))


def _optimizer_state(path: Path) -> dict[str, Any] | None:
    """AdamW's state as saved by :func:`_save` (None when absent); param_groups come from the new optimizer."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    state: dict[int, dict[str, Tensor]] = {}
    for name, t in load_file(str(path)).items():
        i, key = name.split(".", 1)
        state.setdefault(int(i), {})[key] = t.reshape(()) if key == "step" else t
    return {"state": state}


def _resume(out: Path, hidden: int, ids: Tensor, key: str) -> tuple[Heads, TrainState, Any]:
    if out.is_file():
        try:
            h = Heads.load(out)
            if h.meta.get("key") == key and h.a.shape[1] == hidden and torch.equal(h.ids, ids.long()):
                state = TrainState(**h.meta.get("train", {}))
                opt_state = _optimizer_state(out.with_suffix(".optim"))
                log.info("resuming heads training: %d chunks, %d steps so far", state.chunks, state.steps)
                return h, state, opt_state
        except (SpecexecError, TypeError, RuntimeError, OSError):
            pass
    return Heads.new(hidden, ids), TrainState(), None
