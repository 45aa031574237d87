"""Prometheus metrics of the server, in the text exposition format.

A small self-contained registry (counters, gauges, histograms) so the server
runs where prometheus-client is not installed (the GPU machine). ``Metrics``
holds the server's series and is the engine's observer; ``metrics_http``
binds ``/metrics`` to its own port (the server serves it once warmed up).
"""

from __future__ import annotations

import bisect
import http.server
import threading

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)


class _Metric:
  kind = ""

  def __init__(self, name: str, doc: str):
    self.name, self.doc = name, doc
    self._lock = threading.Lock()

  def header(self) -> list[str]:
    return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
  """A count, or with ``label`` one count per label value (``inc(v, value)``);
  with ``fn`` the count is read from it."""
  kind = "counter"

  def __init__(self, name, doc, fn=None, label: str | None = None):
    super().__init__(name, doc)
    self.value, self.fn, self.label = 0.0, fn, label
    self.by_label: dict[str, float] = {}

  def inc(self, v: float = 1.0, label_value: str | None = None) -> None:
    with self._lock:
      self.value += v
      if self.label is not None:
        self.by_label[label_value] = self.by_label.get(label_value, 0.0) + v

  def render(self) -> list[str]:
    if self.label is None:
      return self.header() + [f"{self.name} {float(self.fn()) if self.fn else self.value}"]
    with self._lock:
      items = sorted(self.by_label.items())
    return self.header() + [f'{self.name}{{{self.label}="{k}"}} {v}' for k, v in items]


class Gauge(_Metric):
  kind = "gauge"

  def __init__(self, name, doc, fn=None):
    super().__init__(name, doc)
    self.value, self.fn = 0.0, fn

  def set(self, v: float) -> None:
    self.value = v

  def render(self) -> list[str]:
    return self.header() + [f"{self.name} {self.fn() if self.fn else self.value}"]


class Histogram(_Metric):
  kind = "histogram"

  def __init__(self, name, doc, buckets=_LATENCY_BUCKETS):
    super().__init__(name, doc)
    self.buckets = tuple(buckets)
    self.counts = [0] * (len(self.buckets) + 1)
    self.sum = 0.0

  def observe(self, v: float, n: int = 1) -> None:
    """Records ``n`` samples of value ``v``."""
    with self._lock:
      self.counts[bisect.bisect_left(self.buckets, v)] += n
      self.sum += v * n

  @property
  def count(self) -> int:
    return sum(self.counts)

  def render(self) -> list[str]:
    out, acc = self.header(), 0
    for b, c in zip(self.buckets, self.counts):
      acc += c
      out.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
    out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
    out += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
    return out


class Metrics:
  """The server's series; ``engine`` supplies the gauges."""

  def __init__(self, engine=None):
    self.engine = engine
    p = "mosaic_serving_"
    stat = lambda f: (lambda: getattr(engine.stats(), f) if engine else 0)  # noqa: E731
    self.ttft = Histogram(p + "time_to_first_token_seconds", "Submission to first token.")
    self.itl = Histogram(p + "inter_token_latency_seconds", "Time between streamed tokens.")
    self.queue = Histogram(p + "queue_time_seconds", "Submission to first scheduled step.")
    self.e2e = Histogram(p + "request_latency_seconds", "Submission to the final token.")
    self.tpot = Histogram(p + "time_per_output_token_seconds",
                          "A request's mean time per token after its first.")
    self.step = Histogram(p + "step_seconds", "Wall time of one engine step.")
    self.step_host = Histogram(p + "step_host_seconds",
                               "Host time of one engine step (not waiting on the device).")
    self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens admitted.")
    self.generated_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
    self.cached_tokens = Counter(p + "prefix_cache_hit_tokens_total",
                                 "Prompt tokens served from the prefix cache.")
    self.compiles = Counter(p + "compiles_total", "Backend compiles in the engine's steps "
                            "after its warm-up (each holds up the whole batch).")
    self.requests = Counter(p + "requests_total", "Requests finished (any reason).")
    self.finished = Counter(p + "requests_finished_total", "Requests finished, by reason.",
                            label="reason")
    self.preemptions = Counter(p + "preemptions_total", "Running requests preempted to free "
                               "KV pages (each computes its tokens again).", stat("preemptions"))
    self.jump_forward = Counter(p + "jump_forward_tokens_total", "Tokens structured outputs "
                                "took without sampling (serve --jump-forward).",
                                stat("jump_forward_tokens"))
    self.spec_draft = Counter(p + "spec_decode_num_draft_tokens_total", "Tokens drafted by "
                              "n-gram speculation (serve --num-speculative-tokens).",
                              stat("spec_draft_tokens"))
    self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens_total", "Drafted tokens "
                                 "the model agreed with.", stat("spec_accepted_tokens"))
    self.rejected = Counter(p + "requests_rejected_total", "Requests refused (queue full, "
                            "invalid, draining).")
    self.running = Gauge(p + "requests_running", "Requests in the running batch.",
                         stat("running"))
    self.waiting = Gauge(p + "requests_waiting", "Requests waiting for admission.",
                         stat("waiting"))
    self.pages_used = Gauge(p + "kv_pages_in_use", "KV pages referenced by requests.",
                            stat("pages_in_use"))
    self.pages_total = Gauge(p + "kv_pages_total", "Usable KV pages.", stat("pages_total"))
    self.pages_cached = Gauge(p + "kv_pages_prefix_cached", "KV pages in the prefix cache.",
                              stat("pages_cached"))
    self._all = [v for v in vars(self).values() if isinstance(v, _Metric)]

  # Engine observer hooks (called on the engine thread).
  def on_step(self, engine, record) -> None:
    del engine
    self.step.observe(record.wall)
    self.step_host.observe(max(record.wall - record.wait, 0.0))
    if record.compiles:
      self.compiles.inc(record.compiles)

  def on_final(self, final) -> None:
    self.requests.inc()
    self.finished.inc(1, final.reason.name.lower())
    self.queue.observe(final.queue_s)
    if final.completion_tokens > 1:
      self.tpot.observe((final.total_s - final.first_token_s) / (final.completion_tokens - 1))
    self.e2e.observe(final.total_s)
    if final.completion_tokens:
      self.ttft.observe(final.first_token_s)
    self.prompt_tokens.inc(final.prompt_tokens)
    self.generated_tokens.inc(final.completion_tokens)
    self.cached_tokens.inc(final.cached_prompt_tokens)

  def on_failed(self, failed) -> None:
    """A request that ended in an error (api.Failed): reason "error"."""
    del failed
    self.requests.inc()
    self.finished.inc(1, "error")

  def render(self) -> str:
    return "\n".join(line for m in self._all for line in m.render()) + "\n"


def metrics_http(metrics: Metrics, host: str, port: int) -> http.server.ThreadingHTTPServer:
  """``/metrics`` bound to ``host:port`` (``.server_port``); the caller runs
  ``serve_forever``."""

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
      if self.path.split("?")[0] != "/metrics":
        self.send_error(404, "only /metrics is served")
        return
      body = metrics.render().encode()
      self.send_response(200)
      self.send_header("Content-Type", "text/plain; version=0.0.4")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  return http.server.ThreadingHTTPServer((host, port), Handler)
