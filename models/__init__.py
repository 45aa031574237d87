"""models: a Llama-family decoder in Flax NNX, its checkpoints and tokenizers.

Data flows: ``load(spec)`` builds a ``ModelConfig`` (models.config), reads the
weights (HF safetensors folder, GGUF file, orbax directory, or random for
``"tiny"``) into our parameter tree (models.checkpoint), picks a tokenizer
(models.tokenizer) and returns a ``Model``. ``Model.prefill`` / ``Model.decode``
run the jitted decoder (models.llama) against a paged KV cache.

API used by serving::

  model = models.load(spec=None, dtype=None, tokenizer=None)
    # dtype None: float32 where jax's default device is the CPU, else bfloat16.
    # spec: None / "default" -> embedded SmolLM2-135M-Instruct (GGUF fetched
    #         into .cache/ by .ci/setup); "tiny" (or another named config of
    #         models.config, e.g. "llama3.1-8b") -> random weights (fixed seed)
    #         with a byte-level tokenizer that needs no files; a path to an HF
    #         folder (config.json + *.safetensors), a .gguf file, or an orbax
    #         directory written by models.checkpoint.save.
  model.config      # models.config.ModelConfig (frozen): vocab_size, num_layers,
                    #   num_heads, num_kv_heads, head_dim, max_position_embeddings ...
  model.params      # pytree (nested dict) of jax arrays
    # tokenizer: None = the checkpoint's (an HF folder without one loads for
    #   token-id prompts only: tokenizer.NoTokenizer, whose encode raises);
    #   False = none; a folder to read one from; or a Tokenizer.
    # HF config.json: every field is computed or refused at load with its name
    #   (models.config.hf_fields); README lists the supported features.
  model.tokenizer   # .encode(str) -> list[int]  (no BOS added)
                    # .decode(list[int]) -> str
                    # .bos_id: int | None, .eos_ids: tuple[int, ...]
                    # .add_bos: bool (prepend bos_id to a plain prompt)
                    # .apply_chat_template(messages) -> str  (None if the model has no template)
                    #   messages: [{"role": "user", "content": "..."}]

  cache = model.init_cache(num_pages, page_size=DEFAULT_PAGE_SIZE)
    # KVCache(k, v), each [num_layers, Hkv, num_pages, page_size, head_dim] in
    # model dtype. Page 0 is the null/scratch page: never hand it out; padding
    # rows and padding tokens write there.

  logits, cache = model.prefill(cache, tokens, positions, lengths, page_table)
    # tokens [B, T] int32: a chunk of each prompt, padded beyond lengths[b]
    # positions [B] int32: position of tokens[b, 0] = tokens of b already in the
    #   cache (0 for a fresh prompt; >0 for the next chunk of a chunked prefill)
    # lengths [B] int32: valid tokens in tokens[b] (0 = padding row)
    # page_table [B, max_pages] int32: pages of b, in order; the pages must cover
    #   positions[b] + lengths[b] tokens; entries beyond are any valid page (0)
    # -> logits [B, vocab] float32 at each row's last valid token; the cache
    #    (donated: do not reuse the one passed in).

  logits, cache = model.decode(cache, tokens, lengths, page_table)
    # tokens [B] int32 (one new token per sequence) or [B, Tq] (Tq <= 8,
    #   speculative verification)
    # lengths [B] int32: kv tokens of b INCLUDING the new ones (0 = padding row)
    # -> logits [B, vocab] (or [B, Tq, vocab]) float32; the cache (donated).

  Both pad B, T and max_pages up to buckets (models.jitted.BATCH_BUCKETS, ...)
  so that steady-state serving does not recompile, and slice the result back.
  A prefill whose positions are all 0 runs the "fresh" variant (static): each
  row attends within its own chunk, no page gather, and cuDNN can run it; a
  chunk on top of a cached prefix gathers the row's pages and masks by
  position/segment (backends: xla, reference, mosaic, triton). Decode reads
  each layer's pages in place (attention_decode(..., layer=)); sliding-window
  models decode through the masked attention_prefill instead.
  Lower level: models.jitted.prefill_step / decode_step (jitted; graphdef and
  backends static, cache donated).
  Tensor parallelism: models.load(spec, tp=N) shards weights (Megatron layout)
  and the cache (kv heads) over a 'tp' mesh; XLA's partitioner does the rest.
  Backends: model.prefill(..., attention="cudnn", matmul="xla") or the
  registry's ``use(...)`` context / MOSAIC_BACKEND_<OP> env vars; the names are
  static arguments of the jitted functions.

  models.generate(model, prompt_ids, max_new_tokens) -> list[int]  (greedy)

CLI: ``python -m models.generate --model default --prompt "..."``.
"""

from models.config import ModelConfig  # noqa: E402
from models.kv_cache import DEFAULT_PAGE_SIZE, KVCache  # noqa: E402
from models.model import Model, load, save  # noqa: E402

__all__ = ["DEFAULT_PAGE_SIZE", "KVCache", "Model", "ModelConfig", "generate", "load", "save"]


def __getattr__(name):
  # models.generate (a callable module: greedy helper + CLI) is imported on
  # first use, so that ``python -m models.generate`` runs it without runpy's
  # "found in sys.modules" warning.
  if name == "generate":
    import importlib

    return importlib.import_module("models.generate")
  raise AttributeError(f"module 'models' has no attribute {name!r}")
