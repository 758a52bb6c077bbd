// Startup checks: the data, the output directories and the run id are checked before anything is
// written, so a run that cannot finish says why at once. Part of train_gpt.cu's run section:
// included after its Run.
#pragma once
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include <csignal>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>
#include <utility>

#include "../runtime/checkpoint_format.h"
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

// The message for a token id outside the vocabulary (as the batch producer words it at run time).
template <class Loader>
std::string vocabulary_error(const Loader& loader, int vocab) {
    const auto [rank, at, id] = loader.token_at_least(vocab);
    if (rank < 0) return "";
    return "token id " + std::to_string(id) + " at token " + std::to_string(at) + " of shard " + loader.current_file() +
           " (read by rank " + std::to_string(rank) + ") is outside the vocabulary [0, " + std::to_string(vocab) + ")";
}

// Whether the training shards hold the tokens of steps [0, last) on every rank, walked as the
// loader walks them (documents cut at max_seq_len, shard tails skipped, the batch growing with
// the stages), every token id inside the vocabulary, or why not.
std::string train_tokens_error(const Config& c, const Schedule& sch, const std::string& glob, int world, int last) {
    int step = 0;
    try {
        dataload::TrainLoader::Options lo;
        lo.bigram_vocab = c.bigram_vocab;
        dataload::TrainLoader loader(glob, 0, world, c.stages.front().batch_tokens, c.max_seq_len, c.grad_accum(), lo);
        for (; step < last; ++step) {
            loader.set_batch(sch.lookup(step).first->batch_tokens, c.max_seq_len, c.grad_accum());
            for (int i = 0; i < c.grad_accum(); ++i) {
                loader.advance();
                if (std::string e = vocabulary_error(loader, c.vocab_size); !e.empty())
                    return "the training data of step " + std::to_string(step) + ": " + e;
            }
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
        for (int64_t i = 0; i < c.grad_accum() * c.val_tokens / c.val_batch_tokens; ++i) {
            loader.advance();
            if (std::string e = vocabulary_error(loader, c.vocab_size); !e.empty()) return "the validation data: " + e;
        }
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

// The signals a terminal or a job scheduler sends to stop a run: Ctrl-C, Ctrl-\\, a closed terminal,
// kill and the schedulers' stop and pre-emption notices (Slurm's --signal, PBS and LSF use SIGTERM,
// SIGUSR1/2 or SIGXCPU; mpirun forwards them). Each removes a checkpoint temp file being written,
// ends the log with `fail: stopped by <SIGNAL>`, then ends the process as the signal would have.
constexpr std::pair<int, const char*> kStopSignals[] = {{SIGINT, "SIGINT"},   {SIGTERM, "SIGTERM"}, {SIGHUP, "SIGHUP"},
                                                        {SIGQUIT, "SIGQUIT"}, {SIGUSR1, "SIGUSR1"}, {SIGUSR2, "SIGUSR2"},
                                                        {SIGXCPU, "SIGXCPU"}};

extern "C" void on_stop_signal(int sig) {
    ckpt::remove_active_temp();
    if (g_log_fd >= 0) {  // write() is async-signal-safe; the line is built from constant pieces
        const char* name = "a signal";
        for (const auto& [s, n] : kStopSignals)
            if (s == sig) name = n;
        const char head[] = "fail: stopped by ";
        ssize_t ignored = write(g_log_fd, head, sizeof head - 1);
        ignored = write(g_log_fd, name, std::strlen(name));
        ignored = write(g_log_fd, "\n", 1);
        (void)ignored;
    }
    std::signal(sig, SIG_DFL);
    std::raise(sig);
}

void handle_stop_signals() {
    for (const auto& [sig, name] : kStopSignals) std::signal(sig, on_stop_signal);
}

// ---- what a checkpoint records of the computation a resume continues ----

using RunFacts = std::vector<std::pair<std::string, std::string>>;  // key, value: in every manifest

// The training shards' identity, cheap at any size: each shard's name and size (`name:bytes,...`),
// and an FNV-1a 64 over each one's header and two 64 KiB samples of its tokens, the first and the
// last (reading all of the record's shards a second time would cost seconds at every start; a
// shard rewritten with the same size and the same ends is not told apart). Empty when a shard
// cannot be read (the data check says why).
std::pair<std::string, std::string> data_identity(const std::string& glob) {
    std::string shards;
    uint64_t h = 0xcbf29ce484222325ull;
    const auto add = [&](const void* p, size_t n) {
        for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 0x100000001b3ull;
    };
    try {
        for (const std::string& f : dataload::expand_glob(glob)) {
            struct stat st {};
            FILE* in = std::fopen(f.c_str(), "rb");
            if (!in || fstat(fileno(in), &st) != 0) {
                if (in) std::fclose(in);
                return {};
            }
            const std::string name = f.substr(f.rfind('/') + 1);
            shards += (shards.empty() ? "" : ",") + name + ":" + std::to_string(st.st_size);
            add(name.data(), name.size() + 1);
            constexpr long kHeader = 1024, kSample = 65536;
            std::vector<unsigned char> buf(kHeader + kSample);
            for (long at : {0L, std::max(0L, long(st.st_size) - kSample)}) {
                const size_t n = std::fseek(in, at, SEEK_SET) == 0 ? std::fread(buf.data(), 1, at ? kSample : buf.size(), in) : 0;
                add(buf.data(), n);
            }
            std::fclose(in);
        }
    } catch (const dataload::DataError&) {
        return {};
    }
    char text[20];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
    return {shards, text};
}

// What changes the numbers a continued run computes, beyond the preset, the world size and the seed
// (those are checked by check_same_run): the schedule, the training data, and the kernel choices
// that change bits on a GPU.
RunFacts run_facts(const Config& c, const std::string& train_glob, AttentionKernel attention, MlpKernel mlp) {
    const auto [shards, checksum] = data_identity(train_glob);
    return {{"scheduled_steps", std::to_string(c.scheduled_iterations)},
            {"extension_steps", std::to_string(c.extension_iterations)},
            {"train_shards", shards},
            {"train_data", checksum},
            {"attention", attention_kernel_name(attention)},
            {"mlp_kernel", mlp_kernel_name(mlp)}};
}

// The checkpoint a run continues, as the startup check found it (rank 0).
struct ResumePoint {
    std::string run_id;   // the run that saved it
    std::string lineage;  // the first run of the chain of resumes: whose checkpoint directory this is
    int step = -1;
    std::vector<std::string> warnings;  // for the log: what --resume-changed accepted, what was not recorded
};

// `root`'s step directories (root/stepNNNNNN), sorted.
std::vector<std::string> step_dirs(const std::string& root) {
    std::vector<std::string> found;
    if (DIR* d = opendir(root.c_str())) {
        while (const dirent* e = readdir(d)) {
            const std::string n = e->d_name;
            if (n.size() == 10 && n.rfind("step", 0) == 0 && n.find_first_not_of("0123456789", 4) == std::string::npos)
                found.push_back(root + "/" + n);
        }
        closedir(d);
    }
    std::sort(found.begin(), found.end());
    return found;
}

std::string list_text(const std::vector<std::string>& items, const char* sep = ", ") {
    std::string out;
    for (const std::string& s : items) out += (out.empty() ? "" : sep) + s;
    return out;
}

// The manifest's differences from this run's facts (an old manifest's missing keys are warnings).
std::vector<std::string> fact_differences(const ckpt::Manifest& man, const RunFacts& now, std::vector<std::string>& warnings) {
    std::vector<std::string> diffs;
    for (const auto& [key, value] : now) {
        if (value.empty()) continue;  // unreadable data: the data check names why
        const auto it = std::find_if(man.meta.begin(), man.meta.end(), [&](const auto& m) { return m.first == key; });
        if (it == man.meta.end())
            warnings.push_back("the checkpoint does not record " + key + " (saved before it was recorded): not checked");
        else if (it->second != value)
            diffs.push_back(key + " " + it->second + " in the checkpoint, " + value + " in this run");
    }
    return diffs;
}

// Rank 0, before anything is written: whether `opt.resume_dir` is a checkpoint this run can continue
// (a step directory, of this preset, world size and seed, within this run's steps, of the same
// schedule, data and kernels unless --resume-changed) and whether every save this run is asked for
// comes after it. Fills `out`. The files' bytes are verified when they are loaded.
std::string resume_error(const RunOptions& opt, const Config& c, int world, int last, const RunFacts& now, ResumePoint& out) {
    const std::string& dir = opt.resume_dir;
    const auto bad = [&](const std::string& why) { return "cannot resume from " + dir + ": " + why; };
    struct stat st {};
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return bad("no such checkpoint directory");
    std::string preset, world_size, seed, step;
    try {
        if (ckpt::has_manifest(dir)) {
            const ckpt::Manifest man = ckpt::read_manifest(dir);
            const std::string mpath = ckpt::manifest_path(dir);
            preset = man.get("preset", mpath), world_size = man.get("world_size", mpath), seed = man.get("seed", mpath);
            step = man.get("step", mpath), out.run_id = man.get("run_id", mpath);
            const auto lineage = std::find_if(man.meta.begin(), man.meta.end(), [](const auto& m) { return m.first == "lineage"; });
            out.lineage = lineage != man.meta.end() ? lineage->second : out.run_id;
            if (preset == c.name && world_size == std::to_string(world)) {
                const std::vector<std::string> diffs = fact_differences(man, now, out.warnings);
                if (!diffs.empty() && !opt.resume_changed)
                    return bad("this run would not continue the run that saved it: " + list_text(diffs, "; ") +
                               ". Give the saved run's flags, or --resume-changed to continue with these changes (each one "
                               "a WARNING in the log)");
                for (const std::string& d : diffs) out.warnings.push_back("--resume-changed: " + d);
            }
        } else {
            const std::vector<std::string> steps = step_dirs(dir);
            if (!steps.empty())
                return bad("it is a checkpoint root, not a step directory: resume from one of " + list_text(steps) +
                           " (the last one saved: " + steps.back() + ")");
            if (!opt.resume_unverified)
                return bad(ckpt::manifest_path(dir) + " is missing: the save did not finish (a run or re-save killed midway), "
                           "or the checkpoint predates manifests. --resume-unverified loads a directory saved before "
                           "manifests without verifying its bytes");
            const ckpt::CheckpointReader first(dir + "/rank0.safetensors");
            preset = first.meta("preset"), world_size = first.meta("world_size"), seed = first.meta("seed");
            step = first.meta("step"), out.run_id = first.has_meta("run_id") ? first.meta("run_id") : "";
            out.lineage = out.run_id;
            out.warnings.push_back("the schedule, data and kernels of an unverified checkpoint are not recorded: not checked");
        }
    } catch (const std::exception& e) {
        return bad(e.what());
    }
    if (preset != c.name || world_size != std::to_string(world))
        return bad("it was saved by preset " + preset + " on " + world_size + " ranks; this run is preset " + c.name + " on " +
                   std::to_string(world) + " (a checkpoint continues only on the same preset and number of ranks)");
    if (seed != std::to_string(opt.seed))
        return bad("it was saved by a run with --seed " + seed + "; this run has --seed " + std::to_string(opt.seed));
    out.step = std::atoi(step.c_str());
    if (out.step > last) {
        std::vector<std::string> within;  // the sibling step directories this run reaches
        const std::string root = dir.find('/') == std::string::npos ? "." : dir.substr(0, dir.rfind('/'));
        for (const std::string& s : step_dirs(root))
            if (std::atoi(s.c_str() + s.size() - 6) <= last) within.push_back(s);
        return bad("its step " + step + " is beyond this run's last step " + std::to_string(last) + ": give --max-steps " +
                   step + " or more" + (within.empty() ? "" : ", or resume from one of " + list_text(within)));
    }
    for (int s : opt.checkpoint_steps)
        if (s <= out.step)
            return "--checkpoint-steps " + std::to_string(s) + " would never be saved: this run resumes at step " + step +
                   " and saves only the steps after it";
    if (opt.profile_steps.first >= 0 && opt.profile_steps.first < out.step)
        return "--profile-steps " + std::to_string(opt.profile_steps.first) + ":" + std::to_string(opt.profile_steps.last) +
               " starts before step " + step + ", where this run resumes: it would profile only part of the range";
    if (!opt.save_dir.empty() && opt.checkpoint_steps.empty() && out.step == last)
        return "--save-checkpoint " + opt.save_dir + " would save nothing: this run resumes at its last step " + step;
    return "";
}

// Rank 0: claims the checkpoint directory for the chain of runs `lineage` (a fresh run's own id, a
// resumed run's first run's), so that no two runs save into one directory, one after the other or at
// once. A step directory's manifest names the chain that saved it: another chain's is refused. While
// a run lives it holds a lock on DIR/run_id (which names it): a second process is refused, whichever
// run it is (a resume started twice would overwrite the same steps). A claim whose holder is gone and
// saved nothing is taken over. `lock_fd` keeps the lock until the process exits.
std::string claim_checkpoint_dir(const std::string& dir, const std::string& lineage, const std::string& run_id, int& lock_fd) {
    if (dir.empty()) return "";
    const std::string owner_path = dir + "/run_id";
    const auto refuse = [&](const std::string& other, const std::string& where) {
        return "the checkpoint directory " + dir + " holds the checkpoints of run " + other + " (" + where + "); this run is " +
               (lineage == run_id ? run_id : run_id + ", continuing run " + lineage) +
               ": give each run its own --save-checkpoint directory (only a resume of run " + other + " saves into it)";
    };
    for (const std::string& s : step_dirs(dir)) {
        if (!ckpt::has_manifest(s)) continue;
        try {
            const ckpt::Manifest man = ckpt::read_manifest(s);
            std::string owner;
            for (const auto& [k, v] : man.meta)
                if (k == "lineage" || (k == "run_id" && owner.empty())) owner = v;
            if (!owner.empty() && owner != lineage) return refuse(owner, ckpt::manifest_path(s));
        } catch (const std::exception&) {
            continue;  // a damaged manifest is reported when a run resumes from it
        }
    }
    lock_fd = open(owner_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd < 0) return "cannot write " + owner_path + ": " + std::strerror(errno);
    char text[256] = {};
    const ssize_t n = pread(lock_fd, text, sizeof text - 1, 0);
    std::string holder = n > 0 ? std::string(text, size_t(n)) : "";
    if (!holder.empty() && holder.back() == '\n') holder.pop_back();
    if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0)
        return "the checkpoint directory " + dir + " is in use by a running process of run " +
               (holder.empty() ? "(unnamed)" : holder) + " (it holds the lock on " + owner_path +
               "): two processes would overwrite each other's checkpoints";
    const std::string line = lineage + "\n";
    if (holder != lineage &&
        (ftruncate(lock_fd, 0) != 0 || pwrite(lock_fd, line.data(), line.size(), 0) != ssize_t(line.size()) ||
         fsync(lock_fd) != 0))
        return "cannot write " + owner_path + ": " + std::strerror(errno);
    return "";
}
