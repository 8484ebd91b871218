"""ZeRO stage by stage: DeepSpeed's engine, the kit's strategies and the memory calculator in one table each.

:func:`stage_tables` lays out, for one report of :func:`ddpkit.engines.side_by_side.run_all`, what each
rank held (parameters and optimizer state, in bytes, on rank 0) and which collectives each run issued per
step (counted by the Flight Recorder, :mod:`ddpkit.engines.traffic`), beside what
:func:`ddpkit.parallel.memory.bytes_per_rank` says:

* stage 1: DeepSpeed ZeRO-1, the kit's ``zero1`` (a flat shard, its own) and ``zero1-torch``
  (``ZeroRedundancyOptimizer``: whole tensors);
* stage 2: DeepSpeed ZeRO-2 (the kit has no stage 2 of its own);
* stage 3: DeepSpeed ZeRO-3 and the kit's ``fsdp2``.

:func:`agreements` names what must hold where the designs agree, each as ``{"holds", "evidence"}``, so a
notebook can assert every one and a test can show each can fail. Where the designs differ the check says
how, by measurement: DeepSpeed all-reduces the gradient where the kit's ``zero1`` reduce-scatters it
(on gloo both run an all-reduce of the whole buffer), DeepSpeed adds a one-number all-reduce per step (the
gradient norm, computed even with clipping off), ``zero1-torch`` broadcasts each parameter from its owner
instead of all-gathering a flat shard, and FSDP2 gathers each unit twice per step (it reshards after
forward) where DeepSpeed's ZeRO-3 keeps what it gathered until backward has used it.

Padding: DeepSpeed rounds each flat group (stages 1-2) or each tensor (stage 3) up to a multiple of the
ranks, and torch's AdamW keeps a 4-byte ``step`` per tensor, so "equal" means within
:func:`padding_bytes` (a few elements per tensor), not to the byte.
"""

from __future__ import annotations

import math

from ddpkit.config import TrainConfig
from ddpkit.models import build_model
from ddpkit.parallel import memory

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
LOGGER_NAMES = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
                "reduce_scatter": "reduce_scatter_tensor", "broadcast": "broadcast"}
"""The Flight Recorder's kinds as DeepSpeed's communication logger names them."""


def shapes(cfg: TrainConfig) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in build_model(cfg).parameters()]


def padding_bytes(cfg: TrainConfig, world: int) -> int:
    """How far two honest counts of the same sharded state may differ: up to ``world`` elements of padding
    per tensor at 12 bytes each (master copy and two moments), plus AdamW's 4-byte ``step`` per tensor."""
    tensors = len(shapes(cfg))
    return 12 * world * tensors + 4 * tensors


def _calls(per_step: dict, kind: str) -> float:
    return per_step.get(kind, {}).get("calls", 0)


def _numel(per_step: dict, kind: str) -> float:
    return per_step.get(kind, {}).get("numel", 0)


def _cell(per_step: dict, kind: str) -> str:
    calls = _calls(per_step, kind)
    return "-" if not calls else f"{calls:g} x, {_numel(per_step, kind):,.0f} el."


def _row(name: str, bytes_: dict, per_step: dict | None) -> dict:
    row = {"run": name, "params B": bytes_["params"], "optimizer B": bytes_["optimizer"]}
    for kind in KINDS:
        row[kind] = "" if per_step is None else _cell(per_step, kind)  # the calculator counts bytes only
    return row


def runs_by_stage(report: dict) -> dict[int, dict[str, dict]]:
    """``{stage: {name: {"bytes", "collectives"}}}``: the measured runs each stage's table compares."""
    ds, kit = report["deepspeed"], report["kit"]

    def of_ds(stage):
        r = ds[stage] if stage in ds else ds[str(stage)]
        return {"bytes": r["bytes"], "collectives": r["collectives_per_step"]}

    def of_kit(strategy):
        return {"bytes": kit[strategy]["state_bytes"], "collectives": kit[strategy]["collectives_per_step"]}

    return {1: {"DeepSpeed ZeRO-1": of_ds(1), "kit zero1": of_kit("zero1"), "kit zero1-torch": of_kit("zero1-torch")},
            2: {"DeepSpeed ZeRO-2": of_ds(2)},
            3: {"DeepSpeed ZeRO-3": of_ds(3), "kit fsdp2": of_kit("fsdp2")}}


CALCULATOR_ROWS = {1: ("zero1", "zero1-torch"), 2: ("zero2",), 3: ("zero3", "fsdp2")}


def calculator(cfg: TrainConfig, world: int, strategy: str) -> dict:
    """What the memory calculator says rank 0 holds in fp32 (exact shards: each tensor's shape given)."""
    s = shapes(cfg)
    sizes = [math.prod(x) for x in s]
    return memory.bytes_per_rank(sum(sizes), strategy, world, "fp32", param_sizes=sizes, rank=0, param_shapes=s)


def stage_tables(report: dict, cfg: TrainConfig, world: int) -> dict[int, list[dict]]:
    """One table per ZeRO stage: the measured runs, then the calculator's rows."""
    tables = {}
    for stage, runs in runs_by_stage(report).items():
        rows = [_row(name, r["bytes"], r["collectives"]) for name, r in runs.items()]
        rows += [_row(f"calculator {s}", calculator(cfg, world, s), None) for s in CALCULATOR_ROWS[stage]]
        tables[stage] = rows
    return tables


def _shape(per_step: dict) -> dict:
    return {k: (v["calls"], v["numel"]) for k, v in per_step.items()}


def _near(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol


def agreements(report: dict, cfg: TrainConfig, world: int) -> dict[str, dict]:
    """Every comparison the stage tables support, by name: ``{"holds": bool, "evidence": str}``."""
    runs, pad = runs_by_stage(report), padding_bytes(cfg, world)
    total = sum(math.prod(x) for x in shapes(cfg))
    shard = math.ceil(total / world)
    pad_el = world * len(shapes(cfg))  # elements of padding a sharded collective may carry
    calc = {s: calculator(cfg, world, s) for stages in CALCULATOR_ROWS.values() for s in stages}
    ds1, z1, zt = runs[1]["DeepSpeed ZeRO-1"], runs[1]["kit zero1"], runs[1]["kit zero1-torch"]
    ds2, ds3, f2 = runs[2]["DeepSpeed ZeRO-2"], runs[3]["DeepSpeed ZeRO-3"], runs[3]["kit fsdp2"]
    c = {name: r["collectives"] for name, r in (("ds1", ds1), ("z1", z1), ("zt", zt), ("ds2", ds2), ("ds3", ds3), ("f2", f2))}
    out: dict[str, dict] = {}

    def check(name: str, holds: bool, evidence: str) -> None:
        out[name] = {"holds": bool(holds), "evidence": evidence}

    ob = {k: r["bytes"]["optimizer"] for k, r in (("ds1", ds1), ("z1", z1), ("zt", zt), ("ds2", ds2), ("ds3", ds3), ("f2", f2))}
    check("stage 1: DeepSpeed and zero1 hold the same optimizer bytes (12 per parameter of a flat shard)",
          _near(ob["ds1"], ob["z1"], pad) and _near(ob["ds1"], calc["zero1"]["optimizer"], pad),
          f"{ob['ds1']} vs {ob['z1']} vs calculator {calc['zero1']['optimizer']} (padding {pad})")
    check("stage 1: zero1-torch holds whole tensors at 8 bytes each (no master copy), as the calculator says",
          _near(ob["zt"], calc["zero1-torch"]["optimizer"], pad) and ob["zt"] < ob["z1"],
          f"{ob['zt']} vs calculator {calc['zero1-torch']['optimizer']}; zero1 {ob['z1']}")
    check("stages 1-2: every rank keeps the whole model",
          ds1["bytes"]["params"] == z1["bytes"]["params"] == zt["bytes"]["params"] == ds2["bytes"]["params"] == 4 * total,
          f"{ds1['bytes']['params']}, {z1['bytes']['params']}, {zt['bytes']['params']}, {ds2['bytes']['params']} = 4 x {total}")
    check("stage 1: DeepSpeed and zero1 end the step with one all-gather of the updated shard",
          all(_calls(c[k], "all_gather") == 1 and _near(_numel(c[k], "all_gather"), shard, pad_el) for k in ("ds1", "z1")),
          f"{_cell(c['ds1'], 'all_gather')} and {_cell(c['z1'], 'all_gather')}; shard {shard}")
    grads_ds1 = _numel(c["ds1"], "all_reduce") - (_calls(c["ds1"], "all_reduce") - 1)  # less the norm's one number
    check("stage 1: the whole gradient is reduced once per step: DeepSpeed all-reduces it, zero1 reduce-scatters it "
          "(an all-reduce on gloo too)",
          _near(grads_ds1, total, pad_el) and _calls(c["z1"], "reduce_scatter") == 1
          and _near(_numel(c["z1"], "reduce_scatter"), total, pad_el)
          and c["z1"]["reduce_scatter"]["gloo"] == ["all_reduce"] and "reduce_scatter" not in c["ds1"],
          f"DeepSpeed {_cell(c['ds1'], 'all_reduce')}, zero1 {_cell(c['z1'], 'reduce_scatter')} "
          f"(gloo ran {c['z1'].get('reduce_scatter', {}).get('gloo')}); parameters {total}")
    check("DeepSpeed all-reduces one more number per step than the kit: the gradient norm, even with clipping off",
          all(_calls(c[k], "all_reduce") >= 1 and any("grad_norm" in i for i in c[k]["all_reduce"]["issuers"])
              for k in ("ds1", "ds2", "ds3")) and "all_reduce" not in c["z1"],
          f"issued by {sorted({i for k in ('ds1', 'ds3') for i in c[k].get('all_reduce', {}).get('issuers', [])})}")
    check("stage 1: zero1-torch all-reduces the gradient under DDP and broadcasts each parameter from its owner",
          _near(_numel(c["zt"], "all_reduce"), total, 0) and _calls(c["zt"], "broadcast") == len(shapes(cfg))
          and _near(_numel(c["zt"], "broadcast"), total, 0) and "all_gather" not in c["zt"],
          f"{_cell(c['zt'], 'all_reduce')} by {c['zt'].get('all_reduce', {}).get('issuers')}, "
          f"{_cell(c['zt'], 'broadcast')} ({len(shapes(cfg))} tensors)")
    check("stage 2: the optimizer bytes of stage 1, and the calculator's zero2 row plus DeepSpeed's fp32 master copy",
          ob["ds2"] == ob["ds1"] and _near(ob["ds2"] - calc["zero2"]["optimizer"], 4 * shard, pad),
          f"{ob['ds2']} = {ob['ds1']} (stage 1); calculator zero2 {calc['zero2']['optimizer']} + 4 x {shard}")
    check("stage 2: the collectives of stage 1, call for call (its saving is the gradient buffer, not traffic)",
          _shape(c["ds2"]) == _shape(c["ds1"]),
          f"{_cell(c['ds2'], 'all_reduce')} + {_cell(c['ds2'], 'all_gather')}")
    check("stage 3: DeepSpeed and fsdp2 hold the same shard of the weights",
          _near(ds3["bytes"]["params"], f2["bytes"]["params"], 4 * pad_el) and _near(f2["bytes"]["params"], calc["fsdp2"]["params"], 0),
          f"{ds3['bytes']['params']} vs {f2['bytes']['params']} vs calculator {calc['fsdp2']['params']}")
    check("stage 3: DeepSpeed and fsdp2 hold the same optimizer bytes (8 per parameter of the shard in fp32)",
          _near(ob["ds3"], ob["f2"], pad) and _near(ob["f2"], calc["fsdp2"]["optimizer"], pad),
          f"{ob['ds3']} vs {ob['f2']} vs calculator {calc['fsdp2']['optimizer']}")
    check("stage 3: both reduce-scatter the whole gradient once per step",
          all(_near(_numel(c[k], "reduce_scatter"), total, pad_el) for k in ("ds3", "f2")),
          f"DeepSpeed {_cell(c['ds3'], 'reduce_scatter')}, fsdp2 {_cell(c['f2'], 'reduce_scatter')}")
    check("stage 3: DeepSpeed gathers each shard once per step, fsdp2 twice (it reshards each unit after forward)",
          _near(_numel(c["ds3"], "all_gather"), shard, pad_el) and _near(_numel(c["f2"], "all_gather"), 2 * shard, 2 * pad_el),
          f"DeepSpeed {_cell(c['ds3'], 'all_gather')}, fsdp2 {_cell(c['f2'], 'all_gather')}; shard {shard}")
    check("the Flight Recorder counts what DeepSpeed's own logger counts, call for call",
          all(logger_agrees(report["deepspeed"][s]) for s in report["deepspeed"]),
          "; ".join(f"ZeRO-{s}: {report['deepspeed'][s]['deepspeed_logged_per_step']}" for s in report["deepspeed"]))
    return out


def logger_agrees(run: dict) -> bool:
    """A DeepSpeed run's Flight Recorder counts equal its communication logger's, op by op."""
    flight = {LOGGER_NAMES.get(k, k): v["calls"] for k, v in run["collectives_per_step"].items()}
    return flight == {k: v for k, v in run["deepspeed_logged_per_step"].items() if v}
