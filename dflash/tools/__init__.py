"""dflash.tools: operator and developer tools: the CLI, benchmarks, diagnose, probe, the local launcher, target setup, conversions, test model writers."""
