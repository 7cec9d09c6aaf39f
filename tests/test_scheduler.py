"""The scheduler decides and calls nobody: it imports no torch (the engine's state rides on each
job unread), and the engine core's loop is what runs its plans (verifier_svc/core.py).
Behaviour under load: tests/test_batching.py, tests/test_admission.py."""

from __future__ import annotations

import subprocess
import sys
import threading

from verifier_svc.scheduler import Admission, Job, Scheduler


def test_the_scheduler_imports_no_torch():
    code = ("import sys, verifier_svc.scheduler; "
            "assert 'torch' not in sys.modules, 'verifier_svc.scheduler loaded torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _job(rid: str, prompt_len: int) -> Job:
    from verifier_svc.request import Request

    req = Request(request_id=rid, prompt=list(range(1, prompt_len + 1)))
    return Job(req=req, decode=None, cancelled=lambda: False)  # type: ignore[arg-type]  # never read


def test_a_plan_holds_the_prefilled_jobs_and_cancelled_ones_leave():
    s = Scheduler(prefill_chunk=8, max_batch=2, admission=Admission(max_waiting=4))
    gone = threading.Event()
    a, b = _job("a", 4), _job("b", 4)
    b.cancelled = gone.is_set
    with s.cv:
        assert s.admit(a) and s.admit(b)
        s.take_incoming()
    assert s.leave() == [] and s.fresh_cycle()             # prompts wait: not a steady step
    assert s.next_prefill(8) is a
    s.started(a)
    a.prefilled = 4
    s.prefilled(a, joins=True)
    plan = s.plan(fresh=False)
    assert plan is not None and plan.jobs == [a] and plan.waiting == 1
    gone.set()
    assert s.leave() == [b] and s.next_prefill(8) is None  # b was cancelled before its prefill
    s.stepped(plan, [False])                               # a finished
    assert s.plan(fresh=False) is None and s.batch_size == 0
