"""Soak: minutes of mixed traffic against one server, counting every outcome.

A server on loopback (the counting model by default: every output is known;
``--model toy`` for the small random decoder; ``--engine-process`` puts the
engine in its own process) takes ``--clients`` concurrent clients for
``--minutes``. Each call is one of: a stream read to its end, a stream
cancelled part-way, a call with a short deadline, n > 1 completions, a
structured output (a choice, a regex), a request with a bad field, raw bytes
that do not decode, a grammar that fails inside the engine, an HTTP
completion (streamed or not), an HTTP stream whose client goes away. Every
call has the outcome its kind expects (the counting model's text where it
runs to its end; INVALID_ARGUMENT for bad input; DEADLINE_EXCEEDED; ...) or
it is counted as an error of its kind; a call that returns nothing within
its timeout is a lost request. Every ``--sample-s`` the server's resident
memory (and the engine process's), KV pages in use, requests running and
waiting, threads and file descriptors are recorded.

  PYTHONPATH=. python bench/soak.py --minutes 5 --out bench/results/soak_cpu

writes soak.json (every sample, outcome counts by kind) and soak.md (the
table). The run passes when no request is lost, no outcome was unexpected,
and memory and pages are flat: pages back to 0 at the end, and the last
quarter's median memory within --rss-slack-mb of the second quarter's.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import http.client
import json
import os
import pathlib
import platform
import random
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from serving import engine as E  # noqa: E402
from serving.client import Client  # noqa: E402
from serving.proto import generate_pb2 as pb  # noqa: E402
from serving.service import Server  # noqa: E402

KINDS = ("stream", "cancel", "deadline", "n3", "choice", "regex", "bad_field", "bad_bytes",
         "grammar_fails", "http", "http_stream", "http_gone")


def _expected(last: str, n: int) -> str:
  return "".join(chr(ord(last) + 1 + i) for i in range(n))


def rss_mb(pid: int | str = "self") -> float:
  for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024
  return 0.0


class Soak:

  def __init__(self, server: Server, counting: bool, seed: int):
    self.server = server
    self.counting = counting
    self.port = server.openai_http.server_port
    self.client = Client(server.address)
    self.rng = random.Random(seed)
    self.lock = threading.Lock()
    self.outcomes: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
    self.unexpected: list[str] = []  # the first few, for the report

  def _text_ok(self, prompt_last: str, n: int, text: str) -> bool:
    return not self.counting or text == _expected(prompt_last, n)

  def one(self, kind: str, rng: random.Random) -> str:
    """Runs one call of ``kind``; returns its outcome: "ok" (what its kind
    expects) or a name for what happened instead."""
    c = self.client
    last = rng.choice("abcdefghijklmnop")
    k = rng.randint(4, 14)  # (ends by "~", where the counting model says EOS)
    try:
      if kind == "stream":
        text = "".join(ch.text for ch in c.stream("x" + last, max_tokens=k, timeout=60))
        return "ok" if self._text_ok(last, k, text) else "wrong_text"
      if kind == "cancel":
        s = c.stream("x" + last, max_tokens=400, ignore_eos=True, timeout=60)
        for _ in range(rng.randint(1, 5)):
          next(s)
        s.cancel()
        return "ok"
      if kind == "deadline":
        try:
          c.generate("x" + last, max_tokens=400, ignore_eos=True, timeout=0.05)
          return "no_deadline"
        except grpc.RpcError as e:
          return "ok" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name
      if kind == "n3":
        r = c.generate("x" + last, max_tokens=k, n=3, timeout=60)
        return "ok" if all(self._text_ok(last, k, x.text) for x in r.completions) and len(
            r.completions) == 3 else "wrong_text"
      if kind == "choice":
        r = c.generate("a", timeout=60, structured_outputs={"choice": {"choices": ["yes", "no"]}})
        return "ok" if r.text in ("yes", "no") else "wrong_text"
      if kind == "regex":
        r = c.generate("a", timeout=60, max_tokens=40,
                       structured_outputs={"regex": "[b-z]{5}"})
        return "ok" if len(r.text) == 5 and r.finish_reason == pb.FINISH_REASON_STOP else (
            "wrong_text")
      if kind in ("bad_field", "grammar_fails"):
        kw = (dict(temperature=-1.0) if kind == "bad_field" else
              dict(structured_outputs={"regex": "a{1000000}"}))
        try:
          c.generate("a", max_tokens=8, timeout=60, **kw)
          return "accepted"
        except grpc.RpcError as e:
          return "ok" if e.code() == grpc.StatusCode.INVALID_ARGUMENT else e.code().name
      if kind == "bad_bytes":
        call = c.channel.unary_unary("/mosaic.serving.v1.TextGeneration/Generate",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
        try:
          call(rng.choice([b"\xff\xff\xff", b"\x12\x02\xff\xfe", b"\x1a\x02\x08"]), timeout=30)
          return "accepted"
        except grpc.RpcError as e:
          return "ok" if e.code() == grpc.StatusCode.INVALID_ARGUMENT else e.code().name
      if kind in ("http", "http_stream", "http_gone"):
        return self._http(kind, last, k, rng)
      raise ValueError(kind)
    except grpc.RpcError as e:
      return "lost" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name
    except (TimeoutError, socket.timeout):
      return "lost"

  def _http(self, kind: str, last: str, k: int, rng: random.Random) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
    stream = kind != "http"
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "x" + last, "max_tokens": 400 if kind == "http_gone" else k,
         "temperature": 0, "stream": stream, "ignore_eos": kind == "http_gone"}))
    sock = conn.sock
    r = conn.getresponse()
    try:
      if r.status == 429:
        return "queue_full"
      if r.status != 200:
        return f"http_{r.status}"
      if not stream:
        text = json.loads(r.read())["choices"][0]["text"]
        return "ok" if self._text_ok(last, k, text) else "wrong_text"
      events = []
      while True:
        line = r.readline()  # (the body's chunks decoded)
        if not line:
          break
        if line.startswith(b"data: "):
          events.append(line[6:].strip())
          if kind == "http_gone" and len(events) >= rng.randint(1, 5):
            sock.shutdown(socket.SHUT_RDWR)
            return "ok"
      if events[-1:] != [b"[DONE]"]:
        return "no_done"
      text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]
                     if json.loads(e).get("choices"))
      return "ok" if self._text_ok(last, k, text) else "wrong_text"
    finally:
      r.close()
      conn.close()

  def client_loop(self, end: float, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
      kind = rng.choice(KINDS)
      try:
        outcome = self.one(kind, rng)
      except Exception as e:  # noqa: BLE001 - the soak counts it, whatever it is
        outcome = f"exception:{type(e).__name__}"
      with self.lock:
        self.outcomes[kind][outcome] += 1
        if outcome not in ("ok", "queue_full", "RESOURCE_EXHAUSTED") and len(
            self.unexpected) < 20:
          self.unexpected.append(f"{kind}: {outcome}")
      if outcome in ("queue_full", "RESOURCE_EXHAUSTED"):
        time.sleep(rng.uniform(0.02, 0.1))  # a client's back-off before it retries

  def sample(self, t0: float) -> dict:
    engine = self.server.engine
    st = engine.stats()
    s = {"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss_mb(), 1),
         "pages_in_use": st.pages_in_use, "pages_cached": st.pages_cached,
         "running": st.running, "waiting": st.waiting,
         # (the gRPC server's worker pool keeps its idle threads: counted apart)
         "threads": sum(not t.name.startswith("rpc") for t in threading.enumerate()),
         "pool_threads": sum(t.name.startswith("rpc") for t in threading.enumerate()),
         "fds": len(os.listdir("/proc/self/fd"))}
    proc = getattr(engine, "_proc", None)
    if proc is not None:
      try:
        s["engine_rss_mb"] = round(rss_mb(proc.pid), 1)
      except (OSError, ValueError):
        pass
    with self.lock:
      s["calls"] = sum(sum(c.values()) for c in self.outcomes.values())
    return s


def _engine(a):
  kw = dict(max_batch=a.max_batch, max_waiting=a.max_waiting, default_max_tokens=32)
  if a.model == "counting":
    kw.update(num_pages=a.num_pages, step_delay=a.step_delay)
    factory = E.tiny_engine
  else:
    kw.update(num_pages=a.num_pages, warmup=True)
    factory = E.toy_engine
  if a.engine_process:
    from serving.engine.process import ProcessEngine

    return ProcessEngine(factory, **kw)
  return factory(**kw)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--minutes", type=float, default=5.0)
  p.add_argument("--clients", type=int, default=16)
  p.add_argument("--model", choices=("counting", "toy"), default="counting")
  p.add_argument("--engine-process", action="store_true")
  p.add_argument("--max-batch", type=int, default=8)
  p.add_argument("--max-waiting", type=int, default=16)
  p.add_argument("--num-pages", type=int, default=256)
  p.add_argument("--step-delay", type=float, default=0.002, help="counting model: s a step")
  p.add_argument("--sample-s", type=float, default=5.0)
  p.add_argument("--rss-slack-mb", type=float, default=20.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=pathlib.Path, required=True)
  a = p.parse_args(argv)
  a.out.mkdir(parents=True, exist_ok=True)

  server = Server(_engine(a), host="127.0.0.1", port=0, http_port=0).start()
  soak = Soak(server, a.model == "counting", a.seed)
  t0 = time.monotonic()
  end = t0 + a.minutes * 60
  samples = [soak.sample(t0)]
  with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
    futs = [pool.submit(soak.client_loop, end, a.seed * 1000 + i) for i in range(a.clients)]
    while not all(f.done() for f in futs):
      time.sleep(min(a.sample_s, max(end - time.monotonic(), 0.1)))
      samples.append(soak.sample(t0))
    for f in futs:
      f.result()
  # The end: every request over, pages back to 0 (the prefix cache may keep some).
  settle = time.monotonic() + 10
  while time.monotonic() < settle and (server.engine.stats().pages_in_use
                                       or server.engine.stats().running):
    time.sleep(0.05)
  samples.append(soak.sample(t0))
  soak.client.close()
  server.stop(grace=1.0)

  counts = {k: dict(v) for k, v in soak.outcomes.items()}
  expected = ("ok", "queue_full", "RESOURCE_EXHAUSTED")
  lost = sum(v.get("lost", 0) for v in counts.values())
  unexpected = {k: {o: n for o, n in v.items() if o not in expected}
                for k, v in counts.items()}
  unexpected = {k: v for k, v in unexpected.items() if v}
  q = max(len(samples) // 4, 1)
  second, last = samples[q:2 * q], samples[-q - 1:-1]  # (the settled sample apart)
  # Medians: the resident size moves by ~100 MB between samples (threads' stacks).
  median = lambda xs, f: statistics.median(x[f] for x in xs) if xs else 0.0  # noqa: E731
  rss_growth = median(last, "rss_mb") - median(second, "rss_mb")
  verdict = {"lost": lost, "unexpected": unexpected,
             "pages_at_end": samples[-1]["pages_in_use"],
             "rss_growth_mb_q2_to_q4": round(rss_growth, 1),
             "fds_start_end": [samples[0]["fds"], samples[-1]["fds"]],
             "threads_start_end": [samples[0]["threads"], samples[-1]["threads"]]}
  verdict["pass"] = (not lost and not unexpected and verdict["pages_at_end"] == 0
                     and rss_growth <= a.rss_slack_mb)
  import jax

  result = {"date": datetime.date.today().isoformat(),
            "command": "PYTHONPATH=. python bench/soak.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "jax": jax.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "config": {k: (str(v) if isinstance(v, pathlib.Path) else v)
                       for k, v in vars(a).items()},
            "calls": sum(sum(v.values()) for v in counts.values()),
            "outcomes": counts, "verdict": verdict, "first_unexpected": soak.unexpected,
            "samples": samples}
  (a.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
  (a.out / "soak.md").write_text(markdown(result))
  print(markdown(result))
  return 0 if verdict["pass"] else 1


def markdown(r: dict) -> str:
  v = r["verdict"]
  lines = [f"# Soak: {r['config']['minutes']:g} min of mixed traffic ({r['config']['model']} "
           f"model{', engine process' if r['config']['engine_process'] else ''})", "",
           f"Date {r['date']}; jax {r['jax']}, Python {r['python']}, {r['machine']}.", "",
           f"    {r['command']}", "",
           f"{r['calls']} calls; lost {v['lost']}; unexpected outcomes "
           f"{v['unexpected'] or 'none'}; pages in use at the end {v['pages_at_end']}; "
           f"median memory growth from the 2nd to the 4th quarter {v['rss_growth_mb_q2_to_q4']} MB; "
           f"fds {v['fds_start_end'][0]} -> {v['fds_start_end'][1]}, threads "
           f"{v['threads_start_end'][0]} -> {v['threads_start_end'][1]}: "
           f"**{'pass' if v['pass'] else 'FAIL'}**.", "",
           "| kind | calls | outcomes |", "|---|---|---|"]
  for kind, outs in r["outcomes"].items():
    lines.append(f"| {kind} | {sum(outs.values())} | "
                 + ", ".join(f"{o} {n}" for o, n in sorted(outs.items())) + " |")
  lines += ["", "| t (s) | calls | RSS (MB) | engine RSS (MB) | pages in use | cached | running "
                "| waiting | threads (+ gRPC pool) | fds |", "|---|---|---|---|---|---|---|---|---|---|"]
  samples = r["samples"]
  step = max(len(samples) // 24, 1)
  for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
    lines.append(f"| {s['t_s']} | {s['calls']} | {s['rss_mb']} | {s.get('engine_rss_mb', '')} | "
                 f"{s['pages_in_use']} | {s['pages_cached']} | {s['running']} | {s['waiting']} | "
                 f"{s['threads']} (+{s.get('pool_threads', 0)}) | {s['fds']} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
