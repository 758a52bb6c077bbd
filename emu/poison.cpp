// Poison for memory nobody wrote, and where static __shared__ objects lie (see poison.h).
#include "poison.h"
#include "runtime_state.h"

#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emu {
namespace {

bool env_on(const char* name) {
    const char* v = std::getenv(name);
    return v && *v && std::strcmp(v, "0") != 0;
}

struct SharedObject {
    size_t offset, bytes;  // within the program's TLS block
    std::string symbol;    // _ZZ<the enclosing function's encoding>E<name>
};
struct StaticShared {
    bool known = false;  // false: the program has no symbol table, so nothing is known
    std::vector<SharedObject> objects;
};

template <class T>
bool read_at(int fd, T* out, size_t count, uint64_t offset) {
    const size_t bytes = count * sizeof(T);
    return pread(fd, out, bytes, static_cast<off_t>(offset)) == static_cast<ssize_t>(bytes);
}

// A function-local `static thread_local` is a TLS symbol mangled _ZZ<function>E<name>; those of
// namespace emu (emu's own per-worker state, _ZZN3emu...) are not shared memory.
bool is_static_shared(const Elf64_Sym& s, const char* name) {
    return ELF64_ST_TYPE(s.st_info) == STT_TLS && s.st_size > 0 && std::strncmp(name, "_ZZ", 3) == 0 &&
           std::strncmp(name, "_ZZN3emu", 8) != 0;
}

// The program's symbol table, read from its file: for a TLS symbol of an executable, st_value is the
// offset of the object within the program's TLS block.
StaticShared scan_static_shared() {
    StaticShared r;
    const int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    Elf64_Ehdr eh;
    std::vector<Elf64_Shdr> sections;
    if (fd >= 0 && read_at(fd, &eh, 1, 0) && std::memcmp(eh.e_ident, ELFMAG, SELFMAG) == 0 &&
        eh.e_ident[EI_CLASS] == ELFCLASS64) {
        sections.resize(eh.e_shnum);
        if (!read_at(fd, sections.data(), sections.size(), eh.e_shoff)) sections.clear();
    }
    for (const Elf64_Shdr& s : sections) {
        if (s.sh_type != SHT_SYMTAB || s.sh_link >= sections.size()) continue;
        std::vector<Elf64_Sym> syms(s.sh_size / sizeof(Elf64_Sym));
        std::vector<char> names(sections[s.sh_link].sh_size + 1, '\0');
        if (!read_at(fd, syms.data(), syms.size(), s.sh_offset) ||
            !read_at(fd, names.data(), names.size() - 1, sections[s.sh_link].sh_offset))
            continue;
        r.known = true;
        for (const Elf64_Sym& sym : syms)
            if (sym.st_name < names.size() && is_static_shared(sym, names.data() + sym.st_name))
                r.objects.push_back({sym.st_value, sym.st_size, names.data() + sym.st_name});
    }
    if (fd >= 0) close(fd);
    std::sort(r.objects.begin(), r.objects.end(), [](const SharedObject& a, const SharedObject& b) {
        return a.offset < b.offset;
    });
    r.objects.erase(std::unique(r.objects.begin(), r.objects.end(),
                                [](const SharedObject& a, const SharedObject& b) { return a.offset == b.offset; }),
                    r.objects.end());
    if (!r.known)
        std::fprintf(stderr, "emu: the program has no symbol table (stripped?): static __shared__ objects are neither "
                             "poisoned nor checked by the PTX twins\n");
    return r;
}
const StaticShared& static_shared() {
    static const StaticShared s = scan_static_shared();
    return s;
}

// The calling thread's copy of the program's TLS block (the program is the first object listed).
unsigned char* tls_block() {
    static thread_local unsigned char* base = [] {
        unsigned char* b = nullptr;
        dl_iterate_phdr(
            [](dl_phdr_info* info, size_t, void* out) {
                *static_cast<unsigned char**>(out) = static_cast<unsigned char*>(info->dlpi_tls_data);
                return 1;
            },
            &b);
        return b;
    }();
    return base;
}

}  // namespace

bool read_poison_enabled() {
    const char* v = std::getenv("EMU_POISON");
    if (v && *v && std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0) {
        std::fprintf(stderr, "emu: EMU_POISON=%s: expected 0 or 1\n", v);
        std::exit(2);
    }
    return env_on("EMU_POISON") || read_random_order_seed() != 0;
}
bool poison_enabled() {
    static const bool on = read_poison_enabled();
    return on;
}
// Checked when the program starts, before it writes anything (a log): a bad value stops it at once.
// Only checked: the settings are still read at their first use, so a test may set them in main().
[[maybe_unused]] const bool kPoisonCheckedAtStart = (read_poison_enabled(), true);

void poison_fresh(void* p, size_t bytes) {
    if (poison_enabled() && p && bytes) std::memset(p, kPoisonByte, bytes);
}

// The offsets and sizes a block start poisons.
struct StaticPoison {
    std::vector<std::pair<size_t, size_t>> spans;
};

namespace {
// Which kernel's body each object is local to: object i belongs to kernel owner[i] (an index into
// kernels) once a kernel whose symbol _Z<encoding> makes the object's name _ZZ<encoding>E... has been
// launched; -1 until then, and for ever for the objects of __device__ helpers (block_reduce_sum's).
struct Owners {
    std::mutex m;
    std::vector<std::string> kernels;
    std::vector<int> owner;
    uint64_t version = 0;  // bumped when a launch claims objects: earlier lists may hold them
    std::unordered_map<std::string, std::pair<uint64_t, std::shared_ptr<const StaticPoison>>> lists;
};
Owners& owners() {
    static Owners o;
    return o;
}

}  // namespace

std::shared_ptr<const StaticPoison> static_poison_for(const std::string& kernel_symbol) {
    if (!poison_enabled()) return nullptr;
    const StaticShared& s = static_shared();
    Owners& o = owners();
    std::lock_guard<std::mutex> lock(o.m);
    if (o.owner.empty()) o.owner.assign(s.objects.size(), -1);
    int me = -1;
    if (kernel_symbol.size() > 2 && kernel_symbol.compare(0, 2, "_Z") == 0) {
        const auto known = std::find(o.kernels.begin(), o.kernels.end(), kernel_symbol);
        me = int(known - o.kernels.begin());
        if (known == o.kernels.end()) {  // its first launch: it claims the objects local to it
            o.kernels.push_back(kernel_symbol);
            const std::string prefix = "_ZZ" + kernel_symbol.substr(2) + "E";
            bool claimed = false;
            for (size_t i = 0; i < s.objects.size(); ++i)
                if (o.owner[i] < 0 && s.objects[i].symbol.compare(0, prefix.size(), prefix) == 0) {
                    o.owner[i] = me;
                    claimed = true;
                }
            o.version += claimed;
        }
    }
    auto& [version, list] = o.lists[kernel_symbol];
    if (!list || version != o.version) {
        // A block can reach its own objects and the helpers' (owner -1): another kernel's are out of its
        // reach, so they are left alone. Unknown kernels (no symbol) poison every object.
        auto fresh = std::make_shared<StaticPoison>();
        for (size_t i = 0; i < s.objects.size(); ++i)
            if (me < 0 || o.owner[i] < 0 || o.owner[i] == me) fresh->spans.emplace_back(s.objects[i].offset, s.objects[i].bytes);
        list = std::move(fresh);
        version = o.version;
    }
    return list;
}

void poison_static_shared(const StaticPoison* list) {
    if (!list) return;
    unsigned char* base = tls_block();
    if (!base) return;
    for (const auto& [offset, bytes] : list->spans) std::memset(base + offset, kPoisonByte, bytes);
}

bool in_static_shared(const void* p, size_t bytes) {
    const StaticShared& s = static_shared();
    const unsigned char* base = tls_block();
    if (!s.known || !base) return true;  // nothing known: no claim that it is not shared
    const auto* q = static_cast<const unsigned char*>(p);
    if (q < base) return false;
    // the last object starting at or before q (they are sorted by offset and do not overlap)
    const size_t at = size_t(q - base);
    auto it = std::upper_bound(s.objects.begin(), s.objects.end(), at,
                               [](size_t x, const SharedObject& o) { return x < o.offset; });
    if (it == s.objects.begin()) return false;
    --it;
    return at + bytes <= it->offset + it->bytes;
}

}  // namespace emu
