"""The test suite must run on a 16 GB machine (peak RSS < 8 GB, tests/conftest.py RSS_BUDGET).

The session's peak is reported and checked at its end (conftest's pytest_sessionfinish / terminal summary); the
slow test here checks what keeps it low: loading the shared demo pair costs its weights once (no memory-mapped
file pages, no second transient copy of a model).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REAL_DRAFT, REAL_PAIR_LOAD, REAL_TARGET, RSS_BUDGET, peak_rss, rss_now

LOAD_SLACK = 400 * 10**6  # bytes the load may add beside the weights: two tokenizers, the KV caches, allocator slack


def test_peak_rss_reads_the_kernels_high_water_marks():
    """The figures the session check uses are bytes: this process's peak agrees with /proc's VmHWM and covers what
    it holds now (getrusage's figure lags /proc's by a few pages), and a child that touched 100 MB is counted."""
    import subprocess
    import sys

    from tests.conftest import _proc_status

    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    own, _ = peak_rss()
    assert own >= 0.95 * rss_now() >= big.numel()
    hwm = _proc_status("VmHWM")
    if hwm:
        assert abs(own - hwm) < 0.05 * hwm, (own, hwm)
    del big
    subprocess.run([sys.executable, "-c", "b = bytearray(100 * 10**6)"], check=True)
    assert peak_rss()[1] >= 100 * 10**6


@pytest.mark.slow
def test_real_pair_load_costs_its_weights_once(real_pair):
    """The shared pair's load (bf16 target + draft, the session fixture) peaks at its weights plus one transient
    tensor (sizes.resident_bytes) and the slack above -- a memory-mapped load's file pages (~2.5 GB) fail this --
    and the process holds less than the budget with the pair resident (the session's peak, children included, is
    reported and checked by conftest: see pytest_sessionfinish)."""
    from specexec.loading import hub
    from specexec.loading.checkpoint import read_config
    from specexec.model import sizes

    weights = 0
    for alias in (REAL_TARGET, REAL_DRAFT):
        path = hub.local_path(alias)
        weights += sizes.stored_weights(path).resident_bytes(2, read_config(path))
    load = REAL_PAIR_LOAD
    assert load, "the real_pair fixture did not record its load"
    steady = load["rss_after"] - load["rss_before"]
    assert steady < weights + LOAD_SLACK, f"the loaded pair holds {steady / 1e9:.2f} GB for {weights / 1e9:.2f} GB"
    if load["peak"]:  # 0 where VmHWM could not be reset (not Linux)
        peak = load["peak"] - load["rss_before"]
        assert peak < weights + LOAD_SLACK, f"loading the pair peaked {peak / 1e9:.2f} GB above its start"
    assert rss_now() < RSS_BUDGET, (rss_now(), peak_rss())  # the pair resident beside everything else
