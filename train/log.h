// The run's log: rank 0 prints every line to the console and the log file, which starts with the
// source that produced it (embedded at build time by cmake/embed_sources.cmake), then the
// environment, the header lines scripts/stats.py parses, and the config. Part of train_gpt.cu's run
// section: included after its Run.
#pragma once
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <fcntl.h>
#include <unistd.h>
#include <utility>

#include "host_comm.h"

// The open log's descriptor on rank 0 (-1 before it is made and after a write to it failed): every
// fatal error and a stopping signal end the log with a `fail:` line, so a log that ends with neither
// `fail:` nor `finished:` is a run that was killed outright (SIGKILL, a lost node, a power cut).
int g_log_fd = -1;

// The other ranks hold the same log open only to append their own fatal error, `fail: rank N: <why>`
// (where the file is visible to them: one node, or a shared file system; elsewhere -1 and the message
// is on that rank's stderr alone). Rank 0 appends too (O_APPEND), so no line overwrites another.
int g_rank_fail_fd = -1;
int g_fail_rank = 0;

// Appends `fail: <why>` to the log, once (a plain write: fail runs wherever the run stops).
void log_failure(const std::string& why) {
    int fd = std::exchange(g_log_fd, -1);  // the first failure is the one to report
    std::string line = "fail: " + why + "\n";
    if (fd < 0) {
        fd = std::exchange(g_rank_fail_fd, -1);
        line = "fail: rank " + std::to_string(g_fail_rank) + ": " + why + "\n";
    }
    if (fd < 0) return;
    if (write(fd, line.data(), line.size()) < 0) return;  // the message is on stderr either way
}

// Every rank but 0, once rank 0 has made the log (after a collective that follows open_log).
void open_log_for_failures(int rank, const std::string& path) {
    if (rank == 0) return;
    g_fail_rank = rank;
    g_rank_fail_fd = open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
}
// The run finished: no later exit is a failure of it.
void close_log_for_failures() {
    g_log_fd = -1;
    if (const int fd = std::exchange(g_rank_fail_fd, -1); fd >= 0) close(fd);
}

// A run that exits through std::exit before its end without fail() (CUDA_CHECK, NCCL_CHECK, a
// launcher's shape check) still ends its log with a fail: line; main closes the log at the end.
extern "C" void log_early_exit() { log_failure("the process exited before the run finished (the error is on stderr)"); }

[[noreturn]] void fail(const std::string& why) {
    log_failure(why);
    std::fprintf(stderr, "train_gpt: %s\n", why.c_str());
    std::fflush(stderr);
    host_abort(1);
    std::exit(EXIT_FAILURE);
}

// Appends to the log and flushes; a full disk or any other write error stops the run (every rank,
// through host_abort) naming the file, so a log never ends silently short.
void log_write(Run& r, const char* text, size_t n) {
    if (!r.log) return;
    bool ok = std::fwrite(text, 1, n, r.log) == n && std::fflush(r.log) == 0;
    if constexpr (kEmulated) {
        // The CPU build's full disk for tests where no small file system can be mounted:
        // TRAIN_GPT_LOG_LIMIT=N fails every log write that would take the log past N bytes.
        static const char* limit = std::getenv("TRAIN_GPT_LOG_LIMIT");
        if (ok && limit && std::ftell(r.log) > std::atol(limit)) {
            ok = false;
            errno = ENOSPC;
        }
    }
    if (!ok) {
        const int err = errno;
        g_log_fd = -1;  // the log cannot take the failure line
        std::fclose(std::exchange(r.log, nullptr));
        fail("cannot write the log " + r.log_path + ": " + std::strerror(err));
    }
}

// Rank 0 prints to the console and the log file; every line is flushed (a crash keeps the log).
void print0(Run& r, const char* fmt, ...) {
    if (r.d.rank != 0) return;
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    const int n = std::max(std::vsnprintf(nullptr, 0, fmt, ap), 0);  // any length: a command line, nvidia-smi
    va_end(ap);
    std::string line(size_t(n) + 1, '\0');
    std::vsnprintf(line.data(), line.size(), fmt, again);
    va_end(again);
    line.pop_back();
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
    log_write(r, line.data(), line.size());
}

// ---- the log's preamble: the source, the environment, the config (upstream prints its code,
// then nvidia-smi, then the run) ----
#ifndef TRAIN_GPT_NO_MAIN
struct SourceFile {
    const char* path;
    const char* text;
};
extern const SourceFile kSourceFiles[];
extern const size_t kSourceFileCount;
extern const char* const kGitRevision;
#endif
#ifndef TRAIN_GPT_BUILD_FLAGS
#define TRAIN_GPT_BUILD_FLAGS "unknown"
#endif

std::string command_output(const char* cmd) {
    std::string out;
    if (FILE* p = popen(cmd, "r")) {
        char buf[4096];
        size_t n;
        while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
        pclose(p);
    }
    return out;
}

void log_environment(Run& r, const Distributed& d) {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, d.device));
    int devices = 0, driver = 0, runtime = 0, nccl = 0;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    CUDA_CHECK(cudaDriverGetVersion(&driver));
    CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    NCCL_CHECK(ncclGetVersion(&nccl));
    const char* build = kEmulated ? "CPU build (g++ against emu/)" : "GPU build (nvcc)";
    print0(r, "%s, git %s, flags: %s\n", build,
#ifndef TRAIN_GPT_NO_MAIN
           kGitRevision,
#else
           "unknown",
#endif
           TRAIN_GPT_BUILD_FLAGS);
    print0(r, "device: %s x %d visible, %d SMs; %d rank(s)\n", prop.name, devices, prop.multiProcessorCount, d.world);
    const std::string nccl_name = nccl ? std::to_string(nccl) : "none (train/nccl_world1.cpp, the one-rank stand-in)";
    print0(r, "CUDA driver %d, runtime %d, cuBLASLt %zu, NCCL %s\n", driver, runtime, cublasLtGetVersion(), nccl_name.c_str());
    const std::string smi = command_output("nvidia-smi 2>/dev/null");
    if (!smi.empty()) print0(r, "%s", smi.c_str());
    // What a reviewer of a record asks for, as `key: value` lines that scripts/stats.py puts in
    // statistics.md: the versions, and each GPU with its clocks at the start (none on a machine
    // without nvidia-smi; its failure message, which it prints to stdout, starts with no index).
    const size_t lt = cublasLtGetVersion();
    print0(r, "cuda_driver: %d.%d\ncuda_runtime: %d.%d\n", driver / 1000, driver % 1000 / 10, runtime / 1000,
           runtime % 1000 / 10);
    print0(r, "cublaslt: %zu.%zu.%zu\nnccl: %d.%d.%d\n", lt / 10000, lt / 100 % 100, lt % 100, nccl / 10000,
           nccl / 100 % 100, nccl % 100);
    const std::string gpus = command_output(
        "nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader "
        "2>/dev/null");
    for (size_t at = 0, end; at < gpus.size(); at = end + 1) {
        end = std::min(gpus.find('\n', at), gpus.size());
        const std::string line = gpus.substr(at, end - at);
        if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0]))) print0(r, "gpu: %s\n", line.c_str());
    }
}

// ---- the log's header lines (a fixed `key: value` form that scripts/stats.py parses) ----

#ifndef TRAIN_GPT_NO_MAIN
// FNV-1a 64 over the embedded source files in bundle order, each as its path, a NUL, its text, a NUL:
// runs of the same code share it.
std::string source_hash() {
    uint64_t h = 0xcbf29ce484222325ull;
    const auto add = [&](const char* p, size_t n) {
        for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 0x100000001b3ull;
    };
    for (size_t i = 0; i < kSourceFileCount; ++i) {
        add(kSourceFiles[i].path, std::strlen(kSourceFiles[i].path) + 1);
        add(kSourceFiles[i].text, std::strlen(kSourceFiles[i].text) + 1);
    }
    char text[20];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
    return text;
}
#endif

// command, date_utc, hosts, world_size, seed, run_id, resumes (a resumed run: the run id and step of the
// checkpoint it continues), source_hash: each line starts with its key.
void log_header(Run& r, const Distributed& d) {
    const std::string hosts = host_list(d);
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
    print0(r, "command: %s\n", r.opt.command.c_str());
    print0(r, "date_utc: %s\n", date);
    print0(r, "hosts: %s\n", hosts.c_str());
    print0(r, "world_size: %d\n", d.world);
    print0(r, "seed: %llu\n", static_cast<unsigned long long>(r.opt.seed));
    print0(r, "run_id: %s\n", r.opt.run_id.c_str());
    if (r.resumes_step >= 0)
        print0(r, "resumes: %s step %d\n", r.resumes_run_id.empty() ? "(unknown)" : r.resumes_run_id.c_str(), r.resumes_step);
#ifndef TRAIN_GPT_NO_MAIN
    print0(r, "source_hash: %s\n", source_hash().c_str());
#endif
}

void log_config(Run& r) {
    const Config& c = r.m.cfg;
    print0(r, "config %s: layers %d, model_dim %d, heads %d x %d, mlp %d, vocab %d (padded %d), bigram_vocab %d\n",
           c.name.c_str(), kLayers, c.model_dim, c.num_heads, c.head_dim, c.mlp_dim, c.vocab_size, c.padded_vocab,
           c.bigram_vocab);
    print0(r, "  steps %d scheduled + %d extension, cooldown %.2f, split at step %d, block %d tokens, final long window %d\n",
           c.scheduled_iterations, c.extension_iterations, c.cooldown_frac, r.sch.split_step, c.block_size, c.final_ws_long);
    for (size_t i = 0; i < c.stages.size(); ++i) {
        const TrainingStage& st = c.stages[i];
        std::string mtp;
        for (size_t k = 0; k < st.mtp_start.size(); ++k)
            mtp += (k ? ", " : "") + std::to_string(st.mtp_start[k]).substr(0, 4) + "->" +
                   std::to_string(st.mtp_end[k]).substr(0, 4);
        print0(r, "  stage %zu: from step %d, batch %lld tokens, windows (%d, %d), lr_mul %.2f, mtp [%s]\n", i,
               r.sch.starts[i], static_cast<long long>(st.batch_tokens), st.ws_short, st.ws_long, st.lr_mul, mtp.c_str());
    }
    print0(r, "  adam lr %g eps %g wd %g; normuon lr %g beta2 %g wd %g, momentum %g->%g over %d steps, cool-down %d\n",
           c.adam_lr, c.adam_eps, c.adam_wd, c.normuon_lr, c.normuon_beta2, c.normuon_wd, c.muon_momentum_min,
           c.muon_momentum_max, c.muon_warmup_steps, c.muon_cooldown_steps);
    print0(r, "  world %d, grad_accum %d, val every %d steps on %lld tokens, train %s, val %s, seed %llu\n", r.d.world,
           c.grad_accum(), r.opt.val_every, static_cast<long long>(c.val_tokens), r.opt.train_files.c_str(),
           r.opt.val_files.c_str(), static_cast<unsigned long long>(r.opt.seed));
}

#ifndef TRAIN_GPT_NO_MAIN
// Rank 0 creates the log (exclusive: a log is never appended to another run's) and writes the
// embedded source files into it, each under a rule with its path.
void open_log(Run& r, const std::string& path) {
    r.log_path = path;
    r.log = std::fopen(path.c_str(), "wx");
    if (!r.log) fail("cannot create the log " + path + ": " + std::strerror(errno));
    g_log_fd = fileno(r.log);  // every line is flushed at once, so a direct write lands after the last
    // appending, as the other ranks' failure lines do, so that neither overwrites the other
    if (fcntl(g_log_fd, F_SETFL, fcntl(g_log_fd, F_GETFL) | O_APPEND) != 0)
        fail("cannot set the log " + path + " to append: " + std::strerror(errno));
    std::atexit(log_early_exit);
    std::printf("%s\n", path.c_str());
    const std::string rule(100, '-');
    for (size_t i = 0; i < kSourceFileCount; ++i) {
        const std::string head = rule + "\n// " + kSourceFiles[i].path + "\n" + rule + "\n";
        log_write(r, head.data(), head.size());
        log_write(r, kSourceFiles[i].text, std::strlen(kSourceFiles[i].text));
        log_write(r, "\n", 1);
    }
    const std::string end = std::string(100, '=') + "\n";
    log_write(r, end.data(), end.size());
}
#endif

// What follows the source: the environment, the header lines and the config, then a rule.
void log_preamble(Run& r) {
    log_environment(r, r.d);
    log_header(r, r.d);
    log_config(r);
    print0(r, "%s\n", std::string(100, '=').c_str());
}
