// Stopping signals: a run stopped by a terminal or a job scheduler removes the checkpoint temp file it
// was writing and ends its log with `fail: stopped by <SIGNAL>`.
#pragma once
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <utility>

#include "checkpoint_format.h"
#include "log.h"

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

