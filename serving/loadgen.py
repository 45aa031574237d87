"""Load generator: TTFT / inter-token latency / throughput percentiles.

Sends ``num_requests`` streaming requests of ``input_len`` random prompt
tokens and exactly ``output_len`` generated tokens (ignore_eos) either with
``concurrency`` requests in flight, or arriving as a Poisson process at
``rate`` requests per second. With ``range_ratio`` r > 0 each request draws
its lengths uniformly from [L(1-r), L(1+r)] instead (vLLM's
--random-range-ratio): ragged prompts, as real traffic has, pad the
server's batches. With ``shared_prefix_len`` P each prompt starts with one of
``prefix_groups`` random prefixes of P tokens (a system prompt; SGLang's
generated-shared-prefix data), then its own ``input_len`` tokens; the report
counts the prompt tokens the server served from its prefix cache. Times are
measured at the client. A request the server refuses or fails is counted
(``failed``, with the first errors) and the run goes on, as vLLM's
benchmark_serving does; the latencies are the completed requests'. The report
says when the outputs were shorter than asked (a server whose KV cache
holds less, a grammar that ends first).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import statistics
import time

import grpc

from serving.client import Client


@dataclasses.dataclass
class Sample:
  ttft: float
  itls: list[float]
  e2e: float
  tokens: int
  cached: int = 0  # prompt tokens the server read from its prefix cache
  error: str | None = None  # the call's status when it failed
  asked: int = 0  # its output_len


def _pct(xs, q):
  if not xs:
    return float("nan")
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def run(client: Client, *, num_requests: int, input_len: int, output_len: int,
        concurrency: int | None = None, rate: float | None = None, vocab: int = 256,
        token_range: tuple[int, int] | None = None, seed: int = 0,
        timeout: float = 600.0, range_ratio: float = 0.0, shared_prefix_len: int = 0,
        prefix_groups: int = 1, structured: dict | None = None) -> dict:
  """``structured``: every request's structured_outputs (e.g. {"regex": ...});
  a request then ends where its grammar does, if before output_len."""
  if (concurrency is None) == (rate is None):
    raise ValueError(f"give exactly one of {concurrency=} or {rate=}")
  if num_requests < 1 or input_len < 1 or output_len < 1:
    raise ValueError(f"{num_requests=}, {input_len=} and {output_len=} must be >= 1")
  if shared_prefix_len < 0 or prefix_groups < 1:
    raise ValueError(f"{shared_prefix_len=} must be >= 0 and {prefix_groups=} >= 1")
  if not 0.0 <= range_ratio < 1.0:
    raise ValueError(f"{range_ratio=} must be in [0, 1)")
  rng = random.Random(seed)

  def lengths(n):
    if not range_ratio:  # no draws: a seed gives the prompts it always gave
      return [n] * num_requests
    lo_, hi_ = max(1, round(n * (1 - range_ratio))), round(n * (1 + range_ratio))
    return [rng.randint(lo_, max(lo_, hi_)) for _ in range(num_requests)]

  in_lens, out_lens = lengths(input_len), lengths(output_len)
  lo, hi = token_range or (0, vocab)
  prompts = [[rng.randrange(lo, hi) for _ in range(n)] for n in in_lens]
  if shared_prefix_len:
    prefixes = [[rng.randrange(lo, hi) for _ in range(shared_prefix_len)]
                for _ in range(prefix_groups)]
    prompts = [prefixes[i % prefix_groups] + p for i, p in enumerate(prompts)]

  def one(prompt, output_len) -> Sample:
    try:
      return dataclasses.replace(stream(prompt, output_len), asked=output_len)
    except grpc.RpcError as e:
      return Sample(float("nan"), [], float("nan"), 0, error=f"{e.code().name}: {e.details()}")

  def stream(prompt, output_len) -> Sample:
    t0 = time.perf_counter()
    first = last = None
    itls, n, cached = [], 0, 0
    for chunk in client.stream(prompt, timeout=timeout, max_tokens=output_len, ignore_eos=True,
                               structured_outputs=structured):
      if chunk.HasField("final"):
        cached = chunk.final.usage.cached_prompt_tokens
      k = len(chunk.token_ids)
      if k:
        now = time.perf_counter()
        if last is None:
          first = now
        else:
          # A chunk of k tokens (the server's stream interval, or merged
          # messages) counts as k inter-token gaps of equal share.
          itls.extend([(now - last) / k] * k)
        last = now
        n += k
    end = time.perf_counter()
    return Sample(first - t0 if first is not None else float("nan"), itls, end - t0, n, cached)

  t_start = time.perf_counter()
  workers = concurrency or min(num_requests, 1024)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    if concurrency is not None:
      samples = list(pool.map(one, prompts, out_lens))
    else:
      futures, t = [], time.perf_counter()
      for p, n in zip(prompts, out_lens):
        t += rng.expovariate(rate)
        time.sleep(max(0.0, t - time.perf_counter()))
        futures.append(pool.submit(one, p, n))
      samples = [f.result() for f in futures]
  wall = time.perf_counter() - t_start
  errors = [s.error for s in samples if s.error is not None]
  samples = [s for s in samples if s.error is None]
  ttft = [s.ttft for s in samples]
  itl = [x for s in samples for x in s.itls]
  tpot = [(s.e2e - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
  tokens = sum(s.tokens for s in samples)
  out = {
      "num_requests": num_requests, "input_len": input_len, "output_len": output_len,
      "range_ratio": range_ratio, "shared_prefix_len": shared_prefix_len,
      "prefix_groups": prefix_groups, "input_tokens": sum(map(len, prompts)),
      "cached_prompt_tokens": sum(s.cached for s in samples), "concurrency": concurrency,
      "rate": rate, "structured": structured, "wall_s": wall,
      "output_tokens": tokens, "output_tokens_asked": sum(s.asked for s in samples),
      "output_tok_s": tokens / wall, "requests_s": len(samples) / wall,
      "completed": len(samples), "failed": len(errors), "errors": sorted(set(errors))[:5],
  }
  for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", [s.e2e for s in samples])):
    for q in (50, 90, 99):
      out[f"{name}_p{q}_ms"] = _pct(xs, q) * 1e3
    out[f"{name}_mean_ms"] = statistics.fmean(xs) * 1e3 if xs else float("nan")
  return out


def spread(range_ratio: float) -> str:
  """The lengths' range as a factor of L ("x0.5..1.5"); "" for equal lengths."""
  return f"x{1 - range_ratio:g}..{1 + range_ratio:g}" if range_ratio else ""


def format_report(r: dict) -> str:
  mode = f"concurrency {r['concurrency']}" if r["concurrency"] else f"rate {r['rate']}/s"
  lengths = f" ({spread(r['range_ratio'])})" if r.get("range_ratio") else ""
  if r.get("shared_prefix_len"):
    lengths += (f" after {r['prefix_groups']} shared prefix(es) of {r['shared_prefix_len']}; "
                f"{r['cached_prompt_tokens']} of {r['input_tokens']} prompt tokens cached")
  lines = [f"{r['num_requests']} requests, {r['input_len']} in / {r['output_len']} out{lengths}, "
           f"{mode}: "
           f"{r['output_tok_s']:.1f} output tok/s, {r['requests_s']:.2f} req/s"]
  if r["failed"]:
    lines.append(f"  {r['failed']} of {r['num_requests']} requests failed: "
                 + "; ".join(r["errors"]))
  if r["output_tokens"] < r["output_tokens_asked"]:
    lines.append(f"  {r['output_tokens']} output tokens, fewer than the "
                 f"{r['output_tokens_asked']} asked for")
  lines.append("           p50      p90      p99   (ms)")
  for name in ("ttft", "itl", "tpot", "e2e"):
    lines.append(f"  {name:5s} " + " ".join(f"{r[f'{name}_p{q}_ms']:8.2f}" for q in (50, 90, 99)))
  return "\n".join(lines)


