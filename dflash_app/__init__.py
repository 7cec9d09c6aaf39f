"""The application layer (above the services): the ``dflash`` CLI, the local launcher, bench,
diagnose, probe, flood, target setup, conversions and the tiny test models' writers."""
