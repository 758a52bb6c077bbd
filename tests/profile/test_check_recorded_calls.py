#!/usr/bin/env python3
"""check_recorded_calls.py on the repository (clean: exit 0) and on copies of its sources with one
planted violation each: a launch without its Work, a raw CUDA call where a helper records it (in the
kernels and in the trainer's step: a copy, a blocking copy, a collective), a raw NCCL call outside the
one function allowed to make it, a raw call beside an exception that is for another function, a Work-less launch hidden from nothing but a
comment (still caught) and one inside a comment or string (not a call), and an exception that no
longer matches anything. Each planted copy must exit 1 naming the file and line."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("REPO", os.path.dirname(os.path.dirname(HERE)))
CHECK = os.path.join(HERE, "check_recorded_calls.py")


def run_check(repo):
    p = subprocess.run([sys.executable, CHECK, repo], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


class Planted(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        for d in ("kernels", "runtime", "train"):
            if os.path.isdir(os.path.join(REPO, d)):
                shutil.copytree(os.path.join(REPO, d), os.path.join(self.tmp, d))
        shutil.copy(os.path.join(REPO, "train_gpt.cu"), self.tmp)

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def plant(self, rel, old, new):
        path = os.path.join(self.tmp, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertIn(old, text, f"{rel} no longer holds the text this test edits")
        text = text.replace(old, new, 1)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return text[: text.index(new)].count("\n") + 1  # the line the planted text starts on

    def assert_flags(self, expected):
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 1, out)
        self.assertIn(expected, out)
        self.assertEqual(len(out.strip().splitlines()), 1, f"only the planted violation is reported:\n{out}")

    def test_clean_copy_passes(self):
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 0, out)

    def test_launch_without_work(self):
        line = self.plant("kernels/norm.cuh", "launch(rmsnorm_forward_work(T, C), rmsnorm_forward_kernel,",
                          "launch(rmsnorm_forward_kernel,")
        self.assert_flags(f"kernels/norm.cuh:{line}: launch of rmsnorm_forward_kernel without a Work first")

    def test_templated_launch_without_work(self):
        line = self.plant("kernels/attention.cuh",
                          "launch(attention_backward_dkdv_work(p, D, counts, false), attention_backward_dkdv_kernel<D, false>,",
                          "launch(attention_backward_dkdv_kernel<D, false>,")
        self.assert_flags(f"kernels/attention.cuh:{line}: launch of attention_backward_dkdv_kernel without a Work")

    def test_launch_in_trainer(self):
        line = self.plant("runtime/finite.h", "#include", "__global__ void planted_kernel(int* x) { *x = 1; }\n"
                          "inline void planted(int* x) { launch(planted_kernel, dim3(1), dim3(1), 0, nullptr, x); }\n"
                          "#include")
        self.assert_flags(f"runtime/finite.h:{line + 1}: launch of planted_kernel without a Work first")

    def test_raw_memset(self):
        line = self.plant("kernels/attention.cuh", "CUDA_CHECK(memset_async(dq_accum,", "CUDA_CHECK(cudaMemsetAsync(dq_accum,")
        self.assert_flags(f"kernels/attention.cuh:{line}: cudaMemsetAsync outside a recording helper (use memset_async)")

    def test_raw_event_record(self):
        line = self.plant("kernels/comms.cuh", "CUDA_CHECK(record_event(merged_, stream));",
                          "CUDA_CHECK(cudaEventRecord(merged_, stream));")
        self.assert_flags(f"kernels/comms.cuh:{line}: cudaEventRecord outside a recording helper")

    def test_nccl_outside_its_function(self):
        # ncclSend is allowed in SparseRowExchange::exchange only
        line = self.plant("kernels/comms.cuh", "    int rank() const { return rank_; }",
                          "    void planted(const int* x) { NCCL_CHECK(ncclSend(x, 1, ncclInt32, 0, nccl_, comms_)); }\n"
                          "    int rank() const { return rank_; }")
        self.assert_flags(f"kernels/comms.cuh:{line}: ncclSend outside a recording helper")

    def test_raw_calls_in_trainer(self):
        # the step's copy, collective and blocking copy; warm_up may restore the parameters with
        # cudaMemcpy, the run's loop may not
        cases = [
            ("runtime/step_losses.h", "CUDA_CHECK(copy_async(row(step) + micro,", "CUDA_CHECK(cudaMemcpyAsync(row(step) + micro,",
             "cudaMemcpyAsync outside a recording helper (use copy_async)"),
            ("train_gpt.cu", "NCCL_CHECK(reduce_scatter(", "NCCL_CHECK(ncclReduceScatter(",
             "ncclReduceScatter outside a recording helper"),
            ("runtime/device_batch.h",
             "CUDA_CHECK(copy_async(b.packed, img.pinned, img.used * sizeof(int32_t), cudaMemcpyHostToDevice, s));",
             "CUDA_CHECK(cudaMemcpy(b.packed, img.pinned, img.used * sizeof(int32_t), cudaMemcpyHostToDevice));",
             "cudaMemcpy outside a recording helper (use copy_async and sync_stream)"),
            ("train_gpt.cu", "        watch_nonfinite(r, step);",
             "        CUDA_CHECK(cudaMemcpy(r.m.param_arena.base(), r.m.param_arena.base(), 4, cudaMemcpyDeviceToDevice));\n"
             "        watch_nonfinite(r, step);", "cudaMemcpy outside a recording helper"),
        ]
        for rel, old, new, why in cases:
            with self.subTest(planted=new.strip()):
                path = os.path.join(self.tmp, rel)
                with open(path, encoding="utf-8") as f:
                    clean = f.read()
                line = self.plant(rel, old, new)
                self.assert_flags(f"{rel}:{line}: {why}")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(clean)

    def test_comments_and_strings_are_not_calls(self):
        self.plant("kernels/norm.cuh", "// ---- kernels and launchers ----",
                   "// launch(rmsnorm_forward_kernel, grid, block, 0, s) and cudaMemsetAsync(p, 0, n, s)\n"
                   "inline const char* planted_text() { return \"launch(rmsnorm_forward_kernel, cudaEventRecord(\"; }\n"
                   "// ---- kernels and launchers ----")
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 0, out)

    def test_stale_exception(self):
        # the grouped receives gone, the exception that allowed them must go too
        self.plant("kernels/comms.cuh", "NCCL_CHECK(ncclRecv(", "NCCL_CHECK(ncclSend(")
        self.assert_flags("kernels/comms.cuh: the exception for ncclRecv in exchange matches nothing")


class Repository(unittest.TestCase):
    def test_repository_is_clean(self):
        rc, out = run_check(REPO)
        self.assertEqual(rc, 0, out)


if __name__ == "__main__":
    unittest.main()
