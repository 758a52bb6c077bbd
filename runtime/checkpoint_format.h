// Checkpoint files: named tensors and string metadata, one file per rank, in the safetensors
// layout so outside tools (the `safetensors` Python package, scripts/read_checkpoint.py) read
// them as they are.
//
// The format (every integer little-endian):
//   bytes [0, 8)       N, a uint64: the length of the header. N is a multiple of 8, so the data
//                      section starts at an 8-byte-aligned file offset, and at most 100,000,000.
//   bytes [8, 8+N)     the header: one UTF-8 JSON object, padded at its end with spaces (0x20)
//                      to N bytes. It has one member per tensor,
//                        "NAME": {"dtype": DTYPE, "shape": [d0, d1, ...], "data_offsets": [BEGIN, END]}
//                      with DTYPE one of "BF16", "F32", "U16", "I32", "I64", "U8" (2, 4, 2, 4, 8
//                      and 1 bytes per element), shape [] for a scalar (one element), a 0 in the
//                      shape for an empty tensor, and END - BEGIN = product(shape) * element size;
//                      and one member "__metadata__": {"KEY": "VALUE", ...}, values strings only.
//                      Names and keys are unique (JSON object members).
//                      BEGIN and END are byte offsets into the data section. The tensors tile it:
//                      the first begins at 0, each begins where the previous ended, and the last
//                      ends at the end of the file.
//   bytes [8+N, end)   the data section: each tensor's elements, row-major, raw little-endian.
//
// The writer emits "__metadata__" first, then the tensors in the order they were added, with
// increasing offsets, and no whitespace inside the JSON (nlohmann-json's compact dump: " and \ as
// \" and \\, backspace, tab, newline, form feed and carriage return as \b \t \n \f \r, other
// control characters as \u00XX, all other characters as raw UTF-8). The reader takes members in any
// order (the offsets, not the member order, place the tensors; "__metadata__" may be absent, as in
// files other tools write). The header is untrusted input: nlohmann-json parses it (RFC 8259 JSON,
// valid UTF-8, every escape), and the reader accepts only the part of JSON the schema uses: objects,
// arrays, strings and integers in [0, 2^64), nested at most 16 deep, with no duplicate member
// names. It rejects everything else (true/false/null, negative numbers, fractions and exponents,
// duplicate keys, members the schema does not name) with a CheckpointError naming the file and the
// problem, and a JSON syntax error with the header byte it is at.
//
// Writing goes through PATH.tmp.<host>.<pid>, synced to disk, then renamed over PATH, then the
// directory synced: a reader sees the previous checkpoint or the new one, never a mix, even when
// the writer is killed (which leaves only its temp file behind: remove_stale_temps() clears those
// of dead processes of this host, and remove_active_temp() is a signal handler's way to remove the
// process's own). Tensor bytes are streamed in both directions (no whole-file buffer), with 64-bit
// offsets throughout, and the writer returns the file's size and CRC-32C.
//
// A checkpoint directory holds one file per rank and, written last, a manifest (manifest.json:
// {"meta": {"KEY": "VALUE", ...}, "files": [{"name": N, "bytes": B, "crc32c": "8 hex digits"}, ...]},
// the same JSON subset) that makes the files one unit: verify_file() checks a file against it.
// Host code only (C++20, POSIX, nlohmann-json's headers), no CUDA or MPI dependency.
#pragma once
#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <array>
#include <csignal>

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace ckpt {

static_assert(std::endian::native == std::endian::little, "checkpoints are little-endian; a big-endian host would need byte swaps");

// Every problem with a checkpoint file or with what a caller asks of one; what() is the whole message.
struct CheckpointError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The largest header accepted (the same cap as the safetensors package): a bigger length field
// means a corrupted or foreign file, not a real header.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Bytes per element of a dtype name, 0 for a name the format does not know.
inline size_t dtype_size(std::string_view dtype) {
    if (dtype == "BF16" || dtype == "U16") return 2;
    if (dtype == "F32" || dtype == "I32") return 4;
    if (dtype == "I64") return 8;
    if (dtype == "U8") return 1;
    return 0;
}

// ---- CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial and final inversion), the
// checksum of iSCSI, ext4 and SSE4.2's crc32 instruction; "123456789" gives 0xE3069283. On x86-64
// with SSE4.2 that instruction, eight bytes at a time; elsewhere eight bytes at a time from tables
// built at compile time ("slicing-by-8"): 4.6 and 1.4 GB/s on a 2-core Xeon under load (256 MiB,
// 2026-11-28). Either way a checkpoint's files are summed while they are written. ----
namespace detail {
using Crc32cTables = std::array<std::array<uint32_t, 256>, 8>;
constexpr Crc32cTables make_crc32c_tables() {
    Crc32cTables t{};
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s)
        for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    return t;
}
inline constexpr Crc32cTables kCrc32c = make_crc32c_tables();

// Both as crc32c below (the CRC of `crc`'s bytes followed by n more at data).
inline uint32_t crc32c_tables(uint32_t crc, const void* data, size_t n) {
    const auto& t = kCrc32c;
    const auto* p = static_cast<const unsigned char*>(data);
    uint32_t c = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo, hi;
        std::memcpy(&lo, p, 4);
        std::memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^
            t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    }
    for (; n > 0; --n, ++p) c = (c >> 8) ^ t[0][(c ^ *p) & 0xFF];
    return ~c;
}
#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline uint32_t crc32c_sse42(uint32_t crc, const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    uint64_t c64 = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        c64 = __builtin_ia32_crc32di(c64, v);
    }
    auto c = static_cast<uint32_t>(c64);
    for (; n > 0; --n, ++p) c = __builtin_ia32_crc32qi(c, *p);
    return ~c;
}
inline bool have_sse42() {
    static const bool yes = __builtin_cpu_supports("sse4.2");
    return yes;
}
#endif
}  // namespace detail

// The CRC-32C of `crc`'s bytes followed by n more at data: crc32c(crc32c(0, a), b) == crc32c(0, ab).
inline uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
    if (detail::have_sse42()) return detail::crc32c_sse42(crc, data, n);
#endif
    return detail::crc32c_tables(crc, data, n);
}

// What a file holds, in the two numbers a manifest records.
struct FileDigest {
    uint64_t bytes = 0;
    uint32_t crc32c = 0;
    bool operator==(const FileDigest&) const = default;
};

inline std::string crc_text(uint32_t crc) {
    char s[16];
    std::snprintf(s, sizeof s, "%08x", crc);
    return s;
}

namespace detail {

inline std::string errno_text(int err) { return std::strerror(err); }

// s as a JSON string literal, for headers and for messages (bytes that are not UTF-8 show as U+FFFD,
// so a message can always name what it refuses).
inline std::string json_quote(std::string_view s) {
    return nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

inline bool valid_utf8(std::string_view s) {
    try {
        (void)nlohmann::json(std::string(s)).dump();  // the strict dump refuses ill-formed UTF-8
        return true;
    } catch (const nlohmann::json::type_error&) {
        return false;
    }
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

// product(shape) * element size, or false when a dimension is negative or the product overflows.
inline bool tensor_bytes(const std::vector<int64_t>& shape, size_t elem, uint64_t& bytes) {
    uint64_t n = elem;
    for (const int64_t d : shape) {
        if (d < 0) return false;
        if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
    }
    bytes = n;
    return true;
}

// Closes the descriptor on every path out, including throws.
struct Fd {
    int fd = -1;
    Fd() = default;
    explicit Fd(int f) : fd(f) {}
    Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
    Fd& operator=(Fd&& o) noexcept {
        if (this != &o) {
            reset();
            fd = std::exchange(o.fd, -1);
        }
        return *this;
    }
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    ~Fd() { reset(); }
    void reset() {
        if (fd >= 0) ::close(fd);
        fd = -1;
    }
};

inline int open_retry(const char* path, int flags, mode_t mode = 0) {
    int fd;
    do fd = ::open(path, flags, mode);
    while (fd < 0 && errno == EINTR);
    return fd;
}

// One request per call is capped (Linux moves at most ~2 GiB per read/write), so big tensors go
// in pieces.
constexpr uint64_t kIoChunk = uint64_t(1) << 26;

// Reads up to n bytes at offset, looping over short reads and EINTR; returns the count read,
// less than n only at end of file; -1 with errno set on an error.
inline int64_t pread_fully(int fd, void* dst, uint64_t n, uint64_t offset) {
    auto* p = static_cast<char*>(dst);
    uint64_t done = 0;
    while (done < n) {
        const ssize_t got = ::pread(fd, p + done, static_cast<size_t>(std::min(n - done, kIoChunk)),
                                    static_cast<off_t>(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) break;
        done += static_cast<uint64_t>(got);
    }
    return static_cast<int64_t>(done);
}

// Writes all n bytes, looping over short writes and EINTR, and adds them to *digest when given;
// false with errno set on an error.
inline bool write_fully(int fd, const void* src, uint64_t n, FileDigest* digest = nullptr) {
    const auto* p = static_cast<const char*>(src);
    if (digest) {
        for (uint64_t done = 0; done < n; done += kIoChunk)
            digest->crc32c = crc32c(digest->crc32c, p + done, static_cast<size_t>(std::min(n - done, kIoChunk)));
        digest->bytes += n;
    }
    while (n > 0) {
        const ssize_t w = ::write(fd, p, static_cast<size_t>(std::min(n, kIoChunk)));
        if (w < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        p += w;
        n -= static_cast<uint64_t>(w);
    }
    return true;
}

// The host name as temp file names carry it (characters other than [A-Za-z0-9-] become '-', so
// the name stays one path component and the pid after its last '.' is unambiguous).
inline std::string host_tag() {
    char h[256] = {};
    if (::gethostname(h, sizeof h - 1) != 0) return "unknown-host";
    std::string t = h;
    for (char& c : t)
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-')) c = '-';
    return t.empty() ? "unknown-host" : t;
}

// The temp file this process is writing, for a signal handler (fixed storage: no allocation there).
inline char active_temp[4096];
inline volatile std::sig_atomic_t active_temp_set = 0;

// Marks `tmp` as the active temp file while it exists (a signal handler may remove it).
struct ActiveTemp {
    explicit ActiveTemp(const std::string& tmp) {
        if (tmp.size() < sizeof active_temp) {
            std::memcpy(active_temp, tmp.c_str(), tmp.size() + 1);
            active_temp_set = 1;
        }
    }
    ~ActiveTemp() { active_temp_set = 0; }
    ActiveTemp(const ActiveTemp&) = delete;
    ActiveTemp& operator=(const ActiveTemp&) = delete;
};

// Syncs the directory holding `path`, making a rename into it durable; false with errno set.
inline bool sync_parent_dir(const std::string& path, std::string& dir) {
    const size_t slash = path.find_last_of('/');
    dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
    Fd d(open_retry(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    return d.fd >= 0 && ::fsync(d.fd) == 0;
}

// The parsed header: a JSON value of the accepted subset. An object's member names are in keys, in
// text order, its values at the same index in items (a vector of the type being defined is fine; a
// pair of it would not be).
struct Json {
    enum Kind { Object, Array, String, Integer } kind = Integer;
    std::string str;
    uint64_t num = 0;
    std::vector<std::string> keys;  // an object's, in text order
    std::vector<Json> items;        // an array's elements or an object's values
};

// Builds a Json from nlohmann-json's parse events, refusing what the format never holds. Its own
// tree (not nlohmann::json's) keeps the members' text order and sees duplicate names, which
// nlohmann::json would silently merge (last one wins: two readers could disagree about a file).
class JsonSubset : public nlohmann::json_sax<nlohmann::json> {
  public:
    explicit JsonSubset(const std::string& path) : path_(path) {}

    // The one top-level object of text; after it only whitespace (the padding) may follow.
    static Json parse(const std::string& text, const std::string& path) {
        JsonSubset b(path);
        nlohmann::json::sax_parse(text, &b, nlohmann::json::input_format_t::json, /*strict=*/true);
        return std::move(b.root_);
    }

    bool null() override { fail("null is not allowed"); }
    bool boolean(bool v) override { fail(std::string(v ? "true" : "false") + " is not allowed"); }
    bool number_integer(number_integer_t v) override {
        fail("negative numbers are not allowed, found " + std::to_string(v));
    }
    bool number_unsigned(number_unsigned_t v) override {
        Json j;
        j.num = v;
        place(std::move(j));
        return true;
    }
    // nlohmann-json reads an integer past 2^64 - 1 as a float too.
    bool number_float(number_float_t, const string_t& text) override {
        if (text.find_first_of(".eE") == std::string::npos) fail("integer " + text + " does not fit in 64 bits");
        fail("only integers are allowed (no fraction or exponent), found " + text);
    }
    bool string(string_t& v) override {
        Json j;
        j.kind = Json::String;
        j.str = std::move(v);
        place(std::move(j));
        return true;
    }
    bool binary(binary_t&) override { fail("binary data is not JSON"); }  // only the binary formats give it
    bool start_object(std::size_t) override { return open(Json::Object); }
    bool key(string_t& k) override {
        if (!names_.back().insert(k).second) fail("duplicate member " + json_quote(k));
        open_.back()->keys.push_back(std::move(k));
        return true;
    }
    bool end_object() override { return close(); }
    bool start_array(std::size_t) override { return open(Json::Array); }
    bool end_array() override { return close(); }
    bool parse_error(std::size_t position, const std::string&, const nlohmann::json::exception& e) override {
        // position counts the bytes read, the offending one last; the reason follows "line L, column C: ".
        const std::string what = e.what();
        const size_t column = what.find(", column ");
        const size_t colon = column == std::string::npos ? std::string::npos : what.find(": ", column);
        const std::string reason = colon == std::string::npos ? what : what.substr(colon + 2);
        throw CheckpointError("checkpoint " + path_ + ": bad header JSON at byte " + std::to_string(position ? position - 1 : 0) +
                              " of the header: " + printable(reason));
    }

  private:
    // Our schema nests three deep; anything much deeper is not a checkpoint header.
    static constexpr size_t kMaxDepth = 16;

    [[noreturn]] void fail(const std::string& what) const {
        throw CheckpointError("checkpoint " + path_ + ": bad header JSON: " + what);
    }
    // nlohmann-json quotes the bytes it last read; those that are not printable ASCII become \xNN.
    static std::string printable(const std::string& s) {
        std::string out;
        for (const char ch : s) {
            const auto c = static_cast<unsigned char>(ch);
            if (c >= 0x20 && c < 0x7F) {
                out += ch;
            } else {
                char hex[8];
                std::snprintf(hex, sizeof hex, "\\x%02x", c);
                out += hex;
            }
        }
        return out;
    }
    // A value where the parse is: the document itself (which must be an object), or the next item
    // of the innermost open object or array. Returns where it now lives.
    Json* place(Json v) {
        if (open_.empty()) {
            if (v.kind != Json::Object) fail("the header is not a JSON object");
            root_ = std::move(v);
            return &root_;
        }
        // The innermost container's items only grow while it is innermost: pointers to the
        // enclosing containers' last items stay valid.
        open_.back()->items.push_back(std::move(v));
        return &open_.back()->items.back();
    }
    bool open(Json::Kind kind) {
        if (open_.size() >= kMaxDepth) fail("nested deeper than " + std::to_string(kMaxDepth) + " levels");
        Json v;
        v.kind = kind;
        open_.push_back(place(std::move(v)));
        names_.emplace_back();
        return true;
    }
    bool close() {
        open_.pop_back();
        names_.pop_back();
        return true;
    }

    const std::string& path_;
    Json root_;
    std::vector<Json*> open_;                     // the objects and arrays being read, outermost first
    std::vector<std::set<std::string>> names_;    // their member names so far (none for arrays)
};

}  // namespace detail

// Where a file is written before it is renamed to `path`: PATH.tmp.<host>.<pid>.
inline std::string temp_path(const std::string& path) {
    return path + ".tmp." + detail::host_tag() + "." + std::to_string(::getpid());
}

// Async-signal-safe: removes the temp file this process is writing, if any (SIGINT/SIGTERM handlers).
inline void remove_active_temp() {
    if (detail::active_temp_set) ::unlink(detail::active_temp);
}

// Removes the temp files in `dir` that processes of this host left when they died (their pid is
// gone), and returns their names. Those of live processes and of other hosts (a shared file system)
// are left alone: their writers may still be at work.
inline std::vector<std::string> remove_stale_temps(const std::string& dir) {
    std::vector<std::string> removed;
    DIR* d = ::opendir(dir.c_str());
    if (!d) return removed;
    const std::string mark = ".tmp." + detail::host_tag() + ".";
    while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        const size_t at = name.rfind(mark);
        if (at == std::string::npos || at + mark.size() >= name.size()) continue;
        const std::string pid_text = name.substr(at + mark.size());
        if (pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9) continue;
        const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
        if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
        if (::unlink((dir + "/" + name).c_str()) == 0) removed.push_back(name);
    }
    ::closedir(d);
    return removed;
}

// Collects metadata and tensors, then writes them as one checkpoint file. The tensors' bytes are
// not copied: each data pointer must stay valid until write() returns.
class CheckpointWriter {
  public:
    // A string the trainer wants back on resume (step, config, RNG state...). Keys are unique.
    void meta(const std::string& key, const std::string& value) {
        if (!detail::valid_utf8(key) || !detail::valid_utf8(value))
            throw CheckpointError("checkpoint metadata " + detail::json_quote(key) + ": key and value must be valid UTF-8");
        for (const auto& m : meta_)
            if (m.first == key) throw CheckpointError("checkpoint metadata key " + detail::json_quote(key) + " given twice");
        meta_.emplace_back(key, value);
    }

    // A tensor of `bytes` bytes at `data`, which must be product(shape) elements of dtype.
    void tensor(const std::string& name, const char* dtype, std::vector<int64_t> shape, const void* data, size_t bytes) {
        const std::string q = detail::json_quote(name);
        if (name.empty() || name == "__metadata__" || !detail::valid_utf8(name))
            throw CheckpointError("checkpoint tensor " + q + ": a name must be non-empty valid UTF-8 other than \"__metadata__\"");
        const size_t elem = dtype ? dtype_size(dtype) : 0;
        if (!elem)
            throw CheckpointError("checkpoint tensor " + q + ": unknown dtype " +
                                  (dtype ? detail::json_quote(dtype) : std::string("(null)")) +
                                  " (known: BF16 F32 U16 I32 I64 U8)");
        uint64_t want = 0;
        if (!detail::tensor_bytes(shape, elem, want))
            throw CheckpointError("checkpoint tensor " + q + ": shape " + detail::shape_text(shape) +
                                  " has a negative dimension or too many elements");
        if (want != bytes)
            throw CheckpointError("checkpoint tensor " + q + ": " + std::to_string(bytes) + " bytes given, but shape " +
                                  detail::shape_text(shape) + " of " + dtype + " is " + std::to_string(want) + " bytes");
        if (bytes && !data) throw CheckpointError("checkpoint tensor " + q + ": null data for " + std::to_string(bytes) + " bytes");
        for (const auto& t : tensors_)
            if (t.name == name) throw CheckpointError("checkpoint tensor " + q + " added twice");
        tensors_.push_back({name, dtype, std::move(shape), data, bytes});
    }

    // The header text, padding included (what lands at file bytes [8, 8+N)).
    std::string header() const {
        nlohmann::ordered_json h;  // members in insertion order
        auto& meta = h["__metadata__"] = nlohmann::ordered_json::object();
        for (const auto& [key, value] : meta_) meta[key] = value;
        uint64_t offset = 0;
        for (const auto& t : tensors_) {
            h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
            offset += t.bytes;
        }
        std::string text = h.dump();
        text.append((8 - text.size() % 8) % 8, ' ');
        return text;
    }

    // Writes the file atomically (see the top of this file) and returns its size and CRC-32C;
    // throws CheckpointError naming the path and the system's reason, leaving no temp file and
    // whatever was at path untouched.
    FileDigest write(const std::string& path) const {
        const std::string tmp = temp_path(path);
        // Called as fail(errno, ...) right after the failing call: no argument allocates, so errno
        // is still the failing call's.
        const auto fail = [&](int err, const char* step, const std::string& file, const char* tail = "") {
            throw CheckpointError("cannot write checkpoint " + path + ": " + step + " " + file + tail + ": " +
                                  detail::errno_text(err));
        };
        const std::string h = header();
        if (h.size() > kMaxHeaderBytes)
            throw CheckpointError("cannot write checkpoint " + path + ": its header would be " + std::to_string(h.size()) +
                                  " bytes, more than the " + std::to_string(kMaxHeaderBytes) + "-byte limit readers accept");
        FileDigest digest;
        {
            const detail::ActiveTemp active(tmp);
            // Until the rename, any way out removes the temp file.
            struct TempFile {
                const std::string& tmp;
                detail::Fd fd;
                bool keep = false;
                ~TempFile() {
                    fd.reset();
                    if (!keep) ::unlink(tmp.c_str());
                }
            } file{tmp, detail::Fd(detail::open_retry(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644))};
            if (file.fd.fd < 0) {
                const int err = errno;
                file.keep = true;  // nothing was created
                fail(err, "cannot create temporary file", tmp);
            }
            const uint64_t n = h.size();
            bool ok = detail::write_fully(file.fd.fd, &n, 8, &digest) && detail::write_fully(file.fd.fd, h.data(), n, &digest);
            for (size_t i = 0; ok && i < tensors_.size(); ++i)
                ok = detail::write_fully(file.fd.fd, tensors_[i].data, tensors_[i].bytes, &digest);
            if (!ok) fail(errno, "writing", tmp);
            if (::fsync(file.fd.fd) != 0) fail(errno, "fsync of", tmp);
            if (::close(std::exchange(file.fd.fd, -1)) != 0) fail(errno, "closing", tmp);
            if (::rename(tmp.c_str(), path.c_str()) != 0) fail(errno, "renaming", tmp, " into place");
            file.keep = true;
        }
        // The rename is durable only once the directory entry is on disk.
        std::string dir;
        if (!detail::sync_parent_dir(path, dir)) fail(errno, "syncing its directory", dir);
        return digest;
    }

  private:
    struct Tensor {
        std::string name;
        std::string dtype;
        std::vector<int64_t> shape;
        const void* data;
        size_t bytes;
    };
    std::vector<std::pair<std::string, std::string>> meta_;
    std::vector<Tensor> tensors_;
};

// Opens and validates a checkpoint (header and sizes; tensor bytes are read only on request).
// Keeps the file open: read() takes tensors one at a time, each straight into the caller's buffer.
class CheckpointReader {
  public:
    struct Info {
        std::string dtype;
        std::vector<int64_t> shape;
        size_t offset;  // where the tensor's bytes start in the file: 8 + N + BEGIN
        size_t bytes;
    };

    explicit CheckpointReader(const std::string& path) : path_(path) {
        fd_ = detail::Fd(detail::open_retry(path.c_str(), O_RDONLY | O_CLOEXEC));
        if (fd_.fd < 0) throw CheckpointError("cannot open checkpoint " + path + ": " + detail::errno_text(errno));
        struct stat st {};
        if (::fstat(fd_.fd, &st) != 0) throw CheckpointError("cannot stat checkpoint " + path + ": " + detail::errno_text(errno));
        if (S_ISDIR(st.st_mode)) throw CheckpointError("cannot read checkpoint " + path + ": it is a directory");
        const uint64_t size = static_cast<uint64_t>(st.st_size);
        if (size < 8)
            throw CheckpointError("checkpoint " + path + " is " + std::to_string(size) +
                                  " bytes, too short for its 8-byte header length");
        uint64_t n = 0;
        if (detail::pread_fully(fd_.fd, &n, 8, 0) != 8)
            throw CheckpointError("cannot read checkpoint " + path + ": " + detail::errno_text(errno));
        if (n > size - 8)
            throw CheckpointError("checkpoint " + path + " declares a " + std::to_string(n) +
                                  "-byte header, beyond the end of the " + std::to_string(size) + "-byte file");
        if (n > kMaxHeaderBytes)
            throw CheckpointError("checkpoint " + path + " declares a " + std::to_string(n) + "-byte header, more than the " +
                                  std::to_string(kMaxHeaderBytes) + "-byte limit");
        if (n % 8 != 0)
            throw CheckpointError("checkpoint " + path + " declares a " + std::to_string(n) +
                                  "-byte header, not a multiple of 8 (the data section must be 8-byte aligned)");
        std::string text(static_cast<size_t>(n), '\0');
        if (detail::pread_fully(fd_.fd, text.data(), n, 8) != static_cast<int64_t>(n))
            throw CheckpointError("cannot read checkpoint " + path + "'s header: " + detail::errno_text(errno));
        parse_header(detail::JsonSubset::parse(text, path), 8 + n, size);
    }

    // A metadata value; throws naming the key when the file has none.
    const std::string& meta(const std::string& key) const {
        const auto it = meta_.find(key);
        if (it == meta_.end()) throw CheckpointError("checkpoint " + path_ + " has no metadata key " + detail::json_quote(key));
        return it->second;
    }
    bool has_meta(const std::string& key) const { return meta_.count(key) != 0; }

    bool has(const std::string& name) const { return index_.count(name) != 0; }

    const Info& info(const std::string& name) const { return infos_[find(name)].second; }

    // The tensor's bytes into dst, which holds exactly `bytes` (its size, checked).
    void read(const std::string& name, void* dst, size_t bytes) const {
        const Info& in = infos_[find(name)].second;
        if (bytes != in.bytes)
            throw CheckpointError("checkpoint " + path_ + ": tensor " + detail::json_quote(name) + " is " +
                                  std::to_string(in.bytes) + " bytes (" + in.dtype + " " + detail::shape_text(in.shape) +
                                  "), the caller's buffer " + std::to_string(bytes));
        const int64_t got = detail::pread_fully(fd_.fd, dst, in.bytes, in.offset);
        if (got < 0)
            throw CheckpointError("cannot read tensor " + detail::json_quote(name) + " of checkpoint " + path_ + ": " +
                                  detail::errno_text(errno));
        // The size was checked at open, so only a file changed underneath us lands here.
        if (static_cast<uint64_t>(got) != in.bytes)
            throw CheckpointError("checkpoint " + path_ + " shrank while tensor " + detail::json_quote(name) + " was read");
    }

    // The tensor names in data order (which is the order the writer added them).
    std::vector<std::string> names() const {
        std::vector<std::string> out;
        out.reserve(infos_.size());
        for (const auto& e : infos_) out.push_back(e.first);
        return out;
    }

    const std::string& path() const { return path_; }

  private:
    size_t find(const std::string& name) const {
        const auto it = index_.find(name);
        if (it == index_.end()) throw CheckpointError("checkpoint " + path_ + " has no tensor " + detail::json_quote(name));
        return it->second;
    }

    [[noreturn]] void bad(const std::string& what) const { throw CheckpointError("checkpoint " + path_ + ": " + what); }

    // Checks the parsed header against the schema and the file size, filling meta_ and infos_.
    void parse_header(const detail::Json& doc, uint64_t data_start, uint64_t file_size) {
        using detail::Json;
        using detail::json_quote;
        struct Range {
            uint64_t begin, end;
            size_t index;
        };
        std::vector<Range> ranges;
        for (size_t m = 0; m < doc.keys.size(); ++m) {
            const std::string& name = doc.keys[m];
            const Json& v = doc.items[m];
            const std::string q = json_quote(name);
            if (name == "__metadata__") {
                if (v.kind != Json::Object) bad("\"__metadata__\" is not an object");
                for (size_t k = 0; k < v.keys.size(); ++k) {
                    if (v.items[k].kind != Json::String) bad("metadata value of " + json_quote(v.keys[k]) + " is not a string");
                    meta_.emplace(v.keys[k], v.items[k].str);
                }
                continue;
            }
            if (v.kind != Json::Object) bad("tensor " + q + " is not an object");
            const Json *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
            for (size_t k = 0; k < v.keys.size(); ++k) {
                const std::string& key = v.keys[k];
                if (key == "dtype") dtype = &v.items[k];
                else if (key == "shape") shape = &v.items[k];
                else if (key == "data_offsets") offsets = &v.items[k];
                else bad("tensor " + q + " has an unknown field " + json_quote(key));
            }
            if (!dtype || !shape || !offsets) bad("tensor " + q + " lacks its \"" +
                                                  std::string(!dtype ? "dtype" : !shape ? "shape" : "data_offsets") + "\" field");
            if (dtype->kind != Json::String) bad("tensor " + q + ": \"dtype\" is not a string");
            const size_t elem = dtype_size(dtype->str);
            if (!elem) bad("tensor " + q + " has unknown dtype " + json_quote(dtype->str) + " (known: BF16 F32 U16 I32 I64 U8)");
            if (shape->kind != Json::Array) bad("tensor " + q + ": \"shape\" is not an array");
            Info info{dtype->str, {}, 0, 0};
            for (const auto& d : shape->items) {
                if (d.kind != Json::Integer || d.num > uint64_t(INT64_MAX))
                    bad("tensor " + q + ": \"shape\" holds something other than a dimension (a non-negative 64-bit integer)");
                info.shape.push_back(static_cast<int64_t>(d.num));
            }
            if (offsets->kind != Json::Array || offsets->items.size() != 2 || offsets->items[0].kind != Json::Integer ||
                offsets->items[1].kind != Json::Integer)
                bad("tensor " + q + ": \"data_offsets\" is not a pair of integers [begin, end]");
            const uint64_t begin = offsets->items[0].num, end = offsets->items[1].num;
            const std::string range = "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
            if (end < begin) bad("tensor " + q + ": data_offsets " + range + " end before they begin");
            uint64_t want = 0;
            if (!detail::tensor_bytes(info.shape, elem, want))
                bad("tensor " + q + ": shape " + detail::shape_text(info.shape) + " has too many elements");
            if (want != end - begin)
                bad("tensor " + q + " is " + info.dtype + " " + detail::shape_text(info.shape) + " (" + std::to_string(want) +
                    " bytes) but its data_offsets " + range + " span " + std::to_string(end - begin) + " bytes");
            info.bytes = static_cast<size_t>(end - begin);
            info.offset = static_cast<size_t>(data_start + begin);
            ranges.push_back({begin, end, infos_.size()});
            infos_.emplace_back(name, std::move(info));
        }
        // The tensors must tile the data section: sorted by where they start, each starts where the
        // previous ended (empty tensors sort before a non-empty one at the same offset).
        std::stable_sort(ranges.begin(), ranges.end(),
                         [](const Range& a, const Range& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
        uint64_t at = 0;
        std::string prev;
        for (const Range& r : ranges) {
            const std::string& name = infos_[r.index].first;
            if (r.begin != at) {
                const std::string range = "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + "]";
                if (prev.empty())
                    bad("the first tensor's data, " + json_quote(name) + " at " + range + ", does not begin at 0");
                bad("tensor " + json_quote(name) + " at data_offsets " + range + (r.begin < at ? " overlaps" : " leaves a gap after") +
                    " tensor " + json_quote(prev) + ", which ends at " + std::to_string(at));
            }
            at = r.end;
            prev = name;
        }
        const uint64_t have = file_size - data_start;
        if (have < at)
            bad("the file is truncated: its header describes " + std::to_string(at) + " bytes of tensor data, but only " +
                std::to_string(have) + " follow the header");
        if (have > at)
            bad("the file has " + std::to_string(have) + " bytes after the header, more than the " + std::to_string(at) +
                " bytes of tensor data its header describes");
        std::vector<std::pair<std::string, Info>> sorted;
        sorted.reserve(infos_.size());
        for (const Range& r : ranges) sorted.push_back(std::move(infos_[r.index]));
        infos_ = std::move(sorted);
        for (size_t i = 0; i < infos_.size(); ++i) index_.emplace(infos_[i].first, i);
    }

    std::string path_;
    detail::Fd fd_;
    std::map<std::string, std::string> meta_;
    std::vector<std::pair<std::string, Info>> infos_;  // in data order
    std::map<std::string, size_t> index_;
};

// ---- the manifest: what makes a directory of rank files one checkpoint ----

constexpr const char* kManifestName = "manifest.json";

struct ManifestFile {
    std::string name;  // relative to the directory
    FileDigest digest;
};

struct Manifest {
    std::vector<std::pair<std::string, std::string>> meta;  // in the order written
    std::vector<ManifestFile> files;

    // A metadata value; throws naming the key and the manifest when it has none.
    const std::string& get(const std::string& key, const std::string& path) const {
        for (const auto& m : meta)
            if (m.first == key) return m.second;
        throw CheckpointError("manifest " + path + " has no " + detail::json_quote(key));
    }
};

inline std::string manifest_path(const std::string& dir) { return dir + "/" + kManifestName; }

// The size and CRC-32C of a file's bytes, streamed.
inline FileDigest file_digest(const std::string& path) {
    detail::Fd fd(detail::open_retry(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.fd < 0) throw CheckpointError("cannot open " + path + ": " + detail::errno_text(errno));
    std::vector<unsigned char> buf(size_t(1) << 22);
    FileDigest d;
    for (;;) {
        const int64_t got = detail::pread_fully(fd.fd, buf.data(), buf.size(), d.bytes);
        if (got < 0) throw CheckpointError("cannot read " + path + ": " + detail::errno_text(errno));
        d.crc32c = crc32c(d.crc32c, buf.data(), static_cast<size_t>(got));
        d.bytes += static_cast<uint64_t>(got);
        if (static_cast<size_t>(got) < buf.size()) return d;
    }
}

// Writes DIR/manifest.json atomically (temp file, fsync, rename, directory fsync).
inline void write_manifest(const std::string& dir, const Manifest& m) {
    const std::string path = manifest_path(dir), tmp = temp_path(path);
    // One line per file, so that a manifest reads well in a terminal.
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : m.meta) meta[key] = value;
    std::string text = "{\"meta\":" + meta.dump() + ",\"files\":[";
    for (size_t i = 0; i < m.files.size(); ++i) {
        const nlohmann::ordered_json file = {
            {"name", m.files[i].name}, {"bytes", m.files[i].digest.bytes}, {"crc32c", crc_text(m.files[i].digest.crc32c)}};
        text += (i ? ",\n" : "\n") + file.dump();
    }
    text += "]}\n";
    const auto fail = [&](const char* step) {
        const int err = errno;
        ::unlink(tmp.c_str());
        throw CheckpointError("cannot write manifest " + path + ": " + step + ": " + detail::errno_text(err));
    };
    const detail::ActiveTemp active(tmp);
    detail::Fd fd(detail::open_retry(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.fd < 0) fail("creating its temporary file");
    if (!detail::write_fully(fd.fd, text.data(), text.size())) fail("writing");
    if (::fsync(fd.fd) != 0) fail("fsync");
    if (::close(std::exchange(fd.fd, -1)) != 0) fail("closing");
    if (::rename(tmp.c_str(), path.c_str()) != 0) fail("renaming into place");
    std::string parent;
    if (!detail::sync_parent_dir(path, parent)) fail("syncing its directory");
}

// Removes DIR/manifest.json durably (a save into an existing directory starts with this, so that a
// save that dies midway leaves a directory without a manifest, which resume refuses); a missing
// manifest is fine.
inline void remove_manifest(const std::string& dir) {
    const std::string path = manifest_path(dir);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
        throw CheckpointError("cannot remove " + path + ": " + detail::errno_text(errno));
    std::string parent;
    if (!detail::sync_parent_dir(path, parent))
        throw CheckpointError("cannot sync directory " + parent + ": " + detail::errno_text(errno));
}

inline bool has_manifest(const std::string& dir) { return ::access(manifest_path(dir).c_str(), F_OK) == 0; }

// Reads and checks DIR/manifest.json (schema, unique file names, 8-hex-digit checksums).
inline Manifest read_manifest(const std::string& dir) {
    using detail::Json;
    const std::string path = manifest_path(dir);
    detail::Fd fd(detail::open_retry(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.fd < 0) throw CheckpointError("cannot open manifest " + path + ": " + detail::errno_text(errno));
    struct stat st {};
    if (::fstat(fd.fd, &st) != 0 || st.st_size > int64_t(kMaxHeaderBytes))
        throw CheckpointError("manifest " + path + " cannot be read or is implausibly large");
    std::string text(static_cast<size_t>(st.st_size), '\0');
    if (detail::pread_fully(fd.fd, text.data(), text.size(), 0) != static_cast<int64_t>(text.size()))
        throw CheckpointError("cannot read manifest " + path + ": " + detail::errno_text(errno));
    const Json doc = detail::JsonSubset::parse(text, path);
    const auto bad = [&](const std::string& what) -> CheckpointError { return CheckpointError("manifest " + path + ": " + what); };
    Manifest m;
    const Json *meta = nullptr, *files = nullptr;
    for (size_t k = 0; k < doc.keys.size(); ++k) {
        if (doc.keys[k] == "meta") meta = &doc.items[k];
        else if (doc.keys[k] == "files") files = &doc.items[k];
        else throw bad("unknown member " + detail::json_quote(doc.keys[k]));
    }
    if (!meta || meta->kind != Json::Object) throw bad("\"meta\" is missing or not an object");
    if (!files || files->kind != Json::Array) throw bad("\"files\" is missing or not an array");
    for (size_t k = 0; k < meta->keys.size(); ++k) {
        if (meta->items[k].kind != Json::String) throw bad("meta " + detail::json_quote(meta->keys[k]) + " is not a string");
        m.meta.emplace_back(meta->keys[k], meta->items[k].str);
    }
    for (const Json& f : files->items) {
        const Json *name = nullptr, *bytes = nullptr, *crc = nullptr;
        if (f.kind != Json::Object) throw bad("a \"files\" entry is not an object");
        for (size_t k = 0; k < f.keys.size(); ++k) {
            if (f.keys[k] == "name") name = &f.items[k];
            else if (f.keys[k] == "bytes") bytes = &f.items[k];
            else if (f.keys[k] == "crc32c") crc = &f.items[k];
            else throw bad("a \"files\" entry has an unknown member " + detail::json_quote(f.keys[k]));
        }
        if (!name || name->kind != Json::String || name->str.empty() || name->str.find('/') != std::string::npos)
            throw bad("a \"files\" entry lacks a plain file name");
        if (!bytes || bytes->kind != Json::Integer) throw bad("file " + name->str + " lacks its \"bytes\"");
        if (!crc || crc->kind != Json::String || crc->str.size() != 8 ||
            crc->str.find_first_not_of("0123456789abcdef") != std::string::npos)
            throw bad("file " + name->str + " lacks its \"crc32c\" (8 lowercase hex digits)");
        for (const ManifestFile& e : m.files)
            if (e.name == name->str) throw bad("file " + name->str + " is listed twice");
        m.files.push_back({name->str, {bytes->num, static_cast<uint32_t>(std::stoul(crc->str, nullptr, 16))}});
    }
    return m;
}

// Checks DIR/NAME against its manifest entry (size, then CRC-32C of every byte); throws naming the
// file and what differs.
inline void verify_file(const std::string& dir, const Manifest& m, const std::string& name) {
    const std::string path = dir + "/" + name;
    for (const ManifestFile& e : m.files) {
        if (e.name != name) continue;
        const FileDigest got = file_digest(path);
        if (got.bytes != e.digest.bytes)
            throw CheckpointError(path + " is " + std::to_string(got.bytes) + " bytes, but " + manifest_path(dir) +
                                  " lists it at " + std::to_string(e.digest.bytes) +
                                  " (a file of another save, or damaged)");
        if (got.crc32c != e.digest.crc32c)
            throw CheckpointError(path + " has CRC-32C " + crc_text(got.crc32c) + ", but " + manifest_path(dir) +
                                  " lists " + crc_text(e.digest.crc32c) + " (its bytes changed since the save)");
        return;
    }
    throw CheckpointError(manifest_path(dir) + " does not list " + name);
}

}  // namespace ckpt
