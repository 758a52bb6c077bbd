// The training batches, made ahead of the step on a background thread, so that the thread issuing
// the GPU's work never waits for the device or for host work between micro-steps.
//
// A ring of kSlots slots; each holds a micro-batch's pinned image (runtime/device_batch.h) and what the
// host derives from the batch: the id segments of the embedding backward, the step's MTP weights
// (its first micro-step) and, on Adam steps of the sparse bigram comms, the exchange's plan (every
// rank's touched rows, from the deterministic loader: kernels/comms.cuh). The producer thread runs
// the training loader through a list of steps, following the schedule (each step's batch size: it
// knows the step of every micro-batch), and fills the slots in order; the issuing thread takes
// them in the same order (next), enqueues their uploads and records each slot's event (upload_batch),
// and hands the slot back (issued). The producer waits for that event, on its own thread, before it
// rewrites the slot. The issuing thread waits only for the producer, when it runs more than kSlots
// micro-batches ahead of the uploads the device has done (the ring is then its natural throttle).
//
// Errors of the producer (the loader's DataError, the data's exhaustion, a token outside the
// vocabulary) are kept in the slot of the micro-batch that failed and rethrown by next() when the
// issuing thread reaches it: where and with the message the loader gave on the issuing thread.
//
// The producer touches no MPI and only these CUDA calls: cudaEventSynchronize on its slots' events
// (emu serializes its streams' engine under one lock, so that call may run queued work from this
// thread). Everything else, the pinned allocations and event records included, is the issuing thread's.
#pragma once
#include <ctime>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../data/loader.h"
#include "../kernels/comms.cuh"
#include "../kernels/head.cuh"  // kMaxMtpWeights
#include "device_batch.h"

// The calling thread's CPU time in milliseconds.
inline double thread_cpu_ms() {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) * 1e3 + double(t.tv_nsec) / 1e6;
}

// One micro-batch as made by the producer.
struct BatchSlot {
    std::unique_ptr<BatchImage> image;
    int step = 0, micro = 0;
    float* mtp = nullptr;  // pinned, kMaxMtpWeights: the step's MTP weights (micro 0 only)
    int n_mtp = 0;
    int32_t* plan_rows = nullptr;  // pinned: the sparse exchange's row indexes
    bool has_plan = false;         // an Adam step's last micro-step: plan holds the exchange's plan
    SparseExchangePlan plan;
    std::exception_ptr error;      // the producer stopped here
};

// Which micro-batches a producer makes: every micro-step of `steps`, in order; those of steps before
// `first_made` only advance the loader (a resumed run's data position: the sparse sets are marked
// where the first made step needs them).
struct BatchSchedule {
    std::vector<int> steps;
    int first_made = 0;
};
// What the schedule says of a step's batch: its tokens over all ranks and micro-steps, the length
// its documents are cut at, and the multi-token-prediction weights its first micro-step carries.
struct StepBatch {
    int64_t batch_tokens = 0;
    int max_seq_len = 0;
    std::vector<float> mtp_weights;
};
// The shapes every micro-batch follows: at most max_tokens tokens per rank, cu_seqlens entries by
// max_docs, grad_accum micro-steps per step, ids in `tokens`.
struct BatchShape {
    int max_tokens = 0, grad_accum = 1;
    dataload::MaxDocsRule max_docs;
    TokenSpace tokens{};
};
inline std::vector<int> step_range(int from, int to) {
    std::vector<int> v;
    for (int s = from; s < to; ++s) v.push_back(s);
    return v;
}

// The sparse bigram exchange's share of the producer: every rank's touched rows since the last
// Adam step, and the bound the exchange's buffers were sized for. world 0: no sparse comms.
struct SparsePlanning {
    int world = 0, max_touched = 0, rows = 0;
};

class BatchProducer {
public:
    static constexpr int kSlots = 3;

    // `batches`: the schedule's batch of each step of `plan`, in the same order.
    BatchProducer(const BatchShape& shape, std::unique_ptr<dataload::TrainLoader> loader, int rank, SparsePlanning sparse,
                  size_t image_ints, BatchSchedule plan, std::vector<StepBatch> batches)
        : shape_(shape), loader_(std::move(loader)), rank_(rank), sparse_(sparse), plan_(std::move(plan)),
          batches_(std::move(batches)) {
        if (batches_.size() != plan_.steps.size())
            throw std::logic_error("batch producer: " + std::to_string(batches_.size()) + " step batches for " +
                                   std::to_string(plan_.steps.size()) + " steps");
        const int T = shape.max_tokens;
        for (std::vector<int32_t>* v : {&inputs_, &targets_, &bigram_}) v->resize(T);
        cu_.resize(size_t(shape.max_docs.capacity(T)));
        const size_t plan_bytes =
            sparse.world > 0 ? sparse_exchange_host_bytes(sparse.rows, sparse.world, sparse.max_touched) : 4;
        for (BatchSlot& s : slots_) {
            s.image = std::make_unique<BatchImage>(image_ints);
            CUDA_CHECK(cudaMallocHost(&s.mtp, kMaxMtpWeights * sizeof(float)));
            CUDA_CHECK(cudaMallocHost(&s.plan_rows, std::max<size_t>(plan_bytes, 4)));
        }
        if (sparse.world > 0) touched_.assign(sparse.world, TouchedRows(sparse.rows));
        thread_ = std::thread([this] { run(); });
    }
    ~BatchProducer() {
        {
            std::lock_guard<std::mutex> lock(m_);
            stop_ = true;
        }
        cv_.notify_all();
        thread_.join();
        for (BatchSlot& s : slots_) {  // cudaFreeHost waits for the device: no upload still reads them
            cudaFreeHost(s.mtp);
            cudaFreeHost(s.plan_rows);
        }
    }
    BatchProducer(const BatchProducer&) = delete;
    BatchProducer& operator=(const BatchProducer&) = delete;

    // Issuing thread: the next micro-batch (step, micro), made; rethrows the producer's error there.
    BatchSlot& next(int step, int micro) {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return made_ > taken_; });
        BatchSlot& s = slots_[taken_ % kSlots];
        if (s.error) std::rethrow_exception(s.error);
        if (s.step != step || s.micro != micro)
            throw std::logic_error("batch producer: micro-step " + std::to_string(micro) + " of step " +
                                   std::to_string(step) + " asked for, " + std::to_string(s.micro) + " of step " +
                                   std::to_string(s.step) + " made (the schedules differ)");
        ++taken_;
        return s;
    }
    // Issuing thread: the slot's upload is enqueued and its event recorded; the producer may refill it.
    void issued() {
        {
            std::lock_guard<std::mutex> lock(m_);
            ++issued_;
        }
        cv_.notify_all();
    }
    // CPU milliseconds the producer's thread spent per made micro-batch (its own CPU time: what it
    // costs a core whatever else runs), all of it and the sparse plan's share (marking every rank's
    // ids and planning), for the record (--plan-step prints them).
    double ms_per_batch() {
        std::lock_guard<std::mutex> lock(m_);
        return made_ms_ / double(std::max<long>(1, made_count_));
    }
    double sparse_ms_per_batch() {
        std::lock_guard<std::mutex> lock(m_);
        return sparse_ms_ / double(std::max<long>(1, made_count_));
    }

private:
    void run() {
        size_t n = 0;  // micro-batches made
        int step = -1;
        try {
            int64_t batch_tokens = 0;
            int max_seq_len = 0;
            for (size_t k = 0; k < plan_.steps.size(); ++k) {
                step = plan_.steps[k];
                const StepBatch& sb = batches_[k];
                if (sb.batch_tokens != batch_tokens || sb.max_seq_len != max_seq_len) {  // upstream's send
                    loader_->set_batch(sb.batch_tokens, sb.max_seq_len, shape_.grad_accum);
                    batch_tokens = sb.batch_tokens, max_seq_len = sb.max_seq_len;
                }
                for (int i = 0; i < shape_.grad_accum; ++i) {
                    loader_->advance();
                    if (step < plan_.first_made) {  // a resumed run: the rows of the even step before it count
                        if (sparse_.world > 0 && step % 2 == 0 && step + 1 == plan_.first_made) mark_every_rank();
                        continue;
                    }
                    if (!wait_for_slot(n)) return;
                    make(slots_[n % kSlots], step, i, batches_[k].mtp_weights);
                    publish(n);
                    ++n;
                }
            }
        } catch (const dataload::DataError& e) {  // the data's own errors, said with the step they stop
            if (!wait_for_slot(n)) return;
            const std::string why = "step " + std::to_string(step) + ": " + e.what();
            slots_[n % kSlots].error = std::make_exception_ptr(dataload::DataError(why));
            publish(n);
        } catch (...) {
            if (!wait_for_slot(n)) return;
            slots_[n % kSlots].error = std::current_exception();
            publish(n);
        }
    }

    // Until slot n % kSlots is free (its previous micro-batch issued and uploaded); false: stopping.
    bool wait_for_slot(size_t n) {
        {
            std::unique_lock<std::mutex> lock(m_);
            cv_.wait(lock, [&] { return stop_ || n < issued_ + kSlots; });
            if (stop_) return false;
        }
        BatchImage& img = *slots_[n % kSlots].image;
        if (img.in_flight) CUDA_CHECK(cudaEventSynchronize(img.uploaded));  // off the issuing thread
        img.in_flight = false;
        return true;
    }
    void publish(size_t n) {
        {
            std::lock_guard<std::mutex> lock(m_);
            made_ = n + 1;
        }
        cv_.notify_all();
    }

    // This rank's micro-batch of the loader's current micro-step into slot s, with what derives from it.
    void make(BatchSlot& s, int step, int micro, const std::vector<float>& mtp_weights) {
        const double t0 = thread_cpu_ms();
        const dataload::Batch b = loader_->fill(rank_, buffers());
        const int T = static_cast<int>(b.num_tokens), num_cu = static_cast<int>(b.cu_entries);
        if (const std::string e = vocabulary_error(b, inputs_.data(), targets_.data(), shape_.tokens.vocab_size,
                                                   loader_->files(), rank_);
            !e.empty())
            throw dataload::DataError(e);
        DeviceBatch region;  // the capacities a batch must fit (the arena's packed region)
        region.capacity = shape_.max_tokens;
        region.cu_capacity = static_cast<int>(shape_.max_docs.capacity(region.capacity));
        if (const std::string e = batch_error(region, shape_.tokens, inputs_.data(), targets_.data(), cu_.data(), num_cu, T);
            !e.empty())
            throw dataload::DataError("bad batch: " + e);
        pack_batch(*s.image, builder_, shape_.tokens, inputs_.data(), targets_.data(), cu_.data(), num_cu, bigram_.data(),
                   T);
        s.step = step;
        s.micro = micro;
        s.n_mtp = 0;
        if (micro == 0) {
            if (mtp_weights.size() > size_t(kMaxMtpWeights))
                throw std::logic_error("batch producer: " + std::to_string(mtp_weights.size()) + " MTP weights for step " +
                                       std::to_string(step) + ", at most " + std::to_string(kMaxMtpWeights));
            std::copy(mtp_weights.begin(), mtp_weights.end(), s.mtp);
            s.n_mtp = static_cast<int>(mtp_weights.size());
        }
        const double t1 = thread_cpu_ms();
        s.has_plan = false;
        if (sparse_.world > 0) {
            mark_every_rank();
            if (step % 2 == 1 && micro == shape_.grad_accum - 1) {
                s.plan = plan_sparse_exchange(touched_, rank_, sparse_.max_touched, s.plan_rows, scratch_);
                s.has_plan = true;
            }
        }
        const double t2 = thread_cpu_ms();
        std::lock_guard<std::mutex> lock(m_);
        made_ms_ += t2 - t0;
        sparse_ms_ += t2 - t1;
        ++made_count_;
    }

    // Every rank's bigram ids of the loader's current micro-step into its touched set.
    void mark_every_rank() {
        for (int r = 0; r < sparse_.world; ++r) {
            const dataload::Batch b = loader_->fill(r, buffers());
            touched_[r].mark(bigram_.data(), size_t(b.num_tokens));
        }
    }

    dataload::BatchBuffers buffers() {
        return {inputs_.data(),    targets_.data(), cu_.data(), bigram_.data(), static_cast<int64_t>(inputs_.size()),
                static_cast<int64_t>(cu_.size())};
    }

    BatchShape shape_;
    std::unique_ptr<dataload::TrainLoader> loader_;
    int rank_;
    SparsePlanning sparse_;
    BatchSchedule plan_;
    std::vector<StepBatch> batches_;
    BatchSlot slots_[kSlots];
    std::vector<int32_t> inputs_, targets_, bigram_, cu_, scratch_;
    IdSegmentBuilder builder_;
    std::vector<TouchedRows> touched_;
    double made_ms_ = 0, sparse_ms_ = 0;
    long made_count_ = 0;
    std::mutex m_;
    std::condition_variable cv_;
    size_t made_ = 0, taken_ = 0, issued_ = 0;
    bool stop_ = false;
    std::thread thread_;
};
