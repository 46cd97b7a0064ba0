import pytest
import torch

from rlsearch.actor.batch import TrainSample, collate, pack_indices, pack_micro_batches


def test_collate_packs_samples_back_to_back_without_padding():
    samples = [
        TrainSample([10, 11, 12, 13], response_start=2, loss_mask=[1, 0], advantage=0.5),
        TrainSample([20, 21, 22], response_start=1, loss_mask=[1, 1], advantage=-1.0),
    ]
    mb = collate(samples, [3, 7])
    assert mb.sample_indices == [3, 7]
    assert mb.tokens.tolist() == [[10, 11, 12, 13, 20, 21, 22]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 4, 7] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 4
    # sample 0 predicts 12, 13 from packed positions 1, 2; sample 1 predicts 21, 22 from positions 4, 5
    assert mb.logit_index.tolist() == [1, 2, 4, 5]
    assert mb.labels.tolist() == [12, 13, 21, 22]
    assert mb.tokens[0, mb.logit_index + 1].tolist() == mb.labels.tolist()
    assert mb.loss_mask.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert mb.advantages.tolist() == [0.5, 0.5, -1.0, -1.0]
    assert mb.response_lens == [2, 2]
    params = mb.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q is mb.cu_seqlens and params.max_seqlen_kv == 4


def test_sample_validates_lengths():
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        TrainSample([1, 2, 3], response_start=1, loss_mask=[1])
    with pytest.raises(ValueError, match="response_start=0"):
        TrainSample([1, 2], response_start=0, loss_mask=[1, 1])


def test_pack_indices_fills_bins_up_to_the_token_limit():
    lengths = [60, 30, 50, 20, 40, 100]
    bins = pack_indices(lengths, max_tokens=100)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) == 3  # 300 tokens in three full bins: first-fit decreasing wastes nothing here
    assert all(b == sorted(b) for b in bins) and [b[0] for b in bins] == sorted(b[0] for b in bins)


def test_pack_indices_gives_an_overlong_sample_its_own_bin_and_honours_min_bins():
    assert pack_indices([500, 10, 10], max_tokens=100) == [[0], [1, 2]]
    # two pipeline stages need at least two micro-batches even when everything fits in one
    bins = pack_indices([10, 10, 10, 10], max_tokens=100, min_bins=2)
    assert len(bins) == 2 and sorted(len(b) for b in bins) == [2, 2]
    assert len(pack_indices([10, 10, 10], max_tokens=100, min_bins=4)) == 3  # never more bins than samples


def test_pack_micro_batches_covers_every_sample_once():
    samples = [TrainSample(list(range(n)), response_start=1, loss_mask=[1] * (n - 1)) for n in (5, 9, 3, 7, 4)]
    micro_batches = pack_micro_batches(samples, max_tokens=12)
    assert sorted(i for mb in micro_batches for i in mb.sample_indices) == list(range(5))
    assert all(mb.num_tokens <= 12 for mb in micro_batches)
    assert sum(mb.num_tokens for mb in micro_batches) == 28  # no padding


def test_a_prefix_tree_over_the_micro_batch_size_trains_as_its_segments():
    from rlsearch.actor.batch import Packing

    prompt = list(range(100, 110))
    # a folded trajectory: three segments sharing only the prompt, a 40-token tree; and a short tree of two
    folded = [TrainSample(prompt + list(range(k * 20, k * 20 + 10)), 10, [1] * 10, prefix_group=0) for k in range(3)]
    short = [TrainSample(prompt + [1, 2], 10, [1, 1], prefix_group=1), TrainSample(prompt + [1, 3], 10, [1, 1],
                                                                                 prefix_group=1)]
    micro_batches = pack_micro_batches(folded + short, max_tokens=30, packing=Packing(merge_prefixes=True))
    assert all(mb.num_tokens <= 30 for mb in micro_batches)
    assert sorted(i for mb in micro_batches for i in mb.sample_indices) == list(range(5))
    # the folded segments go apart into sub-trees that fit (two sharing the prompt, 30 tokens, and one of 20); the
    # short tree stays one unit of 13 tokens
    assert sum(mb.num_tokens for mb in micro_batches) == 30 + 20 + 13


def test_a_grpo_groups_samples_train_their_shared_prompt_once():
    from rlsearch.actor.batch import Packing

    prompt = list(range(100, 110))
    group = [TrainSample(prompt + list(range(k * 10, k * 10 + 5)), 10, [1] * 5, prompt_group=0) for k in range(4)]
    other = [TrainSample(list(range(200, 210)) + [1, 2], 10, [1, 1], prompt_group=1)]
    micro_batches = pack_micro_batches(group + other, max_tokens=64, packing=Packing(merge_prefixes=True))
    assert sum(mb.num_tokens for mb in micro_batches) == 10 + 4 * 5 + 12  # the prompt once, then four responses
    merged = pack_micro_batches(group, max_tokens=64, packing=Packing(merge_prefixes=True))[0]
    apart = pack_micro_batches(group, max_tokens=64)[0]
    # every sample predicts its own labels, its first from the one shared last prompt row
    assert torch.equal(merged.labels, apart.labels)
    assert merged.logit_index.tolist()[::5] == [9, 9, 9, 9]
    assert sorted(i for mb in pack_micro_batches(group, max_tokens=64) for i in mb.sample_indices) == list(range(4))
    # two samples of a group can be the same tokens: stored once, each still predicts (and trains) its labels
    twins = pack_micro_batches([group[0], group[0], group[1]], max_tokens=64, packing=Packing(merge_prefixes=True))
    assert twins[0].num_tokens == 10 + 2 * 5
    assert twins[0].logit_index.tolist()[:10] == [*range(9, 14)] * 2


def test_a_merged_group_of_identical_samples_projects_each_row_once():
    from rlsearch.actor.batch import Packing

    prompt = list(range(100, 110))
    response = [5, 6, 7, 8, 9, 10]
    # 8 identical samples, and one that shares 3 response tokens with them and then branches
    group = [TrainSample(prompt + response, 10, [1] * 6, prompt_group=0) for _ in range(8)]
    group.append(TrainSample(prompt + response[:3] + [40, 41, 42], 10, [1] * 6, prompt_group=0))
    merged = pack_micro_batches(group, max_tokens=64, packing=Packing(merge_prefixes=True))[0]
    assert merged.num_tokens == 10 + 6 + 3
    # 54 selected positions, one projection per edge of the tree: 6 of the twins' path and the branch's last 3,
    # fewer than the micro-batch's 19 rows (the memory plan's bound)
    assert len(merged.labels) == 9 * 6
    assert len(merged.projected_rows) == 6 + 3 <= merged.num_tokens
    assert merged.projected_rows.tolist().count(12) == 2  # the branch point's row predicts 8 and 40
    # laid out per position, the projected pairs give each position its own (row, label)
    assert torch.equal(merged.per_position(merged.projected_rows), merged.logit_index)
    assert torch.equal(merged.per_position(merged.projected_labels), merged.labels)
    assert merged.labels.tolist() == [token for i in merged.sample_indices for token in group[i].token_ids[10:]]
    apart = pack_micro_batches(group, max_tokens=64)  # no row shared: every position its own projection
    assert all(mb.distinct_positions is None and mb.projected_rows is mb.logit_index for mb in apart)


def test_a_grpo_group_over_the_micro_batch_size_trains_as_its_trajectories_trees():
    from rlsearch.actor.batch import Packing

    prompt = list(range(100, 110))
    # trajectory 0 has two segments sharing 14 tokens (a 30-token tree); trajectory 1 is one 20-token sample
    two_segments = [TrainSample(prompt + [1, 2, 3, 4] + list(range(k * 10, k * 10 + 6)), 10, [1] * 10,
                                prefix_group=0, prompt_group=0) for k in range(2)]
    lone = TrainSample(prompt + list(range(50, 60)), 10, [1] * 10, prompt_group=0)
    micro_batches = pack_micro_batches([*two_segments, lone], max_tokens=30, packing=Packing(merge_prefixes=True))
    assert all(mb.num_tokens <= 30 for mb in micro_batches)
    assert sorted(mb.num_tokens for mb in micro_batches) == [20, 26]  # the group's 36-token tree went apart
    assert sorted(i for mb in micro_batches for i in mb.sample_indices) == [0, 1, 2]


def test_a_grpo_group_one_token_over_the_micro_batch_size_keeps_its_prompt_shared_in_sub_groups():
    from rlsearch.actor.batch import Packing

    prompt = list(range(100, 110))
    group = [TrainSample(prompt + list(range(k * 10, k * 10 + 5)), 10, [1] * 5, prompt_group=0) for k in range(4)]
    # the group's tree is 10 + 4 x 5 = 30 rows: at 29 it was four samples apart (60 rows), now sub-groups of 3 and 1
    micro_batches = pack_micro_batches(group, max_tokens=29, packing=Packing(merge_prefixes=True))
    assert sorted(mb.num_tokens for mb in micro_batches) == [15, 25]
    assert sorted(i for mb in micro_batches for i in mb.sample_indices) == list(range(4))


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_merged_groups_give_every_pipeline_stage_a_micro_batch(stages):
    from rlsearch.actor.batch import Packing

    prompt = list(range(100, 110))
    group = [TrainSample(prompt + list(range(k * 10, k * 10 + 5)), 10, [1] * 5, prompt_group=0) for k in range(4)]
    micro_batches = pack_micro_batches(group, max_tokens=64, min_micro_batches=stages,
                                       packing=Packing(merge_prefixes=True))
    assert len(micro_batches) == stages  # one merged unit gave one micro-batch for every number of stages
    assert sorted(i for mb in micro_batches for i in mb.sample_indices) == list(range(4))
    # each micro-batch still shares the prompt among its samples
    assert sum(mb.num_tokens for mb in micro_batches) == 10 * stages + 4 * 5
    labels = {i: labels.tolist() for mb in micro_batches
              for i, labels in zip(mb.sample_indices, mb.labels.split(mb.response_lens))}
    assert labels == {k: list(range(k * 10, k * 10 + 5)) for k in range(4)}


def test_trained_only_takes_logits_where_the_loss_mask_is_set():
    samples = [
        TrainSample([10, 11, 12, 13, 14], response_start=2, loss_mask=[1, 0, 1], advantage=0.5,
                    token_weights=[0.25, 0.0, 0.25], old_logprobs=[-1.0, -2.0, -3.0],
                    rollout_logprobs=[-1.5, 0.0, -3.5]),
        TrainSample([20, 21, 22], response_start=1, loss_mask=[0, 1], advantage=-1.0, token_weights=[0.0, 0.5],
                    old_logprobs=[-4.0, -5.0], rollout_logprobs=[0.0, -5.5]),
    ]
    full, trained = collate(samples, [0, 1]), collate(samples, [0, 1], trained_only=True)
    # sample 0 trains on 12 and 14 (positions 1, 3), sample 1 on 22 (packed position 6); 13 and 21 are observations
    assert trained.logit_index.tolist() == [1, 3, 6] and trained.labels.tolist() == [12, 14, 22]
    assert trained.tokens[0, trained.logit_index + 1].tolist() == trained.labels.tolist()
    assert trained.response_lens == [2, 1] and trained.loss_mask.tolist() == [1.0, 1.0, 1.0]
    assert trained.advantages.tolist() == [0.5, 0.5, -1.0] and trained.token_weights.tolist() == [0.25, 0.25, 0.5]
    assert trained.old_logprobs.tolist() == [-1.0, -3.0, -5.0]
    assert trained.rollout_logprobs.tolist() == [-1.5, -3.5, -5.5]
    assert trained.ref_logprobs is None
    # the sequences themselves are packed as before; only the selected positions differ
    assert torch.equal(trained.tokens, full.tokens) and torch.equal(trained.cu_seqlens, full.cu_seqlens)
    selected = full.loss_mask.bool()
    assert torch.equal(full.logit_index[selected], trained.logit_index)
    assert torch.equal(full.token_weights[selected], trained.token_weights)
    assert full.token_weights[~selected].abs().sum() == 0  # what is left out weighs nothing


def test_trained_only_keeps_a_micro_batch_without_trained_tokens_whole():
    # an empty data-parallel shard trains a zero-weight stand-in: its output layer must still see an input
    stand_in = TrainSample([0, 0], 1, [0], token_weights=[0.0])
    mb = collate([stand_in], [0], trained_only=True)
    assert mb.logit_index.tolist() == [0] and mb.token_weights.tolist() == [0.0] and mb.response_lens == [1]
    micro_batches = pack_micro_batches([stand_in, TrainSample([1, 2, 3], 1, [0, 1])], 2, trained_only=True)
    assert [mb.labels.tolist() for mb in micro_batches] == [[0], [3]]


def test_per_token_advantages_follow_their_tokens_into_the_micro_batch():
    """Turn-level credit: a sample's own per-token advantages where it has them, its one advantage elsewhere; with
    trained_only the selected positions keep theirs."""
    samples = [
        TrainSample([10, 11, 12, 13, 14], response_start=2, loss_mask=[1, 0, 1], advantage=0.5,
                    advantages=[0.25, 9.0, -0.75]),
        TrainSample([20, 21, 22], response_start=1, loss_mask=[1, 1], advantage=-1.0),
    ]
    assert collate(samples, [0, 1]).advantages.tolist() == [0.25, 9.0, -0.75, -1.0, -1.0]
    assert collate(samples, [0, 1], trained_only=True).advantages.tolist() == [0.25, -0.75, -1.0, -1.0]
    with pytest.raises(ValueError, match="advantages has 2 entries for 3 response tokens"):
        TrainSample([10, 11, 12, 13, 14], response_start=2, loss_mask=[1, 0, 1], advantages=[0.25, 9.0])
