#!/usr/bin/env python3
"""scripts/run_ab.sh end to end on the CPU build, with the real trainer.

    test_run_ab_cpu.py BUILD_DIR      (BUILD_DIR: this checkout's build folder, with train_gpt_cpu)

In a temporary clone of this checkout's HEAD, a second commit adds a comment to train_gpt.cu, so
that HEAD~1 and HEAD embed different sources. run_ab.sh HEAD~1 HEAD 2 --cpu on a one-step tiny
schedule then reuses BUILD_DIR for HEAD~1 (built from the same tree, when this checkout is clean)
and builds HEAD in its own worktree of the clone, which is what this test's time goes to: that build
is configured (AB_CMAKE_FLAGS) to link BUILD_DIR's emu, whose sources the two revisions share, and so
compiles the trainer alone (CMakeLists.txt: EMU_FROM_BUILD). Checks:
the series ran as planned (pairs AB BA: each arm first in one of the two), each arm's logs carry
its source_hash as the manifest recorded it from the build (source_hash.py against the trainer's
own FNV-1a) and the two differ, both arms ran seeds 0 and 1, the logs carry the environment
lines (versions; gpu lines only where nvidia-smi answers), a progress line per run, and
statistics.md with its sections and the plot.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.environ["REPO"]
BUILD = os.path.abspath(sys.argv[1])
failures = 0
passes = 0


def check(ok, what):
    global failures, passes
    print(("ok: " if ok else "FAILED: ") + what, flush=True)
    if ok:
        passes += 1
    else:
        failures += 1


def git(*args, cwd):
    return subprocess.run(["git", "-c", "user.name=test_run_ab_cpu", "-c", "user.email=test@localhost", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def header(text, key):
    return re.findall(rf"^{key}: (.*)$", text, re.M)


def main():
    tmp = tempfile.mkdtemp(prefix="test_run_ab_cpu_")
    try:
        clone = os.path.join(tmp, "repo")
        head = git("rev-parse", "HEAD", cwd=REPO)
        repo_clean = git("status", "--porcelain", cwd=REPO) == ""
        git("clone", "--quiet", "--shared", "--no-checkout", REPO, clone, cwd=tmp)
        git("checkout", "--quiet", "--detach", head, cwd=clone)
        with open(os.path.join(clone, "train_gpt.cu"), "a") as f:
            f.write("// test_run_ab_cpu: a second revision, whose embedded sources differ by this line\n")
        git("commit", "--quiet", "-am", "a comment", cwd=clone)
        if os.path.isdir(os.path.join(REPO, ".venv")):
            os.symlink(os.path.join(REPO, ".venv"), os.path.join(clone, ".venv"))
        ab = os.path.join(tmp, "ab")
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "SEED", "NP", "BINARY",
                                                                 "SKIP_BUILD", "SKIP_PLATFORM_CHECK", "MPI_BIND")}
        # HEAD's build links this build folder's emu (the revisions differ in train_gpt.cu alone): it compiles
        # the trainer and the launch-bounds table, no emu source (a quarter of its time: 105 s -> 80 s on one
        # core). Only when this checkout is clean: otherwise the build folder's emu may not be HEAD's.
        env.update(LOG_DIR=ab, AB_BUILDS=BUILD, AB_CMAKE_FLAGS=f"-DEMU_FROM_BUILD={BUILD}" if repo_clean else "")
        start = time.time()
        r = subprocess.run([os.path.join(clone, "scripts", "run_ab.sh"), "HEAD~1", "HEAD", "2", "--cpu", "--preset", "tiny",
                            "--max-steps", "1", "--val-every", "0", "--val-tokens", "2048"],
                           cwd=clone, env=env, capture_output=True, text=True, timeout=1500)
        print(r.stderr + r.stdout, flush=True)
        print(f"run_ab.sh took {time.time() - start:.0f} s", flush=True)
        check(r.returncode == 0, f"run_ab.sh exits 0 (got {r.returncode})")
        if repo_clean:
            check(f"reusing {BUILD}, built from the same tree" in r.stderr, "HEAD~1 reuses this checkout's build folder")
        else:
            print(f"note: {REPO} has uncommitted changes, so its build folder is not HEAD~1's: both arms were built")
        b_commit = git("rev-parse", "HEAD", cwd=clone)
        b_build = os.path.join(clone, "build-ab", b_commit[:12], "build")
        check(os.path.isfile(os.path.join(b_build, "train_gpt_cpu")), "HEAD was built in its own worktree, build-ab/<commit>/build")
        logs = [os.path.join(b_build, name) for name in ("run_ab-configure.log", "run_ab-build.log")]
        configured, built = [open(path).read() if os.path.isfile(path) else "" for path in logs]
        emu_compiled = [] if not repo_clean else re.findall(r"^.*Building CXX object .*(?:/emu/|host_comm).*$", built, re.M)
        check((f"emu: linked from {BUILD}" in configured or not repo_clean) and "train_gpt_cpu.cpp.o" in built and not emu_compiled,
              f"HEAD's build linked this build folder's emu and compiled the trainer, none of emu {emu_compiled}")
        manifest = open(os.path.join(ab, "manifest")).read()
        fields = dict(line.split(": ", 1) for line in manifest.splitlines() if ": " in line and not line.startswith("run:"))
        runs = [line.split()[1:] for line in manifest.splitlines() if line.startswith("run: ")]
        check([r[1] for r in runs] == ["A", "B", "B", "A"] and fields["order"] == "ABBA",
              f"pairs AB BA, each arm first in one of the two: {fields['order']}")
        check(fields["A_commit"] == head and fields["B_commit"] == b_commit, "the manifest names both commits")
        check(fields["A_source_hash"] != fields["B_source_hash"], "the arms' source hashes differ")
        seeds = {"A": [], "B": []}
        for position, arm, seed, log in runs:
            path = os.path.join(ab, log)
            if not os.path.isfile(path):
                check(False, f"run {position}: {path} exists")
                continue
            text = open(path).read()
            check(header(text, "source_hash") == [fields[f"{arm}_source_hash"]],
                  f"run {position} ({arm}): the log's source_hash {header(text, 'source_hash')} is the manifest's")
            seeds[arm] += [int(s) for s in header(text, "seed")]
            check(all(len(header(text, key)) == 1 for key in ("cuda_driver", "cuda_runtime", "cublaslt", "nccl")) and
                  re.search(r"^cublaslt: \d+\.\d+\.\d+$", text, re.M) is not None,
                  f"run {position}: the version lines")
            smi = shutil.which("nvidia-smi") is not None
            check(bool(header(text, "gpu")) == smi, f"run {position}: gpu lines {'present' if smi else 'absent'}"
                  f" as nvidia-smi is {'here' if smi else 'not'}")
        check(seeds == {"A": [0, 1], "B": [0, 1]}, f"both arms ran seeds 0 and 1, in pair order: {seeds}")
        progress = re.findall(r"^== \[(\d)/4\] ([AB]) seed (\d): \d+ s \(step 1/\d+, val_loss [\d.]+, train_time \d+ ms\)",
                              r.stderr, re.M)
        check([p[1] for p in progress] == ["A", "B", "B", "A"], f"a progress line per run: {progress}")
        md_path = os.path.join(ab, "statistics.md")
        md = open(md_path).read() if os.path.exists(md_path) else ""
        for section in ("## Command", "## Revisions", "## Machine", "## Per arm", "val_losses = [", "times = [",
                        "## Paired results (B - A)", "order effect", "noise floor, A against A", "## Plot",
                        fields["A_source_hash"], fields["B_source_hash"], "(emulated on the CPU)"):
            check(section in md, f"statistics.md has {section!r}")
        check(os.path.isfile(os.path.join(ab, "ab.png")), "the plot ab.png beside it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passes} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
