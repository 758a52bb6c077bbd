#!/usr/bin/env python3
"""check_res_usage.py on planted resource tables: each kind of overflow is reported, the fitting
configurations are not; and the whole script exits 1 on a planted table and 0 on a fitting one."""
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_res_usage as cru  # noqa: E402

RES_USAGE = """
Fatbin elf code:
================
arch = sm_90a

Resource usage:
 Common:
  GLOBAL:24 CONSTANT[4]:8
 Function _Z4heavyPf:
  REG:255 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:632 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z5tiledPf:
  REG:32 STACK:0 SHARED:17664 LOCAL:0 CONSTANT[0]:577 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z7spilledPf:
  REG:128 STACK:16 SHARED:1024 LOCAL:16 CONSTANT[0]:577 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


class Checks(unittest.TestCase):
    def setUp(self):
        self.kernels = cru.parse_res_usage(RES_USAGE)

    def test_parse(self):
        self.assertEqual(self.kernels["_Z4heavyPf"], {"REG": 255, "SHARED": 1024, "LOCAL": 0, "STACK": 0})
        self.assertEqual(self.kernels["_Z5tiledPf"]["SHARED"], 17664)

    def test_registers(self):
        # 255 registers round to 256 a thread: 128 threads take 32768, 256 threads exactly 65536, 288 too many.
        for threads, fits in ((128, True), (256, True), (288, False)):
            problems, _ = cru.violations({"_Z4heavyPf": self.kernels["_Z4heavyPf"]}, {("_Z4heavyPf", threads, 0)})
            self.assertEqual(not problems, fits, (threads, problems))

    def test_shared(self):
        static = 17664 - 1024
        ok, _ = cru.violations({"_Z5tiledPf": self.kernels["_Z5tiledPf"]}, {("_Z5tiledPf", 256, 227 * 1024 - static)})
        self.assertEqual(ok, [])
        bad, _ = cru.violations({"_Z5tiledPf": self.kernels["_Z5tiledPf"]}, {("_Z5tiledPf", 256, 227 * 1024 - static + 1)})
        self.assertEqual(len(bad), 1)
        self.assertIn("more than the 232448 a block may have", bad[0])

    def test_spills_and_unknown_kernels(self):
        problems, checked = cru.violations(self.kernels, {("_Z4heavyPf", 128, 0), ("_Z7missingv", 32, 0)})
        self.assertEqual(checked, 1)
        self.assertTrue(any("_Z7spilledPf: spills" in p for p in problems), problems)
        self.assertTrue(any("_Z7missingv: launched by the CPU tests but in none" in p for p in problems), problems)

    def test_known_stack_frame(self):
        sym = "_Z22yarn_fill_table_kernelP13__nv_bfloat16PKfii"
        size = cru.STACK_FRAMES[sym][0]
        for stack, fits in ((size, True), (size + 8, False), (0, False)):
            r = {"REG": 20, "SHARED": 1024, "LOCAL": 0, "STACK": stack}
            problems, _ = cru.violations({sym: r}, {(sym, 256, 0)})
            self.assertEqual(not problems, fits, (stack, problems))

    def test_bad_log_line(self):
        with self.assertRaises(ValueError):
            cru.parse_launch_log("_Z4heavyPf 128\n")

    def test_script_exit_status(self):
        with tempfile.TemporaryDirectory() as d:
            res, log = os.path.join(d, "res.txt"), os.path.join(d, "log.txt")
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_res_usage.py")
            fitting = RES_USAGE.replace("REG:128 STACK:16 SHARED:1024 LOCAL:16", "REG:128 STACK:0 SHARED:1024 LOCAL:0")
            for table, launches, want in ((fitting, "_Z4heavyPf 128 0\n_Z5tiledPf 256 4096\n", 0),
                                          (fitting, "_Z4heavyPf 512 0\n", 1), (RES_USAGE, "_Z4heavyPf 128 0\n", 1)):
                with open(res, "w") as f:
                    f.write(table)
                with open(log, "w") as f:
                    f.write(launches)
                run = subprocess.run([sys.executable, script, "--launch-log", log, "--res-usage", res],
                                     capture_output=True, text=True)
                self.assertEqual(run.returncode, want, run.stdout + run.stderr)


if __name__ == "__main__":
    unittest.main()
