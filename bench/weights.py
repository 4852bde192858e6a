"""Weight-channel benchmark: UCX and TCP channels vs the raw loopback TCP limit, plus fan-out.

Moves a transformer-shaped fp32 state dict (100 MB, 500 MB, 2 GB) from a holder process to fetcher
processes over 127.0.0.1 and prints GB/s (1e9 B/s) for:

- ``raw``: a plain socket blast of the same bucket bytes into the same destination memory (the limit);
- ``tcp``: the TCP channel;
- ``ucx-tcp``: the UCX channel's network path (tls=tcp, put_zcopy rendezvous), forced on one host;
- ``ucx``: the UCX channel as configured by default: same-host peers use cross-memory attach
  (one copy, made by the fetcher), other hosts the network path;
- ``<kind>@s<N>``: that channel with ``N`` parallel streams per fetch (without: the client's default,
  ``fetcher.DEFAULT_STREAMS``), swept at 500 MB;

each with ratio channel/raw, the holder's and fetcher's CPU seconds per GB split by thread (where the
time goes), a UCX configuration sweep at 500 MB, and a fan-out at 500 MB: 1 holder -> 4 fetchers at
once, and the peer-to-peer tree where fetchers that finished serve the others, against 4x one
transfer. Channel figures are whole fetches (load probe, handshake, checksums included). Fetch
destinations are bucket-backed model tensors touched in advance (an instance's existing model).
Runs are interleaved; the medians are reported with the load average, since the 2 cores are shared.
Writes bench/results/weights-<timestamp>.json and .png.  Usage: python bench/weights.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
RESULTS = Path(__file__).resolve().parent / "results"
TOKEN = "bench-token"
HOST = os.environ.get("DORA_BENCH_HOST", "127.0.0.1")  # address holders bind (a netns's eth0 address)
RAW_OPTS = struct.Struct("!4q")  # raw request 'o': SO_SNDBUF, send chunk, first bucket, end bucket (0 = default)
EXACT_BYTES = os.environ.get("DORA_BENCH_EXACT_BYTES") == "1"  # state dicts of exactly the asked size
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # Linux: set buffer sizes above net.core.[rw]mem_max (root)
UCX_VARIANTS: dict[str, dict[str, Any]] = {
    "ucx": {},  # defaults: same host -> tcp,cma get_zcopy; else tcp put_zcopy
    "ucx-tcp": {"same_host_tls": None},  # the network path, forced here on one host
    "ucx-tcp-no-delayed-submit": {"same_host_tls": None, "delayed_submission": False},
    "ucx-tcp-auto-rndv": {"same_host_tls": None, "rndv_scheme": "auto"},
    "ucx-tcp-error-handling": {"same_host_tls": None, "error_handling": True},
    "ucx-tcp-window1": {"same_host_tls": None, "window": 1},
    "ucx-tcp-window16": {"same_host_tls": None, "window": 16},
    "ucx-tcp-sockbuf8M": {"same_host_tls": None, "extra": (("TCP_SNDBUF", "8M"), ("TCP_RCVBUF", "8M"))},
    "ucx-tcp-rxseg256K": {"same_host_tls": None, "extra": (("TCP_RX_SEG_SIZE", "256K"),)},
    "ucx-cma-put": {"same_host_rndv_scheme": "put_zcopy"},
    "ucx-tcp-1-holder-worker": {"same_host_tls": None, "holder_workers": 1},  # fan-out only
}
MAIN = ["raw", "tcp", "ucx-tcp", "ucx"]
STREAM_SWEEP = ["tcp@s1", "ucx-tcp@s1", "ucx@s1"]  # one stream per fetch, against MAIN's default


def split_kind(kind: str) -> tuple[str, int | None]:
    """``"tcp@s2"`` -> ``("tcp", 2)``: the channel kind (its holder) and the fetcher's streams (None:
    the client's default)."""
    base, sep, n = kind.partition("@s")
    return base, (int(n) if sep else None)


def transformer_shapes(total_bytes: int, exact: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Llama-like fp32 layer shapes (d_model, 8/3 d MLP, 32k vocab) adding up to ~total_bytes; with
    ``exact`` (default: $DORA_BENCH_EXACT_BYTES=1) whole layers below it plus an ``extra`` projection
    (rows of d) and bias making exactly total_bytes (a multiple of 4)."""
    exact = EXACT_BYTES if exact is None else exact
    d, vocab = (512, 8192) if total_bytes <= 200e6 else (1024, 32000) if total_bytes <= 1e9 else (2048, 32000)
    f = (d * 8 // 3 + 255) // 256 * 256
    per_layer = 4 * d * d + 3 * d * f + 2 * d
    fixed = 2 * vocab * d + d
    layers = max(1, (total_bytes // 4 - fixed) // per_layer if exact else round((total_bytes / 4 - fixed) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm.weight": (d,), p + "q.weight": (d, d), p + "k.weight": (d, d)}
        shapes |= {p + "v.weight": (d, d), p + "o.weight": (d, d), p + "mlp_norm.weight": (d,)}
        shapes |= {p + "gate.weight": (f, d), p + "up.weight": (f, d), p + "down.weight": (d, f)}
    shapes |= {"norm.weight": (d,), "lm_head.weight": (vocab, d)}
    rest = total_bytes // 4 - fixed - layers * per_layer
    if exact and rest > 0:
        shapes |= {"extra.weight": (rest // d, d)} if rest >= d else {}
        shapes |= {"extra.bias": (rest % d,)} if rest % d else {}
    return shapes


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _threads() -> dict[int, float]:
    """CPU seconds of each live thread of this process (from /proc; 10 ms resolution)."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


class CpuMeter:
    """Process CPU since ``mark``, split by thread: Python threads by name, native ones (the UCX
    progress threads) together, and threads that ended meanwhile (sessions, verifiers) together."""

    def __init__(self) -> None:
        self.mark()

    def mark(self) -> None:
        self.t0, self.th0 = _cpu(), _threads()

    def read(self) -> dict[str, float]:
        total, th = _cpu() - self.t0, _threads()
        names = {
            t.native_id: t.name.split("-")[0] if t.name.startswith("Thread") else t.name
            for t in threading.enumerate()
        }
        split: dict[str, float] = {}
        for tid, sec in th.items():
            label = names.get(tid, "native threads (UCX progress)")
            split[label] = split.get(label, 0.0) + sec - self.th0.get(tid, 0.0)
        split["threads that ended (sessions, verifier)"] = total - sum(split.values())
        return {"total": total, **split}


def _client(kind: str) -> Any:
    from dora_rl.infra.weights import make_weight_client
    from dora_rl.infra.weights.ucx import UcxOptions

    base, streams = split_kind(kind)
    extra: dict[str, Any] = {} if streams is None else {"streams": streams}
    if base == "tcp":
        return make_weight_client("tcp", TOKEN, **extra)
    return make_weight_client("ucx", TOKEN, options=UcxOptions(**UCX_VARIANTS[base]), **extra)


def _server(kind: str) -> Any:
    from dora_rl.infra.weights import make_weight_server
    from dora_rl.infra.weights.ucx import UcxOptions

    kind = split_kind(kind)[0]
    if kind == "tcp":
        return make_weight_server("tcp", TOKEN, host=HOST)
    return make_weight_server("ucx", TOKEN, host=HOST, options=UcxOptions(**UCX_VARIANTS[kind]))


def _set_buf(s: socket.socket, force_opt: int, plain_opt: int, size: int) -> None:
    if size:
        try:
            s.setsockopt(socket.SOL_SOCKET, force_opt, size)
        except PermissionError:  # not root: capped by net.core.[rw]mem_max
            s.setsockopt(socket.SOL_SOCKET, plain_opt, size)


def _raw_server(buckets: list[Any]) -> tuple[str, socket.socket]:
    """Plain socket blast: for each request ``x``, sendall every bucket; for ``o`` + RAW_OPTS, buckets
    first..end (0 = all) in chunks of ``chunk`` bytes (0 = whole buckets) with SO_SNDBUF ``sndbuf``."""
    ls = socket.socket()
    ls.bind((HOST, 0))
    ls.listen(8)

    def serve(c: socket.socket) -> None:
        with c:
            while op := c.recv(1):
                sndbuf, chunk, first, end = (0, 0, 0, 0)
                if op == b"o":
                    sndbuf, chunk, first, end = RAW_OPTS.unpack(c.recv(RAW_OPTS.size, socket.MSG_WAITALL))
                _set_buf(c, SO_SNDBUFFORCE, socket.SO_SNDBUF, sndbuf)
                for b in buckets[first : end or None]:
                    mv = memoryview(b)
                    step = chunk or mv.nbytes
                    for off in range(0, mv.nbytes, step):
                        c.sendall(mv[off : off + step])

    def loop() -> None:
        while True:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return f"{HOST}:{ls.getsockname()[1]}", ls


def holder_main(conn: Any, kinds: list[str]) -> None:
    """Holder process: builds + packs the state dict, serves it on every transport."""
    import torch

    from dora_rl.infra.weights import pack_state_dict

    torch.set_num_threads(1)
    servers: dict[str, Any] = {}
    buckets: list[Any] = []
    raw_sock: socket.socket | None = None
    meter = CpuMeter()
    while True:
        cmd, *args = conn.recv()
        if cmd == "build":
            size, version = args
            sd = {k: torch.empty(s).uniform_(-0.02, 0.02) for k, s in transformer_shapes(size).items()}
            t0 = time.perf_counter()
            manifest, buckets = pack_state_dict(sd, version=version)
            pack_s = time.perf_counter() - t0
            del sd
            servers = {k: _server(k) for k in dict.fromkeys(split_kind(k)[0] for k in kinds)}
            for s in servers.values():
                s.serve_packed(manifest, buckets)
            addr, raw_sock = _raw_server(buckets)
            addrs = {k: s.address for k, s in servers.items()} | {"raw": addr}
            conn.send((manifest.to_dict(), addrs, pack_s))
        elif cmd == "mark":
            meter.mark()
            conn.send(None)
        elif cmd == "cpu":
            conn.send(meter.read())
        elif cmd == "free":
            for s in servers.values():
                s.close()
            if raw_sock is not None:
                raw_sock.close()
            servers, buckets, raw_sock = {}, [], None
            conn.send(None)
        elif cmd == "exit":
            return


def fetcher_main(conn: Any) -> None:
    """Fetcher process: a pre-touched bucket-backed model; fetches on command; can serve (P2P)."""
    import torch

    from dora_rl.infra.weights import WeightManifest, unpack_into
    from dora_rl.infra.weights.manifest import alloc_bytes
    from dora_rl.infra.weights.plan import ReceivePlan
    from dora_rl.infra.weights.protocol import parse_address

    torch.set_num_threads(1)
    clients: dict[str, Any] = {}
    servers: list[Any] = []
    meter = CpuMeter()
    while True:
        cmd, *args = conn.recv()
        if cmd == "mark":
            meter.mark()
            conn.send(None)
        elif cmd == "cpu":
            conn.send(meter.read())
        elif cmd == "prepare":
            manifest = WeightManifest.from_dict(args[0])
            buckets = [alloc_bytes(b.nbytes) for b in manifest.buckets]
            for b in buckets:
                b.fill(0)  # touch: an existing model's memory, no first-touch page faults
            target = unpack_into(manifest, buckets, None, verify=False)
            conn.send(None)
        elif cmd == "raw":  # (address[, {"sndbuf", "rcvbuf", "chunk", "streams"}]): see raw_parallel
            opts = args[1] if len(args) > 1 else {}
            conn.send(raw_parallel(parse_address(args[0]), manifest, ReceivePlan(manifest, target), opts))
        elif cmd == "fetch":
            kind, holders = args
            client = clients.get(kind) or clients.setdefault(kind, _client(kind))
            t0 = time.monotonic()
            client.fetch(manifest, holders, into=target)
            st = client.last_stats
            conn.send(
                {
                    "start": t0,
                    "end": time.monotonic(),
                    "seconds": st.seconds,
                    "holders": st.holders,
                    "verify_cpu": st.verify_cpu_seconds,
                }
            )
        elif cmd == "server":
            servers.append(_server(args[0]))
            conn.send(servers[-1].address)
        elif cmd == "hold":
            servers[-1].serve_packed(manifest, buckets)
            conn.send(None)
        elif cmd == "unhold":
            for srv in servers:
                srv.retire(manifest.version)
            conn.send(None)
        elif cmd == "close_servers":
            for s in servers:
                s.close()
            servers = []
            conn.send(None)
        elif cmd == "exit":
            for s in servers:
                s.close()
            for c in clients.values():
                c.close()
            return


def raw_parallel(address: tuple[str, int], manifest: Any, plan: Any, opts: dict[str, int]) -> dict[str, Any]:
    """Raw receive over ``streams`` sockets (each a contiguous run of buckets of about equal bytes),
    SO_RCVBUF ``rcvbuf`` set before connecting; the holder sends with ``sndbuf`` / ``chunk``. No
    options: one socket, kernel-default buffers, whole buckets per sendall (the loopback ``raw``)."""
    from dora_rl.infra.weights.plan import request_segments
    from dora_rl.infra.weights.protocol import recv_exact

    n, total = len(manifest.buckets), manifest.total_bytes
    streams = max(1, min(int(opts.get("streams", 1)), n))
    cuts, acc = [0], 0
    for i, b in enumerate(manifest.buckets):  # stream j gets buckets until j+1 shares of the bytes
        acc += b.nbytes
        if len(cuts) < streams and acc >= total * len(cuts) / streams and i + 1 < n:
            cuts.append(i + 1)
    cuts.append(n)
    socks = []
    for _ in range(len(cuts) - 1):
        s = socket.socket()
        _set_buf(s, SO_RCVBUFFORCE, socket.SO_RCVBUF, int(opts.get("rcvbuf", 0)))
        s.connect(address)
        socks.append(s)
    errors: list[BaseException] = []

    def pull(j: int) -> None:
        try:
            socks[j].sendall(b"o" + RAW_OPTS.pack(int(opts.get("sndbuf", 0)), int(opts.get("chunk", 0)), cuts[j],
                                                  cuts[j + 1]))
            for seg in request_segments(manifest, list(range(cuts[j], cuts[j + 1]))):
                recv_exact(socks[j], memoryview(plan.dest(seg)))
        except BaseException as e:
            errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=pull, args=(j,)) for j in range(1, len(socks))]
    for t in threads:
        t.start()
    pull(0)
    for t in threads:
        t.join()
    t1 = time.monotonic()
    rcvbuf = socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    for s in socks:
        s.close()
    if errors:
        raise RuntimeError(f"raw receive with {opts} failed: {errors[0]!r}") from errors[0]
    return {"start": t0, "end": t1, "seconds": t1 - t0, "streams": len(socks), "rcvbuf_effective": rcvbuf}


class Proc:
    def __init__(self, target: Any, *args: Any) -> None:
        self.conn, child = mp.Pipe()
        self.p = mp.get_context("spawn").Process(target=target, args=(child, *args), daemon=True)
        self.p.start()

    def call(self, *cmd: Any, timeout: float = 300) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{cmd[0]} took more than {timeout}s")
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(("exit",))
        self.p.join(30)
        if self.p.is_alive():
            self.p.kill()


def measure(
    holder: Proc, fetcher: Proc, kind: str, addrs: dict[str, str], size: int, raw_opts: dict[str, int] | None = None
) -> dict[str, Any]:
    """One transfer of ``kind`` (``raw`` + ``raw_opts``: the parallel / tuned raw socket) with CPU split."""
    holder.call("mark")
    fetcher.call("mark")
    if kind == "raw":
        r = fetcher.call("raw", addrs["raw"], *([raw_opts] if raw_opts is not None else []))
    else:
        r = fetcher.call("fetch", kind, [addrs[split_kind(kind)[0]]])
    r["holder_cpu_split"] = holder.call("cpu")
    r["fetcher_cpu_split"] = fetcher.call("cpu")
    r["holder_cpu"] = r["holder_cpu_split"]["total"]
    r["fetcher_cpu"] = r["fetcher_cpu_split"]["total"]
    r["gbps"] = size / r["seconds"] / 1e9
    return r


def point_to_point(sizes: list[int], reps: int, sweep_reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kinds = ["tcp", *UCX_VARIANTS]
    for size_req in sizes:
        holder, fetcher = Proc(holder_main, kinds), Proc(fetcher_main)
        manifest, addrs, pack_s = holder.call("build", size_req, 1)
        size = manifest["total_bytes"]
        fetcher.call("prepare", manifest)
        sweep = [k for k in UCX_VARIANTS if k not in MAIN and "holder-worker" not in k] + STREAM_SWEEP
        names = MAIN + (sweep if size_req == 500_000_000 else [])
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
        for k in names:  # warm-up: connections, UCX wireup, page tables
            measure(holder, fetcher, k, addrs, size)
        for rep in range(max(reps, sweep_reps)):
            for k in names[rep % len(names) :] + names[: rep % len(names)]:
                if (k in MAIN and rep < reps) or (k not in MAIN and rep < sweep_reps):
                    runs[k].append(measure(holder, fetcher, k, addrs, size))
        raw_med = statistics.median(r["gbps"] for r in runs["raw"])
        res = {}
        for k, rs in runs.items():
            med = statistics.median(r["gbps"] for r in rs)
            res[k] = {
                "gbps_median": med,
                "gbps_best": max(r["gbps"] for r in rs),
                "ratio_to_raw": med / raw_med,
                "holder_cpu_s_per_gb": statistics.median(r["holder_cpu"] for r in rs) / (size / 1e9),
                "fetcher_cpu_s_per_gb": statistics.median(r["fetcher_cpu"] for r in rs) / (size / 1e9),
                "runs": [r["gbps"] for r in rs],
                "cpu_split_s_per_gb": {
                    side: _median_split([r[f"{side}_cpu_split"] for r in rs], size)
                    for side in ("holder", "fetcher")
                },
                "verify_cpu_s_per_gb": statistics.median(r.get("verify_cpu", 0.0) for r in rs) / (size / 1e9),
            }
        out[str(size)] = {"bytes": size, "pack_seconds": pack_s, "kinds": res}
        print(f"\n== {size / 1e6:.0f} MB ({len(manifest['buckets'])} buckets, packed in {pack_s:.2f}s)")
        for k, v in res.items():
            print(
                f"  {k:20s} {v['gbps_median']:6.2f} GB/s (best {v['gbps_best']:5.2f})  "
                f"x{v['ratio_to_raw']:.2f} of raw  CPU-s/GB holder {v['holder_cpu_s_per_gb']:.2f} "
                f"fetcher {v['fetcher_cpu_s_per_gb']:.2f}"
            )
        if size_req == sizes[-1]:
            print("  where the CPU goes (CPU-s per GB, median):")
            for k in MAIN:
                for side in ("holder", "fetcher"):
                    sp = res[k]["cpu_split_s_per_gb"][side]
                    print(f"    {k:8s} {side:8s} " + "  ".join(f"{n}: {v:.3f}" for n, v in sp.items()))
        holder.call("free")
        holder.stop()
        fetcher.stop()
    return out


def _median_split(splits: list[dict[str, float]], size: int) -> dict[str, float]:
    keys = {k for sp in splits for k in sp}
    return {k: statistics.median(sp.get(k, 0.0) for sp in splits) / (size / 1e9) for k in sorted(keys)}


def fan_out(size_req: int, kinds: list[str], n: int = 4, reps: int = 5, spawn: Any = Proc) -> dict[str, Any]:
    """``spawn(target, *args)`` makes the processes (``Proc``; bench/weights_netns.py: in namespaces)."""
    holder = spawn(holder_main, kinds)
    manifest, addrs, _ = holder.call("build", size_req, 2)
    size = manifest["total_bytes"]
    fetchers = [spawn(fetcher_main) for _ in range(n)]
    for f in fetchers:
        f.call("prepare", manifest)
    out: dict[str, Any] = {"bytes": size}
    for kind in kinds:
        source = addrs[split_kind(kind)[0]]
        peers = [f.call("server", kind) for f in fetchers]  # long-lived, like a rollout instance's
        fetchers[0].call("fetch", kind, [source])  # warm-up
        single = statistics.median(fetchers[0].call("fetch", kind, [source])["seconds"] for _ in range(3))
        concurrent, p2p = [], []
        for _ in range(reps):
            for f in fetchers:
                f.conn.send(("fetch", kind, [source]))
            rs = [f.conn.recv() for f in fetchers]
            concurrent.append(max(r["end"] for r in rs) - min(r["start"] for r in rs))
            # peer-to-peer tree: every holder (the trainer, then each fetcher that finished) serves
            # one waiting fetcher per round; the others are fallbacks (least loaded first)
            holders, waiting, t0 = [source], list(range(n)), time.monotonic()
            while waiting:
                batch, waiting = waiting[: len(holders)], waiting[len(holders) :]
                for i, h in zip(batch, holders, strict=False):
                    fetchers[i].conn.send(("fetch", kind, [h, *[x for x in holders if x != h]]))
                for i in batch:
                    fetchers[i].conn.recv()
                    fetchers[i].call("hold")
                holders += [peers[i] for i in batch]
            p2p.append(time.monotonic() - t0)
            for f in fetchers:
                f.call("unhold")
        c, p = statistics.median(concurrent), statistics.median(p2p)
        out[kind] = {
            "single_s": single,
            "four_times_single_s": n * single,
            "concurrent_s": c,
            "concurrent_vs_4x": c / (n * single),
            "p2p_s": p,
            "p2p_vs_4x": p / (n * single),
            "runs": {"concurrent": concurrent, "p2p": p2p},
        }
        print(
            f"  fan-out {kind:24s} single {single:.3f}s  4x {n * single:.3f}s  1->{n} at once {c:.3f}s "
            f"({c / (n * single):.2f} of 4x)  p2p tree {p:.3f}s ({p / (n * single):.2f} of 4x)"
        )
    for f in fetchers:  # fetchers' own servers first, then the holder, while every peer still lives
        f.call("close_servers")
    holder.call("free")
    holder.stop()
    for f in fetchers:
        f.stop()
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    sizes = list(result["point_to_point"])
    width = 0.8 / len(MAIN)
    for j, k in enumerate(MAIN):
        vals = [result["point_to_point"][s]["kinds"][k]["gbps_median"] for s in sizes]
        a1.bar([i + j * width for i in range(len(sizes))], vals, width, label=k)
    a1.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [f"{int(s) / 1e6:.0f} MB" for s in sizes])
    a1.set_ylabel("GB/s (median)")
    a1.set_title("holder -> fetcher over 127.0.0.1 (2 cores)")
    a1.legend()
    fo = result["fan_out"]
    kinds = [k for k in fo if k != "bytes"]
    labels = ["4x single", "1->4 at once", "p2p tree"]
    for j, lab in enumerate(labels):
        key = ["four_times_single_s", "concurrent_s", "p2p_s"][j]
        a2.bar([i + j * 0.27 for i in range(len(kinds))], [fo[k][key] for k in kinds], 0.27, label=lab)
    a2.set_xticks([i + 0.27 for i in range(len(kinds))], kinds)
    a2.set_ylabel("seconds")
    a2.set_title(f"fan-out of {fo['bytes'] / 1e6:.0f} MB to 4 fetchers")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 MB and 500 MB only, fewer repetitions")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    sizes = [100_000_000, 500_000_000] + ([] if a.quick else [2_000_000_000])
    t0 = time.time()
    result: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "python": sys.version.split()[0]},
        "ucx_variants": {k: {kk: str(vv) for kk, vv in v.items()} for k, v in UCX_VARIANTS.items()},
    }
    from dora_rl.infra.weights.fetcher import DEFAULT_STREAMS

    result["default_streams"] = DEFAULT_STREAMS
    from provenance import provenance  # bench/provenance.py: the commit (and a dirty flag) of this figure

    os.environ.setdefault("GIT_OPTIONAL_LOCKS", "0")
    result.update(provenance())
    try:
        import ucxx

        result["host"]["ucx_version"] = ".".join(map(str, ucxx.get_ucx_version()))
    except Exception as e:
        sys.exit(f"ucxx is needed for this benchmark: {e}")
    result["point_to_point"] = point_to_point(sizes, 2 if a.quick else a.reps, 2)
    print("\n== fan-out")
    result["fan_out"] = fan_out(500_000_000, ["tcp", "ucx-tcp", "ucx-tcp-1-holder-worker", "ucx"])
    result["host"]["loadavg_end"] = os.getloadavg()
    result["wall_seconds"] = time.time() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"weights-{stamp}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"weights-{stamp}.png")
    print(f"\nwrote {RESULTS}/weights-{stamp}.json and .png in {result['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
