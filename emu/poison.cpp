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
#include <string>
#include <vector>

namespace emu {
namespace {

bool env_on(const char* name) {
    const char* v = std::getenv(name);
    return v && *v && std::strcmp(v, "0") != 0;
}

struct SharedObject {
    size_t offset, bytes;  // within the program's TLS block
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
                r.objects.push_back({sym.st_value, sym.st_size});
    }
    if (fd >= 0) close(fd);
    std::sort(r.objects.begin(), r.objects.end(), [](const SharedObject& a, const SharedObject& b) {
        return a.offset < b.offset;
    });
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

void poison_static_shared() {
    if (!poison_enabled()) return;
    unsigned char* base = tls_block();
    if (!base) return;
    for (const SharedObject& o : static_shared().objects) std::memset(base + o.offset, kPoisonByte, o.bytes);
}

bool in_static_shared(const void* p, size_t bytes) {
    const StaticShared& s = static_shared();
    const unsigned char* base = tls_block();
    if (!s.known || !base) return true;  // nothing known: no claim that it is not shared
    const auto* q = static_cast<const unsigned char*>(p);
    for (const SharedObject& o : s.objects)
        if (q >= base + o.offset && q + bytes <= base + o.offset + o.bytes) return true;
    return false;
}

}  // namespace emu
