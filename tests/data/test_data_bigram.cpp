// The bigram hash (data/bigram.h) against values worked out by hand, including the int32
// overflows upstream's torch arithmetic wraps, and against a second formulation in int64 on
// random tokens.
#include <cstdint>
#include <vector>

#include "data/bigram.h"
#include "tests/data/data_test_util.h"

// Hand-worked, table size 251520, mod = 251519 (each line: cur, prev -> products, xor, result):
//  t=0                      -> 251519 (the reserved id)
//  t=1 cur 995, prev 251519 (position 0 already replaced):
//      36313*995 = 36131435; 27191*251519 = 6839053129 wraps to 6839053129 - 2*2^32 = -1750881463
//      36131435 xor -1750881463 = -1786447582; floor mod: -1786447582 + 7103*251519 = 91875
//  t=2 cur 262, prev 995: 9514006 xor 27055045 = 17694675; 17694675 - 70*251519 = 88345
//  t=3 cur 50256 (BOS), prev 262: 1824946128 xor 7124042 = 1823130522 -> 120810
//  t=4 cur 0, prev 50256: 0 xor 1366510896 = 1366510896 -> 8169
//  t=5 cur 65535, prev 0: 36313*65535 = 2379772455 wraps to -1915194841; xor 0; floor mod -> 122344
//  t=6 cur 50256, prev 65535: 1824946128 xor 1781962185 = 116449817 -> 248039
static void test_hand_values() {
    const std::vector<int32_t> tokens = {15496, 995, 262, 50256, 0, 65535, 50256};
    const std::vector<int32_t> want = {251519, 91875, 88345, 120810, 8169, 122344, 248039};
    std::vector<int32_t> got(tokens.size(), -1);
    dataload::bigram_hash(tokens.data(), got.data(), static_cast<int64_t>(tokens.size()), 251520);
    for (size_t i = 0; i < want.size(); ++i)
        test::check(got[i] == want[i], "hand value at %zu: got %d want %d", i, got[i], want[i]);

    // In place gives the same ids (the trainer may reuse the inputs buffer).
    std::vector<int32_t> inplace = tokens;
    dataload::bigram_hash(inplace.data(), inplace.data(), static_cast<int64_t>(inplace.size()), 251520);
    test::check(inplace == want, "in-place hash differs");

    // Position 0 is reserved whatever the token; a single token is just that.
    int32_t one = 123, out = -1;
    dataload::bigram_hash(&one, &out, 1, 251520);
    test::check(out == 251519, "single token: got %d", out);

    // A tiny table: V = 10, mod 9. t=1: 36313*5 = 181565; 27191*9 = 244719; xor = 98002 -> 98002 % 9 = 1.
    // t=2: 36313*7 = 254191; 27191*5 = 135955; xor = 127996 -> 127996 % 9 = 7.
    const int32_t small_in[3] = {4, 5, 7};
    int32_t small_out[3];
    dataload::bigram_hash(small_in, small_out, 3, 10);
    test::check(small_out[0] == 9 && small_out[1] == 1 && small_out[2] == 7, "table of 10: got %d %d %d", small_out[0],
                small_out[1], small_out[2]);
}

// The same definition written with int64 arithmetic and an explicit wrap.
static int32_t wrap32(int64_t v) {
    v &= 0xFFFFFFFFll;
    return static_cast<int32_t>(v >= (1ll << 31) ? v - (1ll << 32) : v);
}
static std::vector<int32_t> reference(const std::vector<int32_t>& x, int32_t vocab) {
    const int64_t mod = vocab - 1;
    std::vector<int32_t> out(x.size());
    for (size_t t = 0; t < x.size(); ++t) {
        if (t == 0) {
            out[t] = static_cast<int32_t>(mod);
            continue;
        }
        const int64_t prev = t == 1 ? mod : x[t - 1];
        const int64_t h = wrap32(wrap32(36313ll * x[t]) ^ wrap32(27191ll * prev));
        out[t] = static_cast<int32_t>(((h % mod) + mod) % mod);
    }
    return out;
}

static void test_random() {
    for (int32_t vocab : {251520, 50304, 1000, 3, 2}) {
        std::vector<int32_t> x(4096);
        for (auto& v : x) v = test::randint(0, 65535);
        std::vector<int32_t> got(x.size());
        dataload::bigram_hash(x.data(), got.data(), static_cast<int64_t>(x.size()), vocab);
        const auto want = reference(x, vocab);
        size_t bad = 0;
        bool in_range = true;
        for (size_t i = 0; i < x.size(); ++i) {
            bad += got[i] != want[i];
            in_range = in_range && got[i] >= 0 && got[i] <= vocab - 1;
        }
        test::check(bad == 0, "random tokens, table %d: %zu ids differ from the int64 formulation", vocab, bad);
        test::check(in_range, "random tokens, table %d: an id outside [0, %d]", vocab, vocab - 1);
    }
}

static void test_bad_table() {
    int32_t in = 1, out = 0;
    bool threw = false;
    try {
        dataload::bigram_hash(&in, &out, 1, 1);
    } catch (const std::invalid_argument& e) {
        threw = std::string(e.what()).find("at least 2, got 1") != std::string::npos;
    }
    test::check(threw, "a table of 1 entry is refused with a message");
}

int main() {
    test_hand_values();
    test_random();
    test_bad_table();
    return test::finish();
}
