"""A request as the engine's parts see it (``Seq``): its tokens, where it
stands (``State``), its KV pages and batch slot, and what it has not sent.

The scheduler moves it between states (WAITING -> PREFILL -> DECODE -> DONE,
back to WAITING when preempted), the KV cache manager gives it ``pages`` and
``hashes`` and registers its computed pages, each dispatched call advances
``computed``, and the loop appends to ``generated`` as tokens are read back.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from serving.engine import api
from serving.engine.text import IncrementalText

if TYPE_CHECKING:
  from serving.engine import structured

# A request that speculation gains nothing for pauses drafting for this many
# of its tokens at first, doubling up to the second (EngineConfig.speculative_patience).
SPEC_PAUSE = (8, 256)


class State(enum.Enum):
  WAITING = 0
  PREFILL = 1
  DECODE = 2
  DONE = 3


class Seq:

  def __init__(self, req: api.Request, handle: api.RequestHandle, prompt: list[int],
               max_tokens: int, seed: int, tokenizer, order: int, eos_ids: frozenset[int],
               by_priority: bool = False):
    self.req, self.handle, self.params = req, handle, req.sampling
    self.prompt = prompt
    self.generated: list[int] = []
    self.max_tokens = max_tokens
    self.seed = seed
    # Admission order, and the reverse of preemption order: (0, arrival order)
    # in first-come-first-served scheduling, (priority, arrival order) under
    # priority.
    self.rank = (req.priority if by_priority else 0, order)
    self.state = State.WAITING
    self.pages: list[int] = []
    self.computed = 0  # tokens whose KV is in the cache
    self.registered = 0  # full pages registered in the prefix cache
    self.slot = -1
    self.cached_tokens = 0
    self.cancel: api.FinishReason | None = None
    self.text = IncrementalText(tokenizer, req.sampling.stop, context=prompt,
                                include_stop=req.sampling.include_stop_str_in_output)
    self.scheduled_at: float | None = None
    self.first_token_at: float | None = None
    self.hashes: list[bytes] | None = None
    self.final_sent = False
    self.pending = 0  # sampled tokens not read back yet
    # The tokens that end it: EOS unless ignored, and its stop token ids.
    self.ends = frozenset(req.sampling.stop_token_ids) | (
        frozenset() if req.sampling.ignore_eos else eos_ids)
    # Accepted tokens not handed to the client yet (EngineConfig.stream_interval).
    self.out_ids: list[int] = []
    self.out_text: list[str] = []
    self.out_lps: list[api.TokenLogprob] = []
    self.events_sent = 0
    self.stop_token: int | None = None  # the stop token id that ended it
    # Prompt logprobs asked for: (first position, tokens, device scores) per chunk.
    self.scored = req.sampling.prompt_logprobs is not None
    self.scores: list[tuple[int, int, tuple]] = []
    self.guide: structured.Guide | None = None  # structured outputs: the grammar's state
    # Speculation (EngineConfig.speculative_patience): checks in a row that
    # gained nothing, the next pause's length, and the generated-token count
    # at which drafting resumes.
    self.spec_misses, self.spec_pause, self.spec_resume = 0, SPEC_PAUSE[0], 0

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.generated if self.generated else self.prompt

  @property
  def num_tokens(self) -> int:
    """len(tokens) without building the list (a per-token check on long prompts)."""
    return len(self.prompt) + len(self.generated)
