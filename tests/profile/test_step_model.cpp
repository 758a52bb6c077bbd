// The step model (profiler/cost_model.h, replay.h, reports.h, upstream_schedule.h): operation prices
// and replayed makespans on small hand-built graphs, each expected value worked out by hand in the
// comments under a model of round numbers (round_model()); random graphs whose replayed schedules
// must satisfy every rule of the replay, checked constraint by constraint; upstream's schedule rules
// (and the refusal of a recording that lacks a rule's family); bad recordings refused with their
// message; and the JSON plan and Chrome trace parsed back by Python's json module (the checker's
// path and interpreter come as arguments: test_step_model PYTHON CHECKER).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "tests/test_util.h"
#include "profiler/cost_model.h"
#include "profiler/replay.h"
#include "profiler/reports.h"
#include "profiler/upstream_schedule.h"

// ---- a model of round numbers and graph-building shorthands ----

// 1 TFLOP/s = 1e6 FLOP per us; 1 TB/s = 1e6 bytes per us; 1 GB/s = 1e3 bytes per us.
static CostModel round_model() {
    CostModel m;
    m.sms = 4;
    m.bf16_tflops = 4, m.fp8_tflops = 8, m.fp32_tflops = 1, m.hbm_tbs = 1;  // 1e6 flop/us per SM in bf16
    m.gemm_bf16_efficiency = m.gemm_fp8_efficiency = 1;
    m.gemm_tile_m = 100, m.gemm_tile_n = 100, m.gemm_k_ramp = 0, m.gemm_max_split_k = 1;
    m.tc_tflops = {{"attention_forward", 2}, {"fa3_attention_forward", 4}};
    m.tc_default_tflops = 1;
    m.hbm_efficiency = 1, m.hbm_efficiency_by_family = {}, m.cuda_core_efficiency = 1;
    m.host_launch_us = m.host_gemm_us = m.host_collective_us = 1;
    m.host_event_us = 0, m.host_sync_us = 1, m.mpi_us = 1, m.device_launch_us = 1;
    m.pcie_pinned_gbs = 1, m.pcie_pageable_gbs = 0.5, m.copy_latency_us = 0;
    m.world_size = 2, m.nodes = 1;
    m.nvlink_busbw_gbs = 1, m.nics_per_node = 1, m.nic_gbs = 0.5, m.nic_efficiency = 1;
    m.nccl_protocols = {{"flat", 10, 1, 5, 1.0, 0}};
    return m;
}

static StepOp kernel(const char* name, int stream, double bytes, const char* range = "") {
    Work w;
    w.name = name;
    w.bytes_read = bytes;
    return {OpKind::kernel, stream, -1, w, range};
}
static StepOp with_flops(StepOp op, double tc_flops, double flops) {
    op.work.tc_flops = tc_flops, op.work.flops = flops;
    return op;
}
static StepOp gemm(const char* name, int stream, int m, int n, int k, int batch = 1, GemmType t = GemmType::bf16) {
    Work w;
    w.name = name, w.gemm = t, w.m = m, w.n = n, w.k = k, w.batch = batch;
    w.tc_flops = 2.0 * m * n * k * batch;
    return {OpKind::gemm, stream, -1, w, ""};
}
static StepOp record(int stream, int event) { return {OpKind::event_record, stream, event, Work{}, ""}; }
static StepOp wait(int stream, int event) { return {OpKind::event_wait, stream, event, Work{}, ""}; }
static StepOp sync(int stream, const char* name = "") {
    Work w;
    w.name = name;
    return {OpKind::host_sync, stream, -1, w, ""};
}
static StepOp collective(const char* name, Comm kind, int stream, double bytes, const char* range = "") {
    Work w;
    w.name = name, w.comm = kind, w.comm_bytes = bytes;
    return {OpKind::collective, stream, -1, w, range};
}

static bool near(double got, double want) { return std::fabs(got - want) <= 1e-9 * std::max(1.0, std::fabs(want)); }
static void check_near(double got, double want, const char* what) {
    test::check(near(got, want), "%s: got %.12g want %.12g", what, got, want);
}
static void check_span(const OpTiming& t, double start, double end, const char* what) {
    test::check(near(t.start_us, start) && near(t.end_us, end), "%s: ran [%.9g, %.9g], want [%.9g, %.9g]", what,
                t.start_us, t.end_us, start, end);
}
// An error message that says what it should.
static void check_says(const std::string& got, const char* phrase, const char* what) {
    test::check(got.find(phrase) != std::string::npos, "%s: '%s' does not say '%s'", what, got.c_str(), phrase);
}
static double path_share(const Timeline& tl, const char* name) {
    for (const PathShare& p : tl.critical_path)
        if (p.name == name) return p.us;
    return 0;
}
static Timeline replay_one(const std::vector<StepOp>& ops, const CostModel& cm) { return replay({ops}, cm)[0]; }

// ---- the hand-computed graphs (round_model(): launch 1 us host, 1 us device per kernel) ----

// One stream, three kernels, each bound by something else:
//   k1: 10e6 bytes at 1e6 B/us = 10 us, + 1 = 11; host issues it at 1 -> [1, 12]
//   k2: 20e6 CUDA-core flops at 1e6/us = 20 us beats 5e6 bytes (5 us); + 1 = 21; issued at 2 -> [12, 33]
//   k3: 6e6 tensor-core flops at attention_forward's 2 TFLOP/s = 3 us beats 1e6 bytes; + 1 = 4 -> [33, 37]
// Makespan 37 = first launch 1 + 11 + 21 + 4, all on the critical path.
static std::vector<StepOp> three_kernels() {
    return {kernel("k1", 0, 10e6), with_flops(kernel("k2", 0, 5e6), 0, 20e6),
            with_flops(kernel("attention_forward", 0, 1e6), 6e6, 0)};
}
static void test_one_stream() {
    const Timeline tl = replay_one(three_kernels(), round_model());
    check_span(tl.ops[0], 1, 12, "k1");
    check_span(tl.ops[1], 12, 33, "k2");
    check_span(tl.ops[2], 33, 37, "k3");
    check_near(tl.makespan_us, 37, "three kernels' makespan");
    check_near(path_share(tl, "k1"), 11, "k1 on the critical path");
    check_near(path_share(tl, "k2"), 21, "k2 on the critical path");
    check_near(path_share(tl, "attention_forward"), 4, "k3 on the critical path");
    check_near(path_share(tl, "host_launch"), 1, "the first launch on the critical path");
    test::check(tl.launches == 3 && tl.host_syncs == 0, "launches %d host syncs %d", tl.launches, tl.host_syncs);

    // Host-bound: with 2 us per launch and 1 us kernels the host issues at 2, 4, 6 and each kernel
    // waits for it: [2,3], [4,5], [6,7]; makespan 7 = 6 us of launches + the last kernel.
    CostModel slow_host = round_model();
    slow_host.host_launch_us = 2;
    const Timeline hb = replay_one({kernel("a", 0, 0), kernel("b", 0, 0), kernel("c", 0, 0)}, slow_host);
    check_span(hb.ops[1], 4, 5, "host-bound b");
    check_near(hb.makespan_us, 7, "host-bound makespan");
    check_near(path_share(hb, "host_launch"), 6, "host-bound: launches on the critical path");
    check_near(path_share(hb, "c"), 1, "host-bound: the last kernel on the critical path");
}

// Two streams and events (event ops cost the host nothing here):
//   op0 ka s0 10e6 B: issued 1 -> [1, 12];  op1 record e0 on s0: stamped 12;  op2 s1 waits e0
//   op3 kb s1 4e6 B (5 us): issued 2, waits for e0 -> [12, 17];  op4 record e1 on s1: 17
//   op5 kc s0 2e6 B (3 us): issued 3, after ka -> [12, 15];  op6 s0 waits e1
//   op7 kd s0 1e6 B (2 us): issued 4, stream free at 15, e1 at 17 -> [17, 19]
// Stream 0 sat idle 17 - 15 = 2 us for stream 1's event: exposed. Makespan 19; the critical path
// kd 2 <- kb 5 <- ka 11 <- the first launch 1.
static std::vector<StepOp> two_streams() {
    return {kernel("ka", 0, 10e6), record(0, 0),         wait(1, 0), kernel("kb", 1, 4e6),
            record(1, 1),          kernel("kc", 0, 2e6), wait(0, 1), kernel("kd", 0, 1e6)};
}
static void test_event_wait() {
    const Timeline tl = replay_one(two_streams(), round_model());
    check_span(tl.ops[3], 12, 17, "kb after the event");
    check_span(tl.ops[5], 12, 15, "kc after ka");
    check_span(tl.ops[7], 17, 19, "kd after the event");
    check_near(tl.makespan_us, 19, "two streams' makespan");
    check_near(tl.exposed_comm_us, 2, "stream 0 waiting on stream 1");
    check_near(path_share(tl, "kb"), 5, "kb on the critical path");
    check_near(path_share(tl, "kc"), 0, "kc off the critical path");
    test::check(tl.launches == 4, "launches: %d", tl.launches);

    // Stream 0 waits for stream 1 through an event it records itself: still exposed.
    //   ka s0 10e6 B [1, 12]; kb s1 20e6 B issued 2 -> [2, 23]; record e1 on s1 (23); s0 waits e1;
    //   record e0 on s0: 23, a time stream 1 set; s0 waits e0; kc s0 0 B issued 3 -> [23, 24]:
    //   stream 0 idle from 12 to 23 for stream 1, 11 us exposed.
    const Timeline relayed = replay_one({kernel("ka", 0, 10e6), kernel("kb", 1, 20e6), record(1, 1), wait(0, 1),
                                         record(0, 0), wait(0, 0), kernel("kc", 0, 0)},
                                        round_model());
    check_span(relayed.ops[6], 23, 24, "kc after the relayed event");
    check_near(relayed.exposed_comm_us, 11, "a wait relayed through stream 0's own event");

    // A wait on an event never recorded is a no-op (CUDA's rule): kd would start at 4.
    const Timeline none = replay_one({kernel("ka", 1, 10e6), wait(0, 7), kernel("kd", 0, 1e6)}, round_model());
    check_span(none.ops[2], 2, 4, "a wait on an unrecorded event");
}

// Host syncs (1 us after the stream drains):
//   ka s0 10e6 B -> [1, 12]; sync s0: host at max(1, 12) + 1 = 13; kb s0 0 B: issued 14 -> [14, 15]
static std::vector<StepOp> host_sync_graph() { return {kernel("ka", 0, 10e6), sync(0), kernel("kb", 0, 0)}; }
static void test_host_sync() {
    const CostModel cm = round_model();
    const Timeline tl = replay_one(host_sync_graph(), cm);
    check_near(tl.ops[1].host_end_us, 13, "the host after the sync");
    check_span(tl.ops[2], 14, 15, "kb after the sync");
    check_near(tl.makespan_us, 15, "host sync makespan");
    test::check(tl.host_syncs == 1, "host syncs: %d", tl.host_syncs);
    check_near(path_share(tl, "host_sync"), 1, "the sync on the critical path");

    // Two streams: ka s0 [1, 12], kb s1 20e6 B issued 2 -> [2, 23]. A device-wide sync waits for
    // both: host 23 + 1 = 24, kc s0 issued 25 -> [25, 26]. A sync on s0 alone: host 13, kc [14, 15],
    // and the step still ends with kb at 23.
    const std::vector<StepOp> all = {kernel("ka", 0, 10e6), kernel("kb", 1, 20e6), sync(-1), kernel("kc", 0, 0)};
    const Timeline device = replay_one(all, cm);
    check_span(device.ops[3], 25, 26, "kc after a device sync");
    check_near(device.makespan_us, 26, "device sync makespan");
    std::vector<StepOp> one = all;
    one[2] = sync(0);
    const Timeline stream = replay_one(one, cm);
    check_span(stream.ops[3], 14, 15, "kc after a stream sync");
    check_near(stream.makespan_us, 23, "stream sync makespan");
}

// A reduce-scatter of 8e3 bytes on 2 GPUs: 10 + 1 step x 1 = 11 us + 8e3 x 1/2 / 1e3 B/us = 15 us.
//   ka s0 10e6 B [1, 12]; record e0 s0 (12); s1 waits e0; rs on s1 issued 2, ready 12 -> [12, 27]
//   kb s0 (30e6 B: 31 us) issued 3 -> [12, 43]; record e1 on s1 (27); s0 waits e1; kc s0 0 B issued 4
// Overlapped: kc ready at max(43, 27) -> [43, 44]; rs wholly under kb: 15 us overlapped, none exposed.
// Exposed: kb 5e6 B -> [12, 18]; kc waits for e1 at 27 -> [27, 28]: 27 - 18 = 9 us exposed, 18 - 12
// = 6 us overlapped; makespan 28 = kc 1 + rs 15 + ka 11 + the first launch 1.
static std::vector<StepOp> comms_graph(double kb_bytes) {
    return {kernel("ka", 0, 10e6),
            record(0, 0),
            wait(1, 0),
            collective("nccl_reduce_scatter", Comm::reduce_scatter, 1, 8e3),
            kernel("kb", 0, kb_bytes),
            record(1, 1),
            wait(0, 1),
            kernel("kc", 0, 0)};
}
static void test_collective_overlap() {
    const CostModel cm = round_model();
    const Timeline hidden = replay_one(comms_graph(30e6), cm);
    check_span(hidden.ops[3], 12, 27, "overlapped reduce-scatter");
    check_span(hidden.ops[7], 43, 44, "kc after kb");
    check_near(hidden.ops[3].overlapped_us, 15, "reduce-scatter under kb");
    check_near(hidden.exposed_comm_us, 0, "nothing exposed");
    check_near(hidden.makespan_us, 44, "overlapped makespan");

    const Timeline exposed = replay_one(comms_graph(5e6), cm);
    check_span(exposed.ops[7], 27, 28, "kc waiting for the reduce-scatter");
    check_near(exposed.ops[3].overlapped_us, 6, "the part under kb");
    check_near(exposed.exposed_comm_us, 9, "exposed communication");
    check_near(exposed.makespan_us, 28, "exposed makespan");
    check_near(path_share(exposed, "nccl_reduce_scatter"), 15, "the collective on the critical path");

    // On stream 0 itself a collective is all exposed: ka [1, 12], rs issued 2 -> [12, 27]: 15 us.
    const Timeline inline_rs =
        replay_one({kernel("ka", 0, 10e6), collective("nccl_reduce_scatter", Comm::reduce_scatter, 0, 8e3)}, cm);
    check_near(inline_rs.exposed_comm_us, 15, "a collective on stream 0");
}

// Two ranks, an all-reduce of 8e3 bytes (10 + 2 steps = 12 us + 8e3 x 2/2 / 1e3 = 20 us) on stream 0:
//   rank 0: k 10e6 B [1, 12], all-reduce issued 2, ready 12;  rank 1: k 30e6 B [1, 32], ready 32
//   both start at 32 -> [32, 52]; then k2 (0 B) issued 3 -> [52, 53] on each rank.
// Rank 0's critical path goes through rank 1's kernel: k2 1 + all-reduce 20 + rank 1's k 31 + launch 1.
static void test_two_ranks() {
    const CostModel cm = round_model();
    const std::vector<std::vector<StepOp>> ranks = {
        {kernel("k", 0, 10e6), collective("nccl_all_reduce", Comm::all_reduce, 0, 8e3), kernel("k2", 0, 0)},
        {kernel("k", 0, 30e6), collective("nccl_all_reduce", Comm::all_reduce, 0, 8e3), kernel("k2", 0, 0)}};
    const std::vector<Timeline> tl = replay(ranks, cm);
    for (int r = 0; r < 2; ++r) {
        check_span(tl[r].ops[1], 32, 52, "the all-reduce at the later rank's ready time");
        check_span(tl[r].ops[2], 52, 53, "k2 after the all-reduce");
        check_near(tl[r].makespan_us, 53, "two ranks' makespan");
    }
    check_near(path_share(tl[0], "k"), 31, "rank 0 waits for rank 1's kernel");
    check_near(tl[0].exposed_comm_us, 40, "rank 0: 12 until 52 on stream 0 in the all-reduce");
    check_near(tl[1].exposed_comm_us, 20, "rank 1: only the all-reduce itself");

    // Grouped sends of different sizes on stream 1 (1 step: 11 us, + 2e3 or 6e3 bytes at 1e3 B/us):
    // issued at 1 on both ranks, they last as long as the larger, [1, 18]. An MPI call meets like a
    // collective, after waiting for its rank's device (stream -1): rank 0's ka (9e6 B, issued 2)
    // runs [2, 12], so rank 0 is ready at 18 (stream 1), rank 1 at 18; both leave at 18 + 1 = 19
    // and issue kb at 20 -> [20, 21].
    const std::vector<std::vector<StepOp>> sends = {
        {collective("nccl_send_recv", Comm::send_recv, 1, 2e3), kernel("ka", 0, 9e6), sync(-1, "mpi_wait"),
         kernel("kb", 0, 0)},
        {collective("nccl_send_recv", Comm::send_recv, 1, 6e3), sync(-1, "mpi_wait"), kernel("kb", 0, 0)}};
    const std::vector<Timeline> st = replay(sends, cm);
    check_span(st[0].ops[0], 1, 18, "rank 0's sends last as long as rank 1's");
    check_span(st[1].ops[0], 1, 18, "rank 1's sends");
    check_span(st[0].ops[3], 20, 21, "rank 0 after the MPI call");
    check_span(st[1].ops[2], 20, 21, "rank 1 after the MPI call");
    test::check(st[0].host_syncs == 1 && st[1].launches == 2, "MPI calls count as host syncs");
}

// ---- pricing ----

// GEMMs under round_model(): 100x100 tiles, k = 50: 2*100*100*50 = 1e6 flops = 1 us at an SM's 1e6/us.
static void test_gemm_waves() {
    CostModel cm = round_model();
    const auto us = [&](const StepOp& op) { return device_us(op, cm); };
    check_near(us(gemm("g", 0, 400, 100, 50)), 2, "4 tiles: one wave on 4 SMs, + 1");
    check_near(us(gemm("g", 0, 500, 100, 50)), 3, "5 tiles: two waves");
    check_near(us(gemm("g", 0, 401, 100, 50)), 3, "a ragged edge costs a whole tile");
    check_near(us(gemm("g", 0, 400, 100, 50, 2)), 3, "a batch of 2: 8 tiles, two waves");
    check_near(us(gemm("g", 0, 500, 100, 50, 1, GemmType::fp8)), 2, "fp8 at twice the rate: 2 x 0.5 + 1");
    StepOp heavy = gemm("g", 0, 400, 100, 50);
    heavy.work.bytes_read = 10e6;
    check_near(us(heavy), 11, "memory-bound: 10e6 bytes = 10 us, + 1");
    StepOp shapeless = gemm("g", 0, 400, 100, 50);
    shapeless.work.m = 0;
    check_near(us(shapeless), 2, "no shape: 4e6 flops at 4e6/us, + 1");
    cm.gemm_k_ramp = 50;
    check_near(us(gemm("g", 0, 400, 100, 50)), 3, "k = ramp halves the rate: 2 us, + 1");
    cm.gemm_k_ramp = 0;
    // 100x200 tiles (2e6 flops, 2 us): 500x100 is 5 tiles one way (two waves), 3 the other way (one).
    cm.gemm_tile_n = 200;
    check_near(us(gemm("g", 0, 500, 100, 50)), 3, "the better orientation: one wave of 2 us, + 1");
    cm.gemm_tile_n = 100;
    // Split-K, up to 8: one 100x100 tile with k = 400 takes 0.02 us per unit of K, 8 us on one SM.
    // Split 2: 4 us + 2 x 1e4 fp32 partials written and read (8 x 1e4 x 2 bytes = 0.16 us); split 3:
    // k 134, 2.68 + 0.24; split 4: 2 + 0.32 = 2.32, the best (5 splits take two waves: 3.2 + 0.4).
    cm.gemm_max_split_k = 8;
    check_near(us(gemm("g", 0, 100, 100, 400)), 3.32, "split K four ways: 2.32 + 1");
    check_near(us(gemm("g", 0, 400, 100, 50)), 2, "four tiles fill the SMs: no split");
    cm.gemm_max_split_k = 1;
    // In a replay: the fifth tile shows in the makespan (issued at 1: [1, 3] vs [1, 4]).
    check_near(replay_one({gemm("g", 0, 400, 100, 50)}, cm).makespan_us, 3, "one wave's makespan");
    check_near(replay_one({gemm("g", 0, 500, 100, 50)}, cm).makespan_us, 4, "two waves' makespan");
}

static void test_prices() {
    CostModel cm = round_model();
    // family efficiencies: the longest prefix wins
    cm.hbm_efficiency_by_family = {{"norm_backward", 0.25}, {"norm", 0.5}};
    check_near(device_us(kernel("norm_forward", 0, 1e6), cm), 3, "norm_forward at 0.5: 2 us + 1");
    check_near(device_us(kernel("norm_backward_x", 0, 1e6), cm), 5, "norm_backward at 0.25: 4 us + 1");
    check_near(device_us(kernel("other", 0, 1e6), cm), 2, "the default efficiency");
    check_near(device_us(with_flops(kernel("custom_mma", 0, 0), 3e6, 0), cm), 4,
               "an unknown tensor-core family at 1 TFLOP/s");
    // copies: PCIe by direction (1e6 bytes at 1e3 B/us pinned, half that pageable), d2d through HBM
    StepOp h2d = kernel("copy_h2d", 0, 0);
    h2d.kind = OpKind::copy, h2d.work.bytes_written = 1e6;
    check_near(device_us(h2d, cm), 1000, "pinned upload");
    h2d.work.name = "copy_h2d_pageable";
    check_near(device_us(h2d, cm), 2000, "pageable upload");
    StepOp d2d = kernel("copy_d2d", 0, 1e6);
    d2d.kind = OpKind::copy, d2d.work.bytes_written = 1e6;
    check_near(device_us(d2d, cm), 3, "device copy: 2e6 bytes through HBM + 1");

    // Collectives on 4 GPUs in one node (flat protocol: 10 us + 1 per step, 1e3 B/us):
    //   reduce-scatter 4e3: 10 + 3 + 4e3 x 3/4 / 1e3 = 16
    cm.world_size = 4;
    check_near(collective_us(Comm::reduce_scatter, 4e3, cm), 16, "reduce-scatter, one node");
    // On 2 nodes of 2 (one 0.5 GB/s NIC per node: a bus bandwidth of 500 B/us; 5 us per net step):
    //   reduce-scatter: 3 steps, 1 between nodes: 10 + 2 + 5 = 17, + 3e3 / 500 = 6 -> 23
    //   all-reduce: 6 steps, 2 between nodes: 10 + 4 + 10 = 24, + 4e3 x 6/4 / 500 = 12 -> 36
    //   broadcast: 4 steps, all at the net's latency: 10 + 20 = 30, + 4e3 / 500 = 8 -> 38
    //   send_recv 3e3: 1 net step, 15; 1/3 stays on the node (1e3 / 1e3 = 1 us), 2/3 leave through
    //   the NIC (2e3 / 500 = 4 us): 19
    cm.nodes = 2;
    check_near(collective_us(Comm::reduce_scatter, 4e3, cm), 23, "reduce-scatter across nodes");
    check_near(collective_us(Comm::all_reduce, 4e3, cm), 36, "all-reduce across nodes");
    check_near(collective_us(Comm::all_gather, 4e3, cm), 23, "all-gather across nodes");
    check_near(collective_us(Comm::broadcast, 4e3, cm), 38, "broadcast across nodes");
    check_near(collective_us(Comm::send_recv, 3e3, cm), 19, "sends across nodes");
    // NCCL's choice of protocol: small (2 + 0.5 per step, a quarter of the bandwidth capped at 200
    // B/us) against flat, all-reduce on 2 GPUs: 1e3 B: small 3 + 1e3 / 200 = 8 vs flat 12 + 1 -> 8;
    // 1e5 B: small 3 + 500 vs flat 12 + 100 = 112.
    cm.world_size = 2, cm.nodes = 1;
    cm.nccl_protocols = {{"small", 2, 0.5, 5, 0.25, 0.2}, {"flat", 10, 1, 5, 1.0, 0}};
    check_near(collective_us(Comm::all_reduce, 1e3, cm), 8, "a small all-reduce takes the low-latency protocol");
    check_near(collective_us(Comm::all_reduce, 1e5, cm), 112, "a large one the full bandwidth");
    cm.world_size = 1;
    check_near(collective_us(Comm::all_reduce, 1e5, cm), 1, "one GPU: just a launch");

    // The H100 table itself: a 47 MB bf16 reduce-scatter on 8 GPUs is bandwidth-bound at the
    // Simple protocol: 8.4 + 7 x 3.4 = 32.2 us + 47e6 x 7/8 / 370e3 = 111.16 us.
    const CostModel h = h100_model(8);
    check_near(collective_us(Comm::reduce_scatter, 47e6, h), 32.2 + 47e6 * 7 / 8 / 370e3, "H100 reduce-scatter");
    // A 4 KB all-reduce is latency-bound at LL: 6.6 + 14 x 0.6 = 15 us + 4096 x 14/8 / 141e3.
    check_near(collective_us(Comm::all_reduce, 4096, h), 15 + 4096 * 1.75 / 141e3, "H100 small all-reduce");
    // A large bf16 GEMM at 80% of 989: 8192^3 x 2 flops: 64 x 32 tiles = 2048 = 15.5 waves -> 16.
    const double tile_us = 2.0 * 128 * 256 * 8192 / (989e6 * 0.8 * (8192.0 / (8192 + 128)) / 132);
    check_near(device_us(gemm("g", 0, 8192, 8192, 8192), h), 16 * tile_us + 1, "H100 GEMM");
}

// ---- random graphs: the replayed schedule obeys every rule, constraint by constraint ----

// A random step of `nranks` ranks on up to 3 streams: kernels, GEMMs, copies, event records and
// waits, host syncs, and the same sequence of collectives and MPI calls on every rank.
static std::vector<std::vector<StepOp>> random_step(int nranks) {
    static const char* names[] = {"ka", "kb", "kc", "attention_forward"};
    static const char* comm_names[] = {"nccl_rs", "nccl_ag", "nccl_ar", "nccl_sr"};
    static const Comm comm_kinds[] = {Comm::reduce_scatter, Comm::all_gather, Comm::all_reduce, Comm::send_recv};
    std::vector<StepOp> shared;  // the rendezvous, in order
    for (int i = test::randint(0, 5); i > 0; --i) {
        if (test::randint(0, 4) == 0) {
            shared.push_back(sync(-1, "mpi_wait"));
        } else {
            const int c = test::randint(0, 3);
            shared.push_back(collective(comm_names[c], comm_kinds[c], test::randint(0, 2), test::uniform(0, 1e5)));
        }
    }
    std::vector<std::vector<StepOp>> ranks(nranks);
    for (auto& ops : ranks) {
        size_t next = 0;
        const int n = test::randint(5, 40);
        for (int i = 0; i < n || next < shared.size(); ++i) {
            if (next < shared.size() && test::randint(0, 5) == 0) {
                StepOp c = shared[next++];
                if (c.kind == OpKind::collective && c.work.comm == Comm::send_recv)
                    c.work.comm_bytes = test::uniform(0, 1e5);
                ops.push_back(c);
                continue;
            }
            if (i >= n) continue;
            const int s = test::randint(0, 2), pick = test::randint(0, 9);
            if (pick <= 3)
                ops.push_back(with_flops(kernel(names[pick], s, test::uniform(0, 3e7)), test::uniform(0, 3e7),
                                         test::uniform(0, 1e7)));
            else if (pick == 4)
                ops.push_back(gemm("g", s, test::randint(1, 900), test::randint(1, 900), test::randint(1, 300)));
            else if (pick == 5)
                ops.push_back(record(s, test::randint(0, 3)));
            else if (pick <= 7)
                ops.push_back(wait(s, test::randint(0, 3)));
            else if (pick == 8)
                ops.push_back(sync(test::randint(-1, 2)));
            else {
                StepOp c = kernel(test::randint(0, 1) ? "copy_h2d" : "copy_d2d", s, test::uniform(0, 1e6));
                c.kind = OpKind::copy;
                ops.push_back(c);
            }
        }
    }
    return ranks;
}

// Rebuilds every op's earliest start from the replay's own times of its predecessors and checks
// the replay used exactly that: host times, stream order, event stamps, host waits, collectives
// starting together on every rank at the latest ready time, durations, exposure, overlap.
static void check_schedule(const std::vector<std::vector<StepOp>>& ranks, const std::vector<Timeline>& tl,
                           const CostModel& cm, const std::string& what) {
    const size_t R = ranks.size();
    // per rank, per rendezvous index: the ready time (stream, waits, host) and own duration
    std::vector<std::vector<double>> ready(R), own_dur(R);
    std::vector<std::vector<size_t>> at(R);
    for (size_t r = 0; r < R; ++r) {
        const std::vector<StepOp>& ops = ranks[r];
        std::vector<int> last(3, -1);               // the last device op per stream
        std::vector<double> waits(3, 0), ev(4, 0);  // the latest event waited for since it, per stream; stamps
        std::vector<bool> recorded(4, false);
        double host = 0;
        bool ok = true;
        const auto tail = [&](int s) { return last[s] >= 0 ? tl[r].ops[last[s]].end_us : 0.0; };
        const auto stream_free = [&](int s) { return std::max(tail(s), waits[s]); };
        for (size_t i = 0; i < ops.size(); ++i) {
            const StepOp& op = ops[i];
            const OpTiming& t = tl[r].ops[i];
            ok = ok && near(t.host_begin_us, host);
            host += host_cost_us(op.kind, cm);  // host syncs and MPI calls: 0, they wait instead
            if (op.kind != OpKind::host_sync) ok = ok && near(t.host_end_us, host);
            if (is_device_op(op.kind)) {
                const double own = std::max(tail(op.stream), host);  // what delays it beyond this is another stream
                const double earliest = std::max(stream_free(op.stream), host);
                if (op.kind == OpKind::collective) {
                    ready[r].push_back(earliest), own_dur[r].push_back(device_us(op, cm)), at[r].push_back(i);
                } else {
                    ok = ok && near(t.start_us, earliest) && near(t.end_us - t.start_us, device_us(op, cm));
                    const double exposed = op.stream == 0 ? std::max(0.0, t.start_us - own) : 0;
                    ok = ok && near(t.exposed_comm_us, exposed);
                }
                if (op.kind == OpKind::collective && op.stream == 0) ok = ok && near(t.exposed_comm_us, t.end_us - own);
                last[op.stream] = int(i);
                waits[op.stream] = 0;
            } else if (op.kind == OpKind::event_record) {
                ev[op.event] = stream_free(op.stream), recorded[op.event] = true;
                ok = ok && near(t.end_us, ev[op.event]);
            } else if (op.kind == OpKind::event_wait) {
                if (recorded[op.event]) waits[op.stream] = std::max(waits[op.stream], ev[op.event]);
            } else {  // host_sync, and MPI calls (checked against the other ranks below)
                double target = host;
                for (int s = 0; s < 3; ++s)
                    if (op.stream < 0 || op.stream == s) target = std::max(target, stream_free(s));
                if (is_mpi_call(op)) {
                    ready[r].push_back(target), own_dur[r].push_back(0), at[r].push_back(i);
                    host = t.host_end_us;  // the common leave time, checked below
                } else {
                    host = target + cm.host_sync_us;
                    ok = ok && near(t.host_end_us, host);
                }
            }
        }
        test::check(ok, "%s: rank %zu's ops do not start at their constraints", what.c_str(), r);
        // the makespan: the host and every stream done
        double end = host;
        for (int s = 0; s < 3; ++s) end = std::max(end, stream_free(s));
        check_near(tl[r].makespan_us, end, (what + ": makespan").c_str());
        double path = 0;
        for (const PathShare& p : tl[r].critical_path) path += p.us;
        check_near(path, tl[r].makespan_us, (what + ": the critical path adds up to the makespan").c_str());
    }
    bool ok = true;
    for (size_t k = 0; k < at[0].size(); ++k) {
        double start = 0, dur = 0;
        for (size_t r = 0; r < R; ++r) start = std::max(start, ready[r][k]), dur = std::max(dur, own_dur[r][k]);
        for (size_t r = 0; r < R; ++r) {
            const OpTiming& t = tl[r].ops[at[r][k]];
            if (ranks[r][at[r][k]].kind == OpKind::collective)
                ok = ok && near(t.start_us, start) && near(t.end_us, start + dur);
            else
                ok = ok && near(t.start_us, start) && near(t.host_end_us, start + cm.mpi_us);
        }
    }
    test::check(ok, "%s: collectives and MPI calls do not meet at the latest rank", what.c_str());
    // overlap, by brute force over stream 0's compute
    for (size_t r = 0; r < R; ++r) {
        bool overlap_ok = true;
        for (size_t i = 0; i < ranks[r].size(); ++i) {
            if (ranks[r][i].kind != OpKind::collective) continue;
            double sum = 0;
            for (size_t j = 0; j < ranks[r].size(); ++j)
                if (ranks[r][j].stream == 0 && is_device_op(ranks[r][j].kind) && ranks[r][j].kind != OpKind::collective)
                    sum += std::max(0.0, std::min(tl[r].ops[i].end_us, tl[r].ops[j].end_us) -
                                             std::max(tl[r].ops[i].start_us, tl[r].ops[j].start_us));
            overlap_ok = overlap_ok && near(tl[r].ops[i].overlapped_us, sum);
        }
        test::check(overlap_ok, "%s: rank %zu's overlap", what.c_str(), r);
    }
}

static void test_random_graphs() {
    CostModel cm = round_model();
    cm.host_event_us = 0.25;
    for (int trial = 0; trial < 200; ++trial) {
        const int nranks = test::randint(1, 3);
        cm.world_size = nranks;
        const auto ranks = random_step(nranks);
        check_schedule(ranks, replay(ranks, cm), cm, "random graph " + std::to_string(trial));
    }
}

// ---- upstream's schedule ----

static std::vector<StepOp> gather_under_next_step(bool joined);
static void test_upstream_schedule() {
    const CostModel cm = round_model();
    // fa3: 8e6 tensor-core flops at 2 TFLOP/s (ours, 4 us) or FA3's 4 (2 us), + 1
    const StepOp attn = with_flops(kernel("attention_forward", 0, 0), 8e6, 0);
    const std::vector<StepOp> fa3 = upstream_schedule({attn});
    test::check(std::string(fa3[0].work.name) == "fa3_attention_forward", "renamed %s", fa3[0].work.name);
    check_near(device_us(attn, cm), 5, "our attention");
    check_near(device_us(fa3[0], cm), 3, "FA3's attention");

    // c_fc forward: a tensor-core kernel at the default 1 TFLOP/s (4 us for 4e6 flops), upstream
    // a GEMM of its shape: 400x100x50, one wave of 1 us, + 1.
    StepOp fc = with_flops(kernel("linear_relu_square_forward", 0, 0), 4e6, 0);
    fc.work.m = 400, fc.work.n = 100, fc.work.k = 50;
    check_near(device_us(fc, cm), 5, "our c_fc kernel at the default rate");
    const StepOp up_fc = upstream_schedule({fc})[0];
    test::check(std::string(up_fc.work.name) == "triton_linear_relu_square_forward", "renamed %s", up_fc.work.name);
    check_near(device_us(up_fc, cm), 2, "upstream's c_fc as a GEMM");

    // The ReLU^2 backward folds into the 100x50 GEMM before it (1e4 bytes of bf16 output): the
    // GEMM reads pre's 1e4 bytes too. Not after a GEMM on its stream, or of another size: kept.
    StepOp relu = kernel("relu_square_backward", 0, 2e4);
    relu.work.bytes_written = 1e4;
    const std::vector<StepOp> ours = {gemm("gemm_dpre", 0, 100, 50, 10),
                                      kernel("other_stream", 1, 5),
                                      relu,
                                      kernel("k", 0, 0),
                                      relu,
                                      gemm("gemm_other", 0, 10, 10, 10),
                                      relu};
    const std::vector<StepOp> up = upstream_schedule(ours);
    test::check(up.size() == 6 + 2, "two of three relu_square_backward kept (and stream 1 joined at the end): %zu ops",
                up.size());
    check_near(up[0].work.bytes_read, 1e4, "the dpre GEMM reads pre");
    test::check(std::string(up[3].work.name) == "relu_square_backward" && std::string(up[4].work.name) == "gemm_other",
                "the unfused ones stay in place");

    // Our fused loss backward becomes upstream's two passes: the loss backward as recorded (its 3e4
    // bytes read, 2e4 written), then a quantization reading and writing those 2e4 bytes.
    StepOp fused_loss = kernel("softcap_mtp_loss_backward_fp8", 0, 0);
    fused_loss.work.bytes_read = 3e4, fused_loss.work.bytes_written = 2e4;
    const std::vector<StepOp> fused = {kernel("k", 0, 0), fused_loss};
    const std::vector<StepOp> split = upstream_schedule(fused);
    test::check(split.size() == 3, "the fused loss backward becomes two ops: %zu", split.size());
    // record 80's upstream code writes e5m2 from its loss kernel too: no rule splits it, none names the family
    const UpstreamCode r80{UpstreamLoss::fused_e5m2};
    const std::vector<StepOp> kept = upstream_schedule(fused, r80);
    test::check(kept.size() == 2 && std::string(kept[1].work.name) == "softcap_mtp_loss_backward_fp8",
                "record 80's upstream keeps the fused loss backward: %zu ops", kept.size());
    test::check(missing_rule_family({kernel("attention_forward", 0, 0), kernel("attention_backward", 0, 0),
                                     kernel("linear_relu_square_forward", 0, 0), kernel("linear_relu_square_backward", 0, 0)},
                                    r80).empty() &&
                    !missing_rule_family({kernel("attention_forward", 0, 0), kernel("attention_backward", 0, 0),
                                          kernel("linear_relu_square_forward", 0, 0),
                                          kernel("linear_relu_square_backward", 0, 0)}).empty(),
                "record 80's rules need no loss family; record 71's do");
    if (split.size() == 3) {
        test::check(std::string(split[1].work.name) == "softcap_mtp_loss_backward" &&
                        std::string(split[2].work.name) == "quantize_fp8_two_layouts",
                    "named %s then %s", split[1].work.name, split[2].work.name);
        check_near(split[1].work.bytes_read, 3e4, "the loss pass reads what ours reads");
        check_near(split[2].work.bytes_read, 2e4, "the quantization reads the bf16 gradient");
        check_near(split[2].work.bytes_written, 2e4, "and writes both e5m2 layouts");
        test::check(split[2].stream == 0, "on the loss's stream");
    }

    // Collectives inside the backward move after it, behind a new event (here 2):
    //   ours:     fwd [1, 2]; bwd1 10e6 B issued 2 -> [2, 13]; rec e0 s0 (13); s1 waits e0;
    //             rs s1 issued 3 -> [13, 28]; bwd2 30e6 B issued 4 -> [13, 44]; rec e1 s1 (28);
    //             s0 waits e1; opt issued 5 -> [44, 45]: makespan 45, the reduce-scatter hidden
    //   upstream: bwd2 issued 3 -> [13, 44]; rec e2 s0 (44); rs issued 4 waits for it: [44, 59];
    //             opt issued 5 -> [59, 60]: makespan 60
    const std::vector<StepOp> step = {
        kernel("fwd", 0, 0, "forward"),
        kernel("bwd1", 0, 10e6, "backward/layer 1"),
        record(0, 0),
        wait(1, 0),
        collective("nccl_reduce_scatter", Comm::reduce_scatter, 1, 8e3, "backward/layer 1"),
        kernel("bwd2", 0, 30e6, "backward/layer 0"),
        record(1, 1),
        wait(0, 1),
        kernel("opt", 0, 0, "optimizer")};
    std::vector<StepOp> tagged = step;
    tagged[2].range = tagged[3].range = "backward/layer 1";
    const std::vector<StepOp> moved = upstream_schedule(tagged);
    // fwd, bwd1, rec e0, bwd2, rec e2 s0, wait e2 s1, wait e0 s1, rs, rec e1, wait e1, opt
    const std::vector<std::pair<OpKind, int>> want = {
        {OpKind::kernel, 0},       {OpKind::kernel, 0},     {OpKind::event_record, 0}, {OpKind::kernel, 0},
        {OpKind::event_record, 0}, {OpKind::event_wait, 1}, {OpKind::event_wait, 1},   {OpKind::collective, 1},
        {OpKind::event_record, 1}, {OpKind::event_wait, 0}, {OpKind::kernel, 0}};
    bool order = moved.size() == want.size();
    for (size_t i = 0; order && i < want.size(); ++i)
        order = moved[i].kind == want[i].first && moved[i].stream == want[i].second;
    test::check(order, "comms after the backward: %zu ops in the wrong order", moved.size());
    test::check(moved.size() == want.size() && moved[4].event == 2 && moved[5].event == 2 && moved[6].event == 0,
                "a new event behind the backward");
    check_near(replay_one(tagged, cm).makespan_us, 45, "ours: the reduce-scatter under bwd2");
    check_near(replay_one(moved, cm).makespan_us, 60, "upstream's: the reduce-scatter after the backward");

    // Nothing to change: the same ops, field by field (the collective is outside the backward).
    const std::vector<StepOp> plain = {kernel("embed", 0, 4),
                                       gemm("gemm_x", 0, 10, 10, 10),
                                       record(0, 0),
                                       wait(1, 0),
                                       collective("nccl_all_gather", Comm::all_gather, 1, 64, "optimizer"),
                                       record(1, 1),
                                       wait(0, 1),
                                       sync(-1)};
    const std::vector<StepOp> same = upstream_schedule(plain);
    bool identical = same.size() == plain.size();
    for (size_t i = 0; identical && i < plain.size(); ++i)
        identical = same[i].kind == plain[i].kind && same[i].stream == plain[i].stream &&
                    same[i].event == plain[i].event && same[i].work.name == plain[i].work.name &&
                    same[i].work.bytes_read == plain[i].work.bytes_read && same[i].work.gemm == plain[i].work.gemm &&
                    same[i].range == plain[i].range;
    test::check(identical, "a recording without upstream's differences is unchanged");

    // A gather the next forward waits for only where it reads it (gather_under_next_step) is joined at
    // the step's end under upstream's schedule: a record of a new event on stream 1 and stream 0's wait
    // on it, last; in steady state that is the joined step (37 us, 15 exposed), and a joined step stays.
    const std::vector<StepOp> free_gather = gather_under_next_step(false), joined = gather_under_next_step(true);
    const std::vector<StepOp> up_free = upstream_schedule(free_gather);
    test::check(up_free.size() == free_gather.size() + 2 && up_free[up_free.size() - 2].kind == OpKind::event_record &&
                    up_free[up_free.size() - 2].stream == 1 && up_free.back().kind == OpKind::event_wait &&
                    up_free.back().stream == 0 && up_free.back().event == up_free[up_free.size() - 2].event,
                "gathers joined: stream 1's work joined to stream 0 at the step's end");
    const Timeline t = replay_steady({{up_free}, {up_free}, {up_free}, {up_free}}, 2, cm)[0];
    check_near(t.makespan_us, 37, "gathers joined: upstream's step waits for the whole gather");
    check_near(t.exposed_comm_us, 15, "gathers joined: all of it exposed");
    test::check(upstream_schedule(joined).size() == joined.size(), "a step already joined gets no second join");
}

// A rule whose family a training step's recording lacks (a renamed kernel) is refused, naming the rule
// and the family, instead of leaving the recording unchanged; every family a rule names is needed.
static void test_upstream_rule_families() {
    const std::vector<StepOp> step = {
        kernel("attention_forward", 0, 0), kernel("linear_relu_square_forward", 0, 0),
        kernel("softcap_mtp_loss_backward_fp8", 0, 0), kernel("linear_relu_square_backward", 0, 0),
        kernel("attention_backward", 0, 0)};
    test::check(missing_rule_family(step).empty(), "a step with every rule's family: %s",
                missing_rule_family(step).c_str());
    int needed = 0;
    for (const ScheduleRule& r : upstream_rules())
        for (const char* family : r.needs) {
            ++needed;
            std::vector<StepOp> renamed = step;
            for (StepOp& op : renamed)
                if (std::string(op.work.name) == family) op.work.name = "renamed_kernel";
            const std::string want = std::string("rule ") + r.name + " acts on " + family;
            test::check(missing_rule_family(renamed) == want, "%s renamed: got \"%s\"", family,
                        missing_rule_family(renamed).c_str());
        }
    test::check(needed == int(step.size()), "the step holds one op per needed family (%d needed)", needed);

    // In a plan: the stage, step kind and rank that lack it.
    std::vector<StepOp> renamed = step;
    renamed[2].work.name = "softcap_loss_backward_fp8";
    const std::vector<PlanStage> good = {{"stage 0", 1, 1, 0, {step, step}, {step, step}, {}}};
    const std::vector<PlanStage> bad = {{"stage 0", 1, 1, 0, {step, step}, {step, renamed}, {}}};
    test::check(upstream_schedule_error(good).empty(), "a plan with every family: %s",
                upstream_schedule_error(good).c_str());
    check_says(upstream_schedule_error(bad),
               "--schedule upstream: rule separate_loss_quantization acts on softcap_mtp_loss_backward_fp8, and stage "
               "0's adam step (rank 1) records none",
               "the plan's error names the rule, the family, the stage, the step and the rank");
}

// ---- the steady state: steps back to back, events across them ----

// A step whose gather (c, 15 us on stream 1) the next step's second kernel waits for, its first
// kernel free to run under it: W = k0 s0 (11 us), s0 waits e5, k1 s0 (11 us), record e4 on s0, s1
// waits e4, c on s1, record e5 on s1. Alone: k0 [1, 12], the wait a no-op (e5 unrecorded), k1 [12,
// 23], c [23, 38]: 38 us. Four in a row (host far ahead), reporting the third:
//   step 0 as alone, ends 38; step 1: k0 [23, 34], k1 waits for e5 (38): [38, 49], c [49, 64];
//   step 2: k0 [49, 60], k1 [64, 75] (stream 0 idle [60, 64], in step 1's window), c [75, 90];
//   step 3: k0 [75, 86], k1 [90, 101]: idle [86, 90], inside step 2's window [64, 90].
// Step 2 takes 26 us (k0 under the step before's c), 4 us exposed; k1 runs [0, 11] of it. Reporting
// the last of three instead misses that idle (nothing waits for its c). With the gather joined at the
// step's end (J: the wait moved after the record), the next step's k0 waits for all of c: 37 us, 15
// exposed.
static std::vector<StepOp> gather_under_next_step(bool joined) {
    std::vector<StepOp> w = {kernel("k0", 0, 10e6), wait(0, 5),
                             kernel("k1", 0, 10e6), record(0, 4),
                             wait(1, 4),            collective("nccl_all_gather", Comm::all_gather, 1, 8e3),
                             record(1, 5)};
    if (joined) w.erase(w.begin() + 1), w.push_back(wait(0, 5));
    return w;
}
static void test_steady_state() {
    const CostModel cm = round_model();
    const std::vector<StepOp> w = gather_under_next_step(false), j = gather_under_next_step(true);
    check_near(replay_one(w, cm).makespan_us, 38, "one step alone");
    const std::vector<Timeline> st = replay_steady({{w}, {w}, {w}, {w}}, 2, cm);
    check_near(st[0].makespan_us, 26, "steady state: the gather under the next step's first kernel");
    check_near(st[0].exposed_comm_us, 4, "steady state: the next step's wait inside this step's window");
    check_span(st[0].ops[2], 0, 11, "steady state: k1 from the window's start");
    check_span(st[0].ops[0], -15, -4, "steady state: k0 under the step before");
    test::check(st[0].launches == 3, "steady state: the step's own launches: %d", st[0].launches);
    check_near(replay_steady({{w}, {w}, {w}}, 2, cm)[0].exposed_comm_us, 0, "the last step: no later wait seen");
    const Timeline jt = replay_steady({{j}, {j}, {j}, {j}}, 2, cm)[0];
    check_near(jt.makespan_us, 37, "steady state, gather joined at the end");
    check_near(jt.exposed_comm_us, 15, "steady state, gather joined: all of it exposed");
    test::check_fails_with("a report past the steps", "step_model: replay_steady: no step 4",
                           [&] { replay_steady({{w}}, 4, cm); });

    // Two ranks held together by a reduce-scatter on stream 0 (15 us): rank 0's kernel [1, 2], rank
    // 1's [1, 12]; the collective runs [12, 27] on both, so both take 27 us. Rank 0 waited from 2:
    // 25 us "exposed", 10 of them for rank 1's work; rank 1, whom it waited for, 15. The step reports
    // rank 1.
    const StepOp rs = collective("nccl_reduce_scatter", Comm::reduce_scatter, 0, 8e3);
    const ModeledStep held = model_step("held", {{{kernel("k", 0, 0), rs}, {kernel("k", 0, 10e6), rs}}}, 0, cm);
    test::check(held.rank == 1, "of ranks finishing together, the one waited for: got rank %d", held.rank);
    check_near(held.exposed_comm_ms, 0.015, "its exposed communication, without the other's imbalance");
}

// ---- bad recordings and plans ----

static void test_errors() {
    const std::vector<StepOp> a = {collective("nccl_all_reduce", Comm::all_reduce, 1, 8),
                                   collective("nccl_all_gather", Comm::all_gather, 1, 8)};
    std::vector<StepOp> b = a;
    b[1] = collective("nccl_reduce_scatter", Comm::reduce_scatter, 1, 8);
    check_says(recording_error({a, a, b}),
               "call 1 differs: rank 0 issues nccl_all_gather, rank 2 issues nccl_reduce_scatter",
               "mismatched collectives");
    check_says(recording_error({a, {a[0]}}), "rank 0 issues 2 collectives and MPI calls, rank 1 issues 1",
               "a missing one");
    test::check(recording_error({a, a}).empty(), "matching ranks are fine");
    check_says(recording_error({}), "no ranks", "no ranks");
    check_says(recording_error({{kernel("ok", 0, 1), kernel("k", 0, -1)}}),
               "rank 0, operation 1 (k): a FLOP or byte count is negative", "negative bytes");
    check_says(recording_error({{kernel("k", -1, 1)}}), "stream -1 (only a host_sync", "a kernel on stream -1");
    check_says(recording_error({{wait(0, -1)}}), "an event operation without an event", "an event op without an event");
    check_says(recording_error({{collective("c", Comm::none, 0, 1)}}), "a collective without a kind", "Comm::none");
    test::check_fails_with("replay of mismatched ranks", "step_model: collective/MPI call 1 differs", [&] {
        replay({a, b}, round_model());
    });
    check_says(replay_error({a, a, a}, round_model()), "3 ranks recorded, but the model is for 2 GPUs",
               "ranks vs GPUs");
    test::check(replay_error({a}, round_model()).empty(), "one rank may stand for every GPU");

    const CostModel cm = round_model();
    PlanStage s{"s1", 2, 1, 0, {three_kernels()}, {}, {}};
    check_says(plan_error({s}, cm), "stage s1, adam step: 1 steps but no recording", "a missing recording");
    s.adam = {a, b};
    check_says(plan_error({s}, cm), "stage s1, adam step: collective/MPI call 1 differs", "a bad recording");
    s.adam = {three_kernels()}, s.steps_even = -1;
    check_says(plan_error({s}, cm), "stage s1, even step: a negative step count (-1)", "a negative count");
    test::check_fails_with("plan_report of a bad plan", "step_model: stage s1, even step: a negative step count",
                           [&] { plan_report("p", "ours", {s}, cm); });
    test::check_fails_with("a model that does not split", "6 GPUs do not split evenly over 4 nodes",
                           [] { h100_model(6, 4); });
    check_says(write_plan_json("/nonexistent-dir/plan.json", PlanReport{}), "cannot write /nonexistent-dir/plan.json",
               "an unwritable path");
}

// ---- the plan: totals, JSON and trace parsed back ----

// Each step in steady state (replay_steady): the host issues a step's first op while the step before
// still runs, so the first launch (1 us) is off every step's time. Stage s1: 3 even steps of
// three_kernels() (36 us) and 2 Adam steps of comms_graph(5e6) (27 us): 108 + 54 = 162 us. Stage s2:
// 1 even step of two_streams() (18 us), no Adam step, 1 untie step of host_sync_graph() (14 us): 32
// us. Whole run 194 us = 0.194 ms.
// s2 has no Adam step: its "kernels" are the even step's, slowest first: ka 11 us, kb 5, kc 3, kd 2.
// Trace events ("X"): per step and rank, the step's span, one host event per op and one per
// device op: three_kernels 1+3+3 = 7, comms_graph 1+8+4 = 13, two_streams 1+8+4 = 13,
// host_sync_graph 1+3+2 = 6: 39. The steps sit 100 us apart: s1 even at 0, s1 adam at 136, s2 even
// at 136 + 27 + 100 = 263, s2 untie at 381; s2 even (two_streams() after two of its own, ending at 37)
// runs kb [48, 53] on stream 1 (tid 2), 11 us into the step: ts 274.
static void test_plan(const char* python, const char* checker) {
    const CostModel cm = round_model();
    const std::vector<PlanStage> stages = {{"s1", 3, 2, 0, {three_kernels()}, {comms_graph(5e6)}, {}},
                                           {"s2", 1, 0, 1, {two_streams()}, {}, {host_sync_graph()}}};
    const PlanReport p = plan_report("tiny", "ours", stages, cm);
    check_near(p.total_ms, 0.194, "the whole run");
    check_near(p.stages[0].total_ms, 0.162, "stage s1");
    check_near(p.stages[1].untie.ms, 0.014, "s2's untie step");
    test::check(p.stages[0].adam.collectives.size() == 1 && near(p.stages[0].adam.collectives[0].overlapped_ms, 0.006),
                "s1's Adam collectives");
    test::check(p.stages[0].even.kernels.size() == 3 && p.stages[0].even.kernels[0].name == "k2" &&
                    near(p.stages[0].even.kernels[0].flops, 20e6) && near(p.stages[0].even.kernels[0].bytes, 5e6),
                "s1's even families, slowest first");
    const std::string text = format_plan(p);
    check_says(text, "whole run: 7 steps, 0.000 s", "the text report's total");
    // host_sync_graph() after two_streams(): ka 11, kb's launch 1 (ka's is under the step before), the
    // sync 1, kb 1
    check_says(text, "s2 untie: critical path (ms): ka 0.011, host_launch 0.001, host_sync 0.001, kb 0.001",
               "the text report's critical paths");
    const PlanReport up = plan_report("tiny", "upstream", upstream_schedule(stages), cm);
    const std::string cmp = format_schedule_comparison(p, up);
    for (const ScheduleRule& r : upstream_rules())
        check_says(cmp, (std::string(r.name) + ": ").c_str(), "a rule named");
    // s1's even step has attention_forward (6e6 flops): 3 us ours, 1.5 us at FA3's 4 TFLOP/s -> 34.5 us.
    check_near(up.stages[0].even.ms, 0.0345, "upstream's s1 even step");

    if (!python) {
        std::printf("the JSON checks need the Python interpreter and checker as arguments: skipped\n");
        return;
    }
    char dir[] = "/tmp/test_step_model_XXXXXX";
    if (!test::check(mkdtemp(dir) != nullptr, "cannot make a scratch directory")) return;
    const std::string plan = std::string(dir) + "/plan.json", trace = std::string(dir) + "/trace.json";
    test::check(write_plan_json(plan, p).empty() && write_chrome_trace(trace, p).empty(), "writing the JSON files");
    const std::string want_plan =
        R"({"preset": "tiny", "world_size": 2, "total_ms": 0.194, "stages": [)"
        R"({"stage": "s1", "even_ms": 0.036, "adam_ms": 0.027, "untie_ms": null,)"
        R"( "exposed_comm_even_ms": 0, "exposed_comm_adam_ms": 0.009,)"
        R"( "launches_even": 3, "launches_adam": 4, "host_syncs_in_step": 0},)"
        R"({"stage": "s2", "even_ms": 0.018, "adam_ms": 0, "untie_ms": 0.014, "exposed_comm_even_ms": 0.002,)"
        R"( "launches_even": 4, "launches_adam": 0,)"
        R"( "kernels": [{"name": "ka", "count": 1, "bytes": 10e6, "modeled_ms": 0.011},)"
        R"( {"name": "kb"}, {"name": "kc"}, {"name": "kd"}],)"
        R"( "collectives": []}]})";
    const std::string want_trace =
        R"({"x_events": 39, "find": [{"name": "kb", "pid": 0, "tid": 2, "ts": 274, "dur": 5}]})";
    const std::string cmd =
        std::string(python) + " " + checker + " " + plan + " '" + want_plan + "' " + trace + " '" + want_trace + "'";
    std::fflush(stdout);
    const int rc = std::system(cmd.c_str());
    test::check(rc == 0, "the Python JSON check failed (exit %d): %s", rc, cmd.c_str());
    std::remove(plan.c_str()), std::remove(trace.c_str()), rmdir(dir);
}

// ---- calibration: a file of measured rates replaces the defaults, and says so ----
// Under round_model() a memory-bound kernel of 1e6 bytes takes 1 us + 1 of launch at hbm_efficiency 1:
// measured at 0.25 it takes 4 + 1; a tensor-core family measured at 0.5 TFLOP/s takes 3e6 / 0.5e6 =
// 6 us + 1 (its default, 2 TFLOP/s: 1.5 + 1). Each malformed file must be refused naming what is wrong.
static void test_calibration() {
    const std::string good = R"({"made_by": "gpu_check.sh --calibrate", "card": "H100",
        "rates": {"hbm_efficiency": {"value": 0.25, "report": "docs/gpu-runs/run-a/report.md"},
                  "tc_tflops.attention_forward": {"value": 0.5, "report": "docs/gpu-runs/run-b/report.md"},
                  "hbm_efficiency_by_family.embed": {"value": 0.5, "report": "docs/gpu-runs/run-b/report.md"}}})";
    CostModel cm = round_model();
    const StepOp copy_like = kernel("rmsnorm_forward", 0, 1e6), embed = kernel("embedding_gather", 0, 1e6),
                 attention = with_flops(kernel("attention_forward", 0, 0), 3e6, 0);
    check_near(device_us(copy_like, cm), 2, "uncalibrated: 1e6 bytes at 1 TB/s + 1");
    check_near(device_us(attention, cm), 2.5, "uncalibrated: 3e6 flops at 2 TFLOP/s + 1");
    test::check(calibration_summary(cm).find("none measured") != std::string::npos, "uncalibrated: says none measured");
    const std::string e = apply_calibration(cm, good, "planted.json");
    test::check(e.empty(), "a good calibration file is refused: %s", e.c_str());
    check_near(device_us(copy_like, cm), 5, "hbm_efficiency measured at 0.25: 4 us + 1");
    check_near(device_us(embed, cm), 3, "embed's family measured at 0.5: 2 us + 1");
    check_near(device_us(attention, cm), 7, "attention_forward measured at 0.5 TFLOP/s: 6 us + 1");
    // the makespan follows (one stream, host issue at 1): 1 + 5 + 7
    check_near(replay_one({copy_like, attention}, cm).makespan_us, 13, "a replay prices with the measured rates");
    const std::string summary = calibration_summary(cm);
    for (const char* phrase : {"constants measured (planted.json)", "hbm_efficiency", "0.25 (default 1)",
                               "from docs/gpu-runs/run-a/report.md", "tc_tflops.attention_forward",
                               "0.5 (default 2) from docs/gpu-runs/run-b/report.md", "the rest"})
        check_says(summary, phrase, "the summary of a calibrated model");
    test::check(cm.measured.size() == 3, "three constants measured, got %zu", cm.measured.size());
    // a second file naming an existing family entry replaces it rather than adding a shadowed one
    const size_t entries = cm.tc_tflops.size();
    test::check(apply_calibration(cm, R"({"rates": {"tc_tflops.attention_forward": {"value": 3, "report": "r"}}})",
                                  "again.json").empty(), "recalibrating a family");
    test::check(cm.tc_tflops.size() == entries, "recalibrating a family adds no entry");
    check_near(device_us(attention, cm), 2, "attention_forward at 3 TFLOP/s: 1 us + 1");

    const struct {
        const char* text;
        const char* phrase;
    } bad[] = {
        {R"({"rates": {"hbm_efficency": {"value": 0.5, "report": "r"}}})", "unknown constant \"hbm_efficency\""},
        {R"({"rates": {"hbm_efficiency": {"value": 1.5, "report": "r"}}})", "an efficiency of 1.5"},
        {R"({"rates": {"hbm_tbs": {"value": -3, "report": "r"}}})", "is not positive"},
        {R"({"rates": {"hbm_tbs": {"value": "fast", "report": "r"}}})", "no numeric \"value\" (got \"fast\")"},
        {R"({"rates": {"hbm_tbs": {"value": 3}}})", "no \"report\" naming the run"},
        {R"({"rates": {"hbm_tbs": 3}})", "want {\"value\": number"},
        {R"({"rates": {}})", "names no constant"},
        {R"({"rate": {}})", "no \"rates\" object"},
        {R"([1, 2])", "an array, where no calibration entry takes one"},
        {R"("rates")", "not a JSON object"},
        {"{\"rates\": {\"hbm_tbs\": {\"value\": 3, \"report\": \"r\"}\n", "line 2: ',' or '}' expected"},
        {R"({"rates": {"hbm_tbs": {"value": 3, "report": "r"}, "hbm_tbs": {"value": 3, "report": "r"}}})",
         "\"hbm_tbs\" given twice"},
        {R"({"rates": {"hbm_tbs": {"value": 3, "report": "r"}}} x)", "text after the JSON value"},
    };
    for (const auto& b : bad) {
        CostModel m = round_model();
        const std::string err = apply_calibration(m, b.text, "bad.json");
        check_says(err, b.phrase, b.text);
        check_says(err, "calibration bad.json: ", "the file named");
        test::check(m.measured.empty() && m.hbm_tbs == 1 && m.hbm_efficiency == 1,
                    "a refused file leaves the model as it was (%s)", b.text);
    }
    CostModel m = round_model();
    check_says(load_calibration(m, "/nonexistent/calibration.json"), "cannot be read", "a missing file");
    std::printf("calibration: measured rates replace the defaults and are named; %zu malformed files refused\n",
                sizeof bad / sizeof bad[0]);
}

int main(int argc, char** argv) {
    test::seed();
    test_one_stream();
    test_event_wait();
    test_host_sync();
    test_collective_overlap();
    test_two_ranks();
    test_gemm_waves();
    test_prices();
    test_random_graphs();
    test_upstream_schedule();
    test_upstream_rule_families();
    test_steady_state();
    test_errors();
    test_calibration();
    test_plan(argc > 2 ? argv[1] : nullptr, argc > 2 ? argv[2] : nullptr);
    return test::finish();
}
