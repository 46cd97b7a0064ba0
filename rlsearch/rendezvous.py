"""Rendezvous of torch.distributed groups that never race for a port.

A free port picked by binding port 0 and closing the socket can be taken by anything else before the group's store
binds it (two TP2 engines starting their own workers meanwhile did, on a 2-core machine: EADDRINUSE). Here the store's
server binds port 0 when the address is chosen and keeps it for the group's life: the address handed out is one that
is already listening. Every member, the opener included, then connects to it as a client.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class Rendezvous:
    """The server of a group's store, listening from construction until `close`; `address` is "host:port". Keep it
    (for the life of the group: its members keep talking to the store) in the process that opened it."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self._server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                     timeout=timedelta(seconds=timeout_s))
        self.address = f"{host}:{self._server.port}"

    def close(self) -> None:
        self._server = None


def join_store(address: str, timeout_s: float) -> dist.Store:
    """A member's client of the store opened at `address` ("host:port")."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
