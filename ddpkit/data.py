"""The data plane: which samples each rank sees, and where the run was when it stopped.

DDP synchronises gradients; it does **not** split the input. Without a distributed sampler every
rank trains on the same samples, and the run still looks healthy. Two rules make the input stream
correct, and this module enforces both:

1. **Partition**: in every epoch each sample goes to exactly one data-parallel rank (no duplicates, no
   omissions), decided by ``(seed, epoch)`` alone, so every rank computes the same partition without
   talking. Tensor- and pipeline-parallel peers share a data-parallel index and see the same samples.
2. **Position in global samples**: progress is "how many samples the *job* has trained on", counted
   by the training loop after each optimizer step, not by the sampler as the DataLoader pulls indices
   (workers prefetch ahead of training). A global count means a run can resume on a different world
   size and see exactly the same global stream.

:class:`ResumableDistributedSampler` yields, for an uninterrupted epoch, exactly the indices that
``torch.utils.data.DistributedSampler(shuffle=True, drop_last=True)`` yields (same ``randperm`` seeded
with ``seed + epoch``, data-parallel rank ``r`` takes every ``num_replicas``-th index), truncated to
whole global batches; the tests check this against PyTorch's own sampler.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from ddpkit.config import TrainConfig


class TemplateClassification(Dataset):
    """Each class is a fixed random template; an input is its class's template plus Gaussian noise.

    Learnable, so loss curves mean something: the templates have norm ``TEMPLATE_NORM`` against noise of
    norm about sqrt(width), so the classes overlap a little and the default MLP goes from ln(8) ~ 2.08 to
    about 0.3 within the notebooks' 40 steps, then keeps improving slowly. Labels from ``randint`` alone
    (as in the seed handbook) are noise: no model can do better than ln(num_classes), and a broken
    trainer looks the same as a working one.
    """

    TEMPLATE_NORM = 4.0

    def __init__(self, size: int, width: int, num_classes: int, seed: int, delay_s: float = 0.0):
        gen = torch.Generator().manual_seed(seed)
        templates = torch.randn(num_classes, width, generator=gen) * (self.TEMPLATE_NORM / width**0.5)
        self.labels = torch.randint(0, num_classes, (size,), generator=gen)  # (N,)
        self.features = templates[self.labels] + torch.randn(size, width, generator=gen)  # (N, width)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow input pipeline, for the input-bound demo
        return {"index": index, "inputs": self.features[index], "targets": self.labels[index]}


class MarkovTokens(Dataset):
    """Token sequences from a fixed sparse Markov chain: next-token prediction with a learnable rule."""

    def __init__(self, size: int, vocab_size: int, seq_len: int, seed: int, delay_s: float = 0.0):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab_size, vocab_size, generator=gen) * 4.0  # peaked transitions
        probs = torch.softmax(logits, dim=1)  # (V, V): row = current token
        tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab_size, (size,), generator=gen)
        for t in range(seq_len):
            tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=gen).squeeze(1)
        self.tokens = tokens  # (N, T+1)
        self.transition = probs  # (V, V): the rule a model can learn
        self.delay_s = delay_s

    def entropy_floor(self) -> float:
        """The mean loss of the chain itself on this data, -log P(next | current): no model can do
        better on average (every position depends on the token before it only)."""
        current, following = self.tokens[:, :-1], self.tokens[:, 1:]
        return float(-self.transition[current, following].log().mean())

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        if self.delay_s:
            time.sleep(self.delay_s)
        row = self.tokens[index]
        return {"index": index, "inputs": row[:-1], "targets": row[1:]}


class ResumableDistributedSampler(Sampler[int]):
    """A data-parallel rank's share of the current epoch, from a position counted in global samples.

    ``num_replicas`` and ``rank`` are the **data-parallel** size and index (``ctx.dp_size``,
    ``ctx.dp_rank``): tensor- and pipeline-parallel peers hold the same data-parallel index and so
    see the same samples. ``consumed_samples`` is the number of samples the whole job has trained on.
    The training loop sets it (:meth:`set_consumed`) before it asks for an epoch's iterator; iterating
    never changes it. The iterator covers the rest of the current epoch only; the loop asks again for
    the next epoch.
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int, global_batch_size: int,
                 seed: int, consumed_samples: int = 0):
        for name, value, low in (("dataset_len", dataset_len, 1), ("num_replicas", num_replicas, 1),
                                 ("global_batch_size", global_batch_size, 1), ("consumed_samples", consumed_samples, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank!r} is not in a data-parallel world of {num_replicas}")
        if global_batch_size % num_replicas:
            raise ValueError(f"global batch {global_batch_size} is not a multiple of {num_replicas} data-parallel ranks")
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.global_batch_size, self.seed = global_batch_size, seed
        self.samples_per_epoch = (dataset_len // global_batch_size) * global_batch_size
        if self.samples_per_epoch == 0:
            raise ValueError(f"global batch {global_batch_size} is larger than the dataset ({dataset_len})")
        self.consumed_samples = consumed_samples

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    def set_consumed(self, consumed_samples: int) -> None:
        """Where the job is, in global samples (set by the training loop, restored from checkpoints)."""
        self.consumed_samples = consumed_samples

    def epoch_order(self, epoch: int) -> list[int]:
        """The global shuffle of an epoch: the same ``randperm`` as ``DistributedSampler``."""
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_len, generator=gen).tolist()

    def __iter__(self):
        offset = self.consumed_samples % self.samples_per_epoch
        order = self.epoch_order(self.epoch)
        return iter(order[offset + self.rank: self.samples_per_epoch: self.num_replicas])

    def __len__(self) -> int:
        offset = self.consumed_samples % self.samples_per_epoch
        return (self.samples_per_epoch - offset) // self.num_replicas

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.set_consumed(int(state["consumed_samples"]))


def build_dataset(cfg: TrainConfig):
    """The synthetic dataset a config names (identical on every rank)."""
    if cfg.model == "mlp":
        return TemplateClassification(cfg.dataset_size, cfg.input_width, cfg.num_classes, cfg.seed,
                                     cfg.data_delay_s)
    return MarkovTokens(cfg.dataset_size, cfg.vocab_size, cfg.seq_len, cfg.seed, cfg.data_delay_s)


class HandbookResumeSampler(DistributedSampler):
    """The seed handbook's sampler, kept verbatim in behaviour to demonstrate its two bugs. Do not use.

    1. ``consumed`` is never reset, so after the first epoch ``indices[consumed:]`` is empty: epochs
       2, 3, ... yield nothing and only the first epoch trains.
    2. ``consumed`` counts indices as the DataLoader *pulls* them; with workers that prefetch, it runs
       ahead of what was trained, so a resume skips samples.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int = 0, consumed: int = 0, **kwargs):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, seed=seed, **kwargs)
        self.consumed = consumed

    def __iter__(self):
        indices = list(super().__iter__())
        for index in indices[min(self.consumed, len(indices)):]:
            yield index
            self.consumed += 1


@dataclass
class PartitionReport:
    """What a partition check found. ``ok`` means every sample went to exactly one rank."""

    duplicates: dict[int, int]  # sample id -> times seen (> 1)
    omitted: list[int]  # sample ids no rank saw
    per_rank: list[int]  # samples seen by each rank

    @property
    def ok(self) -> bool:
        return not self.duplicates and not self.omitted

    def describe(self) -> str:
        if self.ok:
            return f"partition ok: {sum(self.per_rank)} samples, each on exactly one rank {self.per_rank}"
        return (f"partition broken: {len(self.duplicates)} samples seen more than once, "
                f"{len(self.omitted)} never seen (per rank: {self.per_rank})")


def check_partition(per_rank_indices: list[list[int]], expected: list[int] | range) -> PartitionReport:
    """Compare what the ranks saw in one epoch with the samples that epoch should cover."""
    counts = Counter(i for indices in per_rank_indices for i in indices)
    duplicates = {i: c for i, c in counts.items() if c > 1}
    omitted = sorted(set(expected) - set(counts))
    return PartitionReport(duplicates, omitted, [len(indices) for indices in per_rank_indices])


def assert_partition(per_rank_indices: list[list[int]], expected: list[int] | range) -> PartitionReport:
    """:func:`check_partition`, raising ``AssertionError`` with the details when it is broken."""
    report = check_partition(per_rank_indices, expected)
    assert report.ok, report.describe()
    return report
