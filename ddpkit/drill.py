"""The interview drill: every hard question of the source documents, its strong answer, and a timer.

Notebook 16 asks each question with :func:`ask` (the question, and the answer in a collapsed block to
open only after answering aloud), then runs the evidence on real ranks. :func:`rehearse` is the timer
mode: ``count`` questions in random order, one at a time, ``seconds`` to answer each (a countdown),
then the strong answer. The questions come from seed 000's "Hard Questions And Strong Answers", seed
001's talk track, seed 002's trade-offs and seed 003's interview checklist (``source`` says which).
"""

from __future__ import annotations

import html
import random
import time
from dataclasses import dataclass

from ddpkit.hooks import Hook


@dataclass(frozen=True)
class Question:
    key: str
    source: str
    question: str
    answer: str


QUESTIONS = [
    Question("why-ddp", "seed 000, 002", "Why DDP instead of FSDP?",
             "DDP is the smallest correct baseline: whole replicas, one bucketed all-reduce overlapped with backward, "
             "simple failure semantics and checkpoints. Move to FSDP (or ZeRO) when replicated model state is what does "
             "not fit: it divides parameters, gradients and optimizer state by N, and pays with an all-gather before each "
             "block and a reduce-scatter after, which costs step time when the model fits anyway."),
    Question("silent-failure", "seed 000, 001", "What is the most dangerous silent failure?",
             "Sample duplication or omission across ranks: without a distributed sampler every rank trains on the same "
             "samples, the loss still falls, nothing crashes, and the model has seen 1/N of the data. Guard it with a "
             "sampler that partitions by (seed, epoch) and a fingerprint of the global sample ids (data_sha256)."),
    Question("resume-state", "seed 000, 001", "What state must survive a resume, and why does the loss change after a resume?",
             "Model, optimizer (Adam's moments and step), grad scaler, sampler position in global samples, every rank's "
             "RNG, the step, and the config's identity to refuse an incompatible restore. Restore only the weights and "
             "the Adam moments restart from zero: the loss departs from the uninterrupted run. With everything restored, "
             "the same world size resumes bitwise; another world size sums in another order, within float noise."),
    Question("slow-every-20-min", "seed 000", "How would you debug a slowdown that happens every 20 minutes?",
             "Correlate it with periodic work before blaming the model: checkpoint cadence and storage writes, evaluation, "
             "logging flushes. Look at per-rank step-time breakdowns (data, forward, backward, comm, optimizer) and mark "
             "the saves on the step-time plot; an async save or a faster writer removes the spike."),
    Question("not-build", "seed 000, 001, 002", "What would you deliberately not build in the interview?",
             "Cloud auth, scheduler job specs, vendor metrics exporters, multi-node bootstrapping, hybrid parallelism: "
             "keep their interfaces (hooks at the step boundary, a checkpoint writer, a strategy, a metrics sink) and "
             "leave the implementations as pseudocode."),
    Question("global-batch", "seed 001", "Why put the global batch on the config?",
             "Because the effective batch is micro x accumulation x data-parallel ranks: change the topology and the "
             "training changes silently unless the config makes it explicit. With it stated, 2 ranks x 8 and 1 rank x 8 "
             "x 2 accumulation see the same samples and give the same losses, and a resume that would change it is refused."),
    Question("correct", "issue list, seed 003", "How do you know the trainer is correct?",
             "By comparison, not by a falling loss: DDP against one process on the same global batch (the same gradients "
             "to float rounding), accumulation against a big batch, a resumed run against an uninterrupted one "
             "(bitwise), every sharded or split strategy against DDP, and hashes of the samples (data_sha256) and the "
             "weights (param_sha256) that make two runs comparable by string."),
    Question("strategy", "seed 003", "Data, tensor or pipeline parallelism: when each, and when does pipeline beat tensor?",
             "Data parallelism while the model fits (with ZeRO/FSDP when its state does not). Tensor parallelism when a "
             "layer is too big or too slow for one GPU: it all-reduces the full activation twice per block each way, so "
             "it stays inside a node on NVLink. Pipeline parallelism across nodes: one activation per micro-batch "
             "between neighbours, point to point, at the price of the bubble (p-1)/(m+p-1)."),
    Question("memory-70b", "seed 003", "How much memory does a 7B or a 70B model need, and on how many 80 GB GPUs?",
             "Mixed-precision Adam holds 16 bytes per parameter (bf16 weights and gradients, fp32 master, two fp32 "
             "moments): 112 GB for 7B, 1.12 TB for 70B, before activations. DDP cannot hold 7B on an 80 GB GPU; ZeRO-1 "
             "divides the 12 optimizer bytes by N, ZeRO-3/FSDP all 16. Activations come on top and activation "
             "checkpointing trades them for a third more compute."),
    Question("all-reduce", "seed 003", "What does an all-reduce cost, and how do you hide it?",
             "A ring all-reduce moves 2(N-1)/N x M bytes per rank: bandwidth-bound for large messages, latency-bound for "
             "small ones (alpha + beta x bytes). DDP buckets gradients (~25 MB) and all-reduces each bucket while "
             "backward computes the rest, so most of it overlaps compute; measure it with a comm hook, not as a remainder."),
    Question("zero-stages", "seed 003, 004", "What does each ZeRO stage partition, and what does it save?",
             "Stage 1 the optimizer state (fp32 master and moments: 12 of the 16 bytes per parameter), stage 2 also the "
             "gradients, stage 3 (FSDP) also the parameters. Per rank: 4 + 12/N, 2 + 14/N, 16/N bytes per parameter. "
             "Stage 1 costs no more communication than DDP (reduce-scatter + all-gather = one all-reduce)."),
    Question("bf16", "seed 003", "Why bf16 over fp16? What is loss scaling for?",
             "bf16 has fp32's exponent range: no overflow to inf at 65,504 and no gradient underflow, so no loss scaler. "
             "fp16 has more mantissa but a tiny range: gradients are scaled up before backward and unscaled (before "
             "clipping) after, and a step whose gradients overflowed is skipped."),
    Question("gpu-failure", "seed 003", "What happens when a GPU (a rank) dies mid-training?",
             "Its peers block in the next collective until the timeout; the launcher (or torchrun) sees the dead process, "
             "names it, stops the rest, and restarts the whole world, which resumes from the newest checkpoint that "
             "verifies. Recovery time is detection + restart + restore + first step; lost work is bounded by the save "
             "cadence, in seconds."),
    Question("scaling", "seed 003", "Why doesn't efficiency scale linearly with GPU count?",
             "Per step each rank computes 1/N of the work but the all-reduce still moves about 2M bytes and its latency "
             "grows with N; whatever is not overlapped with backward adds up, and stragglers set everyone's pace. "
             "Efficiency = compute / (compute + exposed communication) falls as N grows and as the model gets smaller."),
]


def question(key: str) -> Question:
    for q in QUESTIONS:
        if q.key == key:
            return q
    raise KeyError(f"no question {key!r}: one of {', '.join(q.key for q in QUESTIONS)}")


def _markdown(q: Question, reveal: bool = False) -> str:
    answer = html.escape(q.answer, quote=False)
    if reveal:
        return f"**{q.question}** *({q.source})*\n\n{answer}"
    return (f"**{q.question}** *({q.source})*\n\n<details><summary>Strong answer (open after answering aloud)"
            f"</summary>\n\n{answer}\n\n</details>")


def ask(key: str) -> Question:
    """Show a question with its answer collapsed (Markdown in Jupyter, text elsewhere)."""
    q = question(key)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Markdown(_markdown(q)))
    else:
        print(f"Q: {q.question} ({q.source})")
    return q


def rehearse(count: int, seconds: float = 60.0, seed: int | None = None, tick_s: float = 10.0) -> list[str]:
    """The timer mode: ``count`` questions in random order (``seed`` fixes it), each shown alone with
    ``seconds`` to answer aloud (a countdown line every ``tick_s``), then its strong answer. Returns the keys asked."""
    order = random.Random(seed).sample(QUESTIONS, k=min(count, len(QUESTIONS)))
    for n, q in enumerate(order, 1):
        print(f"\n[{n}/{len(order)}] {q.question}", flush=True)
        left = seconds
        while left > 0:
            time.sleep(min(tick_s, left))
            left -= tick_s
            if left > 0:
                print(f"    ... {left:.0f} s left", flush=True)
        print(f"    Strong answer: {q.answer}", flush=True)
    return [q.key for q in order]


# --------------------------------------------------------------------------- evidence that needs its own trainer

class _SampleIds(Hook):
    def __init__(self) -> None:
        self.ids: list[list[int]] = []

    def after_step(self, trainer, result) -> None:
        self.ids.append(list(result.sample_ids))


def train_with_sampler(ctx, cfg, partitioned: bool = True) -> dict:
    """Train ``cfg`` (a function for ``ddpkit.launch``) with the real sampler, or with every rank given
    rank 0's share (the silent bug: no error, a falling loss). Returns the losses and this rank's ids."""
    from ddpkit.data import ResumableDistributedSampler
    from ddpkit.train import Trainer

    class SameShareEverywhere(Trainer):
        def build_sampler(self):
            return ResumableDistributedSampler(len(self.dataset), self.ctx.dp_size, 0, self.cfg.global_batch_size, self.cfg.seed)

    ids = _SampleIds()
    trainer = (Trainer if partitioned else SameShareEverywhere)(ctx, cfg, hooks=[ids])
    summary = trainer.fit()
    return {"losses": [x["loss"] for x in summary["losses"]], "ids": ids.ids}
