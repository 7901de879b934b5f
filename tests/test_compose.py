"""The docker-compose stack cannot run here (no Docker engine); check its structure.

Every service command must be a packrat-mq command line that the real CLI
parses, the workers must wait for a healthy Redis, and the image must
install the pinned versions.
"""
from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import yaml

from packrat_mq.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _defaults(text: str) -> str:
    """Substitute ${VAR:-default} the way compose does with an empty environment."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_services_and_dependencies(compose: dict) -> None:
    services = compose["services"]
    assert set(services) >= {"redis", "dispatcher", "workers"}
    assert "healthcheck" in services["redis"]
    for name in ("dispatcher", "workers"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        env = services[name]["environment"]
        assert env["PACKRAT_REDIS_URL"].startswith("redis://")
        assert "@redis:6379" in env["PACKRAT_REDIS_URL"], "must authenticate to the compose Redis"


@pytest.mark.parametrize("service", ["dispatcher", "workers"])
def test_commands_parse_with_the_real_cli(compose: dict, service: str) -> None:
    args = [_defaults(a) for a in compose["services"][service]["command"]]
    name, *rest = args
    command = main.get_command(click.Context(main), name)
    assert command is not None, f"{service}: unknown packrat-mq command {name!r}"
    ctx = command.make_context(name, list(rest))  # raises on an unknown or malformed option
    assert ctx.params["model"]


def test_redis_password_is_required(compose: dict) -> None:
    cmd = compose["services"]["redis"]["command"]
    assert "--requirepass" in cmd


def test_dockerfile_installs_pinned_versions() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "constraints.txt" in text
    assert 'ENTRYPOINT ["packrat-mq"]' in text
    for folder in ("packrat_mq", "dispatcher", "workers", "optimizer", "profiles"):
        assert f"COPY {folder}" in text
