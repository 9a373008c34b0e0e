"""The memory plan reserves what shape-invariant passes need on a GPU (the load-time check, the attention's
temporaries; the NF4 scratch is in the workspace), and a check that cannot fit says so in one line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from offload.layout import LayerFormat, layer_layout
from offload.packing import max_linear_numel
from offload.plan import OffloadConfig, PlanModel, Resources, make_plan
from specexec.loading import invariance
from specexec.model import sizes
from specexec.model.transformer import ModelConfig

BF16 = torch.bfloat16
NF4 = "nf4-b64-bfloat16"
LLAMA3_70B = ModelConfig(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
    head_dim=128,
)  # fmt: skip
LLAMA2_70B = ModelConfig(
    vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
    head_dim=128,
)  # fmt: skip
GPU = Resources(device="cuda", vram_free=int(80e9), ram_total=int(256e9), ram_available=int(200e9), disk_free=None)


def _plan(cfg: ModelConfig, cap: float, invariant: bool = True, kv: float = 2e9, context: int = 8192):
    m = PlanModel(cfg, BF16, kv_bytes=int(kv), max_tokens=2048, invariant=invariant, context=context,
                  cached=frozenset({NF4}))  # fmt: skip
    return make_plan(GPU, m, OffloadConfig(mode="ram", target_dtype="nf4", gpu_memory_gb=cap))


def test_check_bytes_from_shapes() -> None:
    # the output head is the largest linear: its random weight, 3 x 4096 pass rows, 16 probes, 2 x 4096 outputs
    o, i, rows = 128256, 8192, invariance.CUDA_MAX_ROWS
    want = (o * i + 3 * rows * i + 16 * (i + o) + 2 * rows * o) * 2
    assert invariance.check_bytes(LLAMA3_70B, BF16) == want
    assert 4.3e9 < want < 4.5e9  # 4.41 GB at Llama-3-70B shapes
    assert 2.0e9 < invariance.check_bytes(LLAMA2_70B, BF16) < 2.2e9  # a 32k-token head: w13 (57344 x 8192) is larger


def test_attention_reservation_follows_the_pass() -> None:
    at = sizes.invariant_attention_bytes
    assert at(LLAMA3_70B, 8192, 2048) > at(LLAMA3_70B, 1024, 2048) > 0
    assert at(LLAMA3_70B, 8192, 2048) > at(LLAMA3_70B, 8192, 64)
    assert at(LLAMA3_70B, 8192, 2048, attn_rows=128) > 10 * at(LLAMA3_70B, 8192, 2048)  # 8 heads padded to 128
    assert 0.7e9 < at(LLAMA3_70B, 8192, 2048) < 0.9e9


def test_plan_reserves_check_and_attention_24gb() -> None:
    p, fast = _plan(LLAMA3_70B, 24), _plan(LLAMA3_70B, 24, invariant=False)
    parts = p.invariant_parts
    assert parts["check"] == invariance.check_bytes(LLAMA3_70B, BF16)
    assert parts["attention"] == sizes.invariant_attention_bytes(LLAMA3_70B, 8192, 2048)
    assert parts["scratch"] == max_linear_numel(layer_layout(LLAMA3_70B, LayerFormat("nf4", BF16))) * 2
    assert p.check_fits and p.invariant_reserved == max(parts["check"], parts["attention"])
    assert p.vram_need - fast.vram_need > 0 and p.vram_need <= 24e9
    lb = p.layer_bytes
    assert len(fast.resident) - len(p.resident) == (p.invariant_reserved + (fast.vram_need - p.vram_need)) // lb
    assert (len(fast.resident), len(p.resident)) == (28, 19)
    assert "shape-invariant passes: 4.41 GB reserved" in p.describe()
    assert not fast.invariant_parts and "shape-invariant" not in fast.describe()


def test_plan_reserves_at_12gb() -> None:
    p, fast = _plan(LLAMA2_70B, 12), _plan(LLAMA2_70B, 12, invariant=False)
    assert p.check_fits and len(p.resident) < len(fast.resident)
    assert p.invariant_reserved == max(invariance.check_bytes(LLAMA2_70B, BF16), p.invariant_parts["attention"])


def test_check_that_cannot_fit_says_so_in_one_line() -> None:
    # Llama-3-70B at 12 GB: the 4.4 GB check does not fit beside the ring, the passes do
    p = _plan(LLAMA3_70B, 12)
    assert not p.check_fits and p.vram_need <= 12e9 and p.invariant_reserved == p.invariant_parts["attention"]
    line = [s for s in p.describe().splitlines() if "shape-invariant" in s]
    assert len(line) == 1 and invariance.GUARANTEE in line[0] and "4.41 GB" in line[0]


def test_memory_note_and_apply_warn_once(caplog) -> None:
    assert invariance.memory_note(LLAMA3_70B, BF16, int(5e9)) is None
    note = invariance.memory_note(LLAMA3_70B, BF16, int(3e9))
    assert note is not None and "4.41 GB" in note and "3.00 GB is free" in note
    model = SimpleNamespace(cfg=LLAMA3_70B, dtype=BF16, device=torch.device("cpu"),
                            globals=SimpleNamespace(lm_head=torch.zeros(1)), tiling=None)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger=invariance.__name__):
        invariance.apply(model, check=lambda *a, **k: invariance.Choice("k", None, note=note))  # type: ignore[arg-type]
    msgs = [r.getMessage() for r in caplog.records if r.name == invariance.__name__]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert msgs[0] == f"shape-invariant passes are off ({note}); what still holds: {invariance.GUARANTEE}"
    assert model.tiling is None


def test_choose_on_a_short_gpu_does_not_run_the_check(monkeypatch, tmp_path) -> None:
    calls: list[object] = []
    monkeypatch.setattr(invariance, "_device_name", lambda d: "a 12 GB card")
    monkeypatch.setattr(invariance, "_free_bytes", lambda d: int(3e9))
    monkeypatch.setattr(invariance, "find", lambda *a, **k: calls.append(a))
    choice = invariance.choose(LLAMA3_70B, BF16, torch.device("cuda"), home=tmp_path)
    assert choice.get() is None and not calls and choice.note == invariance.memory_note(LLAMA3_70B, BF16, int(3e9))
    assert not (tmp_path / "cache" / invariance.CACHE_FILE).exists() and not list(tmp_path.rglob(invariance.CACHE_FILE))
