"""A Mooncake store: ``mooncake_master`` and one memory-holding client, on one host's address.

For the tests and benchmarks that share chunks across servers through Mooncake (the HiCache tier,
``relaxkv_sglang/cache/sglang/hicache_tier.py``), and as the shape of a deployment:

* ``mooncake_master --rpc_address HOST --rpc_port P``: the store's metadata (which client
  holds which object), its eviction (at 90% of the memory by default) and leases (an object
  read in the last ``LEASE_MS`` is not removed; 1 s here, 10 s by default);
* ``mooncake_client --global_segment_size S``: a long-lived process that contributes ``S`` bytes
  of memory, where the objects live. The servers join with ``global_segment_size`` 0, so a
  server's restart loses nothing (a Mooncake client's objects live in the segments of the
  clients that mounted them; an object placed in a server's own segment would go with it).

The servers' HiCache tier is then ``RELAXKV_HICACHE_STORAGE_BACKEND=mooncake`` with
:meth:`MooncakeService.extra_config` (:meth:`MooncakeService.env` gives both). Mooncake's
transfer engine listens on every interface for its handshake (no flag binds it); everything
named here is ``host`` (loopback by default; the multi-host tests give a host's address and run
both on that host, :attr:`MooncakeService.launcher`). Installed by ``make install-mooncake``
(``requirements/mooncake.txt``, apt packages ``libibverbs1 libnuma1``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from relaxkv_sglang.server.launch import end_process_group

__all__ = ["MooncakeService", "mooncake_binary"]

LEASE_MS = 1000


def mooncake_binary(name: str) -> str:
    """The path of ``mooncake_master`` / ``mooncake_client`` (beside this Python, else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.access(here, os.X_OK) else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found: run `make install-mooncake`")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} at startup")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{proc.args[0]} not listening on {host}:{port} after {timeout_s} s")


class MooncakeService:
    """``mooncake_master`` and a segment-holding ``mooncake_client`` on ``host`` (module doc).

    Use as a context manager; :meth:`stop` ends both process groups (each started in its own)."""

    def __init__(self, segment_mb: int = 256, log_dir: Optional[str] = None, host: str = "127.0.0.1",
                 launcher: Sequence[str] = (), rpc_port: int = 0, holder_port: int = 0) -> None:
        """segment_mb: memory the holder contributes; log_dir: where the two logs go (a temp folder);
        host: the address both bind and advertise; launcher: what runs a command on that host (e.g.
        ``ip netns exec NS``; nothing: this machine); rpc_port, holder_port: 0 picks free ones here."""
        self.segment_mb = segment_mb
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="relaxkv-mooncake-")
        self.host = host
        self.launcher = list(launcher)
        self.rpc_port = rpc_port
        self.holder_port = holder_port
        self.master: Optional[subprocess.Popen] = None
        self.holder: Optional[subprocess.Popen] = None
        self._client = None  # a store client of this process, for clear()

    @property
    def address(self) -> str:
        """The master's RPC address."""
        return f"{self.host}:{self.rpc_port}"

    def extra_config(self) -> dict:
        """The servers' ``--hicache-storage-backend-extra-config`` for this store. No ``local_hostname``:
        each server advertises its own host's address on the route to the master
        (``cache/sglang/hicache_tier.py::with_local_hostname``)."""
        return {"master_server_address": self.address, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": 0, "device_name": ""}

    def env(self, page_kb: int = 64) -> dict[str, str]:
        """A server's environment for the HiCache tier on this store."""
        return {"RELAXKV_HICACHE_STORAGE_BACKEND": "mooncake",
                "RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": json.dumps(self.extra_config()),
                "RELAXKV_HICACHE_PAGE_KB": str(page_kb)}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        try:
            return subprocess.Popen([*self.launcher, mooncake_binary(name), *args], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def master_args(self) -> list[str]:
        """``mooncake_master``'s arguments (ports picked the first time)."""
        self.rpc_port = self.rpc_port or _free_port()
        return [f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}", f"--metrics_host={self.host}",
                f"--metrics_port={_free_port()}", f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={_free_port()}", f"--default_kv_lease_ttl={LEASE_MS}"]

    def holder_args(self) -> list[str]:
        """``mooncake_client``'s arguments (the holder of the objects' memory)."""
        self.holder_port = self.holder_port or _free_port()
        return [f"--host={self.host}", f"--port={self.holder_port}", f"--global_segment_size={self.segment_mb}MB",
                "--metadata_server=P2PHANDSHAKE", "--protocol=tcp", f"--master_server_address={self.address}"]

    def start_master(self) -> None:
        """Start (or restart) the master on its port (a free one the first time); empty of objects."""
        self.master = self._spawn("mooncake_master", self.master_args())
        _wait_port(self.host, self.rpc_port, self.master, 30)

    def start_holder(self) -> None:
        """Start (or restart) the client that holds the objects' memory (``segment_mb``)."""
        self.holder = self._spawn("mooncake_client", self.holder_args())
        _wait_port(self.host, self.holder_port, self.holder, 30)

    def start(self) -> "MooncakeService":
        """Master, then holder."""
        try:
            self.start_master()
            self.start_holder()
        except BaseException:
            self.stop()
            raise
        return self

    def clear(self) -> None:
        """Remove every object (twice, a lease apart: an object read just now is removed the second time)."""
        from mooncake.store import MooncakeDistributedStore

        if self._client is None:
            client = MooncakeDistributedStore()
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this process's address towards the master
                s.connect((self.host, self.rpc_port))
                own = s.getsockname()[0]
            if client.setup(own, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.address):
                raise RuntimeError(f"cannot join the Mooncake store at {self.address}")
            self._client = client
        self._client.remove_all()
        time.sleep(LEASE_MS / 1000 + 0.2)
        self._client.remove_all()

    def kill_master(self) -> None:
        """SIGKILL the master (a store that dies mid-run)."""
        end_process_group(self.master, signal.SIGKILL)

    def stop(self) -> None:
        """End the holder and the master."""
        end_process_group(self.holder)
        end_process_group(self.master)

    def __enter__(self) -> "MooncakeService":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
