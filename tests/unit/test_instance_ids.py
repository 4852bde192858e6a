"""Instance indices claimed from the log (``core/instance_ids.py``): one owner per index, whatever the race."""

from __future__ import annotations

import itertools

import pytest

from dora_rl.core.instance_ids import RunFull, first_free, owned_by, owners


def test_first_record_owns_and_restart_gets_its_index_back() -> None:
    log = [(0, ""), (1, "node-a"), (1, "node-b"), (0, "node-c"), (2, "node-b")]
    own = owners(log)
    assert own == {0: "", 1: "node-a", 2: "node-b"}, "explicit instance 0, then the first claimant of each"
    assert owned_by(own, "node-a") == 1 and owned_by(own, "node-b") == 2 and owned_by(own, "node-c") is None
    assert owned_by(own, "") is None, "an explicitly numbered instance's empty name owns nothing by name"
    assert first_free(own, 16) == 3


def test_a_full_run_refuses_instead_of_sharing_an_index() -> None:
    with pytest.raises(RunFull, match="max_instances"):
        first_free({i: f"n{i}" for i in range(4)}, 4)


def simulate(order: list[str], limit: int) -> dict[str, int]:
    """Claimants that each read the log, claim first_free, and read back, in the interleaving ``order``
    (each entry: the claimant taking its next step). Returns who ended up owning what."""
    log: list[tuple[int, str]] = []
    state: dict[str, tuple[str, int]] = {n: ("read", -1) for n in set(order)}
    won: dict[str, int] = {}
    for name in itertools.chain(order, sorted(set(order)) * 3 * limit):
        if name in won:
            continue
        step, idx = state[name]
        if step == "read":
            mine = owned_by(owners(log), name)
            if mine is not None:
                won[name] = mine
                continue
            state[name] = ("claim", first_free(owners(log), limit))
        else:
            log.append((idx, name))
            state[name] = ("read", -1)
    return won


@pytest.mark.parametrize("order", [
    ["a", "b", "a", "b"],  # both read the empty log, both claim 0: a wins 0, b takes 1
    ["a", "b", "c", "c", "b", "a"],
    ["a", "a", "b", "b", "c", "c"],
])
def test_racing_claimants_never_share_an_index(order: list[str]) -> None:
    won = simulate(order, 8)
    assert len(won) == len(set(order)), "every claimant ends with an index"
    assert len(set(won.values())) == len(won), f"no index shared: {won}"
