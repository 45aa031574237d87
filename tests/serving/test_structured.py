"""Structured outputs (serving.engine.structured): grammars over each
tokenizer's bytes, and the engine writing each step's allowed set.

The counting model (next byte = previous + 1, every other token tied) makes a
constrained greedy output known by hand: the model's own byte where the
grammar admits it, else the lowest allowed id.
"""

import concurrent.futures
import json
import re
import subprocess
import sys

import grpc
import numpy as np
import pytest

from serving import engine as E
from serving.engine import api, structured
from serving.proto import generate_pb2 as pb

from tests.serving.conftest import running, wait_for

pytest.importorskip("llguidance")

_OK_SCHEMA = json.dumps({
    "type": "object", "additionalProperties": False, "required": ["ok", "tag"],
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["ab", "cd"]}}})


# -- each tokenizer's bytes, as llguidance sees them ---------------------------

def _hf_tokenizer(tmp_path):
  import tokenizers
  from tokenizers import decoders, models as tk_models, pre_tokenizers

  from models import tokenizer as tok_lib

  vocab = {"<s>": 0, "</s>": 1}
  for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
    vocab[ch] = len(vocab)
  merges = [("t", "h"), ("th", "e"), ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "t"), ("d", "o")]
  for a, b in merges:
    vocab[a + b] = len(vocab)
  tk = tokenizers.Tokenizer(tk_models.BPE(vocab=vocab, merges=merges))
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  tk.add_special_tokens(["<s>", "</s>"])
  return tok_lib.HFTokenizer(tk, bos_id=0, eos_ids=(1,)), len(vocab) + 5  # a padded vocabulary


def _sp_tokenizer(tmp_path):
  import sentencepiece as spm

  from models import tokenizer as tok_lib

  text = tmp_path / "corpus.txt"
  text.write_text("\n".join(f"the {w} sat on the mat {i}" for i, w in
                            enumerate(["cat", "dog", "bird", "fox"] * 25)))
  spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"),
                                 vocab_size=300, model_type="bpe", byte_fallback=True,
                                 bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
  return tok_lib.SentencePieceTokenizer(tmp_path / "sp.model"), 300


def _tokenizer(kind, tmp_path):
  from models import tokenizer as tok_lib
  from serving.engine.text import ByteTokenizer

  if kind == "serving-bytes":
    return ByteTokenizer(260), 260
  if kind == "model-bytes":
    return tok_lib.ByteTokenizer(), 300
  return (_hf_tokenizer if kind == "hf" else _sp_tokenizer)(tmp_path)


_SPECS = [
    (api.StructuredOutputs(choice=("the cat", "the dog", "a.b(c)|d")),
     lambda t: t in ("the cat", "the dog", "a.b(c)|d")),
    (api.StructuredOutputs(regex="(the|a) [a-z]{1,4}[0-9]"),
     lambda t: re.fullmatch("(the|a) [a-z]{1,4}[0-9]", t)),
    (api.StructuredOutputs(json=_OK_SCHEMA),
     lambda t: json.loads(t)["tag"] in ("ab", "cd") and isinstance(json.loads(t)["ok"], bool)),
    (api.StructuredOutputs(grammar='start: "x" ("y" | "zz")+ "!"'),
     lambda t: re.fullmatch("x(y|zz)+!", t)),
]


@pytest.mark.parametrize("kind", ["serving-bytes", "model-bytes", "hf", "sentencepiece"])
def test_random_walks_through_the_allowed_sets_decode_to_matches(kind, tmp_path):
  """Tokens drawn at random from each step's allowed set, until the grammar
  is complete, decode (with the tokenizer's own decode) to a match; and the
  sets do exclude tokens. A wrong byte mapping (a sentencepiece "▁" kept, an
  offset lost) decodes to text the grammar never allowed."""
  tok, vocab = _tokenizer(kind, tmp_path)
  grammars = structured.Grammars(tok, vocab)
  eos = set(tok.eos_ids)
  rng = np.random.default_rng(0)
  for spec, matches in _SPECS:
    for walk in range(8):
      g, ids = grammars.guide(spec), []
      while not g.stopped:
        allowed = np.flatnonzero(g.allowed())
        assert 0 < len(allowed) < vocab, (spec, ids)
        ends = [t for t in allowed if t in eos]
        if ends and (len(ends) == len(allowed) or rng.random() < 0.3):
          break
        t = int(rng.choice([t for t in allowed if t not in eos]))
        assert g.accept([t])
        ids.append(t)
        assert len(ids) < 64, (spec, tok.decode(ids))
      text = tok.decode(ids)
      assert matches(text), (kind, spec.kind, walk, text, ids)


def test_a_choice_is_literal_text_and_bad_specs_are_refused():
  from serving.engine.text import ByteTokenizer

  grammars = structured.Grammars(ByteTokenizer(), 258)
  g = grammars.guide(api.StructuredOutputs(choice=("a.b", "a+")))
  assert g.accept([ord("a")])
  assert sorted(np.flatnonzero(g.allowed())) == [ord("+"), ord(".")]  # not any byte, not "a"
  for spec, match in [
      (dict(regex="(ab"), "unclosed group"),
      (dict(json="{not json"), "the schema is not JSON"),
      (dict(json="[1]"), "must be a JSON object"),
      (dict(grammar="start: foo"), "unknown name"),
  ]:
    with pytest.raises(api.InvalidRequest, match=re.escape(match)):
      grammars.guide(api.StructuredOutputs(**spec))
  for kw in ({}, dict(regex="a", choice=("a",)), dict(choice=("a", "")),
             dict(regex="a" * (api.MAX_GRAMMAR_CHARS + 1)), dict(json_object=False)):
    with pytest.raises(api.InvalidRequest, match="structured"):
      api.StructuredOutputs(**kw)


# -- the engine -----------------------------------------------------------------

_KNOWN = [  # (spec, other sampling fields, the counting model's greedy output after "a")
    (dict(choice={"choices": ["xyz", "bcq"]}), {}, "bcq"),  # b, c its own; then only q
    (dict(regex="[b-d]+0"), {}, "bcd0"),  # e refused after d: the lowest allowed is "0"
    (dict(json=_OK_SCHEMA), {}, '{"ok":false,"tag":"ab"}'),
    (dict(grammar='start: "b" "c" /[0-9]/'), {}, "bc0"),
    # "{" is the only start; then '"' (the lowest allowed) but for the bias on "}".
    (dict(json_object=True), dict(logit_bias={ord("}"): 30.0}), "{}"),
]


@pytest.mark.parametrize("config", [dict(), dict(decode_steps=4), dict(mixed_steps=True)],
                         ids=["one-step", "multi-step", "mixed"])
def test_greedy_structured_outputs_beside_plain_requests(config):
  """Each step's bias row is the grammar's set after the tokens so far: the
  outputs are known by hand, they end (STOP) when the grammar is complete,
  and the plain requests batched with them keep their own continuations,
  whatever the engine's decode mode."""
  engine = E.tiny_engine(max_batch=8, **config)
  with running(engine) as (server, c):
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
      plain = [pool.submit(c.generate, "hello " + ch, max_tokens=12, ignore_eos=True)
               for ch in "ghij"]
      guided = [pool.submit(c.generate, "a", max_tokens=40, structured_outputs=spec, **kw)
                for spec, kw, _ in _KNOWN]
      streamed = pool.submit(lambda: list(c.stream("a", structured_outputs=_KNOWN[1][0])))
      for f, ch in zip(plain, "ghij"):
        assert f.result().text == "".join(chr(ord(ch) + 1 + i) for i in range(12))
      for f, (spec, _, want) in zip(guided, _KNOWN):
        r = f.result()
        assert r.text == want, spec
        assert r.finish_reason == pb.FINISH_REASON_STOP and not r.HasField("stop_string")
      chunks = streamed.result()
      assert "".join(ch.text for ch in chunks) == "bcd0"
      assert chunks[-1].final.finish_reason == pb.FINISH_REASON_STOP
    # The slot's bias row does not outlive the request.
    assert c.generate("a", max_tokens=5).text == "bcdef"
    assert c.generate("a", max_tokens=3, temperature=1.0, top_k=1, seed=2).text == "bcd"
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")


def test_sampled_structured_outputs_match_and_n_completions_each_match(counting):
  """Sampling from the allowed set always matches; with n = 3 each completion
  follows its own grammar. After a, c or e the model's own next byte is
  refused, so the draw is among the tied allowed ones."""
  _, c = counting
  pattern = "[ace]{6}"
  texts = set()
  for seed in range(6):
    r = c.generate("a", max_tokens=20, temperature=1.0, seed=seed,
                   structured_outputs=dict(regex=pattern))
    assert re.fullmatch(pattern, r.text), r.text
    texts.add(r.text)
  assert len(texts) > 1  # it did sample
  r = c.generate("a", max_tokens=20, temperature=1.0, seed=7, n=3,
                 structured_outputs=dict(choice={"choices": ["no", "yes", "maybe"]}))
  assert all(x.text in ("no", "yes", "maybe") for x in r.completions)
  # Cut at max_tokens: what came is the start of a match.
  r = c.generate("a", max_tokens=3, structured_outputs=dict(regex="bcdefgh"))
  assert r.text == "bcd" and r.finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("spec, match", [
    (dict(regex="(ab"), "unclosed group"),
    (dict(json="{not json"), "not JSON"),
    (dict(grammar="start: foo"), "unknown name"),
    (dict(), "set exactly one of"),
    (dict(json_object=False), "set exactly one of"),
    (dict(choice={"choices": ["a", ""]}), "must not be empty"),
    (dict(regex=""), "regex must not be empty"),
    # JSON Schema's true / false: no object schema for llguidance (was UNKNOWN)
    (dict(json="true"), "the schema must be a JSON object"),
    (dict(json="false"), "the schema must be a JSON object"),
    # a regex no text matches: nothing could be generated (was INTERNAL)
    (dict(regex="[^\\x00-\\x{10FFFF}]"), "no output can match it"),
])
def test_bad_structured_outputs_are_invalid_argument(counting, spec, match):
  _, c = counting
  with pytest.raises(grpc.RpcError) as e:
    c.generate("a", structured_outputs=spec)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert match in e.value.details()


def test_allowed_ids_outside_the_grammars_first_set_are_invalid_argument(counting):
  # The regex starts with b or c: an allowed set without them could only end
  # at once; one with c leaves c as the only start.
  _, c = counting
  with pytest.raises(grpc.RpcError) as e:
    c.generate("a", structured_outputs=dict(regex="[bc]x"), allowed_token_ids=[ord("d")])
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "no common first token" in e.value.details()
  r = c.generate("a", structured_outputs=dict(regex="[bc]x"),
                 allowed_token_ids=[ord("c"), ord("d"), ord("x")])
  assert r.text == "cx" and r.finish_reason == pb.FINISH_REASON_STOP
  # Contradicting later: "a" may start, "b" may not follow. The client's
  # constraints, so INVALID_ARGUMENT (it was INTERNAL, counted as our error).
  for spec in (dict(regex="ab"), dict(choice={"choices": ["a", "ab"]})):
    with pytest.raises(grpc.RpcError) as e:
      c.generate("z", structured_outputs=spec, allowed_token_ids=[ord("a")], max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "after 1 tokens the grammar and allowed_token_ids admit no next token" in (
        e.value.details()), e.value.details()


def test_structured_outputs_survive_preemption():
  """A structured request preempted part-way (its pages freed, its tokens
  recomputed) goes on from its grammar's state: the output is the one it
  gets alone. 40 letters from b..z: after z the model's "{" is refused, so
  it starts again at "b"."""
  want = "bcdefghijklmnopqrstuvwxyz" + "bcdefghijklmnop"
  alone = E.tiny_engine(max_batch=4)
  with running(alone) as (_, c):
    assert c.generate("a", structured_outputs=dict(regex="[b-z]{40}")).text == want
  engine = E.tiny_engine(max_batch=4, num_pages=17, page_size=4)  # 16 pages: 64 tokens
  with running(engine) as (_, c):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      others = [pool.submit(c.generate, "k" * 10, max_tokens=30, ignore_eos=True)
                for _ in range(2)]
      r = c.generate("a", structured_outputs=dict(regex="[b-z]{40}"))
      [f.result() for f in others]
    assert engine.preemptions > 0
    assert r.text == want and r.finish_reason == pb.FINISH_REASON_STOP
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")


@pytest.mark.parametrize("jump_forward", [False, True])
def test_greedy_json_on_the_llama_decoder_is_the_masked_argmax(jump_forward):
  """On the tiny Llama (random weights, float32), a JSON schema's greedy
  output is, token by token, the argmax of a whole-sequence forward over the
  tokens the grammar allows there; and it parses to what the schema says.
  With jump_forward the forced tokens' KV comes from prompt chunks over the
  output: the tokens after them are the same."""
  import models

  from tests.serving.test_batching import _reference_logprobs

  model = models.load("tiny", dtype="float32")
  runner = E.ModelRunner(model, num_pages=64, page_size=8)
  engine = E.BatchingEngine(runner, E.EngineConfig(
      max_batch=4, batch_buckets=(1, 4), min_chunk=16, prefill_chunk=32, max_seq_len=128,
      warmup=False, jump_forward=jump_forward))
  prompt = [7, 300, 12, 45, 99, 3, 18]
  spec = api.StructuredOutputs(json=_OK_SCHEMA)
  h = engine.submit(api.Request("j", prompt_ids=prompt, add_bos=False,
                                sampling=api.SamplingParams(max_tokens=40, structured=spec)))
  while engine.step():
    pass
  ids, final = [], None
  while not h.events.empty():
    ev = h.events.get_nowait()
    assert not isinstance(ev, api.Failed), ev
    ids += ev.token_ids if isinstance(ev, api.Delta) else []
    final = ev if isinstance(ev, api.Final) else final
  assert final.reason == api.FinishReason.STOP
  out = json.loads(model.tokenizer.decode(ids))
  assert set(out) == {"ok", "tag"} and out["tag"] in ("ab", "cd")
  g, want = structured.Grammars(model.tokenizer, model.config.vocab_size).guide(spec), []
  while not g.stopped:
    lp = _reference_logprobs(model, prompt + want)[-1]
    want.append(int(np.argmax(np.where(g.allowed(), lp, -np.inf))))
    assert g.accept(want[-1:])
  assert ids == want
  assert (engine.jump_forward_tokens > 10) == jump_forward


@pytest.mark.parametrize("config", [dict(), dict(mixed_steps=True)], ids=["rows", "mixed"])
def test_jump_forward_takes_forced_tokens_without_steps(config):
  """jump_forward: the bytes a JSON schema forces ('"ok":', 'alse', ',"tag":"',
  'b"}') are taken at once and computed as prompt chunks. The outputs are
  those of one token a step (one tokenization per byte here), cut at
  max_tokens alike, in a fraction of the iterations; a request asking for
  logprobs, or with penalties, steps one token at a time."""
  def run(jump, **kw):
    engine = E.tiny_engine(max_batch=4, jump_forward=jump, **config)
    with running(engine) as (server, c):
      outs = [c.generate("a", structured_outputs=dict(json=_OK_SCHEMA), **kw),
              c.generate("a", structured_outputs=dict(json=_OK_SCHEMA), max_tokens=4, **kw)]
      wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")
      n = engine.counters()["jump_forward_tokens"]
      assert f"mosaic_serving_jump_forward_tokens_total {float(n)}" in server.metrics.render()
      return [(r.text, r.finish_reason) for r in outs], engine.counters()

  want = [('{"ok":false,"tag":"ab"}', pb.FINISH_REASON_STOP), ('{"ok', pb.FINISH_REASON_LENGTH)]
  (plain, n_plain), (fast, n_fast) = run(False), run(True)
  assert plain == fast == want
  assert n_plain["jump_forward_tokens"] == 0 and n_fast["jump_forward_tokens"] == 20 + 2
  assert n_fast["steps"] * 3 < n_plain["steps"], (n_fast["steps"], n_plain["steps"])
  for kw in (dict(logprobs=True), dict(repetition_penalty=1.1)):
    got, n = run(True, **kw)
    assert got == run(False, **kw)[0] and n["jump_forward_tokens"] == 0, kw


class _NoTokenBytes:
  """A tokenizer that does not say what bytes its tokens stand for (as a
  benchmark's id-only tokenizer): every other attribute is the wrapped one's."""

  def __init__(self, tok):
    self._tok = tok

  def __getattr__(self, name):
    if name in ("token_bytes", "tk"):
      raise AttributeError(name)
    return getattr(self._tok, name)


def test_a_tokenizer_without_token_bytes_serves_text_and_refuses_structured_outputs():
  """The warm-up builds the grammar tokenizer; where it cannot, the server
  still starts and serves plain requests, and structured ones are refused."""
  runner = E.CountingRunner()
  runner.tokenizer = _NoTokenBytes(runner.tokenizer)
  engine = E.BatchingEngine(runner, E.EngineConfig(warmup=True))
  with running(engine) as (_, c):
    assert c.generate("a", max_tokens=3).text == "bcd"
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", structured_outputs=dict(regex="[b-z]{3}"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not say what bytes" in e.value.details()


@pytest.mark.parametrize("jump_forward", [False, True])
def test_ngram_speculation_of_structured_outputs_is_plain_decodings_output(jump_forward):
  """Structured requests draft too (k = 4, counting model: after byte b
  comes b + 1). The drafts stop at the first token the grammar refuses ("g"
  after "def" for [b-f]+0) or at one that would complete the output (the
  "f" of "def"), and each position is checked under the grammar's set after
  the drafts before it, so the model's "g" gives way to the lowest allowed
  "0". Greedy, seeded and with logprobs, the outputs (finish reasons and
  logprobs too) are those of decoding without drafts, beside a plain
  request, with and without jump_forward (a JSON output drafted from its
  prompt); drafts are kept, and the pages come back."""
  from tests.serving.test_batching import _spec_run

  text = lambda t: [ord(c) for c in t]  # noqa: E731
  rx = lambda r: api.StructuredOutputs(regex=r)  # noqa: E731
  requests = [(text("abcdefgabc"), dict(max_tokens=20, structured=rx("[b-f]+0"))),
              (text("abcdefabc"), dict(max_tokens=20, structured=rx("def"))),
              (text("abcdefghijabcd"), dict(max_tokens=20, temperature=0.8, seed=3,
                                            structured=rx("[a-z]{3,9}"))),
              (text("klmnopklm"), dict(max_tokens=6, logprobs=True, top_logprobs=2,
                                       structured=rx("[k-z]+"))),
              (text("uvwxyzuvw"), dict(max_tokens=8)),
              (text('{"ok":false,"tag":"ab"}{"ok"'),
               dict(max_tokens=40, structured=api.StructuredOutputs(json=_OK_SCHEMA)))]
  runs = {}
  for k in (0, 4):
    engine = E.tiny_engine(max_batch=8, batch_buckets=(1, 2, 4, 8), num_speculative_tokens=k,
                           speculative_max_batch=8, speculative_patience=0,
                           jump_forward=jump_forward)
    runs[k] = _spec_run(engine, requests, logprobs=True)
    assert engine.stats().pages_in_use == 0
  outs = {k: [(ids, f.reason, f.completion_tokens) for ids, f, _ in run] for k, run in runs.items()}
  assert outs[4] == outs[0]
  assert engine.spec_accepted_tokens > 0 and engine.spec_draft_tokens > engine.spec_accepted_tokens
  got = [bytes(ids).decode() for ids, _, _ in outs[4]]
  assert got[:2] == ["def0", "def"] and got[5] == '{"ok":false,"tag":"ab"}'
  stop = api.FinishReason.STOP
  assert outs[4][0][1] == outs[4][1][1] == stop
  assert re.fullmatch("[a-z]{3,9}", got[2]) and re.fullmatch("[k-z]+", got[3])
  for a, b in zip(runs[4][3][2], runs[0][3][2]):
    assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert [t for t, _ in a.top] == [t for t, _ in b.top]
  assert len(runs[4][3][2]) == 6
  # Alone, the first takes "d" with its prompt, then "ef" as checked drafts
  # and the "0" after them: 2 calls, not 4.
  engine = E.tiny_engine(max_batch=8, batch_buckets=(1, 2, 4, 8), num_speculative_tokens=4)
  ((ids, _),) = _spec_run(engine, requests[:1])
  assert ids == text("def0") and engine.steps == 2 and engine.spec_accepted_tokens == 2


def test_ngram_speculation_of_json_on_the_llama_decoder():
  """The tiny Llama (random weights), a JSON schema, greedy and seeded, with
  k = 3 drafts that are plain decoding's own next tokens (every other call's
  last one changed, which the grammar refuses before it is checked): the
  outputs are plain decoding's, drafts are kept, and the checking calls'
  grammar form was compiled by the warm-up."""
  import itertools

  import models
  from serving.engine import sampling

  from tests.serving.test_batching import _llama_engine, _spec_run

  model = models.load("tiny", dtype="float32")
  spec = api.StructuredOutputs(json=_OK_SCHEMA)
  prompt = [7, 300, 12, 45, 99, 3, 18]
  requests = [(prompt, dict(max_tokens=40, structured=spec)),
              (prompt[2:], dict(max_tokens=40, temperature=0.9, seed=4, structured=spec))]
  outs = {}
  for k in (0, 3):
    _, engine = _llama_engine(model, warmup=bool(k), num_speculative_tokens=k,
                              speculative_patience=0)
    if k:
      engine.warmup()
      verify_shapes = sampling.verify_jit._cache_size()
      want = {f"r{i}": list(p) + outs[0][i] for i, (p, _) in enumerate(requests)}
      made, offered = itertools.count(), []

      def draft(seq, want=want, made=made, offered=offered):
        d = want[seq.req.request_id][len(seq.tokens):len(seq.tokens) + 3]
        if d and next(made) % 2:
          d[-1] = (d[-1] + 1) % model.config.vocab_size
        offered.append(len(d))
        return d
      engine.speculator.draft = draft
    run = _spec_run(engine, requests)
    assert all(f.reason == api.FinishReason.STOP for _, f in run)
    outs[k] = [ids for ids, _ in run]
    assert engine.stats().pages_in_use == 0
  assert outs[3] == outs[0]
  for ids in outs[3]:
    assert set(json.loads(model.tokenizer.decode(ids))) == {"ok", "tag"}
  assert 0 < engine.spec_accepted_tokens <= engine.spec_draft_tokens < sum(offered)
  assert sampling.verify_jit._cache_size() == verify_shapes


_TOO_COMPLEX = dict(regex="a{1000000}")  # compiles; llguidance's lexer gives up at a token


@pytest.mark.parametrize("config", [
    dict(), dict(jump_forward=True),
    dict(num_speculative_tokens=4, speculative_patience=0)], ids=["plain", "jump", "spec"])
def test_a_grammar_that_fails_inside_the_engine_ends_its_request_with_an_error(config):
  """A grammar that compiles but fails once tokens come (the lexer of
  a{1000000} gives up: "too many expressions constructed") ends its request
  with INVALID_ARGUMENT naming the reason, never OK/STOP with partial text;
  metrics count it as an error. Its n completions fail alike, the pages come
  back, and the server goes on serving (structured requests too)."""
  engine = E.tiny_engine(max_batch=4, **config)
  with running(engine) as (server, c):
    calls = (c.generate, lambda *a, **k: list(c.stream(*a, **k)))
    for call, n in ((calls[0], 1), (calls[1], 1), (calls[0], 2)):
      with pytest.raises(grpc.RpcError) as e:
        call("aaaaaaaa", max_tokens=20, n=n, structured_outputs=_TOO_COMPLEX)
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
      assert "too many expressions" in e.value.details()
    r = c.generate("a", structured_outputs=dict(regex="[b-d]{3}"))
    assert r.text == "bcd" and r.finish_reason == pb.FINISH_REASON_STOP
    wait_for(lambda: engine.stats().pages_in_use == engine.stats().running == 0,
             what="pages freed")
    finished = dict(re.findall(r'requests_finished_total\{reason="(\w+)"\} (\S+)',
                               server.metrics.render()))
    # (the failed call's second completion may be cancelled before it fails)
    assert float(finished["error"]) >= 3 and finished["stop"] == "1.0", finished
    assert float(finished["error"]) + float(finished.get("cancelled", 0)) == 4, finished
    engine.alloc.check()


def test_a_grammar_failure_over_http_is_400_or_an_error_event_then_done():
  import http.client

  engine = E.tiny_engine(max_batch=4)
  with running(engine, http_port=0) as (server, _):
    port = server.openai_http.server_port
    for stream in (False, True):
      conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
      conn.request("POST", "/v1/completions", body=json.dumps(
          {"prompt": "a", "max_tokens": 20, "stream": stream, "structured_outputs": _TOO_COMPLEX}))
      r = conn.getresponse()
      data = r.read().decode()
      conn.close()
      if not stream:
        assert r.status == 400 and "too many expressions" in json.loads(data)["error"]["message"]
        continue
      events = [e[len("data: "):] for e in data.split("\n\n") if e]
      assert events[-1] == "[DONE]", events
      error = json.loads(events[-2])["error"]
      assert error["code"] == 400 and "too many expressions" in error["message"]
      assert not any(json.loads(e).get("choices", [{}])[0].get("finish_reason")
                     for e in events[:-2])  # no finish before the error
    assert 'reason="error"} 2.0' in server.metrics.render()


def test_an_engine_process_reports_a_grammar_failure_and_counts_it():
  from serving.engine.process import ProcessEngine

  engine = ProcessEngine(E.tiny_engine, max_batch=4)
  with running(engine) as (server, c):
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=20, structured_outputs=_TOO_COMPLEX)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert c.generate("a", max_tokens=2).text == "bc"
    assert 'requests_finished_total{reason="error"} 1.0' in server.metrics.render()
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")


def test_a_refused_token_that_is_no_limit_is_internal(monkeypatch):
  """A grammar that refuses a token its own allowed set admitted, for no
  limit of the library's, is our bug: INTERNAL, still never a STOP."""
  engine = E.tiny_engine(max_batch=4)
  monkeypatch.setattr(structured.Guide, "accept", lambda self, ids: False)
  monkeypatch.setattr(structured.Guide, "error", property(lambda self: "Parser Error: no"))
  with running(engine) as (server, c):
    with pytest.raises(grpc.RpcError) as e:
      c.generate("a", max_tokens=20, structured_outputs=dict(regex="[b-d]{3}"))
    assert e.value.code() == grpc.StatusCode.INTERNAL and "Parser Error" in e.value.details()
    assert c.generate("a", max_tokens=2).text == "bc"
