"""docker-compose.yml as the container tests run it: each service's command, environment and
volumes as the file writes them (anchors and merge keys resolved), and the order its
``depends_on`` conditions start the services in. The image test starts the product's services
from these, so the file and the image cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class ComposeService:
    name: str
    built: bool
    """Built from the repository (the product's image), not pulled."""
    command: list[str]
    environment: dict[str, str]
    volumes: list[str]
    depends_on: dict[str, str]
    """Each service it waits for, and the condition: started, healthy, completed successfully."""
    profiles: list[str]


def services(path: Path) -> dict[str, ComposeService]:
    document = yaml.safe_load(path.read_text())
    return {name: _service(name, body) for name, body in document["services"].items()}


def _service(name: str, body: dict[str, Any]) -> ComposeService:
    depends = body.get("depends_on") or {}
    if isinstance(depends, list):
        depends = {other: {"condition": "service_started"} for other in depends}
    return ComposeService(
        name=name,
        built="build" in body,
        command=[str(part) for part in body.get("command") or []],
        environment={key: str(value) for key, value in (body.get("environment") or {}).items()},
        volumes=[str(volume) for volume in body.get("volumes") or []],
        depends_on={other: spec["condition"] for other, spec in depends.items()},
        profiles=list(body.get("profiles") or []),
    )


def start_order(found: dict[str, ComposeService]) -> list[str]:
    """The services ``docker compose up`` starts (no profile), each after what it depends on;
    ties in the file's order."""
    wanted = [name for name, service in found.items() if not service.profiles]
    order: list[str] = []
    while len(order) < len(wanted):
        ready = [
            name
            for name in wanted
            if name not in order and set(found[name].depends_on) <= set(order)
        ]
        assert ready, f"a dependency cycle or a missing service among {wanted}"
        order.append(ready[0])
    return order
