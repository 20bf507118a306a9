"""The address other nodes reach this one at, and the network interface that carries it: a node's SGLang servers
bind the address, gloo's sockets (GLOO_SOCKET_IFNAME) the interface. A host name often resolves to 127.0.1.1
(Debian/Ubuntu images), which neither may use in a job on several hosts."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

_PROBE_PORT = 9  # discard; a UDP connect() only picks the route, nothing is sent
_DEFAULT_ROUTE_PROBE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): reached through the default route, if any


def _outgoing_address(target: str) -> str | None:
    """The local address of the interface the kernel routes towards `target` (None if there is no route)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(target, _PROBE_PORT, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def node_address(master_addr: str, environ: Mapping[str, str] | None = None) -> str:
    """The address other nodes reach this one at: $DAPO_NODE_ADDR, else the interface that routes towards
    the job's master, else the one of the default route, else the host name's address."""
    env = os.environ if environ is None else environ
    if env.get("DAPO_NODE_ADDR"):
        return env["DAPO_NODE_ADDR"]
    for target in (master_addr, _DEFAULT_ROUTE_PROBE):
        addr = _outgoing_address(target) if target else None
        if addr is not None and not is_loopback(addr):
            return addr
    return socket.gethostbyname(socket.gethostname())


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address` (None: no interface here does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def gloo_interface(master_addr: str, environ: Mapping[str, str] | None = None) -> str | None:
    """GLOO_SOCKET_IFNAME for a job on several hosts: the user's, else the interface of `node_address()` (None:
    it is loopback or held by no interface here; gloo then resolves the host name itself)."""
    env = os.environ if environ is None else environ
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"]
    addr = node_address(master_addr, env)
    return None if is_loopback(addr) else interface_of(addr)
