from drafter_svc.server import main

main()
