"""dflash.core: the algorithm: models, checkpoints, sampling, statistics, taps, the wire format."""
