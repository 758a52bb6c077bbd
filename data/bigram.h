// The bigram hash that indexes the bigram embedding table, computed on the host exactly as the
// reference computes it in int32 torch arithmetic:
//   id[0] = V - 1
//   id[t] = ((36313 * cur[t]) XOR (27191 * prev[t])) mod (V - 1)        for t >= 1
// where V is the table size (record: 50304 * 5 = 251520), prev[1] = V - 1 (the reference reads
// the already-replaced position 0), prev[t] = tok[t-1] for t >= 2, both products wrap in
// int32, and mod is torch's floor remainder, so the result is in [0, V - 2] even when the XOR
// is negative. Document boundaries are not special: a BOS hashes with the previous document's
// last token, as upstream does.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dataload {

constexpr int32_t kRecordBigramVocab = 50304 * 5;

// Writes the n hash ids of tokens[0..n) into out (the trainer passes pinned memory for an async
// copy). out may be the same array as tokens: each token is read before its slot is written.
inline void bigram_hash(const int32_t* tokens, int32_t* out, int64_t n, int32_t bigram_vocab) {
    if (bigram_vocab < 2)
        throw std::invalid_argument("bigram table size must be at least 2, got " + std::to_string(bigram_vocab));
    if (n <= 0) return;
    const int32_t mod = bigram_vocab - 1;
    // Signed overflow is undefined in C++, so the int32 wrap is done in uint32 and converted
    // back (modular since C++20), which gives the same bits torch's int32 multiply gives.
    uint32_t prev = static_cast<uint32_t>(mod);
    out[0] = mod;
    for (int64_t t = 1; t < n; ++t) {
        const uint32_t cur = static_cast<uint32_t>(tokens[t]);
        const int32_t x = static_cast<int32_t>((36313u * cur) ^ (27191u * prev));
        int32_t r = x % mod;  // C++ truncates toward zero; shift into torch's non-negative range
        if (r < 0) r += mod;
        out[t] = r;
        prev = cur;
    }
}

}  // namespace dataload
