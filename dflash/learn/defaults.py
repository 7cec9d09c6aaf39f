"""Online learning's defaults that the command line reads without the learner's dependencies
(``dflash learn`` runs with the client library alone)."""

#: Drafted steps each version serves before the canary watch decides. Served τ differs a lot
#: from prompt to prompt, and a 128-token answer is ~100 drafted steps: at 200 (two answers a
#: version) the bench kept a version 16% worse teacher-forced, on its prompts' luck; at 2000 it
#: rolled it back (served τ -6.5%, docs/learning.md "Benchmark").
MIN_DRAFTS = 2000
