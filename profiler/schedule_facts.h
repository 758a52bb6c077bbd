// The training schedule as the step profiler sees it: facts the trainer hands over as data, so that
// the profiler needs nothing of the trainer's structs.
#pragma once
#include <cstdint>
#include <vector>

// Each stage's steps [first, end), batch and document cut length, the untie step, and the shape of a
// loader's batches (for the data a plan reads).
struct ScheduleFacts {
    struct Stage {
        int first = 0, end = 0;
        int64_t batch_tokens = 0;
        int max_seq_len = 0;
    };
    std::vector<Stage> stages;
    int split_step = -1;
    int grad_accum = 1, bigram_vocab = 0;
};
