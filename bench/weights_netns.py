"""Weight-channel benchmark across network namespaces: UCX and TCP channels vs the best raw socket.

A :class:`dora_rl.infra.lab.netns.NetLab` of 5 namespaces (``holder``, ``f1`` .. ``f4``) on one bridge
models 5 hosts: every process is started with ``ip netns exec`` and binds its namespace's ``eth0``
address, so bytes cross veth pairs and the bridge, never loopback, and ``host_id()`` differs between
namespaces (UCX takes its ``net`` profile: no shared memory, no cma). Sizes 500 MB and 2 GB: exactly
5e8 and 2e9 bytes of transformer-shaped fp32 tensors (bench/weights.py's state dicts), holder -> ``f1``:

- ``ucx-net@s<N>``: the UCX channel's network path (tls=tcp, put_zcopy rendezvous, ``net_devices=eth0``,
  ``same_host_tls=None``) fetching over ``N`` parallel streams (connections; 1 and 2), whole fetch
  (load probe, handshake, checksums), as bench/weights.py measures;
- ``tcp@s<N>``: the TCP channel, likewise;
- ``raw/<setting>``: a plain socket sweep (SO_SNDBUF/SO_RCVBUF kernel default / 4 MB / 16 MB, send
  chunk 1 MB / 8 MB / whole 64 MB bucket, 1 or 2 streams), same bytes into the same destination memory;
  ``best raw`` = the setting with the highest median;
- ratio = the channel's best setting (highest median over its stream counts, as the raw socket gets
  its best setting) / best-raw median (the goal: UCX >= 0.80; a miss is printed as a miss), and / the
  best one-stream raw; every setting's own ratio is stored too;
- fan-out at 500 MB: 1 holder -> f1..f4 at once and bench/weights.py's P2P tree, against 4x one fetch,
  for each channel at each stream count.

Every UCX figure carries the transports UCX itself reported: processes run with ``UCX_PROTO_INFO=y``
and the lane column of its protocol tables (e.g. ``tcp/eth0``) is parsed from the holder's and the
fetchers' output; a ``cma``, ``posix``, ``sysv``, ``xpmem`` or ``knem`` lane aborts the run.
Cells are interleaved (rotating order) after one warm-up each, 5 repeats at 500 MB and 3 at 2 GB by
default; medians, all samples and the load average (2 shared cores) are stored. Writes
bench/results/weights-netns-<timestamp>.json and .png with provenance.
Usage (root): python bench/weights_netns.py [--quick]  (--quick: 100 MB, 1 repeat, 3 raw settings)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection as mpc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weights as W  # bench/weights.py: state dicts, process loops, raw server, fan-out
from provenance import provenance

NAMES = ["holder", "f1", "f2", "f3", "f4"]
NET_VARIANTS: dict[str, dict[str, Any]] = {"ucx-net": {"same_host_tls": None, "net_devices": "eth0"}}
KINDS = ["tcp", "ucx-net"]
STREAMS = (1, 2)  # the channels' settings: parallel streams per fetch
FAN_OUT_KINDS = [f"{k}@s{n}" for k in KINDS for n in STREAMS]
M = 1 << 20
QUICK_RAW = ("buf=default chunk=bucket streams=1", "buf=default chunk=1M streams=1", "buf=default chunk=8M streams=2")
RAW_SETTINGS: dict[str, dict[str, int]] = {  # sndbuf/rcvbuf 0 = kernel default (autotuning)
    "buf=default chunk=bucket streams=1": {"chunk": 0},
    "buf=default chunk=1M streams=1": {"chunk": 1 * M},
    "buf=default chunk=8M streams=1": {"chunk": 8 * M},
    "buf=4M chunk=8M streams=1": {"sndbuf": 4 * M, "rcvbuf": 4 * M, "chunk": 8 * M},
    "buf=16M chunk=8M streams=1": {"sndbuf": 16 * M, "rcvbuf": 16 * M, "chunk": 8 * M},
    "buf=16M chunk=1M streams=1": {"sndbuf": 16 * M, "rcvbuf": 16 * M, "chunk": 1 * M},
    "buf=default chunk=8M streams=2": {"chunk": 8 * M, "streams": 2},
    "buf=default chunk=1M streams=2": {"chunk": 1 * M, "streams": 2},
    "buf=16M chunk=8M streams=2": {"sndbuf": 16 * M, "rcvbuf": 16 * M, "chunk": 8 * M, "streams": 2},
}
FORBIDDEN_TLS = ("cma", "posix", "sysv", "xpmem", "knem")
GOAL = 0.80
_ROW = re.compile(r"\|\s*[0-9][0-9.KMGinf]*\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*$")
_HEAD = re.compile(r"\|\s*ucp_context_\d+\s+(\S+)\s+cfg#\d+\s*\|")


class NsProc(W.Proc):
    """bench/weights.py's ``Proc`` run in a lab namespace via ``ip netns exec`` (pipe: an inherited fd)."""

    def __init__(self, lab: Any, name: str, role: str, args: list[Any], logdir: Path) -> None:
        self.conn, child = mpc.Pipe()
        self.log = logdir / f"{name}-{role}-{time.monotonic_ns()}.log"
        env = dict(os.environ, DORA_BENCH_HOST=lab.ip(name), DORA_BENCH_EXACT_BYTES="1", UCX_PROTO_INFO="y",
                   UCX_WARN_UNUSED_ENV_VARS="n")
        argv = [sys.executable, __file__, "--child", role, str(child.fileno()), json.dumps(args)]
        with open(self.log, "w") as out:
            self.popen = lab.popen(name, argv, pass_fds=[child.fileno()], stdout=out, stderr=subprocess.STDOUT,
                                   env=env)
        child.close()
        self.name = name

    def call(self, *cmd: Any, timeout: float = 300) -> Any:
        try:
            return super().call(*cmd, timeout=timeout)
        except (EOFError, OSError, TimeoutError) as e:
            tail = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{self.name} failed on {cmd[0]!r}: {e!r}; its output ends:\n{tail}") from e

    def stop(self) -> None:
        try:
            self.conn.send(("exit",))
            self.popen.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.popen.kill()
            self.popen.wait(5)


def child_main(role: str, fd: int, args: list[Any]) -> None:
    W.UCX_VARIANTS.update(NET_VARIANTS)
    conn = mpc.Connection(fd)
    if role == "holder":
        W.holder_main(conn, *args)
    else:
        W.fetcher_main(conn)


def ucx_transports(logs: list[Path]) -> dict[str, Any]:
    """Lanes of UCX's protocol tables (``UCX_PROTO_INFO=y``) in ``logs``: ``{"transport": "tcp/eth0",
    "scopes": [...], "rendezvous": [...]}``; raises if none was printed or a shared-memory lane shows."""
    lanes: set[str] = set()
    scopes: set[str] = set()
    rndv: set[str] = set()
    for p in logs:
        for line in p.read_text(errors="replace").splitlines():
            if h := _HEAD.search(line):
                scopes.add(h.group(1))
            elif r := _ROW.search(line):
                proto, lane = r.group(1).replace("(?)", "").strip(), r.group(2)
                lanes.update(x.strip() for x in re.split(r"[,;]", lane) if x.strip())
                if "rendezvous" in proto:
                    rndv.add(proto)
    if not lanes:
        raise RuntimeError(f"UCX printed no protocol table (UCX_PROTO_INFO=y) in {[str(p) for p in logs]}")
    bad = sorted(x for x in lanes if re.search(rf"\b({'|'.join(FORBIDDEN_TLS)})\b", x))
    if bad:
        raise RuntimeError(f"UCX used a same-host transport across namespaces: {bad} (all lanes: {sorted(lanes)})")
    return {"transport": ",".join(sorted(lanes)), "scopes": sorted(scopes), "rendezvous": sorted(rndv)}


def _cells(quick: bool) -> list[tuple[str, str, dict[str, int] | None]]:
    raws = [(n, o) for n, o in RAW_SETTINGS.items() if n in QUICK_RAW or not quick]
    channels = [(f"{k}@s{n}", f"{k}@s{n}", None) for k in reversed(KINDS) for n in STREAMS]
    return channels + [(f"raw/{n}", "raw", o) for n, o in raws]


def point_to_point(lab: Any, size_req: int, reps: int, logdir: Path, quick: bool) -> dict[str, Any]:
    holder = NsProc(lab, "holder", "holder", [KINDS], logdir)
    fetcher = NsProc(lab, "f1", "fetcher", [], logdir)
    try:
        manifest, addrs, pack_s = holder.call("build", size_req, 1)
        size = manifest["total_bytes"]
        fetcher.call("prepare", manifest)
        cells = _cells(quick)
        runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in cells}
        for _, kind, opts in cells:  # warm-up: connections, UCX wire-up, page tables
            W.measure(holder, fetcher, kind, addrs, size, opts)
        for rep in range(reps):
            for name, kind, opts in cells[rep % len(cells) :] + cells[: rep % len(cells)]:
                r = W.measure(holder, fetcher, kind, addrs, size, opts)
                r["loadavg"] = os.getloadavg()
                runs[name].append(r)
        transports = ucx_transports([holder.log, fetcher.log])
        holder.call("free")
    finally:
        holder.stop()
        fetcher.stop()
    res: dict[str, Any] = {}
    for name, rs in runs.items():
        res[name] = {
            "gbps_median": statistics.median(r["gbps"] for r in rs),
            "runs_gbps": [r["gbps"] for r in rs],
            "runs_loadavg_1m": [r["loadavg"][0] for r in rs],
            "holder_cpu_s_per_gb": statistics.median(r["holder_cpu"] for r in rs) / (size / 1e9),
            "fetcher_cpu_s_per_gb": statistics.median(r["fetcher_cpu"] for r in rs) / (size / 1e9),
        }
        if name.startswith("raw/"):
            res[name]["settings"] = RAW_SETTINGS[name[4:]]
            res[name]["fetcher_rcvbuf_effective"] = rs[0]["rcvbuf_effective"]
        if name.startswith("ucx"):
            res[name]["ucx"] = transports
        if "@s" in name:
            res[name]["streams"] = W.split_kind(name)[1]
    best = max((n for n in res if n.startswith("raw/")), key=lambda n: res[n]["gbps_median"])
    single = max((n for n in res if n.endswith("streams=1")), key=lambda n: res[n]["gbps_median"])
    for n in res:
        res[n]["ratio_to_best_raw"] = res[n]["gbps_median"] / res[best]["gbps_median"]
    best_setting = {
        k: max((n for n in res if n.startswith(f"{k}@")), key=lambda n: res[n]["gbps_median"]) for k in KINDS
    }
    ratios = {k: res[c]["gbps_median"] / res[best]["gbps_median"] for k, c in best_setting.items()}
    ratios_single = {k: res[c]["gbps_median"] / res[single]["gbps_median"] for k, c in best_setting.items()}
    print(f"\n== {size / 1e6:.0f} MB ({len(manifest['buckets'])} buckets, packed in {pack_s:.2f}s), {reps} reps")
    for n, v in res.items():
        samples = " ".join(f"{g:.2f}" for g in v["runs_gbps"])
        print(f"  {n:40s} {v['gbps_median']:6.2f} GB/s  [{samples}]  CPU-s/GB holder {v['holder_cpu_s_per_gb']:.2f} "
              f"fetcher {v['fetcher_cpu_s_per_gb']:.2f}")
    for k, q in ratios.items():
        verdict = "meets" if q >= GOAL else "MISSES"
        c = best_setting[k]
        print(f"  best {k} ({c}, {res[c]['gbps_median']:.2f} GB/s) / best raw ({best}, "
              f"{res[best]['gbps_median']:.2f} GB/s) = {q:.2f}  ({verdict} the {GOAL:.0%} goal); "
              f"/ best one-stream raw ({single}) = {ratios_single[k]:.2f}")
    print(f"  UCX transport (from UCX_PROTO_INFO): {transports['transport']} {transports['scopes']}")
    return {"bytes": size, "pack_seconds": pack_s, "reps": reps, "cells": res, "best_raw": best,
            "best_channel_setting": best_setting,
            "ratio_to_best_raw": ratios, "goal": GOAL, "best_single_stream_raw": single,
            "ratio_to_best_single_stream_raw": ratios_single, "meets_goal": {k: q >= GOAL for k, q in ratios.items()}}


def fan_out(lab: Any, size_req: int, reps: int, logdir: Path) -> dict[str, Any]:
    spawned: list[NsProc] = []

    def spawn(target: Any, *args: Any) -> NsProc:
        if target is W.holder_main:
            p = NsProc(lab, "holder", "holder", list(args), logdir)
        else:
            p = NsProc(lab, f"f{sum(x.name != 'holder' for x in spawned) + 1}", "fetcher", [], logdir)
        spawned.append(p)
        return p

    try:
        out = W.fan_out(size_req, FAN_OUT_KINDS, n=4, reps=reps, spawn=spawn)
    finally:
        for p in spawned:
            if p.popen.poll() is None:
                p.stop()
    transports = ucx_transports([p.log for p in spawned])
    for k in FAN_OUT_KINDS:
        if k.startswith("ucx"):
            out[k]["ucx"] = transports
    print(f"  UCX transport (from UCX_PROTO_INFO): {transports['transport']} {transports['scopes']}")
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    p2p = result["point_to_point"]
    cells = [c for c in next(iter(p2p.values()))["cells"] if not c.startswith("raw/")]
    labels = [*cells, "best raw"]
    sizes = list(p2p)
    w = 0.8 / len(labels)
    for j, lab in enumerate(labels):
        vals = [p2p[s]["cells"][p2p[s]["best_raw"] if lab == "best raw" else lab]["gbps_median"] for s in sizes]
        a1.bar([i + j * w for i in range(len(sizes))], vals, w, label=lab)
    a1.set_xticks([i + 0.4 - w / 2 for i in range(len(sizes))], [f"{int(s) / 1e6:.0f} MB" for s in sizes])
    a1.set_ylabel("GB/s (median)")
    a1.set_title("holder -> fetcher across network namespaces (veth + bridge, 2 cores)")
    a1.legend()
    fo = result["fan_out"]
    keys = ["four_times_single_s", "concurrent_s", "p2p_s"]
    for j, (key, lab) in enumerate(zip(keys, ["4x single", "1->4 at once", "p2p tree"], strict=True)):
        a2.bar([i + j * 0.27 for i in range(len(FAN_OUT_KINDS))], [fo[k][key] for k in FAN_OUT_KINDS], 0.27,
               label=lab)
    a2.set_xticks([i + 0.27 for i in range(len(FAN_OUT_KINDS))], FAN_OUT_KINDS)
    a2.set_ylabel("seconds")
    a2.set_title(f"fan-out of {fo['bytes'] / 1e6:.0f} MB to 4 namespaces")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 100 MB, 1 repeat, 3 raw settings")
    ap.add_argument("--reps-500m", type=int, default=5, help="repeats per cell at 500 MB (>= 3)")
    ap.add_argument("--reps-2g", type=int, default=3, help="repeats per cell at 2 GB (>= 2)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' output (UCX tables)")
    a = ap.parse_args()
    if a.reps_500m < 3 or a.reps_2g < 2:
        ap.error("at least 3 repeats per cell at 500 MB and 2 at 2 GB")
    from dora_rl.infra.lab.netns import NetLab, cleanup_stale, netns_available
    from dora_rl.infra.weights.fetcher import DEFAULT_STREAMS

    if reason := netns_available():
        sys.exit(f"network namespaces are needed for this benchmark: {reason}")
    plan = [(100_000_000, 1)] if a.quick else [(500_000_000, a.reps_500m), (2_000_000_000, a.reps_2g)]
    t0 = time.time()
    os.environ.setdefault("GIT_OPTIONAL_LOCKS", "0")  # provenance's `git status` must not write the index
    result: dict[str, Any] = {
        "provenance": provenance(),
        "host": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "python": sys.version.split()[0]},
        "ucx_variants": {k: {kk: str(vv) for kk, vv in v.items()} for k, v in NET_VARIANTS.items()},
        "raw_settings": RAW_SETTINGS,
        "channel_streams": list(STREAMS),
        "default_streams": DEFAULT_STREAMS,
        "quick": a.quick,
    }
    import ucxx

    result["host"]["ucx_version"] = ".".join(map(str, ucxx.get_ucx_version()))
    cleanup_stale()
    logdir = Path(tempfile.mkdtemp(prefix="weights-netns-"))
    with NetLab(NAMES) as lab:
        result["lab"] = {"bridge_ip": lab.bridge_ip, "ips": {n: lab.ip(n) for n in NAMES}, "device": lab.device}
        result["point_to_point"] = {}
        for size_req, reps in plan:
            r = point_to_point(lab, size_req, reps, logdir, a.quick)
            result["point_to_point"][str(r["bytes"])] = r
        print(f"\n== fan-out {plan[0][0] / 1e6:.0f} MB: holder -> f1..f4 (4 namespaces)")
        result["fan_out"] = fan_out(lab, plan[0][0], 1 if a.quick else 3, logdir)
    result["host"]["loadavg_end"] = os.getloadavg()
    result["wall_seconds"] = time.time() - t0
    W.RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = W.RESULTS / f"weights-netns-{stamp}.json"
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    if not a.keep_logs:
        for p in logdir.iterdir():
            p.unlink()
        logdir.rmdir()
    print(f"\nwrote {out} and .png in {result['wall_seconds']:.0f}s" + (f"; logs in {logdir}" if a.keep_logs else ""))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child_main(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
    else:
        main()
