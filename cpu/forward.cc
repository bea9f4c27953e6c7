// The forward pass mirrors reference/oracle.cc step for step (see there for the
// graph and where it comes from); only the arithmetic differs.
#include "cpu/forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cpu/act_quant.h"
#include "cpu/amx_matmul.h"
#include "cpu/delta_net.h"
#include "cpu/simd_kernels.h"
#include "cpu/thread_pool.h"
#include "cpu/vnni_matmul.h"
#include "kernels/nn_math.h"
#include "loader/quant.h"

namespace moegraph {
namespace {

// The fewest activation rows a q8_0 or q4_K product takes to the batch
// kernels, and to AMX tiles among them: the tiles compute 32 at a time, VNNI
// 16, so fewer waste their work (one thread, tools/bench/bench_amx.cc, q4_K
// 768 x 2048, an expert's gate or up, G multiply-adds/s in two runs: by 8
// rows AMX 28-29, VNNI 37-39, the per-row path 34-42, about even; by 32,
// 98-114, 87-90 and 39).
constexpr int64_t kBatchMinActs = 8;
constexpr int64_t kAmxMinActs = 16;

// Weight rows per task: enough tasks to balance the threads, rows enough to
// amortize a task.
int64_t RowsPerTask(int64_t rows, int threads, int64_t n_act) {
  if (threads <= 1) return rows;
  const int64_t min_rows = n_act > 4 ? 4 : 16;
  return std::max(min_rows, rows / (8 * static_cast<int64_t>(threads)));
}

std::vector<float> OptionalTensor(const GgufTensor* t) {
  return t == nullptr ? std::vector<float>() : TensorToFloat(*t);
}

struct LayerVectors {
  std::vector<float> attn_norm, ffn_norm, q_norm, k_norm, bq, bk, bv, bo, sinks, router_b, score_b;
  // Expert biases, expert e's at e * n_ff_exp (down: e * n_embd); empty when none.
  std::vector<float> gate_b, up_b, down_b;
  // A Gated DeltaNet's conv taps, dt bias, ssm_a and norm.
  std::vector<float> conv, dt_bias, ssm_a, ssm_norm;
};

// Activation rows quantized for one weight type.
struct Acts {
  ActType type = ActType::kF32;
  size_t row_bytes = 0;
  int64_t rows = 0;
  std::vector<uint8_t> data;
  const uint8_t* row(int64_t r) const { return data.data() + static_cast<size_t>(r) * row_bytes; }
};

// One matmul job of a batch of them run as one pool job: out rows of w for the
// activation rows act (all of them, contiguous).
struct MatJob {
  WeightView w;
  const Acts* act = nullptr;
  int64_t act_begin = 0, n_act = 0;
  float* out = nullptr;  // out[t * w.rows + r]
};

class CpuForward final : public Oracle {
 public:
  CpuForward(const Model& model, int max_ctx, ExpertProvider* experts,
             const CpuForwardOptions& options)
      : model_(model),
        max_ctx_(max_ctx),
        model_experts_(model),
        experts_(experts != nullptr ? experts : &model_experts_),
        pool_(options.threads > 0 ? options.threads : PhysicalCores()),
        kv_f16_(options.kv_type == KvCacheType::kF16),
        ubatch_(options.ubatch),
        amx_(options.batch_matmul && options.amx && AmxInt8Available()),
        vnni_(options.batch_matmul && AvxVnniAvailable()),
        overlap_reads_(options.overlap_reads),
        rings_(model.config, max_ctx, options.ring_slack()) {
    const ModelConfig& cfg = model.config;
    for (const LayerTensors& lt : model.layers) {
      layers_.push_back(
          {TensorToFloat(*lt.attn_norm), TensorToFloat(*lt.ffn_norm), OptionalTensor(lt.q_norm),
           OptionalTensor(lt.k_norm), OptionalTensor(lt.bq), OptionalTensor(lt.bk),
           OptionalTensor(lt.bv), OptionalTensor(lt.bo), OptionalTensor(lt.sinks),
           OptionalTensor(lt.router_b), OptionalTensor(lt.score_b), OptionalTensor(lt.gate_exps_b),
           OptionalTensor(lt.up_exps_b), OptionalTensor(lt.down_exps_b),
           OptionalTensor(lt.delta_net.conv), OptionalTensor(lt.delta_net.dt_bias),
           OptionalTensor(lt.delta_net.a), OptionalTensor(lt.delta_net.norm)});
      if (cfg.mixer(static_cast<int>(layers_.size()) - 1) == LayerMixer::kDeltaNet) {
        states_.emplace(static_cast<int>(layers_.size()) - 1, CpuDeltaNetState(cfg.delta_net));
      }
    }
    output_norm_ = TensorToFloat(*model.output_norm);
    const size_t row_bytes = static_cast<size_t>(cfg.n_head_kv) * cfg.head_dim * (kv_f16_ ? 2 : 4);
    for (int il = 0; il < cfg.n_layer; ++il) {
      const int rows = KvLayerRows(cfg, il, max_ctx, options.ring_slack());
      kv_rows_.push_back(rows < max_ctx ? rows : 0);
      k_cache_.emplace_back(static_cast<size_t>(rows) * row_bytes);
      v_cache_.emplace_back(static_cast<size_t>(rows) * row_bytes);
    }
  }

  absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens) override {
    return Run(tokens, /*all_logits=*/true);
  }
  absl::StatusOr<std::vector<float>> ForwardLast(absl::Span<const int32_t> tokens) override {
    return Run(tokens, /*all_logits=*/false);
  }
  int n_past() const override { return n_past_; }
  // A Gated DeltaNet's state holds every position before n_past_, so going
  // back takes the newest checkpoint at or below n_keep (or a zero state) and
  // feeds the kept ids from there again at the next call; windowed rings that
  // lost positions the kept ones' windows read feed them again from 0.
  void Truncate(int n_keep) override {
    const int kept = std::clamp(n_keep, 0, n_past_);
    if (keeps_ids()) {
      const int from = ResumePosition(kept);
      resume_from_ = from == kept && StatesAt(kept) ? -1 : from;
      fed_.resize(static_cast<size_t>(kept));
      while (!checkpoints_.empty() && checkpoints_.back().position > kept) {
        checkpoints_.pop_back();
      }
    }
    n_past_ = kept;
  }
  int ResumePosition(int n_keep) const override {
    const int kept = std::clamp(n_keep, 0, n_past_);
    if (!keeps_ids() || StatesAt(kept)) return rings_.Holds(kept) ? kept : 0;
    if (!rings_.Holds(kept)) return 0;
    for (auto it = checkpoints_.rbegin(); it != checkpoints_.rend(); ++it) {
      if (it->position <= kept) return it->position;
    }
    return 0;
  }

 private:
  // Checks the batch, feeds again what a Truncate left the rings without, and
  // runs the batch in ubatches.
  absl::StatusOr<std::vector<float>> Run(absl::Span<const int32_t> tokens, bool all_logits);
  // One ubatch at positions n_past_..: the logits of every row, of the last,
  // or (rows 0) of none.
  void RunUbatch(absl::Span<const int32_t> tokens, int64_t logit_rows, std::vector<float>* logits);
  void Quantize(GgmlType w_type, const float* x, int64_t rows, int64_t cols, Acts* out);
  void MatMuls(absl::Span<const MatJob> jobs);
  void MatMul(const WeightView& w, const float* x, int64_t rows, float* out);
  // out = w x for every (w, out), all w of x's width: x quantized once per form.
  void MatMulsOfOneInput(const float* x, int64_t rows,
                         std::initializer_list<std::pair<WeightView, float*>> products);
  void AttentionBlock(int il, const std::vector<float>& h, int64_t n, std::vector<float>* out);
  // The Gated DeltaNet of layer il on the attn-normed rows h, advancing its state.
  void DeltaNetBlock(int il, const std::vector<float>& h, int64_t n, std::vector<float>* out);
  // Whether Truncate may need the ids fed so far (to feed them again).
  bool keeps_ids() const { return rings_.has_rings() || !states_.empty(); }
  // Whether the states (none, or every layer's) are those after position kept.
  bool StatesAt(int kept) const {
    return states_.empty() || (kept == n_past_ && resume_from_ < 0);
  }
  // Keeps the states as a checkpoint at n_past_ (the newest kStateCheckpoints).
  void Checkpoint();
  void Rope(float* x, int n_head, int64_t n);
  // RmsNorm of x's rows (weight's width each) into out, row by row.
  void NormRows(absl::Span<const float> x, absl::Span<const float> weight, float eps,
                absl::Span<float> out);
  void MoeBlock(int il, const std::vector<float>& h, int64_t n, std::vector<float>* out);
  // down(silu(gate h) * up h) for the dense FFN of a leading layer or a shared expert.
  void GatedFfn(const GgufTensor& gate, const GgufTensor& up, const GgufTensor& down,
                const GgufTensor* gate_inp, const std::vector<float>& h, int64_t n,
                std::vector<float>* out, std::vector<float>* gate_logit);
  void Experts(int il, const std::vector<float>& h, absl::Span<const int64_t> rows, int k,
               absl::Span<const int32_t> chosen, absl::Span<const ExpertWeights> views,
               std::vector<float>* expert_out);
  // Row t's k experts after ProvideStart: those ready at once, then the
  // rest as the provider hands them over; out as Experts' for the row.
  void RowExperts(int il, const std::vector<float>& h, int64_t t,
                  absl::Span<const int32_t> chosen, absl::Span<const ExpertWeights> views,
                  std::vector<float>* out);

  const Model& model_;
  const int max_ctx_;
  ModelExpertProvider model_experts_;
  ExpertProvider* experts_;
  ThreadPool pool_;
  const bool kv_f16_;
  const int ubatch_;
  // q8_0 and q4_K products of kBatchMinActs rows or more on the batch kernels:
  // AMX tiles from kAmxMinActs rows, VNNI below or without AMX.
  const bool amx_, vnni_;
  const bool overlap_reads_;  // CpuForwardOptions::overlap_reads
  int n_past_ = 0;
  // Per layer: its ring's rows, or 0 where it keeps every position.
  std::vector<int> kv_rows_;
  KvRingPositions rings_;
  // With rings or states (keeps_ids): the ids fed at positions 0..n_past_,
  // and where a Truncate left the next Run to resume: it feeds fed_ from
  // there again, from the states of the checkpoint there (zero at 0); -1:
  // nothing to feed again.
  std::vector<int32_t> fed_;
  int resume_from_ = -1;
  std::map<int, CpuDeltaNetState> states_;  // per Gated DeltaNet layer, one sequence
  // Copies of states_ at chosen positions, oldest first: the start of each
  // call of two tokens or more and its position before its last token (where
  // a rewind to re-send the same prompt lands).
  struct StateCheckpoint {
    int position;
    std::map<int, CpuDeltaNetState> states;
  };
  std::deque<StateCheckpoint> checkpoints_;
  std::vector<LayerVectors> layers_;
  std::vector<float> output_norm_;
  std::vector<std::vector<uint8_t>> k_cache_, v_cache_;  // [row][n_head_kv][head_dim]
  std::vector<float> rope_cos_, rope_sin_;              // [row][head_dim / 2] of this batch
  Acts acts_;
  // Buffers of a forward pass, kept between layers and calls: resizing within
  // their capacity neither allocates nor clears (a prompt's fresh megabytes each
  // layer cost page faults and memsets).
  struct Scratch {
    std::vector<float> x, h, block_out;                                // Run
    std::vector<float> q, k, v, attn, q_gate;                          // AttentionBlock
    std::vector<float> qkv, z, alpha, beta, mixed;                     // DeltaNetBlock
    std::vector<float> probs, expert_out, part, shared, shared_logit;  // MoeBlock
    std::vector<float> shexp_gate, shexp_up;                           // GatedFfn's gate and up
    std::vector<int32_t> chosen;
    std::vector<double> weight;
    std::vector<ExpertWeights> views;
    std::vector<int64_t> rows;
    std::vector<int> ready;                   // RowExperts: ranks ready, not yet computed
    std::vector<int32_t> ready_chosen;        // their experts
    std::vector<ExpertWeights> ready_views;   // and views
    std::vector<float> ready_out;             // and outputs
    std::vector<Acts> in, mid;  // Experts, per expert group
    std::vector<std::vector<float>> gate, up, down;
  } s_;
  // MatMuls' activations packed for the batch kernels, job by job.
  std::vector<AmxQ8_0Acts> batch_q8_0_;
  std::vector<AmxQ8_KActs> batch_q8_K_;
};

void CpuForward::Quantize(GgmlType w_type, const float* x, int64_t rows, int64_t cols, Acts* out) {
  out->type = act_type_for(w_type);
  out->row_bytes = act_row_bytes(out->type, cols);
  out->rows = rows;
  out->data.resize(out->row_bytes * static_cast<size_t>(rows));
  pool_.Run(rows, [&](int64_t r) {
    SimdQuantizeActRow(out->type, x + r * cols, cols, out->data.data() + r * out->row_bytes);
  });
}

void CpuForward::MatMuls(absl::Span<const MatJob> jobs) {
  // Tasks: every job's row blocks, one after the other.
  std::vector<int64_t> first_task(jobs.size() + 1, 0);
  std::vector<int64_t> block(jobs.size());
  // A job on the batch kernels: its activations packed once here for all its
  // tasks, and the kernel it takes.
  enum class Kernel { kPerRow, kAmx, kVnni };
  std::vector<Kernel> kernel(jobs.size(), Kernel::kPerRow);
  batch_q8_0_.resize(std::max(batch_q8_0_.size(), jobs.size()));
  batch_q8_K_.resize(std::max(batch_q8_K_.size(), jobs.size()));
  for (size_t j = 0; j < jobs.size(); ++j) {
    const MatJob& job = jobs[j];
    block[j] = RowsPerTask(job.w.rows, pool_.size(), job.n_act);
    const bool batch_type = job.w.type == GgmlType::kQ8_0 || job.w.type == GgmlType::kQ4_K;
    if (batch_type && job.n_act >= kBatchMinActs) {
      if (amx_ && job.n_act >= kAmxMinActs) {
        kernel[j] = Kernel::kAmx;
      } else if (vnni_) {
        kernel[j] = Kernel::kVnni;
      }
    }
    // Tasks of whole steps and passes: a task of 48 rows (an expert's 768 on
    // two threads) would pad its second AMX step with 16 zero rows.
    const int64_t whole = kernel[j] == Kernel::kAmx    ? kAmxStepRows
                          : kernel[j] == Kernel::kVnni ? kVnniPassRows
                                                       : 1;
    block[j] = (block[j] + whole - 1) / whole * whole;
    first_task[j + 1] = first_task[j] + (job.w.rows + block[j] - 1) / block[j];
  }
  // The batch jobs' activations packed, a job a task (a prompt's experts are
  // many jobs); decode has none.
  const bool any_batch =
      std::any_of(kernel.begin(), kernel.end(), [](Kernel k) { return k != Kernel::kPerRow; });
  if (any_batch) {
    pool_.Run(static_cast<int64_t>(jobs.size()), [&](int64_t j) {
      if (kernel[j] == Kernel::kPerRow) return;
      const MatJob& job = jobs[j];
      const uint8_t* act = job.act->row(job.act_begin);
      if (job.w.type == GgmlType::kQ8_0) {
        PackAmxQ8_0Acts(act, job.act->row_bytes, job.n_act, job.w.cols, &batch_q8_0_[j]);
      } else {
        PackAmxQ8_KActs(act, job.act->row_bytes, job.n_act, job.w.cols, &batch_q8_K_[j]);
      }
    });
  }
  pool_.Run(first_task.back(), [&](int64_t task) {
    const size_t j = static_cast<size_t>(
        std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1);
    const MatJob& job = jobs[j];
    MatMulArgs a;
    a.type = job.w.type;
    a.w = job.w.data;
    a.w_row_bytes = job.w.row_bytes;
    a.cols = job.w.cols;
    a.row_begin = (task - first_task[j]) * block[j];
    a.row_end = std::min(job.w.rows, a.row_begin + block[j]);
    a.act = job.act->row(job.act_begin);
    a.act_row_bytes = job.act->row_bytes;
    a.n_act = job.n_act;
    a.out = job.out;
    a.out_stride = job.w.rows;
    const bool q8_0 = a.type == GgmlType::kQ8_0;
    switch (kernel[j]) {
      case Kernel::kAmx:
        return q8_0 ? AmxMatMulQ8_0(a, batch_q8_0_[j]) : AmxMatMulQ4_K(a, batch_q8_K_[j]);
      case Kernel::kVnni:
        return q8_0 ? VnniMatMulQ8_0(a, batch_q8_0_[j]) : VnniMatMulQ4_K(a, batch_q8_K_[j]);
      case Kernel::kPerRow:
        return SimdMatMulRows(a);
    }
  });
}

void CpuForward::NormRows(absl::Span<const float> x, absl::Span<const float> weight, float eps,
                          absl::Span<float> out) {
  const size_t width = weight.size();
  const int64_t rows = static_cast<int64_t>(x.size() / width);
  pool_.RunSized(rows, static_cast<int64_t>(x.size()), [&](int64_t r) {
    RmsNorm(x.subspan(r * width, width), weight, eps, out.subspan(r * width, width));
  });
}

void CpuForward::MatMulsOfOneInput(const float* x, int64_t rows,
                                   std::initializer_list<std::pair<WeightView, float*>> products) {
  // One quantization and one pool job per activation form among the weights.
  std::vector<ActType> done;
  for (const auto& [w, out] : products) {
    const ActType form = act_type_for(w.type);
    if (std::find(done.begin(), done.end(), form) != done.end()) continue;
    done.push_back(form);
    Quantize(w.type, x, rows, w.cols, &acts_);
    std::vector<MatJob> jobs;
    for (const auto& [w2, out2] : products) {
      if (act_type_for(w2.type) == form) jobs.push_back({w2, &acts_, 0, rows, out2});
    }
    MatMuls(jobs);
  }
}

void CpuForward::MatMul(const WeightView& w, const float* x, int64_t rows, float* out) {
  Quantize(w.type, x, rows, w.cols, &acts_);
  const MatJob job{w, &acts_, 0, rows, out};
  MatMuls({&job, 1});
}

void CpuForward::Rope(float* x, int n_head, int64_t n) {
  const ModelConfig& cfg = model_.config;
  const int half = cfg.n_rot / 2;  // dimensions from n_rot on stay as they are
  for (int64_t t = 0; t < n; ++t) {
    for (int h = 0; h < n_head; ++h) {
      float* head = x + (t * n_head + h) * cfg.head_dim;
      for (int i = 0; i < half; ++i) {
        float* a = cfg.rope_type == RopeType::kNorm ? head + 2 * i : head + i;
        float* b = cfg.rope_type == RopeType::kNorm ? head + 2 * i + 1 : head + i + half;
        rope_rotate_cs(a, b, rope_cos_[t * half + i], rope_sin_[t * half + i]);
      }
    }
  }
}

void CpuForward::AttentionBlock(int il, const std::vector<float>& h, int64_t n,
                                std::vector<float>* out) {
  const ModelConfig& cfg = model_.config;
  const LayerTensors& lt = model_.layers[il];
  const LayerVectors& lv = layers_[il];
  const int64_t q_len = static_cast<int64_t>(cfg.n_head) * cfg.head_dim;
  const int64_t kv_len = static_cast<int64_t>(cfg.n_head_kv) * cfg.head_dim;

  std::vector<float>& q = s_.q;
  std::vector<float>& k = s_.k;
  std::vector<float>& v = s_.v;
  q.resize(static_cast<size_t>(n * q_len));
  k.resize(static_cast<size_t>(n * kv_len));
  v.resize(static_cast<size_t>(n * kv_len));
  // Gated attention's q rows are each head's query, then its output gate's.
  const bool gated = cfg.mixer(il) == LayerMixer::kGatedAttention;
  std::vector<float>& q_gate = s_.q_gate;
  q_gate.resize(gated ? static_cast<size_t>(2 * n * q_len) : 0);
  MatMulsOfOneInput(h.data(), n,
                    {{weight_view(*lt.wq), gated ? q_gate.data() : q.data()},
                     {weight_view(*lt.wk), k.data()},
                     {weight_view(*lt.wv), v.data()}});
  if (gated) {
    const int64_t d = cfg.head_dim;
    for (int64_t row = 0; row < n * cfg.n_head; ++row) {
      std::copy_n(q_gate.data() + row * 2 * d, d, q.data() + row * d);
    }
  }
  if (!lv.bq.empty()) AddBias(lv.bq, absl::MakeSpan(q));
  if (!lv.bk.empty()) AddBias(lv.bk, absl::MakeSpan(k));
  if (!lv.bv.empty()) AddBias(lv.bv, absl::MakeSpan(v));
  if (!lv.q_norm.empty()) NormRows(q, lv.q_norm, cfg.rms_eps, absl::MakeSpan(q));
  if (!lv.k_norm.empty()) NormRows(k, lv.k_norm, cfg.rms_eps, absl::MakeSpan(k));
  Rope(q.data(), cfg.n_head, n);
  Rope(k.data(), cfg.n_head_kv, n);

  // Append to the cache at positions n_past_ .. n_past_ + n - 1 (a ring's
  // rows: the positions mod its rows).
  const size_t elem = kv_f16_ ? 2 : 4;
  const size_t stride = static_cast<size_t>(kv_len) * elem;
  const int rows = kv_rows_[il];
  for (int64_t t = 0; t < n; ++t) {
    const size_t at = static_cast<size_t>(kv_cache_row(static_cast<int32_t>(n_past_ + t), rows));
    uint8_t* kc = k_cache_[il].data() + at * stride;
    uint8_t* vc = v_cache_[il].data() + at * stride;
    const float* kt = k.data() + t * kv_len;
    const float* vt = v.data() + t * kv_len;
    if (kv_f16_) {
      for (int64_t i = 0; i < kv_len; ++i) {
        reinterpret_cast<uint16_t*>(kc)[i] = f32_to_f16(kt[i]);
        reinterpret_cast<uint16_t*>(vc)[i] = f32_to_f16(vt[i]);
      }
    } else {
      std::memcpy(kc, kt, stride);
      std::memcpy(vc, vt, stride);
    }
  }

  // One task per (row, group of heads): softmax(scale q.k) . v over positions
  // 0..pos, or the window's last n_swa of them, with each head's sink where
  // there is one. A task takes a whole GQA group (its heads share each K row's
  // loads) where that leaves 4 tasks a thread, else one head.
  std::vector<float>& attn = s_.attn;
  attn.resize(q.size());
  const float kq_scale = 1.0f / std::sqrt(static_cast<float>(cfg.head_dim));
  const int group = cfg.n_head / cfg.n_head_kv;
  const int heads = n * cfg.n_head_kv >= 4 * pool_.size() ? group : 1;
  const int tasks_a_row = cfg.n_head / heads;
  const int window = cfg.swa_layer(il) ? cfg.n_swa : 0;
  const uint8_t* k_all = k_cache_[il].data();
  const uint8_t* v_all = v_cache_[il].data();
  pool_.Run(n * tasks_a_row, [&](int64_t task) {
    const int64_t t = task / tasks_a_row;
    const int hd = static_cast<int>(task % tasks_a_row) * heads;  // the first head
    const int64_t n_seen = n_past_ + t + 1;
    const int64_t first = window > 0 ? std::max<int64_t>(0, n_seen - window) : 0;
    const int64_t at = t * q_len + static_cast<int64_t>(hd) * cfg.head_dim;
    const size_t kv_off = static_cast<size_t>(hd / group) * cfg.head_dim * elem;
    thread_local std::vector<float> scores;
    scores.resize(static_cast<size_t>(heads * (n_seen - first)));
    SimdAttendHeads(q.data() + at, heads, k_all + kv_off, v_all + kv_off, stride, kv_f16_, first,
                    n_seen - first, rows, cfg.head_dim, kq_scale,
                    lv.sinks.empty() ? nullptr : lv.sinks.data() + hd, scores.data(),
                    attn.data() + at);
  });
  if (gated) {
    // attention * sigmoid(gate), head by head.
    const int64_t d = cfg.head_dim;
    pool_.RunSized(n * cfg.n_head, n * q_len, [&](int64_t row) {
      const float* gate = q_gate.data() + row * 2 * d + d;
      float* a = attn.data() + row * d;
      for (int64_t i = 0; i < d; ++i) a[i] *= sigmoid(gate[i]);
    });
  }
  out->resize(static_cast<size_t>(n * cfg.n_embd));
  MatMul(weight_view(*lt.wo), attn.data(), n, out->data());
  if (!lv.bo.empty()) AddBias(lv.bo, absl::MakeSpan(*out));
}

void CpuForward::DeltaNetBlock(int il, const std::vector<float>& h, int64_t n,
                               std::vector<float>* out) {
  const ModelConfig& cfg = model_.config;
  const DeltaNetShape& shape = cfg.delta_net;
  const LayerTensors::DeltaNet& d = model_.layers[il].delta_net;
  const LayerVectors& lv = layers_[il];
  std::vector<float>& qkv = s_.qkv;
  std::vector<float>& z = s_.z;
  std::vector<float>& alpha = s_.alpha;
  std::vector<float>& beta = s_.beta;
  std::vector<float>& mixed = s_.mixed;
  qkv.resize(static_cast<size_t>(n * shape.conv_dim()));
  z.resize(static_cast<size_t>(n * shape.value_dim()));
  alpha.resize(static_cast<size_t>(n * shape.n_v_heads));
  beta.resize(alpha.size());
  mixed.resize(z.size());
  MatMulsOfOneInput(h.data(), n,
                    {{weight_view(*d.qkv), qkv.data()},
                     {weight_view(*d.gate), z.data()},
                     {weight_view(*d.alpha), alpha.data()},
                     {weight_view(*d.beta), beta.data()}});
  CpuDeltaNetMix(shape, {lv.conv, lv.dt_bias, lv.ssm_a, lv.ssm_norm}, cfg.rms_eps, n, qkv.data(),
                 z.data(), alpha.data(), beta.data(), pool_, &states_.at(il), mixed.data());
  out->resize(static_cast<size_t>(n * cfg.n_embd));
  MatMul(weight_view(*d.out), mixed.data(), n, out->data());
}

// The experts for rows (indices into h), k a row, chosen[i * k + r] with
// views[i * k + r]: gate and up for every (row, rank) at once, swiglu, then
// down; each (row, rank) output lands in expert_out[(i * k + r) * n_embd].
// Each expert's output is its own: which others share the call changes no bit.
void CpuForward::Experts(int il, const std::vector<float>& h, absl::Span<const int64_t> rows,
                         int k, absl::Span<const int32_t> chosen,
                         absl::Span<const ExpertWeights> views, std::vector<float>* expert_out) {
  const ModelConfig& cfg = model_.config;
  const LayerVectors& lv = layers_[il];
  const int64_t n_embd = cfg.n_embd;
  const int64_t n_pairs = static_cast<int64_t>(rows.size()) * k;
  // Group the (row, rank) pairs by expert, in first-seen order.
  std::vector<int32_t> experts;
  std::vector<std::vector<int64_t>> pairs_of;
  for (int64_t p = 0; p < n_pairs; ++p) {
    const auto it = std::find(experts.begin(), experts.end(), chosen[p]);
    if (it == experts.end()) {
      experts.push_back(chosen[p]);
      pairs_of.push_back({p});
    } else {
      pairs_of[it - experts.begin()].push_back(p);
    }
  }
  // Each expert's input rows, quantized for its gate/up type, contiguous.
  const size_t n_groups = experts.size();
  // Grown, never shrunk: each group's buffers keep their capacity.
  for (auto* v : {&s_.gate, &s_.up, &s_.down}) v->resize(std::max(v->size(), n_groups));
  for (auto* v : {&s_.in, &s_.mid}) v->resize(std::max(v->size(), n_groups));
  std::vector<Acts>& in = s_.in;
  std::vector<Acts>& mid = s_.mid;
  std::vector<std::vector<float>>& gate = s_.gate;
  std::vector<std::vector<float>>& up = s_.up;
  std::vector<std::vector<float>>& down = s_.down;
  const int64_t ff = views[0].gate.rows;
  std::vector<MatJob> jobs;
  for (size_t g = 0; g < n_groups; ++g) {
    const ExpertWeights& w = views[pairs_of[g][0]];
    in[g].type = act_type_for(w.gate.type);
    in[g].row_bytes = act_row_bytes(in[g].type, n_embd);
    in[g].rows = static_cast<int64_t>(pairs_of[g].size());
    in[g].data.resize(in[g].row_bytes * pairs_of[g].size());
    gate[g].resize(pairs_of[g].size() * ff);
    up[g].resize(pairs_of[g].size() * ff);
  }
  std::vector<std::pair<size_t, size_t>> quantize_tasks;
  for (size_t g = 0; g < n_groups; ++g) {
    for (size_t i = 0; i < pairs_of[g].size(); ++i) quantize_tasks.push_back({g, i});
  }
  pool_.Run(static_cast<int64_t>(quantize_tasks.size()), [&](int64_t task) {
    const auto [g, i] = quantize_tasks[task];
    const int64_t row = rows[pairs_of[g][i] / k];
    SimdQuantizeActRow(in[g].type, h.data() + row * n_embd, n_embd,
                     in[g].data.data() + i * in[g].row_bytes);
  });
  for (size_t g = 0; g < n_groups; ++g) {
    const ExpertWeights& w = views[pairs_of[g][0]];
    jobs.push_back({w.gate, &in[g], 0, in[g].rows, gate[g].data()});
    jobs.push_back({w.up, &in[g], 0, in[g].rows, up[g].data()});
  }
  MatMuls(jobs);

  // The activation (with gpt-oss's biases first), then the down projection's input.
  for (size_t g = 0; g < n_groups; ++g) {
    const ExpertWeights& w = views[pairs_of[g][0]];
    mid[g].type = act_type_for(w.down.type);
    mid[g].row_bytes = act_row_bytes(mid[g].type, ff);
    mid[g].rows = in[g].rows;
    mid[g].data.resize(mid[g].row_bytes * pairs_of[g].size());
    down[g].resize(pairs_of[g].size() * n_embd);
  }
  pool_.Run(static_cast<int64_t>(quantize_tasks.size()), [&](int64_t task) {
    const auto [g, i] = quantize_tasks[task];
    const absl::Span<float> gi(gate[g].data() + i * ff, static_cast<size_t>(ff));
    const absl::Span<float> ui(up[g].data() + i * ff, static_cast<size_t>(ff));
    if (!lv.gate_b.empty()) {
      AddBias(absl::MakeConstSpan(lv.gate_b).subspan(experts[g] * ff, ff), gi);
      AddBias(absl::MakeConstSpan(lv.up_b).subspan(experts[g] * ff, ff), ui);
    }
    if (cfg.expert_act == ExpertAct::kSwigluOai) {
      SwigluOai(gi, ui, gi);
    } else {
      Swiglu(gi, ui, gi);
    }
    SimdQuantizeActRow(mid[g].type, gi.data(), ff, mid[g].data.data() + i * mid[g].row_bytes);
  });
  jobs.clear();
  for (size_t g = 0; g < n_groups; ++g) {
    jobs.push_back({views[pairs_of[g][0]].down, &mid[g], 0, mid[g].rows, down[g].data()});
  }
  MatMuls(jobs);
  expert_out->resize(static_cast<size_t>(n_pairs * n_embd));
  pool_.RunSized(static_cast<int64_t>(n_groups), n_pairs * n_embd, [&](int64_t g) {
    for (size_t i = 0; i < pairs_of[g].size(); ++i) {
      float* y = expert_out->data() + pairs_of[g][i] * n_embd;
      std::copy_n(down[g].data() + i * n_embd, n_embd, y);
      if (!lv.down_b.empty()) {
        AddBias(absl::MakeConstSpan(lv.down_b).subspan(experts[g] * n_embd, n_embd),
                {y, static_cast<size_t>(n_embd)});
      }
    }
  });
}

void CpuForward::MoeBlock(int il, const std::vector<float>& h, int64_t n, std::vector<float>* out) {
  const ModelConfig& cfg = model_.config;
  const LayerTensors& lt = model_.layers[il];
  const int64_t n_embd = cfg.n_embd;
  const int k = cfg.n_expert_used;

  // The router as the oracle's: softmax over all experts, top-k, norm_w; or
  // gpt-oss's bias and softmax over the k chosen logits.
  std::vector<float>& probs = s_.probs;
  probs.resize(static_cast<size_t>(n * cfg.n_expert));
  MatMul(weight_view(*lt.router), h.data(), n, probs.data());
  const LayerVectors& lv = layers_[il];
  if (!lv.router_b.empty()) AddBias(lv.router_b, absl::MakeSpan(probs));
  GateProbs(cfg.gating, cfg.n_expert, absl::MakeSpan(probs));
  std::vector<int32_t>& chosen = s_.chosen;
  std::vector<double>& weight = s_.weight;
  SelectExperts(probs, cfg.n_expert, k, cfg.norm_topk_prob, &chosen, &weight, cfg.gating,
                lv.score_b, cfg.expert_weights_scale);
  for (int64_t t = 0; t < n; ++t) {
    experts_->Route(il, absl::MakeConstSpan(probs).subspan(t * cfg.n_expert, cfg.n_expert),
                    absl::MakeSpan(chosen).subspan(t * k, k),
                    absl::MakeSpan(weight).subspan(t * k, k));
  }

  std::vector<float>& shared = s_.shared;
  std::vector<float>& shared_logit = s_.shared_logit;
  shared.clear();
  shared_logit.clear();
  bool shared_done = lt.shexp_gate == nullptr;
  const auto shared_expert = [&] {
    if (shared_done) return;
    GatedFfn(*lt.shexp_gate, *lt.shexp_up, *lt.shexp_down, lt.shexp_gate_inp, h, n, &shared,
             &shared_logit);
    shared_done = true;
  };

  // The provider is asked row by row, in order (its residency steps per token).
  // Where its views outlive later calls, every row's experts run as one batch;
  // else each row's run before the next row is asked, as they arrive (a disk
  // tier's reads overlap the shared expert and the experts already there).
  std::vector<float>& expert_out = s_.expert_out;
  expert_out.resize(static_cast<size_t>(n * k * n_embd));
  std::vector<ExpertWeights>& views = s_.views;
  views.resize(static_cast<size_t>(n * k));
  std::vector<float>& part = s_.part;
  const bool batch = experts_->ViewsOutliveCalls();
  std::vector<int64_t>& rows = s_.rows;
  rows.clear();
  for (int64_t t = 0; t < n; ++t) {
    const absl::Span<const int32_t> row_chosen = absl::MakeConstSpan(chosen).subspan(t * k, k);
    const absl::Span<ExpertWeights> row_views = absl::MakeSpan(views).subspan(t * k, k);
    if (batch) {
      experts_->Provide(il, row_chosen, row_views);
      rows.push_back(t);
      continue;
    }
    if (overlap_reads_) {
      experts_->ProvideStart(il, row_chosen, row_views);
    } else {
      experts_->Provide(il, row_chosen, row_views);
    }
    shared_expert();
    RowExperts(il, h, t, row_chosen, row_views, &part);
    std::copy(part.begin(), part.end(), expert_out.begin() + t * k * n_embd);
  }
  if (batch) Experts(il, h, rows, k, chosen, views, &expert_out);
  shared_expert();

  out->resize(static_cast<size_t>(n * n_embd));
  pool_.RunSized(n, n * n_embd, [&](int64_t t) {
    const double shared_scale = shared.empty()         ? 0.0
                                : shared_logit.empty() ? 1.0
                                                       : Sigmoid(shared_logit[t]);
    for (int64_t i = 0; i < n_embd; ++i) {
      double acc = 0.0;
      for (int r = 0; r < k; ++r) acc += weight[t * k + r] * expert_out[(t * k + r) * n_embd + i];
      if (!shared.empty()) acc += shared_scale * shared[t * n_embd + i];
      (*out)[t * n_embd + i] = static_cast<float>(acc);
    }
  });
}

void CpuForward::RowExperts(int il, const std::vector<float>& h, int64_t t,
                            absl::Span<const int32_t> chosen,
                            absl::Span<const ExpertWeights> views, std::vector<float>* out) {
  const int k = static_cast<int>(chosen.size());
  const int64_t n_embd = model_.config.n_embd;
  const int64_t row[] = {t};
  std::vector<int>& ready = s_.ready;
  ready.clear();
  for (int r = 0; r < k; ++r) {
    if (!experts_->Pending(r)) ready.push_back(r);
  }
  if (static_cast<int>(ready.size()) == k) {
    Experts(il, h, row, k, chosen, views, out);
    return;
  }
  out->resize(static_cast<size_t>(k * n_embd));
  for (int done = 0;;) {
    if (!ready.empty()) {
      const int m = static_cast<int>(ready.size());
      s_.ready_chosen.clear();
      s_.ready_views.clear();
      for (const int r : ready) {
        s_.ready_chosen.push_back(chosen[r]);
        s_.ready_views.push_back(views[r]);
      }
      Experts(il, h, row, m, s_.ready_chosen, s_.ready_views, &s_.ready_out);
      for (int i = 0; i < m; ++i) {
        std::copy_n(s_.ready_out.begin() + i * n_embd, n_embd, out->begin() + ready[i] * n_embd);
      }
      done += m;
      ready.clear();
    }
    if (done == k) return;
    experts_->Arrive(&ready);
  }
}

void CpuForward::GatedFfn(const GgufTensor& gate, const GgufTensor& up, const GgufTensor& down,
                          const GgufTensor* gate_inp, const std::vector<float>& h, int64_t n,
                          std::vector<float>* out, std::vector<float>* gate_logit) {
  const WeightView gw = weight_view(gate), uw = weight_view(up), dw = weight_view(down);
  std::vector<float>& g = s_.shexp_gate;
  std::vector<float>& u = s_.shexp_up;
  g.resize(static_cast<size_t>(n * gw.rows));
  u.resize(g.size());
  if (gate_inp != nullptr) {
    gate_logit->resize(static_cast<size_t>(n));
    MatMulsOfOneInput(
        h.data(), n,
        {{gw, g.data()}, {uw, u.data()}, {weight_view(*gate_inp), gate_logit->data()}});
  } else {
    MatMulsOfOneInput(h.data(), n, {{gw, g.data()}, {uw, u.data()}});
  }
  Swiglu(g, u, absl::MakeSpan(g));
  out->resize(static_cast<size_t>(n * dw.rows));
  MatMul(dw, g.data(), n, out->data());
}

absl::StatusOr<std::vector<float>> CpuForward::Run(absl::Span<const int32_t> tokens,
                                                   bool all_logits) {
  const ModelConfig& cfg = model_.config;
  if (tokens.empty()) return absl::InvalidArgumentError("cpu: Forward needs at least one token");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= cfg.n_vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("cpu: token %d at index %d is outside the vocabulary [0, %d)", tokens[i],
                          i, cfg.n_vocab));
    }
  }
  const int64_t n_tokens = static_cast<int64_t>(tokens.size());
  if (n_tokens > max_ctx_ - n_past_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cpu: %d cached + %d new tokens exceed the context size %d", n_past_, n_tokens, max_ctx_));
  }
  absl::Span<const int32_t> batch = tokens;
  std::vector<int32_t> refed;  // the kept ids from resume_from_, then tokens
  int64_t skipped = 0;         // leading rows fed again, whose logits nobody asked for
  if (resume_from_ >= 0) {
    const int from = resume_from_;
    refed.assign(fed_.begin() + from, fed_.end());
    refed.insert(refed.end(), tokens.begin(), tokens.end());
    batch = refed;
    skipped = n_past_ - from;
    n_past_ = from;
    fed_.resize(static_cast<size_t>(from));
    resume_from_ = -1;
    const auto at = std::find_if(checkpoints_.begin(), checkpoints_.end(),
                                 [from](const StateCheckpoint& c) { return c.position == from; });
    if (at != checkpoints_.end()) {
      states_ = at->states;
    } else {
      for (auto& [il, state] : states_) state.Clear();
    }
  }
  // Ubatches of at most ubatch_ rows; with states, a call of two tokens or
  // more also breaks where its own tokens start and before its last token,
  // for a checkpoint at each.
  const int64_t n_batch = static_cast<int64_t>(batch.size());
  const bool checkpoints = !states_.empty() && tokens.size() >= 2;
  std::vector<float> logits;
  for (int64_t begin = 0; begin < n_batch;) {
    int64_t end = std::min(n_batch, begin + ubatch_);
    if (checkpoints) {
      if (begin < skipped) end = std::min(end, skipped);
      if (begin < n_batch - 1) end = std::min(end, n_batch - 1);
      if (begin == skipped) Checkpoint();
    }
    const int64_t wanted = end - std::max(begin, skipped);  // rows of the caller's tokens
    const int64_t logit_rows = wanted <= 0  ? 0
                               : all_logits ? wanted
                                            : (end == n_batch ? 1 : 0);
    const int first_position = n_past_;
    RunUbatch(batch.subspan(begin, end - begin), logit_rows, &logits);
    if (keeps_ids()) {
      rings_.Wrote(first_position, n_past_);
      fed_.insert(fed_.end(), batch.begin() + begin, batch.begin() + end);
    }
    if (checkpoints && end == n_batch - 1) Checkpoint();
    begin = end;
  }
  return logits;
}

void CpuForward::Checkpoint() {
  // Position 0's states are zero: resuming there needs no copy.
  if (n_past_ == 0 || (!checkpoints_.empty() && checkpoints_.back().position == n_past_)) return;
  if (static_cast<int>(checkpoints_.size()) == kStateCheckpoints) checkpoints_.pop_front();
  checkpoints_.push_back({n_past_, states_});
}

void CpuForward::RunUbatch(absl::Span<const int32_t> tokens, int64_t logit_rows,
                           std::vector<float>* logits) {
  const ModelConfig& cfg = model_.config;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t n_embd = cfg.n_embd;

  // RoPE angles of this batch's positions, as the oracle computes them.
  const int half = cfg.n_rot / 2;
  rope_cos_.resize(static_cast<size_t>(n * half));
  rope_sin_.resize(rope_cos_.size());
  for (int64_t t = 0; t < n; ++t) {
    RopeCosSin(static_cast<int32_t>(n_past_ + t), cfg.n_rot, cfg.rope_freq_base, cfg.rope_scaling,
               rope_cos_.data() + t * half, rope_sin_.data() + t * half);
  }

  std::vector<float>& x = s_.x;
  x.resize(static_cast<size_t>(n * n_embd));
  const WeightView embd = weight_view(*model_.token_embd);
  for (int64_t t = 0; t < n; ++t) DequantizeRow(embd, tokens[t], x.data() + t * n_embd);

  std::vector<float>& h = s_.h;
  std::vector<float>& block_out = s_.block_out;
  h.resize(x.size());
  for (int il = 0; il < cfg.n_layer; ++il) {
    NormRows(x, layers_[il].attn_norm, cfg.rms_eps, absl::MakeSpan(h));
    if (cfg.mixer(il) == LayerMixer::kDeltaNet) {
      DeltaNetBlock(il, h, n, &block_out);
    } else {
      AttentionBlock(il, h, n, &block_out);
    }
    AddInPlace(block_out, absl::MakeSpan(x));
    NormRows(x, layers_[il].ffn_norm, cfg.rms_eps, absl::MakeSpan(h));
    if (cfg.moe_layer(il)) {
      MoeBlock(il, h, n, &block_out);
    } else {
      const LayerTensors& lt = model_.layers[il];
      GatedFfn(*lt.ffn_gate, *lt.ffn_up, *lt.ffn_down, nullptr, h, n, &block_out, nullptr);
    }
    AddInPlace(block_out, absl::MakeSpan(x));
  }
  n_past_ += static_cast<int>(n);

  // Logits of the last logit_rows rows (a prompt's other rows are not read).
  if (logit_rows == 0) return;
  const int64_t first = n - logit_rows;
  std::vector<float> normed(static_cast<size_t>(logit_rows * n_embd));
  RmsNorm(absl::MakeConstSpan(x).subspan(first * n_embd), output_norm_, cfg.rms_eps,
          absl::MakeSpan(normed));
  const size_t at = logits->size();
  logits->resize(at + static_cast<size_t>(logit_rows * cfg.n_vocab));
  MatMul(weight_view(*model_.output), normed.data(), logit_rows, logits->data() + at);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Oracle>> CreateCpuForward(const Model& model, int max_ctx,
                                                         ExpertProvider* experts,
                                                         const CpuForwardOptions& options) {
  if (max_ctx <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cpu: context size %d must be positive", max_ctx));
  }
  if (options.threads < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "-t %d: threads must be positive (0: the physical cores)", options.threads));
  }
  if (options.ubatch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("-ub %d: a ubatch needs at least 1 token", options.ubatch));
  }
  const ModelConfig& cfg = model.config;
  if (cfg.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("cpu: head_dim %d is odd", cfg.head_dim));
  }
  return std::unique_ptr<Oracle>(new CpuForward(model, max_ctx, experts, options));
}

}  // namespace moegraph
