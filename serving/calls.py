"""What the gRPC (serving.service) and HTTP (serving.openai_api) front ends
do alike with one call: the prompt's size limit, the parameters of each of
its n completions, and the completions' events merged into one stream."""

from __future__ import annotations

import dataclasses
import queue
import threading

from serving.engine import api

MAX_PROMPT_CHARS = 1 << 20  # a prompt's text, or a chat's, is refused above this
_POLL_S = 0.05  # how often a forwarding thread checks that its call is still open


def completion_seed(seed: int, i: int) -> int:
  """Completion i's seed: ``seed`` itself for i = 0, else a 64-bit mix of both
  (splitmix64), so that no two completions of nearby seeds share draws."""
  if i == 0:
    return seed
  z = (seed + i * 0x9E3779B97F4A7C15) & (2**64 - 1)
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
  return z ^ (z >> 31)


def completion_params(sampling: api.SamplingParams, i: int) -> api.SamplingParams:
  """Completion i's parameters: its own seed (completion_seed), and no prompt
  logprobs past completion 0 (the prompt is scored once)."""
  if i == 0:
    return sampling
  seed = None if sampling.seed is None else completion_seed(sampling.seed, i)
  return dataclasses.replace(sampling, seed=seed, prompt_logprobs=None)


class Events:
  """A call's events as (completion index, event), for the gRPC and the HTTP
  front ends. One request's queue is read directly; with n > 1 a thread per
  request forwards its events into one queue, until its last event or
  ``close``."""

  def __init__(self, handles: list[api.RequestHandle]):
    self.n = len(handles)
    self._closed = threading.Event()
    if self.n == 1:
      self._q = handles[0].events
      return
    self._q = queue.SimpleQueue()
    for i, h in enumerate(handles):
      threading.Thread(target=self._forward, args=(i, h.events), daemon=True,
                       name=f"events-{i}").start()

  def _forward(self, i, events):
    while not self._closed.is_set():
      try:
        ev = events.get(timeout=_POLL_S)
      except queue.Empty:
        continue
      self._q.put((i, ev))
      if isinstance(ev, (api.Final, api.Failed)):
        return

  def get(self, timeout: float):
    ev = self._q.get(timeout=timeout)
    return (0, ev) if self.n == 1 else ev

  def get_nowait(self):
    ev = self._q.get_nowait()
    return (0, ev) if self.n == 1 else ev

  def close(self) -> None:
    self._closed.set()
