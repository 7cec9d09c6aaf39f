"""dflash-serve's shared code, by layer: ``dflash.core`` (the algorithm), ``dflash.serving``
(what the services share), ``dflash.recipe`` (the drafter's training recipe), ``dflash.learn``
(online learning), ``dflash.train`` (data generation and training), ``dflash.client``
(torch-free gRPC client), ``dflash.v1`` (generated stubs). The application layer (CLI, bench,
diagnose) is the top-level package ``dflash_app``."""
