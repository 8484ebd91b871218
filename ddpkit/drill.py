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
             "not fit: it divides parameters, gradients and optimizer state by N, and pays in communication: an all-gather "
             "of each block's parameters before its forward, a second one before its backward, and a reduce-scatter of its "
             "gradients after: about 1.5x DDP's bytes (the ZeRO paper's 3 Psi against 2 Psi), in more, smaller messages, "
             "which costs step time when the model fits anyway. ZeRO-1 and -2 move no more bytes than DDP."),
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
             "Log every rank's step time with a wall-clock timestamp and the phase breakdown (data, forward, backward, "
             "comm, optimizer), find the period, and line it up with everything periodic: checkpoint saves (the write, "
             "and the page-cache writeback or fsync stall that can come seconds later), evaluation, logging flushes, "
             "epoch boundaries (DataLoader workers restart unless persistent_workers=True; the sampler reshuffles), "
             "Python's garbage collector (gc.callbacks; freeze it or collect at the step boundary on every rank). Then "
             "what is outside the job: a noisy neighbour on shared storage or network, a cron job, thermal or power "
             "throttling of one GPU (nvidia-smi's clocks and throttle reasons). One slow rank slows every rank at the next "
             "collective, so compare per-rank times, not the average; here the spike lines up with the save."),
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
             "Mixed-precision Adam holds 16 bytes per parameter (16-bit weights and gradients, fp32 master, two fp32 "
             "moments; the ZeRO paper's K = 12): 112 GB for 7B, 1.12 TB for 70B, before activations. DDP cannot hold "
             "7B on an 80 GB GPU; ZeRO-1 fits it on 2 (14 + 14 + 84/2 = 70 GB), FSDP on 2 (56 GB). For 70B the state "
             "alone needs 1120/80 = 14 GPUs with FSDP, 15 with a little headroom, and more in practice: activations "
             "(batch x sequence x width x layers, not sharded by data parallelism; activation checkpointing trades "
             "most of them for about one more forward), the all-gathered block FSDP holds during compute, "
             "communication buckets and allocator fragmentation. Seed 003's 840 GB leaves out the fp32 master copy."),
    Question("all-reduce", "seed 003", "What does an all-reduce cost, and how do you hide it?",
             "A ring all-reduce moves 2(N-1)/N x M bytes per rank: bandwidth-bound for large messages, latency-bound for "
             "small ones (alpha + beta x bytes). DDP buckets gradients (~25 MB) and all-reduces each bucket while "
             "backward computes the rest, so most of it overlaps compute; measure it with a comm hook, not as a remainder."),
    Question("zero-stages", "seed 003, 004", "What does each ZeRO stage partition, and what does it save?",
             "Stage 1 the optimizer state (fp32 master and moments: 12 of the 16 bytes per parameter), stage 2 also the "
             "gradients, stage 3 (FSDP) also the parameters. Per rank: 4 + 12/N, 2 + 14/N, 16/N bytes per parameter. "
             "Stages 1 and 2 cost no more communication than DDP (reduce-scatter + all-gather = one all-reduce); stage 3 "
             "all-gathers the parameters again in backward: about 1.5x DDP's traffic (the ZeRO paper's 3 Psi vs 2 Psi)."),
    Question("bf16", "seed 003", "Why bf16 over fp16? What is loss scaling for?",
             "bf16 has fp32's 8-bit exponent: its range matches fp32's, so nothing overflows at fp16's 65,504 and "
             "small gradients rarely underflow (rarely, not never: below ~1e-38 they become subnormal and lose precision, and kernels that flush subnormals to zero drop them), which is why bf16 "
             "training usually runs without a loss scaler. Its price is precision: 8 significant bits (7 stored), "
             "about 2-3 decimal digits (2.4), so 1 + 1e-3 rounds to 1; that is why the master weights, the optimizer's update "
             "and reductions stay in fp32. fp16 has 11 significant bits but a 5-bit exponent: the *loss* is multiplied "
             "by a scale before backward (so every gradient is), the gradients are unscaled before clipping, and the "
             "scale is dynamic: GradScaler halves it and skips the step when a gradient is inf or NaN, and doubles it "
             "after 2000 clean steps (its defaults: 2^16, 0.5, 2.0, 2000)."),
    Question("gpu-failure", "seed 003", "What happens when a GPU (a rank) dies mid-training?",
             "It depends how it dies. A process that exits: on gloo its peers fail at once (their sockets read "
             "'Connection reset by peer' or 'Connection closed by peer'); on NCCL they wait in the collective until "
             "NCCL reports the lost peer (a remote error, seen over network transports) or the watchdog's timeout "
             "(10 minutes by default) aborts them. Either way the launcher (ddpkit's monitor, torchrun's agent) sees the exit, names "
             "the rank and stops the rest; where restarts are allowed (ddpkit's and torchrun's --max-restarts, 0 by "
             "default) it starts the world again, and the training script resumes from the newest checkpoint that "
             "verifies. A GPU that hangs "
             "without exiting is worse: no exit code, only a stalled collective; you find it with the NCCL watchdog and "
             "its heartbeat monitor (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC), Xid errors in the kernel log and per-rank step "
             "times, then exclude or replace the node before restarting (a restart on the same bad GPU fails again). At "
             "scale, recovery without a full restart: per-replica fault tolerance (torchft: the healthy replicas "
             "continue, the failed one rejoins) and restoring from peers' memory instead of storage. Recovery time = "
             "detection + restart + restore + first step (measured here); lost work is bounded by the save cadence in "
             "seconds."),
    Question("scaling", "seed 003", "Why doesn't efficiency scale linearly with GPU count?",
             "First say which scaling. Weak scaling (each GPU keeps its batch, DDP's usual case): compute per GPU is "
             "constant; the ring's bytes per GPU stay about 2M but the step waits for (1) the slowest link, which drops "
             "from NVLink to the network once the job leaves one node (about 6-12x slower per GPU on DGX-class nodes with "
             "one 200-400 Gb/s NIC per GPU, far more with fewer or slower NICs); (2) the latency term, 2(N-1) "
             "messages (trees make it log N); (3) the slowest of N GPUs: stragglers, whose expected maximum grows with "
             "N. Strong scaling (the global batch fixed): each GPU's compute also shrinks as 1/N while the all-reduce "
             "does not, so efficiency collapses much sooner. Seed 003's table (90% at 8 GPUs down to 60% at 1,024) has "
             "that shape only with most of the all-reduce hidden behind backward and stragglers that grow with N: the "
             "links alone give a step at the node boundary, then a plateau. Levers: overlap the all-reduce with backward "
             "(buckets), hierarchical collectives, bigger per-GPU work, and finding stragglers from per-rank step times."),
    Question("plan-70b", "seed 003", "How would you train a 70B-parameter model?",
             "State first: 16 bytes/param with Adam in mixed precision = 1.12 TB (seed 003 says 840 GB: it leaves out "
             "the fp32 master copy). Layout: tensor parallelism 8 inside a node (it all-reduces activations every layer: "
             "NVLink only), pipeline 4 across nodes (80 layers, 20 per stage; one activation per micro-batch between "
             "stages), data parallelism 4 over the rest: 8 x 4 x 4 = 128 GPUs, about 35 GB of state per GPU (16 bytes x "
             "70B / 32), about 15 GB with the optimizer state sharded over the data-parallel 4 (ZeRO-1), leaving room "
             "for activations. The schedule: 1F1B holds at most p = 4 micro-batches of activations but has GPipe's "
             "bubble, (p-1)/(m+p-1): with 8 micro-batches that is 3/11 = 27%, not 'minimal', so efficiency is at most "
             "73% before any communication, below the seed's 75-80%; 80% needs m >= 12, or interleaved stages (v = 2 "
             "chunks per GPU: 3/19 = 16%). bf16 without a loss scaler, activation checkpointing, DDP's all-reduce "
             "overlapped with backward. Checkpoints: asynchronous, every 15 minutes, so a failure loses 7.5 minutes on "
             "average and 15 plus the save in flight and the restart at worst, not 'at most 15'."),
    # the advanced lessons (10b, 13, 17-19): each number below is computed by the kit (tests/test_drill.py)
    Question("context-parallel", "lesson 17; Liu et al. 2023", "How do you train on a sequence too long for one GPU's "
             "activations, and why the zig-zag layout?",
             "Context parallelism: every rank holds 1/N of the sequence in every layer, so activations shrink N-fold. "
             "Everything but attention is per position; attention needs every earlier key, so ring attention passes "
             "the key/value blocks around the ranks: in N steps each rank's queries meet every block, the next block's "
             "transfer overlapped with the current one's compute, and the partial outputs merged exactly by online "
             "softmax (each re-weighted by its log-sum-exp). With causal masking a contiguous split is unbalanced: cut "
             "in 2N chunks on 4 ranks, contiguous chunks cost the ranks 3, 7, 11 and 15 query-key blocks; rank r holding "
             "chunks r and 2N-1-r (zig-zag, torch's head-tail load balancing) costs 9 each, and since every ring step "
             "waits for the slowest rank, that is 15 against 9 per step."),
    Question("experts", "lesson 18; GShard, Switch Transformer", "How does expert parallelism move tokens, and what does "
             "the capacity factor trade?",
             "A router sends each token to its top-k of E experts. With the experts split over ep ranks, each rank "
             "routes its own tokens, exchanges how many rows go to each rank (the receivers cannot know before routing), "
             "then one all-to-all sends each row to its expert's rank, the experts run, and a reverse all-to-all brings "
             "the rows home to be weighted by their gates: two all-to-alls per layer forward, two backward (the split "
             "sizes swapped). Capacity fixes each expert's batch: ceil(capacity factor x k x tokens / E), 1,280 slots for "
             "4,096 tokens, 8 experts, top-2 and a factor of 1.25 (1,024 when perfectly balanced); assignments past it "
             "are dropped (the residual carries the token on). A higher factor drops less but pads more compute and "
             "all-to-all bytes; a load-balancing loss (E x sum f_e P_e, 1 when uniform) keeps the router spread."),
    Question("pipeline-bubbles", "lessons 13, 19; Narayanan et al. 2021, Qi et al. 2023", "How do interleaved and "
             "zero-bubble schedules shrink the pipeline bubble, and what do they cost?",
             "Counted against the ideal compute time, 1F1B idles (p-1)/m. Interleaving gives each rank v thinner "
             "chunks, so each hop of the fill and drain costs 1/v of a stage: (p-1)/(v m), for v times the "
             "point-to-point messages and a longer warm-up holding more activations. Zero bubble splits each backward "
             "into the input gradient, which the previous stage waits for, and the weight gradient, which nobody "
             "waits for, and fills idle slots with the latter: ZB-H1 reaches (p-1)/(3m) when forward, input and "
             "weight gradient take equal time, at 1F1B's memory; ZB-V (two chunks per rank in a V) leaves no rank "
             "idle between its first and last action once m >= 2p-1. On the kit's simulator with p = 4, m = 8: 1F1B "
             "37.5%, interleaved v = 2 18.75%, ZB-H1 12.5%, ZB-V 0% inside each rank."),
    Question("fsdp-knobs", "lesson 10b; torch fully_shard", "What do reshard_after_forward and HSDP trade in FSDP2?",
             "reshard_after_forward=True frees each unit's gathered parameters after its forward and all-gathers them "
             "again in backward (ZeRO-3); False keeps them from forward to backward, one all-gather fewer per unit, "
             "holding every unit's whole parameters in between (torch's default, None, is True except for the root "
             "module, which backward needs at once; an int reshards to a smaller group, e.g. a node). On 4 ranks the "
             "4-layer, 64-wide model of lesson 10b holds 16,640 bytes of fp32 parameters between forward and backward "
             "with True, 83,200 with False (its shard plus the 66,560 gathered). HSDP shards inside a group and "
             "replicates across groups (a 2-D mesh, placements (Replicate(), Shard(0))): all-gathers and "
             "reduce-scatters stay on a node's fast links and only an all-reduce of each gradient shard crosses nodes, "
             "for state divided by the group, not the world: 7B in mixed precision holds 7.0 GB per GPU under FSDP on "
             "16 GPUs, 14.0 GB under HSDP with groups of 8."),
    Question("tp-in-node", "lesson 19; Narayanan et al. 2021, section 3", "Why keep tensor parallelism inside a node?",
             "Tensor parallelism all-reduces a whole activation (batch x sequence x width) twice per transformer layer "
             "in forward and twice in backward (Megatron-LM), between operations that need the result. Some of it "
             "hides: Megatron-LM runs the input-gradient all-reduce while it computes the weight gradient, and with "
             "sequence parallelism (reduce-scatter + all-gather) async tensor parallelism cuts the forward's "
             "collectives into pieces pipelined with the matmuls; the rest still waits on the link. "
             "Pipeline parallelism sends one activation per micro-batch per stage boundary and data parallelism "
             "reduces gradients once per step, mostly behind backward: those tolerate the slow link. So tensor "
             "parallelism up to the GPUs of one node (NVLink), pipeline across nodes, data parallelism for the rest. "
             "The kit's planner rediscovers it from bandwidths alone: seed 003's TP 8 x PP 4 x DP 4 on 16 nodes of 8 "
             "takes 4.51 s per step with each tensor-parallel group inside a node and 6.29 s with it across nodes "
             "(1.40x); give the cluster one link class and every placement takes the same time."),
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
