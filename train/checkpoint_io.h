// Checkpoint save and load: one safetensors file per rank and a manifest per directory (the format
// and its integrity checks: data/checkpoint.h). Part of train_gpt.cu's run section: included after
// its Run.
#pragma once
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../runtime/checkpoint_format.h"
#include "host_comm.h"

// ---- checkpoints: one file per rank, DIR/stepNNNNNN/rankR.safetensors (format: data/checkpoint.h) ----
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

// Everything the next step depends on: the parameters (rank 0; every rank holds the same), this
// rank's optimizer state, the Adam gradients accumulated over an even step, and the counters.
// The data position and YaRN follow from the step: a resume replays the loader and the schedule.
// The directory is one unit: rank 0 first removes an old manifest, every rank writes its file, then
// rank 0 writes the manifest listing each file's size and CRC-32C. A save that dies midway leaves
// no manifest, and resume refuses the directory. Nothing is written when any rank's parameters or
// optimizer state hold a non-finite value.
// The manifest also names the chain of runs the directory belongs to (`lineage`) and what a resume
// must match to continue the same computation (r.facts: the schedule, the data, the kernels).
// `training_ms`: the run's training time up to this step, in the log's line for scripts/stats.py.
void save_checkpoint(Run& r, int step, double training_ms) {
    refresh_lm_head_copies(r.m, r.s);  // a tied embed follows the last Adam step's lm_head
    await_all_gathered(r.m.gathered, r.s);
    CUDA_CHECK(cudaStreamSynchronize(r.s));
    check_finite(r, step, "before saving a checkpoint");
    const std::string path = checkpoint_path(r.opt.save_dir, step, r.d.rank);
    const std::string dir = path.substr(0, path.rfind('/'));
    const std::string save_id = new_save_id();
    try {
        if (r.d.rank == 0) {
            for (const std::string& p : {r.opt.save_dir, dir})
                if (mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) fail("cannot create " + p + ": " + std::strerror(errno));
            ckpt::remove_manifest(dir);
        }
        host_barrier();
        for (const std::string& stale : ckpt::remove_stale_temps(dir))
            std::fprintf(stderr, "train_gpt: removed %s/%s, the temp file of a dead process\n", dir.c_str(), stale.c_str());
    } catch (const std::exception& e) {
        fail(e.what());
    }
    HostCopies host;
    ckpt::CheckpointWriter w;
    w.meta("format", "train_gpt checkpoint 1");
    w.meta("preset", r.m.cfg.name);
    w.meta("step", std::to_string(step));
    w.meta("world_size", std::to_string(r.d.world));
    w.meta("rank", std::to_string(r.d.rank));
    w.meta("seed", std::to_string(r.opt.seed));
    w.meta("run_id", r.opt.run_id);
    w.meta("save_id", save_id);
    w.meta("split_embed", r.o.split ? "1" : "0");
    const bool pending_adam_grads = step % 2 == 1;  // the even step's gradients wait for this odd step
    for (const OptimGroup& q : r.o.group) {
        const std::string label = q.rule->label;
        const char* dt = q.t.fp32 ? "F32" : "BF16";
        const size_t full = size_t(q.t.rows * q.t.row_elems) * q.elem_bytes();
        if (r.d.rank == 0) w.tensor("param." + label, dt, {q.t.rows, q.t.row_elems}, host.copy(q.t.param, full), full);
        for (const StateTensor& t : q.state)
            w.tensor(t.name + ("." + label), safetensors_dtype(t.dtype), t.shape, host.copy(t.data, t.bytes()), t.bytes());
        if (q.rule->optim == Optim::adam) {
            w.meta("adam_steps." + label, std::to_string(q.adam_steps));
            if (pending_adam_grads) w.tensor("grad." + label, dt, {q.t.rows, q.t.row_elems}, host.copy(q.t.grad, full), full);
        }
    }
    ckpt::FileDigest digest;
    try {
        digest = w.write(path);
    } catch (const std::exception& e) {
        fail(e.what());
    }
    std::vector<ckpt::FileDigest> all(r.d.world);
    static_assert(sizeof(ckpt::FileDigest) == 16, "gathered as bytes");
    host_gather(&digest, sizeof digest, all.data());
    if (r.d.rank == 0) {
        ckpt::Manifest man;
        man.meta = {{"format", "train_gpt manifest 1"},  {"preset", r.m.cfg.name},
                    {"step", std::to_string(step)},      {"world_size", std::to_string(r.d.world)},
                    {"seed", std::to_string(r.opt.seed)}, {"run_id", r.opt.run_id},
                    {"save_id", save_id},                {"lineage", r.lineage}};
        man.meta.insert(man.meta.end(), r.facts.begin(), r.facts.end());
        for (int k = 0; k < r.d.world; ++k) man.files.push_back({"rank" + std::to_string(k) + ".safetensors", all[k]});
        try {
            ckpt::write_manifest(dir, man);
        } catch (const std::exception& e) {
            fail(e.what());
        }
    }
    host_barrier();
    print0(r, "saved checkpoint %s step:%d train_time:%.0fms\n", dir.c_str(), step, training_ms);
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

// A checkpoint continues only a run of its own preset, world size and seed.
void check_same_run(const Run& r, const CheckpointIdentity& id) {
    if (id.preset != r.m.cfg.name || id.world_size != std::to_string(r.d.world))
        throw std::runtime_error("it was saved by preset " + id.preset + " on " + id.world_size + " ranks; this run is preset " +
                                 r.m.cfg.name + " on " + std::to_string(r.d.world));
    if (id.seed != std::to_string(r.opt.seed))
        throw std::runtime_error("it was saved by a run with --seed " + id.seed + "; this run has --seed " +
                                 std::to_string(r.opt.seed));
}

// The directory's identity from its manifest, after checking this rank's file and rank 0's
// against the manifest's sizes and checksums; without a manifest only with --resume-unverified.
CheckpointIdentity verified_identity(Run& r, const std::string& dir) {
    const std::string mine = "rank" + std::to_string(r.d.rank) + ".safetensors";
    if (!ckpt::has_manifest(dir)) {
        if (!r.opt.resume_unverified)
            throw std::runtime_error(ckpt::manifest_path(dir) + " is missing: the save did not finish (a run or re-save " +
                                     "killed midway), or the checkpoint predates manifests. --resume-unverified loads " +
                                     "a directory saved before manifests without verifying its bytes");
        print0(r, "WARNING: %s has no manifest: nothing in it can be verified (--resume-unverified); its files are only "
                  "checked against each other's metadata and this run's shapes\n", dir.c_str());
        const ckpt::CheckpointReader first(dir + "/rank0.safetensors");
        const CheckpointIdentity id{first.meta("preset"), first.meta("step"), first.meta("seed"), first.meta("world_size"),
                                    first.has_meta("save_id") ? first.meta("save_id") : ""};
        check_same_run(r, id);
        return id;
    }
    const ckpt::Manifest man = ckpt::read_manifest(dir);
    const std::string mpath = ckpt::manifest_path(dir);
    const CheckpointIdentity id{man.get("preset", mpath), man.get("step", mpath), man.get("seed", mpath),
                                man.get("world_size", mpath), man.get("save_id", mpath)};
    check_same_run(r, id);
    if (man.files.size() != size_t(r.d.world))
        throw std::runtime_error(mpath + " lists " + std::to_string(man.files.size()) + " files for " + id.world_size + " ranks");
    ckpt::verify_file(dir, man, mine);
    if (r.d.rank != 0) ckpt::verify_file(dir, man, "rank0.safetensors");
    return id;
}

// Loads the checkpoint in `dir` (a stepNNNNNN directory a run of the same preset, world size and
// seed saved), verified as above and tensor by tensor against this run's dtypes and shapes;
// returns its step.
int load_checkpoint(Run& r, const std::string& dir) {
    try {
        const CheckpointIdentity id = verified_identity(r, dir);
        const ckpt::CheckpointReader mine(dir + "/rank" + std::to_string(r.d.rank) + ".safetensors");
        const ckpt::CheckpointReader first(dir + "/rank0.safetensors");  // the parameters
        check_rank_file(mine, r.d.rank, id);
        check_rank_file(first, 0, id);
        const int step = std::stoi(id.step);
        auto load = [](const ckpt::CheckpointReader& f, const std::string& name, const char* dtype,
                       const std::vector<int64_t>& shape, void* device, size_t bytes) {
            const ckpt::CheckpointReader::Info& in = f.info(name);
            if (in.dtype != dtype || in.shape != shape)
                throw std::runtime_error(f.path() + ": tensor " + name + " is " + in.dtype + " " + ckpt::detail::shape_text(in.shape) +
                                         ", this run's is " + dtype + " " + ckpt::detail::shape_text(shape));
            std::vector<unsigned char> h(bytes);
            f.read(name, h.data(), bytes);
            CUDA_CHECK(cudaMemcpy(device, h.data(), bytes, cudaMemcpyHostToDevice));
        };
        r.o.split = mine.meta("split_embed") == "1";
        r.m.lm_head_fp8_stale = true, r.m.embed_stale = false;  // a saved embed is lm_head's already while tied
        for (OptimGroup& q : r.o.group) {
            const std::string label = q.rule->label;
            const char* dt = q.t.fp32 ? "F32" : "BF16";
            const std::vector<int64_t> whole = {q.t.rows, q.t.row_elems};
            const size_t full = size_t(q.t.rows * q.t.row_elems) * q.elem_bytes();
            load(first, "param." + label, dt, whole, q.t.param, full);
            for (const StateTensor& t : q.state)
                load(mine, t.name + ("." + label), safetensors_dtype(t.dtype), t.shape, t.data, t.bytes());
            if (q.rule->optim == Optim::adam) {
                q.adam_steps = std::stoi(mine.meta("adam_steps." + label));
                if (step % 2 == 1) load(mine, "grad." + label, dt, whole, q.t.grad, full);
            }
        }
        return step;
    } catch (const std::exception& e) {
        fail("cannot resume from " + dir + ": " + e.what());
    }
}
