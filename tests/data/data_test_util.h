// Helpers the data tests share: a scratch directory removed at exit, raw file writing (to make
// broken shards the library's writer would refuse to produce), and checks that a call fails with
// a DataError whose message says the right things.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/shard.h"
#include "tests/test_util.h"

namespace datatest {

// A fresh directory under $TMPDIR (or /tmp), removed with its files when the program ends.
class ScratchDir {
  public:
    ScratchDir() {
        const char* base = std::getenv("TMPDIR");
        std::string templ = std::string(base && *base ? base : "/tmp") + "/data_test_XXXXXX";
        std::vector<char> buf(templ.begin(), templ.end());
        buf.push_back('\0');
        if (!::mkdtemp(buf.data())) {
            std::perror("mkdtemp");
            std::exit(2);
        }
        path_ = buf.data();
    }
    ~ScratchDir() { remove_tree(path_); }
    ScratchDir(const ScratchDir&) = delete;
    ScratchDir& operator=(const ScratchDir&) = delete;
    const std::string& path() const { return path_; }
    std::string file(const std::string& name) const { return path_ + "/" + name; }

    // Names of the entries in the directory (to check nothing stray was left behind).
    std::vector<std::string> entries() const {
        std::vector<std::string> out;
        if (DIR* d = ::opendir(path_.c_str())) {
            while (dirent* e = ::readdir(d))
                if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) out.emplace_back(e->d_name);
            ::closedir(d);
        }
        return out;
    }

  private:
    static void remove_tree(const std::string& p) {
        struct stat st {};
        if (::lstat(p.c_str(), &st) != 0) return;
        if (S_ISDIR(st.st_mode)) {
            ::chmod(p.c_str(), 0700);
            if (DIR* d = ::opendir(p.c_str())) {
                std::vector<std::string> names;
                while (dirent* e = ::readdir(d))
                    if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) names.emplace_back(e->d_name);
                ::closedir(d);
                for (const auto& n : names) remove_tree(p + "/" + n);
            }
            ::rmdir(p.c_str());
        } else {
            ::unlink(p.c_str());
        }
    }
    std::string path_;
};

inline void write_bytes(const std::string& path, const void* data, size_t n) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || (n && std::fwrite(data, 1, n, f) != n) || std::fclose(f) != 0) {
        std::fprintf(stderr, "test setup: cannot write %s\n", path.c_str());
        std::exit(2);
    }
}

// A shard file with an arbitrary header and payload, valid or not.
inline void write_raw_shard(const std::string& path, int32_t magic, int32_t version, int32_t count,
                            const std::vector<uint16_t>& tokens, size_t extra_bytes = 0) {
    std::vector<unsigned char> bytes(1024, 0);
    std::memcpy(bytes.data(), &magic, 4);
    std::memcpy(bytes.data() + 4, &version, 4);
    std::memcpy(bytes.data() + 8, &count, 4);
    const auto* t = reinterpret_cast<const unsigned char*>(tokens.data());
    bytes.insert(bytes.end(), t, t + tokens.size() * 2);
    bytes.insert(bytes.end(), extra_bytes, 0x5a);
    write_bytes(path, bytes.data(), bytes.size());
}

// One check: fn throws an Error (by default dataload::DataError) whose message contains every one
// of parts.
template <class Error = dataload::DataError>
bool expect_error_of(const std::string& what, const std::function<void()>& fn, std::initializer_list<std::string> parts) {
    try {
        fn();
    } catch (const Error& e) {
        const std::string msg = e.what();
        for (const auto& p : parts)
            if (msg.find(p) == std::string::npos)
                return test::check(false, "%s: message \"%s\" lacks \"%s\"", what.c_str(), msg.c_str(), p.c_str());
        return test::check(true, "");
    } catch (const std::exception& e) {
        return test::check(false, "%s: threw a different exception: %s", what.c_str(), e.what());
    }
    return test::check(false, "%s: did not throw", what.c_str());
}
inline bool expect_data_error(const std::string& what, const std::function<void()>& fn,
                              std::initializer_list<std::string> parts) {
    return expect_error_of(what, fn, parts);
}

// Documents as a token stream: each length counts its BOS; the other tokens are arbitrary
// non-BOS values derived from a seed.
inline std::vector<uint16_t> make_docs(const std::vector<int>& lengths, uint32_t seed) {
    std::vector<uint16_t> out;
    uint32_t s = seed * 2654435761u + 12345u;
    for (int len : lengths) {
        out.push_back(dataload::kBosId);
        for (int i = 1; i < len; ++i) {
            s = s * 1664525u + 1013904223u;
            out.push_back(static_cast<uint16_t>((s >> 8) % dataload::kBosId));
        }
    }
    return out;
}

inline std::string read_text_file(const std::string& path) {
    std::string out;
    if (std::FILE* f = std::fopen(path.c_str(), "rb")) {
        char buf[65536];
        size_t n;
        while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
        std::fclose(f);
    } else {
        std::fprintf(stderr, "cannot read %s\n", path.c_str());
    }
    return out;
}

// The repository root: $REPO when CTest sets it, else the current directory.
inline std::string repo_root() {
    const char* r = std::getenv("REPO");
    return r && *r ? r : ".";
}

}  // namespace datatest
