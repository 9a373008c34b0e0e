"""``specexec bench --quality FILE``: what a weight format costs in quality, on a text the user gives.

As ``llama-perplexity`` does, the text is tokenized (no chat template) and cut into chunks of ``chunk`` tokens (each
starting with the tokenizer's BOS when it adds one); in each chunk the second half is scored given the first half
(:meth:`~specexec.decoding.engine.Engine.score`). The target in the chosen format is scored first, then the
reference (the same checkpoint dense: fp32 on a CPU, the compute dtype on a GPU), one model at a time. Reported per
format: the perplexity over the scored tokens; for the chosen format also the top-1 agreement with the reference
(the share of scored positions whose argmax is the reference's) and the mean KL(reference || chosen) in nats.

The KL needs both full distributions at each position: the chosen format's log-probs are kept meanwhile in a
temporary file (fp16, tokens x vocabulary x 2 bytes, e.g. 2.5 GB for 8192 tokens of a 152k vocabulary), not in
RAM, and both sides are compared after the same fp16 rounding (a format against itself: KL exactly 0).
"""

from __future__ import annotations

import gc
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specexec.decoding.engine import Engine
from specexec.decoding.text import encode_text
from specexec.errors import ConfigError, SpecexecError, setting

MIN_CHUNK = 8
CHARS_PER_TOKEN = 32  # more than any text's average: only this many characters per needed token are tokenized


def read_text(path: Path) -> str:
    """The ``--quality`` file as text: a missing, unreadable, non-UTF-8 or empty file is refused."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecexecError(f"cannot read the {setting('quality')} file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SpecexecError(f"the {setting('quality')} file {path} is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise SpecexecError(f"the {setting('quality')} file {path} is empty")
    return text


def check_sizes(chunk: int, max_tokens: int) -> None:
    if chunk < MIN_CHUNK:
        raise ConfigError("quality_chunk", chunk, f"must be >= {MIN_CHUNK} tokens")
    if max_tokens < 1:
        raise ConfigError("quality_tokens", max_tokens, "must be >= 1")


def scored_per_chunk(chunk: int) -> int:
    """Tokens scored in a chunk: its second half."""
    return chunk - chunk // 2


def text_chunks(tokenizer: Any, text: str, chunk: int, max_tokens: int) -> list[list[int]]:
    """The text's token ids in chunks of ``chunk`` (each led by the tokens the tokenizer adds to a text, e.g. a
    BOS): as many as score at most about ``max_tokens`` tokens (at least one). Fewer than 2 whole chunks in the text
    is refused."""
    check_sizes(chunk, max_tokens)
    lead = encode_text(tokenizer, "")  # what the tokenizer puts before any text (a BOS), e.g. [] for Qwen
    step = chunk - len(lead)
    if step < 2:
        raise ConfigError("quality_chunk", chunk, f"must be >= {len(lead) + 2} tokens")
    wanted = max(2, math.ceil(max_tokens / scored_per_chunk(chunk)))
    body = [int(t) for t in tokenizer(text[: wanted * chunk * CHARS_PER_TOKEN], add_special_tokens=False)["input_ids"]]
    have = len(body) // step
    if have < 2:
        raise SpecexecError(
            f"the {setting('quality')} text has {len(body)} tokens: fewer than 2 chunks of {chunk} "
            f"({setting('quality_chunk')}); give a longer text or a smaller chunk"
        )
    n = min(have, max(1, math.ceil(max_tokens / scored_per_chunk(chunk))))
    return [lead + body[i * step : (i + 1) * step] for i in range(n)]


@dataclass(frozen=True)
class QualityRow:
    """One weight format's scores over the same positions. ``agreement`` and ``kl`` (mean KL(reference || this),
    nats per token) are against the reference: None on the reference's own row."""

    format: str
    reference: bool
    perplexity: float
    tokens: int
    seconds: float
    agreement: float | None = None
    kl: float | None = None


@dataclass
class QualityReport:
    target: str
    file: str
    device: str
    chunk: int
    chunks: int
    rows: list[QualityRow]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Pass:
    nll: float
    top1: torch.Tensor  # (tokens,) int64
    seconds: float
    kl: float | None = None  # summed over the tokens


def _score_all(engine: Engine, chunks: list[list[int]], store: torch.Tensor, against: bool) -> _Pass:
    """Score every chunk's second half. ``against`` False: write the log-probs into ``store`` (tokens, V) fp16;
    True: sum KL(this || the stored ones) after the same rounding."""
    chunk = len(chunks[0])
    if engine.context < chunk:
        raise ConfigError("quality_chunk", chunk, f"must be at most the model's context ({engine.context} tokens)")
    nll, seconds, kl, row, tops = 0.0, 0.0, 0.0, 0, []
    for ids in chunks:
        t0 = time.perf_counter()
        s = engine.score(ids, start=chunk // 2, chunk=chunk, logits=True)
        seconds += time.perf_counter() - t0
        assert s.logits is not None
        nll += s.nll
        tops.append(torch.tensor(s.top1, dtype=torch.long))
        lp = torch.log_softmax(s.logits, dim=-1)
        n = len(s.tokens)
        if not against:
            store[row : row + n] = lp.to(torch.float16).cpu()
        else:
            p = lp.exp()
            diff = lp.to(torch.float16).float() - store[row : row + n].to(lp.device).float()
            kl += float(torch.where(p > 0, p * diff, 0.0).sum(-1).clamp(min=0).double().sum())
        row += n
    return _Pass(nll, torch.cat(tops), seconds, kl if against else None)


def _free() -> None:
    """Return a dropped engine's memory before the next load."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(
    load_chosen: Callable[[], Engine],
    load_reference: Callable[[torch.device], Engine],
    chunks: list[list[int]],
    target_dtype: str = "auto",
    workdir: Path | None = None,
    target: str = "",
    file: str = "",
    on_phase: Callable[[str], None] | None = None,
) -> QualityReport:
    """Score ``chunks`` under the chosen format (``load_chosen()``), free it, then under the reference
    (``load_reference(the chosen one's device)``), and compare. ``target_dtype``: the chosen format as asked (names
    an NF4 target). ``workdir``: where the temporary log-prob file goes (default: the system's temporary
    directory). ``on_phase(format)``: before each scoring pass."""
    chunk = len(chunks[0])
    tokens = len(chunks) * scored_per_chunk(chunk)
    with tempfile.TemporaryDirectory(prefix="specexec-quality-", dir=workdir) as tmp:
        engine = load_chosen()
        vocab = engine.target.cfg.vocab_size
        need, free = tokens * vocab * 2, shutil.disk_usage(tmp).free
        if need > free:
            raise SpecexecError(
                f"comparing {tokens} tokens needs {need / 1e9:.1f} GB of temporary disk space in {tmp}, and "
                f"{free / 1e9:.1f} GB is free: lower {setting('quality_tokens')}"
            )
        store = torch.from_file(str(Path(tmp) / "logprobs"), shared=True, size=tokens * vocab, dtype=torch.float16)
        store = store.view(tokens, vocab)
        name, device = format_name(engine, target_dtype), engine.target.device
        if on_phase:
            on_phase(name)
        mine = _score_all(engine, chunks, store, against=False)
        del engine
        _free()
        engine = load_reference(device)
        ref_name = format_name(engine)
        if on_phase:
            on_phase(ref_name)
        ref = _score_all(engine, chunks, store, against=True)
        del engine, store
        _free()
    assert ref.kl is not None
    rows = [
        QualityRow(
            format=name,
            reference=False,
            perplexity=math.exp(mine.nll / tokens),
            tokens=tokens,
            seconds=mine.seconds,
            agreement=float((mine.top1 == ref.top1).double().mean()),
            kl=ref.kl / tokens,
        ),
        QualityRow(
            format=ref_name, reference=True, perplexity=math.exp(ref.nll / tokens), tokens=tokens, seconds=ref.seconds
        ),
    ]
    return QualityReport(target=target, file=file, device=str(device), chunk=chunk, chunks=len(chunks), rows=rows)


def format_name(engine: Engine, target_dtype: str = "auto") -> str:
    """The target's weight format as a user names it: a low-bit format (int8, q4, nf4), else its dtype."""
    if engine.target_weights:
        return engine.target_weights
    if target_dtype == "nf4":
        return "nf4"
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        engine.target.dtype, str(engine.target.dtype).removeprefix("torch.")
    )
