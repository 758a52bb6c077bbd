// The committed prefix-token table (data/gpt2_prefix_table.bin, made by
// scripts/make_prefix_table.py) read through data/prefix_table.h: upstream's spot values and valid
// count, and planted corruptions refused with messages naming the file and the fault.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "data/prefix_table.h"
#include "tests/data/data_test_util.h"

static std::string committed() { return datatest::repo_root() + "/data/gpt2_prefix_table.bin"; }

static void test_committed() {
    std::vector<int32_t> p;
    try {
        p = dataload::read_prefix_table(committed());
    } catch (const std::exception& e) {
        test::check(false, "reading the committed table: %s", e.what());
        return;
    }
    // " the" -> " th", " and" -> " an", "the" -> "th", " gazed" -> " gaze", "," has none.
    const int32_t spots[][2] = {{262, 294}, {290, 281}, {1169, 400}, {50255, 17841}, {11, -1}};
    for (const auto& s : spots) test::check(p[s[0]] == s[1], "p[%d] = %d, want %d", s[0], p[s[0]], s[1]);
    int valid = 0;
    for (int32_t x : p) valid += x >= 0;
    test::check(valid == 50000, "%d valid entries, want 50000", valid);
    // Single bytes, <|endoftext|> and the padding rows have no prefix.
    for (int32_t v : {0, 255, 50256, 50257, 50303}) test::check(p[v] == -1, "p[%d] = %d, want -1", v, p[v]);
}

static void test_planted() {
    const std::string bytes = datatest::read_text_file(committed());
    if (!test::check(bytes.size() == 50304 * 4, "committed table has %zu bytes", bytes.size())) return;
    datatest::ScratchDir dir;
    auto planted = [&](const std::string& name, int32_t v, int32_t value) {
        std::vector<int32_t> t(50304);
        std::memcpy(t.data(), bytes.data(), bytes.size());
        t[v] = value;
        const std::string path = dir.file(name);
        datatest::write_bytes(path, t.data(), t.size() * 4);
        return std::make_pair(path, dataload::fnv1a64(t.data(), t.size() * 4));
    };

    const std::string cut = dir.file("truncated.bin");
    datatest::write_bytes(cut, bytes.data(), bytes.size() - 4);
    datatest::expect_data_error("truncated", [&] { dataload::read_prefix_table(cut); },
                                {cut, "201212 bytes", "expected 201216"});
    datatest::expect_data_error("missing", [&] { dataload::read_prefix_table(dir.file("none.bin")); },
                                {dir.file("none.bin"), "cannot open"});

    // Each planted table is given its own checksum, so the structural check is what must refuse it.
    const auto [high, high_fnv] = planted("high.bin", 300, 50304);
    datatest::expect_data_error("out of range", [&] { dataload::read_prefix_table(high, high_fnv); },
                                {high, "entry 300 = 50304", "outside"});
    const auto [low, low_fnv] = planted("low.bin", 7, -2);
    datatest::expect_data_error("below -1", [&] { dataload::read_prefix_table(low, low_fnv); },
                                {low, "entry 7 = -2"});
    const auto [self, self_fnv] = planted("self.bin", 262, 262);
    datatest::expect_data_error("self", [&] { dataload::read_prefix_table(self, self_fnv); },
                                {self, "entry 262 points to itself"});
    // A plausible but wrong entry (" the" -> "t") passes the structure and fails the checksum.
    const auto [wrong, wrong_fnv] = planted("wrong.bin", 262, 83);
    (void)wrong_fnv;
    datatest::expect_data_error("wrong entry", [&] { dataload::read_prefix_table(wrong); },
                                {wrong, "FNV-1a 64", "0x0da2e81f3537e45b"});
}

int main() {
    test_committed();
    test_planted();
    return test::finish();
}
