"""Which drafts pair with a target, and which draft ``--draft auto`` picks.

**Pairing.** A draft only proposes token ids; the target scores them in its own vocabulary. So a target and a draft
pair when their tokenizers agree on every id the draft can propose -- the ids below the draft's embedding rows
that are real tokens of its tokenizer: the same token string for the id, the same text when decoded, and the same
ids when that text is encoded again. Releases of one family often differ in a few special tokens (a Gemma 2 pair
differs in one id), and large and small models of one family pad their embeddings differently (Qwen2.5-7B..72B
have 152,064 rows, 0.5B..3B 151,936, one tokenizer). :func:`check_pair` finds the ids where the two disagree and
the rows that are no token at all; the draft never proposes those (:class:`Pairing.excluded`: its logits there are
-inf before it picks or samples, see :class:`specexec.propose.draft_model.LimitedDraft`). The output stays the
target's: the target's distribution over its own full vocabulary decides every token, the draft's only weights
the proposals (tree walk), and the chain rule draws rejections from norm(max(p - q, 0)), where a token the draft
never proposes has q = 0.

A pair is refused (:class:`~specexec.errors.TokenizerMismatch`, one line naming the first few ids) when more than
:data:`MAX_DIFFER` of the target's tokens differ -- then the tokenizers are different builds, not one family's
releases with a few renamed special tokens: different families differ in most ids -- or when text encodes to
different ids (different merges, pre-tokenizers or normalizers: the draft would read other sequences than it was
trained on).

**Auto.** :func:`choose_draft`: a target alias with a known pair in ``configs/models.toml`` takes its draft; else
the largest model already on this machine (the cache's aliases, the HF cache's checkpoints, converted GGUFs of the
local stores) of the target's family (same ``model_type``) with at most half its parameters whose tokenizer pairs
with the target's; else no draft (plain decoding). The choice reads configs and tokenizers only (nothing is
downloaded or converted), and says which and why in one line (:meth:`DraftChoice.line`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specexec.errors import SpecexecError, TokenizerMismatch
from specexec.model import sizes
from specexec.model.transformer import ModelConfig

log = logging.getLogger(__name__)

AUTO = "auto"  # draft="auto": :func:`choose_draft`
# A pair is refused when more than this fraction of the target's tokens differ. Releases of one family differ in a
# handful of (special) ids out of 32k-256k; at 1% (over 300 ids of a 32k vocabulary, 1,500 of 150k) the
# differences are a different vocabulary build, whose tokens the draft could not propose and whose text it would
# read as unknown ids. Different families differ in almost every id.
MAX_DIFFER = 0.01
MAX_DRAFT_SHARE = 0.5  # auto: a draft with more than half the target's parameters costs too much to pay off
SAMPLE_IDS = 2048  # ids whose text -> ids round trip is compared when the tokenizers are not identical
SHOWN = 3  # differing ids named in a message
# text -> ids on both sides: prose, code, whitespace runs, digits, non-Latin scripts, an emoji
PROBE = (
    "The quick brown fox jumps over the lazy dog.\n"
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr  # 1234567890\n\n\t  \n"
    "Ünïcödé — naïve café, 東京タワー, Привет мир, مرحبا, 😀!"
)


# ---------------------------------------------------------------------------------------------- pairing


@dataclass(frozen=True)
class Pairing:
    """How a draft's ids map onto the target's.

    ``excluded`` (k,) long, sorted: the ids below the draft's ``rows`` it must never propose (their tokens differ,
    are no token of the draft's tokenizer, or lie beyond the target's vocabulary). ``differ``: ids that are a
    token on either side and not the same token on both (counted up to the larger of the two row counts);
    ``examples``: the first few, ``id: 'target' vs 'draft'``."""

    rows: int
    excluded: Tensor
    differ: int
    examples: tuple[str, ...] = ()

    @property
    def allowed(self) -> Tensor | None:
        """(rows,) bool: the ids the draft may propose; None when it may propose every id it has."""
        if self.excluded.numel() == 0:
            return None
        mask = torch.ones(self.rows, dtype=torch.bool)
        mask[self.excluded] = False
        return mask


def _tokens(tok: Any, rows: int) -> list[str | None]:
    """Each id's token string below ``rows`` as the tokenizer maps ids to tokens (an added token's content before a
    base-vocabulary entry of the same id; None: no token, e.g. an embedding's padding row)."""
    n = min(rows, len(tok))
    out: list[str | None] = list(tok.convert_ids_to_tokens(list(range(n))))
    return out + [None] * (rows - n)


def _fingerprint(tok: Any) -> str | None:
    """The whole tokenizer as text (a fast tokenizer's JSON), None when it has none."""
    backend = getattr(tok, "backend_tokenizer", None)
    return backend.to_str() if backend is not None else None


def _show(s: str | None) -> str:
    return "no token" if s is None else repr(s)


def check_pair(
    target: Any, draft: Any, target_rows: int, draft_rows: int, target_name: str = "target", draft_name: str = "draft"
) -> Pairing:
    """Check that the ``draft`` tokenizer agrees with the ``target``'s on every id it can propose (tokenizers are
    transformers tokenizers; ``*_rows`` the models' embedding rows). Returns the ids to exclude from the draft's
    proposals; raises :class:`TokenizerMismatch` (one line) when the pair is unusable."""
    rows = max(target_rows, draft_rows)
    same = (fp := _fingerprint(target)) is not None and fp == _fingerprint(draft)
    if same:  # one tokenizer: only the row counts can differ
        full = _tokens(target, rows)
        t_tok = [s if i < target_rows else None for i, s in enumerate(full)]
        d_tok = [s if i < draft_rows else None for i, s in enumerate(full)]
    else:
        t_tok = _tokens(target, target_rows) + [None] * (rows - target_rows)
        d_tok = _tokens(draft, draft_rows) + [None] * (rows - draft_rows)
    excluded: list[int] = []
    differ: list[int] = []
    for i, (ts, ds) in enumerate(zip(t_tok, d_tok)):
        if ts == ds and ts is not None:
            continue
        if i < draft_rows:
            excluded.append(i)
        if ts is not None or ds is not None:
            differ.append(i)
    examples = tuple(f"id {i}: {_show(t_tok[i])} vs {_show(d_tok[i])}" for i in differ[:SHOWN])
    n_target = sum(s is not None for s in t_tok)
    if len(differ) > MAX_DIFFER * n_target:
        raise TokenizerMismatch(
            f"draft {draft_name} and target {target_name} use different tokenizers: {len(differ)} of "
            f"{n_target} token ids differ ({'; '.join(examples)}): pick a draft from the target's model family"
        )
    if not same:
        _check_text(target, draft, t_tok, d_tok, target_name, draft_name)
    if differ:
        log.warning(
            "draft %s: %d token id(s) differ from target %s's (%s); the draft never proposes them",
            draft_name,
            len(differ),
            target_name,
            "; ".join(examples),
        )
    return Pairing(draft_rows, torch.tensor(excluded, dtype=torch.long), len(differ), examples)


def _check_text(
    target: Any, draft: Any, t_tok: Sequence[str | None], d_tok: Sequence[str | None], t_name: str, d_name: str
) -> None:
    """ids -> text and text -> ids on a sample of the shared ids (every added token and an even spread of the rest)
    and on :data:`PROBE`: any difference means another decoder, pre-tokenizer or normalizer."""
    shared = [i for i, (a, b) in enumerate(zip(t_tok, d_tok)) if a is not None and a == b]
    added = set(getattr(target, "added_tokens_decoder", {}) or {})
    step = max(1, len(shared) // SAMPLE_IDS)
    ids = sorted(set(shared[::step]) | (added & set(shared)))
    t_text = target.batch_decode([[i] for i in ids])
    d_text = draft.batch_decode([[i] for i in ids])
    for i, a, b in zip(ids, t_text, d_text):
        if a != b:
            raise TokenizerMismatch(
                f"draft {d_name} and target {t_name} use different tokenizers: id {i} decodes to {a!r} vs {b!r}"
            )
    texts = [*t_text, PROBE]
    t_ids = target(texts, add_special_tokens=False)["input_ids"]
    d_ids = draft(texts, add_special_tokens=False)["input_ids"]
    for text, a, b in zip(texts, t_ids, d_ids):
        if a != b:
            raise TokenizerMismatch(
                f"draft {d_name} and target {t_name} use different tokenizers: {_clip(text)!r} encodes to "
                f"{_clip(a)} vs {_clip(b)}"
            )


def _clip(x: Any, n: int = 40) -> Any:
    if isinstance(x, str):
        return x if len(x) <= n else x[:n] + "..."
    return x if len(x) <= 12 else [*x[:12], "..."]


# ---------------------------------------------------------------------------------------------- --draft auto


@dataclass(frozen=True)
class DraftChoice:
    """What ``draft="auto"`` loads: ``draft`` (an alias or a local path; None: no draft, plain decoding) and why;
    ``name``: how the line names it (default ``draft``)."""

    draft: str | None
    reason: str
    name: str | None = None

    @property
    def line(self) -> str:
        if self.draft is None:
            return f"draft: none ({self.reason}): plain decoding; name a draft with --draft"
        return f"draft: {self.name or self.draft} ({self.reason})"


def local_config(spec: str, home: Path | None = None) -> tuple[ModelConfig | None, Path | None]:
    """A model's architecture without downloading or converting anything: (config, its local directory or None when
    not downloaded). An alias not downloaded gives the architecture ``configs/models.toml`` records; a GGUF (a path
    or a store name) gives its converted directory's once converted; a spec that is not on this machine gives
    (None, None)."""
    from specexec.loading import hub

    if spec in hub.aliases():
        if hub.is_present(spec, home):
            directory = hub.local_path(spec, home)
            return _read(directory), directory
        known = hub.known_config(spec)
        return (_parse(dict(known)) if known is not None else None), None
    try:
        gguf = hub.local_gguf(spec)
    except SpecexecError:  # a store name that names nothing here
        return None, None
    if gguf is not None:
        return _converted(gguf, home)
    path = Path(spec).expanduser()
    if not path.exists():
        if _looks_like_path(spec):
            return None, None
        try:  # an HF id in the HF cache
            path = hub.resolve(spec, pull_missing=False, progress=False, home=home)
        except SpecexecError:
            return None, None
    directory = path.parent if path.is_file() else path
    return _read(directory), directory if (directory / "config.json").is_file() else None


def _converted(gguf: Path, home: Path | None) -> tuple[ModelConfig | None, Path | None]:
    """The config and directory of a GGUF's conversion, (None, None) before it is converted."""
    from specexec.loading import hub

    try:
        directory = hub.converted_gguf_dir(gguf, home)
    except (OSError, SpecexecError):
        return None, None
    cfg = _read(directory)
    return (cfg, directory) if cfg is not None else (None, None)


def _read(directory: Path) -> ModelConfig | None:
    try:
        return _parse(json.loads((directory / "config.json").read_text()))
    except (OSError, ValueError):
        return None


def _parse(raw: dict[str, Any]) -> ModelConfig | None:
    try:
        return ModelConfig.from_hf(raw)
    except (KeyError, TypeError, ValueError):
        return None


def known_draft(target: str) -> tuple[str, str] | None:
    """(draft alias, pair name) of the first ``[pairs]`` entry in ``configs/models.toml`` whose target is
    ``target``; None when it has none."""
    from specexec.loading import hub

    for name, pair in hub.pairs().items():
        if pair.target == target:
            return pair.draft, name
    return None


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.endswith(".gguf")


def choose_draft(target: str, home: Path | None = None) -> DraftChoice:
    """The draft for ``target`` (see the module docstring). Reads configs and, for the local candidates that fit
    by family and size, tokenizers; downloads nothing. A target path that does not exist gives no draft (loading
    the target reports it)."""
    from specexec.loading import hub

    pair = known_draft(target)
    if pair is not None:
        draft, name = pair
        where = "" if hub.is_present(draft, home) else "; downloaded on first use"
        return DraftChoice(draft, f"the known pair {name!r} in configs/models.toml{where}")
    cfg, directory = local_config(target, home)
    if cfg is None or directory is None:
        if Path(target).expanduser().exists():
            why = "whose architecture is not readable before it loads"
        else:
            why = "which was not found" if _looks_like_path(target) else "which is not on this machine yet"
        return DraftChoice(None, f"no known pair for {target}, {why}")
    found = _smaller_local_model(target, cfg, directory, home)
    if found is not None:
        return found
    return DraftChoice(
        None,
        f"no known pair for {target} and no smaller {cfg.model_type} model with its tokenizer on this machine",
    )


def _local_models(home: Path | None) -> list[tuple[str, Path]]:
    """(name, directory) of every model on this machine with a readable config: the aliases ``hub.list_models``
    reports present, the HF cache's checkpoints and the GGUFs of the local stores that were converted
    (:mod:`specexec.loading.stores`)."""
    from specexec.loading import hub, stores

    out = []
    for row in hub.list_models(home):
        if not row.get("present"):
            continue
        path = Path(row["path"])
        out.append((str(row.get("alias") or path), path.parent if path.is_file() else path))
    try:
        found = stores.discover()
    except OSError:
        found = []
    for f in found:
        if f.format == "gguf":
            directory = _converted(f.path, home)[1]
        else:
            directory = f.path if f.path.is_dir() else f.path.parent
        if directory is not None:
            out.append((f.name, directory))
    return out


def _loadable(name: str, path: Path, home: Path | None) -> str:
    """``name`` when it resolves to ``path`` without a download, else the path itself."""
    from specexec.loading import hub

    try:
        found = hub.resolve(name, pull_missing=False, progress=False, home=home)
    except SpecexecError:
        return str(path)
    return name if found.resolve() == path.resolve() or found.resolve().parent == path.resolve() else str(path)


def _smaller_local_model(target: str, cfg: ModelConfig, directory: Path, home: Path | None) -> DraftChoice | None:
    """The largest local model of ``cfg``'s family with at most :data:`MAX_DRAFT_SHARE` of its parameters whose
    tokenizer pairs with the target's."""
    from specexec.loading.checkpoint import load_tokenizer

    limit = MAX_DRAFT_SHARE * sizes.param_count(cfg)
    candidates = []
    for name, path in _local_models(home):
        if path.resolve() == directory.resolve():
            continue
        d_cfg = _read(path)
        if d_cfg is None or d_cfg.model_type != cfg.model_type or sizes.param_count(d_cfg) > limit:
            continue
        candidates.append((sizes.param_count(d_cfg), name, path, d_cfg))
    if not candidates:
        return None
    try:
        t_tok = load_tokenizer(directory).tokenizer
    except SpecexecError:  # no usable tokenizer: loading the target reports it
        return None
    for params, name, path, d_cfg in sorted(candidates, key=lambda c: -c[0]):
        try:
            d_tok = load_tokenizer(path).tokenizer
            check_pair(t_tok, d_tok, cfg.vocab_size, d_cfg.vocab_size, target, name)
        except SpecexecError as e:
            log.info("auto draft: %s does not pair with %s (%s)", name, target, e)
            continue
        share = params / sizes.param_count(cfg)
        return DraftChoice(
            _loadable(name, path, home),
            f"a {cfg.model_type} model on this machine with the target's tokenizer, {share:.0%} of its size",
            name,
        )
    return None
