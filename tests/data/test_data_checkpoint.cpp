// The checkpoint file format (runtime/checkpoint_format.h): round trips of every dtype and shape kind, the
// byte layout checked by hand, every kind of broken file with the message it must give, writer
// misuse, a writer killed mid-write, and writes that fail; CRC-32C against the published test
// vectors and a bit-at-a-time reference; manifests (round trip, a flipped bit, a changed size,
// broken manifests); the removal of dead processes' temp files.
//   test_data_checkpoint                     runs the tests
//   test_data_checkpoint --write-sample PATH writes the fixed sample tests/data/test_read_checkpoint.py checks
//   test_data_checkpoint --list PATH         prints what the reader sees, one JSON array a line
#include <algorithm>
#include <cinttypes>
#include <csignal>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "runtime/checkpoint_format.h"
#include "tests/data/data_test_util.h"

using ckpt::CheckpointError;
using ckpt::CheckpointReader;
using ckpt::CheckpointWriter;

namespace {

// One check: fn throws CheckpointError and its message contains every one of parts.
bool expect_error(const std::string& what, const std::function<void()>& fn, std::initializer_list<std::string> parts) {
    return datatest::expect_error_of<CheckpointError>(what, fn, parts);
}

std::vector<unsigned char> random_bytes(size_t n) {
    std::vector<unsigned char> v(n);
    for (auto& b : v) b = static_cast<unsigned char>(test::rng()());
    return v;
}

std::vector<unsigned char> file_bytes(const std::string& path) {
    const std::string s = datatest::read_text_file(path);
    return {s.begin(), s.end()};
}

uint64_t le64(const unsigned char* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
    return v;
}

// A file made by hand: the length field (the padded header's unless given), the header padded
// with spaces to a multiple of 8 (unless pad is false), then data.
void write_raw(const std::string& path, std::string header, const std::vector<unsigned char>& data, bool pad = true,
               int64_t length_field = -1) {
    if (pad) header.append((8 - header.size() % 8) % 8, ' ');
    const uint64_t n = length_field >= 0 ? static_cast<uint64_t>(length_field) : header.size();
    std::vector<unsigned char> bytes(8);
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(n >> (8 * i));
    bytes.insert(bytes.end(), header.begin(), header.end());
    bytes.insert(bytes.end(), data.begin(), data.end());
    datatest::write_bytes(path, bytes.data(), bytes.size());
}

bool has_entry_with(const datatest::ScratchDir& dir, const std::string& part) {
    for (const auto& e : dir.entries())
        if (e.find(part) != std::string::npos) return true;
    return false;
}

// ---- the fixed sample (its values are written out again in test_read_checkpoint.py) ----

uint16_t bf16_bits(float f) {  // exact for the sample's values, which bf16 holds exactly
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
}

void write_sample(const std::string& path) {
    std::vector<uint16_t> wte(12);
    for (int i = 0; i < 12; ++i) wte[i] = bf16_bits(static_cast<float>(i - 5) * 0.25f);
    static const float scalars[5] = {0.5f, -1.0f, 3.25f, 1024.0f, -0.125f};
    static const int64_t step = 1234;
    static const uint16_t tokens[6] = {0, 1, 50256, 65535, 7, 300};
    static const int32_t counts[4] = {-1, 2, INT32_MIN, INT32_MAX};
    static const uint8_t bytes[5] = {0, 1, 127, 128, 255};
    static const uint8_t seed = 42;
    CheckpointWriter w;
    w.meta("step", "1234");
    w.meta("note", "quote \" backslash \\ newline \n tab \t bell \x07 e-acute \xc3\xa9 emoji \xf0\x9f\x98\x80");
    w.meta("empty", "");
    w.tensor("wte.weight", "BF16", {3, 4}, wte.data(), 24);
    w.tensor("scalars", "F32", {5}, scalars, 20);
    w.tensor("step", "I64", {}, &step, 8);
    w.tensor("tokens", "U16", {6}, tokens, 12);
    w.tensor("counts", "I32", {2, 2}, counts, 16);
    w.tensor("empty", "F32", {0, 3}, nullptr, 0);
    w.tensor("bytes", "U8", {5}, bytes, 5);
    w.tensor("rng state/\xc3\xbc", "U8", {}, &seed, 1);
    w.write(path);
}

int list(const std::string& path) {
    try {
        const CheckpointReader r(path);
        for (const auto& name : r.names()) {
            const auto& in = r.info(name);
            std::vector<unsigned char> data(in.bytes);
            r.read(name, data.data(), data.size());
            std::string shape, hex;
            for (size_t i = 0; i < in.shape.size(); ++i) {  // appended: "," + std::string&& is GCC 12's false -Wrestrict at -O3
                if (i) shape += ',';
                shape += std::to_string(in.shape[i]);
            }
            for (unsigned char b : data) {
                char h[3];
                std::snprintf(h, sizeof h, "%02x", b);
                hex += h;
            }
            std::printf("[\"tensor\",%s,\"%s\",[%s],%zu,%zu,\"%s\"]\n", ckpt::detail::json_quote(name).c_str(),
                        in.dtype.c_str(), shape.c_str(), in.offset, in.bytes, hex.c_str());
        }
        for (const char* key : {"step", "note", "empty", "origin"})
            if (r.has_meta(key))
                std::printf("[\"meta\",\"%s\",%s]\n", key, ckpt::detail::json_quote(r.meta(key)).c_str());
        return 0;
    } catch (const CheckpointError& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}

// ---- tests ----

struct Made {
    std::string name, dtype;
    std::vector<int64_t> shape;
    std::vector<unsigned char> data;
};

void test_round_trip(const datatest::ScratchDir& dir) {
    // Every dtype, a scalar, empty tensors (flat and with a 0 inside a shape), odd sizes, and
    // names that need escaping; random contents.
    std::vector<Made> made = {
        {"bf16 matrix", "BF16", {7, 5}, {}},       {"f32/vec", "F32", {13}, {}},      {"scalar", "F32", {}, {}},
        {"u16 \"quoted\"", "U16", {3, 1, 4}, {}},  {"i32", "I32", {2, 3}, {}},        {"i64 step", "I64", {}, {}},
        {"empty", "BF16", {0}, {}},                {"empty 3d", "I32", {3, 0, 5}, {}}, {"u8 odd", "U8", {1001, 3}, {}},
        {"tab\there\\ \xe6\x97\xa5\xe6\x9c\xac", "U8", {1}, {}}, {"last", "I64", {2, 2, 2}, {}},
    };
    CheckpointWriter w;
    for (auto& m : made) {
        uint64_t n = ckpt::dtype_size(m.dtype);
        for (int64_t d : m.shape) n *= static_cast<uint64_t>(d);
        m.data = random_bytes(n);
        w.tensor(m.name, m.dtype.c_str(), m.shape, m.data.data(), m.data.size());
    }
    const std::string tricky = "q\" b\\ n\n t\t r\r c\x01\x1f del\x7f \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 /";
    w.meta("step", "1000");
    w.meta("tricky \"key\"\n", tricky);
    w.meta("empty", "");
    const std::string path = dir.file("round_trip.safetensors");
    w.write(path);

    const CheckpointReader r(path);
    std::vector<std::string> want_names;
    for (const auto& m : made) want_names.push_back(m.name);
    test::check(r.names() == want_names, "round trip: names() is not the order tensors were added");
    for (const auto& m : made) {
        if (!test::check(r.has(m.name), "round trip: tensor \"%s\" missing", m.name.c_str())) continue;
        const auto& in = r.info(m.name);
        test::check(in.dtype == m.dtype && in.shape == m.shape && in.bytes == m.data.size(),
                    "round trip: \"%s\" info is %s %s %zu bytes", m.name.c_str(), in.dtype.c_str(),
                    ckpt::detail::shape_text(in.shape).c_str(), in.bytes);
        std::vector<unsigned char> back(m.data.size() + 1, 0xee);  // one guard byte past the end
        r.read(m.name, back.data(), m.data.size());
        test::check(std::equal(m.data.begin(), m.data.end(), back.begin()) && back.back() == 0xee,
                    "round trip: \"%s\" contents differ", m.name.c_str());
    }
    test::check(r.meta("step") == "1000" && r.meta("tricky \"key\"\n") == tricky && r.meta("empty").empty(),
                "round trip: metadata values differ");
    test::check(r.has_meta("empty") && !r.has_meta("missing") && !r.has("missing") && r.path() == path,
                "round trip: has_meta/has/path");
    const auto names = dir.entries();
    test::check(names.size() == 1 && names[0] == "round_trip.safetensors", "write left %zu entries (temp file?)",
                names.size());

    // Writing again replaces the file atomically, and the writer is reusable.
    CheckpointWriter w2;
    const float one = 1.0f;
    w2.tensor("only", "F32", {}, &one, 4);
    w2.write(path);
    w2.write(path);
    const CheckpointReader r2(path);
    float back = 0;
    r2.read("only", &back, 4);
    test::check(r2.names() == std::vector<std::string>{"only"} && back == 1.0f && !r2.has_meta("step"),
                "rewrite: the new file replaced the old");
    test::check(dir.entries().size() == 1, "rewrite left stray entries");

    // A tensor bigger than one I/O request (64 MiB), at an odd size and odd file offset, goes
    // through the chunked write and read loops.
    {
        const size_t n = (size_t(150) << 20) + 3;
        std::vector<unsigned char> big(n), big_back(n);
        uint64_t x = test::rng()();
        for (size_t i = 0; i < n; i += 8) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            std::memcpy(big.data() + i, &x, std::min<size_t>(8, n - i));
        }
        CheckpointWriter wb;
        wb.tensor("odd", "U8", {3}, big.data(), 3);
        wb.tensor("big", "U8", {static_cast<int64_t>(n)}, big.data(), n);
        const std::string bpath = dir.file("big.safetensors");
        wb.write(bpath);
        const CheckpointReader rb(bpath);
        rb.read("big", big_back.data(), n);
        test::check(big_back == big && rb.info("big").offset % 8 == 3, "round trip of a 150 MiB tensor");
        ::unlink(bpath.c_str());
    }

    // A relative path (the directory to sync is ".").
    const std::string cwd = [] {
        char buf[4096];
        return std::string(::getcwd(buf, sizeof buf) ? buf : ".");
    }();
    if (::chdir(dir.path().c_str()) == 0) {
        w2.write("relative.safetensors");
        test::check(CheckpointReader("relative.safetensors").has("only"), "relative path round trip");
        ::unlink("relative.safetensors");
        test::check(::chdir(cwd.c_str()) == 0, "chdir back");
    }
}

void test_layout(const datatest::ScratchDir& dir) {
    // The exact header for a small case, and every byte's place in the file.
    const float a[2] = {1.5f, -2.0f};
    const uint8_t b = 9;
    CheckpointWriter w;
    w.meta("step", "12");
    w.meta("k\"", "v\\\n\t\x02");
    w.tensor("a", "F32", {2}, a, 8);
    w.tensor("b", "U8", {}, &b, 1);
    w.tensor("e", "I64", {0, 4}, nullptr, 0);
    const std::string json =
        "{\"__metadata__\":{\"step\":\"12\",\"k\\\"\":\"v\\\\\\n\\t\\u0002\"},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[8,9]},"
        "\"e\":{\"dtype\":\"I64\",\"shape\":[0,4],\"data_offsets\":[9,9]}}";
    const std::string header = w.header();
    test::check(header.size() % 8 == 0 && header.size() - json.size() < 8 && header.compare(0, json.size(), json) == 0 &&
                    header.find_first_not_of(' ', json.size()) == std::string::npos,
                "layout: header is \"%s\", want \"%s\" padded with spaces", header.c_str(), json.c_str());
    const std::string path = dir.file("layout.safetensors");
    w.write(path);
    const auto bytes = file_bytes(path);
    const uint64_t n = le64(bytes.data());
    test::check(n == header.size() && (8 + n) % 8 == 0 && bytes.size() == 8 + n + 9, "layout: length %" PRIu64
                ", file %zu bytes", n, bytes.size());
    test::check(std::string(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(n)) == header,
                "layout: header bytes in the file");
    test::check(std::memcmp(bytes.data() + 8 + n, a, 8) == 0 && bytes[8 + n + 8] == 9, "layout: data section bytes");
    const CheckpointReader r(path);
    test::check(r.info("a").offset == 8 + n && r.info("b").offset == 8 + n + 8 && r.info("e").offset == 8 + n + 9,
                "layout: info offsets are file offsets");
    test::check(r.meta("k\"") == "v\\\n\t\x02", "layout: escaped metadata reads back");
    test::check(r.names() == std::vector<std::string>{"a", "b", "e"}, "layout: names");

    // No tensors at all: the header alone.
    CheckpointWriter none;
    none.write(dir.file("none.safetensors"));
    const CheckpointReader rn(dir.file("none.safetensors"));
    test::check(rn.names().empty() && file_bytes(dir.file("none.safetensors")).size() == 8 + none.header().size(),
                "layout: a checkpoint without tensors");
}

void test_reader_accepts(const datatest::ScratchDir& dir) {
    // What another writer may produce: members in another order, whitespace, every escape, no
    // metadata, tensors listed out of data order.
    const std::string path = dir.file("foreign.safetensors");
    const std::vector<unsigned char> data = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    write_raw(path,
              " {\r\n \"z\" : { \"data_offsets\" : [ 4 , 10 ] , \"shape\":[3], \"dtype\":\"BF16\" },\n"
              "\t\"a\\/b\\u00e9\\ud83d\\ude00\\r\\b\\f\":{\"shape\":[2,1],\"dtype\":\"U16\",\"data_offsets\":[0,4]},"
              "\"zero\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[10,10]}}",
              data);
    const CheckpointReader r(path);
    const std::string odd = "a/b\xc3\xa9\xf0\x9f\x98\x80\r\b\f";
    test::check(r.names() == std::vector<std::string>{odd, "z", "zero"}, "foreign file: names in data order");
    unsigned char z[6] = {}, o[4] = {};
    r.read("z", z, 6);
    r.read(odd, o, 4);
    test::check(z[0] == 5 && z[5] == 10 && o[0] == 1 && o[3] == 4 && r.info("z").shape == std::vector<int64_t>{3},
                "foreign file: contents");
    expect_error("foreign file: no metadata at all", [&] { (void)r.meta("step"); }, {path, "no metadata key \"step\""});

    // 64-bit offsets: a sparse 5 GB file whose one tensor is past 4 GiB in size (not read).
    const std::string big = dir.file("sparse.safetensors");
    const uint64_t nbig = 5'000'000'000ull;
    write_raw(big, "{\"huge\":{\"dtype\":\"U8\",\"shape\":[5000000000],\"data_offsets\":[0,5000000000]}}", {});
    if (::truncate(big.c_str(), static_cast<off_t>(file_bytes(big).size() + nbig)) == 0) {
        const CheckpointReader rb(big);
        test::check(rb.info("huge").bytes == nbig && rb.info("huge").shape[0] == 5'000'000'000ll,
                    "64-bit sizes: a 5 GB tensor's info");
    }
    ::unlink(big.c_str());
}

void test_corrupt(const datatest::ScratchDir& dir) {
    const std::string p = dir.file("bad.safetensors");
    const auto open = [&] { CheckpointReader r(p); };
    const std::vector<unsigned char> ten(10, 7);
    const std::string good10 = "{\"t\":{\"dtype\":\"U8\",\"shape\":[10],\"data_offsets\":[0,10]}}";

    // Sizes.
    expect_error("missing file", [&] { CheckpointReader r(dir.file("nope")); }, {"cannot open checkpoint", "No such file"});
    expect_error("directory", [&] { CheckpointReader r(dir.path()); }, {dir.path(), "is a directory"});
    datatest::write_bytes(p, "abc", 3);
    expect_error("3-byte file", open, {p, "is 3 bytes, too short for its 8-byte header length"});
    write_raw(p, good10, ten, true, 1 << 20);
    expect_error("header length beyond the file", open, {p, "declares a 1048576-byte header, beyond the end"});
    write_raw(p, good10, ten, true, INT64_MAX);
    expect_error("absurd header length", open, {p, "beyond the end"});
    write_raw(p, good10, ten, false, 59);
    expect_error("unaligned header length", open, {p, "59-byte header, not a multiple of 8"});

    // Truncated and overlong data.
    write_raw(p, good10, std::vector<unsigned char>(9, 7));
    expect_error("truncated data", open, {p, "truncated", "describes 10 bytes of tensor data, but only 9"});
    write_raw(p, good10, std::vector<unsigned char>(11, 7));
    expect_error("trailing bytes", open, {p, "11 bytes after the header, more than the 10"});
    write_raw(p, "{\"t\":{\"dtype\":\"U8\",\"shape\":[5000000000],\"data_offsets\":[0,5000000000]}}", ten);
    expect_error("truncated, 64-bit sizes", open, {p, "describes 5000000000 bytes"});

    // Bad JSON: each problem named; a syntax error (nlohmann-json's words) with where it is.
    const std::vector<std::pair<std::string, std::string>> bad_json = {
        {"[1]", "is not a JSON object"},
        {"\"a\"", "is not a JSON object"},
        {"{\"a\":1,}", "at byte 7 of the header: syntax error while parsing object key - unexpected '}'"},
        {"{\"a\":{\"dtype\":\"U8\"}", "at byte 24 of the header: syntax error while parsing object - unexpected end of input"},
        {"{\"a\" 1}", "at byte 5 of the header: syntax error while parsing object separator"},
        {"{\"a\":\"unterminated}", "invalid string: missing closing quote"},
        {"{\"a\":\"bad \\x escape\"}", "at byte 11 of the header: syntax error while parsing value - invalid string: forbidden character after backslash"},
        {"{\"a\":\"\\u12g4\"}", "'\\u' must be followed by 4 hex digits"},
        {"{\"a\":\"\\ud800 lone\"}", "surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF"},
        {"{\"a\":\"\\udc00\"}", "surrogate U+DC00..U+DFFF must follow U+D800..U+DBFF"},
        {"{\"a\":\"raw\nnewline\"}", "control character U+000A (LF) must be escaped"},
        {"{\"a\":\"\xff\"}", "ill-formed UTF-8 byte; last read: '\"\\xff'"},
        {"{\"a\":\"\xc0\xaf\"}", "ill-formed UTF-8 byte"},  // an overlong '/'
        {std::string("{\"a\":\"nul\0\"}", 12), "control character U+0000 (NUL) must be escaped"},
        {"{\"a\":true}", "bad header JSON: true is not allowed"},
        {"{\"a\":false}", "bad header JSON: false is not allowed"},
        {"{\"a\":null}", "bad header JSON: null is not allowed"},
        {"{\"a\":-1}", "negative numbers are not allowed, found -1"},
        {"{\"a\":-0}", "negative numbers are not allowed"},
        {"{\"a\":1.5}", "only integers are allowed (no fraction or exponent), found 1.5"},
        {"{\"a\":1e3}", "only integers are allowed (no fraction or exponent), found 1e3"},
        {"{\"a\":012}", "at byte 7 of the header: syntax error while parsing object - unexpected number literal"},
        {"{\"a\":18446744073709551616}", "integer 18446744073709551616 does not fit in 64 bits"},
        {"{\"a\":1,\"a\":2}", "duplicate member \"a\""},
        {"{\"a\":{\"b\":1,\"b\":1}}", "duplicate member \"b\""},
        {"{} x", "at byte 3 of the header: syntax error while parsing value - invalid literal"},
        {"{}{}", "expected end of input"},
        {"{\"a\":" + std::string(40, '[') + std::string(40, ']') + "}", "nested deeper than 16 levels"},
    };
    for (const auto& [json, message] : bad_json) {
        write_raw(p, json, {});
        expect_error("bad JSON " + json, open, {"checkpoint " + p + ": bad header JSON", message});
    }
    // Members of the same name in different objects are not duplicates.
    write_raw(p, "{\"__metadata__\":{\"t\":\"x\"},\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}", {});
    test::check(CheckpointReader(p).meta("t") == "x", "a metadata key may be a tensor's name");

    // Schema problems.
    const std::vector<std::pair<std::string, std::string>> bad_schema = {
        {"{\"t\":[1]}", "tensor \"t\" is not an object"},
        {"{\"__metadata__\":[]}", "\"__metadata__\" is not an object"},
        {"{\"__metadata__\":{\"step\":12}}", "metadata value of \"step\" is not a string"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":[0]}}", "lacks its \"data_offsets\" field"},
        {"{\"t\":{\"shape\":[0],\"data_offsets\":[0,0]}}", "lacks its \"dtype\" field"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0],\"extra\":1}}", "unknown field \"extra\""},
        {"{\"t\":{\"dtype\":\"F16\",\"shape\":[0],\"data_offsets\":[0,0]}}", "unknown dtype \"F16\""},
        {"{\"t\":{\"dtype\":8,\"shape\":[0],\"data_offsets\":[0,0]}}", "\"dtype\" is not a string"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":3,\"data_offsets\":[0,3]}}", "\"shape\" is not an array"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":[\"3\"],\"data_offsets\":[0,3]}}", "\"shape\" holds something other"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":[9223372036854775808],\"data_offsets\":[0,0]}}", "\"shape\" holds something"},
        {"{\"t\":{\"dtype\":\"I64\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", "too many elements"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0,0]}}", "not a pair of integers"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[\"0\",0]}}", "not a pair of integers"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,2]}}", "data_offsets [4, 2] end before they begin"},
        {"{\"t\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,10]}}",
         "tensor \"t\" is BF16 [2, 3] (12 bytes) but its data_offsets [0, 10] span 10 bytes"},
        {"{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]}}", "\"t\" at [2, 4], does not begin at 0"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}",
         "tensor \"b\" at data_offsets [2, 6] overlaps tensor \"a\", which ends at 4"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}",
         "tensor \"b\" at data_offsets [0, 4] overlaps tensor \"a\""},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[6,10]}}",
         "tensor \"b\" at data_offsets [6, 10] leaves a gap after tensor \"a\", which ends at 4"},
    };
    for (const auto& [json, message] : bad_schema) {
        write_raw(p, json, std::vector<unsigned char>(10, 1));
        expect_error("bad schema " + json, open, {"checkpoint " + p + ": ", message});
    }

    // A real checkpoint cut short by one byte, or at its header.
    CheckpointWriter w;
    const auto payload = random_bytes(100);
    w.tensor("x", "U8", {100}, payload.data(), 100);
    w.write(p);
    const auto whole = file_bytes(p);
    datatest::write_bytes(p, whole.data(), whole.size() - 1);
    expect_error("real file minus a byte", open, {p, "truncated", "100 bytes of tensor data, but only 99"});
    datatest::write_bytes(p, whole.data(), 20);
    expect_error("real file cut in its header", open, {p, "beyond the end of the 20-byte file"});
}

void test_misuse(const datatest::ScratchDir& dir) {
    const std::string path = dir.file("misuse.safetensors");
    const uint16_t six[6] = {};
    CheckpointWriter w;
    w.tensor("x", "BF16", {2, 3}, six, 12);
    w.meta("step", "1");
    expect_error("bytes not matching the shape", [&] { w.tensor("y", "BF16", {2, 3}, six, 10); },
                 {"\"y\": 10 bytes given, but shape [2, 3] of BF16 is 12 bytes"});
    expect_error("unknown dtype", [&] { w.tensor("y", "F64", {1}, six, 8); }, {"\"y\": unknown dtype \"F64\""});
    expect_error("null dtype", [&] { w.tensor("y", nullptr, {1}, six, 8); }, {"unknown dtype (null)"});
    expect_error("negative dimension", [&] { w.tensor("y", "U8", {2, -1}, six, 0); }, {"shape [2, -1] has a negative"});
    expect_error("overflowing shape", [&] { w.tensor("y", "I64", {INT64_MAX, 4}, six, 0); }, {"too many elements"});
    expect_error("null data", [&] { w.tensor("y", "U8", {2}, nullptr, 2); }, {"null data for 2 bytes"});
    expect_error("duplicate tensor", [&] { w.tensor("x", "U8", {1}, six, 1); }, {"tensor \"x\" added twice"});
    expect_error("reserved name", [&] { w.tensor("__metadata__", "U8", {1}, six, 1); }, {"other than \"__metadata__\""});
    expect_error("empty name", [&] { w.tensor("", "U8", {1}, six, 1); }, {"non-empty valid UTF-8"});
    expect_error("invalid UTF-8 name", [&] { w.tensor("a\xff", "U8", {1}, six, 1); }, {"valid UTF-8"});
    expect_error("duplicate metadata key", [&] { w.meta("step", "2"); }, {"key \"step\" given twice"});
    expect_error("invalid UTF-8 metadata", [&] { w.meta("k", "\xe2\x82"); }, {"valid UTF-8"});
    {
        CheckpointWriter huge;
        huge.meta("huge", std::string(ckpt::kMaxHeaderBytes, 'x'));
        expect_error("header over the size limit", [&] { huge.write(path); },
                     {"cannot write checkpoint " + path, "more than the 100000000-byte limit"});
        test::check(!has_entry_with(dir, ".tmp.") && ::access(path.c_str(), F_OK) != 0,
                    "header over the size limit: nothing written");
    }
    w.write(path);  // the refused calls changed nothing
    const CheckpointReader r(path);
    test::check(r.names() == std::vector<std::string>{"x"} && r.meta("step") == "1", "misuse: refused calls left no trace");

    uint16_t buf[8];
    expect_error("missing tensor (info)", [&] { (void)r.info("y"); }, {path, "has no tensor \"y\""});
    expect_error("missing tensor (read)", [&] { r.read("y", buf, 2); }, {path, "has no tensor \"y\""});
    expect_error("missing metadata key", [&] { (void)r.meta("lr"); }, {path, "has no metadata key \"lr\""});
    expect_error("read into the wrong size", [&] { r.read("x", buf, 16); },
                 {path, "tensor \"x\" is 12 bytes (BF16 [2, 3]), the caller's buffer 16"});
}

void test_write_failures(const datatest::ScratchDir& dir) {
    const uint8_t one = 1;
    CheckpointWriter w;
    w.tensor("x", "U8", {}, &one, 1);

    const std::string nodir = dir.file("no/such/dir/c.safetensors");
    expect_error("write into a missing directory", [&] { w.write(nodir); },
                 {"cannot write checkpoint " + nodir, "cannot create temporary file " + nodir + ".tmp.",
                  "No such file or directory"});

    // The final rename fails (the path is a directory): the temp file is removed.
    const std::string target = dir.file("is_a_dir");
    ::mkdir(target.c_str(), 0755);
    datatest::write_bytes(target + "/keep", "k", 1);
    expect_error("rename onto a directory", [&] { w.write(target); },
                 {"cannot write checkpoint " + target, "renaming " + target + ".tmp.", "into place", "Is a directory"});
    test::check(!has_entry_with(dir, ".tmp."), "failed rename left its temp file");
    ::unlink((target + "/keep").c_str());
    ::rmdir(target.c_str());

    // A write that fails partway (the file size limit stands in for a full disk), in a child so
    // the limit stays there: a clear message, no temp file, the previous checkpoint untouched.
    const std::string path = dir.file("limited.safetensors");
    w.write(path);
    const auto before = file_bytes(path);
    std::vector<unsigned char> big(3 << 20, 0x5a);
    CheckpointWriter wb;
    wb.tensor("big", "U8", {static_cast<int64_t>(big.size())}, big.data(), big.size());
    test::check_fails_with("write past the file size limit", "File too large", [&] {
        const rlimit lim{1 << 20, 1 << 20};
        ::setrlimit(RLIMIT_FSIZE, &lim);
        std::signal(SIGXFSZ, SIG_IGN);
        try {
            wb.write(path);
        } catch (const CheckpointError& e) {
            std::fprintf(stderr, "%s\n", e.what());
            std::fflush(stderr);
            _exit(1);
        }
    });
    test::check(!has_entry_with(dir, ".tmp.") && file_bytes(path) == before,
                "failed write: temp file left or previous checkpoint changed");
    ::unlink(path.c_str());
}

// A writer killed mid-write leaves the previous checkpoint whole at the final path.
void test_interrupted_write(const datatest::ScratchDir& dir) {
    const std::string path = dir.file("resume.safetensors");
    const auto old_data = random_bytes(4096);
    CheckpointWriter old;
    old.meta("step", "100");
    old.tensor("w", "U8", {4096}, old_data.data(), old_data.size());
    old.write(path);
    const auto old_file = file_bytes(path);

    // 64 tensors sharing one 64 MiB buffer: a 4 GiB file, which the child is far from finishing
    // when it is killed, in a few tens of MiB.
    const size_t chunk = size_t(64) << 20;
    std::vector<unsigned char> buf(chunk, 0x33);
    CheckpointWriter big;
    big.meta("step", "200");
    for (int i = 0; i < 64; ++i)
        big.tensor(std::string("t").append(std::to_string(i)), "U8", {static_cast<int64_t>(chunk)}, buf.data(), chunk);  // not "t" + std::string&&: GCC 12's false -Wrestrict at -O3

    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid == 0) {
        try {
            big.write(path);
        } catch (...) {
        }
        _exit(0);
    }
    const std::string tmp = path + ".tmp." + ckpt::detail::host_tag() + "." + std::to_string(pid);
    off_t seen = 0;
    bool growing = false;
    for (int i = 0; i < 20000 && !growing; ++i) {  // up to ~10 s
        struct stat st {};
        if (::stat(tmp.c_str(), &st) == 0) {
            growing = st.st_size > seen && seen > 0 && st.st_size >= (8 << 20);
            seen = std::max(seen, st.st_size);
        }
        if (!growing) {
            const timespec ts{0, 500'000};
            ::nanosleep(&ts, nullptr);
        }
    }
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    test::check(growing && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
                "interrupted write: the child was not caught mid-write (temp file reached %lld bytes)",
                static_cast<long long>(seen));

    test::check(file_bytes(path) == old_file, "interrupted write: the previous checkpoint changed");
    try {
        const CheckpointReader r(path);
        std::vector<unsigned char> back(4096);
        r.read("w", back.data(), back.size());
        test::check(r.meta("step") == "100" && back == old_data && r.names() == std::vector<std::string>{"w"},
                    "interrupted write: the previous checkpoint does not read back");
    } catch (const CheckpointError& e) {
        test::check(false, "interrupted write: the previous checkpoint does not read back: %s", e.what());
    }
    // What is left is the dead writer's temp file, which the reader refuses as truncated.
    struct stat st {};
    if (test::check(::stat(tmp.c_str(), &st) == 0 && st.st_size < 8 + (off_t(64) << 26),
                    "interrupted write: the partial temp file should remain under its own name"))
        expect_error("the partial temp file", [&] { CheckpointReader rt(tmp); }, {tmp, "truncated"});
    ::unlink(tmp.c_str());
    const auto names = dir.entries();
    test::check(names.size() == 1 && names[0] == "resume.safetensors", "interrupted write: stray entries");
}

// CRC-32C one bit at a time, straight from the definition (reflected polynomial 0x82F63B78).
uint32_t crc32c_bitwise(const unsigned char* p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
        c ^= p[i];
        for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
}

// Each implementation the host may pick (SSE4.2's instruction where the CPU has it, the tables
// everywhere), and crc32c itself, against known vectors and the bitwise reference.
void test_crc32c() {
    // RFC 3720 (iSCSI) appendix B.4 and the common check value.
    std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF), up(32), down(32);
    for (int i = 0; i < 32; ++i) up[i] = static_cast<unsigned char>(i), down[i] = static_cast<unsigned char>(31 - i);
    const char* check = "123456789";
    const struct {
        const void* p;
        size_t n;
        uint32_t want;
    } vectors[] = {{zeros.data(), 32, 0x8A9136AAu}, {ones.data(), 32, 0x62A8AB43u}, {up.data(), 32, 0x46DD794Eu},
                   {down.data(), 32, 0x113FDB5Cu},  {check, 9, 0xE3069283u},        {check, 0, 0u}};
    using Impl = uint32_t (*)(uint32_t, const void*, size_t);
    std::vector<std::pair<const char*, Impl>> impls = {{"crc32c", &ckpt::crc32c},
                                                       {"tables", &ckpt::detail::crc32c_tables}};
#if defined(__x86_64__)
    if (ckpt::detail::have_sse42())
        impls.push_back({"sse4.2", &ckpt::detail::crc32c_sse42});
    else
        std::printf("this CPU lacks SSE4.2: crc32c's instruction path is not tested here\n");
#endif
    const auto data = random_bytes(5000);
    for (const auto& [name, crc] : impls) {
        for (const auto& v : vectors)
            test::check(crc(0, v.p, v.n) == v.want, "%s of a known vector: %08x, want %08x", name, crc(0, v.p, v.n), v.want);
        // Random data at every alignment and length, in random pieces, against the bitwise reference.
        for (int trial = 0; trial < 200; ++trial) {
            const size_t begin = test::rng()() % 64, n = test::rng()() % (data.size() - begin);
            const uint32_t want = crc32c_bitwise(data.data() + begin, n);
            uint32_t got = 0;
            for (size_t at = 0; at < n;) {
                const size_t piece = std::min<size_t>(n - at, test::rng()() % 40);
                got = crc(got, data.data() + begin + at, piece);
                at += piece;
            }
            if (!test::check(got == want && crc(0, data.data() + begin, n) == want,
                             "%s of %zu random bytes at offset %zu: %08x, want %08x", name, n, begin, got, want))
                break;
        }
    }
}

void test_manifest(const datatest::ScratchDir& dir) {
    const auto a = random_bytes(3000), b = random_bytes(777);
    CheckpointWriter wa, wb;
    wa.meta("rank", "0");
    wa.tensor("a", "U8", {3000}, a.data(), a.size());
    wb.tensor("b", "U8", {777}, b.data(), b.size());
    const ckpt::FileDigest da = wa.write(dir.file("rank0.safetensors")), db = wb.write(dir.file("rank1.safetensors"));
    const auto bytes0 = file_bytes(dir.file("rank0.safetensors"));
    test::check(da.bytes == bytes0.size() && da.crc32c == crc32c_bitwise(bytes0.data(), bytes0.size()),
                "the writer's digest is the file's size and CRC-32C");
    test::check(ckpt::file_digest(dir.file("rank1.safetensors")) == db, "file_digest agrees with the writer's");

    ckpt::Manifest m;
    m.meta = {{"step", "7"}, {"note", "quote \" and \\"}};
    m.files = {{"rank0.safetensors", da}, {"rank1.safetensors", db}};
    test::check(!ckpt::has_manifest(dir.path()), "no manifest before one is written");
    ckpt::write_manifest(dir.path(), m);
    test::check(!has_entry_with(dir, ".tmp."), "the manifest's temp file is gone");
    const ckpt::Manifest back = ckpt::read_manifest(dir.path());
    test::check(back.meta == m.meta && back.files.size() == 2 && back.files[0].name == "rank0.safetensors" &&
                    back.files[0].digest == da && back.files[1].digest == db,
                "the manifest reads back");
    bool ok = true;
    try {
        ckpt::verify_file(dir.path(), back, "rank0.safetensors");
        ckpt::verify_file(dir.path(), back, "rank1.safetensors");
    } catch (const CheckpointError& e) {
        ok = test::check(false, "intact files verify: %s", e.what());
    }
    (void)ok;
    const std::string p1 = dir.file("rank1.safetensors");
    // One flipped bit anywhere (here in the tensor data) fails the checksum, naming the file.
    auto flipped = file_bytes(p1);
    flipped[flipped.size() - 100] ^= 0x08;
    datatest::write_bytes(p1, flipped.data(), flipped.size());
    expect_error("a flipped bit", [&] { ckpt::verify_file(dir.path(), back, "rank1.safetensors"); },
                 {p1, "CRC-32C", ckpt::crc_text(db.crc32c)});
    // Another rank's file in its place: the size differs.
    datatest::write_bytes(p1, bytes0.data(), bytes0.size());
    expect_error("a file of another size", [&] { ckpt::verify_file(dir.path(), back, "rank1.safetensors"); },
                 {p1, std::to_string(bytes0.size()) + " bytes", std::to_string(db.bytes)});
    expect_error("a file the manifest does not list", [&] { ckpt::verify_file(dir.path(), back, "rank2.safetensors"); },
                 {"does not list rank2.safetensors"});
    expect_error("a missing meta key", [&] { back.get("seed", "M"); }, {"manifest M has no \"seed\""});

    const std::string mpath = ckpt::manifest_path(dir.path());
    for (const auto& [text, part] : std::vector<std::pair<std::string, std::string>>{
             {"{\"meta\":{},\"files\":[{\"name\":\"r\",\"bytes\":1,\"crc32c\":\"0000000g\"}]}", "8 lowercase hex"},
             {"{\"meta\":{},\"files\":[{\"name\":\"r\",\"crc32c\":\"00000000\"}]}", "lacks its \"bytes\""},
             {"{\"meta\":{},\"files\":[{\"name\":\"../r\",\"bytes\":1,\"crc32c\":\"00000000\"}]}", "plain file name"},
             {"{\"meta\":{},\"files\":[{\"name\":\"r\",\"bytes\":1,\"crc32c\":\"00000000\"},"
              "{\"name\":\"r\",\"bytes\":1,\"crc32c\":\"00000000\"}]}", "listed twice"},
             {"{\"meta\":{\"step\":7},\"files\":[]}", "not a string"},
             {"{\"files\":[]}", "\"meta\" is missing"},
             {"{\"meta\":{},\"files\":[],\"extra\":1}", "unknown member"},
             {"{\"meta\":{},\"files\":[]", "bad header JSON"}}) {
        datatest::write_bytes(mpath, text.data(), text.size());
        expect_error("broken manifest " + text, [&] { ckpt::read_manifest(dir.path()); }, {mpath, part});
    }
    ckpt::remove_manifest(dir.path());
    test::check(!ckpt::has_manifest(dir.path()), "remove_manifest removes it");
    ckpt::remove_manifest(dir.path());  // and a missing one is fine
    expect_error("no manifest", [&] { ckpt::read_manifest(dir.path()); }, {"cannot open manifest " + mpath});
}

// A dead writer's temp file of this host goes; a live process's, another host's and other files stay.
void test_stale_temps(const datatest::ScratchDir& dir) {
    std::fflush(stdout);
    const pid_t dead = ::fork();
    if (dead == 0) _exit(0);
    ::waitpid(dead, nullptr, 0);
    const std::string host = ckpt::detail::host_tag();
    const std::string stale = "rank0.safetensors.tmp." + host + "." + std::to_string(dead);
    const std::string live = "rank1.safetensors.tmp." + host + "." + std::to_string(::getppid());
    const std::string other = "rank2.safetensors.tmp.other-host-x." + std::to_string(dead);
    for (const std::string& name : {stale, live, other, std::string("rank0.safetensors")})
        datatest::write_bytes(dir.file(name), "x", 1);
    const auto removed = ckpt::remove_stale_temps(dir.path());
    const auto left = dir.entries();
    test::check(removed == std::vector<std::string>{stale} && left.size() == 3 &&
                    std::find(left.begin(), left.end(), stale) == left.end(),
                "remove_stale_temps removes exactly the dead process's temp file (%zu removed, %zu left)", removed.size(),
                left.size());
    test::check(ckpt::temp_path("/d/f") == "/d/f.tmp." + host + "." + std::to_string(::getpid()),
                "temp files are named PATH.tmp.<host>.<pid>");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 3 && std::string(argv[1]) == "--write-sample") {
        try {
            write_sample(argv[2]);
        } catch (const CheckpointError& e) {
            std::fprintf(stderr, "error: %s\n", e.what());
            return 1;
        }
        return 0;
    }
    if (argc == 3 && std::string(argv[1]) == "--list") return list(argv[2]);
    if (argc != 1) {
        std::fprintf(stderr, "usage: test_data_checkpoint [--write-sample PATH | --list PATH]\n");
        return 2;
    }
    test::seed();
    datatest::ScratchDir dir;
    test_round_trip(dir);
    datatest::ScratchDir d2;
    test_layout(d2);
    test_reader_accepts(d2);
    test_corrupt(d2);
    test_misuse(d2);
    datatest::ScratchDir d3;
    test_write_failures(d3);
    datatest::ScratchDir d4;
    test_interrupted_write(d4);
    test_crc32c();
    datatest::ScratchDir d5;
    test_manifest(d5);
    datatest::ScratchDir d6;
    test_stale_temps(d6);

    // The sample the Python test checks also reads back here.
    const std::string sample = d2.file("sample.safetensors");
    write_sample(sample);
    const CheckpointReader r(sample);
    int64_t step = 0;
    r.read("step", &step, 8);
    test::check(step == 1234 && r.names().size() == 8 && r.meta("step") == "1234", "sample reads back");
    return test::finish();
}
