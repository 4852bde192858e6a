"""``dora-rl dashboard``: a web page of one run (running or finished), and the plot every run ends with.

- :mod:`.payload`: the JSON the page polls, built from a :class:`~dora_rl.consumers.monitor_view.RunSnapshot`
  and the instances' :class:`~dora_rl.consumers.timeline.Timeline` (pure);
- :mod:`.page`: the page itself (inline SVG drawn by inline JavaScript: no CDN, no framework);
- :mod:`.server`: the HTTP server (stdlib) and the thread that follows the run;
- :mod:`.plot`: ``summary.png`` (reward, throughput, staleness per step) beside a run's ``summary.json``.
"""
