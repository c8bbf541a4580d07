// batcher.cc: the packing rule, the memory estimate and the batch loop.
#include "server/runtime/batcher.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/thread_name.h"

namespace hsx {

int64_t EstimateBatchBytes(const ModelConfig& c, int tp, const std::vector<int64_t>& lengths,
                           int64_t capture_layers, bool final_norm) {
  int64_t tokens = 0, longest = 0;
  for (int64_t n : lengths) {
    tokens += n;
    longest = std::max(longest, n);
  }
  const int64_t heads = c.num_attention_heads / tp;
  const int64_t h = c.hidden_size;
  const int64_t attention = heads * c.qk_head_dim() + c.q_lora_rank + 2 * c.kv_lora_rank +
                            c.qk_rope_head_dim + heads * (c.qk_nope_head_dim + 2 * c.v_head_dim);
  const int64_t dense = 2 * c.intermediate_size / tp;
  const int64_t moe = c.n_routed_experts == 0
                          ? 0
                          : 2 * c.num_experts_per_tok * (h + c.moe_intermediate_size) +
                                2 * c.moe_intermediate_size * c.n_shared_experts / tp + h;
  const int64_t per_token = 3 * h + attention + std::max(dense, moe) + h * (capture_layers + final_norm);
  // Attention score and key matrices, bounded by every local head at once.
  const int64_t scores = heads * (longest * longest + longest * c.qk_head_dim());
  return static_cast<int64_t>(sizeof(float)) * (tokens * per_token + scores);
}

std::vector<size_t> PackNext(const std::vector<int64_t>& lengths, int64_t max_batch_tokens,
                             size_t lookahead,
                             const std::function<bool(const std::vector<int64_t>&)>& fits) {
  std::vector<size_t> chosen;
  std::vector<int64_t> chosen_lengths;
  int64_t tokens = 0;
  const size_t scan = std::min(lengths.size(), std::max<size_t>(lookahead, 1));
  for (size_t i = 0; i < scan && tokens < max_batch_tokens; ++i) {
    const bool first = chosen.empty();  // the oldest sample always runs
    if (!first && tokens + lengths[i] > max_batch_tokens) continue;
    chosen_lengths.push_back(lengths[i]);
    if (!first && fits && !fits(chosen_lengths)) {
      chosen_lengths.pop_back();
      continue;
    }
    chosen.push_back(i);
    tokens += lengths[i];
  }
  return chosen;
}

Batcher::Batcher(Engine& engine, const BatcherOptions& options)
    : engine_(engine),
      options_(options),
      thread_([this] { Loop(); }),
      delivery_thread_([this] { DeliveryLoop(); }) {}

Batcher::~Batcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();  // every queued sample has run and been handed over
  {
    std::lock_guard<std::mutex> lock(delivery_mutex_);
    loop_ended_ = true;
  }
  delivery_wake_.notify_all();
  delivery_thread_.join();
}

absl::Status Batcher::Submit(WorkItem item) {
  if (absl::Status lost = engine_.lost(); !lost.ok()) return lost;
  const int64_t length = static_cast<int64_t>(item.tokens.size());
  if (length == 0) return absl::InvalidArgumentError("empty sample");
  if (length > options_.max_batch_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("sample of ", length, " tokens exceeds the batch "
                                                   "budget of ", options_.max_batch_tokens, " tokens"));
  }
  if (options_.max_batch_bytes > 0) {
    const int64_t bytes = EstimateBatchBytes(engine_.config(), engine_.options().tp, {length},
                                             static_cast<int64_t>(item.capture.ids().size()),
                                             item.capture.final_norm());
    if (bytes > options_.max_batch_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("sample of ", length, " tokens needs ", bytes,
                                                       " bytes, over the batch memory limit of ",
                                                       options_.max_batch_bytes));
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queued_tokens_ += length;
    queue_.push_back(std::move(item));
  }
  wake_.notify_one();
  return absl::OkStatus();
}

int64_t Batcher::batches_run() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return batches_;
}

int64_t Batcher::queued_tokens() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queued_tokens_;
}

double Batcher::fill() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return batches_ == 0 ? 0.0
                       : static_cast<double>(tokens_run_) /
                             static_cast<double>(batches_ * options_.max_batch_tokens);
}

void Batcher::Loop() {
  NameThisThread("hsx-batcher");
  for (;;) {
    std::vector<WorkItem> batch;
    std::vector<WorkItem> dropped;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (it->abandoned && it->abandoned()) {
          queued_tokens_ -= static_cast<int64_t>(it->tokens.size());
          dropped.push_back(std::move(*it));
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (WorkItem& item : dropped) item.deliver(absl::CancelledError("the request was cancelled before it ran"));
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (queue_.empty()) continue;
      std::vector<int64_t> lengths;
      const size_t scan = std::min(queue_.size(), options_.lookahead);
      for (size_t i = 0; i < scan; ++i) lengths.push_back(static_cast<int64_t>(queue_[i].tokens.size()));
      auto fits = [&](const std::vector<int64_t>& candidate) {
        return options_.max_batch_bytes <= 0 ||
               EstimateBatchBytes(engine_.config(), engine_.options().tp, candidate,
                                  engine_.config().num_hidden_layers + 1, true) <= options_.max_batch_bytes;
      };
      std::vector<size_t> chosen = PackNext(lengths, options_.max_batch_tokens, options_.lookahead, fits);
      for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) {
        batch.push_back(std::move(queue_[*it]));
        queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(*it));
      }
      std::reverse(batch.begin(), batch.end());
      for (const WorkItem& item : batch) queued_tokens_ -= static_cast<int64_t>(item.tokens.size());
    }
    // After a lost device, Run() fails each later batch at once without
    // touching a device, so the queue empties promptly.
    RunBatch(std::move(batch));
  }
}

void Batcher::RunBatch(std::vector<WorkItem> items) {
  Batch batch;
  std::vector<const CaptureSpec*> specs;
  std::vector<std::optional<RowCheck>> checks;
  std::vector<int64_t> values;
  Fp8Samples fp8;  // the samples sent as fp8: a device encodes them (Model::Run)
  for (const WorkItem& item : items) {
    batch.AddSample(item.tokens);
    specs.push_back(&item.capture);
    checks.push_back(item.row_check);
    values.push_back(static_cast<int64_t>(item.tokens.size()) * engine_.config().hidden_size);
    const bool sent_as_fp8 = item.row_check.has_value() && item.row_check->dtype == OutputDType::kFp8;
    fp8.push_back(sent_as_fp8 ? std::optional<CaptureSpec>(item.capture) : std::nullopt);
  }
  const CaptureSpec capture = CaptureSpec::Union(specs);
  const size_t tensors = capture.ids().size() + (capture.final_norm() ? 1 : 0);
  auto check = std::make_unique<CaptureCheck>(checks, engine_.options().precision, tensors,
                                              std::move(values));
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].encode_buffer == nullptr) continue;
    check->EncodeFp8(static_cast<int64_t>(i), capture, items[i].capture,
                     static_cast<int64_t>(items[i].tokens.size()), engine_.config().hidden_size,
                     items[i].encode_buffer);
  }
  // The copies of the last captures may still run: Deliver waits for them on
  // the delivery thread while the next batch starts here.
  absl::StatusOr<Captures> captures = engine_.Run(batch, capture, Engine::Copies::kFence, check.get(), fp8);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++batches_;
    tokens_run_ += static_cast<int64_t>(batch.tokens.size());
  }
  HandOver({std::move(items), std::move(captures), std::move(check)});
}

void Batcher::HandOver(Finished finished) {
  std::unique_lock<std::mutex> lock(delivery_mutex_);
  delivery_wake_.wait(lock, [&] { return !handed_over_.has_value(); });
  handed_over_ = std::move(finished);
  delivery_wake_.notify_all();
}

void Batcher::DeliveryLoop() {
  NameThisThread("hsx-delivery");
  for (;;) {
    std::optional<Finished> finished;
    {
      std::unique_lock<std::mutex> lock(delivery_mutex_);
      delivery_wake_.wait(lock, [&] { return handed_over_.has_value() || loop_ended_; });
      if (!handed_over_.has_value()) return;  // the loop has ended and everything is delivered
      finished.emplace(*std::move(handed_over_));  // the slot stays taken until this batch is delivered
    }
    Deliver(*std::move(finished));
    {
      std::lock_guard<std::mutex> lock(delivery_mutex_);
      handed_over_.reset();
    }
    delivery_wake_.notify_all();
  }
}

void Batcher::Deliver(Finished finished) {
  std::vector<WorkItem>& items = finished.items;
  if (finished.captures.ok()) {
    if (absl::Status s = engine_.WaitForCopies(*finished.captures); !s.ok()) finished.captures = s;
  }
  if (!finished.captures.ok()) {
    for (WorkItem& item : items) item.deliver(finished.captures.status());
    return;
  }
  std::vector<SampleTensors> samples = ViewBySample(*std::move(finished.captures));
  for (size_t i = 0; i < items.size(); ++i) {
    finished.check->AttachFindings(static_cast<int64_t>(i), samples[i]);
    items[i].deliver(SelectCaptures(std::move(samples[i]), items[i].capture));
  }
}

}  // namespace hsx
