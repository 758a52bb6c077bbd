// The shard reader and writer (data/shard.h): a round trip, every kind of bad file with the
// message it must give, and the file pattern expansion order.
#include <algorithm>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "data/shard.h"
#include "tests/data/data_test_util.h"

using dataload::read_shard;
using dataload::read_shard_header;
using datatest::expect_data_error;
using datatest::write_raw_shard;

static void test_round_trip(const datatest::ScratchDir& dir) {
    std::vector<uint16_t> tokens;
    for (int i = 0; i < 5000; ++i) tokens.push_back(static_cast<uint16_t>((i * 7919) % 65536));
    tokens[17] = dataload::kBosId;
    const std::string path = dir.file("round_trip.bin");
    dataload::write_shard(path, tokens);
    test::check(read_shard(path) == tokens, "round trip: tokens differ");
    test::check(read_shard_header(path).num_tokens == 5000, "round trip: header count");
    const auto names = dir.entries();
    test::check(names.size() == 1 && names[0] == "round_trip.bin", "write_shard left %zu entries (temp file?)",
                names.size());

    // Empty shards are valid: a header and nothing else.
    const std::string empty = dir.file("empty.bin");
    dataload::write_shard(empty, std::vector<uint16_t>{});
    test::check(read_shard(empty).empty(), "empty shard reads as empty");

    // The header matches the format byte for byte: magic, version, count, then zeros.
    const std::string bytes = datatest::read_text_file(path);
    int32_t h[256];
    std::memcpy(h, bytes.data(), sizeof h);
    bool zeros = true;
    for (int i = 3; i < 256; ++i) zeros = zeros && h[i] == 0;
    test::check(bytes.size() == 1024 + 2 * 5000 && h[0] == 20240520 && h[1] == 1 && h[2] == 5000 && zeros,
                "written header layout");
}

static void test_bad_files(const datatest::ScratchDir& dir) {
    const std::vector<uint16_t> ten(10, 7);

    const std::string missing = dir.file("missing.bin");
    expect_data_error("missing file", [&] { read_shard(missing); },
                      {"cannot open token shard", missing, "No such file or directory"});
    expect_data_error("missing file (header only)", [&] { read_shard_header(missing); }, {missing, "No such file"});

    expect_data_error("directory", [&] { read_shard(dir.path()); }, {dir.path(), "is a directory"});

    // Permission bits do not stop root, so this case only means something for other users.
    const std::string locked = dir.file("locked.bin");
    write_raw_shard(locked, 20240520, 1, 10, ten);
    ::chmod(locked.c_str(), 0);
    if (::geteuid() != 0)
        expect_data_error("unreadable file", [&] { read_shard(locked); }, {locked, "Permission denied"});
    ::chmod(locked.c_str(), 0644);

    const std::string zero = dir.file("zero.bin");
    datatest::write_bytes(zero, "", 0);
    expect_data_error("empty file", [&] { read_shard(zero); }, {zero, "is 0 bytes, shorter than its 1024-byte header"});

    const std::string short_header = dir.file("short_header.bin");
    const std::vector<unsigned char> hundred(100, 1);
    datatest::write_bytes(short_header, hundred.data(), hundred.size());
    expect_data_error("short header", [&] { read_shard(short_header); },
                      {short_header, "is 100 bytes, shorter than its 1024-byte header"});

    const std::string magic = dir.file("magic.bin");
    write_raw_shard(magic, 12345, 1, 10, ten);
    expect_data_error("wrong magic", [&] { read_shard(magic); },
                      {magic, "has magic number 12345, expected 20240520"});

    const std::string version = dir.file("version.bin");
    write_raw_shard(version, 20240520, 2, 10, ten);
    expect_data_error("wrong version", [&] { read_shard(version); },
                      {version, "has version 2, only version 1 is supported"});

    const std::string too_few = dir.file("too_few_tokens.bin");
    write_raw_shard(too_few, 20240520, 1, 12, ten);
    expect_data_error("count above file size", [&] { read_shard(too_few); },
                      {too_few, "claims 12 tokens (1048 bytes with the header) but the file has 1044 bytes"});

    const std::string too_many = dir.file("too_many_tokens.bin");
    write_raw_shard(too_many, 20240520, 1, 8, ten);
    expect_data_error("count below file size (no silent truncation)", [&] { read_shard(too_many); },
                      {too_many, "claims 8 tokens (1040 bytes with the header) but the file has 1044 bytes"});

    const std::string odd = dir.file("odd.bin");
    write_raw_shard(odd, 20240520, 1, 10, ten, 1);
    expect_data_error("half a token at the end", [&] { read_shard(odd); },
                      {odd, "claims 10 tokens (1044 bytes with the header) but the file has 1045 bytes"});

    const std::string negative = dir.file("negative.bin");
    write_raw_shard(negative, 20240520, 1, -3, ten);
    expect_data_error("negative count", [&] { read_shard(negative); }, {negative, "negative token count (-3)"});

    // The cheap header check sees the same problems.
    expect_data_error("header check: wrong magic", [&] { read_shard_header(magic); }, {magic, "magic number"});
    expect_data_error("header check: size mismatch", [&] { read_shard_header(too_few); }, {too_few, "claims 12 tokens"});
}

static void test_write_errors(const datatest::ScratchDir& dir) {
    const std::string nowhere = dir.file("no_such_dir/x.bin");
    expect_data_error("write into a missing directory", [&] { dataload::write_shard(nowhere, std::vector<uint16_t>(4, 1)); },
                      {"cannot create", nowhere});
    // A failed rename (the target is a non-empty directory) leaves no temporary file behind.
    const std::string target = dir.file("occupied");
    ::mkdir(target.c_str(), 0755);
    datatest::write_bytes(target + "/keep", "x", 1);
    const size_t before = dir.entries().size();
    expect_data_error("rename onto a directory", [&] { dataload::write_shard(target, std::vector<uint16_t>(4, 1)); },
                      {"cannot write token shard", target, "rename"});
    test::check(dir.entries().size() == before, "failed write left a temporary file");
}

static void test_glob(const datatest::ScratchDir& dir) {
    for (const char* name : {"b.bin", "B.bin", "a_10.bin", "a_9.bin", ".hidden.bin"})
        dataload::write_shard(dir.file(name), std::vector<uint16_t>{1});
    const auto files = dataload::expand_glob(dir.file("*.bin"));
    // Byte order, as Python's sorted() gives (upper case before lower, '1' before '9'); names
    // starting with '.' are not matched, as in Python's glob.
    const std::vector<std::string> want = {dir.file("B.bin"), dir.file("a_10.bin"), dir.file("a_9.bin"), dir.file("b.bin")};
    test::check(files == want, "glob order: got %zu files, first %s", files.size(), files.empty() ? "-" : files[0].c_str());
    const std::string none = dir.file("nothing_*.bin");
    expect_data_error("glob with no match", [&] { dataload::expand_glob(none); }, {"no files match", none});
    test::check(dataload::expand_glob(dir.file("b.bin")) == std::vector<std::string>{dir.file("b.bin")},
                "a plain path matches itself");
}

int main() {
    datatest::ScratchDir dir;
    test_round_trip(dir);
    {
        datatest::ScratchDir bad;
        test_bad_files(bad);
    }
    {
        datatest::ScratchDir w;
        test_write_errors(w);
    }
    {
        datatest::ScratchDir g;
        test_glob(g);
    }
    return test::finish();
}
