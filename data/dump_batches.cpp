// dump_batches: prints the loaders' batches for every rank (see data/dump.h and --help).
// Exit status: 0 on success, 1 for bad data (after printing what came before), 2 for a bad
// command line.
#include <cstdio>
#include <cstring>

#include "dump.h"

int main(int argc, char** argv) {
    for (int i = 1; i < argc; ++i)
        if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
            std::fputs(dataload::dump_usage(), stdout);
            return 0;
        }
    dataload::DumpConfig config;
    try {
        config = dataload::parse_dump_args(argc, argv);
    } catch (const dataload::UsageError& e) {
        std::fprintf(stderr, "dump_batches: %s\n%s", e.what(), dataload::dump_usage());
        return 2;
    }
    try {
        dataload::dump_batches(stdout, config);
    } catch (const dataload::DataError& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "dump_batches: error: %s\n", e.what());
        return 1;
    }
    return 0;
}
