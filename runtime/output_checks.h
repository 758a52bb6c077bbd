// The run's outputs checked before anything is written: the log and checkpoint directories can be
// made and written, the checkpoint directory is this run's to save into, and the checkpoint a resume
// continues is one this run can continue (what a checkpoint records of the computation: RunFacts).
#pragma once
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_format.h"
#include "../kernels/attention.cuh"
#include "../kernels/mlp.cuh"
#include "data_checks.h"
#include "flags.h"

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

// ---- what a checkpoint records of the computation a resume continues ----

using RunFacts = std::vector<std::pair<std::string, std::string>>;  // key, value: in every manifest

// What changes the numbers a continued run computes, beyond the preset, the world size and the seed
// (those are checked by check_same_run): the schedule's length, the training data, and the kernel
// choices that change bits on a GPU.
RunFacts run_facts(int scheduled_steps, int extension_steps, const std::string& train_glob, AttentionKernel attention,
                   MlpKernel mlp) {
    const auto [shards, checksum] = data_identity(train_glob);
    return {{"scheduled_steps", std::to_string(scheduled_steps)},
            {"extension_steps", std::to_string(extension_steps)},
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
std::string resume_error(const RunOptions& opt, const std::string& preset_name, int world, int last, const RunFacts& now,
                         ResumePoint& out) {
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
            if (preset == preset_name && world_size == std::to_string(world)) {
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
    if (preset != preset_name || world_size != std::to_string(world))
        return bad("it was saved by preset " + preset + " on " + world_size + " ranks; this run is preset " + preset_name + " on " +
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
