#!/usr/bin/env python3
"""scripts/side_by_side.sh's table: per requested stage, our ms per step (the mean wall time of the
warm-up steps --profile-warmup timed in that stage, the untie step apart) beside upstream's (the mean of
its timed steps there), and upstream/ours. Writes OUTDIR/side_by_side.md and .json; prints the table."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from gpu_check_tool import parse_profiles  # noqa: E402

LEFT_OUT = [
    "FlashAttention-3: not on the GPU machine; upstream's attention ran through fa3_standin.py (PyTorch "
    "flex_attention with FA3's masks), slower than FA3: this flatters our trainer",
    "validation (upstream: val_loss_every 0 and no last step; ours: one validation after the warm-up, not timed)",
    "communication: one GPU (world 1, 8 micro-steps of gradient accumulation), no NCCL traffic on either side",
    "FineWeb: both sides read the same synthetic tokens (random, documents of FineWeb-like lengths)",
    "upstream's warm-up compiles only the requested stages' first two steps; ours warms up every stage",
    "the untie step: not in ours' stage means; in upstream's only where a timed range holds it",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--upstream-json", required=True)
    ap.add_argument("--stages", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ours-status", required=True)
    ap.add_argument("--upstream-status", required=True)
    ap.add_argument("--dry-run", type=int, default=0)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    stages = [int(s) for s in a.stages.split(",")]
    ours = {}
    text = open(a.ours, errors="replace").read() if os.path.exists(a.ours) else ""
    for p in parse_profiles(text):
        if p.get("stage") is None or p.get("kind") == "untie" or p.get("wall_ms") is None:
            continue
        ours.setdefault(p["stage"], []).append(p["wall_ms"])
    up = json.load(open(a.upstream_json)) if os.path.exists(a.upstream_json) else {}
    up_steps = {}
    for s in up.get("steps", []):
        up_steps.setdefault(s["stage"], []).append(s["ms"])
    rows = []
    for st in stages:
        o = ours.get(st, [])
        # upstream's first timed step of a stage can still carry a lazy allocation or autotune: the mean
        # of the rest where there are at least three
        u = up_steps.get(st, [])
        u_used = u[1:] if len(u) >= 3 else u
        om = sum(o) / len(o) if o else None
        um = sum(u_used) / len(u_used) if u_used else None
        rows.append({"stage": st, "ours_ms": om, "ours_steps": len(o), "upstream_ms": um, "upstream_steps": len(u_used),
                     "upstream_over_ours": um / om if om and um else None})
    label = ("DRY RUN: ours on the CPU build (emu wall time, the tiny preset), upstream skipped"
             if a.dry_run else "one GPU, both sides on the same synthetic tokens")
    doc = {"label": label, "stages": rows, "steps_per_stage": a.steps, "ours_status": a.ours_status,
           "upstream_status": a.upstream_status, "upstream_compile_s": up.get("compile_s"),
           "upstream_peak_mib": up.get("peak_mib"), "left_out": LEFT_OUT, "seconds": a.seconds}
    os.makedirs(a.out, exist_ok=True)
    json.dump(doc, open(os.path.join(a.out, "side_by_side.json"), "w"), indent=1)

    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    table = [f"{'stage':>5} {'ours ms/step':>13} {'upstream ms/step':>17} {'upstream/ours':>14}"]
    table += [f"{r['stage']:>5} {f(r['ours_ms']):>13} {f(r['upstream_ms']):>17} {f(r['upstream_over_ours'], '.3f'):>14}"
              for r in rows]
    md = [f"# side by side: ours against upstream's record 71", "", f"**{label}**", "",
          f"- ours: {a.ours_status}", f"- upstream: {a.upstream_status}",
          f"- upstream's compile and warm-up: {f(up.get('compile_s'), '.1f')} s (not in the timed steps)",
          f"- the call took {a.seconds} s", "", "| stage | ours ms/step (steps) | upstream ms/step (steps) | upstream/ours |",
          "| ---: | ---: | ---: | ---: |"]
    md += [f"| {r['stage']} | {f(r['ours_ms'])} ({r['ours_steps']}) | {f(r['upstream_ms'])} ({r['upstream_steps']}) | "
           f"{f(r['upstream_over_ours'], '.3f')} |" for r in rows]
    md += ["", "Left out:", ""] + [f"- {x}" for x in LEFT_OUT] + [""]
    open(os.path.join(a.out, "side_by_side.md"), "w").write("\n".join(md))
    print(f"\nside_by_side ({label}); ours: {a.ours_status}; upstream: {a.upstream_status}; "
          f"upstream compile {f(up.get('compile_s'), '.1f')} s")
    print("\n".join(table))
    print("left out:" + "".join(f"\n  - {x}" for x in LEFT_OUT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
