"""models.tokenizer.from_folder reads an HF folder as transformers does: the
eos/bos ids (generation_config.json, then config.json, then the tokenizer),
which chat template (chat_template.jinja over tokenizer_config.json's, named
templates) and the Jinja environment it renders in.

The expectations are written out by construction (what transformers 5 does,
checked with it when these tests were written); the last test asks
transformers itself (.venv-oracle) about the same folders.
"""

import datetime
import json
import pathlib
import subprocess

import pytest

tokenizers = pytest.importorskip("tokenizers")

from models import tokenizer as tok_lib  # noqa: E402

VOCAB = {"<s>": 0, "</s>": 1, "<unk>": 2, "<|end|>": 3, "hi": 4, "yo": 5, "a": 6, "b": 7}
MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
# A Llama of the smallest shape: transformers (the oracle) builds it to read
# the folder's generation config as from_pretrained does.
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16,
         "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def _folder(d: pathlib.Path, *, tcfg=None, cfg=None, gen=None, jinja=None, extra=None,
            template_json=None, append_eos=False) -> pathlib.Path:
  """An HF folder: a WordLevel tokenizer.json (its post-processor appends
  </s> where ``append_eos``), tokenizer_config.json ``tcfg`` (bos <s>, eos
  </s> unless given), config.json (LLAMA + ``cfg``), generation_config.json
  ``gen`` (absent: None), chat_template.jinja, additional_chat_templates/
  (``extra``: name -> template) and chat_template.json."""
  from tokenizers import models, pre_tokenizers, processors

  d.mkdir(parents=True)
  tk = tokenizers.Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
  tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tk.add_special_tokens(["<s>", "</s>", "<unk>", "<|end|>"])
  if append_eos:
    tk.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                      special_tokens=[("</s>", 1)])
  tk.save(str(d / "tokenizer.json"))
  tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>"}
  tc.update(tcfg or {})
  (d / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tc.items()
                                                       if v is not None}))
  (d / "config.json").write_text(json.dumps({**LLAMA, **(cfg or {})}))
  if gen is not None:
    (d / "generation_config.json").write_text(json.dumps(gen))
  if jinja is not None:
    (d / "chat_template.jinja").write_text(jinja)
  for name, template in (extra or {}).items():
    (d / "additional_chat_templates").mkdir(exist_ok=True)
    (d / "additional_chat_templates" / f"{name}.jinja").write_text(template)
  if template_json is not None:
    (d / "chat_template.json").write_text(json.dumps({"chat_template": template_json}))
  return d


# --- 1. eos / bos ids -------------------------------------------------------

# name -> (folder kwargs, eos ids as a set, eos_ids[0]). transformers' generate
# stops at generation_config.json's eos_token_id where the file is there, else
# at config.json's (GenerationConfig.from_model_config).
EOS_CASES = {
    "generation_config": (dict(gen={"eos_token_id": [5, 1]}, cfg={"eos_token_id": 6}), {5, 1}, 1),
    "config_list": (dict(cfg={"eos_token_id": [6, 1]}), {6, 1}, 1),
    "config_int": (dict(cfg={"eos_token_id": 6}), {6}, 6),
    "config_null": (dict(cfg={"eos_token_id": None}), {1}, 1),  # then the tokenizer's
    "tokenizer_only": (dict(cfg={}), {1}, 1),
    # (transformers would stop nowhere: generation_config.json without the key)
    "generation_config_without_eos": (dict(gen={"do_sample": False}, cfg={"eos_token_id": 6}),
                                      {6}, 6),
}


@pytest.mark.parametrize("case", sorted(EOS_CASES))
def test_eos_ids_generation_config_then_config_then_tokenizer(tmp_path, case):
  kwargs, want, first = EOS_CASES[case]
  tok = tok_lib.from_folder(_folder(tmp_path / case, **kwargs))
  assert set(tok.eos_ids) == want and len(tok.eos_ids) == len(want)
  assert tok.eos_ids[0] == first  # the tokenizer's own eos first where it is one
  # The chat template's eos_token is the tokenizer's (tokenizer_config), as in
  # transformers, whatever ids generation stops at.
  assert tok.eos_token == "</s>"


def test_bos_id_is_the_tokenizers_then_generation_config_then_config(tmp_path):
  # The tokenizer's bos is what transformers' tokenizer prepends to a prompt.
  tok = tok_lib.from_folder(_folder(tmp_path / "a", gen={"bos_token_id": 3},
                                    cfg={"bos_token_id": 6}))
  assert tok.bos_id == 0 and tok.bos_token == "<s>"
  tok = tok_lib.from_folder(_folder(tmp_path / "b", tcfg={"bos_token": None},
                                    gen={"bos_token_id": 3}, cfg={"bos_token_id": 6}))
  assert tok.bos_id == 3 and tok.bos_token == "<|end|>"
  tok = tok_lib.from_folder(_folder(tmp_path / "c", tcfg={"bos_token": None},
                                    cfg={"bos_token_id": 6}))
  assert tok.bos_id == 6 and tok.bos_token == "a"


def test_eos_the_post_processor_appends_stays_first(tmp_path):
  """A tokenizer whose encode appends </s> ("$A </s>"): add_eos appends
  eos_ids[0], which stays </s> when config.json lists another id first."""
  tok = tok_lib.from_folder(_folder(tmp_path / "d", cfg={"eos_token_id": [6, 1]},
                                    append_eos=True))
  assert tok.add_eos and tok.eos_ids == (1, 6)


def test_sentencepiece_eos_from_config(tmp_path):
  spm = pytest.importorskip("sentencepiece")
  text = tmp_path / "corpus.txt"
  text.write_text("\n".join(f"the {w} sat on the mat number {i}" for i, w in
                            enumerate(["cat", "dog", "bird", "fox", "cow"] * 20)))
  d = tmp_path / "sp"
  d.mkdir()
  spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(d / "tokenizer"),
                                 vocab_size=40, model_type="bpe", bos_id=1, eos_id=2,
                                 unk_id=0, pad_id=-1)
  (d / "config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
  tok = tok_lib.from_folder(d)
  assert tok.eos_ids == (2, 7) and tok.bos_id == 1 and tok.add_bos
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
  assert tok_lib.from_folder(d).eos_ids == (9,)
  (d / "generation_config.json").unlink()
  (d / "config.json").write_text("{}")
  assert tok_lib.from_folder(d).eos_ids == (2,)  # the model's own


# --- 2. which chat template -----------------------------------------------

CFG_T = "CFG{% for m in messages %}{{ m['content'] }}{% endfor %}"
JINJA_T = "JINJA{% for m in messages %}{{ m['content'] }}{% endfor %}"
# name -> (folder kwargs, the rendered text, or the error's words)
TEMPLATE_CASES = {
    "jinja_over_tokenizer_config": (dict(jinja=JINJA_T, tcfg={"chat_template": CFG_T}),
                                    "JINJAhiyo"),
    "tokenizer_config": (dict(tcfg={"chat_template": CFG_T}), "CFGhiyo"),
    "named_list_default": (dict(tcfg={"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CFG_T}]}),
        "CFGhiyo"),
    "named_dict_default": (dict(tcfg={"chat_template": {"rag": "RAG", "default": CFG_T}}),
                           "CFGhiyo"),
    "named_list_without_default": (dict(tcfg={"chat_template": [
        {"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}),
        ValueError("named chat templates ['a', 'b'] and none named 'default'")),
    "additional_with_jinja": (dict(jinja=JINJA_T, extra={"rag": "RAG"},
                                   tcfg={"chat_template": CFG_T}), "JINJAhiyo"),
    # additional_chat_templates/ replace tokenizer_config's templates, and
    # have no default here
    "additional_without_jinja": (dict(extra={"rag": "RAG"}, tcfg={"chat_template": CFG_T}),
                                 ValueError("named chat templates ['rag']")),
    # chat_template.json is a processor's file: AutoTokenizer does not read it
    "template_json_and_tokenizer_config": (dict(template_json="JSON",
                                                tcfg={"chat_template": CFG_T}), "CFGhiyo"),
    "template_json_only": (dict(template_json="JSON"), ValueError("chat_template.json")),
    "none": (dict(), None),
}


@pytest.mark.parametrize("case", sorted(TEMPLATE_CASES))
def test_chat_template_precedence(tmp_path, case):
  kwargs, want = TEMPLATE_CASES[case]
  tok = tok_lib.from_folder(_folder(tmp_path / case, **kwargs))
  if isinstance(want, ValueError):
    with pytest.raises(ValueError, match=str(want).replace("[", r"\[").replace("]", r"\]")):
      tok.apply_chat_template(MSGS, add_generation_prompt=False)
  else:
    assert tok.apply_chat_template(MSGS, add_generation_prompt=False) == want


# --- 3. the Jinja environment ---------------------------------------------

# name -> (template, what transformers renders for MSGS without a generation prompt)
ENV_CASES = {
    "break": ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}", "<user>hi"),
    "continue": ("{% for m in messages %}{% if m['role'] == 'user' %}{% continue %}{% endif %}"
                 "{{ m['content'] }}{% endfor %}", "yo"),
    "generation_block": ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                         "{% generation %}[{{ m['content'] }}]{% endgeneration %}"
                         "{% else %}{{ m['content'] }}{% endif %}{% endfor %}", "hi[yo]"),
    # jinja's own tojson sorts keys and writes \u escapes for é and <
    "tojson_key_order_and_unicode": ('{{ {"zeta": "é<", "alpha": 1} | tojson }}',
                                     '{"zeta": "é<", "alpha": 1}'),
    "tojson_indent": ("{{ messages[0] | tojson(indent=2) }}",
                      '{\n  "role": "user",\n  "content": "hi"\n}'),
    "tojson_separators": ('{{ messages[0] | tojson(separators=(",", ":")) }}',
                          '{"role":"user","content":"hi"}'),
    "tojson_sort_keys": ("{{ messages[0] | tojson(sort_keys=true) }}",
                         '{"content": "hi", "role": "user"}'),
    "strftime_now": ("{{ strftime_now('%Y') | length }}|{{ messages | length }}", "4|2"),
    "trim_and_lstrip_blocks": ("{% for m in messages %}\n    {% if true %}\n{{ m['content'] }}\n"
                               "    {% endif %}\n{% endfor %}", "hi\nyo\n"),
    "namespace": ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                  "{% endfor %}{{ ns.n }}", "2"),
    "dict": ("{{ dict(a=1)['a'] }}", "1"),
    "tools_and_documents_are_none": ("{{ tools is none }} {{ documents is none }}", "True True"),
    "bos_eos_tokens": ("{{ bos_token }}{{ eos_token }}", "<s></s>"),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_chat_template_environment(tmp_path, case):
  template, want = ENV_CASES[case]
  tok = tok_lib.from_folder(_folder(tmp_path / case, jinja=template))
  assert tok.apply_chat_template(MSGS, add_generation_prompt=False) == want


def test_strftime_now_is_now(tmp_path):
  tok = tok_lib.from_folder(_folder(tmp_path / "t", jinja="{{ strftime_now('%Y-%m') }}"))
  before = datetime.datetime.now().strftime("%Y-%m")
  out = tok.apply_chat_template(MSGS)
  assert out in (before, datetime.datetime.now().strftime("%Y-%m"))


# name -> (template, what the ValueError says)
RAISING = {
    "raise_exception": ("{{ raise_exception('no system message') }}",
                        "chat template: no system message"),
    "type_error": ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    "undefined": ("{{ nothing.here }}", "UndefinedError"),
    "zero_division": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "immutable_sandbox": ("{{ messages.append(1) }}", "SecurityError"),
    "namespace_underscore": ("{% set ns = namespace(_x=1) %}", "SecurityError"),
    "tojson_of_a_function": ("{{ raise_exception | tojson }}", "TypeError"),
    "syntax": ("{% for m in messages %}", "does not parse"),
}


@pytest.mark.parametrize("case", sorted(RAISING))
def test_what_a_template_raises_is_a_value_error(tmp_path, case):
  """Whatever the template raises is a ValueError (INVALID_ARGUMENT at the
  server), not a jinja error or a Python one from inside the template."""
  template, words = RAISING[case]
  tok = tok_lib.from_folder(_folder(tmp_path / case, jinja=template))
  with pytest.raises(ValueError, match=words) as e:
    tok.apply_chat_template(MSGS)
  assert type(e.value) is ValueError


# --- against transformers itself ------------------------------------------

_ORACLE = r"""
import json, pathlib, shutil, sys, tempfile
import transformers

cases = json.loads(pathlib.Path(sys.argv[1]).read_text())
out = {}
for name, (folder, msgs) in cases.items():
  r = {}
  t = transformers.AutoTokenizer.from_pretrained(folder)
  try:
    r["chat"] = t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
  except Exception as e:
    r["chat_error"] = f"{type(e).__name__}: {e}"
  if not name.startswith("eos_"):
    out[name] = r
    continue
  # The eos ids generate stops at: the model loaded from the folder (weights
  # written here, the folder's own config.json and generation_config.json).
  with tempfile.TemporaryDirectory() as tmp:
    cfg = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
    shutil.copy(pathlib.Path(folder) / "config.json", tmp)
    gen = pathlib.Path(folder) / "generation_config.json"
    if gen.exists():
      shutil.copy(gen, tmp)
    else:
      (pathlib.Path(tmp) / "generation_config.json").unlink(missing_ok=True)
    eos = transformers.AutoModelForCausalLM.from_pretrained(tmp).generation_config.eos_token_id
  r["eos"] = [eos] if isinstance(eos, int) else eos
  out[name] = r
print(json.dumps(out))
"""


def test_against_transformers(tmp_path):
  from tests.models.conftest import oracle_python

  py = oracle_python()
  if py is None:
    pytest.skip("no oracle interpreter (.venv-oracle with torch + transformers): run .ci/setup")
  cases = {}
  # The eos cases where transformers has ids at all: where the file it reads
  # has none, transformers' generate stops nowhere, or (config.json without
  # the key) at LlamaConfig's default 2; ours then stops at the tokenizer's.
  for name in ("generation_config", "config_list", "config_int"):
    cases[f"eos_{name}"] = (_folder(tmp_path / f"eos_{name}", **EOS_CASES[name][0]), MSGS[:1])
  for name, (kwargs, _) in TEMPLATE_CASES.items():
    cases[f"tmpl_{name}"] = (_folder(tmp_path / f"tmpl_{name}", **kwargs), MSGS)
  for name, (template, _) in ENV_CASES.items():
    cases[f"env_{name}"] = (_folder(tmp_path / f"env_{name}", jinja=template), MSGS)
  spec = tmp_path / "cases.json"
  spec.write_text(json.dumps({k: (str(d), m) for k, (d, m) in cases.items()}))
  r = subprocess.run([py, "-c", _ORACLE, str(spec)], capture_output=True, text=True,
                     timeout=600, cwd=tmp_path)  # (not the repo: its kernels/ shadows theirs)
  assert r.returncode == 0, r.stderr[-4000:]
  ref = json.loads(r.stdout.strip().splitlines()[-1])
  for name, (d, msgs) in cases.items():
    tok, theirs = tok_lib.from_folder(d), ref[name]
    if name.startswith("eos_"):
      assert set(tok.eos_ids) == set(theirs["eos"]), (name, theirs)
      continue
    if "chat_error" in theirs:  # refused; or (no template at all) None: "send text"
      try:
        ours = tok.apply_chat_template(msgs, add_generation_prompt=False)
      except ValueError:
        continue
      assert ours is None and name == "tmpl_none", (name, ours, theirs)
    else:
      assert tok.apply_chat_template(msgs, add_generation_prompt=False) == theirs["chat"], name
