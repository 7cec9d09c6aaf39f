"""``dflash up --prometheus``: the local stack plus a Prometheus process scraping it.

The Docker-free twin of the compose stack's ``prometheus`` service: each service gets the same
``DFLASH_METRICS_PORT`` as in docker-compose.yml (9400 + the last two digits of its default gRPC
port: gateway 9450, verifier 9451, drafters 9461, 9462, ...), and a ``prometheus`` binary found
on PATH is started with a generated config (``<run_dir>/prometheus.yml``, same job names as
deploy/prometheus.yml, targets on the stack's host) and its data in ``<run_dir>/prometheus-data``.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import time
import urllib.request

import yaml

from dflash_app.launcher import LaunchError, LocalStack, StackConfig, verifier_name

DEFAULT_METRICS_PORTS = {"gateway": 9450, "verifier": 9451}
FIRST_DRAFTER_METRICS_PORT = 9461

INSTALL_HINT = """\
--prometheus needs a `prometheus` binary on PATH, and none was found.
Install it, then run the command again:
  Debian/Ubuntu:  sudo apt-get install prometheus   (the service it enables is not needed)
  elsewhere:      any Prometheus 2.x release; put its `prometheus` on PATH
Or use the compose stack's Prometheus: docker compose up -d prometheus grafana"""


def metrics_ports(cfg: StackConfig) -> dict[str, int]:
    """Process name -> metrics port: ``cfg.metrics_ports`` wins, the compose layout fills in
    (verifier replica r on 9451 + r, every replica's drafters from 9461 on)."""
    ports = {"gateway": DEFAULT_METRICS_PORTS["gateway"]}
    ports.update({verifier_name(r, cfg.verifiers): DEFAULT_METRICS_PORTS["verifier"] + r
                  for r in range(cfg.verifiers)})
    ports.update({f"drafter{i}": FIRST_DRAFTER_METRICS_PORT + i
                  for i in range(len(cfg.drafters) * cfg.verifiers)})
    ports.update(cfg.metrics_ports)
    return ports


def prometheus_config(cfg: StackConfig, scrape_interval: str = "5s") -> dict:
    """A Prometheus config scraping every service of ``cfg`` (jobs as in deploy/prometheus.yml)."""
    ports = metrics_ports(cfg)

    def target(name: str) -> dict:
        return {"targets": [f"{cfg.host}:{ports[name]}"], "labels": {"service": name}}

    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": "15s"},
        "scrape_configs": [
            {"job_name": "gateway", "static_configs": [target("gateway")]},
            {"job_name": "verifier", "static_configs": [target(verifier_name(r, cfg.verifiers))
                                                        for r in range(cfg.verifiers)]},
            {"job_name": "drafter",
             "static_configs": [target(f"drafter{i}")
                                for i in range(len(cfg.drafters) * cfg.verifiers)]},
        ],
    }


class PrometheusStack(LocalStack):
    """A :class:`LocalStack` that exposes /metrics on every service and runs Prometheus last."""

    def __init__(self, cfg: StackConfig, *, binary: str, port: int = 9090, **kw):
        cfg.metrics_ports = metrics_ports(cfg)
        super().__init__(cfg, **kw)
        self.binary = binary
        self.prometheus_port = port

    @classmethod
    def from_path(cls, **kw):
        """``cfg -> PrometheusStack`` using the ``prometheus`` on PATH.

        Raises SystemExit with install instructions when there is none (before anything starts).
        """
        binary = shutil.which("prometheus")
        if not binary:
            raise SystemExit(INSTALL_HINT)
        return functools.partial(cls, binary=binary, **kw)

    @property
    def prometheus_url(self) -> str:
        return f"http://{self.cfg.host}:{self.prometheus_port}"

    def start(self) -> "PrometheusStack":
        super().start()
        try:
            self.start_prometheus()
        except BaseException:
            self.stop()
            raise
        return self

    def start_prometheus(self, timeout_s: float = 30.0) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.run_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(self.cfg), sort_keys=False))
        log = open(self.run_dir / "prometheus.log", "w")
        p = subprocess.Popen(
            [self.binary, f"--config.file={config.resolve()}",
             f"--storage.tsdb.path={(self.run_dir / 'prometheus-data').resolve()}",
             f"--web.listen-address={self.cfg.host}:{self.prometheus_port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs["prometheus"] = p
        deadline = time.monotonic() + timeout_s
        while not http_ok(self.prometheus_url + "/-/ready"):
            if p.poll() is not None or time.monotonic() > deadline:
                state = f"exited with code {p.returncode}" if p.poll() is not None else "not ready"
                raise LaunchError(f"prometheus {state}:\n{self.log_tail('prometheus')}")
            time.sleep(0.2)
        targets = ", ".join(f"{n} :{port}" for n, port in metrics_ports(self.cfg).items())
        print(f"  prometheus {self.prometheus_url}  (scraping {targets}; config {config})",
              flush=True)


def http_ok(url: str) -> bool:
    """Whether ``url`` (a loopback health endpoint) answers 200 within a second."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(url, timeout=1.0) as r:
            return r.status == 200
    except OSError:
        return False

