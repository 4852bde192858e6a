"""bench/scheduler.py's sweeps: every mode gets the same number of settings at every TP, the colocated partial
uses the whole cluster for both phases, and every setting is held to the same bound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import scheduler


@pytest.mark.parametrize(("gpus", "tps"), [(64, (4,)), (64, (4, 8)), (128, (4, 8))])
def test_every_mode_gets_a_sweep_of_the_same_size(gpus: int, tps: tuple[int, ...]) -> None:
    grids = scheduler.sweeps(gpus, tps)
    assert set(grids) == {"dora", "partial", "colocated"}
    assert len({len(g) for g in grids.values()}) == 1
    assert {st.staleness for g in grids.values() for st in g} == {scheduler.S}
    for st in grids["colocated"]:
        assert st.colocated and st.rollout_gpus == st.train_gpus == gpus and st.mode == "partial_bounded"
    for st in grids["dora"] + grids["partial"]:
        assert not st.colocated and st.rollout_gpus + st.train_gpus == gpus and st.rollout_gpus % st.tp == 0


def test_a_result_names_its_commit_and_its_machine() -> None:
    """Timed figures and bf16 numerics depend on the host (decision 0075): every result records it."""
    import provenance

    p = provenance.provenance()
    assert p["commit"] and len(p["commit"]) == 40
    assert p["machine"]["cpus"] >= 1 and isinstance(p["machine"]["cpu"], str)


def test_every_layouts_bound_is_recorded_and_the_bound_is_their_best() -> None:
    """``bound()`` is the best layout; a disaggregated layout is capped by its slower side, so no split passes the
    colocated layout when both phases scale linearly in GPUs (decision 0081)."""
    from dataclasses import replace

    from paper import Efficiencies, Setting, Workload, bound

    w, eff = Workload(), replace(Efficiencies(), train_mfu=scheduler.MFU)
    b = bound(64, w, eff, tp=8, hop_latency_s=scheduler.HOP_US * 1e-6)
    layouts = b["layouts"]
    assert set(layouts) == {"colocated"} | {f"{r}r+{64 - r}t" for r in range(8, 64, 8)}
    assert b["tokens_per_s"] == max(layouts.values()) and layouts[b["layout"]] == b["tokens_per_s"]
    assert max(v for k, v in layouts.items() if k != "colocated") < layouts["colocated"]
    chosen = {"dora": Setting("dora", 2, 2.0, 40, 24, repartition="consolidate", tp=8),
              "partial": Setting("partial_bounded", 2, 2.0, 24, 40, tp=4)}  # rollout-bound: its TP counts
    lb = scheduler.layout_bounds(64, w, eff, chosen)
    assert lb["dora"] == layouts["40r+24t"]
    assert lb["partial"] == bound(64, w, eff, tp=4)["layouts"]["24r+40t"] != layouts["24r+40t"]
    assert lb["best_disaggregated"] >= max(lb["dora"], lb["partial"])


@pytest.mark.parametrize("tps", [(8,), (4, 8)])
def test_colocated_dora_and_the_colocated_partial_get_sweeps_of_the_same_size(tps: tuple[int, ...]) -> None:
    """bench/colocated_dora.py: both modes on every GPU for both phases, the same S, the same sweep size."""
    import colocated_dora

    grids = colocated_dora.sweeps(64, tps)
    assert len(grids["dora_colocated"]) == len(grids["partial_colocated"]) == 24 * len(tps)
    for label, mode in (("dora_colocated", "dora"), ("partial_colocated", "partial_bounded")):
        for st in grids[label]:
            assert st.colocated and st.rollout_gpus == st.train_gpus == 64 and st.mode == mode
            assert st.staleness == scheduler.S and st.tp in tps
    assert {st.repartition for st in grids["dora_colocated"]} == {"drain", "consolidate"}
