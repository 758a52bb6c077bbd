// Token shards in the speedrun's on-disk format: a header of 256 little-endian int32 (magic
// 20240520, version 1, token count, the rest zero) followed by that many uint16 tokens.
// Reading validates everything and throws DataError naming the file and the problem, so a
// library caller can test the failure and a program's main can print it and exit non-zero;
// a shard is never silently truncated (upstream reads only the claimed count and ignores extra
// bytes; we refuse such a file, since it means the header and the data disagree).
// Host code only (C++20), no CUDA or MPI dependency.
#pragma once
#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dataload {

static_assert(std::endian::native == std::endian::little, "shards are little-endian; a big-endian host would need byte swaps");

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int64_t kHeaderInts = 256;
constexpr int64_t kHeaderBytes = kHeaderInts * 4;
constexpr uint16_t kBosId = 50256;  // <|endoftext|>: every document starts with it

// Every problem with the data or the loader's configuration; what() is the whole message.
struct DataError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

namespace detail {

inline std::string errno_text(int err) { return std::strerror(err); }

// Closes the descriptor on every path out, including throws.
struct Fd {
    int fd = -1;
    explicit Fd(int f) : fd(f) {}
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};

// Reads exactly n bytes at offset (pread loops over short reads and EINTR); returns the count
// actually read, which is less than n only at end of file.
inline int64_t read_fully(int fd, void* dst, int64_t n, int64_t offset, const std::string& path) {
    auto* p = static_cast<char*>(dst);
    int64_t done = 0;
    while (done < n) {
        // Large shards are read in pieces: a single pread is capped near 2 GiB on Linux anyway.
        const size_t chunk = static_cast<size_t>(std::min<int64_t>(n - done, int64_t(1) << 28));
        const ssize_t got = ::pread(fd, p + done, chunk, static_cast<off_t>(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            throw DataError("cannot read token shard " + path + ": " + errno_text(errno));
        }
        if (got == 0) break;
        done += got;
    }
    return done;
}

}  // namespace detail

// What a shard's header says, after checking it against the file's size.
struct ShardHeader {
    int64_t num_tokens = 0;
};

namespace detail {

inline ShardHeader check_header(int fd, const std::string& path) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw DataError("cannot stat token shard " + path + ": " + errno_text(errno));
    if (S_ISDIR(st.st_mode)) throw DataError("cannot read token shard " + path + ": it is a directory");
    const int64_t size = st.st_size;
    if (size < kHeaderBytes)
        throw DataError("token shard " + path + " is " + std::to_string(size) + " bytes, shorter than its " +
                        std::to_string(kHeaderBytes) + "-byte header");
    int32_t header[kHeaderInts];
    const int64_t got = read_fully(fd, header, kHeaderBytes, 0, path);
    if (got != kHeaderBytes)
        throw DataError("token shard " + path + " ended inside its header (read " + std::to_string(got) + " of " +
                        std::to_string(kHeaderBytes) + " bytes)");
    if (header[0] != kShardMagic)
        throw DataError("token shard " + path + " has magic number " + std::to_string(header[0]) + ", expected " +
                        std::to_string(kShardMagic) + " (not a token shard?)");
    if (header[1] != kShardVersion)
        throw DataError("token shard " + path + " has version " + std::to_string(header[1]) +
                        ", only version " + std::to_string(kShardVersion) + " is supported");
    const int64_t claimed = header[2];
    if (claimed < 0)
        throw DataError("token shard " + path + " claims a negative token count (" + std::to_string(claimed) + ")");
    const int64_t want = kHeaderBytes + 2 * claimed;
    if (size != want)
        throw DataError("token shard " + path + " claims " + std::to_string(claimed) + " tokens (" +
                        std::to_string(want) + " bytes with the header) but the file has " + std::to_string(size) +
                        " bytes");
    return {claimed};
}

inline int open_shard(const std::string& path) {
    int fd;
    do fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) throw DataError("cannot open token shard " + path + ": " + errno_text(errno));
    return fd;
}

}  // namespace detail

// Checks a shard's header and size without reading its tokens (cheap: lets a loader reject a
// bad file among many before training starts rather than when it reaches it).
inline ShardHeader read_shard_header(const std::string& path) {
    detail::Fd fd(detail::open_shard(path));
    return detail::check_header(fd.fd, path);
}

// The whole shard's tokens.
inline std::vector<uint16_t> read_shard(const std::string& path) {
    detail::Fd fd(detail::open_shard(path));
    const ShardHeader h = detail::check_header(fd.fd, path);
    std::vector<uint16_t> tokens(static_cast<size_t>(h.num_tokens));
    const int64_t want = 2 * h.num_tokens;
    const int64_t got = detail::read_fully(fd.fd, tokens.data(), want, kHeaderBytes, path);
    // The size was checked a moment ago, so only a file changed underneath us lands here.
    if (got != want)
        throw DataError("token shard " + path + " shrank while being read (" + std::to_string(got) + " of " +
                        std::to_string(want) + " token bytes)");
    return tokens;
}

// Writes a shard through a temporary file in the same directory and renames it into place, so
// a reader never sees a half-written shard and a failed write leaves nothing behind.
inline void write_shard(const std::string& path, const uint16_t* tokens, int64_t n) {
    if (n < 0 || n > INT32_MAX)
        throw DataError("cannot write token shard " + path + ": token count " + std::to_string(n) +
                        " does not fit the int32 header");
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    int fd;
    do fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) throw DataError("cannot create " + tmp + ": " + detail::errno_text(errno));
    auto fail = [&](const std::string& what, int err) {
        ::close(fd);
        ::unlink(tmp.c_str());
        throw DataError("cannot write token shard " + path + ": " + what + ": " + detail::errno_text(err));
    };
    auto put = [&](const void* src, int64_t bytes) {
        const auto* p = static_cast<const char*>(src);
        while (bytes > 0) {
            const ssize_t w = ::write(fd, p, static_cast<size_t>(std::min<int64_t>(bytes, int64_t(1) << 28)));
            if (w < 0) {
                if (errno == EINTR) continue;
                fail("write", errno);
            }
            p += w;
            bytes -= w;
        }
    };
    int32_t header[kHeaderInts] = {};
    header[0] = kShardMagic;
    header[1] = kShardVersion;
    header[2] = static_cast<int32_t>(n);
    put(header, kHeaderBytes);
    put(tokens, 2 * n);
    if (::close(fd) != 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        throw DataError("cannot write token shard " + path + ": close: " + detail::errno_text(err));
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        throw DataError("cannot write token shard " + path + ": rename: " + detail::errno_text(err));
    }
}
inline void write_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
    write_shard(path, tokens.data(), static_cast<int64_t>(tokens.size()));
}

// The files a pattern names, in the order Python's sorted(glob.glob(pattern)) gives (byte-wise,
// not the locale's collation that glob(3) would use), so shards are visited as upstream does.
inline std::vector<std::string> expand_glob(const std::string& pattern) {
    glob_t g{};
    const int rc = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g);
    std::vector<std::string> files;
    if (rc == 0)
        for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (rc != 0 && rc != GLOB_NOMATCH)
        throw DataError("cannot expand file pattern " + pattern + " (glob error " + std::to_string(rc) + ")");
    if (files.empty()) throw DataError("no files match " + pattern);
    std::sort(files.begin(), files.end());
    return files;
}

}  // namespace dataload
