"""Prometheus metrics of the server, through prometheus-client.

``Metrics`` holds the server's series in a ``CollectorRegistry`` of its own
(two servers in one process keep theirs apart) and is the engine's observer:
the engine calls ``on_step`` / ``on_final`` / ``on_failed``; the engine's
own counts (pages, running, preemptions, ...) are read from
``engine.stats()`` once per scrape. ``exposition()`` gives the text and its
content type for any HTTP front end's ``GET /metrics``; ``metrics_http``
binds prometheus-client's WSGI app to a port of its own.

With ``serve --engine-process`` the engine's process records no series: its
step timings and request events cross the pipe to the server's process,
whose ``Metrics`` records them, and ``stats()`` is a call over that pipe, so
one registry in one process holds every series (no multiprocess mode).
"""

from __future__ import annotations

import logging
import socketserver
import time
import wsgiref.simple_server

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               disable_created_metrics, generate_latest, make_wsgi_app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("serving.metrics")

# No ``*_created`` series beside each counter and histogram (prometheus-client
# adds them by default, process-wide): the exposition keeps the series the
# server has always exported, and no gauge named like a count of requests.
disable_created_metrics()

PREFIX = "mosaic_serving_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)

# Series read from engine.stats() at each scrape: (name, help, EngineStats field).
_ENGINE_COUNTERS = (
    ("preemptions_total", "Running requests preempted to free KV pages (each computes its "
     "tokens again).", "preemptions"),
    ("jump_forward_tokens_total", "Tokens structured outputs took without sampling "
     "(serve --jump-forward).", "jump_forward_tokens"),
    ("spec_decode_num_draft_tokens_total", "Tokens drafted by n-gram speculation "
     "(serve --num-speculative-tokens).", "spec_draft_tokens"),
    ("spec_decode_num_accepted_tokens_total", "Drafted tokens the model agreed with.",
     "spec_accepted_tokens"),
)
_ENGINE_GAUGES = (
    ("requests_running", "Requests in the running batch.", "running"),
    ("requests_waiting", "Requests waiting for admission.", "waiting"),
    ("kv_pages_in_use", "KV pages referenced by requests.", "pages_in_use"),
    ("kv_pages_total", "Usable KV pages.", "pages_total"),
    ("kv_pages_prefix_cached", "KV pages in the prefix cache.", "pages_cached"),
)


class _EngineStats(Collector):
  """The engine's own counts, one ``stats()`` call per scrape (a call over
  the pipe with --engine-process). An engine that no longer answers (its
  process died) leaves them out; the server's own series still export."""

  def __init__(self, engine):
    self.engine = engine

  def _families(self, stats):
    for name, doc, field in _ENGINE_COUNTERS:
      yield CounterMetricFamily(PREFIX + name, doc,
                                value=None if stats is None else getattr(stats, field))
    for name, doc, field in _ENGINE_GAUGES:
      yield GaugeMetricFamily(PREFIX + name, doc,
                              value=None if stats is None else getattr(stats, field))

  def describe(self):
    return list(self._families(None))

  def collect(self):
    if self.engine is None:
      return []
    try:
      stats = self.engine.stats()
    except Exception as e:  # noqa: BLE001 - a scrape must not fail on a dead engine
      log.debug("engine stats unavailable for /metrics: %r", e)
      return []
    return list(self._families(stats))


class Metrics:
  """The server's series; ``engine`` supplies the gauges and its counters."""

  def __init__(self, engine=None):
    self.engine = engine
    self.registry = r = CollectorRegistry()
    p = PREFIX

    def hist(name, doc):
      return Histogram(p + name, doc, buckets=_LATENCY_BUCKETS, registry=r)

    self.ttft = hist("time_to_first_token_seconds", "Submission to first token.")
    self.itl = hist("inter_token_latency_seconds", "Time between streamed tokens.")
    self.queue = hist("queue_time_seconds", "Submission to first scheduled step.")
    self.e2e = hist("request_latency_seconds", "Submission to the final token.")
    self.tpot = hist("time_per_output_token_seconds",
                     "A request's mean time per token after its first.")
    self.step = hist("step_seconds", "Wall time of one engine step.")
    self.step_host = hist("step_host_seconds",
                          "Host time of one engine step (not waiting on the device).")
    self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens admitted.",
                                 registry=r)
    self.generated_tokens = Counter(p + "generation_tokens_total", "Tokens generated.",
                                    registry=r)
    self.cached_tokens = Counter(p + "prefix_cache_hit_tokens_total",
                                 "Prompt tokens served from the prefix cache.", registry=r)
    self.compiles = Counter(p + "compiles_total", "Backend compiles in the engine's steps "
                            "after its warm-up (each holds up the whole batch).", registry=r)
    self.requests = Counter(p + "requests_total", "Requests finished (any reason).", registry=r)
    self.finished = Counter(p + "requests_finished_total", "Requests finished, by reason.",
                            ["reason"], registry=r)
    self.rejected = Counter(p + "requests_rejected_total", "Requests refused (queue full, "
                            "invalid, draining).", registry=r)
    r.register(_EngineStats(engine))

  # Engine observer hooks (called on the engine thread, or on the reader
  # thread of an --engine-process engine).
  def on_step(self, engine, record) -> None:
    del engine
    self.step.observe(record.wall)
    self.step_host.observe(max(record.wall - record.wait, 0.0))
    if record.compiles:
      self.compiles.inc(record.compiles)

  def on_final(self, final) -> None:
    self.requests.inc()
    self.finished.labels(reason=final.reason.name.lower()).inc()
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
    self.finished.labels(reason="error").inc()

  def observe_itl(self, gap: float, n: int = 1) -> None:
    """``n`` inter-token gaps of ``gap`` seconds (a message of n tokens)."""
    for _ in range(n):
      self.itl.observe(gap)

  def token_gaps(self) -> "TokenGaps":
    """A call's clock for the inter-token latency histogram."""
    return TokenGaps(self.observe_itl)

  def sample(self, name: str, **labels) -> float | None:
    """One sample's value by its exposed name (``PREFIX`` may be left out),
    e.g. ``sample("requests_finished_total", reason="eos")``; None if absent."""
    if not name.startswith(PREFIX):
      name = PREFIX + name
    return self.registry.get_sample_value(name, labels or None)

  def exposition(self) -> tuple[bytes, str]:
    """The body and Content-Type of a ``GET /metrics`` answer."""
    return generate_latest(self.registry), CONTENT_TYPE_LATEST

  def render(self) -> str:
    """The exposition as text."""
    return generate_latest(self.registry).decode()


class _Server(socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer):
  daemon_threads = True  # a thread per scrape, not waited for at close


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
  def log_message(self, *args):
    pass


def metrics_http(metrics: Metrics, host: str, port: int) -> wsgiref.simple_server.WSGIServer:
  """prometheus-client's WSGI app for ``metrics.registry`` at ``/metrics``
  (other paths 404), bound to ``host:port`` now (``.server_port``); the
  caller runs ``serve_forever`` and stops it with ``shutdown`` and
  ``server_close``."""
  app = make_wsgi_app(metrics.registry)

  def only_metrics(environ, start_response):
    if environ.get("PATH_INFO", "") != "/metrics":
      start_response("404 Not Found", [("Content-Type", "text/plain")])
      return [b"only /metrics is served\n"]
    return app(environ, start_response)

  return wsgiref.simple_server.make_server(host, port, only_metrics, server_class=_Server,
                                           handler_class=_QuietHandler)


class TokenGaps:
  """The inter-token gaps of one call's completions, as the gRPC and HTTP
  APIs count them: k tokens that reach a completion at once are k equal
  gaps since its previous tokens (its first tokens are its TTFT, no gap)."""

  def __init__(self, observe):
    self.observe = observe  # (gap seconds, count)
    self.last: dict[int, float] = {}  # completion -> when its last tokens came

  def arrived(self, completion: int, k: int) -> None:
    if not k:
      return
    now = time.monotonic()
    if completion in self.last:
      self.observe((now - self.last[completion]) / k, k)
    self.last[completion] = now
