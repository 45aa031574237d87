"""serving: a continuous-batching engine behind a gRPC text-generation API.

Data flows: a gRPC request (serving.service) becomes an engine ``Request``
(serving.engine.api) that the engine's scheduler thread admits by free KV
pages, prefills in chunks and decodes together with every other running
request, one jitted model step at a time (serving.engine.engine). Sampled
tokens go back to the request's output queue as ``Delta`` events and finally
a ``Final`` event, which the service turns into stream chunks. The service
depends only on the small ``Engine`` interface, so it is tested with a tiny
engine whose output is known.

Entry points: ``python -m serving serve | generate | loadgen`` (serving.cli).
"""
