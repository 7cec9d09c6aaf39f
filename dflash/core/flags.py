"""Flag vocabularies shared by the model services (:mod:`dflash.core.device`) and the ``dflash``
CLI, which builds its parsers without importing torch: one list of each, importable anywhere."""

from __future__ import annotations

DEVICE_FLAGS = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_FLAGS = ("auto", "bfloat16", "float16", "float32")
#: ``--packed-linear``: oneDNN products on prepacked weights (``kernels.packed_linear``);
#: "auto" = measured at start against the other CPU paths. The kernels' own list is
#: ``kernels.skinny_linear.PRODUCT_MODES`` (kernels import nothing of dflash; a test pins both).
PACKED_CHOICES = ("auto", "on", "off")
#: ``--batch-invariant``: the batch-invariant kernels (``kernels.invariant``); "auto" = on where
#: the CPU kernels build (``kernels.invariant.resolve``).
INVARIANT_CHOICES = ("auto", "on", "off")
