"""Data-parallel FSDP2 on CPU/gloo: 2 ranks on disjoint groups make the update 1 rank makes on the union.

One spawn of 2 gloo ranks runs three things on the same batch (4 groups x 4 samples, one group with
equal rewards, so advantage 0, and uneven micro-batch counts, so the dummy passes run):

* synced: ``shard_model`` + ``policy_update(..., dp=...)``, 2 updates (the 2nd decoupled) — must match
  1 rank on the whole batch (plain model, ``dp=DataParallel(0, 1)``: the same arithmetic, one model call
  per micro-batch) to 1e-5 on every tensor, with the same global stats, and ``dp=None`` (shared prompt
  forwards, other float rounding) to 1e-4;
* restored: the synced model/optimizer saved with ``full_*_state_dict`` and loaded into a fresh
  sharded model with ``load_full_state``, then one more update on both — must stay identical;
* bf16: the synced training again under the trainer's bf16 precision (autocast over fp32 master weights)
  — must match 1 rank under the same precision as closely as 1 rank matches itself when only its
  micro-batch split changes (bf16 GEMMs round each micro-batch's weight gradient to bf16, so no split
  of the rows is exact; measured 3.9e-3 max-abs against 4.0e-3 moved on this toy, where 2 AdamW steps
  from a fresh state are nearly sign steps: docs/decisions/0042). Compared by ``‖Δθ_a − Δθ_b‖ / ‖Δθ_b‖``;
* unsynced (negative control): the same, but FSDP's gradient reduce-scatter replaced by a local copy
  (each rank keeps its own gradient shard) — must NOT match, so the gradient sum is what makes them match.
"""

from __future__ import annotations

import copy
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from dora_rl.config import DoraConfig
from dora_rl.consumers.trainer.distributed import (
    DataParallel,
    broadcast_batch,
    full_optimizer_state_dict,
    full_state_dict,
    init_ranks,
    load_full_state,
    shard_model,
)
from dora_rl.consumers.trainer.grpo import sequence_logprobs
from dora_rl.consumers.trainer.step import precision
from dora_rl.consumers.trainer.update import Sample, group_minibatches, policy_update, rank_rows
from dora_rl.modeling import build_tiny_model, load_policy

torch.set_num_threads(1)

TOL = 1e-5
KW: dict[str, Any] = dict(minibatches=2, micro_tokens=40, grad_clip=1.0)
STEPS: list[dict[str, Any]] = [dict(seed=0), dict(seed=1, decoupled=True)]  # "2 steps" of the issue
BF16 = DoraConfig(dtype="bf16").validate()
STAT_KEYS = ("loss", "clip_frac", "approx_kl", "ratio_mean", "ratio_max", "grad_norm", "tis_weight_mean")


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _batch(model: torch.nn.Module) -> list[Sample]:
    """4 groups x 4 samples: distinct prompts, random responses (1..14 tokens), behaviour log-probs
    near the model's own; group 2 has equal rewards (A == 0, skipped)."""
    g = torch.Generator().manual_seed(1)
    rewards = [[0.0, 1.0, 0.5, 1.0], [1.0, 0.0, 0.0, 0.2], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 1.0, 0.7]]
    out = []
    for k in range(4):
        prompt = [1, *torch.randint(4, 50, (3 + k,), generator=g).tolist()]
        for j in range(4):
            n = int(torch.randint(1, 15, (1,), generator=g))
            resp = torch.randint(4, 50, (n,), generator=g).tolist()
            with torch.no_grad():
                cur, _ = sequence_logprobs(model, [prompt], [resp])
            beh = (cur[0, :n] + 0.1 * torch.randn(n, generator=g)).tolist()
            out.append(Sample(prompt, resp, beh, rewards[k][j], f"g{k}"))
    return out


class _LocalReduceScatter(ReduceScatter):
    """Gradient synchronisation switched off: each rank keeps its own shard of its LOCAL gradient."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])


def _train(model_dir: Path, samples: list[Sample], dp: DataParallel, sync: bool) -> tuple[Any, Any, list[Any]]:
    model, _ = load_policy(model_dir)
    sharded = shard_model(model)
    if not sync:
        for m in sharded.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(_LocalReduceScatter())
    opt = _optimizer(model)
    stats = [policy_update(model, opt, samples, dp=dp, **KW, **step) for step in STEPS]
    return model, opt, stats


def _worker(rank: int, world: int, port: int, model_dir: Path, samples: list[Sample], out: Path) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dp = init_ranks(rank, world, store, cuda=False, timeout_s=120.0)  # a collective mismatch fails, not hangs
    try:
        batch = broadcast_batch(samples if rank == 0 else None, dp)
        model, opt, stats = _train(model_dir, batch, dp, sync=True)
        synced, osd = full_state_dict(model), full_optimizer_state_dict(model, opt)
        restored, _ = load_policy(model_dir)
        shard_model(restored)
        ropt = _optimizer(restored)
        load_full_state(restored, ropt, synced if rank == 0 else {}, osd if rank == 0 else {})
        for m, o in ((model, opt), (restored, ropt)):
            policy_update(m, o, batch, dp=dp, **KW, seed=2)
        after, after_restored = full_state_dict(model), full_state_dict(restored)
        unsynced_model, _, _ = _train(model_dir, batch, dp, sync=False)
        unsynced = full_state_dict(unsynced_model)
        with precision(BF16):
            bf16_model, _, _ = _train(model_dir, batch, dp, sync=True)
        bf16 = full_state_dict(bf16_model)
        if rank == 0:
            torch.save(dict(synced=synced, stats=stats, after=after, after_restored=after_restored,
                            unsynced=unsynced, bf16=bf16), out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


WHOLE = {**KW, "micro_tokens": 10_000}  # the same update, each minibatch in one micro-batch


def _bf16_one_rank(model_dir: Path, samples: list[Sample], kw: dict[str, Any]) -> torch.nn.Module:
    model, _ = load_policy(model_dir)
    opt = _optimizer(model)
    with precision(BF16):
        for step in STEPS:
            policy_update(model, opt, samples, dp=DataParallel(0, 1), **kw, **step)
    return model


def _rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> float:
    """``‖a − b‖ / ‖b − initial‖`` over every tensor: two updates' difference relative to the update's size."""
    num = sum(float((a[k].float() - b[k].float()).norm() ** 2) for k in b)
    den = sum(float((b[k].float() - initial[k].float()).norm() ** 2) for k in b)
    return (num / den) ** 0.5


def test_two_gloo_ranks_match_one_rank_on_the_union_and_unsynced_do_not(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    model_dir = build_tiny_model(tmp_path / "m", "1m", seed=0)
    model, _ = load_policy(model_dir)
    initial = _snapshot(model)
    samples = _batch(model)
    shared = copy.deepcopy(model)
    opt = _optimizer(model)
    one = DataParallel(0, 1)  # 1 rank, plain model: the ranks' arithmetic (one model call per micro-batch)
    ref_stats = [policy_update(model, opt, samples, dp=one, **KW, **step) for step in STEPS]
    ref = _snapshot(model)
    policy_update(model, opt, samples, dp=one, **KW, seed=2)
    ref_after = _snapshot(model)
    bf16_model, bf16_whole = _bf16_one_rank(model_dir, samples, KW), _bf16_one_rank(model_dir, samples, WHOLE)
    shared_opt = _optimizer(shared)  # dp=None: the single-trainer path (shared prompt forwards)
    for step in STEPS:
        policy_update(shared, shared_opt, samples, **KW, **step)

    out = tmp_path / "rank0.pt"
    mp.start_processes(_worker, args=(2, _free_port(), model_dir, samples, out), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(out, weights_only=False)

    moved = _max_diff(ref, initial)
    synced, unsynced = _max_diff(got["synced"], ref), _max_diff(got["unsynced"], ref)
    vs_shared = _max_diff(got["synced"], _snapshot(shared))
    bf16_ranks = _rel_diff(got["bf16"], _snapshot(bf16_model), initial)
    bf16_floor = _rel_diff(_snapshot(bf16_whole), _snapshot(bf16_model), initial)
    print(f"moved {moved:.3e} synced diff {synced:.3e} unsynced diff {unsynced:.3e} vs dp=None {vs_shared:.3e} "
          f"bf16 2 ranks vs 1 (relative) {bf16_ranks:.3e}, 1 rank vs itself split otherwise {bf16_floor:.3e} "
          f"restored diff {_max_diff(got['after_restored'], got['after']):.3e} "
          f"{time.perf_counter() - t0:.1f}s")
    assert moved > 1e-3  # a non-trivial update
    assert synced <= TOL
    # dp=None runs a group's prompt once (KV cache shared by its samples): equal up to float rounding,
    # which 4 AdamW steps amplify to ~2e-5 here (AdamW divides by the gradients' own scale)
    assert vs_shared <= 1e-4
    assert bf16_ranks <= max(bf16_floor, 1e-5)  # bf16: 2 ranks make the 1-rank update up to bf16's own split noise
    assert unsynced > 100 * TOL  # without the gradient sum the ranks do not make the 1-rank update
    for mine, theirs in zip(got["stats"], ref_stats, strict=True):
        for k in STAT_KEYS:
            assert abs(mine.get(k, 0.0) - theirs.get(k, 0.0)) <= 1e-4 * max(1.0, abs(theirs.get(k, 0.0))), k
        assert mine["optimizer_steps"] == theirs["optimizer_steps"] == 2.0
    assert _max_diff(got["after_restored"], got["after"]) == 0.0  # checkpoint round trip is exact
    assert _max_diff(got["after"], ref_after) <= TOL


def test_rank_rows_split_each_minibatch_by_whole_groups_round_robin() -> None:
    s = [Sample([1], [3], [-1.0], 0.0, f"g{k // 3}") for k in range(21)]  # 7 groups of 3
    dp = DataParallel(1, 3)
    for chunk in group_minibatches(s, 2, np.random.default_rng(0)):
        parts = rank_rows(s, chunk, dp)
        assert sorted(i for p in parts for i in p) == sorted(chunk)
        groups = list(dict.fromkeys(s[i].group_id for i in chunk))
        for r, part in enumerate(parts):
            assert list(dict.fromkeys(s[i].group_id for i in part)) == groups[r::3]
    with pytest.raises(ValueError):
        DataParallel(2, 2)
