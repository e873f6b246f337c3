"""Several hosts on one machine: Linux network namespaces on one bridge (the multi-host tests).

Each :class:`Host` is a network namespace with its own loopback and one interface (``eth0``, a veth
pair whose other end is on the harness's bridge) holding one address of a private /24 that no route
of the machine overlaps. The bridge, in the root namespace, holds the /24's first address, so
clients of the root namespace reach every host, as a client on the hosts' network would; nothing is
ever sent outside the /24. A process started on a host (:meth:`Host.popen`, ``ip netns exec``, which
execs in place: the pid and process group are the command's own) binds and connects from that host
only: its ``127.0.0.1`` is its own host's, so a process that looks for another host's service on
loopback finds nothing there.

:meth:`Host.cut` takes the host's cable out (the bridge's end of its veth down: frames to and from
it are dropped, peers see timeouts, then "no route to host"); :meth:`Host.restore` plugs it back.

Names carry the harness process's pid (namespaces ``rkv<pid>-<host>``, interfaces ``rkv<pid>...``),
so two runs side by side keep apart, and :meth:`HostNetwork.start` first removes what a run whose
process is gone left behind (a killed run). :meth:`HostNetwork.close` removes every namespace and
interface this run made, also when a test fails (a context manager). Needs root and iproute2
(:func:`unavailable` says why not, in one line).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import subprocess
from typing import Optional

PREFIX = "rkv"  # of every namespace and interface the harness makes
SUBNET_CHOICES = [ipaddress.ip_network(f"10.77.{i}.0/24") for i in range(16, 240)]


_NETWORKS = itertools.count()  # a process may hold several networks (a deployment, the harness's own test)


def _name(suffix: str, network: str = "") -> str:
    """This run's name for a namespace (``-host``) or an interface (``b0``: the bridge's end of host 0's cable,
    ``h0``: the host's end, ``br``: the bridge) of ``network`` (its tag; at most 15 characters in all)."""
    return f"{PREFIX}{os.getpid()}{network}{suffix}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def unavailable() -> Optional[str]:
    """Why this machine cannot run the harness (one line), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2)"
    probe = _name("-probe")
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def remove_leftovers() -> list[str]:
    """Remove the namespaces and interfaces of harness runs whose process is gone; what was removed."""
    removed = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        owner = re.match(rf"{PREFIX}(\d+)\D", name)
        if owner and not _alive(int(owner.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        owner = re.match(rf"{PREFIX}(\d+)\D", name)
        if owner and not _alive(int(owner.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of :data:`SUBNET_CHOICES` that no route or address of the machine overlaps."""
    taken = []
    for line in _ip("-o", "-4", "route", "show", "table", "all").stdout.splitlines():
        first = line.split()[0]
        if first in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit", "throw"):
            first = line.split()[1] if first != "default" else "0.0.0.0/32"
        try:
            taken.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            continue
    start = os.getpid() % len(SUBNET_CHOICES)  # runs side by side start at different places
    for net in SUBNET_CHOICES[start:] + SUBNET_CHOICES[:start]:
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise RuntimeError("no free /24 in 10.77.16.0-10.77.239.0 for the hosts' network")


class Host:
    """One host: a network namespace with ``eth0`` at :attr:`address` on the harness's bridge."""

    def __init__(self, network: "HostNetwork", name: str, index: int, address: str):
        self.network, self.name, self.address = network, name, address
        self.namespace = _name(f"-{name}", network.tag)
        self.link = _name(f"b{index}", network.tag)  # the bridge's end of the host's cable
        self.processes: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address})"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: list[str], log_path: str, env: Optional[dict] = None) -> subprocess.Popen:
        """Start ``argv`` on this host in its own process group, stdout and stderr to ``log_path``;
        :meth:`HostNetwork.close` ends it if the caller has not."""
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(self.command(argv), stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.processes.append(proc)
        return proc

    def run(self, argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to its end."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout_s)

    def cut(self) -> None:
        """Take the host's cable out: nothing reaches it or leaves it until :meth:`restore`."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        """Plug the host's cable back in."""
        _ip("link", "set", self.link, "up")

    def connections(self) -> list[tuple[str, str]]:
        """This host's TCP connections as (local address:port, peer address:port), from ``ss``."""
        out = self.run(["ss", "-Htn"]).stdout
        return [(f[3], f[4]) for f in (line.split() for line in out.splitlines()) if len(f) >= 5]


class HostNetwork:
    """Hosts as network namespaces on one bridge (module doc). A context manager::

        with HostNetwork(["store", "a", "b", "gateway"]) as net:
            net["a"].popen([...], log)
    """

    def __init__(self, names: list[str]):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and at least one: {names}")
        self.names = list(names)
        self.subnet: Optional[ipaddress.IPv4Network] = None
        self.tag = f"n{next(_NETWORKS)}"
        self.prefix = _name("", self.tag)  # of every name this network makes
        self.bridge = _name("br", self.tag)
        self.gateway_address: Optional[str] = None  # the bridge's address (the root namespace's)
        self.hosts: dict[str, Host] = {}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> "HostNetwork":
        why = unavailable()
        if why:
            raise RuntimeError(why)
        remove_leftovers()
        self.subnet = _free_subnet()
        addresses = [str(a) for a in self.subnet.hosts()]
        self.gateway_address = addresses[0]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                host = Host(self, name, i, addresses[i + 1])
                inner = _name(f"h{i}", self.tag)
                _ip("netns", "add", host.namespace)
                _ip("link", "add", host.link, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", host.namespace)
                _ip("-n", host.namespace, "link", "set", inner, "name", "eth0")
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.namespace, "link", "set", "eth0", "up")
                _ip("-n", host.namespace, "link", "set", "lo", "up")
                _ip("link", "set", host.link, "master", self.bridge, "up")
                self.hosts[name] = host
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """End every process started on a host (its process group), then remove the namespaces,
        their interfaces and the bridge."""
        import signal

        for host in self.hosts.values():
            for proc in host.processes:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(30)
        for i, name in enumerate(self.names):
            _ip("netns", "del", _name(f"-{name}", self.tag), check=False)
            _ip("link", "del", _name(f"b{i}", self.tag), check=False)
        _ip("link", "del", self.bridge, check=False)
        self.hosts.clear()

    def __enter__(self) -> "HostNetwork":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
