"""Pipeline schedules beyond 1F1B: interleaved virtual stages, and a backward split in two.

**Interleaved 1F1B** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2.2). The model is cut into p * v *virtual stages* (chunks) and
rank r holds chunks r, r + p, r + 2p, ...: each rank owns v thinner slices instead of one thick one. The
warm-up and flush still cross p ranks, but each hop now costs a chunk's time, 1/v of a stage's, so the
pipeline flush shrinks by v. In the paper's terms, with t_f and t_b a whole stage's forward and backward,
the ideal time of a batch is t_id = m (t_f + t_b) and the bubble time t_pb = (p - 1)(t_f + t_b) / v:

    bubble time fraction = t_pb / t_id = (p - 1) / (v m)

a share of the *ideal compute time*, not of the step (1F1B's is (p - 1) / m in the same units). The price,
in the paper's words: "the amount of communication also increases by v", and the first ranks hold more
activations during the longer warm-up. (The paper asks m to be a multiple of p; torch, and this module,
accept any m divisible by the number of rounds, max(1, m // p): with p = 4, m = 3, 6 or 10 are accepted and
m = 9 is not. A round then holds at least p micro-batches, or all m when m < p.)

**Zero bubble** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"). A backward is two computations: the
gradient of the *input* (the paper's B, torch's ``I``), which the previous stage is waiting for, and the
gradient of the *weights* (``W``), which nobody waits for. Sending B's result on at once and running W
later fills idle slots. ZB-H1 (section 2.1) keeps 1F1B's warm-up and delays W passes so that no stage
holds more micro-batches than 1F1B's first stage; with T_F = T_B = T_W its bubble is a third of 1F1B's:
(p - 1) / (3m) of the ideal time, against (p - 1) / m. torch's generator (followed here) has rank r skip
the W of its first r steady steps and run those W passes in the flush. torch's
``ScheduleInterleavedZeroBubble`` is the same with v chunks per rank: torch documents it as the paper's
ZB1P (the schedule its algorithm finds under 1F1B's memory limit); with v = 1 its order has ZB-H1's
shape, which is what this module generates and checks.

**ZB-V** (Qi et al., section 6): two chunks per rank placed in a V (rank r holds chunks r and 2p - 1 - r,
so the last rank runs the middle two back to back and the first rank holds both ends), with F, B and W
ordered so that, when T_F = T_B = T_W and m >= 2p - 1, no rank is idle between its first action and its
last, at 1F1B's peak activation memory. That is the paper's zero bubble: the ranks' staggered start and
end fit against the next step's when no synchronization separates the steps (its section 4).

Here the generators return each rank's actions in order (kinds ``F``, ``B`` = full backward, ``I``, ``W``
as in ``torch.distributed.pipelining``), :func:`simulate` runs them on a clock and refuses any order that
breaks a dependency, and :func:`torch_order` asks torch's own schedule classes for theirs, to compare.
"""

from __future__ import annotations

from types import SimpleNamespace

from ddpkit.parallel.pipeline import Action, gpipe, one_f_one_b

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zbv")
# a whole stage's forward, full backward, input-gradient and weight-gradient times: the paper's
# T_F = T_B = T_W, with a full backward being B + W
TIMES = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def chunks_per_rank(name: str, v: int = 2) -> int:
    """How many virtual stages each rank holds under a schedule."""
    return {"gpipe": 1, "1f1b": 1, "zbv": 2}.get(name, v)


def stage_ranks(p: int, v: int, style: str = "loop") -> list[int]:
    """The rank that holds each of the p * v chunks: ``loop`` puts chunk c on rank c mod p (interleaved);
    ``v`` goes down the ranks and back up (ZB-V: rank r holds chunks r and 2p - 1 - r)."""
    if style == "loop":
        return [c % p for c in range(p * v)]
    return [c % p if (c // p) % 2 == 0 else p - 1 - c % p for c in range(p * v)]


def _rounds(p: int, m: int) -> int:
    """Micro-batches per round: forwards go p at a time through one chunk before moving to the next."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"{m} micro-batches do not split into {rounds} equal rounds (max(1, m // p) of them, p = {p}): "
                         f"use a multiple of {p}")
    return m // rounds


def interleaved(p: int, m: int, v: int, zero_bubble: bool = False) -> list[list[Action]]:
    """Interleaved 1F1B (``zero_bubble=False``) or its zero-bubble form, each rank's actions in order.

    A rank's forwards visit its chunks depth first: a round of micro-batches through its first chunk, the
    same round through its second, ... (Narayanan et al., figure 4). Warm-up: (v - 1) rounds plus two
    forwards per hop from the last rank (one per hop with the backward split, whose B comes back sooner);
    then one forward and one backward in turn; then the remaining backwards. With ``zero_bubble`` the
    backward is I, and each I after the first ``rank`` steady ones is followed by the oldest deferred W
    (ZB-H1's delay); the deferred W run at the end."""
    if v < 1 or p < 1 or m < 1:
        raise ValueError(f"need p, m, v >= 1 (got p={p}, m={m}, v={v})")
    per_round = _rounds(p, m) if v > 1 else m  # one chunk per rank: no rounds to split into
    orders = []
    for r in range(p):
        total = v * m
        warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), total)
        chunk_f = [((k // per_round) % v) * p + r for k in range(total)]
        chunk_b = [(v - 1 - ((k - warmup) // per_round) % v) * p + r for k in range(warmup, warmup + total)]
        seen_f: dict[int, int] = {}
        seen_b: dict[int, int] = {}

        def take(seen, chunk):
            seen[chunk] = seen.get(chunk, 0) + 1
            return seen[chunk] - 1

        order: list[Action] = []
        pending_w: list[Action] = []
        for k in range(total):
            c = chunk_f[k]
            order.append(Action("F", c, take(seen_f, c)))
            if k >= warmup:  # past the warm-up, each forward is followed by a backward
                order += _backward(chunk_b[k - warmup], take(seen_b, chunk_b[k - warmup]), zero_bubble, pending_w,
                                   release=k - warmup >= r)
        for j in range(total - warmup, total):  # flush: the backwards still owed
            order += _backward(chunk_b[j], take(seen_b, chunk_b[j]), zero_bubble, pending_w,
                               release=j >= r)
        order += pending_w
        orders.append(order)
    return orders


def _backward(chunk: int, micro: int, zero_bubble: bool, pending_w: list[Action], release: bool) -> list[Action]:
    if not zero_bubble:
        return [Action("B", chunk, micro)]
    pending_w.append(Action("W", chunk, micro))
    return [Action("I", chunk, micro)] + ([pending_w.pop(0)] if release else [])


def zero_bubble(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """ZB-H1 (v = 1) and its interleaved form ZB1P (v > 1): :func:`interleaved` with the backward split."""
    return interleaved(p, m, v, zero_bubble=True)


def zbv(p: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al., section 6): rank r holds chunk r (going down) and chunk 2p - 1 - r (coming back).

    Warm-up: 2(p - r) - 1 forwards of the first chunk, then r pairs (second chunk, first chunk), then
    p - r rounds of F, I, W on the second chunk; steady: F I W on the first chunk, then on the second;
    flush: r pairs of I (first, second), p - r pairs of I and W on the first chunk, then every W left.
    The order is built for max(m, 2p - 1) micro-batches, and actions of the ones beyond m are dropped."""
    if p < 1 or m < 1:
        raise ValueError(f"need p, m >= 1 (got p={p}, m={m})")
    n = max(2 * p - 1, m)
    orders = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        count = {(k, c): 0 for k in "FIW" for c in (down, up)}
        order: list[Action] = []

        def act(kind, chunk):
            order.append(Action(kind, chunk, count[(kind, chunk)]))
            count[(kind, chunk)] += 1

        for _ in range(2 * (p - r) - 1):
            act("F", down)
        for _ in range(r):
            act("F", up), act("F", down)
        for _ in range(p - r):
            act("F", up), act("I", up), act("W", up)
        while count[("F", up)] < count[("F", down)] or count[("F", down)] < n:
            if count[("F", down)] < n:
                act("F", down)
            act("I", down), act("W", down)
            act("F", up), act("I", up), act("W", up)
        for _ in range(r):
            act("I", down), act("I", up)
        for _ in range(p - r):
            act("I", down), act("W", down)
        while count[("W", up)] < count[("I", up)]:
            act("W", up)
        while count[("W", down)] < count[("I", down)]:
            act("W", down)
        orders.append([a for a in order if a.micro < m])
    return orders


def generate(name: str, p: int, m: int, v: int = 2) -> list[list[Action]]:
    """Each rank's actions for a schedule named in :data:`SCHEDULES` (``v`` for the interleaved ones)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, v)
    if name == "zero-bubble":
        return zero_bubble(p, m, v)
    return zbv(p, m)


def needs(a: Action, n_stages: int) -> list[tuple[str, int, int]]:
    """What an action waits for: a forward the previous chunk's forward of its micro-batch; an input
    gradient (``B`` or ``I``) its own forward and the next chunk's input gradient; a ``W`` its own ``I``."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.micro)] if a.stage > 0 else []
    if a.kind == "W":
        return [("I", a.stage, a.micro)]
    return [("F", a.stage, a.micro)] + ([("dx", a.stage + 1, a.micro)] if a.stage < n_stages - 1 else [])


def _check_complete(orders: list[list[Action]]) -> tuple[int, int]:
    """Every chunk on one rank, each micro-batch's F once and either B or I and W once: refuse otherwise."""
    owner: dict[int, int] = {}
    seen: dict[tuple[str, int, int], int] = {}
    for r, order in enumerate(orders):
        for a in order:
            if owner.setdefault(a.stage, r) != r:
                raise ValueError(f"chunk {a.stage} appears on ranks {owner[a.stage]} and {r}: a chunk lives on one rank")
            key = (a.kind, a.stage, a.micro)
            seen[key] = seen.get(key, 0) + 1
    n_stages = max(owner) + 1
    m = 1 + max(k[2] for k in seen)
    for s in range(n_stages):
        for i in range(m):
            full, split = seen.get(("B", s, i), 0), (seen.get(("I", s, i), 0), seen.get(("W", s, i), 0))
            if seen.get(("F", s, i), 0) != 1 or (full, split) not in ((1, (0, 0)), (0, (1, 1))):
                raise ValueError(f"chunk {s} micro-batch {i}: needs one F and either one B or one I and one W "
                                 f"(has F x{seen.get(('F', s, i), 0)}, B x{full}, I x{split[0]}, W x{split[1]})")
    return n_stages, m


def simulate(orders: list[list[Action]], times: dict[str, float] | None = None) -> list[dict]:
    """Run each rank's actions in its order on a clock. An action starts when its rank is free and all it
    :func:`needs` is done; it lasts ``times[kind] / v``, v being the chunks per rank (a chunk is 1/v of a
    stage's layers). Messages between ranks are instant. Returns the timeline (rank, stage = chunk, kind,
    micro, start, end). Raises ValueError for an incomplete order or one that can never finish."""
    times = {**TIMES, **(times or {})}
    n_stages, _ = _check_complete(orders)
    p = len(orders)
    v = n_stages / p
    done: dict[tuple[str, int, int], float] = {}
    position, free_at, timeline = [0] * p, [0.0] * p, []
    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] >= len(orders[r]):
                continue
            a = orders[r][position[r]]
            wanted = needs(a, n_stages)
            if all(w in done for w in wanted):
                start = max([free_at[r]] + [done[w] for w in wanted])
                end = start + times[a.kind] / v
                done[(a.kind, a.stage, a.micro)] = free_at[r] = end
                if a.kind in "BI":  # what the previous chunk waits for, whichever way it was computed
                    done[("dx", a.stage, a.micro)] = end
                timeline.append({"rank": r, "stage": a.stage, "kind": a.kind, "micro": a.micro,
                                 "start": start, "end": end})
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: f"{orders[r][position[r]].kind}{orders[r][position[r]].micro}@{orders[r][position[r]].stage}"
                     for r in range(p) if position[r] < len(orders[r])}
            raise ValueError(f"schedule deadlocks: each rank waits on work that cannot come first ({stuck})")
    return timeline


def bubble_over_ideal(timeline: list[dict]) -> float:
    """Megatron's bubble time fraction: idle time of a rank over its ideal (busy) time, t_pb / t_id, from
    a timeline: (ranks x span - busy) / busy. 1F1B gives (p - 1) / m, interleaved (p - 1) / (v m)."""
    ranks = {e["rank"] for e in timeline}
    span = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    busy = sum(e["end"] - e["start"] for e in timeline)
    return (len(ranks) * span - busy) / busy


def bubble_within_ranks(timeline: list[dict]) -> float:
    """Idle time inside each rank's own span (its first start to its last end) over busy time: the
    parallelogram Qi et al. count, whose staggered start and end fit against the next step's when no
    synchronization separates the steps (their section 4). ZB-V makes this 0 for m >= 2p - 1; a single
    step still pays the stagger, which :func:`bubble_over_ideal` counts."""
    idle = busy = 0.0
    for r in {e["rank"] for e in timeline}:
        mine = [e for e in timeline if e["rank"] == r]
        work = sum(e["end"] - e["start"] for e in mine)
        idle += max(e["end"] for e in mine) - min(e["start"] for e in mine) - work
        busy += work
    return idle / busy


def held(timeline: list[dict], rank: int, v: int) -> float:
    """The most activations ``rank`` holds at once, in micro-batches of a whole stage's layers (a chunk's
    count 1/v): a chunk's activations exist from its forward's end until its last backward part (B, or W
    with the split, since W needs the layer inputs) starts."""
    last = {(e["stage"], e["micro"]): e for e in timeline if e["rank"] == rank and e["kind"] in "BW"}
    events = sorted([(e["end"], 0, 1) for e in timeline if e["rank"] == rank and e["kind"] == "F"] +
                    [(e["start"], 1, -1) for e in last.values()])  # at equal times the forward's end counts first
    count = peak = 0
    for _, _, delta in events:
        count += delta
        peak = max(peak, count)
    return peak / v


def megatron_bubble(p: int, m: int, v: int = 1) -> float:
    """Narayanan et al.'s bubble time fraction (p - 1) / (v m), relative to the ideal compute time."""
    return (p - 1) / (v * m)


def zb_h1_bubble(p: int, m: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Qi et al.'s ZB-H1 bubble (p - 1)(T_F + T_B - T_W), as a fraction of the ideal m (T_F + T_B + T_W)."""
    return (p - 1) * (t_f + t_b - t_w) / (m * (t_f + t_b + t_w))


# ------------------------------------------------------------------------------- torch's own orders

def torch_order(name: str, p: int, m: int, v: int = 2) -> list[list[Action]]:
    """The compute actions torch's schedule class would give each rank (its idle slots dropped), from the
    class's own per-rank generator, run without process groups. Raises RuntimeError if this torch has no
    such generator (it is private API, checked at torch 2.13)."""
    from torch.distributed.pipelining import schedules as S

    classes = {"interleaved": "ScheduleInterleaved1F1B", "zero-bubble": "ScheduleInterleavedZeroBubble",
               "zbv": "ScheduleZBVZeroBubble"}
    cls = getattr(S, classes.get(name, ""), None)
    if cls is None or not hasattr(cls, "_calculate_single_rank_operations"):
        raise RuntimeError(f"this torch has no per-rank generator for {name!r} to compare with")
    v = 2 if name == "zbv" else v
    per_round = _rounds(p, m)
    state = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m, microbatches_per_round=per_round,
                            number_of_rounds=m // per_round, num_stages=p * v)
    out = []
    for r in range(p):
        ops = cls._calculate_single_rank_operations(state, r)
        out.append([Action(str(a.computation_type.value), a.stage_index, a.microbatch_index) for a in ops if a is not None])
    return out
