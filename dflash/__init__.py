"""dflash-serve's shared code, by layer: ``dflash.core`` (the algorithm), ``dflash.serving``
(what the services share), ``dflash.tools`` (CLI, bench, diagnose), ``dflash.train``,
``dflash.client`` (torch-free gRPC client), ``dflash.v1`` (generated stubs)."""
