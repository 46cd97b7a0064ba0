"""Start-up never races for a port. A group's store binds its port when the address is chosen and keeps it
(rlsearch.rendezvous): something that tries to take the port between the choice and the group's forming (as two TP2
engines starting their workers once did, EADDRINUSE) cannot, and the actor group and a broadcast group form."""

from __future__ import annotations

import errno
import socket

import pytest
import torch

from rlsearch.actor import ActorRanks, TrainSample
from rlsearch.weights.process_group import broadcast_within, new_weight_group
from tests.integration.actor_helpers import actor_spec


def take(address: str) -> int:
    """Try to listen on `address` ("host:port") as another program would; the errno it fails with, 0 if it got it."""
    host, _, port = address.rpartition(":")
    with socket.socket() as thief:
        try:
            thief.bind((host, int(port)))
            thief.listen()
        except OSError as error:
            return error.errno
    return 0


class ContestedActorGroup(ActorRanks):
    """An actor group whose chosen rendezvous port something tries to take before the ranks join."""

    def _open_rendezvous(self) -> str:
        address = super()._open_rendezvous()
        self.taken = take(address)
        return address


@pytest.fixture(scope="module")
def contested_group(ray_local, tiny_model_dir):
    group = ContestedActorGroup(actor_spec(tiny_model_dir, 1, 1, 2, {}))
    yield group
    group.shutdown()


def test_the_actor_group_forms_while_its_chosen_port_is_contested(contested_group):
    assert contested_group.taken == errno.EADDRINUSE
    assert sorted(info.dp_rank for info in contested_group.infos) == [0, 1]
    # the two data-parallel ranks run a collective step together
    samples = [TrainSample(list(range(100, 140)), 30, [1] * 10, advantage=1.0, token_weights=[0.05] * 10)
               for _ in range(2)]
    assert contested_group.train_step(samples)["actor/update_ok"] == 1.0


def test_a_broadcast_group_forms_while_its_chosen_port_is_contested(ray_local, contested_group):
    """The stage's sender (actor rank 0) and a receiver, as an engine worker is."""

    class Receiver:
        def join(self, address: str) -> None:
            self.group = new_weight_group(address, 2, 1, "rlsearch-weights-0", 30.0)

        def receive(self) -> list[float]:
            flat = torch.zeros(1024)
            broadcast_within(flat, self.group, 30.0)
            return flat[:3].tolist()

    sender = contested_group.workers[0]
    receiver = ray_local.remote(Receiver).options(num_cpus=0).remote()
    try:
        address = ray_local.get(sender.open_rendezvous.remote("weights-0", 30.0))
        assert take(address) == errno.EADDRINUSE
        ray_local.get([sender.join_weight_group.remote(address, 2, 30.0), receiver.join.remote(address)])

        def send(worker) -> None:
            broadcast_within(torch.full((1024,), 5.0), worker.broadcast_sender.group, 30.0)

        received = receiver.receive.remote()
        ray_local.get(sender.__ray_call__.remote(send))
        assert ray_local.get(received) == [5.0, 5.0, 5.0]
        ray_local.get(sender.leave_weight_groups.remote())
    finally:
        ray_local.kill(receiver)
