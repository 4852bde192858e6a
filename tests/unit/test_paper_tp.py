"""``bench/paper_tp.py``'s pure parts: it re-runs the settings the committed headline chose, and compares each
mode at its best TP."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_it_reads_the_headline_choices_and_ranks_each_mode_at_its_best_tp() -> None:
    sys.path.insert(0, str(BENCH))
    import paper
    import paper_tp

    src = json.loads(paper_tp.HEADLINE.read_text())
    chosen = paper_tp.chosen_settings(src, 64)
    assert set(chosen) == set(paper.MODES)
    assert chosen["dora"].repartition == "drain" and chosen["sync"].colocated and chosen["dora"].tp == paper.TP
    assert {m: st.name for m, st in chosen.items()} == src["results"]["64"]["best"]  # names as the headline's
    tp8 = paper_tp.at_tp(chosen["sync"], 8, 2.0)
    assert tp8.tp == 8 and tp8.hop_latency_s == 2e-6 and "tp=8 hop=2us" in tp8.name

    def row(thr: float) -> dict[str, dict[str, float]]:
        return {"throughput": {"mean": thr}, "step_time_s": {"mean": 1e6 / thr}}

    rows = {"sync": {4: row(100.0), 8: row(110.0)}, "one_step_off": {4: row(120.0), 8: row(115.0)},
            "partial": {4: row(150.0), 8: row(150.0)}, "dora": {4: row(130.0), 8: row(143.0)}}
    cmp = paper_tp.compare(rows, bound=200.0)
    assert cmp["best_tp"] == {"sync": 8, "one_step_off": 4, "partial": 4, "dora": 8}  # a tie keeps TP 4
    assert cmp["dora_vs_sync"] == pytest.approx(1.3) and cmp["dora_vs_one_step_off"] == 143.0 / 120.0
    assert cmp["dora_step_vs_sync"] == pytest.approx(1.3) and cmp["fraction_of_bound"]["dora"] == 143.0 / 200.0
