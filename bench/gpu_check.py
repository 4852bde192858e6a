"""GPU check: the trainer and the torch engine on one device, no Kafka (torch + transformers only).

One script anyone with a GPU runs (under 5 minutes on an H100/H200); its result file is rewritten after
every section, so a run cut short keeps what it measured. Sections (``bench/gpu_sections.py``):

- ``env``: versions, device, commit;
- ``engine``: decode tokens/s and step time by batch size (1 .. 512) of the torch engine (growing and
  static KV cache) next to a plain HF ``generate`` under the same attention backends, dtype and cache,
  each warmed up, in fp32 and bf16, on the tiny 10M model and a random model of SmolLM2-135M's shape;
- ``update``: one policy update of 64 trajectories x 256 response tokens on the 135M shape in bf16, today's
  settings (micro-batches of 1,024 padded tokens, unfused AdamW) next to the device's (derived budget,
  packed rows, fused AdamW): tokens/s, MFU, peak memory;
- ``logprobs``: engine vs trainer log-probs of the same sampled tokens, fp32 and bf16 (mean / max gap);
- ``bf16_update``: ``‖Δθ_bf16 − Δθ_fp32‖ / ‖Δθ_fp32‖`` over 8 minibatches (<= 0.05), clip fraction of both;
- ``packing`` / ``static_cache``: packed loss equals padded loss; static-cache tokens equal growing-cache ones;
- ``kv_move``: a request moved mid-decode with its KV cache, against the same batch unmoved and against a
  batch-size change alone, fp32 and bf16 (``bench/gpu_kv_move.py``);
- ``fsdp``: FSDP2 with one rank (NCCL on a GPU, gloo on the CPU) against the unsharded update;
- ``checkpoint``: save, load into a fresh trainer, one more update on both: identical;
- ``rl_loop``: SFT warm-up then 15 RL steps of the tiny model with bf16 trainer and engine (fixed seed):
  last-5 mean reward >= first-5 + 0.03.

Usage::

    python bench/gpu_check.py                      # on a GPU: bench/results/gpu-<time>.json
    python bench/gpu_check.py --small              # CPU, tiny sizes, asserts every check (CI, < 60 s)

Each check is recorded as ``{value, limit, pass}``; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_sections as sec  # noqa: E402
import torch  # noqa: E402
from gpu_kv_move import kv_move  # noqa: E402

SECTIONS = {"env": sec.env, "packing": sec.packing, "static_cache": sec.static_cache, "bf16_update": sec.bf16_update,
            "checkpoint": sec.checkpoint_section, "fsdp": sec.fsdp, "logprobs": sec.logprobs, "kv_move": kv_move,
            "update": sec.update, "rl_loop": sec.rl_loop, "engine": sec.engine}


def commit() -> str:
    """The commit measured: ``DORA_COMMIT`` (set by whoever copies the tree without .git), else git's."""
    if os.environ.get("DORA_COMMIT"):
        return os.environ["DORA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU, tiny sizes, every check asserted (CI)")
    ap.add_argument("--out", type=Path, default=None, help="result file (default bench/results/gpu-<time>.json)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--rl-prompts", type=int, default=128, help="prompts per RL step of rl_loop (x 8 samples)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dora-gpu-check"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.small or not torch.cuda.is_available() else "cuda"
    torch.set_num_threads(1 if device == "cpu" else max(1, torch.get_num_threads()))
    out = args.out or ROOT / "bench" / "results" / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    ctx = sec.Context(device=device, small=args.small, workdir=args.workdir, rl_prompts=args.rl_prompts)
    args.workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"commit": commit(), "command": " ".join(["python bench/gpu_check.py", *(argv or [])]),
                              "device": device, "small": args.small, "sections": {}, "checks": {}}
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            body = SECTIONS[name](ctx)
        except Exception as exc:  # a broken section is recorded and fails the run, the others still run
            body = {"error": f"{type(exc).__name__}: {exc}"}
            ctx.check(f"{name}.ran", 0.0, 1.0, ok=False)
        body["seconds"] = round(time.perf_counter() - t0, 2)
        result["sections"][name] = body
        result["checks"] = ctx.checks
        result["modules"] = sorted({m.split(".")[0] for m in sys.modules if not m.startswith("_")})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"[{name}] {body['seconds']:.1f}s {json.dumps(body)[:400]}", flush=True)
    failed = [k for k, v in ctx.checks.items() if not v["pass"]]
    print(f"wrote {out}; checks: {len(ctx.checks) - len(failed)} passed, {len(failed)} failed {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
