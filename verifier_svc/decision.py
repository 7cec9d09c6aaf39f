"""A step's speculation decision as it travels on the step's events to metrics and spans
(``verifier_svc.request.StepEvent``): a plain, torch-free record, so the hand-off types import
it without the policy that makes it (``verifier_svc.policy``) and all that the policy imports."""

from __future__ import annotations

import dataclasses

#: ``Decision.mode`` of a step without adaptive sessions whose sessions' modes differ.
MIXED = "mixed"


@dataclasses.dataclass(frozen=True)
class Decision:
    """One step's choice and the figures it was made from (for metrics and spans)."""

    mode: str                       # MODE_ADAPTIVE if any session is adaptive, else the batch's
                                    # mode (MIXED: several)
    k: int                          # drafts chosen for adaptive sessions (-1: none adaptive)
    batch: int
    expected_tokens: float = 0.0    # sum over adaptive sessions of E_i[k]
    cost_seconds: float = 0.0       # estimated step seconds at k
    explored: bool = False
    waiting: int = 0                # prompts waiting for prefill (adaptive: no speculation)
    budget: int = 0                 # tree node budget chosen (0: a chain of k drafts)
    suffix: bool = False            # the chosen tree is of suffix candidates alone
    arm: str = ""                   # the mode race's arm (verifier_svc/mode_race.py; "": no race)
