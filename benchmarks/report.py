"""The benchmark report: one Markdown page with plots, from the JSON every benchmark wrote.

``python benchmarks/report.py`` (``python -m benchmarks`` runs it last) reads ``results/*.json`` and
writes ``results/REPORT.md`` and ``results/plots/*.png``, and puts the summary table into the README
between its ``benchmarks:table`` markers, so the README's numbers are always the last measured ones; the
sentences of the README's prose that quote measurements (:func:`prose`) are generated the same way,
each between ``benchmarks:NAME`` markers. A benchmark whose JSON is missing is left out, not invented.
"""

from __future__ import annotations

import json
import os
import re
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
START, END = "<!-- benchmarks:table -->", "<!-- /benchmarks:table -->"


def load(results_dir: str = RESULTS) -> dict[str, dict]:
    found = {}
    for name in sorted(os.listdir(results_dir)):
        if name.endswith(".json") and not name.startswith("notebook_"):
            with open(os.path.join(results_dir, name)) as handle:
                found[name[:-5]] = json.load(handle)
    return found


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f} ms"


def table_rows(r: dict[str, dict]) -> list[list[str]]:
    """benchmark | ddpkit | baseline | ratio | target, one row per measurement that has a JSON."""
    rows = []
    if "checkpoint_cost" in r:
        s = r["checkpoint_cost"]["save"]
        rows.append([f"checkpoint save, {r['checkpoint_cost']['bytes'] / 1e6:.0f} MB, atomic + fsynced + sha256 manifest",
                     _ms(s["ddpkit_atomic_verified"]["median_s"]), f"`torch.save` + `fsync` {_ms(s['torch_save_fsync']['median_s'])}",
                     f"{s['ratio_to_torch_save_fsync']:.2f}x ({s['ratio_to_torch_save']:.2f}x plain `torch.save`)",
                     f"<= {s['target_ratio_to_torch_save_fsync']}x"])
    if "trainer_overhead" in r:
        o = r["trainer_overhead"]["step_overhead"]
        rows.append(["trainer step, world 2, MLP, micro-batch 32", _ms(o["ddpkit"]["median_s"]),
                     f"hand-written DDP loop {_ms(o['hand_written']['median_s'])}",
                     _overhead_ratio(o) if "ratio_with_metrics_dir" in o else
                     f"{o['paired_ratio_median']:.2f}x ({o['ratio_without_comm_timing']:.2f}x without the comm-timing hook)",
                     f"<= {o['target_ratio']}x"])
        w = r["trainer_overhead"]["weak_scaling"]
        parts = ""
        if "efficiency_meeting_each_step" in w:  # where the rest goes, measured side by side in the same run
            parts = (f" (no communication {w['efficiency_without_comm']:.2f}, meeting each step "
                     f"{w['efficiency_meeting_each_step']:.2f})")
        rows.append(["weak scaling, 2 ranks vs 1, compute-bound MLP", f"{w['two_ranks_samples_per_s']:,.0f} samples/s",
                     f"1 rank {w['one_rank_samples_per_s']:,.0f} samples/s", f"efficiency {w['efficiency']:.2f}{parts}",
                     f">= {w['target_efficiency']}"])
    if "launch_latency" in r:
        l2, l4 = r["launch_latency"]["world_2"], r["launch_latency"]["world_4"]

        def q(d: dict, name: str, key: str) -> str:  # "2 ranks / 4 ranks" of one launcher's p50 or p90
            return f"{_ms(d[name].get(key, d[name]['median_s']))}"

        n = l2["ddpkit"]["n"]
        fork = f"bare fork p50 {q(l2, 'raw_start_processes', 'p50_s')} / {q(l4, 'raw_start_processes', 'p50_s')}"
        ratio = f"p50 {l2['ratio_to_raw']:.2f}x / {l4['ratio_to_raw']:.2f}x the fork"
        target = f"<= {l2.get('target_ratio_to_raw', 1.3)}x the fork"
        if "accelerate_notebook_launcher" in l2:
            fork = (f"`accelerate.notebook_launcher` p50 {q(l2, 'accelerate_notebook_launcher', 'p50_s')} / "
                    f"{q(l4, 'accelerate_notebook_launcher', 'p50_s')}; {fork}")
            ratio += f", {l2['ratio_to_accelerate']:.2f}x / {l4['ratio_to_accelerate']:.2f}x accelerate"
            target += ", <= 1x accelerate"
        if "tail_p90_over_p50" in l2:
            ratio += f"; p90/p50 {l2['tail_p90_over_p50']:.2f} / {l4['tail_p90_over_p50']:.2f}"
            target += f", p90 <= {l2['target_tail_p90_over_p50']}x p50"
        ours = f"p50 {q(l2, 'ddpkit', 'p50_s')} / {q(l4, 'ddpkit', 'p50_s')}"
        if "p90_s" in l2["ddpkit"]:
            ours += f", p90 {q(l2, 'ddpkit', 'p90_s')} / {q(l4, 'ddpkit', 'p90_s')}"
        rows.append([f"launch of 2 / 4 ranks to a barrier and back ({n} warm launches each)", ours, fork, ratio, target])
    if "startup" in r:
        s = r["startup"]
        rows.append([f"{s['command']}, from the shell to exit", f"{s['wall_s']['median_s']:.1f} s", "", "", f"< {s['goal_s']:g} s"])
    if "collectives" in r:
        c = r["collectives"]
        ratios = [row["ring_over_gloo"] for row in c["rows"]]
        rows.append([f"ring all-reduce from `send`/`recv`, {c['world_size']} ranks, "
                     f"{c['rows'][0]['bytes'] / 2**20:.0f}-{c['rows'][-1]['bytes'] / 2**20:.0f} MB", "hand-written ring",
                     "gloo's `all_reduce`", f"{min(ratios):.2f}-{max(ratios):.2f}x", "report"])
        rows.append([f"gloo `all_reduce` busbw at {c['rows'][-1]['bytes'] / 2**20:.0f} MB", f"{c['rows'][-1]['gloo_busbw'] / 1e9:.1f} GB/s",
                     f"memory copy {c['memcpy_bandwidth'] / 1e9:.0f} GB/s", f"{c['gloo_busbw_64mb_over_memcpy']:.0%} of the limit", "report"])
    if "sharding_memory" in r:
        m = r["sharding_memory"]["results"]
        cells = [f"{key.replace('_world', ', world ')}: " + ", ".join(f"{k} {v:.2f}" for k, v in m[key]["ratio_to_ddp"].items() if k != "ddp")
                 for key in ("gpt_world2", "gpt_world4") if key in m]
        rows.append(["optimizer state per rank (fullest rank) over DDP's", "; ".join(cells), "DDP", "", "<= 1/N + 5%"])
    if "async_save" in r:
        a = r["async_save"]
        rows.append([f"async DCP save, {a['state_bytes'] / 1e6:.0f} MB, {a['world_size']} ranks",
                     f"training stalls {_ms(min(a['async_stall_s']))}-{_ms(max(a['async_stall_s']))}",
                     f"synchronous DCP save {_ms(min(a['sync_dcp_s']))}-{_ms(max(a['sync_dcp_s']))}",
                     f"{a['stall_over_sync_median']:.0%} (median)", f"<= {a['target']:.0%}"])
    if "recovery" in r:
        rec = r["recovery"]["recovery_median"]
        rows.append(["recovery after a killed rank, to the first step after the restart",
                     f"launcher {rec['ddpkit']['total_s']:.2f} s", f"torchrun {rec['torchrun']['total_s']:.2f} s", "",
                     f"< {r['recovery']['target_s']:g} s"])
        cad = r["recovery"]["cadence"]
        rows.append(["worst work lost to a failure, steps slowing down, same number of saves",
                     f"every {cad['seconds']['every']:.2f} s: {cad['seconds']['worst_lost_s']:.2f} s",
                     f"every {cad['steps']['every']} steps: {cad['steps']['worst_lost_s']:.2f} s",
                     f"{r['recovery']['worst_lost_ratio_seconds_over_steps']:.2f}x", "report"])
    if "bucket_sweep" in r:
        b = r["bucket_sweep"]
        cells = ", ".join(f"{row['bucket_cap_mb']}: {row['step_over_one_bucket']:.2f}x" for row in b["rows"])
        one = next(row for row in b["rows"] if row["buckets"] == 1)
        rows.append([f"DDP step vs `bucket_cap_mb` (MiB, step time over one bucket's), 2 ranks, {b['model']}",
                     f"best {b['best_cap_mb']} MiB: {_ms(next(x for x in b['rows'] if x['bucket_cap_mb'] == b['best_cap_mb'])['step']['median_s'])}",
                     f"one bucket ({one['bucket_cap_mb']} MiB) {_ms(one['step']['median_s'])}", cells, "report"])
    if "pipeline_bubble" in r:
        p = r["pipeline_bubble"]
        last = [row for row in p["rows"] if row["micro_batches"] == max(x["micro_batches"] for x in p["rows"])]
        rows.append([f"pipeline bubble, {p['stages']} stages, {last[0]['micro_batches']} micro-batches",
                     ", ".join(f"{row['schedule']} {row['measured']:.2f}" for row in last), f"(p-1)/(m+p-1) = {last[0]['predicted']:.2f}",
                     "", "report"])
    return rows


def prose(r: dict[str, dict]) -> dict[str, str]:
    """The README's sentences that quote a JSON's numbers, by marker name (``<!-- benchmarks:NAME -->``)."""
    out = {}
    o = r.get("trainer_overhead", {}).get("step_overhead", {})
    if "over_runs" in o:
        runs = o["over_runs"]
        p, m, c, load = (runs[k] for k in ("paired_ratio", "paired_ratio_with_metrics_dir", "paired_ratio_control", "loadavg_1"))
        every = [o["paired_ratio_median"], *(x["paired"] for x in o.get("repeats_under_load", []))]
        met = sum(x <= o["target_ratio"] for x in every)
        out["trainer-runs"] = (f"Measured side by side beside other jobs (load average {load['min']:.1f}-{load['max']:.1f}), "
                               f"{p['n']} runs, each a fresh launch: median {p['median']:.3f}x, range {p['min']:.3f}-"
                               f"{p['max']:.3f}x ({met} of {len(every)} at or under {o['target_ratio']}x), and "
                               f"{m['min']:.2f}-{m['max']:.2f}x with `--metrics-dir`; the control read {c['min']:.3f}-{c['max']:.3f}x.")
    w = r.get("trainer_overhead", {}).get("weak_scaling", {})
    if "profiled_ddp_step" in w and "efficiency_meeting_each_step" in w:
        t, load = w["profiled_ddp_step"], w["loadavg_1_5_15"]["before"][0]
        where = f"with the machine otherwise idle (load average {load:.1f})" if load < 1.5 else f"beside other jobs (load average {load:.1f})"
        out["weak-scaling"] = (
            f"**Weak scaling**, measured {where}, side by side in one launch of 2 ranks: {w['efficiency']:.2f}. Two ranks "
            f"training without any communication reach {w['efficiency_without_comm']:.2f} of twice one rank alone: sharing "
            f"the two cores' memory bandwidth and caches costs {1 - w['efficiency_without_comm']:.0%}. Meeting in a barrier "
            f"after each backward brings it to {w['efficiency_meeting_each_step']:.2f}: at every step each rank waits for "
            f"the slower one. The all-reduce's bytes cost the remaining "
            f"{w['efficiency_meeting_each_step'] - w['efficiency']:.2f}: in a profiled DDP step (rank 0, three steps under "
            f"`torch.profiler`, `weak_scaling.profiled_ddp_step` in `benchmarks/results/trainer_overhead.json`), "
            f"{1e3 * t['comm_s']:.0f} ms of the {1e3 * t['wall_s']:.0f} ms step is communication and "
            f"{1 - t['overlapped_fraction']:.0%} of it ({1e3 * t['exposed_comm_s']:.0f} ms) is exposed.")
    return out


def markers(name: str) -> tuple[str, str]:
    return f"<!-- benchmarks:{name} -->", f"<!-- /benchmarks:{name} -->"


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| benchmark | ddpkit | baseline | ratio | target |", "|---|---|---|---|---|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def plots(r: dict[str, dict], out_dir: str) -> list[tuple[str, str]]:
    """PNG files (title, path relative to the report) for the benchmarks that have results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    made = []

    def save(fig, name, title):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=90)
        plt.close(fig)
        made.append((title, f"plots/{name}.png"))

    if "launch_latency" in r:
        fig, ax = plt.subplots(figsize=(6, 3))
        order = ("ddpkit", "ddpkit_env_rendezvous", "raw_start_processes", "accelerate_notebook_launcher")
        colors = dict(zip(order, ["#3182bd", "#bdbdbd", "#9ecae1", "#fdae6b"]))
        for i, world in enumerate(("world_2", "world_4")):
            d = r["launch_latency"][world]
            names = [k for k in order if k in d]
            x = [i * 5 + j for j in range(len(names))]
            ax.bar(x, [1e3 * d[k].get("p50_s", d[k]["median_s"]) for k in names], color=[colors[k] for k in names],
                   label=names if i == 0 else None)
            if all("p90_s" in d[k] for k in names):
                ax.plot(x, [1e3 * d[k]["p90_s"] for k in names], "k_", markersize=14, label="p90" if i == 0 else None)
        ax.set_xticks([1.5, 6.5], ["2 ranks", "4 ranks"]); ax.set_ylabel("ms (bar: p50)"); ax.legend(fontsize=6)
        save(fig, "launch_latency", "Launch latency, p50 and p90: ddpkit vs its old rendezvous, a bare fork and accelerate")
    if "collectives" in r:
        c = r["collectives"]
        fig, ax = plt.subplots(figsize=(6, 3))
        sizes = [row["bytes"] for row in c["rows"]]
        ax.plot(sizes, [row["gloo_busbw"] / 1e9 for row in c["rows"]], "o-", label="gloo all_reduce busbw")
        ax.axhline(c["memcpy_bandwidth"] / 1e9, color="k", ls="--", label="memory copy")
        ax.set_xscale("log", base=2); ax.set_yscale("log"); ax.set_xlabel("bytes"); ax.set_ylabel("GB/s"); ax.legend(fontsize=7)
        save(fig, "allreduce_bandwidth", "All-reduce bandwidth vs the memory-copy limit")
    if "sharding_memory" in r:
        m = r["sharding_memory"]["results"]
        fig, ax = plt.subplots(figsize=(7, 3))
        keys = list(m)
        strategies = list(m[keys[0]]["ratio_to_ddp"])
        for j, strategy in enumerate(strategies):
            ax.bar([i * (len(strategies) + 1) + j for i in range(len(keys))], [m[k]["ratio_to_ddp"][strategy] for k in keys], label=strategy)
        ax.set_xticks([i * (len(strategies) + 1) + 1.5 for i in range(len(keys))], keys, fontsize=8)
        ax.set_ylabel("optimizer bytes / DDP's"); ax.legend(fontsize=7)
        save(fig, "memory_per_rank", "Optimizer state per rank, by strategy")
    if "pipeline_bubble" in r:
        p = r["pipeline_bubble"]
        fig, ax = plt.subplots(figsize=(6, 3))
        ms = sorted({row["micro_batches"] for row in p["rows"]})
        ax.plot(ms, [next(row["predicted"] for row in p["rows"] if row["micro_batches"] == m) for m in ms], "k--", label="(p-1)/(m+p-1)")
        for name in sorted({row["schedule"] for row in p["rows"]}):
            ax.plot(ms, [next(row["measured"] for row in p["rows"] if row["micro_batches"] == m and row["schedule"] == name) for m in ms],
                    "o-", label=f"{name}, measured")
        ax.set_xscale("log", base=2); ax.set_xlabel("micro-batches"); ax.set_ylabel("bubble"); ax.legend(fontsize=7)
        save(fig, "pipeline_bubble", "Pipeline bubble, measured vs predicted")
    if "bucket_sweep" in r:
        b = r["bucket_sweep"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 3))
        labels = [f"{row['bucket_cap_mb']}\n({row['buckets']} b.)" for row in b]
        ax.bar(range(len(b)), [row["step_over_one_bucket"] for row in b], color="#3182bd", label="step time / one bucket's")
        ax.plot(range(len(b)), [sum(row["overlapped_fraction"]) / 2 for row in b], "o", color="#fd8d3c", label="overlapped fraction (mean of ranks)")
        ax.set_xticks(range(len(b)), labels, fontsize=7); ax.set_xlabel("bucket_cap_mb (buckets)"); ax.legend(fontsize=7)
        save(fig, "bucket_sweep", "DDP step time and overlap against bucket_cap_mb")
    if "recovery" in r:
        rec = r["recovery"]["recovery_median"]
        fig, ax = plt.subplots(figsize=(6, 2.5))
        for i, name in enumerate(rec):
            left = 0.0
            for part, color in zip(("detection_s", "restart_s", "restore_s", "first_step_s"), ("#fdae6b", "#9ecae1", "#3182bd", "#a1d99b")):
                ax.barh(i, rec[name][part], left=left, color=color, label=part[:-2] if i == 0 else None)
                left += rec[name][part]
        ax.set_yticks(range(len(rec)), list(rec)); ax.set_xlabel("seconds"); ax.legend(fontsize=7, ncol=4)
        save(fig, "recovery", "Recovery time after a killed rank")
    if "checkpoint_cost" in r:
        s = r["checkpoint_cost"]["save"]
        fig, ax = plt.subplots(figsize=(6, 2.5))
        names = ["torch_save", "torch_save_fsync", "ddpkit_atomic_verified"]
        ax.barh(names, [1e3 * s[n]["median_s"] for n in names], color=["#9ecae1", "#6baed6", "#3182bd"]); ax.set_xlabel("ms")
        save(fig, "checkpoint_cost", "Checkpoint save cost")
    return made


def _overhead_ratio(o: dict) -> str:
    """The trainer's ratio: this run's paired median, and the range over any repeats kept beside it."""
    if "over_runs" in o:  # every run's paired ratio (trainer_overhead.py --repeats), and the A/A control's
        p, m, c = (o["over_runs"].get(k) for k in ("paired_ratio", "paired_ratio_with_metrics_dir", "paired_ratio_control"))
        control = f"; the loop against a copy of itself {c['min']:.3f}-{c['max']:.3f}x" if c else ""
        return (f"median {p['median']:.3f}x, {p['min']:.3f}-{p['max']:.3f}x over {p['n']} runs ({m['min']:.2f}-"
                f"{m['max']:.2f}x with `--metrics-dir`, which times comm_s{control})")
    runs = [{"paired": o["paired_ratio_median"], "with_metrics_dir_paired": o["ratio_with_metrics_dir"]},
            *o.get("repeats_under_load", [])]
    plain = [r["paired"] for r in runs]
    metered = [r["with_metrics_dir_paired"] for r in runs]
    if len(runs) == 1:
        return (f"{plain[0]:.3f}x (ratio of medians {o['ratio_median']:.3f}x; {metered[0]:.3f}x with `--metrics-dir`, "
                "which times comm_s)")
    return (f"{min(plain):.3f}-{max(plain):.3f}x over {len(runs)} runs ({min(metered):.2f}-{max(metered):.2f}x with "
            "`--metrics-dir`, which times comm_s)")


def write_report(results_dir: str = RESULTS, readme: str | None = README) -> str:
    """Write REPORT.md (and its plots) into ``results_dir``; update the README's table. Returns the report's path."""
    r = load(results_dir)
    table = markdown_table(table_rows(r))
    made = plots(r, os.path.join(results_dir, "plots"))
    machine = next(iter(r.values()), {})
    lines = ["# ddpkit benchmark report", "",
             f"Measured with torch {machine.get('torch', '?')}, Python {machine.get('python', '?')}, {machine.get('cpus', '?')} CPUs; "
             "each benchmark runs ddpkit and its baseline side by side in one run. Targets, not tests.", "", table, ""]
    for title, path in made:
        lines += [f"## {title}", "", f"![{title}]({path})", ""]
    lines += ["## When each was measured", ""] + [f"- `{name}`: {d.get('when', '?')}" for name, d in r.items()]
    path = os.path.join(results_dir, "REPORT.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    if readme:
        update_readme(readme, table, prose(r))
    return path


def update_readme(readme: str, table: str, sentences: dict[str, str] | None = None) -> None:
    """Put ``table`` between the table's markers and each of ``sentences`` between its own (inline)."""
    with open(readme) as handle:
        text = handle.read()
    if START not in text or END not in text:
        raise ValueError(f"{readme} has no {START} ... {END} markers for the benchmark table")
    text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: f"{START}\n{table}\n{END}", text, flags=re.S)
    for name, sentence in (sentences or {}).items():
        start, end = markers(name)
        if start not in text or end not in text:
            raise ValueError(f"{readme} has no {start} ... {end} markers for the sentence it quotes")
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: f"{start}{sentence}{end}", text, flags=re.S)
    with open(readme, "w") as handle:
        handle.write(text)


if __name__ == "__main__":
    print(write_report(*(sys.argv[1:2] or [RESULTS])))
