"""dflash.serving: service infrastructure shared by the three services: server lifecycle, telemetry, tracing, metrics, the log line, threads, TLS."""
