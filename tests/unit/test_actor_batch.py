import pytest
import torch

from rlsearch.actor.batch import TrainSample, collate, split_micro_batches


def test_collate_selects_response_positions_in_megatron_layout():
    samples = [
        TrainSample([10, 11, 12, 13], response_start=2, loss_mask=[1, 0], advantage=0.5),
        TrainSample([20, 21, 22], response_start=1, loss_mask=[1, 1], advantage=-1.0),
    ]
    mb = collate(samples)
    assert mb.tokens.tolist() == [[10, 11, 12, 13], [20, 21, 22, 0]]
    # sample 0 predicts 12, 13 from positions 1, 2; sample 1 predicts 21, 22 from positions 0, 1 (batch = 2)
    assert mb.logit_index.tolist() == [1 * 2 + 0, 2 * 2 + 0, 0 * 2 + 1, 1 * 2 + 1]
    assert mb.labels.tolist() == [12, 13, 21, 22]
    assert mb.loss_mask.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert mb.advantages.tolist() == [0.5, 0.5, -1.0, -1.0]
    assert mb.response_lens == [2, 2]
    hidden = torch.arange(4 * 2).view(4, 2, 1)  # [seq, batch, hidden]: value = t * batch + row
    assert hidden.reshape(-1, 1).index_select(0, mb.logit_index).view(-1).tolist() == mb.logit_index.tolist()


def test_sample_validates_lengths():
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        TrainSample([1, 2, 3], response_start=1, loss_mask=[1])
    with pytest.raises(ValueError, match="response_start=0"):
        TrainSample([1, 2], response_start=0, loss_mask=[1, 1])


def test_split_micro_batches():
    assert [len(b) for b in split_micro_batches(list(range(10)), 4)] == [4, 4, 2]
