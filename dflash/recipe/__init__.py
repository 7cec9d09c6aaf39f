"""The drafter's training recipe (blocks, loss, trainer checkpoints), shared by the offline
trainer (``dflash.train``) and the online learner (``dflash.learn``, which runs inside the
drafter service): it imports only ``dflash.core``."""
