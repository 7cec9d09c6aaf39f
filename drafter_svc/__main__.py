from dflash.serving.omp import default_spin_count

default_spin_count()   # before torch is imported (libgomp reads it once, on load)

from drafter_svc.server import main  # noqa: E402

main()
