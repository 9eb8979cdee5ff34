"""One column's profile from what was sampled (``build_profile``), and its tables and picture."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from megatron_rl.benchmarks.profiling.attribution import (
    BETWEEN,
    attribute_cpu,
    collapsed_stacks,
    loop_window,
    main_thread,
    phase_cpu,
    phase_wall,
    read_phases,
    spy_intervals,
)

PHASE_ORDER = ["rollout/baseline", "rollout/short", "rollout/long", "scoring", "train", "weight_sync", "validation",
               "checkpoint", BETWEEN]
ENGINE_ROLES = ("engine core", "engine worker")
AGGREGATED = {"ray runtime": "Ray daemons", "reward child": "reward children (isolated grader calls)",
              "engine helper": "engine helpers", "other": "other"}
ACTIVE_THREAD_S = 0.1
"""A thread counts as active when it used at least this much CPU during the run (and 2 % of its
process's)."""


def _label_processes(records: list[dict]) -> dict[int, str]:
    """A readable label per pid: ranks numbered by pid order, the profiler's own py-spy apart."""
    labels, counts = {}, defaultdict(int)
    for rec in sorted(records, key=lambda r: r["pid"]):
        role = rec["role"]
        if rec["name"] == "py-spy":
            labels[rec["pid"]] = "profiler (py-spy)"
        elif role in AGGREGATED:
            labels[rec["pid"]] = AGGREGATED[role]
        elif role in ("trainer rank", "reward worker"):
            labels[rec["pid"]] = f"{role} {counts[role]}"
            counts[role] += 1
        else:
            labels[rec["pid"]] = role
    return labels


def _active_threads(rec: dict) -> list[tuple[str, float]]:
    used = [(name, last - first) for name, first, last in rec["threads"].values()]
    total = sum(c for _, c in used) or 1.0
    return sorted([(n, c) for n, c in used if c >= ACTIVE_THREAD_S and c >= 0.02 * total], key=lambda x: -x[1])


def build_profile(column: str, run_dir: Path, records: list[dict], traces: dict[int, tuple[float, str]],
                  metrics: list[dict]) -> tuple[dict, dict[str, dict[tuple[str, ...], float]]]:
    """The column's profile (JSON-able) and, per engine round type, the engine's collapsed
    stacks (for flame graphs)."""
    phases = read_phases(run_dir)
    start, end = loop_window(phases)
    labels = _label_processes(records)
    procs: dict[str, dict] = {}
    engine_cpu: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    flames: dict[str, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
    for rec in records:
        total = [(t, c) for t, c, _ in rec["samples"]]
        main = [(t, m) for t, _, m in rec["samples"]]
        if len(total) < 2:
            continue
        cpu = phase_cpu(total, phases)
        label = labels[rec["pid"]]
        entry = procs.setdefault(label, {"role": rec["role"], "pids": [], "cpu": defaultdict(float),
                                         "main_cpu": defaultdict(float), "categories": {}, "threads": [],
                                         "env": rec["env"], "max_threads": 0})
        entry["pids"].append(rec["pid"])
        entry["max_threads"] = max(entry["max_threads"], rec["max_threads"])
        for k, v in cpu.items():
            entry["cpu"][k] += v
        for k, v in phase_cpu(main, phases).items():
            entry["main_cpu"][k] += v
        if rec["role"] not in AGGREGATED and rec["name"] != "py-spy":
            entry["threads"] = _active_threads(rec)
        trace = traces.get(rec["pid"])
        if trace is None:
            continue
        intervals = spy_intervals(trace[1], trace[0])
        tid = main_thread(intervals)
        if tid is None:
            continue
        # Ray actors run their calls on threads other than the main one (async actors on an
        # event-loop thread): every Python thread's stacks share the process's CPU (the GIL runs
        # one at a time); what runs outside Python (OMP, gloo, I/O threads) stays unattributed.
        merged = sorted((iv for thread in intervals.values() for iv in thread), key=lambda iv: iv[0])
        cats = attribute_cpu(total, merged, rec["role"], phases)
        entry["categories"] = {ph: dict(sorted(c.items(), key=lambda x: -x[1])) for ph, c in cats.items()}
        if rec["role"] in ENGINE_ROLES:
            for ph, c in cats.items():
                for name, secs in c.items():
                    engine_cpu[ph][name] += secs
            for rt in ("baseline", "short", "long"):
                for stack, secs in collapsed_stacks({tid: intervals[tid]}, phases, {f"rollout/{rt}"}).items():
                    flames[rt][stack] += secs
    wall = phase_wall(phases)
    engine = {}
    for rt in ("baseline", "short", "long"):
        rows = [r for r in metrics if r.get("round_type") == rt]
        steps = sum(float(r.get("rollout/spec/decode_steps", 0.0)) for r in rows)
        ph = f"rollout/{rt}"
        if not rows or not steps or ph not in wall:
            continue
        engine[rt] = {"rounds": len(rows), "decode_steps": steps, "wall_ms_per_step": 1e3 * wall[ph] / steps,
                      "cpu_ms_per_step": {k: 1e3 * v / steps for k, v in
                                          sorted(engine_cpu.get(ph, {}).items(), key=lambda x: -x[1])},
                      "draft_tokens": sum(float(r.get("rollout/spec/draft_tokens", 0.0)) for r in rows),
                      "accepted_tokens": sum(float(r.get("rollout/spec/accepted_tokens", 0.0)) for r in rows)}
    profile = {"column": column, "window_s": end - start, "wall": wall,
               "loop_time": sum(float(r["time/step"]) for r in metrics),
               "processes": {k: {**v, "cpu": dict(v["cpu"]), "main_cpu": dict(v["main_cpu"])} for k, v in procs.items()},
               "engine": engine, "timeline": _timeline(records, labels, start, end), "phases":
               [[p.label, p.start - start, p.end - start] for p in phases]}
    return profile, {rt: dict(st) for rt, st in flames.items()}


def _timeline(records: list[dict], labels: dict[int, str], start: float, end: float, bin_s: float = 0.5) -> dict:
    """Cores in use per process label, in bins of ``bin_s`` over the loop window."""
    bins = max(1, int((end - start) / bin_s) + 1)
    series: dict[str, list[float]] = {}
    for rec in records:
        row = series.setdefault(labels[rec["pid"]], [0.0] * bins)
        samples = rec["samples"]
        for (t0, c0, _), (t1, c1, _) in zip(samples, samples[1:]):
            if t1 <= start or t0 >= end or t1 <= t0:
                continue
            i = int((0.5 * (t0 + t1) - start) / bin_s)
            if 0 <= i < bins:
                row[i] += (c1 - c0) / bin_s
    return {"bin_s": bin_s, "series": {k: v for k, v in series.items() if sum(v) > 0}}


# ---------------------------------------------------------------------------- tables
def _phases_present(profiles: list[dict]) -> list[str]:
    seen = {ph for p in profiles for ph in p["wall"]}
    return [ph for ph in PHASE_ORDER if ph in seen]


def process_table(profile: dict) -> str:
    """CPU seconds per process and loop phase (the kernel's accounting), wall seconds on top."""
    phases = _phases_present([profile])
    head = "| process | " + " | ".join(phases) + " | total |"
    lines = [f"**{profile['column']}**: CPU seconds per process and loop phase (loop window "
             f"{profile['window_s']:.1f} s, loop time {profile['loop_time']:.1f} s)", "", head,
             "| --- |" + " ---: |" * (len(phases) + 1),
             "| *wall time* | " + " | ".join(f"*{profile['wall'].get(ph, 0):.1f}*" for ph in phases)
             + f" | *{sum(profile['wall'].values()):.1f}* |"]
    procs = sorted(profile["processes"].items(), key=lambda kv: -sum(kv[1]["cpu"].values()))
    totals = defaultdict(float)
    for label, p in procs:
        cells = [p["cpu"].get(ph, 0.0) for ph in phases]
        for ph, v in zip(phases, cells):
            totals[ph] += v
        if sum(cells) < 0.05:
            continue
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in cells) + f" | {sum(cells):.1f} |")
    lines.append("| **cores busy (all CPU / wall)** | " + " | ".join(
        f"**{totals[ph] / profile['wall'][ph]:.2f}**" if profile["wall"].get(ph) else "-" for ph in phases) + " | |")
    return "\n".join(lines)


def thread_table(profile: dict) -> str:
    lines = [f"**{profile['column']}**: threads per process", "",
             "| process | threads (max) | active threads (CPU s) | thread settings in its environment |",
             "| --- | ---: | --- | --- |"]
    for label, p in sorted(profile["processes"].items()):
        if p["role"] in AGGREGATED or label.startswith("profiler"):
            continue
        active = ", ".join(f"{n} {c:.1f}" for n, c in p["threads"][:6]) or "-"
        env = ", ".join(f"{k}={v}" for k, v in p["env"].items() if k != "LD_PRELOAD") or "(none)"
        lines.append(f"| {label} | {p['max_threads']} | {len(p['threads'])}: {active} | {env} |")
    return "\n".join(lines)


def category_table(profile: dict, label: str, top: int = 6) -> str:
    """What one process spent its CPU on, per phase (py-spy's stacks share the kernel's CPU time)."""
    p = profile["processes"].get(label)
    if not p or not p["categories"]:
        return ""
    lines = [f"**{profile['column']}**, {label}: CPU seconds by activity (py-spy)", "",
             "| phase | CPU s | activities |", "| --- | ---: | --- |"]
    for ph in _phases_present([profile]):
        cats = p["categories"].get(ph)
        if not cats or sum(cats.values()) < 0.05:
            continue
        cells = ", ".join(f"{k} {v:.2f}" for k, v in list(cats.items())[:top])
        lines.append(f"| {ph} | {sum(cats.values()):.2f} | {cells} |")
    return "\n".join(lines)


def engine_table(profiles: list[dict]) -> str:
    """Per decode step, per column and round type: wall ms and the engine's CPU ms by activity."""
    cats: list[str] = []
    for p in profiles:
        for e in p["engine"].values():
            cats += [c for c in e["cpu_ms_per_step"] if c not in cats]
    lines = ["Engine per decode step (ms): wall time of the rollout phase and the engine processes' CPU "
             "(core + worker) by activity", "",
             "| column, round | decode steps | accepted/drafted | wall ms/step | CPU ms/step | " + " | ".join(cats) + " |",
             "| --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(cats)]
    for p in profiles:
        for rt, e in p["engine"].items():
            cpu = e["cpu_ms_per_step"]
            acc = f"{e['accepted_tokens'] / e['draft_tokens']:.2f}" if e["draft_tokens"] else "-"
            lines.append(f"| {p['column']}, {rt} | {e['decode_steps']:.0f} | {acc} | {e['wall_ms_per_step']:.2f} | "
                         f"{sum(cpu.values()):.2f} | " + " | ".join(f"{cpu.get(c, 0.0):.2f}" for c in cats) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- picture
def plot(profiles: list[dict], path: Path) -> None:
    """Top: cores in use per process over the loop (one panel per column, phases shaded);
    bottom: the engine's CPU per decode step by activity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phase_colours = {"rollout/baseline": "#bbbbbb", "rollout/short": "#9ecae1", "rollout/long": "#fdae6b",
                     "scoring": "#c7e9c0", "train": "#a1d99b", "weight_sync": "#dadaeb", "validation": "#f0f0f0",
                     "checkpoint": "#fde0dd"}
    fig, axes = plt.subplots(len(profiles) + 1, 1, figsize=(14, 3.2 * (len(profiles) + 1)))
    for ax, prof in zip(axes, profiles):
        tl = prof["timeline"]
        names = sorted(tl["series"], key=lambda k: -sum(tl["series"][k]))
        xs = [i * tl["bin_s"] for i in range(len(next(iter(tl["series"].values()))))] if names else []
        if names:
            ax.stackplot(xs, [tl["series"][n] for n in names], labels=names, alpha=0.85)
        for label, a, b in prof["phases"]:
            ax.axvspan(a, b, color=phase_colours.get(label, "#ffffff"), alpha=0.35, lw=0, zorder=0)
        ax.axhline(2.0, color="k", lw=0.8, ls="--")
        ax.set(title=f"{prof['column']}: cores in use per process (shaded: loop phases)", xlabel="s into the loop",
               ylabel="cores")
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    ax = axes[-1]
    bars, labels = [], []
    for prof in profiles:
        for rt, e in prof["engine"].items():
            bars.append(e["cpu_ms_per_step"])
            labels.append(f"{prof['column']}\n{rt} ({e['wall_ms_per_step']:.1f} ms wall)")
    cats = []
    for b in bars:
        cats += [c for c in b if c not in cats]
    bottom = [0.0] * len(bars)
    for c in cats:
        vals = [b.get(c, 0.0) for b in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=c)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax.set_xticks(range(len(bars)), labels, fontsize=7)
    ax.set(title="engine CPU per decode step by activity (ms)", ylabel="ms")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
