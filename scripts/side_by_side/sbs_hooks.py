"""Hooks a run-time copy of upstream's train_gpt.py calls (scripts/side_by_side/patch_upstream.py puts
the calls in; nothing here is upstream's): which steps the warm-up compiles, the timed steps, the
compile time, and the results as JSON (SBS_OUT). SBS_STAGES: stages to time ("0,2"); SBS_STEPS: steps
timed per stage, from the stage's first step."""
import json
import os
import time

import torch

STAGES = [int(s) for s in os.environ["SBS_STAGES"].split(",")]
STEPS = int(os.environ.get("SBS_STEPS", "6"))
OUT = os.environ["SBS_OUT"]
_results = {"stages": STAGES, "steps_per_stage": STEPS, "compile_s": None, "steps": []}
_compile_t0 = None


def _stage_starts(transition_steps):
    return [0] + list(transition_steps)


def warmup_steps(transition_steps):
    """Upstream's warm-up visits the steps around every schedule change, compiling every shape; here only
    the requested stages' first two steps (an even and an odd one), so that the compile fits one call."""
    starts = _stage_starts(transition_steps)
    for s in STAGES:
        if s >= len(starts):
            raise SystemExit(f"side_by_side: stage {s}: upstream's schedule has stages 0..{len(starts) - 1}")
    steps = sorted({starts[s] + k for s in STAGES for k in (0, 1)})
    print(f"side_by_side: warm-up (compile) on steps {steps}", flush=True)
    return steps


def begin_compile():
    global _compile_t0
    torch.cuda.synchronize()
    _compile_t0 = time.perf_counter()


def end_compile():
    torch.cuda.synchronize()
    _results["compile_s"] = time.perf_counter() - _compile_t0
    print(f"side_by_side: compile and warm-up took {_results['compile_s']:.1f} s (not in the timed steps)", flush=True)
    _save()


def timed_steps(transition_steps):
    """The steps the training loop runs instead of the whole schedule: STEPS from each stage's first step,
    each timed from a synchronized start to a synchronized end (the loop body: schedule, micro-steps,
    optimizer, log line)."""
    starts = _stage_starts(transition_steps)
    for s in STAGES:
        for step in range(starts[s], starts[s] + STEPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            yield step
            torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - t0)
            _results["steps"].append({"stage": s, "step": step, "ms": ms})
            print(f"side_by_side: stage {s} step {step}: {ms:.2f} ms", flush=True)
            _save()
    _results["peak_mib"] = torch.cuda.max_memory_allocated() // 1048576
    _save()


def _save():
    with open(OUT, "w") as f:
        json.dump(_results, f, indent=1)
