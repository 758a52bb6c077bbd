// Startup checks: the data, the output directories and the run id are checked before anything is
// written, so a run that cannot finish says why at once. Part of train_gpt.cu's run section:
// included after its Run.
#pragma once
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cerrno>
#include <cstring>
#include <string>

#include "../data/checkpoint.h"
#include "../data/loader.h"

// ---- startup checks: what can be known before the first step is checked before anything is written ----


// The repository the binary was built in: the parent of the executable's directory (build/..).
std::string repo_dir() {
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    const std::string path = n > 0 ? std::string(exe, size_t(n)) : "./build/train_gpt";
    const std::string build = path.substr(0, path.rfind('/'));
    return build.substr(0, build.rfind('/'));
}

std::string current_dir() {
    char cwd[4096];
    return getcwd(cwd, sizeof cwd) ? cwd : "(unknown)";
}

// The shards a run reads: a preset's default path is relative to the repository, wherever the run
// starts; a path given on the command line is taken as it is.
struct DataFiles {
    std::string train, val;
    bool train_default = false, val_default = false;
    std::string remedy;  // how to get the preset's default data
};

// The shards of this config and command line (its remedy names the script that makes the preset's).
DataFiles data_files(const Config& c, const RunOptions& opt) {
    DataFiles f{opt.train_files, opt.val_files, opt.train_files.empty(), opt.val_files.empty(),
                c.name == "tiny" ? "python3 data/prepare_tinyshakespeare.py makes it"
                                 : "python3 data/cached_fineweb10B.py 9 downloads it"};
    if (f.train_default) f.train = c.train_files[0] == '/' ? c.train_files : repo_dir() + "/" + c.train_files;
    if (f.val_default) f.val = c.val_files[0] == '/' ? c.val_files : repo_dir() + "/" + c.val_files;
    return f;
}

// The command line's changes to the preset (schedule lengths, data, validation tokens), checked at
// once; opt gets the data files. Returns the run's last step.
int configure_run(Config& cfg, const CommandLine& cl, RunOptions& opt, DataFiles& files) {
    if (cl.scheduled > 0) cfg.scheduled_iterations = cl.scheduled;
    if (cl.extension >= 0) cfg.extension_iterations = cl.extension;
    files = data_files(cfg, opt);
    opt.train_files = files.train;
    opt.val_files = files.val;
    if (opt.val_tokens > 0) cfg.val_tokens = opt.val_tokens;
    if (cfg.val_tokens % cfg.val_batch_tokens != 0)
        usage_error("--val-tokens must be a multiple of the validation batch (" + std::to_string(cfg.val_batch_tokens) +
                    " tokens)");
    const int total_steps = cfg.scheduled_iterations + cfg.extension_iterations;
    const int last = opt.max_steps >= 0 ? std::min(total_steps, opt.max_steps) : total_steps;
    check_run_options(opt, last);
    return last;
}

// Why the shards `glob` names cannot be opened (no match, a bad header), or "".
std::string shard_error(const std::string& what, const std::string& glob, bool is_default, const std::string& remedy) {
    try {
        for (const std::string& f : dataload::expand_glob(glob)) dataload::read_shard_header(f);
    } catch (const dataload::DataError& e) {
        if (!is_default) return what + ": " + e.what();
        return what + ": " + e.what() + " (the preset's default, relative to the repository; the current directory is " +
               current_dir() + "): " + remedy + ", or give " +
               (what == "training data" ? "--train-files" : "--val-files");
    }
    return "";
}

// Whether the training shards hold the tokens of steps [0, last) on every rank, walked as the
// loader walks them (documents cut at max_seq_len, shard tails skipped, the batch growing with
// the stages), or why not.
std::string train_tokens_error(const Config& c, const Schedule& sch, const std::string& glob, int world, int last) {
    int step = 0;
    try {
        dataload::TrainLoader::Options lo;
        lo.bigram_vocab = c.bigram_vocab;
        dataload::TrainLoader loader(glob, 0, world, c.stages.front().batch_tokens, c.max_seq_len, c.grad_accum(), lo);
        for (; step < last; ++step) {
            loader.set_batch(sch.lookup(step).first->batch_tokens, c.max_seq_len, c.grad_accum());
            for (int i = 0; i < c.grad_accum(); ++i) loader.advance();
        }
    } catch (const dataload::DataError& e) {
        return "the training data cannot feed this run's " + std::to_string(last) + " steps on " + std::to_string(world) +
               " rank(s): it runs out in step " + std::to_string(step) + ": " + e.what();
    }
    return "";
}

// Whether the validation shards hold val_tokens as the validation loader takes them, or why not.
std::string val_tokens_error(const Config& c, const std::string& glob, int world) {
    try {
        dataload::ValLoader loader(glob, 0, world, c.val_batch_tokens, c.grad_accum(), c.bigram_vocab);
        for (int64_t i = 0; i < c.grad_accum() * c.val_tokens / c.val_batch_tokens; ++i) loader.advance();
    } catch (const dataload::DataError& e) {
        return "the validation data cannot supply --val-tokens " + std::to_string(c.val_tokens) + ": " + e.what();
    }
    return "";
}

// The data checks, in the order their messages are most useful (rank 0 reads for every rank).
std::string data_error(const Config& c, const DataFiles& f, int world, int last) {
    const Schedule sch(c);
    for (const std::string& e : {shard_error("training data", f.train, f.train_default, f.remedy),
                                 shard_error("validation data", f.val, f.val_default, f.remedy)})
        if (!e.empty()) return e;
    if (std::string e = val_tokens_error(c, f.val, world); !e.empty()) return e;
    return train_tokens_error(c, sch, f.train, world, last);
}

// Rank 0: the log directory and the checkpoint directory exist or can be made (their parents must
// exist), and the run id is new (a reused one would mix two runs in one log).
std::string output_dirs_error(const RunOptions& opt, const std::string& log_path) {
    for (const auto& [what, dir] : {std::pair{"log", opt.log_dir}, std::pair{"checkpoint", opt.save_dir}}) {
        if (dir.empty()) continue;
        struct stat st {};
        if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
            return std::string("cannot create the ") + what + " directory " + dir + ": " + std::strerror(errno);
        if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
            return std::string("the ") + what + " directory " + dir + " is not a directory";
    }
    if (access(log_path.c_str(), F_OK) == 0)
        return "the log " + log_path + " already exists: run id " + opt.run_id +
               " was used before; give a new --run-id (or none, for a random one)";
    return "";
}

// Every rank: a file can be written in the checkpoint directory (a read-only or full disk is found
// now, not at the first save after hours of training).
std::string checkpoint_dir_write_error(const std::string& dir) {
    if (dir.empty()) return "";
    const std::string probe = ckpt::temp_path(dir + "/.write_check");
    FILE* f = std::fopen(probe.c_str(), "w");
    bool ok = f && std::fputs("ok\n", f) >= 0 && std::fflush(f) == 0 && fsync(fileno(f)) == 0;
    const int err = errno;
    if (f) ok = std::fclose(f) == 0 && ok;
    std::remove(probe.c_str());
    return ok ? "" : "cannot write in the checkpoint directory " + dir + ": " + std::strerror(err);
}

// SIGINT and SIGTERM (mpirun forwards them) remove a checkpoint temp file being written, then end
// the process as the signal would have.
extern "C" void on_stop_signal(int sig) {
    ckpt::remove_active_temp();
    std::signal(sig, SIG_DFL);
    std::raise(sig);
}
