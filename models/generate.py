"""Command line: greedy completion of a prompt.

  python -m models.generate --model default --prompt "The capital of France is"
  python -m models.generate --model path/to/hf_folder --chat --prompt "Hi!"

--model: default (embedded SmolLM2-135M-Instruct), tiny, an HF folder, a .gguf
file or an orbax directory. --attention/--decode-attention/--matmul/--norm
choose the ops' backends (names as in mosaic.registry).

The module is also the greedy helper: ``models.generate(model, prompt_ids,
max_new_tokens)`` calls ``models.model.generate`` (importing this module for
``-m`` would otherwise shadow the function of that name on the package).
"""

from __future__ import annotations

import argparse
import sys
import time
import types

from models.model import generate


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m models.generate", description=__doc__.split("\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--prompt", required=True)
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                 help="default: float32 on the CPU, bfloat16 elsewhere")
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
  p.add_argument("--attention", default=None, help="attention_prefill backend")
  p.add_argument("--decode-attention", default=None, help="attention_decode backend")
  p.add_argument("--matmul", default=None)
  p.add_argument("--norm", default=None, help="rms_norm backend")
  p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree ('tp' mesh axis)")
  p.add_argument("--quantization", default=None, choices=["fp8"],
                 help="fp8: the layers' linears W8A8 (quantized at load)")
  args = p.parse_args(argv)

  import models
  from models import jitted, llama

  llama.ops()  # registers backends, so that bad names fail before loading weights
  try:
    jitted.backends(attention_prefill=args.attention, attention_decode=args.decode_attention,
                   matmul=args.matmul, rms_norm=args.norm)
  except ValueError as e:
    p.error(str(e))
  t0 = time.perf_counter()
  try:
    model = models.load(args.model, dtype=args.dtype, tp=args.tp, quantization=args.quantization)
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  t1 = time.perf_counter()
  text = args.prompt
  if args.chat:
    try:
      text = model.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    except ValueError as e:  # (the template's own raise_exception, or a render error)
      print(f"error: {e}", file=sys.stderr)
      return 2
    if text is None:
      p.error(f"{args.model}: the model ships no chat template; drop --chat")
  ids = model.tokenizer.encode(text)
  if not args.chat:  # chat templates spell their special tokens themselves
    ids = ([model.tokenizer.bos_id] * model.tokenizer.add_bos + ids
           + list(model.tokenizer.eos_ids[:1]) * model.tokenizer.add_eos)
  try:
    out = generate(model, ids, args.max_new_tokens, attention=args.attention,
                   decode_attention=args.decode_attention, matmul=args.matmul, norm=args.norm)
  except ValueError as e:  # a backend named that cannot run this model's calls
    print(f"error: {e}", file=sys.stderr)
    return 2
  t2 = time.perf_counter()
  print(args.prompt + model.tokenizer.decode(out) if not args.chat else model.tokenizer.decode(out))
  print(f"[{model!r}: load {t1 - t0:.1f}s, {len(ids)} prompt + {len(out)} new tokens in "
        f"{t2 - t1:.1f}s]", file=sys.stderr)
  return 0


class _CallableModule(types.ModuleType):

  def __call__(self, *args, **kwargs):
    return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
  sys.exit(main())
