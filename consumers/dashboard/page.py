"""The dashboard page: one self-contained HTML document (inline CSS, inline SVG drawn by inline JS).

The page polls ``api/run`` (:mod:`.payload`) every ``POLL_MS`` and redraws: headline figures, reward,
throughput and staleness per step (line charts), the staleness histogram of the recent batches (bars),
the version timeline (one ``<g class="timeline-row" data-instance=…>`` per rollout instance, one
rectangle per segment coloured by version; ``IDLE``/``LOADING`` segments, the bubbles, are grey and
hatched; ``STARTING`` before any version is light grey, ``STOPPED`` dark grey), the versions live with
their pending work, the instances and the consumer lag. Nothing is fetched from anywhere else (no CDN):
it works offline. Hooks for tests and tools: ``#step-count`` holds
the step count, ``body[data-rendered]`` the number of redraws, ``body[data-error]`` the last poll error.
"""

from __future__ import annotations

POLL_MS = 1000

_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 8px} h2{font-size:14px;margin:14px 0 4px}
.cards{display:flex;gap:10px;flex-wrap:wrap} .card{background:#fff;border:1px solid #ddd;border-radius:6px;
padding:6px 12px;min-width:110px} .card b{display:block;font-size:18px}
.charts{display:grid;grid-template-columns:repeat(2,minmax(380px,1fr));gap:10px}
.panel{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px}
svg text{font-size:10px;fill:#555} table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #ddd;padding:2px 8px;text-align:right} th{background:#f0f0f0}
#status{color:#888}
"""

_JS = r"""
const NS = "http://www.w3.org/2000/svg";
function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function hue(v) { return "hsl(" + ((v * 67) % 360) + ",65%,55%)"; }
function fmt(x, d) { return x === null || x === undefined ? "-" : Number(x).toFixed(d); }
function lineChart(id, title, series) {
  const W = 460, H = 170, L = 46, R = 10, T = 18, B = 22;
  const svg = el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": "chart"});
  svg.appendChild(el("text", {x: L, y: 12, style: "font-weight:bold"}, title));
  const pts = series.flatMap(s => s.points);
  if (pts.length) {
    let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
    let y0 = Math.min(0, ...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
    if (x1 === x0) x1 = x0 + 1; if (y1 === y0) y1 = y0 + 1;
    const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    svg.appendChild(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}));
    svg.appendChild(el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}));
    svg.appendChild(el("text", {x: 2, y: T + 4}, fmt(y1, y1 < 10 ? 2 : 0)));
    svg.appendChild(el("text", {x: 2, y: H - B}, fmt(y0, y0 < 10 ? 2 : 0)));
    svg.appendChild(el("text", {x: L, y: H - 6}, "step " + x0));
    svg.appendChild(el("text", {x: W - R - 40, y: H - 6}, "step " + x1));
    series.forEach((s, i) => {
      if (!s.points.length) return;
      svg.appendChild(el("polyline", {points: s.points.map(p => sx(p[0]) + "," + sy(p[1])).join(" "),
                                      fill: "none", stroke: s.color, "stroke-width": 2}));
      s.points.forEach(p => svg.appendChild(el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2, fill: s.color})));
      svg.appendChild(el("text", {x: W - R - 150 + i * 75, y: 12, fill: s.color}, s.name));
    });
  } else {
    svg.appendChild(el("text", {x: L, y: H / 2}, "no step yet"));
  }
  const box = document.getElementById(id); box.replaceChildren(svg);
}
function histogram(id, pairs, S) {
  const W = 460, H = 170, L = 46, B = 22, T = 18;
  const svg = el("svg", {width: W, height: H, "class": "chart"});
  svg.appendChild(el("text", {x: L, y: 12, style: "font-weight:bold"}, "staleness of the recent batches"));
  const counts = new Map(pairs.map(p => [p[0], p[1]]));
  const n = Math.max(S, ...pairs.map(p => p[0])) + 1, top = Math.max(1, ...pairs.map(p => p[1]));
  const bw = (W - L - 10) / n;
  for (let s = 0; s < n; s++) {
    const c = counts.get(s) || 0, h = c / top * (H - T - B);
    svg.appendChild(el("rect", {x: L + s * bw + 2, y: H - B - h, width: bw - 4, height: h, fill: "#4a7",
                                "class": "hist-bar", "data-staleness": s, "data-count": c}));
    svg.appendChild(el("text", {x: L + s * bw + bw / 2 - 8, y: H - 6}, "s=" + s));
    svg.appendChild(el("text", {x: L + s * bw + bw / 2 - 8, y: H - B - h - 3}, String(c)));
  }
  document.getElementById(id).replaceChildren(svg);
}
function timeline(tl) {
  const rows = tl.rows, W = 940, L = 150, R = 60, RH = 22, T = 20;
  const H = T + rows.length * RH + 24;
  const svg = el("svg", {width: W, height: H, id: "timeline-svg"});
  const defs = el("defs", {});
  const pat = el("pattern", {id: "bubble", width: 6, height: 6, patternUnits: "userSpaceOnUse",
                             patternTransform: "rotate(45)"});
  pat.appendChild(el("rect", {width: 6, height: 6, fill: "#ddd"}));
  pat.appendChild(el("line", {x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#aaa", "stroke-width": 3}));
  defs.appendChild(pat); svg.appendChild(defs);
  const t0 = tl.start_ms, t1 = Math.max(tl.end_ms, t0 + 1);
  const sx = t => L + (t - t0) / (t1 - t0) * (W - L - R);
  rows.forEach((row, i) => {
    const g = el("g", {"class": "timeline-row", "data-instance": row.instance});
    const y = T + i * RH;
    g.appendChild(el("text", {x: 4, y: y + 14}, row.instance));
    row.segments.forEach(seg => {
      const [a, b, v, st] = seg, bubble = st === "IDLE" || st === "LOADING";
      const r = el("rect", {x: sx(a), y: y + 2, width: Math.max(1, sx(b) - sx(a)), height: RH - 6,
                            fill: bubble ? "url(#bubble)" : st === "STOPPED" ? "#555" : v < 0 ? "#ccc" : hue(v),
                            "class": "segment" + (bubble ? " bubble" : ""), "data-version": v, "data-state": st});
      r.appendChild(el("title", {}, row.instance + " v" + v + " " + st + " " + ((b - a) / 1000).toFixed(1) + "s"));
      g.appendChild(r);
    });
    g.appendChild(el("text", {x: W - R + 4, y: y + 14}, "idle " + Math.round(100 * (row.idle_fraction || 0)) + "%"));
    svg.appendChild(g);
  });
  if (t0 !== null) {
    svg.appendChild(el("text", {x: L, y: H - 6}, "0 s"));
    svg.appendChild(el("text", {x: W - R - 40, y: H - 6}, ((t1 - t0) / 1000).toFixed(0) + " s"));
  }
  const versions = [...new Set(rows.flatMap(r => r.segments.map(s => s[2])))].filter(v => v >= 0).sort((a, b) => a - b);
  versions.slice(-12).forEach((v, i) => {
    svg.appendChild(el("rect", {x: L + i * 50, y: 4, width: 10, height: 10, fill: hue(v)}));
    svg.appendChild(el("text", {x: L + i * 50 + 13, y: 13}, "v" + v));
  });
  document.getElementById("timeline").replaceChildren(svg);
}
function table(id, head, rows) {
  const t = document.createElement("table"), tr = t.insertRow();
  head.forEach(h => { const th = document.createElement("th"); th.textContent = h; tr.appendChild(th); });
  rows.forEach(r => { const row = t.insertRow(); r.forEach(c => { row.insertCell().textContent = c; }); });
  document.getElementById(id).replaceChildren(t);
}
function draw(d) {
  const run = d.run;
  document.getElementById("title").textContent = "run " + run.id + " (" + run.mode + ", S=" + run.max_staleness + ")";
  document.getElementById("state").textContent = run.state + (run.done ? " / done" : "");
  document.getElementById("step-count").textContent = d.step_count;
  document.getElementById("steps-target").textContent = run.steps_target;
  document.getElementById("reward").textContent = fmt(d.reward, 3);
  document.getElementById("throughput").textContent = fmt(d.throughput_tokens_per_s, 0);
  document.getElementById("version").textContent = run.latest_version;
  document.getElementById("dlq").textContent = d.dlq.total + " (" + d.dlq.per_min + "/min)";
  const st = d.steps;
  lineChart("chart-reward", "reward per step", [{name: "reward", color: "#27c",
            points: st.filter(s => s.reward !== null).map(s => [s.step, s.reward])}]);
  lineChart("chart-throughput", "trained tokens/s per step", [{name: "tok/s", color: "#c72",
            points: st.filter(s => s.tokens_per_s !== null).map(s => [s.step, s.tokens_per_s])}]);
  const col = name => st.filter(s => s[name] !== null).map(s => [s.step, s[name]]);
  lineChart("chart-staleness", "staleness per step", [{name: "max", color: "#c33", points: col("staleness_max")},
                                                      {name: "mean", color: "#393", points: col("staleness_mean")}]);
  histogram("chart-hist", d.staleness_recent, run.max_staleness);
  timeline(d.timeline);
  table("versions", ["version", "pending", "in flight", "instances"],
        d.versions.map(v => ["v" + v.version, v.pending, v.in_flight, v.instances.join(", ")]));
  table("instances", ["instance", "version", "state", "in flight", "tokens/s", "idle"],
        d.instances.map(i => [i.id, "v" + i.version, i.state, i.in_flight + "/" + i.capacity, fmt(i.tokens_per_s, 0),
                              Math.round(100 * (i.idle_fraction || 0)) + "%"]));
  table("lag", ["role", "topic", "partitions", "lag"], d.lag.map(r => [r.role, r.topic, r.partitions, r.lag]));
  document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
  document.getElementById("status").textContent = "updated " + new Date(d.now_ms).toLocaleTimeString();
}
async function poll() {
  try {
    const r = await fetch("api/run", {cache: "no-store"});
    draw(await r.json());
    delete document.body.dataset.error;
  } catch (e) {
    document.body.dataset.error = String(e);
  }
}
poll(); setInterval(poll, POLL_MS);
"""

_BODY = """<body data-rendered="0">
<h1 id="title">run</h1><div id="status">loading…</div>
<div class="cards">
 <div class="card">steps<b><span id="step-count">0</span> / <span id="steps-target">?</span></b></div>
 <div class="card">reward<b id="reward">-</b></div>
 <div class="card">trained tok/s<b id="throughput">-</b></div>
 <div class="card">version<b id="version">-</b></div>
 <div class="card">dead letters<b id="dlq">-</b></div>
 <div class="card">state<b id="state">-</b></div>
</div>
<div class="charts">
 <div class="panel" id="chart-reward"></div><div class="panel" id="chart-throughput"></div>
 <div class="panel" id="chart-staleness"></div><div class="panel" id="chart-hist"></div>
</div>
<h2>version timeline per instance (hatched: bubbles, the instance idle or loading)</h2>
<div class="panel" id="timeline"></div>
<h2>versions live</h2><div id="versions"></div>
<h2>instances</h2><div id="instances"></div>
<h2>consumer lag (committed offsets)</h2><div id="lag"></div>
"""


def render_page(title: str = "dora-rl dashboard") -> str:
    """The whole page (the JSON comes from ``api/run``, relative to the page)."""
    js = _JS.replace("POLL_MS", str(POLL_MS))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{_CSS}</style>"
            f"</head>{_BODY}<script>{js}</script></body></html>")


__all__ = ["POLL_MS", "render_page"]
