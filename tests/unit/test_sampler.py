from rlsearch.trainer import EpochSampler


def test_epoch_sampler_is_deterministic_and_covers_each_epoch():
    a = EpochSampler(list(range(10)), seed=3)
    b = EpochSampler(list(range(10)), seed=3)
    first = [a.next_batch(4) for _ in range(5)]
    assert first == [b.next_batch(4) for _ in range(5)]
    flat = [x for batch in first for x in batch]
    assert sorted(flat[:10]) == list(range(10))
    assert sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]
    assert (a.state.epoch, a.state.position) == (1, 10)
    assert EpochSampler(list(range(10)), seed=4).next_batch(10) != flat[:10]


def test_epoch_sampler_restore_continues_the_same_order_across_epochs():
    from rlsearch.trainer.sampler import SamplerState

    uninterrupted = EpochSampler(list(range(10)), seed=3)
    batches = [uninterrupted.next_batch(4) for _ in range(6)]
    restored = EpochSampler(list(range(10)), seed=3)
    restored.restore(SamplerState(epoch=1, position=2))  # where the sampler stood after three batches
    assert [restored.next_batch(4) for _ in range(3)] == batches[3:]
