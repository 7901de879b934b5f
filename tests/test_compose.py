"""What docker-compose.yml does, checked without a Docker engine.

The file is parsed with yaml and its ``${VAR...}`` references are resolved
here the way compose resolves them, for a given environment; the tests then
check what the stack would run: no start without a password, every service
authenticating with it, Redis reachable from the host's loopback only and
keeping an append-only file on a volume, every packrat-mq service's
command accepted by the real CLI that the image's ENTRYPOINT runs, and the
``monitoring`` profile's Prometheus scraping every packrat-mq service where
its settings say it exports, with a Grafana dashboard that shows every
exported family. Where Docker Compose v2 is installed, one more test checks
the resolver against it.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click
import pytest
import yaml
from redis.connection import parse_url

from packrat_mq.cli import main
from packrat_mq.exposition import FAMILIES
from packrat_mq.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "0123456789abcdef0123456789abcdef"  # hex, as docs/deployment.md recommends
LOOPBACK = {"127.0.0.1", "::1", "[::1]", "localhost"}


class InterpolationError(ValueError):
    """compose refuses the file for this environment."""


# $$ | ${NAME} | ${NAME<op>word} with op in :- - :? ? :+ + | $NAME
_REF = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<word>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>))"
)


def interpolate(text: str, env: dict[str, str]) -> str:
    """``text`` with compose's variable references substituted from ``env``."""

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        if m["invalid"] is not None:
            raise InterpolationError(f"invalid interpolation format in {text!r}")
        name = m["braced"] or m["bare"]
        op, word = m["op"], m["word"] or ""
        value = env.get(name)
        is_set = value is not None
        is_full = bool(value)  # the ":" forms also treat an empty value as unset
        present = is_full if op and op.startswith(":") else is_set
        if op in (":-", "-"):
            return value if present else word  # type: ignore[return-value]
        if op in (":?", "?"):
            if not present:
                raise InterpolationError(f"required variable {name} is missing a value: {word}")
            return value  # type: ignore[return-value]
        if op in (":+", "+"):
            return word if present else ""
        return value or ""

    return _REF.sub(one, text)


def resolve(node: Any, env: dict[str, str]) -> Any:
    """Every string of a parsed compose document, interpolated."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    return node


def host_ips(port: str | int | dict[str, Any]) -> list[str]:
    """The host addresses a ``ports`` entry binds (short or long syntax); "0.0.0.0" for all."""
    if isinstance(port, dict):
        return [str(port.get("host_ip") or "0.0.0.0")]
    spec = str(port).split("/", 1)[0]
    m = re.fullmatch(r"(?:(?P<ip>\[[^\]]+\]|[^:\[\]]+):)?(?P<host>[\d-]*):(?P<target>[\d-]+)", spec)
    if m is None:  # only a container port: published on an ephemeral port of every interface
        return ["0.0.0.0"]
    return [m["ip"] or "0.0.0.0"]


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def compose(raw: dict[str, Any]) -> dict[str, Any]:
    """The file as compose sees it with only REDIS_PASSWORD set."""
    return resolve(raw, {"REDIS_PASSWORD": PASSWORD})


def packrat_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run the image built from this repository's Dockerfile."""
    return {name: s for name, s in compose["services"].items() if "build" in s}


def _use_environment(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The process environment of ``service``'s container, as far as packrat-mq reads it."""
    for key in [k for k in os.environ if k.startswith("PACKRAT_")]:
        monkeypatch.delenv(key)
    for key, value in service.get("environment", {}).items():
        monkeypatch.setenv(key, str(value))


def test_the_resolver_follows_compose_rules() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $SET $$SET ${SET:+x}", env) == "v d  d v $SET x"
    with pytest.raises(InterpolationError, match="required variable EMPTY is missing a value: say so"):
        interpolate("a${EMPTY:?say so}", env)
    assert interpolate("${EMPTY?say so}", env) == ""
    with pytest.raises(InterpolationError, match="invalid interpolation"):
        interpolate("${not valid}", env)


@pytest.mark.parametrize("password", [None, ""])
def test_refuses_to_start_without_a_password(raw: dict[str, Any], password: str | None) -> None:
    env = {} if password is None else {"REDIS_PASSWORD": password}
    with pytest.raises(InterpolationError, match="required variable REDIS_PASSWORD is missing a value: set REDIS_PASSWORD"):
        resolve(raw, env)
    # Every place the password is used requires it: none falls back to a default password.
    uses = [("redis", "command"), ("redis", "environment")] + [
        (name, "environment") for name in packrat_services(raw)
    ]
    for service, part in uses:
        with pytest.raises(InterpolationError, match="REDIS_PASSWORD"):
            resolve(raw["services"][service][part], env)


def test_every_service_authenticates_with_the_password(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_svc = compose["services"]["redis"]
    args = redis_svc["command"]
    assert args[args.index("--requirepass") + 1] == PASSWORD
    # The healthcheck's redis-cli authenticates through REDISCLI_AUTH, not a password on its argv.
    assert redis_svc["environment"]["REDISCLI_AUTH"] == PASSWORD
    assert "-a" not in " ".join(redis_svc["healthcheck"]["test"]).split()

    services = packrat_services(compose)
    assert set(services) >= {"dispatcher", "workers"}
    for name, service in services.items():
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        _use_environment(service, monkeypatch)
        url = Settings().redis_url  # what the process in the container reads
        assert url is not None and PASSWORD in url, name
        parsed = parse_url(url)
        assert (parsed["password"], parsed["host"], parsed["port"]) == (PASSWORD, "redis", 6379), name


def test_a_password_with_reserved_characters_must_be_percent_encoded() -> None:
    """What docs/deployment.md says about PACKRAT_REDIS_URL, checked against redis-py."""
    password = "p/w@x:y?z#%"
    assert parse_url(f"redis://:{quote(password, safe='')}@redis:6379/0")["password"] == password
    try:  # unencoded, the URL no longer names this password and server, or does not parse at all
        parsed = parse_url(f"redis://:{password}@redis:6379/0")
    except ValueError:
        parsed = {}
    assert (parsed.get("password"), parsed.get("host")) != (password, "redis")


@pytest.mark.parametrize(
    ("port", "ips"),
    [
        ("6379:6379", ["0.0.0.0"]),
        ("6379", ["0.0.0.0"]),
        ("0.0.0.0:6379:6379/tcp", ["0.0.0.0"]),
        ("127.0.0.1:6379:6379", ["127.0.0.1"]),
        ("[::1]:6379:6379", ["[::1]"]),
        ("127.0.0.1::6379", ["127.0.0.1"]),
        ({"target": 6379, "published": 6379}, ["0.0.0.0"]),
        ({"target": 6379, "host_ip": "127.0.0.1"}, ["127.0.0.1"]),
    ],
)
def test_host_ips_reads_both_port_syntaxes(port: Any, ips: list[str]) -> None:
    assert host_ips(port) == ips


@pytest.mark.parametrize("redis_port", [None, "16379"])
def test_nothing_is_published_beyond_loopback(raw: dict[str, Any], redis_port: str | None) -> None:
    env = {"REDIS_PASSWORD": PASSWORD, **({"REDIS_PORT": redis_port} if redis_port else {})}
    for name, service in resolve(raw, env)["services"].items():
        assert service.get("network_mode") != "host", f"{name} would share the host's interfaces"
        for port in service.get("ports", []):
            assert set(host_ips(port)) <= LOOPBACK, f"{name} publishes {port!r} beyond loopback"


def test_redis_keeps_an_append_only_file_on_a_volume(compose: dict[str, Any]) -> None:
    redis_svc = compose["services"]["redis"]
    args = redis_svc["command"]
    assert args[0] == "redis-server"
    config = dict(zip(args[1::2], args[2::2], strict=True))  # --name value pairs
    assert config["--appendonly"] == "yes"
    assert config.get("--appendfsync", "everysec") in ("everysec", "always")
    mounts = {}
    for volume in redis_svc["volumes"]:
        if isinstance(volume, str):
            source, _, target = volume.partition(":")
            mounts[target.split(":", 1)[0]] = source
        else:
            mounts[volume["target"]] = volume.get("source")
    assert mounts.get("/data"), "no volume at /data: the AOF would die with the container"
    if not mounts["/data"].startswith((".", "/")):  # a named volume must be declared
        assert mounts["/data"] in (compose.get("volumes") or {})


def _image_cli() -> click.Command:
    """The click command the image's ENTRYPOINT runs: the console script pip installed under that name."""
    entrypoint = None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT"):
            entrypoint = yaml.safe_load(line.removeprefix("ENTRYPOINT"))  # exec form is a JSON list
    assert isinstance(entrypoint, list) and len(entrypoint) == 1, f"expected exec-form ENTRYPOINT, got {entrypoint!r}"
    (script,) = importlib.metadata.entry_points(group="console_scripts", name=entrypoint[0])
    return script.load()


def test_the_image_runs_the_packrat_cli() -> None:
    assert _image_cli() is main


@pytest.mark.parametrize("env", [{}, {"MODEL": "minilm", "THREADS": "4", "BATCH": "8", "INSTANCES": "2*2x4"}])
def test_commands_parse_with_the_real_cli(
    raw: dict[str, Any], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    compose = resolve(raw, {"REDIS_PASSWORD": PASSWORD, **env})
    cli = _image_cli()
    services = packrat_services(compose)
    assert set(services) >= {"dispatcher", "workers"}
    for name, service in services.items():
        _use_environment(service, monkeypatch)  # click reads PACKRAT_INSTANCES from it
        args = [str(a) for a in service["command"]]
        command: click.Command = cli
        while isinstance(command, click.Group):
            sub = command.get_command(click.Context(command), args[0])
            assert sub is not None, f"{name}: unknown packrat-mq command {args[0]!r}"
            command, args = sub, args[1:]
        ctx = command.make_context(command.name, args)  # raises on an unknown or malformed option
        assert ctx.params["model"] == env.get("MODEL", "resnet50"), name
        if "instances" in ctx.params:
            assert ctx.params["instances"] == (env.get("INSTANCES") or None), name


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of a service's bind mounts (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        source, _, rest = volume.partition(":")
        if source.startswith("."):
            out[rest.split(":", 1)[0]] = source
    return out


def test_the_monitoring_profile_scrapes_every_packrat_service(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    monitoring = {name for name, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    # Optional: the stack without the profile needs nothing of it.
    for name, service in services.items():
        if name not in monitoring:
            assert not set(service.get("depends_on", {})) & monitoring, name
    prometheus = services["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    config_file = ROOT / _mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_file.read_text())
    scraped: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                scraped[host] = sd["port"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                scraped[host] = int(port)
    exporting = {}
    for name, service in packrat_services(compose).items():
        _use_environment(service, monkeypatch)
        settings = Settings()  # what the process in the container reads
        assert settings.metrics_port is not None, f"{name} exports no metrics"
        # Reachable from Prometheus's container, and published on no host interface.
        assert settings.metrics_address == "0.0.0.0" and not service.get("ports"), name
        exporting[name] = settings.metrics_port
    assert scraped == exporting
    grafana = services["grafana"]
    for target, source in _mounts(grafana).items():
        assert (ROOT / source).exists(), f"grafana mounts {source}, which is not in the repository"
    assert _mounts(grafana)["/etc/grafana/dashboards/packrat-mq.json"] == "./deploy/grafana-dashboard.json"


def test_metrics_port_can_be_turned_off(raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    compose = resolve(raw, {"REDIS_PASSWORD": PASSWORD, "METRICS_PORT": ""})
    for name, service in packrat_services(compose).items():
        _use_environment(service, monkeypatch)
        assert Settings().metrics_port is None, name


def test_the_dashboard_shows_every_exported_family() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    used = set(re.findall(r"\b(packrat_[a-z_]+)", exprs))
    samples = {}
    for fam in FAMILIES:
        suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}[fam.kind]
        samples.update({fam.name + s: fam.name for s in suffixes})
    assert used - set(samples) == set(), "the dashboard queries metrics nobody exports"
    assert {f.name for f in FAMILIES} - {samples[u] for u in used} == set(), "families without a panel"
    assert {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p} == {"${datasource}"}


def _compose_cli() -> list[str] | None:
    """A Docker Compose v2 command line, if this machine has one (the development machine does not)."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        out = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2"):
            return cmd
    return None


def test_the_resolver_agrees_with_docker_compose(raw: dict[str, Any]) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose v2 here")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}

    def config(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, "-f", str(ROOT / "docker-compose.yml"), "--profile", "monitoring",
                               "config", "--format", "json"],
                              capture_output=True, text=True, env={**env, **extra}, cwd=ROOT, check=False)

    refused = config({})
    assert "required variable REDIS_PASSWORD is missing a value" in refused.stderr
    assert not refused.stdout.strip(), "compose printed a configuration without a password"
    extra = {"REDIS_PASSWORD": PASSWORD, "MODEL": "minilm", "INSTANCES": "2*2x4"}
    done = config(extra)
    assert done.returncode == 0, done.stderr
    real, ours = json.loads(done.stdout)["services"], resolve(raw, extra)["services"]
    for name, service in ours.items():
        command = [str(a) for a in service["command"]] if "command" in service else None
        assert real[name].get("command") == command, name
        assert real[name].get("environment", {}) == {k: str(v) for k, v in service.get("environment", {}).items()}, name
