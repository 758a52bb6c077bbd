// The run's log: rank 0 prints every line to the console and the log file, which starts with the
// source that produced it (embedded at build time by cmake/embed_sources.cmake), then the
// environment, the header lines scripts/stats.py parses (the trainer adds its config). Every fatal
// error goes through fail(), which ends the log with a `fail:` line.
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

#include "../kernels/common.cuh"
#include "../kernels/matmul.cuh"  // cublasLtGetVersion
#include "distributed.h"
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

// Where the run's lines go: rank 0 prints them to the console and, once it is open, to the log file.
struct LogSink {
    int rank = 0;
    FILE* file = nullptr;  // rank 0's log (nullptr before open_log, after close_log, on other ranks)
    std::string path;
};

// Appends to the log and flushes; a full disk or any other write error stops the run (every rank,
// through host_abort) naming the file, so a log never ends silently short.
void log_write(LogSink& log, const char* text, size_t n) {
    if (!log.file) return;
    bool ok = std::fwrite(text, 1, n, log.file) == n && std::fflush(log.file) == 0;
    if constexpr (kEmulated) {
        // The CPU build's full disk for tests where no small file system can be mounted:
        // TRAIN_GPT_LOG_LIMIT=N fails every log write that would take the log past N bytes.
        static const char* limit = std::getenv("TRAIN_GPT_LOG_LIMIT");
        if (ok && limit && std::ftell(log.file) > std::atol(limit)) {
            ok = false;
            errno = ENOSPC;
        }
    }
    if (!ok) {
        const int err = errno;
        g_log_fd = -1;  // the log cannot take the failure line
        std::fclose(std::exchange(log.file, nullptr));
        fail("cannot write the log " + log.path + ": " + std::strerror(err));
    }
}

// Rank 0 prints to the console and the log file; every line is flushed (a crash keeps the log).
void log_vprint(LogSink& log, const char* fmt, va_list ap) {
    if (log.rank != 0) return;
    va_list again;
    va_copy(again, ap);
    const int n = std::max(std::vsnprintf(nullptr, 0, fmt, ap), 0);  // any length: a command line, nvidia-smi
    std::string line(size_t(n) + 1, '\0');
    std::vsnprintf(line.data(), line.size(), fmt, again);
    va_end(again);
    line.pop_back();
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
    log_write(log, line.data(), line.size());
}
void log_print(LogSink& log, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_vprint(log, fmt, ap);
    va_end(ap);
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

void log_environment(LogSink& log, const Distributed& d) {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, d.device));
    int devices = 0, driver = 0, runtime = 0, nccl = 0;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    CUDA_CHECK(cudaDriverGetVersion(&driver));
    CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    NCCL_CHECK(ncclGetVersion(&nccl));
    const char* build = kEmulated ? "CPU build (g++ against emu/)" : "GPU build (nvcc)";
    log_print(log, "%s, git %s, flags: %s\n", build,
#ifndef TRAIN_GPT_NO_MAIN
           kGitRevision,
#else
           "unknown",
#endif
           TRAIN_GPT_BUILD_FLAGS);
    log_print(log, "device: %s x %d visible, %d SMs; %d rank(s)\n", prop.name, devices, prop.multiProcessorCount, d.world);
    const std::string nccl_name = nccl ? std::to_string(nccl) : "none (runtime/nccl_world1.cpp, the one-rank stand-in)";
    log_print(log, "CUDA driver %d, runtime %d, cuBLASLt %zu, NCCL %s\n", driver, runtime, cublasLtGetVersion(), nccl_name.c_str());
    const std::string smi = command_output("nvidia-smi 2>/dev/null");
    if (!smi.empty()) log_print(log, "%s", smi.c_str());
    // What a reviewer of a record asks for, as `key: value` lines that scripts/stats.py puts in
    // statistics.md: the versions, and each GPU with its clocks at the start (none on a machine
    // without nvidia-smi; its failure message, which it prints to stdout, starts with no index).
    const size_t lt = cublasLtGetVersion();
    log_print(log, "cuda_driver: %d.%d\ncuda_runtime: %d.%d\n", driver / 1000, driver % 1000 / 10, runtime / 1000,
           runtime % 1000 / 10);
    log_print(log, "cublaslt: %zu.%zu.%zu\nnccl: %d.%d.%d\n", lt / 10000, lt / 100 % 100, lt % 100, nccl / 10000,
           nccl / 100 % 100, nccl % 100);
    const std::string gpus = command_output(
        "nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader "
        "2>/dev/null");
    for (size_t at = 0, end; at < gpus.size(); at = end + 1) {
        end = std::min(gpus.find('\n', at), gpus.size());
        const std::string line = gpus.substr(at, end - at);
        if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0]))) log_print(log, "gpu: %s\n", line.c_str());
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

// What the header says of the run: its command line, seed and id, and the checkpoint a resumed run
// continues (resumes_step -1: none).
struct RunHeader {
    std::string command;
    std::string preset;  // the config's own name (r89 for --preset record), which scripts/stats.py groups runs by
    uint64_t seed = 0;
    std::string run_id;
    std::string resumes_run_id;
    int resumes_step = -1;
};

// command, preset, date_utc, hosts, world_size, seed, run_id, resumes (a resumed run: the run id and step of
// the checkpoint it continues), source_hash: each line starts with its key.
void log_header(LogSink& log, const Distributed& d, const RunHeader& run) {
    const std::string hosts = host_list(d);
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
    log_print(log, "command: %s\n", run.command.c_str());
    log_print(log, "preset: %s\n", run.preset.c_str());
    log_print(log, "date_utc: %s\n", date);
    log_print(log, "hosts: %s\n", hosts.c_str());
    log_print(log, "world_size: %d\n", d.world);
    log_print(log, "seed: %llu\n", static_cast<unsigned long long>(run.seed));
    log_print(log, "run_id: %s\n", run.run_id.c_str());
    if (run.resumes_step >= 0)
        log_print(log, "resumes: %s step %d\n", run.resumes_run_id.empty() ? "(unknown)" : run.resumes_run_id.c_str(), run.resumes_step);
#ifndef TRAIN_GPT_NO_MAIN
    log_print(log, "source_hash: %s\n", source_hash().c_str());
#endif
}

#ifndef TRAIN_GPT_NO_MAIN
// Rank 0 creates the log (exclusive: a log is never appended to another run's) and writes the
// embedded source files into it, each under a rule with its path.
void open_log(LogSink& log, const std::string& path) {
    log.path = path;
    log.file = std::fopen(path.c_str(), "wx");
    if (!log.file) fail("cannot create the log " + path + ": " + std::strerror(errno));
    g_log_fd = fileno(log.file);  // every line is flushed at once, so a direct write lands after the last
    // appending, as the other ranks' failure lines do, so that neither overwrites the other
    if (fcntl(g_log_fd, F_SETFL, fcntl(g_log_fd, F_GETFL) | O_APPEND) != 0)
        fail("cannot set the log " + path + " to append: " + std::strerror(errno));
    std::atexit(log_early_exit);
    std::printf("%s\n", path.c_str());
    const std::string rule(100, '-');
    for (size_t i = 0; i < kSourceFileCount; ++i) {
        const std::string head = rule + "\n// " + kSourceFiles[i].path + "\n" + rule + "\n";
        log_write(log, head.data(), head.size());
        log_write(log, kSourceFiles[i].text, std::strlen(kSourceFiles[i].text));
        log_write(log, "\n", 1);
    }
    const std::string end = std::string(100, '=') + "\n";
    log_write(log, end.data(), end.size());
}
#endif

// The end of a finished run: the log is closed (a failed close is a write that did not land).
void close_log(LogSink& log) {
    if (log.file && std::fclose(std::exchange(log.file, nullptr)) != 0)
        fail("cannot write the log " + log.path + ": " + std::strerror(errno));
}
