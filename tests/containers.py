"""The repository's image run as a container engine would run it, with buildah (chroot
isolation, the host's network): the image's own entrypoint, command, environment, user and
working directory, a host folder as its volume, PID 1's signals sent to tini."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulator.processes import kill_tree, process_tree

IMAGE = os.environ.get("CDC_TEST_IMAGE", "localhost/spanner-delta-cdc:test")
"""What ``make image`` builds (the Makefile's IMAGE)."""


@dataclass(frozen=True)
class ImageConfig:
    """What a container engine takes from the image to start a container."""

    entrypoint: list[str]
    command: list[str]
    user: str
    workdir: str
    healthcheck: list[str]

    @classmethod
    def of(cls, image: str) -> ImageConfig:
        shown = subprocess.run(
            ["buildah", "inspect", "--type", "image", image],
            capture_output=True,
            text=True,
            check=True,
        )
        config = json.loads(shown.stdout)["Docker"]["config"]
        test = (config.get("Healthcheck") or {}).get("Test") or []
        return cls(
            config.get("Entrypoint") or [],
            config.get("Cmd") or [],
            config.get("User") or "",
            config.get("WorkingDir") or "/",
            test[1:] if test[:1] == ["CMD"] else [],
        )


class Container:
    """One container of the image: started, signalled through tini, killed, started again."""

    def __init__(self, name: str, volume: Path, log: Path, env: dict[str, str]) -> None:
        self.config = ImageConfig.of(IMAGE)
        self.volume, self.log, self.env = volume, log, env
        # a container of this name left by a run that was killed (process ids come back)
        subprocess.run(["buildah", "rm", name], capture_output=True, check=False)
        self.id = subprocess.run(
            ["buildah", "from", "--name", name, IMAGE],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    def run(self, *command: str, **popen: Any) -> subprocess.Popen[bytes]:
        """``command`` after the image's entrypoint (its CMD when empty), as its user."""
        argv = [
            "buildah",
            "run",
            "--isolation",
            "chroot",
            "--user",
            self.config.user,
            "--workingdir",
            self.config.workdir,
            "--volume",
            f"{self.volume}:/data",
            *[f"--env={name}={value}" for name, value in self.env.items()],
            self.id,
            "--",
            *self.config.entrypoint,
            *(command or self.config.command),
        ]
        with self.log.open("ab") as out:
            return subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen
            )

    def healthcheck(self) -> int:
        """The image's HEALTHCHECK command, run in the container; its exit code."""
        argv = ["buildah", "run", "--isolation", "chroot", "--user", self.config.user]
        argv += [f"--env={name}={value}" for name, value in self.env.items()]
        argv += [self.id, "--", *self.config.healthcheck]
        return subprocess.run(argv, capture_output=True, timeout=60).returncode

    def signal(self, process: subprocess.Popen[bytes], signum: int) -> None:
        """What ``docker stop`` and the kubelet do: the signal to the container's PID 1,
        tini, which passes it on."""
        os.kill(pid_one(process), signum)

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        """The container's end: every process of it, kill -9."""
        kill_tree(process)

    def remove(self) -> None:
        subprocess.run(["buildah", "rm", self.id], capture_output=True, check=False)

    def written(self, since: float, writable: tuple[str, ...]) -> list[str]:
        """Paths of the container's root file system changed after ``since`` outside the
        ``writable`` folders: what a read-only root file system would have refused. The
        ``/run`` folder itself is the engine's (its mount point for the container's run)."""
        root = subprocess.run(
            ["buildah", "mount", self.id], capture_output=True, text=True, check=True
        ).stdout.strip()
        try:
            found = []
            for folder, dirs, files in os.walk(root):
                inside = "/" + os.path.relpath(folder, root).removeprefix(".").lstrip("/")
                dirs[:] = [
                    d
                    for d in dirs
                    if os.path.join(inside, d) not in (*writable, "/proc", "/sys", "/dev")
                ]
                for name in [*dirs, *files]:
                    path = os.path.join(folder, name)
                    changed = os.lstat(path).st_mtime > since
                    if changed and os.path.join(inside, name) != "/run":
                        found.append(os.path.join(inside, name))
            return found
        finally:
            subprocess.run(["buildah", "umount", self.id], capture_output=True, check=False)

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines() if line.startswith('{"')]

    def count(self, event: str) -> int:
        return sum(e.get("event") == event for e in self.events())


def pid_one(process: subprocess.Popen[bytes]) -> int:
    """The container's first process (tini) under ``buildah run``."""
    for pid in process_tree(process.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode()).name == "tini":
            return pid
    raise AssertionError(f"no tini under buildah run {process.pid}")


def status(url: str) -> int | None:
    """An HTTP GET's status, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


def not_json(lines: list[str]) -> list[str]:
    """The lines that are not one JSON object with a level."""
    bad = []
    for line in lines:
        try:
            parsed = json.loads(line)
        except ValueError:
            bad.append(line)
            continue
        if not isinstance(parsed, dict) or "level" not in parsed:
            bad.append(line)
    return bad
