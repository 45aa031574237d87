"""mosaic: the typed layer between our kernels and Pallas / Mosaic GPU.

Modules: target (what machine, its ceilings), dsl (primitives + helpers,
interpret mode on CPU), registry (ops x backends by short name), tuning
(configs, autotuner, JSON tables), cost (FLOPs/bytes, utilization), bench
(device timing, tables), testing (reference comparison), torch (interop).
"""
