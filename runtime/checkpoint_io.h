// Checkpoint save and load: one safetensors file per rank and a manifest per directory (the format
// and its integrity checks: runtime/checkpoint_format.h), of a list of named device tensors. What the list
// holds (the parameters, the optimizer state) is the trainer's.
#pragma once
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_format.h"
#include "../kernels/common.cuh"
#include "arena.h"
#include "host_comm.h"
#include "log.h"

// ---- checkpoints: one file per rank, DIR/stepNNNNNN/rankR.safetensors (format: runtime/checkpoint_format.h) ----
std::string checkpoint_path(const std::string& dir, int step, int rank) {
    char name[64];
    std::snprintf(name, sizeof name, "/step%06d/rank%d.safetensors", step, rank);
    return dir + name;
}

// A state tensor's dtype as safetensors names it.
const char* safetensors_dtype(DType t) { return t == DType::u16 ? "U16" : t == DType::bf16 ? "BF16" : "F32"; }

// A device region's host copy, kept alive until the writer has written it.
struct HostCopies {
    std::vector<std::vector<unsigned char>> blocks;
    const void* copy(const void* device, size_t bytes) {
        blocks.emplace_back(bytes);
        CUDA_CHECK(cudaMemcpy(blocks.back().data(), device, bytes, cudaMemcpyDeviceToHost));
        return blocks.back().data();
    }
};

// A fresh identity for one save, the same on every rank (rank 0's, broadcast): every rank file and
// the manifest carry it, so files of different saves of one directory cannot pass for one.
std::string new_save_id() {
    std::random_device rd;
    uint64_t id = uint64_t(rd()) << 32 | rd();
    host_broadcast(&id, sizeof id);
    char text[20];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(id));
    return text;
}

// A tensor of a checkpoint file: its name, safetensors dtype and shape, and its bytes on the device.
struct CheckpointTensor {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    void* device;
    size_t bytes;
};
using CheckpointMeta = std::vector<std::pair<std::string, std::string>>;  // key, value, in file order

// One save of the directory ROOT/stepNNNNNN: every rank writes its file (`meta` and `tensors`), then
// rank 0 the manifest (`manifest_meta`, and each file's size and CRC-32C). The directory is one unit:
// rank 0 first removes an old manifest, so a save that dies midway leaves no manifest, and resume
// refuses the directory. Both metas should carry the save's id (new_save_id). Collective; returns the
// step directory, or throws std::runtime_error saying what could not be written.
std::string write_checkpoint(const std::string& root, int step, int rank, int world, const CheckpointMeta& meta,
                             const std::vector<CheckpointTensor>& tensors, const CheckpointMeta& manifest_meta) {
    const std::string path = checkpoint_path(root, step, rank);
    const std::string dir = path.substr(0, path.rfind('/'));
    if (rank == 0) {
        for (const std::string& p : {root, dir})
            if (mkdir(p.c_str(), 0755) != 0 && errno != EEXIST)
                throw std::runtime_error("cannot create " + p + ": " + std::strerror(errno));
        ckpt::remove_manifest(dir);
    }
    host_barrier();
    for (const std::string& stale : ckpt::remove_stale_temps(dir))
        std::fprintf(stderr, "train_gpt: removed %s/%s, the temp file of a dead process\n", dir.c_str(), stale.c_str());
    HostCopies host;
    ckpt::CheckpointWriter w;
    for (const auto& [key, value] : meta) w.meta(key, value);
    for (const CheckpointTensor& t : tensors)
        w.tensor(t.name, t.dtype.c_str(), t.shape, host.copy(t.device, t.bytes), t.bytes);
    const ckpt::FileDigest digest = w.write(path);
    std::vector<ckpt::FileDigest> all(world);
    static_assert(sizeof(ckpt::FileDigest) == 16, "gathered as bytes");
    host_gather(&digest, sizeof digest, all.data());
    if (rank == 0) {
        ckpt::Manifest man;
        man.meta = manifest_meta;
        for (int k = 0; k < world; ++k) man.files.push_back({"rank" + std::to_string(k) + ".safetensors", all[k]});
        ckpt::write_manifest(dir, man);
    }
    host_barrier();
    return dir;
}

// What every file of a checkpoint directory must agree on: its manifest's (or, for a directory
// saved before manifests, rank 0's file's) metadata.
struct CheckpointIdentity {
    std::string preset, step, seed, world_size, save_id;  // save_id: "" in files from before it
};

// A rank file's metadata against the directory's identity and the rank it must be: a file of
// another rank or another save (a copy, a directory a killed re-save left mixed) is refused by name.
void check_rank_file(const ckpt::CheckpointReader& f, int rank, const CheckpointIdentity& id) {
    const auto differs = [&](const char* key, const std::string& want) {
        if (f.meta(key) != want)
            throw std::runtime_error(f.path() + " has " + key + " " + f.meta(key) + ", but the directory's is " + want +
                                     " (a file of another " + (std::string(key) == "rank" ? "rank" : "save") + ")");
    };
    differs("rank", std::to_string(rank));
    differs("preset", id.preset);
    differs("step", id.step);
    differs("seed", id.seed);
    differs("world_size", id.world_size);
    if (!id.save_id.empty()) differs("save_id", f.has_meta("save_id") ? id.save_id : "");
}

// What a checkpoint must have been saved by to continue this run: its preset, world size and seed.
struct RunIdentity {
    std::string preset;
    int world = 1;
    uint64_t seed = 0;
};

// A checkpoint continues only a run of its own preset, world size and seed.
void check_same_run(const RunIdentity& run, const CheckpointIdentity& id) {
    if (id.preset != run.preset || id.world_size != std::to_string(run.world))
        throw std::runtime_error("it was saved by preset " + id.preset + " on " + id.world_size + " ranks; this run is preset " +
                                 run.preset + " on " + std::to_string(run.world));
    if (id.seed != std::to_string(run.seed))
        throw std::runtime_error("it was saved by a run with --seed " + id.seed + "; this run has --seed " +
                                 std::to_string(run.seed));
}

// The directory's identity from its manifest, after checking this rank's file and rank 0's
// against the manifest's sizes and checksums; without a manifest only when `unverified`
// (--resume-unverified), with a warning in the log.
CheckpointIdentity verified_identity(const std::string& dir, int rank, const RunIdentity& run, bool unverified, LogSink& log) {
    const std::string mine = "rank" + std::to_string(rank) + ".safetensors";
    if (!ckpt::has_manifest(dir)) {
        if (!unverified)
            throw std::runtime_error(ckpt::manifest_path(dir) + " is missing: the save did not finish (a run or re-save " +
                                     "killed midway), or the checkpoint predates manifests. --resume-unverified loads " +
                                     "a directory saved before manifests without verifying its bytes");
        log_print(log, "WARNING: %s has no manifest: nothing in it can be verified (--resume-unverified); its files are only "
                  "checked against each other's metadata and this run's shapes\n", dir.c_str());
        const ckpt::CheckpointReader first(dir + "/rank0.safetensors");
        const CheckpointIdentity id{first.meta("preset"), first.meta("step"), first.meta("seed"), first.meta("world_size"),
                                    first.has_meta("save_id") ? first.meta("save_id") : ""};
        check_same_run(run, id);
        return id;
    }
    const ckpt::Manifest man = ckpt::read_manifest(dir);
    const std::string mpath = ckpt::manifest_path(dir);
    const CheckpointIdentity id{man.get("preset", mpath), man.get("step", mpath), man.get("seed", mpath),
                                man.get("world_size", mpath), man.get("save_id", mpath)};
    check_same_run(run, id);
    if (man.files.size() != size_t(run.world))
        throw std::runtime_error(mpath + " lists " + std::to_string(man.files.size()) + " files for " + id.world_size + " ranks");
    ckpt::verify_file(dir, man, mine);
    if (rank != 0) ckpt::verify_file(dir, man, "rank0.safetensors");
    return id;
}

// A checkpoint directory opened for loading (a stepNNNNNN directory a run of the same preset, world
// size and seed saved), verified as above: this rank's file and rank 0's (the parameters).
struct OpenCheckpoint {
    ckpt::CheckpointReader mine, first;
    int step;
};
OpenCheckpoint open_checkpoint(const std::string& dir, int rank, const RunIdentity& run, bool unverified, LogSink& log) {
    const CheckpointIdentity id = verified_identity(dir, rank, run, unverified, log);
    OpenCheckpoint c{ckpt::CheckpointReader(dir + "/rank" + std::to_string(rank) + ".safetensors"),
                     ckpt::CheckpointReader(dir + "/rank0.safetensors"), std::stoi(id.step)};
    check_rank_file(c.mine, rank, id);
    check_rank_file(c.first, 0, id);
    return c;
}

// One tensor of file `f` onto the device, checked against this run's dtype and shape.
void read_tensor(const ckpt::CheckpointReader& f, const CheckpointTensor& t) {
    const ckpt::CheckpointReader::Info& in = f.info(t.name);
    if (in.dtype != t.dtype || in.shape != t.shape)
        throw std::runtime_error(f.path() + ": tensor " + t.name + " is " + in.dtype + " " + ckpt::detail::shape_text(in.shape) +
                                 ", this run's is " + t.dtype + " " + ckpt::detail::shape_text(t.shape));
    std::vector<unsigned char> h(t.bytes);
    f.read(t.name, h.data(), t.bytes);
    CUDA_CHECK(cudaMemcpy(t.device, h.data(), t.bytes, cudaMemcpyHostToDevice));
}
