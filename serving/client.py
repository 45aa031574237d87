"""A thin client of the TextGeneration service (used by the CLI and tests)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.proto import generate_pb2 as pb
from serving.proto import generate_pb2_grpc as pb_grpc

_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def make_request(prompt: str | Sequence[int] | Sequence[dict], *, request_id: str = "",
                 priority: int = 0, add_generation_prompt: bool | None = None,
                 **sampling) -> pb.GenerateRequest:
  """``prompt`` as text, token ids, or chat messages ({"role": ..., "content": ...}
  each); ``sampling`` keys are SamplingParams fields."""
  unknown = set(sampling) - _SAMPLING_FIELDS
  if unknown:
    raise ValueError(f"unknown sampling fields {sorted(unknown)}; valid: {sorted(_SAMPLING_FIELDS)}")
  sp = pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
  chat = not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], dict)
  if add_generation_prompt is not None and not chat:
    raise ValueError("add_generation_prompt applies to chat messages, not a text or ids prompt")
  if isinstance(prompt, str):
    prompt = dict(text=prompt)
  elif prompt and isinstance(prompt[0], dict):
    prompt = dict(chat=_chat(prompt, add_generation_prompt))
  else:
    prompt = dict(token_ids=pb.TokenIds(ids=list(prompt)))
  return pb.GenerateRequest(request_id=request_id, sampling=sp, priority=priority, **prompt)


def _chat(messages: Sequence[dict], add_generation_prompt: bool | None) -> pb.Chat:
  return pb.Chat(messages=[pb.ChatMessage(**m) for m in messages],
                 add_generation_prompt=add_generation_prompt)


class Client:

  def __init__(self, target: str, *, token: str | None = None, tls_ca: bytes | None = None,
               tls_server_name: str | None = None):
    if tls_ca is not None:
      opts = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
      self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(tls_ca), opts)
    else:
      self.channel = grpc.insecure_channel(target)
    self.stub = pb_grpc.TextGenerationStub(self.channel)
    self.health_stub = health_pb2_grpc.HealthStub(self.channel)
    self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

  def close(self) -> None:
    self.channel.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def stream(self, prompt, *, timeout: float | None = None, request_id: str = "",
             **sampling) -> Iterator[pb.GenerateStreamChunk]:
    """Server-streaming call; cancel it with ``.cancel()`` on the returned iterator."""
    return self.stub.GenerateStream(make_request(prompt, request_id=request_id, **sampling),
                                    timeout=timeout, metadata=self.metadata)

  def generate(self, prompt, *, timeout: float | None = None, request_id: str = "",
               **sampling) -> pb.GenerateResponse:
    return self.stub.Generate(make_request(prompt, request_id=request_id, **sampling),
                              timeout=timeout, metadata=self.metadata)

  def tokenize(self, text: str | Sequence[dict], add_bos: bool = False,
               add_generation_prompt: bool | None = None) -> pb.TokenizeResponse:
    """Token ids of text, or of chat messages as a chat prompt has them."""
    if isinstance(text, str):
      if add_generation_prompt is not None:
        raise ValueError("add_generation_prompt applies to chat messages, not text")
      req = pb.TokenizeRequest(text=text, add_bos=add_bos)
    else:
      if add_bos:
        raise ValueError("add_bos applies to text: a chat's BOS is its template's")
      req = pb.TokenizeRequest(chat=_chat(text, add_generation_prompt))
    return self.stub.Tokenize(req, metadata=self.metadata)

  def detokenize(self, token_ids: Sequence[int]) -> str:
    """The text of token ids, decoded whole."""
    return self.stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids),
                                metadata=self.metadata).text

  def model_info(self) -> pb.ModelInfoResponse:
    return self.stub.ModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

  def health(self, service: str = "", timeout: float = 5.0) -> int:
    """grpc.health.v1 Check: a ``health_pb2.HealthCheckResponse.ServingStatus``
    ("" is the server as a whole; an unknown service is NOT_FOUND)."""
    return self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=timeout).status

  def wait_ready(self, timeout: float = 120.0) -> None:
    grpc.channel_ready_future(self.channel).result(timeout=timeout)
