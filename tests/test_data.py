import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.data import (HandbookResumeSampler, MarkovTokens, ResumableDistributedSampler,
                         TemplateClassification, assert_partition, check_partition)

N = 200


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_an_epoch_equals_pytorchs_distributed_sampler(world_size):
    """Same randperm, same stride: bitwise the indices torch's own sampler yields (whole batches)."""
    global_batch = 8 * world_size
    for epoch in range(3):
        ours = [list(ResumableDistributedSampler(N, world_size, r, global_batch, seed=17,
                                                 consumed_samples=epoch * (N // global_batch) * global_batch))
                for r in range(world_size)]
        for rank in range(world_size):
            theirs = DistributedSampler(range(N), num_replicas=world_size, rank=rank, seed=17, drop_last=True)
            theirs.set_epoch(epoch)
            assert ours[rank] == list(theirs)[: len(ours[rank])]


def test_every_epoch_sees_every_sample_once_across_ranks():
    world, global_batch = 4, 40  # 200 samples = 5 whole global batches
    orders = []
    for epoch in range(3):
        per_rank = [list(ResumableDistributedSampler(N, world, r, global_batch, 3, epoch * N)) for r in range(world)]
        assert_partition(per_rank, range(N))
        orders.append(per_rank[0])
    assert orders[0] != orders[1] != orders[2]  # the shuffle changes every epoch


def test_resume_mid_epoch_continues_the_same_partition():
    world, global_batch = 2, 20
    full = [list(ResumableDistributedSampler(N, world, r, global_batch, 3)) for r in range(world)]
    first_part = [ranks[:30] for ranks in full]  # 3 steps of 10 per rank = 60 global samples
    resumed = [list(ResumableDistributedSampler(N, world, r, global_batch, 3, consumed_samples=60)) for r in range(world)]
    assert [a + b for a, b in zip(first_part, resumed)] == full
    assert_partition([a + b for a, b in zip(first_part, resumed)], range(N))


def test_the_global_stream_does_not_depend_on_world_size():
    global_batch = 16
    for consumed in (0, 48, 208):
        streams = []
        for world in (1, 2, 4):
            per_rank = [list(ResumableDistributedSampler(N, world, r, global_batch, 9, consumed)) for r in range(world)]
            step_sets = [sorted(i for ranks in per_rank for i in ranks[s * global_batch // world:(s + 1) * global_batch // world])
                         for s in range(len(per_rank[0]) * world // global_batch)]
            streams.append(step_sets)
        assert streams[0] == streams[1] == streams[2]


def test_no_distributed_sampler_means_duplicates():
    per_rank = [list(range(N)), list(range(N))]  # what two ranks see with a plain DataLoader
    report = check_partition(per_rank, range(N))
    assert not report.ok and len(report.duplicates) == N


def test_handbook_sampler_trains_only_the_first_epoch():
    sampler = HandbookResumeSampler(range(N), num_replicas=2, rank=0, seed=3, drop_last=True)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    assert len(epochs[0]) == N // 2 and epochs[1] == [] and epochs[2] == []


def test_handbook_sampler_counts_prefetched_samples_as_trained():
    sampler = HandbookResumeSampler(range(N), num_replicas=1, rank=0, seed=3)
    loader = DataLoader(range(N), batch_size=1, sampler=sampler, num_workers=2, prefetch_factor=4)
    trained = 0
    for _ in loader:
        trained += 1
        if trained == 4:
            break
    assert sampler.consumed > trained  # a resume from `consumed` would skip the difference


def test_datasets_are_deterministic_and_learnable_shaped():
    a, b = TemplateClassification(64, 16, 4, seed=1), TemplateClassification(64, 16, 4, seed=1)
    assert torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels)
    assert len(set(a.labels.tolist())) > 1
    item = MarkovTokens(8, 64, 16, seed=1)[3]
    assert item["index"] == 3 and item["inputs"].shape == (16,) and torch.equal(item["inputs"][1:], item["targets"][:-1])


@pytest.mark.parametrize("args, message", [
    ((N, 3, 0, 16, 0), "not a multiple"),
    ((10, 2, 0, 16, 0), "larger than the dataset"),
    ((10, 0, 0, 4, 0), "num_replicas must be a whole number >= 1"),
    ((10, 2, 2, 4, 0), "rank 2 is not in a data-parallel world of 2"),
    ((10, 2, -1, 4, 0), "rank -1 is not"),
    ((0, 1, 0, 4, 0), "dataset_len must be"),
    ((10, 1, 0, 0, 0), "global_batch_size must be"),
    ((10, 1, 0, 4, 0, -4), "consumed_samples must be"),
])
def test_sampler_rejects_impossible_shapes(args, message):
    with pytest.raises(ValueError, match=message):
        ResumableDistributedSampler(*args)
