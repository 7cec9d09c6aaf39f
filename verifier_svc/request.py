"""What passes between the verifier's stages: a validated request, its step events, its trace.

Pure Python/torch types, imported by the scheduler, the engine, the servicer and the observer
alike (none of them imports another for a type).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from dflash.core.errors import PreconditionError  # re-exported: the stages import it from here
from dflash.core.grammar import GrammarSpec
from dflash.core.logits_processors import TokenLogprob
from dflash.core.proposer import MAX_BLOCK_SIZE, Proposer
from dflash.core.sampling import InvalidParam, Sampling
from dflash.core.speculation import MAX_TREE_BUDGET, MODES
from dflash.core.stats import AcceptanceCounter
from verifier_svc.decision import Decision
from verifier_svc.scheduler import SlowConsumer  # re-exported: defined where it is raised

MAX_SESSION_ID_CHARS = 1024     # the gateway's own bound (--max-session-id-chars) is tighter

__all__ = ["MAX_BLOCK_SIZE", "MAX_SESSION_ID_CHARS", "PreconditionError", "Request", "RequestTrace",
           "SlowConsumer", "StepEvent", "validate"]


class RequestTrace(Protocol):
    """Spans of one request, driven from the scheduler thread (``verifier_svc.observe``)."""

    def prefill_started(self) -> None: ...

    def step_started(self, step: int) -> dict[str, str]:
        """Open step ``step``'s span if it is traced; returns its W3C carrier for the drafter
        (empty when the step is not traced)."""

    def event(self, req: "Request", ev: "StepEvent") -> None:
        """An event left the scheduler (ends the prefill span or the step's span)."""


@dataclasses.dataclass(kw_only=True)
class Request:
    """One generation request, validated. ``proposer`` None = speculation off."""

    request_id: str
    session_id: str = ""
    prompt: list[int]
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    proposer: Proposer | None = None
    block_size: int = 0                 # 0 = the drafter's block size
    spec_mode: str = ""                 # "" = the engine's; else one of MODES
    tree_budget: int = 0                # largest tree in nodes (0 = the engine's tree budget)
    prefix_group: str = ""              # may share prompt KV with this group's sessions ("" = none)
    tenant: str = ""                    # whose recent answers may be suffix candidates (the
    #                                     gateway's client identity; "" = the anonymous tenant)
    resumed: int = 0                    # the prompt's last ``resumed`` ids are output another
    #                                     replica already sent (penalties count them as output)
    no_learn: bool = False              # the tenant opted out: drafters never capture it (--no-learn-tenants)
    grammar: GrammarSpec | None = None  # the output's constraint (dflash.core.grammar); None: free text
    trace: RequestTrace | None = None

    @property
    def session_key(self) -> str:
        """The engine's session id: one-shot requests get ``req-<request_id>``."""
        return self.session_id or f"req-{self.request_id}"


@dataclasses.dataclass(kw_only=True)
class StepEvent:
    """What one step committed. ``finish`` is set on the last event."""

    tokens: list[int]
    accepted: int = 0
    drafted: int = 0
    finish: str | None = None          # one of FINISH_REASONS (dflash.core.finish)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    fallback: str | None = None        # reason this step ran without speculation
    stats: AcceptanceCounter | None = None   # the request's counts so far (same object each step)
    prompt_tokens: int = 0             # set on the prefill event (the first)
    cached_prompt_tokens: int = 0      # prompt tokens not prefilled: reused from the session's
    #                                    cache, copied from the prefix cache or from another
    #                                    session of its prefix group
    batch_size: int = 1                # sessions verified in this step's target forward
    policy: Decision | None = None     # the speculation policy's choice for this step
    tree_nodes: int = 0                # nodes of the tree verified this step (0: a chain)
    suffix_nodes: int = 0              # of those, nodes from suffix candidates
    suffix_accepted: int = 0           # accepted tokens only a suffix candidate proposed
    grammar_accepted: int = 0          # accepted tokens only the grammar proposed (forced)
    step: int = -1                     # decode step index (-1: the prefill event)
    logprobs: list[TokenLogprob] | None = None   # one per token when sampling.logprobs


def validate(req: Request, vocab_size: int, window: int) -> None:
    """Raise InvalidParam naming the field for a request that cannot run on a target with
    ``vocab_size`` ids and a context window of ``window`` positions."""
    if not req.prompt:
        raise InvalidParam("prompt", "must not be empty")
    if req.max_tokens < 1:
        raise InvalidParam("max_tokens", f"must be >= 1, got {req.max_tokens}")
    bad = next((t for t in req.prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParam("prompt_token_ids", f"token id {bad} outside the vocabulary [0, {vocab_size})")
    if not 0 <= req.resumed < len(req.prompt):
        raise InvalidParam("resumed_tokens", f"must be in [0, {len(req.prompt)}) (the prompt's "
                           f"length), got {req.resumed}")
    if len(req.prompt) >= window:
        raise InvalidParam("prompt", f"{len(req.prompt)} tokens do not fit the context window "
                           f"of {window} tokens")
    if len(req.prompt) + req.max_tokens > window:
        raise InvalidParam("max_tokens", f"prompt ({len(req.prompt)}) + max_tokens "
                           f"({req.max_tokens}) exceeds the context window of {window} tokens")
    bad = next((t for t in req.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParam("stop_token_ids", f"token id {bad} outside the vocabulary [0, {vocab_size})")
    bad = next((t for t, _ in req.sampling.logit_bias if not t < vocab_size), None)
    if bad is not None:   # ids are >= 0 (Sampling checks)
        raise InvalidParam("logit_bias", f"token id {bad} outside the vocabulary [0, {vocab_size})")
    if len(req.prefix_group) > MAX_SESSION_ID_CHARS:
        raise InvalidParam("prefix_group", f"{len(req.prefix_group)} characters, more than "
                           f"{MAX_SESSION_ID_CHARS}")
    if len(req.tenant) > MAX_SESSION_ID_CHARS:
        raise InvalidParam("tenant", f"{len(req.tenant)} characters, more than {MAX_SESSION_ID_CHARS}")
    if len(req.session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidParam("session_id", f"{len(req.session_id)} characters, more than "
                           f"{MAX_SESSION_ID_CHARS}")
    if req.block_size < 0 or req.block_size > MAX_BLOCK_SIZE:
        raise InvalidParam("block_size", f"must be in [0, {MAX_BLOCK_SIZE}]")
    if req.spec_mode and req.spec_mode not in MODES:
        raise InvalidParam("speculation.mode", f"{req.spec_mode!r} not one of {', '.join(MODES)}")
    if not 0 <= req.tree_budget <= MAX_TREE_BUDGET:
        raise InvalidParam("speculation.tree_budget",
                           f"must be in [0, {MAX_TREE_BUDGET}], got {req.tree_budget}")
