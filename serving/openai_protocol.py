"""The OpenAI API's request and response bodies as pydantic models.

Requests are checked strictly (JSON's true is no count, 2.0 no integer: the
engine's own checks assume the types a proto guarantees) and refuse a field
they do not know (``extra="forbid"``): a field this server does not honour is
an error naming it, never ignored. ``parse`` turns a body into its model, or
into an ``APIError`` naming the field at fault and what it must be (each
field's description). Responses serialize with the fields they were given
(``exclude_unset``), as vLLM's and OpenAI's objects have them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 64  # completions per prompt, as serving.service.MAX_N (that module imports this one)
BAD_PROMPT = "a string, a list of token ids, or a list of either"


class APIError(Exception):
  """An OpenAI error object's content and its HTTP status."""

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.kind, self.param, self.headers = status, kind, param, headers

  def response(self) -> ErrorResponse:
    return ErrorResponse(error=ErrorDetail(message=str(self), type=self.kind, param=self.param,
                                           code=self.status))


# -- request bodies ------------------------------------------------------------------

def is_ids(p) -> bool:
  return isinstance(p, list) and bool(p) and all(
      isinstance(t, int) and not isinstance(t, bool) for t in p)


class _Body(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)

  @field_validator("*", mode="before")
  @classmethod
  def _null_is_default(cls, v, info):
    # OpenAI's spec makes its optional fields nullable, and clients send an
    # unset one as null: null means the default (n, stream, echo, ...).
    field = cls.model_fields[info.field_name]
    if v is None and not field.is_required() and field.default_factory is None:
      return field.default
    return v


def _f(what: str, default=None, **kw):
  return Field(default, description=what, **kw)


class TextPart(_Body):
  type: Literal["text"] = _f('"text"', ...)
  text: str = _f("a string", "")


class ChatMessage(_Body):
  role: str = _f("a string", ...)
  content: str | list[TextPart] = _f("a string or a list of text parts", ...)

  def text(self) -> str:
    # Text parts one per line, as vLLM joins them for a template that takes
    # a string.
    c = self.content
    return c if isinstance(c, str) else "\n".join(p.text for p in c)


class StreamOptions(_Body):
  include_usage: bool = _f("true or false", False)


class JSONSchemaFormat(_Body):
  name: str | None = _f("a string")
  description: str | None = _f("a string")
  schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                  description="a JSON schema (an object)")
  strict: bool | None = _f("true or false")  # (the output always matches the schema)


class ResponseFormat(_Body):
  type: Literal["text", "json_object", "json_schema"] = _f(
      "one of text, json_object, json_schema", ...)
  json_schema: JSONSchemaFormat | None = _f("{name, schema}")


class StructuredOutputsField(_Body):
  """vLLM's structured_outputs: exactly one of these."""
  json_: str | dict[str, Any] | None = _f("a JSON schema", alias="json")
  regex: str | None = _f("a string")
  choice: list[str] | None = _f("a list of strings")
  grammar: str | None = _f("a string")
  json_object: bool | None = _f("true or false")


class _Generation(_Body):
  """The fields completions and chat completions share."""
  model: str | None = _f("a string")
  max_tokens: int | None = _f("an integer")
  temperature: float | None = _f("a number")
  top_p: float | None = _f("a number")
  top_k: int | None = _f("an integer")
  min_p: float | None = _f("a number")
  presence_penalty: float | None = _f("a number")
  frequency_penalty: float | None = _f("a number")
  repetition_penalty: float | None = _f("a number")
  seed: int | None = _f("an integer")
  min_tokens: int | None = _f("an integer")
  ignore_eos: bool | None = _f("true or false")
  include_stop_str_in_output: bool | None = _f("true or false")
  truncate_prompt_tokens: int | None = _f("an integer")
  prompt_logprobs: int | None = _f("an integer")
  stop: str | list[str] | None = _f("a string or a list of strings")
  stop_token_ids: list[int] | None = _f("a list of integers")
  allowed_token_ids: list[int] | None = _f("a list of integers")
  logit_bias: dict[str, float] | None = _f("an object of token id -> number")
  n: int = _f(f"an integer in [1, {MAX_N}]", 1, ge=1, le=MAX_N)
  stream: bool = _f("true or false", False)
  stream_options: StreamOptions | None = _f("{include_usage}")
  response_format: ResponseFormat | None = _f("{type, json_schema}")
  structured_outputs: StructuredOutputsField | None = _f(
      "one of {json, regex, choice, grammar, json_object}")
  guided_json: str | dict[str, Any] | None = _f("a JSON schema")
  guided_regex: str | None = _f("a string")
  guided_choice: list[str] | None = _f("a list of strings")
  guided_grammar: str | None = _f("a string")
  priority: int | None = _f("an integer")
  user: str | None = _f("a string")  # (an end user's id: nothing to honour)

  @field_validator("logit_bias")
  @classmethod
  def _token_ids(cls, v):
    if v is not None and not all(re.fullmatch(r"-?[0-9]+", t) for t in v):
      raise ValueError("the keys must be token ids")
    return v


class CompletionRequest(_Generation):
  prompt: Any = _f(BAD_PROMPT, ...)
  logprobs: int | None = _f("an integer")
  echo: bool = _f("true or false", False)
  suffix: str | None = _f("a string")
  best_of: int | None = _f("an integer")
  add_special_tokens: bool = _f("true or false", True)

  @field_validator("prompt")
  @classmethod
  def _prompts(cls, p):
    if isinstance(p, str) or is_ids(p):
      return p
    if isinstance(p, list) and p and all(isinstance(x, str) or is_ids(x) for x in p):
      return p
    raise ValueError(BAD_PROMPT)


class ChatCompletionRequest(_Generation):
  messages: list[ChatMessage] = _f("a non-empty list of {role, content}", ..., min_length=1)
  max_completion_tokens: int | None = _f("an integer")
  logprobs: bool | None = _f("true or false")
  top_logprobs: int | None = _f("an integer")
  add_generation_prompt: bool = _f("true or false", True)
  tools: list[Any] | None = _f("a list")
  tool_choice: str | dict[str, Any] | None = _f("a string or an object")
  functions: list[Any] | None = _f("a list")


class TokenizeRequest(_Body):
  model: str | None = _f("a string")
  prompt: str | None = _f("a string")
  messages: list[ChatMessage] | None = _f("a non-empty list of {role, content}", min_length=1)
  add_special_tokens: bool | None = _f("true or false")
  add_generation_prompt: bool | None = _f("true or false")


class DetokenizeRequest(_Body):
  model: str | None = _f("a string")
  tokens: list[int] = _f("a list of token ids", ...)


# -- response bodies -----------------------------------------------------------------

class ResponseBody(BaseModel):
  """A response object: its JSON has the fields it was given (a stream's
  choice has no stop_reason until its last chunk), and a logprob of -inf is
  JSON's de-facto -Infinity, not null."""
  model_config = ConfigDict(ser_json_inf_nan="constants")

  def json_bytes(self) -> bytes:
    return self.model_dump_json(exclude_unset=True).encode()


class ErrorDetail(ResponseBody):
  message: str
  type: str
  param: str | None = None
  code: int


class ErrorResponse(ResponseBody):
  error: ErrorDetail


class Usage(ResponseBody):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int


class PromptLogprob(ResponseBody):
  """vLLM's Logprob: a token's logprob at a prompt position, its rank there
  (1: the likeliest; None where it is not among the k asked for) and text."""

  logprob: float
  rank: int | None = None
  decoded_token: str | None = None


# vLLM's prompt_logprobs: one entry per prompt token, None for the first (it
# has no context); each maps token ids (as JSON keys) to their logprobs: the
# prompt's own token and the k likeliest there.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(ResponseBody):
  tokens: list[str]
  token_logprobs: list[float | None]
  top_logprobs: list[dict[str, float] | None]
  text_offset: list[int]


class TopLogprob(ResponseBody):
  token: str
  logprob: float
  bytes: list[int]


class ContentLogprob(ResponseBody):
  token: str
  logprob: float
  bytes: list[int]
  top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseBody):
  content: list[ContentLogprob]


class CompletionChoice(ResponseBody):
  index: int
  text: str
  logprobs: CompletionLogprobs | None
  finish_reason: str | None
  stop_reason: int | str | None = None  # (a stream's last chunk of the choice only)
  prompt_logprobs: PromptLogprobs | None = None  # (every choice of the prompt)


class AssistantMessage(ResponseBody):
  role: Literal["assistant"]
  content: str


class ChatChoice(ResponseBody):
  index: int
  message: AssistantMessage
  logprobs: ChatLogprobs | None
  finish_reason: str
  stop_reason: int | str | None


class ChatDelta(ResponseBody):
  role: Literal["assistant"] | None = None
  content: str | None = None


class ChatChunkChoice(ResponseBody):
  index: int
  delta: ChatDelta
  logprobs: ChatLogprobs | None
  finish_reason: str | None
  stop_reason: int | str | None = None
  prompt_logprobs: PromptLogprobs | None = None  # (a stream's: at the choice's end)


class CompletionResponse(ResponseBody):
  id: str
  object: Literal["text_completion"]
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage | None = None


class ChatCompletionResponse(ResponseBody):
  id: str
  object: Literal["chat.completion"]
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage
  prompt_logprobs: PromptLogprobs | None = None  # (vLLM's place for chat: the response's)


class ChatCompletionChunk(ResponseBody):
  id: str
  object: Literal["chat.completion.chunk"]
  created: int
  model: str
  choices: list[ChatChunkChoice]
  usage: Usage | None = None


class ModelCard(ResponseBody):
  id: str
  object: Literal["model"]
  created: int
  owned_by: str
  max_model_len: int


class ModelList(ResponseBody):
  object: Literal["list"]
  data: list[ModelCard]


class TokenizeResponse(ResponseBody):
  count: int
  max_model_len: int
  tokens: list[int]


class DetokenizeResponse(ResponseBody):
  prompt: str


# -- validation errors as OpenAI errors -----------------------------------------------

def _short(v) -> str:
  r = repr(v)
  return r if len(r) <= 120 else r[:100] + f"... ({len(r)} chars)"


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _where(loc: tuple) -> str:
  """A field's path (messages[0].role) from pydantic's loc, without its union tags."""
  out = str(loc[0])
  for x in loc[1:]:
    if isinstance(x, int):
      out += f"[{x}]"
    elif x.isidentifier() and x.islower() and x not in _TYPE_TAGS:
      out += f".{x}"
  return out


def parse(model: type[BaseModel], raw: bytes):
  """``model`` from a JSON body; APIError naming the field at fault."""
  try:
    return model.model_validate_json(raw)
  except pydantic.ValidationError as e:
    err = e.errors(include_url=False)[0]
  kind, loc = err["type"], err["loc"]
  if kind == "json_invalid":
    why = err["ctx"]["error"]
    if "escape" in why or "unicode" in why:  # (\ud800 alone is no character: no UTF-8 holds it)
      why += " (JSON text is UTF-8: an escape of a lone surrogate is no character)"
    raise APIError(400, f"the body is not JSON: {why}")
  if not loc:
    raise APIError(400, "the body must be a JSON object")
  name, where = str(loc[0]), _where(loc)
  if kind == "extra_forbidden":
    raise APIError(400, f"the field {where!r} is not supported", param=where)
  field = model.model_fields.get(name) or next(
      (f for f in model.model_fields.values() if f.alias == name), None)
  what = field.description if field is not None else None
  if where == name:
    if kind == "missing":
      raise APIError(400, f"{name} is required: {what}", param=name)
    raise APIError(400, f"{name}={_short(err['input'])} must be {what}"
                   if what else f"{name}: {err['msg']}", param=name)
  detail = (f"{where} is required" if kind == "missing" else
            f"{where}={_short(err['input'])}: {err['msg']}")
  raise APIError(400, f"{name} must be {what} ({detail})" if what else detail, param=where)
