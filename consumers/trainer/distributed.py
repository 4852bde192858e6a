"""Data-parallel training with PyTorch's FSDP2 (``fully_shard``): N ranks make the update 1 rank makes.

Invariant (tested by ``tests/unit/test_fsdp_gloo.py``): ``N`` ranks, each handed the *whole* batch
and training only its share of it through ``policy_update(..., dp=DataParallel(rank, N))``, end with
the same weights as one rank running ``policy_update`` on the whole batch (up to float rounding).

Why: one optimizer step of :func:`~.update.policy_update` descends the gradient of

    L = sum over every live token t of the minibatch of l_t / T,    T = the minibatch's token count.

Every rank knows ``T`` (it holds the whole batch), so rank ``r``'s loss
``L_r = sum over the tokens of its groups of l_t / T`` is a *partial sum* of ``L``, and since the
groups of the minibatch are split across ranks without overlap, ``grad L = sum_r grad L_r``. Hence
FSDP's gradient reduction must be a plain SUM (no division by the world size, FSDP's default):
:func:`shard_model` sets the divide factor to 1 and forces SUM collectives (gloo has no
``PREMUL_SUM``). After the reduce-scatter each rank holds its shard of ``grad L``; the gradient norm
(:func:`torch.nn.utils.clip_grad_norm_` over DTensor gradients) is the global one, so clipping and the
(elementwise) optimizer step on the shards reproduce the single-rank step exactly.

Collectives must match across ranks: every forward of a sharded model all-gathers each layer and
every backward reduce-scatters it, so all ranks must run the same number of forward/backward passes
per optimizer step; ``policy_update`` pads the ranks with fewer micro-batches with zero-loss dummy
passes (see there).

Also here: process-group set-up (:func:`init_ranks`, over a store rank 0 opened), the batch hand-off from rank
0 (:func:`broadcast_batch`), and full (unsharded, CPU) model/optimizer state dicts for checkpoints
(:func:`full_state_dict`, :func:`full_optimizer_state_dict`, :func:`load_full_state`;
:func:`plain_state_dicts` / :func:`load_plain` convert them to and from an unsharded model, locally).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

T = TypeVar("T")


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the data-parallel ranks: ``0 <= rank < world``.

    The default process group must be initialised (:func:`init_ranks`) before any collective here or in
    ``policy_update`` runs with ``world > 1``; ``world == 1`` never communicates.
    """

    rank: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"need 0 <= rank < world, got rank={self.rank} world={self.world}")

    def owner(self, j: int) -> int:
        """The rank that trains the ``j``-th group of a minibatch (round-robin)."""
        return j % self.world


def init_ranks(rank: int, world: int, store: dist.Store, cuda: bool, timeout_s: float) -> DataParallel:
    """Join the default process group of ``world`` ranks over ``store`` (a ``TCPStore`` rank 0 opened);
    returns this rank's :class:`DataParallel`. CPU: gloo. ``cuda``: gloo for CPU tensors and NCCL for
    CUDA ones (``"cpu:gloo,cuda:nccl"``; the caller sets its CUDA device first) — the GPU choice, not
    exercised by the tests here (no multi-GPU machine). ``timeout_s`` bounds every collective."""
    dp = DataParallel(rank, world)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise RuntimeError(f"rank {rank}/{world}: {backend} rendezvous failed") from exc
    return dp


def shard_model(model: torch.nn.Module) -> FSDPModule:
    """Shard ``model`` in place with FSDP2 and return it (the same object, now an :class:`FSDPModule`).

    A Hugging Face Llama gets one FSDP unit per decoder layer plus the root (embeddings, final norm
    and the tied LM head); any other model is one root unit. Gradient reduction is set to a SUM over
    ranks (divide factor 1, SUM collectives): see the module docstring for why.
    """
    if isinstance(model, LlamaForCausalLM):
        for layer in model.model.layers:
            fully_shard(layer)
    root = fully_shard(model)
    for module in model.modules():  # the same object as root, which is typed as FSDPModule only
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL_FROM_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The unsharded model weights on CPU. Collective: every rank must call it; rank 0 gets the full
    dict (names as the unsharded model's ``state_dict()``), the other ranks an empty dict. No returned
    tensor shares memory with the live model (later steps never change a snapshot)."""
    return _tree_copy(get_model_state_dict(model, options=_FULL), _storages(model.state_dict()))


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state with unsharded tensors on CPU, keyed by parameter name. Collective like
    :func:`full_state_dict` (rank 0 gets it all, the others an empty dict). No returned tensor shares
    memory with the live optimizer: torch hands back its CPU tensors as they are (AdamW's ``step``
    counters), which a later step would otherwise change in the snapshot."""
    return _tree_copy(dict(get_optimizer_state_dict(model, optimizer, options=_FULL)),
                      _storages(list(optimizer.state.values())))


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    model_sd: dict[str, Any], optim_sd: dict[str, Any] | None) -> None:
    """Load the full dicts of :func:`full_state_dict` / :func:`full_optimizer_state_dict` into the
    sharded ``model`` (and ``optimizer``). Collective: rank 0 passes the dicts, which it broadcasts;
    the other ranks may pass empty dicts. Every rank ends with its shard of the same state.

    The caller's dicts are left as they were and share no memory with the loaded state (torch's
    loaders replace the entries of the dicts they are given, and keep rank 0's unsharded tensors,
    e.g. AdamW's ``step``, as they are: two optimizers loaded from one dict would share counters)."""
    set_model_state_dict(model, _tree_copy(model_sd), options=_FULL_FROM_RANK0)
    if optimizer is None:
        return
    given = _storages(optim_sd or {})
    set_optimizer_state_dict(model, optimizer, _tree_copy(optim_sd or {}), options=_FULL_FROM_RANK0)
    for state in optimizer.state.values():
        state.update(_tree_copy(dict(state), given))


def plain_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The weights and optimizer state of an *unsharded* ``model`` in the format of :func:`full_state_dict`
    / :func:`full_optimizer_state_dict` (names as keys), for :func:`load_full_state`. Local, no collective:
    rank 0 calls it alone. An optimizer without state (never stepped) gives None. The tensors are the
    live ones (not copies): use the dicts before the model or optimizer changes."""
    model_sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    if optimizer is None or not optimizer.state:
        return model_sd, None
    names = _param_names(model, optimizer)
    sd = optimizer.state_dict()
    return model_sd, {"state": {names[i]: v for i, v in sd["state"].items()},
                      "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}


def load_plain(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict[str, Any],
               optim_sd: dict[str, Any]) -> None:
    """Load the full dicts of :func:`full_state_dict` / :func:`full_optimizer_state_dict` into an
    *unsharded* ``model`` and its ``optimizer`` (``optimizer.load_state_dict`` after renaming parameters to
    their positions; values copied exactly). Local, no collective. Afterwards ``optimizer.state_dict()`` is
    that of an optimizer built over ``model.parameters()`` (what a 1-rank trainer checkpoints and loads)."""
    model.load_state_dict(model_sd)
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    optimizer.load_state_dict({
        "state": {index[name]: v for name, v in optim_sd["state"].items()},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in optim_sd["param_groups"]],
    })


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name (as in ``model.named_parameters()``: a tied weight under its first name) of each of the
    optimizer's parameters, in ``state_dict()`` order (groups in order, each group's parameters in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storages(obj: Any) -> set[int]:
    """Addresses of the (local) storages of every tensor in the dicts/lists/tuples of ``obj``."""
    if isinstance(obj, torch.Tensor):
        ptr = _local(obj).untyped_storage().data_ptr()
        return {ptr} if ptr else set()
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
    return set().union(*(_storages(v) for v in items))


def _tree_copy(obj: T, clone: set[int] | frozenset[int] = frozenset()) -> T:
    """``obj`` with every dict/list/tuple in it copied (recursively) and every tensor whose storage is
    in ``clone`` cloned; any other value is shared."""
    out: Any = obj
    if isinstance(obj, dict):
        out = {k: _tree_copy(v, clone) for k, v in obj.items()}
    elif isinstance(obj, list | tuple):
        out = type(obj)(_tree_copy(v, clone) for v in obj)
    elif isinstance(obj, torch.Tensor) and clone and _local(obj).untyped_storage().data_ptr() in clone:
        out = obj.clone()
    return out


def broadcast_batch(obj: T | None, dp: DataParallel, group: dist.ProcessGroup | None = None) -> T:
    """Rank 0's ``obj`` (e.g. a training batch, a list of ``update.Sample``) on every rank.

    Rank 0 passes the object, the others anything (``None``); pickled, so it must be picklable.
    Collective over ``group`` (default: the default group): every rank must call it. ``world == 1``
    returns ``obj`` without communicating.
    """
    if dp.world == 1:
        if obj is None:
            raise ValueError("rank 0 must pass the object to broadcast")
        return obj
    box: list[Any] = [obj if dp.rank == 0 else None]
    if dp.rank == 0 and obj is None:
        raise ValueError("rank 0 must pass the object to broadcast")
    dist.broadcast_object_list(box, src=0, group=group)
    out: T = box[0]
    return out


def all_reduce_sum(values: list[float], dp: DataParallel) -> list[float]:
    """Elementwise sum of ``values`` over the ranks (float64), on every rank. Collective; every rank
    must pass a list of the same length. ``world == 1`` returns ``values`` unchanged."""
    if dp.world == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(x) for x in t]


def all_reduce_max(value: float, dp: DataParallel) -> float:
    """The maximum of ``value`` over the ranks, on every rank. Collective like :func:`all_reduce_sum`."""
    if dp.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])
