"""Where the launcher's rendezvous store listens: loopback on one node, only MASTER_ADDR's address
on several.

torchrun's own rendezvous (``--standalone``, static, c10d) creates a ``TCPStore`` whose server
binds every interface: the C++ store takes a port but no address, so anyone who can reach the host
can read and write the run's keys. It does take an already listening socket
(``master_listen_fd``), and listens where that socket does. This backend is torch's static TCP
rendezvous (one store on node 0, every node's rank known in advance) with that socket made first;
:func:`register` adds it to torch's rendezvous registry under :data:`BACKEND`, and the launch
commands name it (:mod:`sft_play.launch.commands`).
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

from sft_play.launch.tensorboard import LOOPBACK

BACKEND = "sft-play"
DEFAULT_TIMEOUT_S = 600


def listen_address(master_addr: str, nnodes: int) -> tuple[str, str | None]:
    """The address node 0's store binds, and a line to say when that is every interface.

    One node: loopback. Several: the address MASTER_ADDR names, as this node resolves it, unless
    that is a loopback address reached through a host name (Debian's ``127.0.1.1 <hostname>`` in
    /etc/hosts): the other nodes resolve the same name elsewhere, so only every interface serves
    them both.
    """
    if nnodes == 1:
        return LOOPBACK, None
    try:
        return str(ipaddress.ip_address(master_addr)), None
    except ValueError:
        pass
    try:
        resolved = socket.getaddrinfo(master_addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError:
        resolved = None
    if resolved is None or (ipaddress.ip_address(resolved).is_loopback and master_addr != "localhost"):
        where = f"resolves to {resolved}" if resolved else "does not resolve"
        return "0.0.0.0", (f"MASTER_ADDR={master_addr} {where} on this node: the rendezvous store listens on every "
                           "interface (give MASTER_ADDR as this node's IP address to bind only that one)")
    return resolved, None


def _handler(params):
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class BoundRendezvous(RendezvousHandler):
        """torch's ``StaticTCPRendezvous``, its store listening on a socket bound first."""

        def __init__(self, host: str, port: int, rank: int, nodes: int, run_id: str, timeout_s: int):
            self.host, self.port, self.rank, self.nodes, self.run_id = host, port, rank, nodes, run_id
            self.timeout = timedelta(seconds=timeout_s)
            self._store = None

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True  # the workers connect to this store (TORCHELASTIC_USE_AGENT_STORE): none binds its own

        def next_rendezvous(self):
            if self._store is None:
                if self.rank == 0:
                    bind, note = listen_address(self.host, self.nodes)
                    if note:
                        print(note, flush=True)
                    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
                    listener = socket.create_server((bind, self.port), family=family, backlog=max(128, self.nodes))
                    self.port = listener.getsockname()[1]
                    if self.nodes == 1:
                        self.host = bind
                    # the store owns the socket from here (it closes it): Python's object lets go of it first
                    self._store = TCPStore(self.host, self.port, self.nodes, True, self.timeout, multi_tenant=True,
                                           master_listen_fd=listener.detach())
                else:
                    self._store = TCPStore(self.host, self.port, self.nodes, False, self.timeout, multi_tenant=True)
            return RendezvousInfo(PrefixStore(self.run_id, self._store), self.rank, self.nodes,
                                  RendezvousStoreInfo(self.host, self.port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            self._store = None  # the store closes its socket as it goes
            return True

    host, port = parse_rendezvous_endpoint(params.endpoint.strip() or f"{LOOPBACK}:0", 0)
    rank = params.get_as_int("rank", 0)
    return BoundRendezvous(host, port, rank, params.max_nodes, params.run_id,
                           params.get_as_int("timeout", DEFAULT_TIMEOUT_S))


def register() -> None:
    """Make :data:`BACKEND` a rendezvous torch's launchers in this process can name (once)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _handler)  # the same creator again is accepted
