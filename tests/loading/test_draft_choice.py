"""--draft-dtype auto on a GPU beside a streamed target (specexec/loading/draft_choice.py): the cost model's data,
the choice it makes, and plan_with_draft's ``pick``. No GPU: the bandwidths are given, not measured."""

from __future__ import annotations

import pytest

from specexec.loading import draft_choice as dc
from specexec.model.transformer import ModelConfig

LLAMA2_7B = ModelConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32, head_dim=128,
    num_layers=32,
)  # fmt: skip
GB = 1e9


def test_cost_model_reproduces_its_h200_calibration():
    """configs/draft_formats.toml says its constants come from an H200's measured 7B draft passes end to end
    (8.8 ms 16-bit, ~13.0 int8, ~16.8 NF4, with 4.19 TB/s device copies) and, with the resident layers spread
    among the streamed ones, no resident layer's compute left outside the copies: the model must give those back
    (a check of the data, not a timing)."""
    m = dc.cost_model()
    assert set(m.formats) == {"dense", "int8", "nf4"} and m.formats["dense"].keep == 1.0
    assert dc.pass_seconds(LLAMA2_7B, "dense", 4190) == pytest.approx(8.8e-3, rel=0.05)
    assert dc.pass_seconds(LLAMA2_7B, "int8", 4190) == pytest.approx(13.0e-3, rel=0.05)
    assert dc.pass_seconds(LLAMA2_7B, "nf4", 4190) == pytest.approx(16.8e-3, rel=0.05)
    seventy = ModelConfig(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128,
        num_layers=80,
    )  # fmt: skip
    assert m.resident_ms(seventy, "nf4") == 0.0 and m.resident_ms(seventy, "dense") == 0.0
    # bytes: the 16-bit draft reads its 13.2 GB of non-embedding weights; NF4 reads ~3.7 GB and rewrites 2 x 13.2
    assert dc.pass_bytes(LLAMA2_7B, "dense") == pytest.approx(13.2e9, rel=0.01)
    assert dc.pass_bytes(LLAMA2_7B, "int8") < dc.pass_bytes(LLAMA2_7B, "dense") / 1.9
    assert dc.pass_bytes(LLAMA2_7B, "nf4") > 2 * dc.pass_bytes(LLAMA2_7B, "dense")


def test_cost_model_rejects_malformed_data(tmp_path):
    bad = tmp_path / "f.toml"
    bad.write_text("levels_per_step = 10\nlayer_ms = 0.2\n[formats.int8]\nkeep = 0.9\nlayer_ms = 0\nrewrite = 0\n")
    with pytest.raises(ValueError, match="dense"):
        dc.cost_model.__wrapped__(bad)
    bad.write_text("levels_per_step = 10\n[formats.dense]\nkeep = 1\n")
    with pytest.raises(ValueError, match="malformed"):
        dc.cost_model.__wrapped__(bad)


# streamed bytes a pass of a 70B NF4 target at a 24 GB cap with a 7B draft in each format (the library's plan,
# context 4096, budget 256; docs/BENCHMARKS.md): 7 / 20 / 26 resident layers of 0.481 GB
STREAMED_24 = {"dense": 73 * 481_329_152, "int8": 60 * 481_329_152, "nf4": 54 * 481_329_152}
RESIDENT_24 = {"dense": 7, "int8": 20, "nf4": 26}


@pytest.mark.parametrize("h2d, hbm", [(25.0, 1000.0), (55.5, 4190.0)])
def test_a_streamed_70b_takes_a_lighter_draft(h2d, hbm):
    """On a PCIe4 consumer card and on the H200 alike, the streamed bytes an int8 draft saves outweigh its
    dearer passes, the resident layers' compute and its keep prior; the modelled times are what the choice
    compares."""
    opts = dc.options(LLAMA2_7B, STREAMED_24, h2d, hbm, RESIDENT_24, 1.5)
    by = {o.fmt: o for o in opts}
    best = dc.choose(opts)
    assert best.fmt == "int8" and best.s_per_token == min(o.s_per_token for o in opts)
    for o in opts:
        assert o.s_per_token == pytest.approx((o.stream_s + o.draft_s) / o.keep)
        assert o.stream_s == pytest.approx(o.streamed_bytes / (h2d * GB) + RESIDENT_24[o.fmt] * 1.5e-3)
    assert by["dense"].break_even_keep == 1.0 and 0 < by["int8"].break_even_keep < by["int8"].keep
    assert "ties the 16-bit draft at keep" in by["int8"].describe()


def test_nothing_streamed_keeps_the_16_bit_draft_and_cheap_streaming_too():
    """Where the 16-bit draft leaves nothing to stream, it stays; where streaming is nearly free and the device's
    memory fast (an H200's 4.8 TB/s: a 16-bit pass reads its weights in 2.8 ms of its ~9.5), a lighter draft
    saves nothing and its dearer passes and keep lose."""
    assert dc.choose(dc.options(LLAMA2_7B, {"dense": 0, "int8": 0, "nf4": 0}, 25.0, 1000.0)).fmt == "dense"
    fast_link = dc.options(LLAMA2_7B, STREAMED_24, 100_000.0, 4800.0)
    assert dc.choose(fast_link).fmt == "dense"
    nf4 = next(o for o in fast_link if o.fmt == "nf4")
    assert nf4.break_even_keep == 1.0 and "even at keep 1" in nf4.describe()


def test_without_the_16_bit_draft_there_is_no_break_even():
    opts = dc.options(LLAMA2_7B, {f: STREAMED_24[f] for f in ("int8", "nf4")}, 25.0, 1000.0)
    assert all(o.break_even_keep is None for o in opts) and dc.choose(opts).fmt in ("int8", "nf4")


def test_picker_plans_every_format_and_loads_the_chosen_one(monkeypatch, tmp_path):
    """plan_with_draft(pick=...) plans all formats that fit and returns the picked one's plan; without pick it
    keeps the first that fits (an explicit --draft-dtype)."""
    import specexec.loading.offloaded as load
    from offload.plan import Plan

    seen: list[list[str]] = []

    def pick(fits: list[tuple[str, Plan]]) -> str:
        seen.append([f for f, _ in fits])
        return fits[-1][0]

    calls: list[str] = []

    class FakeModel:
        @classmethod
        def from_checkpoint(cls, *a, draft_bytes, **kw):  # noqa: ANN001, ANN003, ANN206
            return draft_bytes

    def fake_plan(res, draft_bytes, off):  # noqa: ANN001, ANN202
        calls.append(str(draft_bytes))
        return f"plan-{draft_bytes}"

    from specexec.model.sizes import PlanReservations

    monkeypatch.setattr(load, "PlanModel", FakeModel)
    monkeypatch.setattr(load, "make_plan", fake_plan)
    monkeypatch.setattr(load, "model_dir", lambda p, **_: p)
    monkeypatch.setattr(load, "read_config", lambda p: LLAMA2_7B)
    monkeypatch.setattr(load, "target_compute_dtype", lambda *a: None)
    from offload.plan import OffloadConfig

    reserve = {"dense": 3, "int8": 2, "nf4": 1}
    off = OffloadConfig(mode="ram", cache_dir=tmp_path)
    plan, fmt = load.plan_with_draft(
        tmp_path, None, "bf16", off, lambda f: PlanReservations(reserve[f], 0, 16), ["dense", "int8", "nf4"],
        resources=object(), pick=pick,
    )  # fmt: skip
    assert (plan, fmt) == ("plan-1", "nf4") and seen == [["dense", "int8", "nf4"]] and calls == ["3", "2", "1"]
    calls.clear()
    plan, fmt = load.plan_with_draft(
        tmp_path, None, "bf16", off, lambda f: PlanReservations(reserve[f], 0, 16), ["dense", "int8", "nf4"],
        resources=object(),
    )  # fmt: skip
    assert (plan, fmt) == ("plan-3", "dense") and calls == ["3"]


def test_picker_weighs_the_plans_it_is_given(caplog):
    """draft_choice.picker (what specexec.load hands plan_with_draft on a GPU): from each fitting plan's streamed
    bytes and resident layers, with the bandwidths given (measured on a GPU), it names the modelled fastest and
    logs every option."""
    import logging
    from types import SimpleNamespace

    seventy = ModelConfig(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128,
        num_layers=80,
    )  # fmt: skip

    def plan(fmt: str) -> SimpleNamespace:
        n = RESIDENT_24[fmt]
        return SimpleNamespace(
            bytes_per_forward=STREAMED_24[fmt], resident=tuple(range(n)), fmt=SimpleNamespace(kind="nf4")
        )

    pick = dc.picker(LLAMA2_7B, seventy, None, bandwidths=(25.0, 1000.0))
    with caplog.at_level(logging.INFO, logger="specexec"):
        assert pick([(f, plan(f)) for f in ("dense", "int8", "nf4")]) == "int8"
    assert "loading the draft in int8" in caplog.text and "ties the 16-bit draft at keep" in caplog.text
    fast = dc.picker(LLAMA2_7B, seventy, None, bandwidths=(100_000.0, 4190.0))
    assert fast([(f, plan(f)) for f in ("dense", "int8", "nf4")]) == "dense"


def test_picker_without_measurable_bandwidths_assumes_a_consumer_card(monkeypatch, caplog):
    """Pinned memory refused (e.g. under WSL) or no room for the test buffers: the picker takes the plan's H2D
    figure and a consumer card's device bandwidth instead of failing the load."""
    import logging
    from types import SimpleNamespace

    def refuse(device):  # noqa: ANN001, ANN202
        raise RuntimeError("pinned allocation failed")

    monkeypatch.setattr(dc, "measure_bandwidths", refuse)
    plans = [
        (f, SimpleNamespace(bytes_per_forward=STREAMED_24[f], resident=range(RESIDENT_24[f]), h2d_gbps=25.0,
                            fmt=SimpleNamespace(kind="nf4")))
        for f in ("dense", "int8", "nf4")
    ]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="specexec"):
        assert dc.picker(LLAMA2_7B, LLAMA2_7B, None)(plans) == "int8"
    assert "bandwidths not measured" in caplog.text and "1000 GB/s device" in caplog.text


def test_int8_is_offered_only_where_bitsandbytes_runs_it():
    """bitsandbytes' int8 matmul needs integer tensor cores (compute capability 7.5+): an older card is offered
    NF4 only."""
    assert dc.lighter_formats((8, 9)) == ["int8", "nf4"] and dc.lighter_formats((7, 5)) == ["int8", "nf4"]
    assert dc.lighter_formats((6, 1)) == ["nf4"]
