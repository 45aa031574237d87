"""Flag values that more than one command line takes (``python -m serving
serve`` in serving.cli, ``python -m serving.profiler``), with what each means.
Only the standard library: the CLI imports this before anything heavy."""

# --kv-cache-dtype: flag -> the KV cache's dtype (None = the model's own;
# models.kv_cache.KV_DTYPES lists what a cache can hold).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn"}
