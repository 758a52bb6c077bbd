// The prefix-token table of upstream record 88's prefix-token prediction loss (modded-nanogpt
// 75d6867a, build_prefix_table): p[v] is the token whose bytes are the longest proper prefix of
// token v's bytes that is itself a token, or -1 where none is ("ignore this term"). Upstream builds
// it from tiktoken at start-up and warms up with an all -1 table; we ship it as
// data/gpt2_prefix_table.bin (50304 int32 little-endian), made and checked against upstream's
// sha256 by scripts/make_prefix_table.py. This reader checks the size, every entry's range, that no
// entry points to itself, and the FNV-1a 64 checksum the script prints (a cheap stand-in for the
// sha256, which the script checks). Errors are DataError naming the file. Host code only (C++20).
#pragma once
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>

#include "data/shard.h"  // DataError, detail::Fd, detail::read_fully

namespace dataload {

constexpr int32_t kPrefixTableRows = 50304;                 // the model's padded vocabulary
constexpr uint64_t kPrefixTableFnv1a64 = 0x0da2e81f3537e45bull;  // printed by make_prefix_table.py

inline uint64_t fnv1a64(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

// Reads and checks a prefix table. expected_fnv is the checksum the whole file must have: the
// record's by default; tests pass their own for planted tables.
inline std::vector<int32_t> read_prefix_table(const std::string& path, uint64_t expected_fnv = kPrefixTableFnv1a64) {
    detail::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.fd < 0) throw DataError("cannot open prefix table " + path + ": " + detail::errno_text(errno));
    struct stat st {};
    if (::fstat(fd.fd, &st) != 0)
        throw DataError("cannot stat prefix table " + path + ": " + detail::errno_text(errno));
    const int64_t want_bytes = int64_t(kPrefixTableRows) * 4;
    if (st.st_size != want_bytes)
        throw DataError("prefix table " + path + " has " + std::to_string(st.st_size) + " bytes, expected " +
                        std::to_string(want_bytes) + " (" + std::to_string(kPrefixTableRows) + " int32)");
    std::vector<int32_t> table(kPrefixTableRows);
    if (detail::read_fully(fd.fd, table.data(), want_bytes, 0, path) != want_bytes)
        throw DataError("prefix table " + path + " ended early (changed while reading?)");
    // Range and self-reference first: they say which entry is wrong, the checksum only that one is.
    for (int32_t v = 0; v < kPrefixTableRows; ++v) {
        const int32_t p = table[v];
        if (p < -1 || p >= kPrefixTableRows)
            throw DataError("prefix table " + path + ": entry " + std::to_string(v) + " = " + std::to_string(p) +
                            " is outside [-1, " + std::to_string(kPrefixTableRows) + ")");
        if (p == v) throw DataError("prefix table " + path + ": entry " + std::to_string(v) + " points to itself");
    }
    const uint64_t got = fnv1a64(table.data(), size_t(want_bytes));
    if (got != expected_fnv) {
        char buf[96];
        std::snprintf(buf, sizeof buf, ": FNV-1a 64 0x%016llx, expected 0x%016llx", (unsigned long long)got,
                      (unsigned long long)expected_fnv);
        throw DataError("prefix table " + path + buf + " (not the table make_prefix_table.py makes)");
    }
    return table;
}

}  // namespace dataload
