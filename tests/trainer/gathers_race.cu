// The next forward waits for each gathered parameter at its place, where it first reads it (its param_table row),
// checked by emu's race detector rather than by reading the code: real training steps (not a dry
// run) of the tiny preset on this run's ranks under EMU_STREAMS=deferred, where any kernel reading
// a parameter that a gather on the comms stream writes, without an event ordering it after the
// gather, stops the program with "race on '<the parameter>'". The steps: 0 and 1 (an Adam step:
// every group gathered while embed is tied), 2 (its forward reads them), then the untie step and
// the three after it (an untied Adam step: embed gathered first, lm_head last, read at the head;
// then an even step's forward). Afterwards every rank holds the same parameters, bit for bit (a gather or
// a broadcast piece that missed rows would leave a rank's copy stale).
//
// `gathers_race plant GROUP [TABLE]` plants the bug: after each optimizer step the forward's event
// for GROUP (a sharded row of the tiny preset's param_table; TABLE: which of its tables) is swapped for one that is
// already complete, so the next forward no longer waits for that gather; the program must then die
// of the race the detector reports (CTest's gathers_race_planted_*).
#include "../trainer_under_test.h"
#include "trainer_test_util.h"

struct Plant {
    bool on = false;
    int group = 0;  // its row in the param_table
    int table = 0;
};

Plant parse_plant(int argc, char** argv) {
    Plant p;
    if (argc < 2) return p;
    const std::string name = argc >= 3 ? argv[2] : "";
    std::string groups;
    const Config c = tiny_preset();
    const std::vector<ParamRule>& table = c.param_table;
    for (int i = 0; i < static_cast<int>(table.size()); ++i) {
        if (!is_sharded(table[i].reduce)) continue;
        groups += std::string(groups.empty() ? "" : "|") + table[i].label;
        if (std::strcmp(argv[1], "plant") == 0 && name == table[i].label) p = {true, i, argc >= 4 ? std::atoi(argv[3]) : 0};
    }
    if (!p.on || p.table < 0 || p.table >= tables_at(c.structure, table[p.group].place)) {
        std::fprintf(stderr, "usage: gathers_race [plant %s [TABLE]]\n", groups.c_str());
        std::exit(2);
    }
    return p;
}

// The planted bug: the forward's event for p swapped for `done` (recorded on s, so complete as far
// as s goes); the real one is kept in `done` for the next swap.
void plant_missing_wait(Model& m, const Plant& p, cudaEvent_t& done, cudaStream_t s) {
    CUDA_CHECK(record_event(done, s));
    std::swap(m.gathered.event.at(size_t(p.group)).at(size_t(p.table)), done);
}

// A hash of this rank's whole parameter arena; every rank's equal when the gathers covered it.
uint64_t param_hash(Model& m) {
    std::vector<unsigned char> host(m.param_arena.bytes());
    CUDA_CHECK(cudaMemcpy(host.data(), m.param_arena.base(), host.size(), cudaMemcpyDeviceToHost));
    uint64_t h = 1469598103934665603ull;
    for (unsigned char b : host) h = (h ^ b) * 1099511628211ull;
    return h;
}

int main(int argc, char** argv) {
    Distributed d = start_distributed(&argc, &argv);
    const Plant plant = parse_plant(argc, argv);
    const char* repo = std::getenv("REPO");
    const char* mode = std::getenv("EMU_STREAMS");
    if (!repo || !mode || std::strncmp(mode, "deferred", 8) != 0) {
        std::fprintf(stderr, "gathers_race: set REPO, and EMU_STREAMS=deferred[:SEED] (the race detector runs there)\n");
        return 2;
    }
    Config c = tiny_preset();
    c.world_size = d.world;
    TrainerRun t(d, c, repo, false);
    Run& r = t.r;
    Model& m = t.m;
    const Schedule& sch = t.sch;
    cudaStream_t s = t.s;

    const std::vector<int> steps = {0, 1, 2, sch.split_step, sch.split_step + 1, sch.split_step + 2, sch.split_step + 3};
    cudaEvent_t done;
    CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    reset_schedule(r);
    start_batches(r, {steps, 0});
    for (int step : steps) {
        advance_schedule(r, step);
        train_step(r, step);
        if (plant.on) plant_missing_wait(m, plant, done, s);
    }
    await_all_gathered(m.gathered, s);
    CUDA_CHECK(sync_stream(s, "gathers_race"));
    test::check(!plant.on, "the planted missing wait was not reported as a race");
    test::check(t.o.split, "the steps did not reach the untied schedule");

    const uint64_t mine = param_hash(m);
    uint64_t low = 0, high = 0;
    MPI_Allreduce(&mine, &low, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&mine, &high, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    test::check(low == high, "%d ranks: the parameters differ between ranks after the gathers", d.world);
    CUDA_CHECK(cudaEventDestroy(done));
    return finish_trainer_test(r, t.o);
}
