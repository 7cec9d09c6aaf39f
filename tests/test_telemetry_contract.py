"""The telemetry contract: span names, attribute keys and metric names are public (dashboards,
alerts and trace queries read them), so each is written once and pinned here. A package move or
a rename shows up as a diff of this file, and docs/observability.md says what changed.

- every name in ``dflash.serving.semconv`` with its value (:data:`SEMCONV`);
- the services' span code writes ``dflash.*`` keys and span names only through semconv (no
  string literal of one in the observe modules);
- the metric names of the Prometheus collectors (:data:`METRICS`; label values, fallback
  reasons included, are pinned by ``tests/test_fallback_reasons.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from dflash.serving import semconv

ROOT = Path(__file__).resolve().parents[1]

SEMCONV = {
    "OPERATION": "gen_ai.operation.name",
    "OP_CHAT": "chat",
    "OP_TEXT_COMPLETION": "text_completion",
    "REQUEST_MODEL": "gen_ai.request.model",
    "RESPONSE_MODEL": "gen_ai.response.model",
    "RESPONSE_ID": "gen_ai.response.id",
    "FINISH_REASONS": "gen_ai.response.finish_reasons",
    "TIME_TO_FIRST_CHUNK": "gen_ai.response.time_to_first_chunk",
    "INPUT_TOKENS": "gen_ai.usage.input_tokens",
    "OUTPUT_TOKENS": "gen_ai.usage.output_tokens",
    "CACHE_READ_INPUT_TOKENS": "gen_ai.usage.cache_read.input_tokens",
    "CHOICE_COUNT": "gen_ai.request.choice.count",
    "MAX_TOKENS": "gen_ai.request.max_tokens",
    "TEMPERATURE": "gen_ai.request.temperature",
    "TOP_P": "gen_ai.request.top_p",
    "TOP_K": "gen_ai.request.top_k",
    "SEED": "gen_ai.request.seed",
    "STREAM": "gen_ai.request.stream",
    "TAU": "dflash.mean_acceptance_length",
    "DRAFTS": "dflash.drafts",
    "DRAFT_TOKENS": "dflash.draft_tokens",
    "ACCEPTED_TOKENS": "dflash.accepted_tokens",
    "ACCEPTED_PER_POSITION": "dflash.accepted_per_position",
    "DRAFTER_VERSION": "dflash.drafter_version",
    "E2E_SECONDS": "dflash.e2e_seconds",
    "SPAN_VERIFIER_PREFILL": "verifier.prefill",
    "SPAN_VERIFIER_DECODE": "verifier.decode",
    "SPAN_VERIFIER_STEP": "verifier.step",
    "SPAN_DRAFTER_DRAFT": "drafter.draft",
    "ACCEPTED": "dflash.accepted",
    "ACCEPTED_DRAFTER": "dflash.accepted.drafter",
    "ACCEPTED_SUFFIX": "dflash.accepted.suffix",
    "ACCEPTED_TOKENS_DRAFTER": "dflash.accepted_tokens.drafter",
    "ACCEPTED_TOKENS_SUFFIX": "dflash.accepted_tokens.suffix",
    "BATCH_ITEMS": "dflash.batch_items",
    "BATCH_SIZE": "dflash.batch_size",
    "BLOCK_SIZE": "dflash.block_size",
    "CANCELLED": "dflash.cancelled",
    "CONTEXT_BYTES": "dflash.context_bytes",
    "CONTEXT_ROWS": "dflash.context_rows",
    "CONTEXT_START": "dflash.context_start",
    "DRAFT_SECONDS": "dflash.draft_seconds",
    "DRAFTED": "dflash.drafted",
    "DRAFTER_ADDRESS": "dflash.drafter_address",
    "DRAFTER_REQUESTED": "dflash.drafter_requested",
    "EMITTED": "dflash.emitted",
    "FALLBACK": "dflash.fallback",
    "FALLBACK_STEPS": "dflash.fallback_steps",
    "FINISH_REASON": "dflash.finish_reason",
    "POLICY_BATCH": "dflash.policy.batch",
    "POLICY_COST_SECONDS": "dflash.policy.cost_seconds",
    "POLICY_DRAFTS": "dflash.policy.drafts",
    "POLICY_EXPECTED_TOKENS": "dflash.policy.expected_tokens",
    "POLICY_EXPLORED": "dflash.policy.explored",
    "POLICY_TREE_BUDGET": "dflash.policy.tree_budget",
    "POLICY_WAITING": "dflash.policy.waiting",
    "REQUEST_ID": "dflash.request_id",
    "SESSION_ID": "dflash.session_id",
    "SPEC_MODE": "dflash.spec_mode",
    "SPECULATION": "dflash.speculation",
    "STEP": "dflash.step",
    "STEP_SUFFIX_NODES": "dflash.suffix.nodes",
    "SUFFIX_DRAFTS": "dflash.suffix_drafts",
    "SUFFIX_NODES": "dflash.suffix_nodes",
    "STEP_TREE_NODES": "dflash.tree.nodes",
    "STEP_TREE_PATH_LENGTH": "dflash.tree.path_length",
    "TREE_DRAFTS": "dflash.tree_drafts",
    "TREE_NODES": "dflash.tree_nodes",
    "VERIFY_SECONDS": "dflash.verify_seconds",
    "WIRE_SECONDS": "dflash.wire_seconds",
}

SPAN_CODE = ("verifier_svc/observe.py", "drafter_svc/observe.py", "gateway/observe.py")
METRIC_CODE = ("dflash/serving/metrics.py", "dflash/serving/speclog.py", "dflash/learn/idle.py",
               "gateway/emitted.py")
METRIC_KINDS = {"Counter", "Gauge", "Histogram", "Summary", "CounterMetricFamily",
                "GaugeMetricFamily", "HistogramMetricFamily", "SummaryMetricFamily"}
METRICS = {
    "dflash_drafter_batch_seconds",
    "dflash_drafter_context_bytes",
    "dflash_drafter_errors",
    "dflash_drafter_items",
    "dflash_gateway_resent_answers_spliced",
    "dflash_gateway_routed_requests",
    "dflash_gateway_running_requests",
    "dflash_learn_heldout_tau",
    "dflash_learn_steps",
    "dflash_learn_store_bytes",
    "dflash_learn_store_conversations",
    "dflash_learn_train_seconds",
    "dflash_request_acceptance_length",
    "dflash_request_completion_tokens",
    "dflash_request_e2e_seconds",
    "dflash_request_inter_token_latency_seconds",
    "dflash_request_prompt_tokens",
    "dflash_request_ttft_seconds",
    "dflash_requests",
    "dflash_spec_decode_acceptance_length",
    "dflash_spec_decode_context_bytes",
    "dflash_spec_decode_draft_seconds",
    "dflash_spec_decode_drafter_circuit_open",
    "dflash_spec_decode_drafter_circuit_trips",
    "dflash_spec_decode_drafter_deadline_seconds",
    "dflash_spec_decode_drafter_latency_seconds",
    "dflash_spec_decode_fallback_steps",
    "dflash_spec_decode_num_accepted_tokens",
    "dflash_spec_decode_num_accepted_tokens_by_source",
    "dflash_spec_decode_num_accepted_tokens_per_pos",
    "dflash_spec_decode_num_draft_tokens",
    "dflash_spec_decode_num_drafts",
    "dflash_spec_decode_num_suffix_nodes",
    "dflash_spec_decode_num_tree_drafts",
    "dflash_spec_decode_num_tree_nodes",
    "dflash_spec_decode_policy_drafts",
    "dflash_spec_decode_verify_seconds",
    "dflash_spec_decode_wire_seconds",
    "dflash_spec_policy_acceptance_rate",
    "dflash_spec_policy_accuracy",
    "dflash_spec_policy_hybrid_factor",
    "dflash_spec_policy_overhead_seconds",
    "dflash_spec_policy_race_explore_cost_tokens",
    "dflash_spec_policy_race_explored_seconds",
    "dflash_spec_policy_race_explored_steps",
    "dflash_spec_policy_race_leader",
    "dflash_spec_policy_race_seconds",
    "dflash_spec_policy_race_steps",
    "dflash_spec_policy_race_tokens_per_second",
    "dflash_spec_policy_step_seconds",
    "dflash_spec_policy_tree_tokens",
    "dflash_verifier_batch_sessions",
    "dflash_verifier_cached_prompt_tokens",
    "dflash_verifier_generation_tokens",
    "dflash_verifier_prefill_seconds",
    "dflash_verifier_prompt_tokens",
    "dflash_verifier_queue_wait_seconds",
    "dflash_verifier_rejected_requests",
    "dflash_verifier_running_requests",
    "dflash_verifier_step_batch_size",
    "dflash_verifier_waiting_prompt_tokens",
    "dflash_verifier_waiting_requests",
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
}
PUBLIC_LITERAL = re.compile(r"^(dflash\.(?!v1\.)[a-z_]+(\.[a-z_]+)*|(verifier|drafter)\.[a-z_]+)$")


def test_semconv_names_and_values_are_pinned():
    names = {n: v for n, v in vars(semconv).items() if n.isupper() and isinstance(v, str)}
    assert names == SEMCONV


def test_the_span_code_writes_public_names_only_through_semconv():
    found = []
    for rel in SPAN_CODE:
        tree = ast.parse((ROOT / rel).read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
                      and n.body and isinstance(n.body[0], ast.Expr)}
        found += [f"{rel}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and id(n) not in docstrings and PUBLIC_LITERAL.match(n.value)]
    assert found == []


def test_metric_names_are_pinned():
    names = set()
    for rel in METRIC_CODE:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            kind = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if kind in METRIC_KINDS and node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    assert names == METRICS


def test_the_speculation_key_is_the_one_published_before_the_package_move():
    # the dflash.speculation -> dflash.core.speculation module move rewrote this key by accident
    assert semconv.SPECULATION == "dflash.speculation"
