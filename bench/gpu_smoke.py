"""The README's commands on a GPU machine, run as a user types them.

Each server is started with `python -m serving serve` (the README's flags, the
default memory sizing unless SERVE_FLAGS says otherwise) in a process of its
own; the clients are `python -m serving generate` / `loadgen` and curl on the
OpenAI-compatible route, each its own process; SIGTERM ends the server, which
must exit 0 within its drain timeout. A failed step fails the smoke (exit 1),
and later steps of that server are skipped. The summary (commit, each step's
pass/fail and seconds, warm-up time, TTFT / TPOT / tok/s) goes to
``$OUT/gpu_smoke.json`` with every process's log beside it.

    PYTHONPATH=. python3 bench/gpu_smoke.py --out $OUT [--model llama3.1-8b] [--c64]

``--servers`` picks the server variants: ``process`` (the README's command,
with --engine-process) and ``inproc`` (the same without it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_FLAGS = ["--attention-backend", "mosaic", "--decode-steps", "8"]
VARIANTS = {"process": ["--engine-process"], "inproc": []}


class Smoke:

  def __init__(self, out: pathlib.Path, summary: dict):
    self.out = out
    self.summary = summary
    self.steps: list[dict] = []
    self.ok = True

  def write(self, done: bool) -> None:
    """The JSON as it stands (after every step: a run cut short keeps the
    steps before the cut, and says it was cut)."""
    self.summary.update(ok=self.ok and done, finished=done, steps=self.steps)
    (self.out / "gpu_smoke.json").write_text(json.dumps(self.summary, indent=1))

  def step(self, name: str, fn, *args, **kw):
    """Runs ``fn`` as the step ``name``: its dict result is kept; an exception
    fails the step (and the smoke) with its message."""
    t0 = time.perf_counter()
    rec = {"step": name}
    try:
      rec.update(fn(*args, **kw) or {})
      rec["ok"] = True
    except Exception as e:  # noqa: BLE001 (any failure is the step's result)
      rec.update(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
      self.ok = False
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"[smoke] {name}: {'ok' if rec['ok'] else 'FAILED'} ({rec['seconds']} s) "
          + json.dumps({k: v for k, v in rec.items() if k not in ('step', 'ok', 'seconds')})[:600],
          flush=True)
    self.steps.append(rec)
    self.write(done=False)
    return rec["ok"], rec


def run(cmd: list[str], log: pathlib.Path, timeout: float) -> subprocess.CompletedProcess:
  # Clients never take the GPU (a jax import that found it would hold most of its memory).
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  log.write_text(f"$ {shlex.join(cmd)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
  if p.returncode:
    raise RuntimeError(f"exit {p.returncode}: {p.stderr.strip()[-800:]}")
  return p


def start_server(name: str, argv: list[str], out: pathlib.Path, timeout: float):
  ready = out / f"{name}.ready.json"
  ready.unlink(missing_ok=True)
  cmd = [sys.executable, "-m", "serving", "serve", *argv, "--port", "0", "--http-port", "0",
         "--ready-file", str(ready)]
  log = open(out / f"{name}.serve.log", "w")
  log.write(f"$ {shlex.join(cmd)}\n")
  log.flush()
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  while not ready.exists():
    if proc.poll() is not None:
      tail = (out / f"{name}.serve.log").read_text()[-1500:]
      raise RuntimeError(f"serve exited {proc.returncode} before it was ready: {tail}")
    if time.perf_counter() - t0 > timeout:
      proc.kill()
      raise RuntimeError(f"serve not ready after {timeout:.0f} s")
    time.sleep(0.5)
  info = json.loads(ready.read_text())
  text = (out / f"{name}.serve.log").read_text()
  pages = re.search(r"KV cache: (\d+) pages of (\d+) tokens \(([\d.]+) GiB", text)
  warm = re.search(r"warm-up compiled .* in ([\d.]+) s", text)
  return proc, info, {
      "command": shlex.join(["python", "-m", "serving", "serve", *argv]),
      "ready_s": round(time.perf_counter() - t0, 1),
      "warmup_s": float(warm.group(1)) if warm else None,
      "kv_pages": int(pages.group(1)) if pages else None,
      "kv_gib": float(pages.group(3)) if pages else None}


def generate(target: str, out: pathlib.Path, name: str, chat: bool):
  cmd = [sys.executable, "-m", "serving", "generate", "--target", target, "--max-tokens", "32",
         "--ignore-eos", "What is the capital of France?"] + (["--chat"] if chat else [])
  p = run(cmd, out / f"{name}.log", 300)
  m = re.search(r"\[(\d+) tokens, (\w+).*time to first token ([\d.]+) ms, ([\d.]+) ms/token",
                p.stderr)
  if not m:
    raise RuntimeError(f"no summary line in: {p.stderr[-500:]}")
  n = int(m.group(1))
  if n != 32:
    raise RuntimeError(f"{n} tokens, asked for 32 with --ignore-eos")
  return {"tokens": n, "finish": m.group(2), "ttft_ms": float(m.group(3)),
          "tpot_ms": float(m.group(4))}


def loadgen(target: str, out: pathlib.Path, name: str, concurrency: int, requests: int,
            input_len: int, output_len: int):
  path = out / f"{name}.json"
  cmd = [sys.executable, "-m", "serving", "loadgen", "--target", target,
         "--concurrency", str(concurrency), "--num-requests", str(requests),
         "--input-len", str(input_len), "--output-len", str(output_len), "--json", str(path)]
  run(cmd, out / f"{name}.log", 500)
  r = json.loads(path.read_text())
  return {"concurrency": concurrency, "requests": requests, "input_len": input_len,
          "output_len": output_len, "output_tok_s": r["output_tok_s"],
          "ttft_p50_ms": r["ttft_p50_ms"], "tpot_p50_ms": r["tpot_p50_ms"],
          "itl_p50_ms": r["itl_p50_ms"]}


def _post(url: str, body: str, log: pathlib.Path) -> str:
  """curl -d BODY URL, or the same POST through urllib where curl is missing."""
  if shutil.which("curl"):
    return run(["curl", "-sS", "-N", "--fail-with-body", "-m", "120", "-H",
                "Content-Type: application/json", "-d", body, url], log, 150).stdout
  import urllib.request
  req = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=120) as r:
    text = r.read().decode()
  log.write_text(f"POST {url} (urllib: no curl here)\n{body}\n--- response\n{text}")
  return text


def curl(http_port: int, out: pathlib.Path, name: str):
  base = f"http://127.0.0.1:{http_port}"
  body = json.dumps({"prompt": "The capital of France is", "max_tokens": 16,
                     "ignore_eos": True})
  r = json.loads(_post(f"{base}/v1/completions", body, out / f"{name}_completions.log"))
  usage = r["usage"]["completion_tokens"]
  if usage != 16:
    raise RuntimeError(f"/v1/completions: {usage} completion tokens, asked for 16")
  chat = json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                     "stream": True})
  text = _post(f"{base}/v1/chat/completions", chat, out / f"{name}_chat_stream.log")
  events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
  if not events or events[-1] != "[DONE]":
    raise RuntimeError(f"chat stream did not end with [DONE]: {text[-300:]}")
  if any('"error"' in e for e in events):
    raise RuntimeError(f"chat stream carried an error: {text[-300:]}")
  return {"completion_tokens": usage, "chat_stream_events": len(events),
          "client": "curl" if shutil.which("curl") else "urllib"}


def sigterm(proc: subprocess.Popen, drain_timeout: float):
  t0 = time.perf_counter()
  proc.send_signal(signal.SIGTERM)
  try:
    rc = proc.wait(drain_timeout + 30)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise RuntimeError(f"still running {drain_timeout + 30:.0f} s after SIGTERM") from None
  if rc != 0:
    raise RuntimeError(f"exit code {rc} after SIGTERM")
  return {"exit_s": round(time.perf_counter() - t0, 2)}


def git_commit() -> str:
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return os.environ.get("SMOKE_COMMIT", "unknown")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", type=pathlib.Path,
                  default=pathlib.Path(os.environ.get("OUT", "/tmp/gpu_out")) / "smoke")
  ap.add_argument("--model", default="llama3.1-8b",
                  help="serve's --model (the embedded model's .gguf is a 98 MB download)")
  ap.add_argument("--servers", default="process,inproc",
                  help=f"server variants, of {sorted(VARIANTS)}")
  ap.add_argument("--readme-flags", default=shlex.join(README_FLAGS),
                  help="the README's serve flags (another backend where mosaic cannot run)")
  ap.add_argument("--serve-flags", default="",
                  help="more serve flags, after the README's (e.g. --compilation-cache DIR)")
  ap.add_argument("--ready-timeout", type=float, default=420.0)
  ap.add_argument("--c64", action="store_true",
                  help="also the c=64 load of bench/serving_gpu.py (512 in / 256 out, 128 "
                       "requests)")
  a = ap.parse_args()
  a.out.mkdir(parents=True, exist_ok=True)
  summary = {"commit": git_commit(), "date": datetime.datetime.now(datetime.UTC).isoformat(),
             "model": a.model, "readme_flags": a.readme_flags, "extra_flags": a.serve_flags}
  # Read without starting a jax backend here: the servers need the GPU's memory.
  import importlib.metadata
  try:
    summary["jax"] = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    summary["jax"] = "not installed"
  try:
    summary["device"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30).stdout.strip() or "no GPU"
  except (OSError, subprocess.TimeoutExpired):
    summary["device"] = "no GPU (nvidia-smi not found)"
  smoke = Smoke(a.out, summary)
  drain = 30.0
  for variant in a.servers.split(","):
    if variant not in VARIANTS:
      ap.error(f"unknown server variant {variant!r}; known: {sorted(VARIANTS)}")
    argv = ["--model", a.model, *shlex.split(a.readme_flags), *VARIANTS[variant], *shlex.split(a.serve_flags)]
    holder = {}

    def start():
      proc, info, facts = start_server(variant, argv, a.out, a.ready_timeout)
      holder.update(proc=proc, info=info)
      return facts

    ok, _ = smoke.step(f"{variant}: serve", start)
    if not ok:
      continue
    target = f"127.0.0.1:{holder['info']['port']}"
    try:
      for name, fn, args in (
          ("generate", generate, (target, a.out, f"{variant}_generate", False)),
          ("generate --chat", generate, (target, a.out, f"{variant}_generate_chat", True)),
          ("loadgen c=8", loadgen, (target, a.out, f"{variant}_loadgen_c8", 8, 16, 512, 128)),
          *((("loadgen c=64", loadgen,
              (target, a.out, f"{variant}_loadgen_c64", 64, 128, 512, 256)),) if a.c64 else ()),
          ("curl /v1", curl, (holder["info"]["http_port"], a.out, f"{variant}_curl"))):
        if not smoke.step(f"{variant}: {name}", fn, *args)[0]:
          break
    finally:
      smoke.step(f"{variant}: SIGTERM", sigterm, holder["proc"], drain)
  smoke.write(done=True)
  print(f"gpu_smoke: {'PASS' if smoke.ok else 'FAIL'} -> {a.out / 'gpu_smoke.json'}", flush=True)
  return 0 if smoke.ok else 1


if __name__ == "__main__":
  sys.exit(main())
