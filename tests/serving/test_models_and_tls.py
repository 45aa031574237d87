"""The engine over the real models package, and the server over TLS."""

import http.client
import json
import pathlib
import shutil
import ssl
import subprocess

import grpc
import pytest

from serving import engine as E
from serving.client import Client
from serving.service import Server

from tests.serving.conftest import running


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_models_tiny_through_the_server_equals_models_generate(decode_steps):
  models = pytest.importorskip("models")
  model = models.load("tiny", dtype="float32")
  prompt = [5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 2 chunks
  want = list(models.generate(model, prompt, 8))[-8:]
  runner = E.ModelRunner(model, num_pages=32, page_size=8)
  engine = E.BatchingEngine(runner, E.EngineConfig(
      max_batch=4, batch_buckets=(4,), prefill_rows=1, min_chunk=16, prefill_chunk=16,
      max_seq_len=128, warmup=True, decode_steps=decode_steps))
  with running(engine) as (server, c):
    assert runner._fast is not None
    compiled = engine.counters()["compiled_shapes"]
    # prefill packed (the default: the tiny model's attention takes segment
    # ids), fresh and continued at each page-table width (1, 4, 16 pages), so no
    # row-layout prefill; decode; decode_steps steps in one call (greedy, greedy
    # with logprobs, sampled); no mixed step (mixed_steps off), no scored
    # prefill (prompt_logprobs off)
    assert engine.packed and engine.table_buckets == (1, 4, 16)
    assert compiled == {"prefill": 0, "decode": 1,
                        "decode_multi_step": 3 if decode_steps > 1 else 0, "mixed": 0,
                        "prefill_packed": 4, "prefill_scores": 0,
                        "check_prefill": 0, "check_decode": 0, "mixed_packed": 0}
    assert c.model_info().model_name == model.config.name
    got = [list(c.generate(prompt, max_tokens=8, ignore_eos=True).token_ids) for _ in range(2)]
    assert got == [want, want]
    if decode_steps > 1:  # 8 tokens: the first from prefill, then steps of 3 (the last cut)
      assert engine.steps < 2 * 8
      # Seeded sampling with penalties draws, 3 steps per call, what one step at a time draws.
      kw = dict(temperature=0.9, top_p=0.9, seed=11, max_tokens=7, presence_penalty=0.5,
                logprobs=True, ignore_eos=True)
      multi = c.generate(prompt, **kw)
      one = E.BatchingEngine(E.ModelRunner(model, num_pages=32, page_size=8), E.EngineConfig(
          max_batch=4, batch_buckets=(4,), prefill_rows=1, min_chunk=16, prefill_chunk=16,
          max_seq_len=128, warmup=False))
      with running(one) as (_, c1):
        single = c1.generate(prompt, **kw)
      assert list(multi.token_ids) == list(single.token_ids)
      assert [round(x.logprob, 4) for x in multi.logprobs] == [
          round(x.logprob, 4) for x in single.logprobs]
      assert engine.counters()["compiled_shapes"] == compiled  # the sampled steps too
    assert engine.stats().pages_in_use == 0
    assert engine.counters()["compiled_shapes"] == compiled  # steady state: no compiles


def test_warmup_compiles_on_threads_and_then_runs_without_compiling():
  # compile_threads=2: a first pass lowers each step and compiles it on the
  # threads without running it; the second pass runs every shape from those
  # executables (no backend compile at all) and serving compiles nothing more.
  jax = pytest.importorskip("jax")
  models = pytest.importorskip("models")
  model = models.load("tiny", dtype="float32")
  prompt = [5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 2 chunks
  runner = E.ModelRunner(model, num_pages=32, page_size=8)
  engine = E.BatchingEngine(runner, E.EngineConfig(
      max_batch=4, batch_buckets=(4,), prefill_rows=1, min_chunk=16, prefill_chunk=16,
      max_seq_len=128, warmup=True, decode_steps=3, compile_threads=2, prompt_logprobs=True))
  compiles, marks = [], []
  def listener(event, secs, **kw):
    if "backend_compile" in event:
      compiles.append(event)
  warm_calls = engine._warm_calls

  def counted():
    marks.append(len(compiles))
    out = warm_calls()
    marks.append(len(compiles))
    return out

  engine._warm_calls = counted
  want = list(models.generate(model, prompt, 8))[-8:]
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    with running(engine) as (server, c):
      # The first pass's compiles finish on the pool: count them up to the
      # second pass's start, by when the warm-up has waited for them all.
      assert len(marks) == 4, marks
      per_pass = [marks[2] - marks[0], marks[3] - marks[2]]
      assert per_pass[0] >= 8 and per_pass[1] == 0, per_pass
      compiled = engine.counters()["compiled_shapes"]
      # prefill_scores: a chunk of one row, fresh and continued at 3 table
      # widths; other prefills packed (the default), as many.
      assert compiled == {"prefill": 0, "decode": 1, "decode_multi_step": 3, "mixed": 0,
                          "prefill_packed": 4, "prefill_scores": 4,
                          "check_prefill": 0, "check_decode": 0, "mixed_packed": 0}
      got = [list(c.generate(prompt, max_tokens=n, ignore_eos=True).token_ids) for n in (8, 5)]
      assert got == [want, want[:5]]
      # Sampled, with and without logprobs: the variants the warm-up compiled.
      for lp in (False, True):
        c.generate(prompt, max_tokens=7, ignore_eos=True, temperature=0.8, seed=1, logprobs=lp)
      # The prompt scored in two chunks (16, then 2 over the cache).
      r = c.generate(prompt, max_tokens=5, ignore_eos=True, prompt_logprobs=2)
      assert [x.token_id for x in r.prompt_logprobs] == prompt[1:]
      assert list(r.token_ids) == want[:5]
      counters = engine.counters()
      assert counters["compiled_shapes"] == compiled
      # Nothing at all compiled while serving: not a step, not sampling.
      assert counters["compiles_after_start"] == 0, counters
      assert all(t.compiles == 0 for t in engine.step_times)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  with pytest.raises(ValueError, match="compile_threads"):
    E.EngineConfig(compile_threads=0)


def test_compiles_after_start_are_counted_and_pinned_to_their_iteration():
  # Without warm-up the first requests compile: the counters and the step
  # records say so (what bench/serving_gpu.py reports after a load).
  models = pytest.importorskip("models")
  model = models.load("tiny", dtype="float32")
  engine = E.BatchingEngine(E.ModelRunner(model, num_pages=32, page_size=8), E.EngineConfig(
      max_batch=4, batch_buckets=(4,), prefill_rows=1, min_chunk=16, prefill_chunk=16,
      max_seq_len=128, warmup=False, decode_steps=3))
  with running(engine) as (server, c):
    c.generate([5, 17, 99], max_tokens=6, ignore_eos=True)
    counters = engine.counters()
    assert counters["compiles_after_start"] > 0 and counters["compile_s_after_start"] > 0
    compiling = [t for t in engine.step_times if t.compiles]
    assert compiling and sum(t.compiles for t in engine.step_times) <= (
        counters["compiles_after_start"])
    # and Prometheus's counter of them (the server observes every step)
    assert server.metrics.sample("compiles_total") == sum(t.compiles for t in engine.step_times)


def test_fp8_kv_cache_through_the_server():
  # --kv-cache-dtype fp8: a cache of half the bytes, prompts in two chunks
  # (the second reads the first's fp8 pages), decode on fp8 pages, multi-step
  # decode; every page comes back. With random tiny weights greedy tokens may
  # differ from a bf16 cache's, so the check is: the same with the same cache,
  # and close logprobs to the bf16 cache's first token.
  models = pytest.importorskip("models")
  model = models.load("tiny", dtype="bfloat16")
  prompt = [5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]

  def engine(kv, warmup=False):
    runner = E.ModelRunner(model, num_pages=32, page_size=8, kv_cache_dtype=kv)
    return runner, E.BatchingEngine(runner, E.EngineConfig(
        max_batch=4, batch_buckets=(4,), prefill_rows=1, min_chunk=16, prefill_chunk=16,
        max_seq_len=128, warmup=warmup, decode_steps=3))

  runner, eng = engine("float8_e4m3fn", warmup=True)
  assert runner.cache.k.dtype.name == "float8_e4m3fn" and runner.dtype == "bfloat16"
  assert runner.cache.k.nbytes * 2 == model.init_cache(32, 8).k.nbytes
  with running(eng) as (_, c):
    compiled = eng.counters()["compiled_shapes"]
    a = c.generate(prompt, max_tokens=6, ignore_eos=True, logprobs=True)
    b = c.generate(prompt, max_tokens=6, ignore_eos=True, logprobs=True)
    assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 6
    assert eng.stats().pages_in_use == 0
    assert eng.counters()["compiled_shapes"] == compiled  # warm-up covered the fp8 cache
  _, ref = engine(None)
  with running(ref) as (_, c):
    r = c.generate(prompt, max_tokens=1, ignore_eos=True, logprobs=True)
  # The first token comes from the prefill, whose second chunk read fp8 pages.
  assert a.token_ids[0] == r.token_ids[0]
  assert abs(a.logprobs[0].logprob - r.logprobs[0].logprob) < 0.1
  with pytest.raises(ValueError, match="no KV cache dtype option"):
    E.model_engine("toy", kv_cache_dtype="float8_e4m3fn")


def test_a_backend_chosen_by_name_that_cannot_serve_is_refused_at_start():
  # A backend chosen by name never falls back, so one that cannot run a call
  # the engine makes would fail the first request needing it (cuDNN: every
  # prompt chunk over cached tokens; on the CPU, every call). The engine is
  # refused at start, naming the op, the backend and the call.
  from serving import cli

  kw = dict(dtype="float32", num_pages=32, warmup=False, max_batch=2, prefill_chunk=16,
            max_seq_len=64)
  with pytest.raises(ValueError, match="attention_prefill backend 'cudnn' cannot run a"):
    E.model_engine("tiny", attention="cudnn", page_size=8, **kw)
  # Triton's decode kernel takes pages of 16 tokens or more.
  with pytest.raises(ValueError, match="attention_decode backend 'triton' cannot run a decode "
                                       "step: page size"):
    E.model_engine("tiny", decode_attention="triton", page_size=8, **kw)
  # The fp8 prefill attention takes head dim 128 only (tiny's is 64).
  with pytest.raises(ValueError, match="attention_prefill backend 'mosaic_fp8' cannot run a "
                                       "fresh prompt chunk: head dim 64"):
    E.model_engine("tiny", attention="mosaic_fp8", page_size=8, **dict(kw, dtype="bfloat16"))
  with pytest.raises(SystemExit, match="serve: attention_prefill backend 'cudnn'"):
    cli.cmd_serve(cli.parser().parse_args(["serve", "--model", "tiny", "--no-warmup",
                                           "--attention-backend", "cudnn"]))
  # The matmul named: every projection at its own shapes. mosaic's matmul
  # takes 16-bit inputs (this float32 model), and its fp8 kernel K in whole
  # 128-byte blocks (an MLP of 192 features: the down projection's K).
  with pytest.raises(ValueError, match="matmul backend 'mosaic' cannot run the qkv projection"):
    E.model_engine("tiny", matmul="mosaic", page_size=8, **kw)
  import models
  from models import model as model_lib
  from serving.engine.runners import ModelRunner

  cfg = models.config.get("tiny").replace(intermediate_size=192)
  fp8 = models.Model(cfg, model_lib.random_params(cfg), models.tokenizer.ByteTokenizer(),
                     dtype="bfloat16", quantization="fp8")
  why = ModelRunner(fp8, num_pages=8, page_size=8, matmul="mosaic").backends_why_not
  assert why.startswith("matmul_fp8 backend 'mosaic' cannot run the down projection (192 -> "
                        "128): K=192 must be a multiple of 128"), why
  assert ModelRunner(fp8, num_pages=8, page_size=8, matmul="xla").backends_why_not is None
  # The ones that can serve here still start, and a prompt over two chunks
  # (the second over the first's cached tokens) runs on the backend named.
  for name in ("xla", "reference"):
    eng = E.model_engine("tiny", attention=name, page_size=8, **kw)
    assert eng.info.backends["attention_prefill"] == name
    with running(eng) as (_, c):
      out = c.generate(list(range(3, 40)), max_tokens=3, ignore_eos=True)
      assert len(out.token_ids) == 3


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(tmp_path: pathlib.Path):
  key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                  "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                  "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                 check=True, capture_output=True)
  # serve with the files swapped: one line naming them, before the model
  # loads (gRPC's bind failure said "is the port taken?").
  from serving import cli

  with pytest.raises(SystemExit, match="--tls-cert .*key.pem and --tls-key .*cert.pem are not"):
    cli.cmd_serve(cli.parser().parse_args(["serve", "--model", "counting", "--port", "0",
                                           "--tls-cert", str(key), "--tls-key", str(cert)]))
  server = Server(E.tiny_engine(), port=0, tls=(cert.read_bytes(), key.read_bytes()),
                  http_port=0).start()
  try:
    with Client(f"localhost:{server.port}", tls_ca=cert.read_bytes()) as c:
      assert c.generate("a", max_tokens=3).text == "bcd"
    # The OpenAI endpoints speak HTTPS with the same certificate, and only that.
    port = server.openai_http.server_port
    body = json.dumps({"prompt": "a", "max_tokens": 3, "temperature": 0})
    https = http.client.HTTPSConnection(
        "localhost", port, timeout=30, context=ssl.create_default_context(cafile=str(cert)))
    https.request("POST", "/v1/completions", body=body)
    assert json.loads(https.getresponse().read())["choices"][0]["text"] == "bcd"
    sock = https.sock  # kept alive: the next call reuses the TLS session's socket
    https.request("POST", "/v1/completions", body=body)
    assert json.loads(https.getresponse().read())["choices"][0]["text"] == "bcd"
    assert https.sock is sock
    https.close()
    plain_http = http.client.HTTPConnection("localhost", port, timeout=5)
    with pytest.raises((http.client.HTTPException, OSError)):
      plain_http.request("POST", "/v1/completions", body=body)
      plain_http.getresponse().read()
    with Client(f"localhost:{server.port}") as plain:  # no TLS: refused
      with pytest.raises(grpc.RpcError) as e:
        plain.generate("a", max_tokens=3, timeout=5)
      assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
  finally:
    server.stop(grace=0.5)


def test_a_kv_cache_past_the_device_memory_is_one_line_naming_num_pages(monkeypatch):
  # jax's RESOURCE_EXHAUSTED traceback named no flag; the size is the cache's.
  import jax

  models = pytest.importorskip("models")
  model = models.load("tiny")
  real = model.init_cache

  def exhausted(num_pages, **kw):
    if num_pages > 64:  # (jax.eval_shape's call traces; only a real one allocates)
      if not isinstance(jax.numpy.zeros(()), jax.core.Tracer):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating")
    return real(num_pages, **kw)

  monkeypatch.setattr(model, "init_cache", exhausted)
  with pytest.raises(ValueError, match=r"num_pages=100000: a KV cache of [\d.]+ GiB does not fit"):
    E.ModelRunner(model, num_pages=100_000, page_size=8)
  assert E.ModelRunner(model, num_pages=16, page_size=8).num_pages == 16
