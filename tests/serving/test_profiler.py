"""serving.profiler: costs, trace parsing, layer attribution, and the outputs
(JSON, PNG, Perfetto trace) of a real CPU profile of the tiny model."""

import gzip
import json
import pathlib
import struct

import pytest

from models import config as config_lib
from serving import profiler as P
from tests.host_devices import run_checked


# ---------------------------------------------------------------- costs by hand


def test_op_costs_match_hand_computed_prefill():
  cfg = config_lib.get("tiny")  # D=128, Hq=4, Hkv=2, hd=64, F=256, V=320
  b, s = 2, 32
  m = b * s
  c = P.op_costs(cfg, "prefill", b, s, dtype="bfloat16")
  assert c["qkv"].flops == 2 * m * 128 * (4 * 64 + 2 * 2 * 64)
  assert c["o_proj"].flops == 2 * m * (4 * 64) * 128
  assert c["gate_up"].flops == 2 * (2 * m * 128 * 256)
  assert c["down"].flops == 2 * m * 256 * 128
  # causal, no prefix: each query sees (i + 1) keys -> S(S+1)/2 pairs per head
  assert c["attention"].flops == 4 * b * 4 * (s * (s + 1) / 2) * 64
  assert c["lm_head"].flops == 2 * b * 128 * 320  # logits at the last token only
  assert c["attn_norm"].flops == 4 * m * 128
  # bf16 weights of qkv read once: K*N*2 bytes, plus activations in and out
  assert c["qkv"].bytes == 3 * m * 128 * 2 + 128 * (4 * 64 + 2 * 2 * 64) * 2 + m * (
      4 * 64 + 2 * 2 * 64) * 2
  assert c["lm_head"].bytes == b * 128 * 2 + 128 * 320 * 2 + b * 320 * 4  # float32 logits


def test_op_costs_match_hand_computed_decode():
  cfg = config_lib.get("llama3.1-8b")
  b, l = 16, 2048
  c = P.op_costs(cfg, "decode", b, l, dtype="bfloat16")
  assert c["qkv"].flops == 2 * b * 4096 * (32 * 128 + 2 * 8 * 128)
  assert c["gate_up"].flops == 2 * 2 * b * 4096 * 14336
  assert c["down"].flops == 2 * b * 14336 * 4096
  assert c["attention"].flops == 4 * b * 32 * l * 128  # one query sees all L keys
  assert c["attention"].bytes == b * 128 * 2 * (2 * 32 * 1 + 2 * 8 * l)
  assert c["lm_head"].flops == 2 * b * 4096 * 128256


def test_op_costs_with_an_fp8_cache():
  # Decode reads K and V at 1 byte each; the write stores them at 1 byte; a
  # fresh prefill attends its own bf16 K/V.
  cfg = config_lib.get("llama3.1-8b")
  b, l = 16, 2048
  c = P.op_costs(cfg, "decode", b, l, dtype="bfloat16", kv_dtype="float8_e4m3fn")
  assert c["attention"].bytes == b * 128 * (2 * 2 * 32 * 1 + 1 * 2 * 8 * l)
  assert c["kv_write"].bytes == 2 * b * 8 * 128 * (2 + 1)
  bf = P.op_costs(cfg, "prefill", 1, 512, dtype="bfloat16")
  f8 = P.op_costs(cfg, "prefill", 1, 512, dtype="bfloat16", kv_dtype="float8_e4m3fn")
  assert f8["attention"].bytes == bf["attention"].bytes


def test_op_costs_of_fp8_prefill_attention():
  # attention_prefill's mosaic_fp8: the same FLOPs, all on the fp8 tensor
  # cores; bytes: q, k, v read twice in bf16 (amax, quantize) and written and
  # read once in fp8, the output written in bf16. Decode attention is unchanged.
  cfg = config_lib.get("llama3.1-8b")
  t = 4096
  bf = P.op_costs(cfg, "prefill", 1, t, dtype="bfloat16")
  f8 = P.op_costs(cfg, "prefill", 1, t, dtype="bfloat16", fp8_prefill_attention=True)
  a = f8["attention"]
  assert a.flops == bf["attention"].flops == a.fp8_flops > 0
  qkv = t * (32 + 2 * 8) * 128
  assert a.bytes == t * 32 * 128 * 2 + qkv * (2 * 2 + 1) + qkv
  assert all(f8[k] == bf[k] for k in bf if k != "attention")
  mixed = dict(batch=8, length=1024, chunk=256, dtype="bfloat16")
  m_bf, m_f8 = (P.op_costs(cfg, "mixed", fp8_prefill_attention=f, **mixed)
                for f in (False, True))
  decode_part = P.op_costs(cfg, "decode", 8, 1024, dtype="bfloat16")["attention"]
  assert m_f8["attention"].fp8_flops == m_bf["attention"].flops - decode_part.flops


def test_profile_an_fp8_cache_on_cpu():
  from models import load

  model = load("tiny", dtype="float32")
  rep = P.profile(model, batch=2, decode_context=40, phases=["decode"], attention="xla",
                  steps=1, iters=1, page_size=16, kv_cache_dtype="float8_e4m3fn",
                  log=lambda m: None)
  (p,) = rep.profiles
  assert p.error is None
  att = [r for r in p.rows if r["op"] == "attention"]
  assert att and all(r["time_us"] > 0 for r in att)


def test_profile_fp8_linears_on_cpu():
  # --quantization fp8: the projections' rows carry the fp8 cost model (their
  # bytes halve against the same model's bf16 profile; the quantize fusion is
  # timed inside its projection).
  rc_rows = {}
  for q in (None, "fp8"):
    model = P.load_model("tiny", dtype="float32", quantization=q)
    assert model.quantization == q
    rep = P.profile(model, batch=2, decode_context=40, phases=["decode"], attention="xla",
                    steps=1, iters=1, page_size=16, log=lambda m: None)
    (p,) = rep.profiles
    assert p.error is None, p.error
    rc_rows[q] = {(r["layer"], r["op"]): r for r in p.rows}
  # (XLA:CPU fuses some of the first layer's ops into their neighbours: the
  # last layer has a row for each.)
  last = config_lib.get("tiny").num_layers - 1
  for op in ("qkv", "o_proj", "gate_up", "down"):
    bf, f8 = rc_rows[None][(last, op)], rc_rows["fp8"][(last, op)]
    assert f8["time_us"] > 0 and f8["flops"] == bf["flops"] and f8["bytes"] < bf["bytes"], op
  att = (last, "attention")
  assert rc_rows["fp8"][att]["bytes"] == rc_rows[None][att]["bytes"]


def test_op_costs_with_decode_append_book_rope_and_the_cache_write_to_attention():
  cfg = config_lib.get("llama3.1-8b")
  plain = P.op_costs(cfg, "decode", 4, 600, dtype="bfloat16")
  fused = P.op_costs(cfg, "decode", 4, 600, dtype="bfloat16", decode_append=True)
  assert "rope" not in fused and "kv_write" not in fused
  assert fused["attention"].flops == plain["attention"].flops
  # rope reads and writes q and k (40 heads of 128, bf16); the write reads and writes k and v.
  extra = 4 * (2 * 40 * 128 * 2) + 4 * (2 * 8 * 128 * (2 + 2))
  assert fused["attention"].bytes == plain["attention"].bytes + extra
  # Only one-token decode steps append; the other phases keep their ops.
  for phase, kw in (("decode", dict(decode_tokens=2)), ("prefill", {})):
    assert "kv_write" in P.op_costs(cfg, phase, 4, 600, decode_append=True, **kw)


def test_op_costs_with_folded_norms_book_the_norms_to_their_matmuls():
  cfg = config_lib.get("llama3.1-8b")
  plain = P.op_costs(cfg, "decode", 4, 600, dtype="bfloat16")
  folded = P.op_costs(cfg, "decode", 4, 600, dtype="bfloat16", folded_norms=True)
  assert "attn_norm" not in folded and "mlp_norm" not in folded
  for norm, op in (("attn_norm", "qkv"), ("mlp_norm", "gate_up")):
    assert folded[op].flops == plain[op].flops + plain[norm].flops == plain[op].flops + 4 * 4 * 4096
    assert folded[op].bytes == plain[op].bytes  # the norm reads the matmul's own rows
  assert {k: v for k, v in folded.items() if k not in ("qkv", "gate_up")} == {
      k: v for k, v in plain.items() if k not in ("qkv", "gate_up", "attn_norm", "mlp_norm")}


def test_op_costs_match_hand_computed_mixed():
  # 16 decode rows at L=2048 and a fresh 128-token chunk in one pass.
  cfg = config_lib.get("llama3.1-8b")
  b, l, t = 16, 2048, 128
  c = P.op_costs(cfg, "mixed", b, l, dtype="bfloat16", chunk=t)
  assert c["qkv"].flops == 2 * (b + t) * 4096 * (32 * 128 + 2 * 8 * 128)
  assert c["down"].flops == 2 * (b + t) * 14336 * 4096
  # the decode rows' attention over L keys, plus the chunk's causal attention
  assert c["attention"].flops == 4 * b * 32 * l * 128 + 4 * 32 * (t * (t + 1) / 2) * 128
  assert c["lm_head"].flops == 2 * (b + 1) * 4096 * 128256  # decode rows + the chunk's last
  with pytest.raises(ValueError, match="chunk"):
    P.op_costs(cfg, "mixed", b, l)


def test_op_costs_under_tensor_parallelism_are_one_devices_share():
  cfg = config_lib.get("llama3.1-8b")
  one = P.op_costs(cfg, "decode", 16, 1024)
  two = P.op_costs(cfg, "decode", 16, 1024, tp=2)
  for op in ("qkv", "attention", "gate_up", "lm_head"):  # heads, features, vocabulary split
    assert two[op].flops == pytest.approx(one[op].flops / 2), op
  assert two["down"].flops == one["down"].flops / 2 and two["o_proj"].flops == one["o_proj"].flops / 2
  for op in ("attn_norm", "mlp_norm", "final_norm", "embed"):  # replicated
    assert two[op] == one[op], op
  # A tied embedding is the logits' weight on every device: not split.
  tied = cfg.replace(tie_embeddings=True)
  assert (P.op_costs(tied, "decode", 16, 1024, tp=2)["lm_head"]
          == P.op_costs(tied, "decode", 16, 1024)["lm_head"])
  assert not {o for o in two if "all_" in o}  # collectives: time only, no cost model
  with pytest.raises(ValueError, match="tp"):
    P.op_costs(cfg, "decode", 1, 8, tp=0)


def test_op_costs_reject_bad_input():
  cfg = config_lib.get("tiny")
  with pytest.raises(ValueError, match="phase"):
    P.op_costs(cfg, "train", 1, 8)
  with pytest.raises(ValueError, match="batch"):
    P.op_costs(cfg, "prefill", 0, 8)
  with pytest.raises(ValueError, match="decode_tokens"):
    P.op_costs(cfg, "decode", 1, 4, decode_tokens=5)


def test_unknown_backend_names_the_valid_ones():
  from models import llama

  llama.ops()
  with pytest.raises(ValueError, match="valid"):
    P.configurations(["prefill"], ["nonesuch"], None, [None])
  with pytest.raises(ValueError, match="phase"):
    P.configurations(["train"], [None], None, [None])
  # cudnn has no decode kernel: skipped for decode, kept for prefill
  confs = P.configurations(["prefill", "decode"], ["cudnn", "xla"], None, [None])
  assert [(ph, b.get("attention_prefill", b.get("attention_decode"))) for ph, b in confs] == [
      ("prefill", "cudnn"), ("prefill", "xla"), ("decode", "xla")]


# ---------------------------------------------------------------- parsing and attribution


HLO = """HloModule jit_decode_step, entry_computation_layout={()}

%body {
  %fusion.1 = bf16[2] fusion(), kind=kLoop, metadata={op_name="jit(decode_step)/while/body/attn_norm/mul"}
  %gemm.2 = bf16[2] custom-call(), metadata={op_name="jit(decode_step)/while/body/qkv/jit(_xla)/dot_general"}
  %attn.3 = bf16[2] custom-call(), metadata={op_name="jit(decode_step)/while/body/attention/pallas_call"}
  %gemm.4 = bf16[2] custom-call(), metadata={op_name="jit(decode_step)/while/body/o_proj/dot_general"}
  %gemm.5 = bf16[2] custom-call(), metadata={op_name="jit(decode_step)/while/body/down/dot_general"}
  ROOT %t = (bf16[2]) tuple()
}

ENTRY %main {
  %gather.7 = bf16[2] gather(), metadata={op_name="jit(decode_step)/embed/jit(_take)/gather"}
  %mask.8 = bf16[2] fusion(), metadata={op_name="jit(decode_step)/while/body/attention/and"}
  %lm.9 = f32[2] custom-call(), metadata={op_name="jit(decode_step)/lm_head/dot_general"}
  ROOT %copy.10 = f32[2] copy()
}
"""

LAYER_SEQ = ["fusion.1", "gemm.2", "attn.3", "gemm.4", "gemm.5"]


def _kernels(names, dur=10.0, by_name=False):
  out = []
  for i, n in enumerate(names):
    if by_name:  # only the kernel name, as XLA sanitizes it
      out.append(P.Kernel(ts=100.0 * i, dur=dur, name=P.sanitize(n), hlo_op=None))
    else:
      out.append(P.Kernel(ts=100.0 * i, dur=dur, name=f"k{i}", hlo_op=n))
  return out


def test_hlo_op_names_and_classify():
  names = P.hlo_op_names(HLO)
  assert P.hlo_module_name(HLO) == "jit_decode_step"
  assert names["attn.3"].endswith("attention/pallas_call")
  assert names["copy.10"] == ""  # no metadata: known, unnamed
  assert P.classify(names["gemm.2"]) == ("qkv", True)
  assert P.classify(names["lm.9"]) == ("lm_head", False)
  assert P.classify("jit(f)/while/body/jit(dynamic_index_in_dim)/dynamic_slice") == ("params", True)
  assert P.classify("jit(f)/while/cond/lt") == ("loop", False)
  # With no loop: in a layer inside the model's "layers" scope only.
  assert P.classify("jit(f)/layers/qkv/dot_general") == ("qkv", True)
  assert P.classify("jit(f)/rope/cos") == ("rope", False)
  # Tensor parallelism: each collective is a row named by the op it ends.
  assert P.classify("jit(f)/shard_map/while/body/o_proj/all_reduce/psum") == (
      "o_proj_all_reduce", True)
  assert P.classify("jit(f)/shard_map/while/body/down/all_reduce/psum") == ("down_all_reduce", True)
  assert P.classify("jit(f)/shard_map/lm_head/all_gather/all_gather") == (
      "lm_head_all_gather", False)


@pytest.mark.parametrize("by_name", [False, True])
def test_attribute_scanned_layers(by_name):
  layers = 3
  seq = ["gather.7", "mask.8"] + LAYER_SEQ * layers + ["lm.9", "copy.10", "mystery"]
  st = P.attribute(_kernels(seq, by_name=by_name), P.hlo_op_names(HLO), layers)
  for layer in range(layers):
    for op in ("attn_norm", "qkv", "attention", "o_proj", "down"):
      assert st.times[(layer, op)] == pytest.approx(10e-6), (layer, op)
  assert st.times[(None, "embed")] == pytest.approx(10e-6)
  assert st.times[(None, "attention")] == pytest.approx(10e-6)  # hoisted mask, no layer
  assert st.times[(None, "lm_head")] == pytest.approx(10e-6)
  assert st.times[(None, "other")] == pytest.approx(10e-6)
  assert st.times[(None, "unattributed")] == pytest.approx(10e-6)
  assert sum(st.times.values()) == pytest.approx(len(seq) * 10e-6)


def test_attribute_unrolled_layers_by_op_order():
  # An unrolled loop: every instruction runs once, layers follow the op order.
  hlo_lines, seq = [], []
  for layer in range(2):
    for op in ("attn_norm", "qkv", "rope", "attention", "o_proj", "mlp_norm", "gate_up", "down"):
      n = f"i{layer}_{op}"
      hlo_lines.append(f'  %{n} = bf16[2] fusion(), metadata={{op_name="jit(f)/while/body/{op}/x"}}')
      seq.append(n)
  st = P.attribute(_kernels(seq), P.hlo_op_names("\n".join(hlo_lines)), 2)
  assert st.times[(0, "down")] == pytest.approx(10e-6)
  assert st.times[(1, "attn_norm")] == pytest.approx(10e-6)
  assert st.times[(1, "down")] == pytest.approx(10e-6)
  assert (2, "qkv") not in st.times


def test_attribute_the_models_unrolled_decode_step():
  # The model's one-token decode step has no layer loop: its layer ops sit in
  # the "layers" scope, the RoPE table is built once outside it, and XLA may
  # run the layers' weight slices (xla backends) first, side by side (CPU).
  hlo_lines, seq = [], []

  def add(name, path):
    hlo_lines.append(f'  %{name} = bf16[2] fusion(), metadata={{op_name="{path}"}}')
    seq.append(name)

  add("table", "jit(f)/rope/cos")
  for i, op in enumerate(("o_proj", "gate_up", "qkv", "down")):
    add(f"w{i}", f"jit(f)/layers/{op}/jit(dynamic_index_in_dim)/dynamic_slice")
  for layer in range(2):
    for op in ("qkv", "attention", "o_proj", "gate_up", "down"):
      add(f"i{layer}_{op}", f"jit(f)/layers/{op}/x")
  st = P.attribute(_kernels(seq), P.hlo_op_names("\n".join(hlo_lines)), 2)
  assert st.times[(None, "rope")] == pytest.approx(10e-6)
  assert st.times[(None, "params")] == pytest.approx(40e-6)
  for layer in range(2):
    for op in ("qkv", "attention", "o_proj", "gate_up", "down"):
      assert st.times[(layer, op)] == pytest.approx(10e-6), (layer, op)


def test_parse_trace_reads_gpu_streams_only(tmp_path):
  ev = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
      {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
      {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 100, "name": "mosaic_profile_step0"},
      {"ph": "X", "pid": 1, "tid": 1, "ts": 5, "dur": 1, "name": "launch", "args": {"hlo_op": "gemm.2"}},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 20, "dur": 30, "name": "nvjet_sm90",
       "args": {"hlo_op": "gemm.2", "hlo_module": "jit_decode_step"}},
      {"ph": "X", "pid": 2, "tid": 8, "ts": 20, "dur": 30, "name": "gemm.2"},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 60, "dur": 5, "name": "fusion_1"},
      # a library kernel named by neither: its launch sits inside XLA's host annotation
      {"ph": "X", "pid": 1, "tid": 3, "ts": 10, "dur": 5, "name": "thunk", "args": {"hlo_op": "gemm.4"}},
      {"ph": "X", "pid": 1, "tid": 3, "ts": 11, "dur": 1, "name": "cuLaunchKernel",
       "args": {"correlation_id": 77}},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 70, "dur": 8, "name": "sm90_xmma",
       "args": {"correlation_id": 77}},
  ]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as fh:
    json.dump({"traceEvents": ev}, fh)
  assert P.find_trace_file(tmp_path) == path
  tr = P.parse_trace(path)
  assert tr.device == "gpu"
  assert [(k.name, k.hlo_op) for k in tr.kernels] == [
      ("nvjet_sm90", "gemm.2"), ("fusion_1", None), ("sm90_xmma", None)]
  assert tr.windows == {"mosaic_profile_step0": (0.0, 100.0)}
  st = P.attribute(tr.kernels, P.hlo_op_names(HLO), 1)
  assert st.times == {(0, "qkv"): pytest.approx(30e-6), (0, "attn_norm"): pytest.approx(5e-6),
                      (0, "o_proj"): pytest.approx(8e-6)}
  assert st.span_s == pytest.approx(58e-6)


def test_parse_trace_keeps_the_first_device_of_a_tensor_parallel_step(tmp_path):
  # Every device runs the same program: counting both would book each op twice.
  ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
  for pid, gpu in ((3, 1), (2, 0)):
    ev += [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"/device:GPU:{gpu}"}},
           {"ph": "M", "pid": pid, "tid": 7, "name": "thread_name",
            "args": {"name": "Stream #7(Compute)"}},
           {"ph": "X", "pid": pid, "tid": 7, "ts": 20 + gpu, "dur": 30 + gpu, "name": "nvjet",
            "args": {"hlo_op": "gemm.2"}}]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as fh:
    json.dump({"traceEvents": ev}, fh)
  tr = P.parse_trace(path)
  assert [(k.ts, k.dur) for k in tr.kernels] == [(20.0, 30.0)]
  assert tr.info["gpus_in_trace"] == 2
  # Host devices (CPU): XLA's thunks carry their device ordinal.
  cpu = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}] + [
      {"ph": "X", "pid": 1, "tid": 10 + d, "ts": 5 + d, "dur": 2, "name": "dot.1",
       "args": {"hlo_op": "dot.1", "device_ordinal": str(d)}} for d in (0, 1)]
  with gzip.open(path, "wt") as fh:
    json.dump({"traceEvents": cpu}, fh)
  tr = P.parse_trace(path)
  assert tr.device == "cpu" and [k.ts for k in tr.kernels] == [5.0]


def test_cupti_step_time_is_one_devices_share_under_tensor_parallelism(monkeypatch):
  from mosaic import bench

  # CUPTI reports both devices' kernels of a TP=2 step: 3 + 5 us on each.
  monkeypatch.setattr(bench, "cupti_kernels", lambda f, inputs: [
      ("qkv", 3e-6), ("qkv", 3e-6), ("all_reduce", 5e-6), ("all_reduce", 5e-6)])
  step = P._Step.__new__(P._Step)
  step.devices = 2
  assert step._cupti(3) == pytest.approx(8e-6)
  step.devices = 1
  assert step._cupti(3) == pytest.approx(16e-6)


def test_tensor_parallel_profile_has_a_row_per_collective():
  run_checked(pathlib.Path(__file__).parent / "tp_profile_check.py")


def test_find_trace_file_missing(tmp_path):
  with pytest.raises(FileNotFoundError, match="perfetto_trace"):
    P.find_trace_file(tmp_path)


# ---------------------------------------------------------------- a real profile on CPU


def test_profile_cli_writes_json_png_and_perfetto_trace(tmp_path):
  # One test (not a fixture shared by several) so that pytest-xdist runs the
  # profile once.
  out = tmp_path / "profile"
  rc = P.main(["--model", "tiny", "--dtype", "float32", "--batch", "2", "--prefill-len", "16",
               "--decode-context", "40", "--page-size", "16", "--attention-backend", "xla",
               "--phases", "prefill,decode,mixed", "--mixed-chunk", "8",
               "--steps", "2", "--iters", "2", "--out", str(out)])
  assert rc == 0
  _check_json(out)
  _check_png(out)
  _check_trace(out)


def _check_json(out):
  rep = json.loads((out / "profile.json").read_text())
  assert "CPU" in rep["note"] and "nominal" in rep["note"]
  cfg = config_lib.get("tiny")
  assert [p["phase"] for p in rep["profiles"]] == ["prefill", "decode", "mixed"]
  assert rep["profiles"][2]["chunk"] == 8 and "T=8" in rep["profiles"][2]["label"]
  for p in rep["profiles"]:
    assert p["error"] is None
    rows = {(r["layer"], r["op"]): r for r in p["rows"]}
    for layer in range(cfg.num_layers):
      for op in ("qkv", "attention", "o_proj", "gate_up", "down"):
        r = rows[(layer, op)]
        assert r["time_us"] > 0 and r["flops"] > 0
        assert r["tflops"] == pytest.approx(r["flops"] / (r["time_us"] * 1e-6) / 1e12)
        assert r["bound"] in ("compute", "memory")
    assert rows[(None, "lm_head")]["time_us"] > 0
    # The tiny model folds its norms (models.Model's default): no norm rows,
    # and qkv's FLOPs include the norm's (decode: 2 rows of D=128).
    assert not {"attn_norm", "mlp_norm"} & {r["op"] for r in p["ops"]}
    if p["phase"] == "decode":
      assert rows[(0, "qkv")]["flops"] == 2 * 2 * 128 * (4 * 64 + 2 * 2 * 64) + 4 * 2 * 128
      # One-token decode rotates and writes the cache inside attention
      # (attention_decode_append): no rope or kv_write op in the layers.
      assert not {"rope", "kv_write"} & {op for layer, op in rows if layer is not None}
      assert "kv_write" not in {r["op"] for r in p["ops"]}
    assert len(p["layers"]) == cfg.num_layers and all(r["time_us"] > 0 for r in p["layers"])
    assert p["step"]["wall_s"] > 0 and p["step"]["sum_s"] > 0
    assert p["step"]["trace_device"] == "cpu"
    # the op rows add up to the step total
    assert sum(r["time_us"] for r in p["ops"]) == pytest.approx(p["step"]["sum_s"] * 1e6)


def _check_png(out):
  data = (out / "profile.png").read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
  w, h = struct.unpack(">II", data[16:24])
  assert (w, h) == P.PNG_SIZE
  import matplotlib.image

  img = matplotlib.image.imread(out / "profile.png")
  assert img.shape[:2] == (P.PNG_SIZE[1], P.PNG_SIZE[0])
  assert img[..., :3].std() > 0.01  # not a blank canvas


def _check_trace(out):
  tr = json.loads((out / "profile_trace.json").read_text())
  xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
  names = {e["name"] for e in xs}
  assert {"L0 qkv", "L1 qkv", "L0 attention", "L1 down", "top lm_head"} <= names
  assert {"layer 0", "layer 1"} <= names
  assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
  procs = [e for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
  assert len(procs) == 3  # one per configuration: prefill, decode, mixed


def test_kernels_without_metadata_join_the_op_around_them():
  hlo = "\n".join([
      '  %a = bf16[2] fusion(), metadata={op_name="jit(f)/while/body/attention/dot_general"}',
      '  %b = bf16[2] fusion(), kind=kInput',  # XLA-made, no metadata
      '  %c = bf16[2] fusion(), metadata={op_name="jit(f)/while/body/attention/exp"}',
      '  %d = bf16[2] fusion(), metadata={op_name="jit(f)/while/body/down/dot_general"}',
      '  %e = bf16[2] copy()',
      '  %g = f32[2] fusion(), metadata={op_name="jit(f)/lm_head/dot_general"}'])
  st = P.attribute(_kernels(["a", "b", "c", "d", "e", "g"]), P.hlo_op_names(hlo), 1)
  assert st.times[(0, "attention")] == pytest.approx(30e-6)
  assert st.times[(None, "other")] == pytest.approx(10e-6)  # between different ops: unknown


def test_cli_bad_input_is_a_message(capsys):
  assert P.main(["--model", "/nonexistent/model"]) == 2
  assert "no such model" in capsys.readouterr().err
  assert P.main(["--model", "tiny", "--layers", "1", "--batch", "0"]) == 2
  assert "batch" in capsys.readouterr().err
  # Flags the asked phases would not use, or need --out, are refused before any work.
  for flags, message in (
      (["--phases", ","], "names no phase"),
      (["--phases", "prefill", "--decode-batch", "4"], "--decode-batch 4: --phases 'prefill'"),
      (["--phases", "prefill", "--decode-attention-backend", "xla"],
       "--decode-attention-backend xla: --phases 'prefill' has no decode or mixed step"),
      (["--phases", "prefill,decode", "--mixed-chunk", "64"],
       "--mixed-chunk 64: --phases 'prefill,decode' has no mixed step"),
      (["--kernel-timeline"], "--kernel-timeline needs --out"),
      (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0 must be >= 1")):
    assert P.main(["--model", "/nonexistent/model", *flags]) == 2, flags
    assert message in capsys.readouterr().err, flags
  # More devices than this process has (one CPU device here): a message.
  assert P.main(["--model", "tiny", "--tensor-parallel-size", "2"]) == 2
  assert "needs 2 devices" in capsys.readouterr().err
  # The same through python -m serving profile: a message, not a traceback.
  from serving import cli
  assert cli.main(["profile", "--model", "/nonexistent/model"]) == 2
  assert "no such model" in capsys.readouterr().err


def test_label_timeline_names_warpgroups_and_keeps_the_first_sms():
  ev = lambda name, ph, ts, pid, tid: {"name": name, "ph": ph, "ts": ts, "pid": pid, "tid": tid}
  raw = {"displayTimeUnit": "ns", "traceEvents": [
      # SM 0: CTA 0's three warpgroups; SM 7: CTA 1's producer.
      ev("qk", "B", 100.0, 1, 1), ev("qk", "E", 101.5, 1, 1),
      ev("softmax", "B", 100.2, 1, 2), ev("softmax", "E", 102.0, 1, 2),
      ev("load_kv", "B", 99.0, 1, 3), ev("load_kv", "E", 99.5, 1, 3),
      ev("load_kv", "B", 98.0, 8, 6), ev("load_kv", "E", 98.4, 8, 6)]}
  out = P.label_timeline(raw, max_sms=1)
  names = {(e["pid"], e["tid"]): e["args"]["name"] for e in out["traceEvents"]
           if e["name"] == "thread_name"}
  assert names == {(1, 1): "CTA 0 consumer 0", (1, 2): "CTA 0 consumer 1", (1, 3): "CTA 0 producer"}
  spans = [e for e in out["traceEvents"] if e["ph"] in "BE"]
  assert len(spans) == 6 and min(e["ts"] for e in spans) == 0.0  # SM 7 cut, rebased to SM 0's start
  both = P.label_timeline(raw, max_sms=None)
  assert {"CTA 1 producer"} <= {e["args"]["name"] for e in both["traceEvents"] if e["ph"] == "M"}
  json.loads(json.dumps(out))  # what Perfetto reads
  with pytest.raises(ValueError, match="no events"):
    P.label_timeline({"traceEvents": []})


def test_kernel_timeline_sets_the_profiler_params_and_needs_a_gpu(monkeypatch, tmp_path):
  from mosaic import dsl

  seen = {}
  monkeypatch.setattr(dsl, "interpret_params", lambda: None)  # as on a GPU
  monkeypatch.setattr(dsl.plgpu, "kernel", lambda body, **kw: seen.update(kw))
  with dsl.kernel_timeline(tmp_path / "t", events=64):
    dsl.kernel(lambda: None, compiler_params=dsl.plgpu.CompilerParams(approx_math=True))
  cp = seen["compiler_params"]
  assert (cp.profile_space, cp.profile_dir, cp.approx_math) == (64, str(tmp_path / "t"), True)
  seen.clear()
  dsl.kernel(lambda: None)  # outside: no profiler
  assert seen == {"interpret": None}
  with pytest.raises(ValueError, match="events"):
    with dsl.kernel_timeline(tmp_path, events=0):
      pass
  monkeypatch.undo()
  with pytest.raises(RuntimeError, match="needs a GPU"):
    P.kernel_timeline(P.load_model("tiny"), tmp_path)


def test_op_costs_with_fp8_linears():
  # The four projections read fp8 weights (half the bytes) and fp8 rows, run
  # on the fp8 tensor cores, and each quantizes its rows first (read bf16,
  # write fp8 + a float32 scale); embed, attention and lm_head are unchanged.
  cfg = config_lib.get("llama3.1-8b")
  b, l = 16, 2048
  bf = P.op_costs(cfg, "decode", b, l, dtype="bfloat16")
  f8 = P.op_costs(cfg, "decode", b, l, dtype="bfloat16", quantization="fp8")
  n_qkv = (32 + 2 * 8) * 128
  assert f8["qkv"].flops == bf["qkv"].flops == f8["qkv"].fp8_flops
  assert f8["qkv"].bytes == (b * 4096 * 1 + 4096 * n_qkv * 1 + b * n_qkv * 2  # the product
                             + b * 4096 * (2 + 1) + b * 4)  # the rows' quantization
  assert f8["gate_up"].bytes == (b * 4096 + 4096 * 2 * 14336 + b * 14336 * 2
                                 + b * 4096 * 3 + b * 4)
  for op in ("o_proj", "down"):
    assert f8[op].fp8_flops == f8[op].flops > 0 and f8[op].bytes < 0.6 * bf[op].bytes
  for op in ("attention", "lm_head", "embed", "attn_norm"):
    assert f8[op] == bf[op]
  with pytest.raises(ValueError, match="no cost model"):
    P.op_costs(cfg, "decode", b, l, quantization="int4")
