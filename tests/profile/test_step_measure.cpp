// profiler/step_measure.h, what --profile-steps makes of measured times, on hand-made timed steps whose
// answers are worked out in the comments: families (counts, time, an NCCL group's shares, work),
// the device span, and exposed communication (a wait that idles stream 0, one that does not, two
// waits in one gap, a collective on stream 0, a record with no timed op before it, a wait on
// another stream).
#include "profiler/step_measure.h"

#include <cmath>
#include <cstdio>
#include <cstring>

static int failures = 0, checks = 0;
static void check_near(double got, double want, const char* what) {
    ++checks;
    if (std::fabs(got - want) > 1e-9 * std::max(1.0, std::fabs(want))) {
        ++failures;
        std::printf("FAIL %s: got %.9g, want %.9g\n", what, got, want);
    }
}

// A builder: ops appended with their times (-1: untimed).
struct Steps {
    TimedStep t;
    Steps& op(OpKind kind, int stream, int event, Work w, double start = -1, double end = -1, double share = 1) {
        t.ops.push_back({kind, stream, event, w, ""});
        t.start_ms.push_back(start);
        t.end_ms.push_back(end);
        t.share.push_back(share);
        return *this;
    }
    Steps& kernel(int stream, const char* name, double start, double end, double bytes = 0) {
        return op(OpKind::kernel, stream, -1, Work{.name = name, .bytes_read = bytes}, start, end);
    }
    Steps& collective(int stream, const char* name, double start, double end, double share = 1) {
        return op(OpKind::collective, stream, -1, Work{.name = name, .comm = Comm::all_reduce, .comm_bytes = 100}, start,
                  end, share);
    }
    Steps& record(int stream, int event) { return op(OpKind::event_record, stream, event, Work{.name = "event_record"}); }
    Steps& wait(int stream, int event) { return op(OpKind::event_wait, stream, event, Work{.name = "event_wait"}); }
};

static const MeasuredFamily* family(const std::vector<MeasuredFamily>& f, const char* name) {
    for (const MeasuredFamily& m : f)
        if (m.name == name) return &m;
    return nullptr;
}

int main() {
    // Stream 0 computes a (0-10); stream 1 waits for it and reduces (12-30), recording e1; stream 0
    // runs b (11-15) meanwhile, then waits for e1 and runs c (31-40). Stream 0 idles from b's end (15)
    // until e1 completes (30): exposed 15. The device span: 0 to 40.
    {
        Steps s;
        s.kernel(0, "a", 0, 10).record(0, 0).wait(1, 0).collective(1, "nccl_all_reduce", 12, 30).record(1, 1);
        s.kernel(0, "b", 11, 15).wait(0, 1).kernel(0, "c", 31, 40);
        check_near(exposed_comm_ms(s.t), 15, "an exposed reduction");
        check_near(device_ms(s.t), 40, "the device span");
    }
    // The same, but the reduction ends (20) before b does (25): stream 0 never idles for it.
    {
        Steps s;
        s.kernel(0, "a", 0, 10).record(0, 0).wait(1, 0).collective(1, "nccl_all_reduce", 12, 20).record(1, 1);
        s.kernel(0, "b", 11, 25).wait(0, 1).kernel(0, "c", 26, 40);
        check_near(exposed_comm_ms(s.t), 0, "an overlapped reduction");
        check_near(tail_after_stream0_ms(s.t), 0, "nothing after stream 0's last op");
        s.collective(1, "nccl_all_gather", 38, 47);  // a gather left running after c (ends 40)
        check_near(tail_after_stream0_ms(s.t), 7, "a gather after stream 0's last op");
    }
    // Two waits in one gap (e1 ready at 30, e2 at 35) before c (starts 36) after b (ends 15): the gap
    // counts once, to the later event: 35 - 15 = 20 (not 15 + 20). c starting early (at 33, before
    // e2 could be ready; the clocks disagree) caps it at c's start: 33 - 15 = 18.
    for (const double c_start : {36.0, 33.0}) {
        Steps s;
        s.kernel(0, "a", 0, 10).record(0, 0).wait(1, 0).wait(2, 0);
        s.collective(1, "nccl_reduce_scatter", 12, 30).record(1, 1).collective(2, "nccl_all_gather", 12, 35).record(2, 2);
        s.kernel(0, "b", 11, 15).wait(0, 1).wait(0, 2).kernel(0, "c", c_start, 40);
        check_near(exposed_comm_ms(s.t), c_start == 36 ? 20 : 18, "two waits in one gap");
    }
    // A collective on stream 0 (5-9) is exposed whole: 4. A wait on an event recorded on stream 0 is
    // not communication; neither is an event recorded on stream 1 before any timed op there, nor a
    // wait on stream 1.
    {
        Steps s;
        s.kernel(0, "a", 0, 4).collective(0, "nccl_all_reduce", 5, 9).record(0, 0).record(1, 1);
        s.wait(1, 0).wait(0, 1).wait(0, 0).kernel(0, "c", 20, 21);
        check_near(exposed_comm_ms(s.t), 4, "a collective on stream 0, and waits that are not communication");
    }
    // Families: a kernel twice (2 + 3 ms, 10 + 30 bytes read), three all-reduces of one NCCL group
    // (each timed 0-6 ms, a third each: 6 ms in all), an untimed event op (not counted); the slowest first.
    {
        Steps s;
        s.kernel(0, "k", 0, 2, 10).record(0, 0).kernel(0, "k", 2, 5, 30);
        for (int i = 0; i < 3; ++i) s.collective(1, "nccl_all_reduce", 0, 6, 1.0 / 3);
        const std::vector<MeasuredFamily> f = measured_families(s.t);
        ++checks;
        if (f.size() != 2 || f[0].name != "nccl_all_reduce" || !family(f, "k")) {
            ++failures;
            std::printf("FAIL families: want nccl_all_reduce then k\n");
        } else {
            check_near(f[0].count, 3, "the group's count");
            check_near(f[0].ms, 6, "the group's time, shared");
            check_near(f[0].bytes, 300, "the group's bytes");
            check_near(f[0].collective, 1, "a collective family");
            check_near(family(f, "k")->count, 2, "the kernel's count");
            check_near(family(f, "k")->ms, 5, "the kernel's time");
            check_near(family(f, "k")->bytes, 40, "the kernel's bytes");
        }
    }
    std::printf("%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
