// The dump_batches program as a user runs it: usage errors exit 2 with the usage text, data
// errors exit 1 naming the file, and a good run prints exactly the reference's text.
//   test_data_cli PATH_TO_dump_batches
#include <cstdio>
#include <string>
#include <sys/wait.h>

#include "tests/data/data_test_util.h"

namespace {

std::string g_tool;

struct Run {
    int status = -1;
    std::string out, err;
};

std::string quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
}

Run run(const std::string& args, const datatest::ScratchDir& dir) {
    const std::string out = dir.file("stdout"), err = dir.file("stderr");
    const std::string cmd = quote(g_tool) + " " + args + " >" + quote(out) + " 2>" + quote(err);
    const int rc = std::system(cmd.c_str());
    Run r;
    r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    r.out = datatest::read_text_file(out);
    r.err = datatest::read_text_file(err);
    return r;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

void expect_usage_error(const std::string& args, const std::string& message, const datatest::ScratchDir& dir) {
    const Run r = run(args, dir);
    test::check(r.status == 2 && has(r.err, message) && has(r.err, "usage: dump_batches") && r.out.empty(),
                "dump_batches %s: status %d, stderr \"%s\" (want 2 and \"%s\" with the usage)", args.c_str(), r.status,
                r.err.c_str(), message.c_str());
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: test_data_cli PATH_TO_dump_batches\n");
        return 2;
    }
    g_tool = argv[1];
    datatest::ScratchDir dir;
    const std::string repo = datatest::repo_root();
    const std::string hand = quote(repo + "/tests/data/fixtures/handmade_*.bin");

    expect_usage_error("", "--files is required", dir);
    expect_usage_error("--files " + hand, "--batches is required", dir);
    expect_usage_error("--files " + hand + " --batches 2 --frobnicate", "unknown argument '--frobnicate'", dir);
    expect_usage_error("--files " + hand + " --batches two", "--batches needs an integer, got 'two'", dir);
    expect_usage_error("--files " + hand + " --batches 0", "--batches must be between 1 and", dir);
    expect_usage_error("--files " + hand + " --batches 1 --world-size 3", "world size 3 does not divide 8; give --grad-accum", dir);
    expect_usage_error("--files " + hand + " --batches 1 --max-seq-len", "--max-seq-len needs a value", dir);
    expect_usage_error("--files " + hand + " --batches 1 --change 5", "--change needs STEP:TOKENS[:MAX_SEQ_LEN], got '5'", dir);
    expect_usage_error("--files " + hand + " --batches 1 --change 0:64", "--change step must be between 1 and", dir);
    expect_usage_error("--files " + hand + " --batches 1 --change 4:64 --change 2:64", "--change steps must be ascending", dir);
    expect_usage_error("--files " + hand + " --batches 1 --val --change 2:64", "--change applies to the training loader", dir);
    expect_usage_error("--files " + hand + " --batches 1 --bigram-vocab 1", "--bigram-vocab must be between 2 and", dir);

    const Run help = run("--help", dir);
    test::check(help.status == 0 && has(help.out, "usage: dump_batches") && has(help.out, "--no-prefetch"), "--help");

    const std::string absent = dir.file("nothing_*.bin");
    const Run missing = run("--files " + quote(absent) + " --batches 1", dir);
    test::check(missing.status == 1 && has(missing.err, "dump_batches: error: no files match " + absent),
                "no shards: status %d, stderr \"%s\"", missing.status, missing.err.c_str());

    const std::string bad = dir.file("bad_000.bin");
    datatest::write_raw_shard(bad, 20240520, 7, 4, std::vector<uint16_t>(4, 1));
    const Run wrong = run("--files " + quote(bad) + " --batches 1", dir);
    test::check(wrong.status == 1 && has(wrong.err, bad) && has(wrong.err, "has version 7, only version 1 is supported"),
                "bad shard: status %d, stderr \"%s\"", wrong.status, wrong.err.c_str());

    const Run small = run("--files " + quote(repo + "/tests/data/fixtures/handmade_00[01].bin") +
                              " --world-size 2 --batch-tokens 2000 --max-seq-len 64 --batches 3",
                          dir);
    test::check(small.status == 1 && has(small.err, "training data exhausted") && has(small.out, "# train batches"),
                "out of data: status %d, stderr \"%s\"", small.status, small.err.c_str());

    // A good run through the real binary, against the reference's text for the same flags.
    const Run good = run("--files " + hand +
                             " --world-size 2 --grad-accum 1 --batch-tokens 96 --max-seq-len 32 --batches 21"
                             " --change 3:192:48 --change 6:64:8",
                         dir);
    const std::string want = datatest::read_text_file(repo + "/tests/data/fixtures/expected/hand_w2_g1_change.txt");
    test::check(good.status == 0 && good.err.empty() && good.out == want, "good run: status %d, %zu bytes vs %zu expected",
                good.status, good.out.size(), want.size());
    return test::finish();
}
