"""Online learning's defaults that the command line reads without the learner's dependencies
(``dflash learn`` runs with the client library alone)."""

#: Drafted steps each version serves before the canary watch decides: served τ differs a lot
#: from prompt to prompt, so a window of a few answers decides by which prompts each version
#: drew (docs/bench/learning-history/README.md, "Capture's cost and the guards").
MIN_DRAFTS = 2000
