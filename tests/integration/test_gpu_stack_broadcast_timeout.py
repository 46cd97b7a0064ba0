"""A weight broadcast that cannot finish fails after its deadline, on nccl as on gloo: one code path
(rlsearch.weights.process_group), run here on gloo between real processes (Ray actors). The collective runs
asynchronously and is polled; past the deadline its group is aborted and CollectiveTimeout raised, so neither side hangs
or is torn down by torch's watchdog: the same processes form a new group and broadcast through it."""

from __future__ import annotations

import time

import pytest
import torch

from rlsearch.rendezvous import Rendezvous
from rlsearch.weights.process_group import CollectiveTimeout, broadcast_within, destroy_weight_group, new_weight_group

DEADLINE_S = 3.0
HANG_GUARD_S = 5 * DEADLINE_S  # a broadcast still waiting then was not ended by its deadline


def ended_at_its_deadline(seconds: float) -> bool:
    """Not before the deadline (a bound from below: no machine is too slow for it); the hang guard above it."""
    assert seconds < HANG_GUARD_S, f"hang guard: a broadcast with a {DEADLINE_S:g} s deadline took {seconds:.0f} s"
    return seconds >= DEADLINE_S


@pytest.fixture(scope="module")
def members(ray_local):
    """Two processes in weight groups, as an actor rank and an engine worker are (the class is local so that Ray
    ships it by value: a test module is not importable in its workers)."""

    class Member:
        """A process in a weight group, as an actor rank or an engine worker is."""

        def __init__(self) -> None:
            self.groups: dict[str, object] = {}
            self.rendezvous: Rendezvous | None = None

        def open(self) -> str:
            self.rendezvous = Rendezvous("127.0.0.1", 30.0)
            return self.rendezvous.address

        def join(self, address: str, rank: int, name: str) -> str:
            self.groups[name] = new_weight_group(address, 2, rank, name, DEADLINE_S)
            return torch.distributed.get_backend(self.groups[name])

        def broadcast(self, name: str, numel: int, value: float) -> tuple[list[float] | str, float]:
            """Broadcast (or receive into) `numel` floats set to `value`: (the first four after the broadcast, or the
            error; seconds it took)."""
            flat = torch.full((numel,), value)
            started = time.perf_counter()
            try:
                broadcast_within(flat, self.groups[name], DEADLINE_S)
            except (CollectiveTimeout, RuntimeError) as error:
                return f"{type(error).__name__}: {error}", time.perf_counter() - started
            return flat[:4].tolist(), time.perf_counter() - started

        def leave(self, name: str) -> None:
            destroy_weight_group(self.groups.pop(name))

    handles = [ray_local.remote(Member).options(num_cpus=0).remote() for _ in range(2)]
    yield handles
    for handle in handles:
        ray_local.kill(handle)


def form_group(ray_local, members, name: str) -> list[str]:
    sender, receiver = members
    address = ray_local.get(sender.open.remote())
    return ray_local.get([sender.join.remote(address, 0, name), receiver.join.remote(address, 1, name)])


def test_a_stuck_weight_broadcast_fails_after_its_deadline_and_the_processes_go_on(ray_local, members):
    sender, receiver = members
    assert form_group(ray_local, members, "receiver-waits") == ["gloo", "gloo"]  # each member's choice: no GPU here
    assert form_group(ray_local, members, "sender-waits") == ["gloo", "gloo"]

    # a receiver whose sender never sends (an actor rank that died or hangs) fails after its deadline
    result, seconds = ray_local.get(receiver.broadcast.remote("receiver-waits", 4, 0.0))
    assert result.startswith("CollectiveTimeout: a weight broadcast did not finish within 3 s; its group is aborted")
    assert ended_at_its_deadline(seconds)
    # a sender whose receiver never receives (an engine that died or hangs) too: 64 MiB, more than socket buffers hold
    result, seconds = ray_local.get(sender.broadcast.remote("sender-waits", 2**24, 1.0))
    assert result.startswith("CollectiveTimeout") and ended_at_its_deadline(seconds)

    # both processes are alive and form a new group (as the next sync does), which broadcasts
    for member in members:
        ray_local.get([member.leave.remote("receiver-waits"), member.leave.remote("sender-waits")])
    form_group(ray_local, members, "next-sync")
    sent = sender.broadcast.remote("next-sync", 2**20, 7.0)
    received = receiver.broadcast.remote("next-sync", 2**20, 0.0)
    assert [value for value, _ in ray_local.get([sent, received])] == [[7.0] * 4] * 2
