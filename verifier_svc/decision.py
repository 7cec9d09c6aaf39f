"""A step's speculation decision as it travels on the step's events to metrics and spans
(``verifier_svc.request.StepEvent``): a plain, torch-free record, so the hand-off types import
it without the policy that makes it (``verifier_svc.policy``) and all that the policy imports."""

from __future__ import annotations

import dataclasses
from enum import StrEnum

from dflash.core.speculation import SpecMode


class StepMode(StrEnum):
    """``Decision.mode`` where no one speculation mode names the step."""

    MIXED = "mixed"     # no adaptive session, and the sessions' modes differ


@dataclasses.dataclass(frozen=True)
class Decision:
    """One step's choice and the figures it was made from (for metrics and spans)."""

    mode: SpecMode | StepMode       # ADAPTIVE if any session is adaptive, else the batch's
                                    # mode (StepMode.MIXED: several)
    k: int                          # drafts chosen for adaptive sessions (-1: none adaptive)
    batch: int
    expected_tokens: float = 0.0    # sum over adaptive sessions of E_i[k]
    cost_seconds: float = 0.0       # estimated step seconds at k
    explored: bool = False
    waiting: int = 0                # prompts waiting for prefill (adaptive: no speculation)
    budget: int = 0                 # tree node budget chosen (0: a chain of k drafts)
    suffix: bool = False            # the chosen tree is of suffix candidates alone
    arm: str = ""                   # the mode race's arm (verifier_svc/mode_race.py; "": no race)
