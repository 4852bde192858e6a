"""The sections of ``bench/gpu_check.py`` (each ``fn(ctx) -> dict``; checks go to ``ctx.check``).

Models: ``tiny(ctx, size)`` is the product's char-level Llama (built locally); ``smol_shape(ctx)`` a randomly
initialised Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, vocabulary 49,152,
tied embeddings): the timing of a real 135M model without its weights. In the small (CPU) mode every
size shrinks so the whole check runs in well under a minute.
"""

from __future__ import annotations

import copy
import platform
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from dora_rl.config import DoraConfig
from dora_rl.consumers.trainer import checkpoint
from dora_rl.consumers.trainer.grpo import sequence_logprobs, warmup_cosine_schedule
from dora_rl.consumers.trainer.precision import precision
from dora_rl.consumers.trainer.sft import sft_warmup
from dora_rl.consumers.trainer.throughput import (
    mfu,
    model_flops_per_token,
    peak_flops,
    resolved_micro_tokens,
)
from dora_rl.consumers.trainer.update import Sample, policy_update
from dora_rl.core.tasks import get_task
from dora_rl.modeling import (
    attention_kernels,
    build_tiny_model,
    decode_completion,
    encode_prompt,
    keep_lm_head_fp32,
    load_policy,
    load_weights,
    state_dict_for_transfer,
)
from dora_rl.producers.rollout.engine import GenRequest
from dora_rl.producers.rollout.torch_engine import TorchEngine

NEVER = -1
"""An EOS id no token has: timed requests run to their length cap."""


@dataclass
class Context:
    device: str
    small: bool
    workdir: Path
    rl_prompts: int = 128
    """Prompts per RL step of ``rl_loop`` (x 8 samples; the product's default batch is 128 x 8)."""
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def check(self, name: str, value: float, limit: float, ok: bool) -> None:
        """Record a check; in the small mode a failed one raises at once (CI asserts)."""
        self.checks[name] = {"value": value, "limit": limit, "pass": bool(ok)}
        if self.small and not ok:
            raise AssertionError(f"check {name}: {value} against {limit}")

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def tiny(ctx: Context, size: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, Any, Path]:
    path = ctx.workdir / f"tiny-{size}-{seed}"
    if not (path / "config.json").exists():
        build_tiny_model(path, size, seed=seed)
    model, tok = load_policy(path, dtype=dtype, device=ctx.device)
    return model, tok, path


def smol_shape(ctx: Context, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    big = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=512)
    cfg = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0,
                      **(small if ctx.small else big))
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=ctx.device, dtype=dtype).eval()


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [[1, *g.integers(4, vocab, length - 1).tolist()] for _ in range(n)]


# -- env -----------------------------------------------------------------------------------------------


def env(ctx: Context) -> dict[str, Any]:
    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": ctx.device}
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return out


# -- correctness ---------------------------------------------------------------------------------------


def fresh_groups(model: torch.nn.Module, groups: int, size: int = 4, seed: int = 3) -> list[Sample]:
    """``groups`` x ``size`` samples whose behaviour log-probs are the model's own (fresh data)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        prompt = [1, *torch.randint(4, 40, (4 + k % 3,), generator=g).tolist()]
        for j in range(size):
            resp = torch.randint(4, 40, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            with torch.no_grad():
                own, _ = sequence_logprobs(model, [prompt], [resp])
            out.append(Sample(prompt, resp, own[0].tolist(), float((j + k) % 3 == 0), f"g{k}"))
    return out


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def moved_by_update(path: Path, ctx: Context, dtype: str, samples: list[Sample], minibatches: int = 8,
                    **kw: Any) -> tuple[torch.Tensor, dict]:
    """Δθ (flat, fp32) and the stats of one ``minibatches``-step update of the model at ``path`` under
    ``precision`` of ``dtype`` (AdamW at the product's lr)."""
    model, _ = load_policy(path, device=ctx.device)
    before = _flat(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    with precision(DoraConfig(device=ctx.device, dtype=dtype).validate()):  # type: ignore[arg-type]
        stats = policy_update(model, opt, samples, minibatches=minibatches, seed=0, **kw)
    return _flat(model) - before, stats


BF16_DRIFT_LIMIT = 0.75
"""The most an 8-step bf16 update may differ from its fp32 twin, as a share of the one-step floor: the
difference of a single step (``‖Δθ_bf16 − Δθ_fp32‖ / ‖Δθ_fp32‖``). AdamW's first step is a sign step, so
bf16 rounding of near-zero gradients flips whole steps; that floor is the hardware's (0.11 on an AMD EPYC
CPU). Over 8 steps correct updates average that noise down (0.38–0.55 of the floor, seeds 2–4); forwards
that compute with stale weights (autocast's weight cache, decision 0042) drift away (7.5x the floor)."""


def bf16_drift(update: Any, samples: list[Sample]) -> tuple[float, float, dict, dict]:
    """(8-step relative difference, one-step floor, fp32 stats, bf16 stats) of ``update(dtype, samples,
    minibatches)`` -> (Δθ, stats). The floor is one step on one minibatch's worth of ``samples``."""
    d32, s32 = update("fp32", samples, 8)
    d16, s16 = update("bf16", samples, 8)
    one32, _ = update("fp32", samples[: len(samples) // 8], 1)  # one minibatch's worth: the floor, at 1/8 the cost
    one16, _ = update("bf16", samples[: len(samples) // 8], 1)
    return float((d16 - d32).norm() / d32.norm()), float((one16 - one32).norm() / one32.norm()), s32, s16


def bf16_update(ctx: Context) -> dict[str, Any]:
    model, _, path = tiny(ctx, "1m", seed=2)
    samples = fresh_groups(model, 32)
    rel, floor, s32, s16 = bf16_drift(lambda dt, ss, mb: moved_by_update(path, ctx, dt, ss, mb), samples)
    ctx.check("bf16_update.share_of_one_step_floor", rel / floor, BF16_DRIFT_LIMIT, rel <= BF16_DRIFT_LIMIT * floor)
    ctx.check("bf16_update.clip_frac_seen", s16["clip_frac"], 0.5 * s32["clip_frac"],
              s16["clip_frac"] >= 0.5 * s32["clip_frac"] > 0)
    return {"relative_diff": rel, "one_step_floor": floor,
            "clip_frac": {"fp32": s32["clip_frac"], "bf16": s16["clip_frac"]},
            "approx_kl": {"fp32": s32["approx_kl"], "bf16": s16["approx_kl"]}, "minibatches": 8, "trajectories": 128}


def packing(ctx: Context) -> dict[str, Any]:
    model, _, _ = tiny(ctx, "1m", seed=1)
    samples = fresh_groups(model, 8)
    ps, rs = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    with torch.no_grad():
        padded, _ = sequence_logprobs(model, ps, rs, share_prompts=False)
        packed, _ = sequence_logprobs(model, ps, rs, packed=True)
    gap = float((padded - packed).abs().max())
    ctx.check("packing.logprob_gap", gap, 1e-4, gap <= 1e-4)
    return {"max_logprob_gap": gap}


def _generate(model: Any, reqs: list[GenRequest], static: bool, seed: int = 0) -> list[list[int]]:
    eng = TorchEngine(model, None, eos_id=NEVER, pad_id=0, seed=seed, static_cache=static)
    return [r.token_ids for r in eng.generate(reqs)]


def static_cache(ctx: Context) -> dict[str, Any]:
    model, _, _ = tiny(ctx, "1m", seed=0)
    ps = prompts(12, 9, 40)
    reqs = [GenRequest(request_id=f"r{i}", prompt_ids=p[: 3 + i % 6], max_new_tokens=5 + 7 * (i % 4))
            for i, p in enumerate(ps)]
    same = _generate(model, reqs, static=False) == _generate(model, reqs, static=True)
    ctx.check("static_cache.same_tokens", float(same), 1.0, same)
    return {"same_tokens": same, "requests": len(reqs)}


def _trainer(path: Path, ctx: Context) -> tuple[Any, Any, Any]:
    model, _ = load_policy(path, device=ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    return model, opt, warmup_cosine_schedule(opt, 2)


def checkpoint_section(ctx: Context) -> dict[str, Any]:
    model, opt, sched = _trainer(tiny(ctx, "1m", seed=4)[2], ctx)
    samples = fresh_groups(model, 6)
    policy_update(model, opt, samples, minibatches=2, lr_scheduler=sched)
    root = checkpoint.StorageRoot(ctx.workdir / "ckpt")
    saved = checkpoint.save(root, 1, "check", model, opt, sched, step=1)
    other, oopt, osched = _trainer(tiny(ctx, "1m", seed=4)[2], ctx)
    step = checkpoint.load_from(root, saved, other, oopt, osched)
    same_weights = bool(torch.equal(_flat(model), _flat(other)))
    for m, o, s in ((model, opt, sched), (other, oopt, osched)):
        policy_update(m, o, samples, minibatches=2, seed=1, lr_scheduler=s)
    gap = float((_flat(model) - _flat(other)).abs().max())
    ctx.check("checkpoint.round_trip", gap, 0.0, same_weights and step == 1 and gap == 0.0)
    return {"weights_equal_after_load": same_weights, "gap_after_next_update": gap}



def fsdp(ctx: Context) -> dict[str, Any]:
    import torch.distributed as dist

    from dora_rl.consumers.trainer.distributed import DataParallel, init_ranks, shard_model

    path = tiny(ctx, "1m", seed=5)[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    init_ranks(0, 1, store, cuda=ctx.device == "cuda", timeout_s=120.0)
    try:
        out: dict[str, Any] = {"backend": dist.get_backend()}
        for dtype in ("fp32", "bf16"):
            plain, _ = load_policy(path, device=ctx.device)
            opt = torch.optim.AdamW(plain.parameters(), lr=3e-4, weight_decay=0.0)
            samples = fresh_groups(plain, 8)
            sharded, _ = load_policy(path, device=ctx.device)
            shard_model(sharded)
            sopt_model = torch.optim.AdamW(sharded.parameters(), lr=3e-4, weight_decay=0.0)
            with precision(DoraConfig(device=ctx.device, dtype=dtype).validate()):  # type: ignore[arg-type]
                policy_update(plain, opt, samples, minibatches=2, dp=DataParallel(0, 1))
                policy_update(sharded, sopt_model, samples, minibatches=2, dp=DataParallel(0, 1))
            full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sharded.state_dict().items()}
            gap = max(float((full[k].float() - v.float()).abs().max()) for k, v in plain.state_dict().items())
            ctx.check(f"fsdp.one_rank_{dtype}", gap, 1e-5, gap <= 1e-5)
            out[f"max_gap_{dtype}"] = gap
        return out
    finally:
        dist.destroy_process_group()


# -- log-probs ----------------------------------------------------------------------------------------


def logprobs(ctx: Context) -> dict[str, Any]:
    """Tokens sampled by the engine (its weights in ``dtype``) scored by the trainer (fp32 master weights,
    autocast in bf16), on the 135M shape; ``bf16_head_fp32``: both compute their logits in fp32."""
    master = smol_shape(ctx)
    n, new = (8, 8) if ctx.small else (64, 64)
    reqs = [GenRequest(request_id=f"r{i}", prompt_ids=p, max_new_tokens=new)
            for i, p in enumerate(prompts(n, 32, master.config.vocab_size))]
    out: dict[str, Any] = {}
    for variant in ("fp32", "bf16", "bf16_head_fp32"):
        dtype = variant[:4]
        engine_model = copy.deepcopy(master).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        trainer_model = copy.deepcopy(master)
        if variant == "bf16_head_fp32":
            keep_lm_head_fp32(engine_model)
            keep_lm_head_fp32(trainer_model)
        eng = TorchEngine(engine_model, None, eos_id=NEVER, pad_id=0, seed=0)
        res = eng.generate(reqs)
        with torch.no_grad(), precision(DoraConfig(device=ctx.device, dtype=dtype).validate()):  # type: ignore
            mine, mask = sequence_logprobs(trainer_model, [r.prompt_ids for r in reqs], [r.token_ids for r in res],
                                           packed=ctx.device == "cuda")
        theirs = torch.zeros_like(mine)
        for b, r in enumerate(res):
            theirs[b, : len(r.logprobs)] = torch.tensor(r.logprobs, device=mine.device)
        gap = (mine - theirs).abs() * mask
        out[variant] = {"mean": float(gap.sum() / mask.sum()), "max": float(gap.max())}
        del engine_model, trainer_model, eng
    ctx.check("logprobs.fp32_mean", out["fp32"]["mean"], 1e-4, out["fp32"]["mean"] <= 1e-4)
    return out


# -- engine --------------------------------------------------------------------------------------------


def _time(ctx: Context, fn: Any) -> float:
    ctx.sync()
    t0 = time.perf_counter()
    fn()
    ctx.sync()
    return time.perf_counter() - t0


def _hf_generate(model: Any, ps: list[list[int]], new: int, seed: int = 0) -> None:
    ids = torch.tensor(ps, device=model.device)
    torch.manual_seed(seed)
    with attention_kernels(model.device):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0, eos_token_id=None,
                       use_cache=True)


def _engine_row(ctx: Context, model: Any, batch: int, new: int) -> dict[str, Any]:
    ps = prompts(batch, 32, model.config.vocab_size, seed=batch)
    reqs = [GenRequest(request_id=f"r{i}", prompt_ids=p, max_new_tokens=new) for i, p in enumerate(ps)]
    row: dict[str, Any] = {"batch": batch, "new_tokens": new}
    runs = [("engine", lambda: _generate(model, reqs, static=False)),
            ("engine_static", lambda: _generate(model, reqs, static=True)),
            ("hf_generate", lambda: _hf_generate(model, ps, new))]
    for name, fn in runs if batch in (64, 256) or ctx.small else runs[::2]:  # static: at the checked sizes
        fn()  # warm-up: kernels chosen, allocator grown
        secs = min(_time(ctx, fn) for _ in range(2))  # the better of two: host jitter only slows a run
        row[name] = {"tokens_per_s": batch * new / secs, "step_ms": 1000 * secs / new}
    return row


def _profile_decode(ctx: Context, batch: int, new: int) -> list[str]:
    """The top operators (by host time) of one engine call: where a decode step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny(ctx, "10m", torch.bfloat16)[0]
    reqs = [GenRequest(request_id=f"r{i}", prompt_ids=p, max_new_tokens=new)
            for i, p in enumerate(prompts(batch, 32, model.config.vocab_size))]
    _generate(model, reqs, static=False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device == "cuda" else [])
    with profile(activities=acts) as prof:
        _generate(model, reqs, static=False)
        ctx.sync()
    return str(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)).splitlines()


def engine(ctx: Context) -> dict[str, Any]:
    batches = [1, 8] if ctx.small else [1, 64, 256, 512]
    new = 8 if ctx.small else 64
    out: dict[str, Any] = {}
    for model_name in ("tiny-10m", "smol-135m-shape"):
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            model = tiny(ctx, "10m", dtype)[0] if model_name == "tiny-10m" else smol_shape(ctx, dtype)
            sizes = batches if model_name == "tiny-10m" or ctx.small else [64, 256]
            steps = new if model_name == "tiny-10m" or ctx.small else new // 2
            out[f"{model_name}/{dtype_name}"] = [_engine_row(ctx, model, b, steps) for b in sizes]
            del model
    out["profile_tiny_bf16_b64"] = _profile_decode(ctx, 64 if not ctx.small else 8, new)
    for model_name in ("tiny-10m", "smol-135m-shape"):
        fp32 = {r["batch"]: r for r in out[f"{model_name}/fp32"]}
        for r in out[f"{model_name}/bf16"]:
            if r["batch"] in (64, 256):
                best = max(r["engine"]["tokens_per_s"], r["engine_static"]["tokens_per_s"])
                ref = fp32[r["batch"]]
                fp32_best = max(ref["engine"]["tokens_per_s"], ref["engine_static"]["tokens_per_s"])
                ctx.check(f"engine.{model_name}.bf16_not_slower_than_fp32.b{r['batch']}", best / fp32_best, 1.0,
                          best >= fp32_best)
                hf = r["hf_generate"]["tokens_per_s"]
                ctx.check(f"engine.{model_name}.bf16_vs_hf_generate.b{r['batch']}", best / hf, 1.0, best >= hf)
    return out


# -- update --------------------------------------------------------------------------------------------


def _update_batch(model: Any, n: int, p_len: int, r_len: int) -> list[Sample]:
    ps, rs = prompts(n // 8, p_len, model.config.vocab_size, seed=7), prompts(n, r_len, model.config.vocab_size, 8)
    out = []
    for i in range(n):
        prompt = ps[i // 8]
        with torch.no_grad():
            own, _ = sequence_logprobs(model, [prompt], [rs[i]])
        out.append(Sample(prompt, rs[i], own[0].float().tolist(), float(i % 3 == 0), f"g{i // 8}"))
    return out


def _timed_update(ctx: Context, model: Any, samples: list[Sample], micro_tokens: int, packed: bool,
                  fused: bool) -> dict[str, Any]:
    """One warm-up update, then one timed (bf16 autocast over fp32 master weights, 8 minibatches). The
    warm-up's responses are one token shorter, so the timed update meets shapes it has not seen (as every
    real step does: a kernel that plans per shape pays for it in the timing)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-6, weight_decay=0.0, fused=fused)
    shorter = [Sample(x.prompt_ids, x.response_ids[:-1], x.behaviour_logprobs[:-1], x.reward, x.group_id)
               for x in samples[:64]]

    def run(batch: list[Sample]) -> None:
        policy_update(model, opt, batch, minibatches=8, micro_tokens=micro_tokens, packed=packed)

    with precision(DoraConfig(device=ctx.device, dtype="bf16").validate()):
        run(shorter)
        if ctx.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        secs = _time(ctx, lambda: run(samples))
    tokens = float(sum(len(x.prompt_ids) + len(x.response_ids) for x in samples))
    used = mfu(model_flops_per_token(model), tokens, secs, peak_flops(torch.device(ctx.device), True))
    return {"update_s": secs, "tokens_per_s": tokens / secs, "mfu": used,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if ctx.device == "cuda" else None}


def update(ctx: Context) -> dict[str, Any]:
    """Today's settings against the device's, at 64 trajectories (the issue's probe) and 256 (a quarter of
    the product's default batch), 8 groups of 8 per 64, 64 prompt + 256 response tokens each."""
    sizes, p_len, r_len = ((16,), 8, 16) if ctx.small else ((64, 256), 64, 256)
    master = smol_shape(ctx)
    derived = resolved_micro_tokens(0, master, bf16=True, checkpointing=False)
    settings = {"today": dict(micro_tokens=1024, packed=False, fused=False),
                "device": dict(micro_tokens=derived, packed=ctx.device == "cuda", fused=ctx.device == "cuda")}
    out: dict[str, Any] = {"prompt_tokens": p_len, "response_tokens": r_len, "minibatches": 8}
    for n in sizes:
        samples = _update_batch(master, n, p_len, r_len)
        row: dict[str, Any] = {name: {**st, **_timed_update(ctx, copy.deepcopy(master), samples, **st)}
                               for name, st in settings.items()}
        row["speedup"] = row["device"]["tokens_per_s"] / row["today"]["tokens_per_s"]
        out[f"trajectories_{n}"] = row
        if not ctx.small:
            ctx.check(f"update.tokens_per_s_vs_fixed_1024.t{n}", row["speedup"], 10.0, row["speedup"] >= 10.0)
    out["profile_device_setting"] = _profile(ctx, master, sizes[0], p_len, r_len, settings["device"])
    return out


def _profile(ctx: Context, master: Any, n: int, p_len: int, r_len: int, setting: dict[str, Any]) -> list[str]:
    """The top operators (by host time) of one update at the device's setting: where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    model, samples = copy.deepcopy(master), _update_batch(master, n, p_len, r_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-6, weight_decay=0.0, fused=bool(setting["fused"]))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device == "cuda" else [])
    with precision(DoraConfig(device=ctx.device, dtype="bf16").validate()), profile(activities=acts) as prof:
        policy_update(model, opt, samples, minibatches=8, micro_tokens=int(setting["micro_tokens"]),
                      packed=bool(setting["packed"]))
        ctx.sync()
    return str(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)).splitlines()


# -- RL loop -------------------------------------------------------------------------------------------


def rl_loop(ctx: Context) -> dict[str, Any]:
    """The same loop in the product's bf16 and in fp32 (same seed, same prompts): the bf16 path must learn,
    and the fp32 twin says how much this workload learns in these steps at all."""
    out = {dtype: _rl_run(ctx, dtype) for dtype in ("bf16", "fp32")}
    gain = {d: out[d]["last5"] - out[d]["first5"] for d in out}
    if not ctx.small:
        ctx.check("rl_loop.bf16_last5_minus_first5", gain["bf16"], 0.03, gain["bf16"] >= 0.03)
    rel = out["bf16"]["first_update_vs_fp32"]
    ctx.check("rl_loop.first_update_bf16_vs_fp32", rel, 0.05, rel <= 0.05 or ctx.small)
    rewards = out["bf16"]["rewards"] + out["fp32"]["rewards"]
    ctx.check("rl_loop.rewards_finite", float(np.isfinite(rewards).all()), 1.0, bool(np.isfinite(rewards).all()))
    return {**out, "gain": gain}


def _rl_run(ctx: Context, dtype: str) -> dict[str, Any]:
    """SFT warm-up, then on-policy GRPO steps: trainer fp32 master weights (bf16 autocast when ``dtype`` is
    bf16), the engine holding a ``dtype`` copy refreshed after every update, fixed seed. At the first step
    the same batch is also applied in fp32 to a copy: ``‖Δθ − Δθ_fp32‖ / ‖Δθ_fp32‖`` on a real batch."""
    steps, prompts_n, group, sft = (2, 4, 4, 5) if ctx.small else (15, ctx.rl_prompts, 8, 150)
    torch.manual_seed(0)
    task = get_task("reverse")
    master, tok, path = tiny(ctx, "1m", seed=0)
    sft_warmup(master, tok, task, sft, 64, 3e-3, 16, seed=0)
    engine_model, _ = load_policy(path, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32, device=ctx.device)
    load_weights(engine_model, state_dict_for_transfer(master))
    eng = TorchEngine(engine_model, tok, seed=0)
    opt = torch.optim.AdamW(master.parameters(), lr=3e-4, weight_decay=0.0, fused=ctx.device == "cuda")
    sched = warmup_cosine_schedule(opt, 10)
    rng = random.Random(10_000)
    rewards: list[float] = []
    stats: list[dict[str, float]] = []
    first_rel = float("nan")
    cfg = DoraConfig(device=ctx.device, dtype=dtype).validate()  # type: ignore[arg-type]
    for step in range(steps):
        problems = [task.sample(rng) for _ in range(prompts_n)]
        reqs = [GenRequest(request_id=f"{p}-{g}", prompt_ids=encode_prompt(tok, problems[p].prompt), max_new_tokens=128)
                for p in range(prompts_n) for g in range(group)]
        res = eng.generate(reqs)
        scores = [task.reward(problems[k // group].reference, decode_completion(tok, r.token_ids))
                  for k, r in enumerate(res)]
        samples = [Sample(q.prompt_ids, r.token_ids, r.logprobs, s, str(k // group))
                   for k, (q, r, s) in enumerate(zip(reqs, res, scores, strict=True))]
        kw = dict(minibatches=8, seed=20_000 + step, packed=ctx.device == "cuda")
        if step == 0:
            twin = copy.deepcopy(master)  # its own AdamW: a deep-copied optimizer would step copies of the weights
            twin_opt = torch.optim.AdamW(twin.parameters(), lr=3e-4, weight_decay=0.0, fused=ctx.device == "cuda")
            before = _flat(master)
            policy_update(twin, twin_opt, samples, lr_scheduler=warmup_cosine_schedule(twin_opt, 10), **kw)
        with precision(cfg):
            st = policy_update(master, opt, samples, lr_scheduler=sched, **kw)
        if step == 0:
            d32 = _flat(twin) - before
            first_rel = float((_flat(master) - before - d32).norm() / d32.norm())
        load_weights(engine_model, state_dict_for_transfer(master))
        rewards.append(sum(scores) / len(scores))
        stats.append({k: st[k] for k in ("clip_frac", "approx_kl", "logprob_diff_mean", "update_s") if k in st})
    k = min(5, steps)
    return {"rewards": rewards, "first5": sum(rewards[:k]) / k, "last5": sum(rewards[-k:]) / k, "steps": stats,
            "prompts": prompts_n, "group": group, "first_update_vs_fp32": first_rel}
