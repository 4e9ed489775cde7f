"""Test hosts in network namespaces: each `Host` is a namespace joined to this machine by a veth
pair, 10.231.N.1/24 on the machine's side and 10.231.N.2 inside. A private cluster listens on the
machine's side; a supervisor runs inside with `ip netns exec`.

Cutting a host brings the machine's side of its veth down: packets are dropped, nothing is
reset, so the host's open connections hang (a partition, as seen by TCP) until `heal`.

Names carry this process's pid and a random suffix, and N is one no interface uses yet, so
parallel test runs on one machine never collide. Everything made is deleted on exit, on failure
too. Needs root (CI runs as root) and iproute2; `unavailable()` says why not otherwise."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "10.231"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass
class Host:
    name: str  # the namespace, also the key for the veth names
    net: int  # N in 10.231.N.0/24
    outer: str  # the machine's side of the veth pair

    @property
    def subnet(self) -> str:
        return f"{PREFIX}.{self.net}.0/24"

    @property
    def server_addr(self) -> str:
        """The machine's side: what the host connects to."""
        return f"{PREFIX}.{self.net}.1"

    @property
    def addr(self) -> str:
        """The host's own address (inet_client_addr() of its sessions)."""
        return f"{PREFIX}.{self.net}.2"

    @property
    def wrap(self) -> list[str]:
        """Command prefix that runs a program on this host (exec'd: the pid stays the program's)."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        ip("link", "set", self.outer, "down")

    def heal(self) -> None:
        ip("link", "set", self.outer, "up")


def unavailable() -> str | None:
    """Why hosts in network namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "two hosts need network namespaces: `ip` (iproute2) is not on PATH"
    if os.geteuid() != 0:
        return (
            "two hosts need network namespaces: `ip netns add` and veth pairs need root "
            "(CAP_SYS_ADMIN and CAP_NET_ADMIN); CI runs as root, this run does not"
        )
    probe = f"lwprobe{os.getpid()}{secrets.token_hex(2)}"
    done = ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"two hosts need network namespaces: `ip netns add` failed: {done.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _used_nets() -> set[int]:
    out = ip("-o", "-4", "addr", "show").stdout
    used = set()
    for word in out.split():
        if word.startswith(PREFIX + "."):
            used.add(int(word.split(".")[2]))
    return used


@contextlib.contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """n hosts, each in its own namespace with its own veth pair and /24; deleted on exit."""
    key = f"{os.getpid() % 100000:05d}{secrets.token_hex(2)}"
    free = sorted(set(range(1, 255)) - _used_nets())
    made: list[Host] = []
    try:
        for i, net in enumerate(random.sample(free, n)):
            name = f"lw{key}{chr(ord('a') + i)}"  # <= 12 chars: veth names are <= 15
            ip("netns", "add", name)
            host = Host(name, net, f"{name}h")
            made.append(host)
            ip("link", "add", host.outer, "type", "veth", "peer", "name", f"{name}n", "netns", name)
            ip("addr", "add", f"{host.server_addr}/24", "dev", host.outer)
            ip("link", "set", host.outer, "up")
            ip("-n", name, "addr", "add", f"{host.addr}/24", "dev", f"{name}n")
            ip("-n", name, "link", "set", f"{name}n", "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield made
    finally:
        for host in made:
            ip("link", "del", host.outer, check=False)  # deletes both ends
            ip("netns", "del", host.name, check=False)
