#!/usr/bin/env python3
"""Parses the step model's JSON files with Python's json module and checks them (test_step_model runs it).

    check_step_model_json.py PLAN WANT_PLAN TRACE WANT_TRACE

PLAN (--plan-step --json): strict JSON (no NaN or Infinity), every key the issue's checks use with
its type, and the values WANT_PLAN gives (a JSON object; its lists are matched element by element,
its objects key by key). TRACE (--trace): a Chrome trace whose "X" events all have a name, pid,
tid, ts and a non-negative dur, WANT_TRACE's "x_events" of them, and each event in its "find".
"""
import json
import numbers
import sys

failures = []


def check(ok, message):
    if not ok:
        failures.append(message)


def refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f, parse_constant=refuse_constant)


def is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def has(obj, key, kind, where):
    ok = isinstance(obj, dict) and key in obj
    check(ok, f"{where}: no key {key!r}")
    if not ok:
        return
    v = obj[key]
    good = {"str": isinstance(v, str), "int": isinstance(v, int) and not isinstance(v, bool),
            "number": is_number(v), "list": isinstance(v, list)}[kind]
    check(good, f"{where}.{key}: {v!r} is not a {kind}")


def check_schema(plan):
    for key, kind in [("preset", "str"), ("world_size", "int"), ("total_ms", "number"), ("stages", "list")]:
        has(plan, key, kind, "plan")
    for i, s in enumerate(plan.get("stages", [])):
        where = f"stages[{i}]"
        has(s, "stage", "str", where)
        for key in ["even_ms", "adam_ms", "exposed_comm_even_ms", "exposed_comm_adam_ms"]:
            has(s, key, "number", where)
        for key in ["launches_even", "launches_adam", "host_syncs_in_step"]:
            has(s, key, "int", where)
        has(s, "kernels", "list", where)
        has(s, "collectives", "list", where)
        for j, k in enumerate(s.get("kernels", [])):
            has(k, "name", "str", f"{where}.kernels[{j}]")
            has(k, "count", "int", f"{where}.kernels[{j}]")
            for key in ["flops", "bytes", "modeled_ms"]:
                has(k, key, "number", f"{where}.kernels[{j}]")
        for j, c in enumerate(s.get("collectives", [])):
            has(c, "name", "str", f"{where}.collectives[{j}]")
            for key in ["bytes", "modeled_ms", "overlapped_ms"]:
                has(c, key, "number", f"{where}.collectives[{j}]")


def matches(got, want, where):
    if isinstance(want, dict):
        if not isinstance(got, dict):
            check(False, f"{where}: {got!r} is not an object")
            return
        for key, w in want.items():
            check(key in got, f"{where}: no key {key!r}")
            if key in got:
                matches(got[key], w, f"{where}.{key}")
    elif isinstance(want, list):
        ok = isinstance(got, list) and len(got) == len(want)
        check(ok, f"{where}: {got!r} is not a list of {len(want)}")
        if ok:
            for i, (g, w) in enumerate(zip(got, want)):
                matches(g, w, f"{where}[{i}]")
    elif is_number(want):
        check(is_number(got) and abs(got - want) <= 1e-9 * max(1.0, abs(want)), f"{where}: got {got!r}, want {want!r}")
    else:
        check(got == want, f"{where}: got {got!r}, want {want!r}")


def check_trace(trace, want):
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    check(isinstance(events, list), "trace: no traceEvents list")
    x = [e for e in events or [] if isinstance(e, dict) and e.get("ph") == "X"]
    check(len(x) == want["x_events"], f"trace: {len(x)} X events, want {want['x_events']}")
    for e in x:
        ok = (isinstance(e.get("name"), str) and isinstance(e.get("pid"), int) and isinstance(e.get("tid"), int)
              and is_number(e.get("ts")) and is_number(e.get("dur")) and e["dur"] >= 0)
        check(ok, f"trace: malformed X event {e!r}")
    for f in want.get("find", []):
        found = any(all(abs(e.get(k, float("nan")) - v) <= 1e-6 if is_number(v) else e.get(k) == v
                        for k, v in f.items()) for e in x)
        check(found, f"trace: no X event {f!r}")


def main():
    if len(sys.argv) != 5:
        print(__doc__)
        return 2
    plan_path, want_plan, trace_path, want_trace = sys.argv[1:]
    try:
        plan, trace = load(plan_path), load(trace_path)
    except ValueError as e:
        print(f"FAIL: not strict JSON: {e}")
        return 1
    check_schema(plan)
    matches(plan, json.loads(want_plan), "plan")
    check_trace(trace, json.loads(want_trace))
    for f in failures:
        print("FAIL: " + f)
    print(f"JSON check: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
