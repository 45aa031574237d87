"""The CLI end to end: a server process, SIGTERM drain, the generate client, loadgen."""

import http.client
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2
import pytest

from serving import engine as E
from serving.client import Client
from serving.proto import generate_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]


def serve_process(tmp_path, args: list[str]) -> tuple[subprocess.Popen, str]:
  """``python -m serving serve --model counting ...`` on loopback, once ready:
  (the process, with .http_port and .log, and its gRPC target)."""
  ready, log = tmp_path / "ready.json", tmp_path / "server.log"
  # The server's output goes to a file: a pipe nobody reads can fill and block it.
  with open(log, "w") as out:
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving", "serve", "--model", "counting", "--host", "127.0.0.1",
         "--port", "0", "--ready-file", str(ready)] + args,
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  end = time.monotonic() + 120
  while not ready.exists():
    if proc.poll() is not None or time.monotonic() > end:
      proc.kill()
      raise AssertionError(f"server did not start:\n{log.read_text()}")
    time.sleep(0.1)
  info = json.loads(ready.read_text())
  proc.http_port, proc.log = info["http_port"], log
  return proc, f"127.0.0.1:{info['port']}"


@pytest.fixture(params=[[], ["--engine-process"]], ids=["in-process", "engine-process"])
def server_proc(tmp_path, request):
  proc, target = serve_process(tmp_path, [
      "--step-delay", "0.02", "--max-batch", "4", "--enable-prompt-logprobs",
      "--http-port", "0"] + request.param)
  yield proc, target
  if proc.poll() is None:
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("extra", [[], ["--engine-process"]], ids=["in-process", "engine-process"])
def test_sigterm_past_the_drain_timeout_cancels_at_the_timeout(tmp_path, extra):
  """--drain-timeout 1 with a stream of ~20 s left: the stream ends
  UNAVAILABLE soon after the timeout (it went on for 5 s more, generating
  meanwhile), and the server exits. Idle, it ends 1.02-1.24 s after SIGTERM;
  the bound leaves room for a loaded 2-core CI machine and still fails the
  old behaviour."""
  proc, target = serve_process(tmp_path, ["--step-delay", "0.02", "--drain-timeout", "1"] + extra)
  try:
    c = Client(target)
    stream = c.stream("a", max_tokens=1000, ignore_eos=True)
    next(stream)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as e:
      for _ in stream:
        pass
    ended = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert ended < 2.5, ended
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - t0 < 4.0
    assert "Traceback" not in proc.log.read_text()
    c.close()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def test_sigterm_drains_in_flight_and_reports_not_serving(server_proc):
  proc, target = server_proc
  c = Client(target)
  assert c.health() == health_pb2.HealthCheckResponse.SERVING
  stream = c.stream("a", max_tokens=400, ignore_eos=True)  # about 8 s of steps
  first = next(stream)
  assert first.text == "b"
  proc.send_signal(signal.SIGTERM)
  end = time.monotonic() + 15  # generous: CI machines are small and busy
  while c.health() != health_pb2.HealthCheckResponse.NOT_SERVING:
    assert time.monotonic() < end, "health never turned NOT_SERVING"
    time.sleep(0.02)
  with pytest.raises(grpc.RpcError) as e:
    c.generate("a", max_tokens=2)
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE
  rest = list(stream)
  assert rest[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
  assert rest[-1].final.usage.completion_tokens == 400
  ids = list(first.token_ids) + [i for ch in rest for i in ch.token_ids]
  assert ids[:29] == list(range(ord("b"), ord("~") + 1)) and len(ids) == 400
  assert proc.wait(timeout=20) == 0
  c.close()


_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}


@pytest.mark.skipif(not sys.platform.startswith("linux") or
                    os.uname().machine not in _SYS_TGKILL, reason="tgkill is Linux's")
def test_sigterm_taken_by_another_thread_still_drains(server_proc):
  # The kernel may deliver a process's SIGTERM to any of its threads; Python
  # runs the handler in the main thread, which must not sleep through it.
  import ctypes

  proc, target = server_proc
  c = Client(target)
  stream = c.stream("a", max_tokens=400, ignore_eos=True)
  next(stream)
  tid = max(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
  libc = ctypes.CDLL(None, use_errno=True)
  assert libc.syscall(_SYS_TGKILL[os.uname().machine], proc.pid, tid, signal.SIGTERM) == 0
  end = time.monotonic() + 15
  while c.health() != health_pb2.HealthCheckResponse.NOT_SERVING:
    assert time.monotonic() < end, "health never turned NOT_SERVING"
    time.sleep(0.02)
  assert list(stream)[-1].final.usage.completion_tokens == 400
  assert proc.wait(timeout=20) == 0
  c.close()


def test_generate_and_loadgen_commands(server_proc, tmp_path):
  proc, target = server_proc
  # serve --http-port: OpenAI-compatible chat completions beside gRPC.
  conn = http.client.HTTPConnection("127.0.0.1", proc.http_port, timeout=60)
  conn.request("POST", "/v1/chat/completions", body=json.dumps(
      {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
       "logprobs": True}))
  r = json.loads(conn.getresponse().read())
  conn.close()
  assert r["choices"][0]["message"]["content"] == '!"#', r
  assert [x["token"] for x in r["choices"][0]["logprobs"]["content"]] == ["!", '"', "#"]
  out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", target,
                        "hello a", "--max-tokens", "5"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "bcdef"
  assert "time to first token" in out.stderr and "5 tokens" in out.stderr
  out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", target,
                        "hello a", "--max-tokens", "3", "--n", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  header = "--- completion 1 (3 tokens, FINISH_REASON_LENGTH) ---"
  assert out.stdout.split("\n")[:3] == ["bcd", header, "bcd"], out.stdout
  out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", target,
                        "hello a", "--max-tokens", "3", "--logit-bias", f"{ord('c')}=100"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ccc", (out.stdout, out.stderr)
  out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", target,
                        "hello a", "--stop", "de"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "bc", (out.stdout, out.stderr)
  assert "FINISH_REASON_STOP (stop_string 'de')" in out.stderr, out.stderr
  out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", target,
                        "abcx", "--max-tokens", "2", "--prompt-logprobs", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "yz", (out.stdout, out.stderr)
  # After BOS: "b" and "c" follow their bytes (logprob ~0), "a" and "x" do not (~-20).
  assert "prompt logprobs (4 tokens, sum -40.0000)" in out.stderr, out.stderr
  assert f"{ord('c'):>8} {-0.0:10.4f}   [{ord('c')}: -0.0000]" in out.stderr, out.stderr
  out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", target,
                        "hello a", "--max-tokens", "3", "--logprobs", "--top-logprobs", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "bcd", (out.stdout, out.stderr)
  # The counting model is sure of each next byte: logprob ~0, its top-1 itself.
  assert out.stderr.startswith("logprobs (3 tokens, sum -0.0000):"), out.stderr
  assert f"{ord('d'):>8} {-0.0:10.4f}   [{ord('d')}: -0.0000, " in out.stderr, out.stderr
  out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", target,
                        "hi", "--system", "be brief", "--max-tokens", "5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == '!"#$%', (out.stdout, out.stderr)
  schema = tmp_path / "schema.json"
  schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
                    '"required": ["ok"], "additionalProperties": false}')
  for flags, want in ((["--regex", "[b-d]+0"], "bcd0"),
                      (["--json-schema", f"@{schema}"], '{"ok":false}')):
    out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", target,
                          "a", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == want, (out.stdout, out.stderr)
  # The server's refusal is one line naming its status, not a traceback; so is no server.
  for t, flags, want in ((target, ["--temperature", "-1"], "generate: INVALID_ARGUMENT: "),
                         ("127.0.0.1:1", [], "generate: UNAVAILABLE: ")):
    out = subprocess.run([sys.executable, "-m", "serving", "generate", "--target", t, "a",
                          *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.startswith(want), out.stderr
    assert "Traceback" not in out.stderr
  js = tmp_path / "load.json"
  out = subprocess.run([sys.executable, "-m", "serving", "loadgen", "--target", target,
                        "--concurrency", "4", "--num-requests", "8", "--input-len", "8",
                        "--output-len", "6", "--byte-prompts", "--json", str(js)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  r = json.loads(js.read_text())
  assert r["output_tokens"] == 48 and r["ttft_p50_ms"] > 0 and r["output_tok_s"] > 0
  assert "ttft" in out.stdout


def _never_start(self):
  raise AssertionError("the server started: the flag was taken")


@pytest.mark.parametrize("flag, value, field", [
    ("--stream-interval", "0", "--stream-interval 0 must be >= 1"),
    ("--decode-steps", "0", "--decode-steps 0 must be >= 1"),
    ("--max-batch", "-1", "--max-batch -1 must be >= 1"),
    ("--max-seq-len", "0", "--max-seq-len 0 must be >= 1"),
    ("--page-size", "0", "page_size=0"),
    ("--max-seq-len", "1025", "max_seq_len=1025 is more than the 1024 tokens"),
    # (EngineConfig's errors name the flags, not its fields)
    ("--max-num-batched-tokens", "0", "--max-num-batched-tokens 0 must be >= --max-batch 64"),
    ("--token-budget", "4", "--max-num-batched-tokens 4 must be >= --max-batch 64"),
    ("--prefill-chunk", "0", "--prefill-chunk 0 must be >= 1"),
    ("--matmul-backend", "xla", "the counting model has no matmul backend option"),
    ("--dtype", "bfloat16", "the counting model has no dtype option"),
    ("--num-pages", "0", "num_pages=0 must be >= 2"),
    ("--step-delay", "-1", "step_delay=-1.0: seconds >= 0"),
    ("--tls-cert", "/nonexistent/cert.pem", "TLS: /nonexistent/cert.pem: No such file")])
def test_serve_refuses_bad_engine_flags_with_a_message(flag, value, field, monkeypatch):
  from serving import cli
  from serving.service import Server

  monkeypatch.setattr(Server, "start", _never_start)  # a taken flag fails, never serves
  with pytest.raises(SystemExit) as e:
    cli.main(["serve", "--model", "counting", "--no-warmup", flag, value,
              *(["--tls-key", value] if flag == "--tls-cert" else [])])
  assert str(e.value).startswith("serve: ") and field in str(e.value)


def test_serve_refuses_a_step_delay_the_model_would_not_take(monkeypatch):
  """--step-delay is the counting model's: another model would run at full
  speed with the flag taken and ignored."""
  from serving import cli
  from serving.service import Server

  monkeypatch.setattr(Server, "start", _never_start)
  with pytest.raises(SystemExit) as e:
    cli.main(["serve", "--model", "toy", "--no-warmup", "--step-delay", "0.5"])
  assert str(e.value) == "serve: step_delay=0.5: seconds >= 0, for the counting model only"


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "argument --seed: '-1' is not an integer in 0..18446744073709551615"),
    (["--max-tokens", str(2**31)], "argument --max-tokens: '2147483648' is not an integer in"),
    (["--allowed-token-ids", f"1,{2**40}"], "is not a comma-separated list of ids"),
    (["--logit-bias", f"{2**40}=1"], "is not TOKEN_ID=BIAS"),
    (["--top-logprobs", "2"], "--top-logprobs 2 needs --logprobs")])
def test_generate_refuses_numbers_the_request_cannot_carry(flags, message, capsys):
  """A value outside its proto field's type is a usage error (protobuf would
  raise while building the request); values the field holds are the server's
  to judge."""
  from serving import cli

  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--target", "127.0.0.1:1", *flags, "a"])
  assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port", "--port"])
def test_serve_reports_a_taken_http_port_before_the_warm_up(flag, monkeypatch):
  """One line naming the address, for the gRPC port too (grpcio's bind
  error was a traceback)."""
  import socket

  from serving import cli
  from serving.service import Server

  monkeypatch.setattr(Server, "start", _never_start)
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(SystemExit) as e:
      cli.main(["serve", "--model", "counting", "--no-warmup", "--port", "0", flag, str(port)])
  assert str(e.value).startswith("serve: cannot serve ") and f"127.0.0.1:{port}" in str(e.value)


def test_serve_refuses_a_negative_drain_timeout(capsys, monkeypatch):
  from serving import cli
  from serving.service import Server

  monkeypatch.setattr(Server, "start", _never_start)
  with pytest.raises(SystemExit) as e:
    cli.main(["serve", "--model", "counting", "--no-warmup", "--drain-timeout", "-1"])
  assert e.value.code == 2 and "'-1' is not a number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--http-port"])
def test_serve_refuses_a_port_outside_0_65535(flag, capsys, monkeypatch):
  """gRPC would bind 70000 as 70000 % 65536 = 4464: refused before anything loads."""
  from serving import cli
  from serving.service import Server

  monkeypatch.setattr(Server, "start", _never_start)
  for bad in ("70000", "-1", "http"):
    with pytest.raises(SystemExit) as e:
      cli.main(["serve", "--model", "counting", "--no-warmup", flag, bad])
    assert e.value.code == 2 and "is not a port in 0..65535" in capsys.readouterr().err
  field = flag[2:].replace("-", "_")
  with pytest.raises(ValueError, match=f"{field}=70000 must be in 0..65535"):
    Server(E.tiny_engine(), **{field: 70000})


@pytest.mark.parametrize("flag, bad, message", [
    ("--range-ratio", "1", "--range-ratio must be in [0, 1)"),
    ("--range-ratio", "-0.5", "--range-ratio must be in [0, 1)"),
    ("--concurrency", "0", "is not an integer >= 1"),
    ("--num-requests", "0", "is not an integer >= 1"),
    ("--input-len", "-2", "is not an integer >= 1"),
    ("--output-len", "x", "is not an integer >= 1"),
    ("--prefix-groups", "0", "is not an integer >= 1"),
    ("--shared-prefix-len", "-1", "is not an integer >= 0"),
    ("--rate", "0", "is not a number > 0"), ("--rate", "nan", "is not a number > 0"),
    # Flags that would be dropped: a rate beside a concurrency, groups of no prefix.
    ("--rate", "2", "--concurrency 4 and --rate 2: give one of them"),
    ("--prefix-groups", "3", "--prefix-groups 3 needs --shared-prefix-len")])
def test_loadgen_refuses_bad_counts_before_connecting(flag, bad, message, capsys):
  from serving import cli

  with pytest.raises(SystemExit) as e:
    cli.main(["loadgen", "--target", "127.0.0.1:1", flag, bad,
              *(["--concurrency", "4"] if message.startswith("--concurrency") else [])])
  assert e.value.code == 2  # argparse's usage error, before any connection
  err = capsys.readouterr().err
  assert message in err and "usage: python -m serving loadgen" in err, err  # (its own usage)


def test_serve_kv_cache_dtype_flag():
  from serving import cli

  a = cli.parser().parse_args(["serve", "--model", "tiny", "--no-warmup", "--num-pages", "16",
                               "--page-size", "8", "--kv-cache-dtype", "fp8"])
  assert cli.build_engine(a).runner.cache.k.dtype.name == "float8_e4m3fn"
  a = cli.parser().parse_args(["serve", "--model", "tiny", "--no-warmup", "--num-pages", "16",
                               "--page-size", "8"])
  from models.model import default_dtype  # float32 on the CPU, bfloat16 on a GPU

  assert cli.build_engine(a).runner.cache.k.dtype.name == default_dtype()
  with pytest.raises(SystemExit):
    cli.parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


def test_serve_sizes_the_kv_cache_from_device_memory(monkeypatch):
  # Without --num-pages the cache takes what --gpu-memory-utilization of the
  # device leaves beside what it holds: checked against the cache actually
  # allocated (its bytes fit, one page more would not), at two fractions and
  # with fp8 pages (half the bytes, twice the pages).
  from serving import cli

  limit, held = 256 * 2**20, 64 * 2**20
  monkeypatch.setattr(E, "_memory_stats", lambda: {"bytes_limit": limit, "bytes_in_use": held})
  pages = {}
  for frac, kv in (("0.8", "auto"), ("0.5", "auto"), ("0.5", "fp8")):
    a = cli.parser().parse_args(["serve", "--model", "tiny", "--no-warmup", "--page-size", "8",
                                 "--gpu-memory-utilization", frac, "--kv-cache-dtype", kv,
                                 "--dtype", "bfloat16"])
    runner = cli.build_engine(a).runner
    c = runner.cache
    page_bytes = (c.k.nbytes + c.v.nbytes) // c.num_pages
    room = float(frac) * limit - held
    assert c.num_pages == runner.num_pages >= 2
    assert c.num_pages * page_bytes <= room < (c.num_pages + 1) * page_bytes
    pages[frac, kv] = c.num_pages
  assert pages["0.8", "auto"] > pages["0.5", "auto"]
  assert abs(pages["0.5", "fp8"] - 2 * pages["0.5", "auto"]) <= 1
  # No room: a clear error; no memory stats (the CPU): the default count, and
  # a fraction given there is refused (it would size nothing).
  a = cli.parser().parse_args(["serve", "--model", "tiny", "--no-warmup",
                               "--gpu-memory-utilization", "0.2"])
  with pytest.raises(ValueError, match="no room for a KV cache"):
    cli.build_engine(a)
  monkeypatch.setattr(E, "_memory_stats", lambda: None)
  with pytest.raises(ValueError, match="gpu_memory_utilization=0.2: .*no memory limit"):
    cli.build_engine(a)
  a = cli.parser().parse_args(["serve", "--model", "tiny", "--no-warmup"])
  assert cli.build_engine(a).runner.num_pages == E.DEFAULT_NUM_PAGES
  with pytest.raises(ValueError, match="gpu_memory_utilization"):
    E.kv_pages({"bytes_limit": limit}, 1, 1.5)
  with pytest.raises(SystemExit) as e:  # a usage error before anything loads
    cli.main(["serve", "--model", "tiny", "--gpu-memory-utilization", "0"])
  assert e.value.code == 2
  # A fraction beside a page count, or for a model without a device cache,
  # would size nothing: refused, naming it.
  for flags in (["--model", "tiny", "--num-pages", "64"], ["--model", "toy"]):
    a = cli.parser().parse_args(["serve", *flags, "--no-warmup",
                                 "--gpu-memory-utilization", "0.5"])
    with pytest.raises(ValueError, match="(?i)gpu.memory.utilization"):
      cli.build_engine(a)


_BUILD = """
import sys
from serving import cli
a = cli.parser().parse_args(["serve", "--model", "tiny", "--num-pages", "16", "--max-batch", "2",
                             "--compilation-cache", sys.argv[1]])
engine = cli.build_engine(a)  # warms up: compiles every step shape
"""


def test_compilation_cache_keeps_the_warmup_for_a_restart(tmp_path):
  # In child processes: the cache setting is process-wide in jax.
  cache = tmp_path / "cache"
  build = lambda: subprocess.run([sys.executable, "-c", _BUILD, str(cache)], cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
                                 capture_output=True, text=True, timeout=300)
  build()
  first = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
  assert len(first) >= 3, "the warm-up's steps were not cached"
  build()  # the restart finds every step it compiles in the cache: nothing is written
  assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == first


def test_compilation_cache_that_is_not_a_directory_is_refused(tmp_path):
  from serving import cli

  (tmp_path / "file").write_text("")
  with pytest.raises(SystemExit, match="serve: --compilation-cache"):
    cli.use_compilation_cache(tmp_path / "file" / "cache")


def test_serve_decode_unroll_flag():
  from serving import cli

  def built(*flags):
    a = cli.parser().parse_args(["serve", "--model", "tiny", "--no-warmup", "--num-pages", "16",
                                 "--page-size", "8", *flags])
    return cli.build_engine(a).runner.model

  assert built().graphdef != built("--decode-unroll", "1").graphdef
  assert built("--decode-unroll", "1").graphdef == built("--decode-unroll", "1").graphdef
  with pytest.raises(SystemExit, match="serve: --decode-unroll 0"):
    cli.main(["serve", "--model", "tiny", "--no-warmup", "--decode-unroll", "0"])
  for where in ([], ["--engine-process"]):  # built here, or in the engine's own process
    with pytest.raises(SystemExit, match="serve: .*counting model has no decode_unroll"):
      cli.main(["serve", "--model", "counting", "--no-warmup", "--decode-unroll", "2", *where])


def test_serve_compile_threads_default_is_one_per_core_up_to_8(monkeypatch):
  from serving import cli
  from serving.engine import config as config_lib

  cfg = lambda *flags: cli._engine_config(cli.parser().parse_args(["serve", *flags]))
  for cores, want in ((None, 1), (2, 2), (16, 8)):
    monkeypatch.setattr(config_lib.os, "cpu_count", lambda c=cores: c)
    assert cfg()["compile_threads"] == want
  assert cfg("--compile-threads", "3")["compile_threads"] == 3  # a given value is kept
  with pytest.raises(SystemExit, match="--compile-threads 0 must be >= 1"):
    cfg("--compile-threads", "0")


def test_serve_token_budget_flag_has_vllms_name_and_the_old_one():
  from serving import cli

  cfg = lambda *flags: cli._engine_config(cli.parser().parse_args(["serve", *flags]))
  assert "token_budget" not in cfg()  # the engine's default (max_batch + prefill_chunk)
  assert cfg("--max-num-batched-tokens", "300")["token_budget"] == 300
  assert cfg("--token-budget", "301")["token_budget"] == 301


def test_serve_speculation_flags_reach_the_engine_config():
  from serving import cli

  cfg = lambda *flags: cli._engine_config(cli.parser().parse_args(["serve", *flags]))
  assert cfg()["num_speculative_tokens"] == 0  # off unless asked for
  got = cfg("--num-speculative-tokens", "4", "--prompt-lookup-max", "5",
            "--prompt-lookup-min", "2", "--speculative-max-batch", "2",
            "--speculative-patience", "0")
  assert (got["num_speculative_tokens"], got["prompt_lookup_max"], got["prompt_lookup_min"],
          got["speculative_max_batch"], got["speculative_patience"]) == (4, 5, 2, 2, 0)
  with pytest.raises(SystemExit, match="serve: --speculative-patience -1 must be >= 0"):
    cfg("--num-speculative-tokens", "4", "--speculative-patience", "-1")
  with pytest.raises(SystemExit, match="serve: --prompt-lookup-max 1 must be >= --prompt-lookup-min 2"):
    cfg("--num-speculative-tokens", "4", "--prompt-lookup-max", "1", "--prompt-lookup-min", "2")
  # Each sets how drafts are made: without speculation it would change
  # nothing, so it is refused by name, the default's value too.
  for flag, value in (("--prompt-lookup-max", "3"), ("--prompt-lookup-min", "2"),
                      ("--speculative-max-batch", "8"), ("--speculative-patience", "0")):
    with pytest.raises(SystemExit, match=f"serve: {flag} .*needs --num-speculative-tokens"):
      cfg(flag, value)
    with pytest.raises(SystemExit, match=f"serve: {flag} "):
      cfg("--num-speculative-tokens", "0", flag, value)


def test_help_lists_every_command_and_shows_the_defaults():
  """``python -m serving --help`` names every command with its line;
  each command's --help ends an option's help with its default."""
  from serving import cli

  def help_of(*args):
    out = subprocess.run([sys.executable, "-m", "serving", *args, "--help"], cwd=ROOT,
                         env={**os.environ, "COLUMNS": "1000"}, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    entries = {}  # an option or command's first word -> its whole entry on one line
    for line in out.splitlines():
      if re.match(r" {2,4}\S", line):
        key = line.split()[0]
        entries[key] = " ".join(line.split())
      elif line.startswith(" " * 6) and entries:
        entries[key] += " " + " ".join(line.split())
    return entries

  top = help_of()
  for name, line in cli.COMMANDS.items():
    assert top.get(name) == f"{name} {line}", (name, top.get(name))
  subcommands = next(a for a in cli.parser()._actions if a.dest == "cmd").choices
  assert set(subcommands) == set(cli.COMMANDS)
  serve = help_of("serve")
  assert serve["--port"].endswith("(default: 50051)") and serve["--max-batch"].endswith(
      "(default: 64)")
  assert "(default: 256)" in serve["--default-max-tokens"]
  generate = help_of("generate")
  assert "(default: 127.0.0.1:50051)" in generate["--target"]
  assert "--default-max-tokens" in generate["--max-tokens"]


def test_client_and_serve_flags_that_would_do_nothing_or_fail_late_are_refused_first(
    tmp_path, monkeypatch, capsys):
  """Each ends in one line naming the flag, before a model loads or a call
  is made: a server name with no CA to check it against (it was ignored), a
  missing CA file, a deadline <= 0, a ready file in no directory (it failed
  after the warm-up), compile threads with no warm-up (ignored). Ctrl-C in
  generate exits 130 without a traceback."""
  from serving import cli

  def refused(argv, match):
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    said = str(e.value.code) if not isinstance(e.value.code, int) else capsys.readouterr().err
    assert e.value.code != 0 and re.search(match, said), (argv, said)

  target = ["--target", "127.0.0.1:1"]
  refused(["generate", *target, "hi", "--tls-server-name", "x"], "--tls-server-name .*--tls-ca")
  refused(["generate", *target, "hi", "--tls-ca", str(tmp_path / "none.pem")],
          "generate: --tls-ca .*none.pem: No such file")
  refused(["loadgen", *target, "--tls-ca", str(tmp_path / "none.pem")], "loadgen: --tls-ca")
  refused(["generate", *target, "hi", "--timeout", "-1"], "--timeout -1: seconds > 0")
  refused(["serve", "--model", "counting", "--ready-file", str(tmp_path / "no" / "r.json")],
          "--ready-file .* is not a directory")
  # (it was a traceback after the whole load, its results lost)
  refused(["loadgen", *target, "--json", str(tmp_path / "no" / "r.json")],
          "python -m serving loadgen: error: --json .* is not a directory")
  refused(["serve", "--model", "counting", "--no-warmup", "--compile-threads", "4"],
          "--compile-threads 4 .* nothing with --no-warmup")
  # A chunk below the smallest bucket (16) is a chunk, not an error about
  # min_chunk, which is no flag.
  cfg = cli._engine_config(cli.parser().parse_args(["serve", "--prefill-chunk", "8"]))
  assert (cfg["prefill_chunk"], cfg["min_chunk"]) == (8, 8)

  def interrupted(a):
    raise KeyboardInterrupt

  monkeypatch.setattr(cli, "cmd_generate", interrupted)
  assert cli.main(["generate", *target, "hi"]) == 130


def test_serve_quantization_flag():
  # --quantization fp8 loads W8A8 linears and serves them: the engine's
  # greedy tokens come from the quantized weights (checked against the
  # model's own fp8 forward), and the flag is refused where it cannot apply.
  import numpy as np

  from serving import cli

  a = cli.parser().parse_args(["serve", "--model", "tiny", "--no-warmup", "--num-pages", "16",
                               "--page-size", "8", "--quantization", "fp8"])
  engine = cli.build_engine(a)
  model = engine.runner.model
  assert model.quantization == "fp8"
  wq = model.params["layers"]["mlp"]["w_down"]["w_q"][...]
  assert wq.dtype.name == "float8_e4m3fn"
  from serving.engine import api

  prompt = [5, 17, 42, 99, 7]
  handle = engine.submit(api.Request("q", prompt_ids=prompt, add_bos=False,
                                     sampling=api.SamplingParams(max_tokens=3, ignore_eos=True)))
  while engine.step():
    pass
  ids = []
  while not handle.events.empty():
    ev = handle.events.get_nowait()
    assert not isinstance(ev, api.Failed), ev
    if isinstance(ev, api.Delta):
      ids.extend(ev.token_ids)
  assert len(ids) == 3
  cache = model.init_cache(4, 8)
  logits, _ = model.prefill(cache, np.asarray([prompt]), [0], [len(prompt)], [[1, 2]])
  assert ids[0] == int(np.argmax(np.asarray(logits)[0]))
  with pytest.raises(ValueError, match="no quantization option"):
    cli.build_engine(cli.parser().parse_args(["serve", "--no-warmup", "--model", "toy",
                                              "--quantization", "fp8"]))
  with pytest.raises(SystemExit):
    cli.parser().parse_args(["serve", "--quantization", "int4"])
