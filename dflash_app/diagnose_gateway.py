"""``dflash diagnose --gateway [--metrics]``: a running deployment's figures for the report.

The probe prompts go through the gateway (greedy, the deployment's own speculation settings);
the verifier's Prometheus ``/metrics`` give its lifetime acceptance per drafter version (by
source too: drafter or suffix candidates), its policy's cost cells and tokens per tree step
(``dflash_app.diagnose_cost.scrape``).
"""

from __future__ import annotations

#: The domain whose prices decide the verdict: the deployment's lifetime traffic when read
#: (--gateway --metrics), else every probe prompt.
DEPLOYMENT = "deployment (lifetime)"


def gateway_figures(a, prompts, report: dict):
    """The deployment's live tau on the probe prompts (``report["live"]``), and its counters
    and cost cells (``report["deployment"]``). Returns (the cost table or None, chain blocks by
    domain or None, tokens per tree step by domain). Raises SystemExit naming ``--metrics``
    when a metrics endpoint cannot be read."""
    from dflash_app.diagnose_cost import blocks_from_rates, scrape
    from dflash_app.probe import gateway_probe

    live = gateway_probe(a.gateway, [p for _, p in prompts], max_tokens=a.max_tokens,
                         drafter=a.use_drafter, raw=a.raw)
    report["live"] = live_dict(live)
    blocks = {"all": blocks_from_rates(live.stats.per_position_rate)} if live.stats.drafts else None
    trees: dict[str, dict[int, float]] = {}
    costs = None
    if not a.metrics:
        report["notes"].append("--gateway without --metrics: the deployment's costs and lifetime "
                               "acceptance are not read; give the verifier's --metrics-port as "
                               "--metrics HOST:PORT to price on them")
    for url in a.metrics:
        try:
            dep = scrape(url)
        except OSError as e:
            raise SystemExit(f"dflash diagnose: error: --metrics {url}: {e}") from None
        version = a.use_drafter if "@" in a.use_drafter else dep.busiest()
        rates = dep.rates(version) if version else []
        report["deployment"] = {
            "source": dep.source, "drafter_version": version,
            "tau": 1 + dep.accepted.get(version, 0.0) / dep.drafts[version] if rates else None,
            "per_position": [round(r, 4) for r in rates], "drafts": dep.drafts.get(version, 0.0),
            "verify_ms": round(1e3 * dep.verify_mean.get(version, 0.0), 2),
            "draft_ms": round(1e3 * dep.draft_mean.get(version, 0.0), 2)}
        report["deployment"]["tree_tokens"] = dep.trees.get(version or "", {})
        report["deployment"]["accepted_by_source"] = dep.by_source.get(version or "", {})
        report["deployment"]["suffix_nodes"] = dep.suffix_nodes.get(version or "", 0.0)
        costs = dep.cost_table() or costs
        if rates:
            blocks = (blocks or {}) | {DEPLOYMENT: blocks_from_rates(rates)}
            trees[DEPLOYMENT] = dep.trees.get(version or "", {})
    return costs, blocks, trees


def live_dict(r) -> dict:
    """A ``dflash_app.probe.ProbeResult`` as the report's ``live`` entry."""
    s = r.stats
    return {"tau": s.mean_acceptance_length, "per_position": s.per_position_rate,
            "draft_acceptance_rate": s.draft_acceptance_rate, "drafts": s.drafts,
            "fallback_steps": s.fallback_steps, "block_size": r.block_size, "prompts": r.prompts,
            "accepted_by_source": {"drafter": s.drafter_accepted_tokens,
                                   "suffix": s.suffix_accepted_tokens},
            "seconds": r.seconds, "summary": r.summary()}
