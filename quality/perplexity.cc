#include "quality/perplexity.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "quality/logprobs.h"

namespace moegraph {
namespace {

constexpr char kMagic[8] = {'_', 'l', 'o', 'g', 'i', 't', 's', '_'};

// llama.cpp's nearest_int: round to nearest through the float's mantissa.
int NearestInt(float f) {
  float v = f + 12582912.f;
  int32_t i;
  std::memcpy(&i, &v, sizeof(i));
  return (i & 0x007fffff) - 0x00400000;
}

// (mean, its standard error) of values given their sum and sum of squares;
// no error under 11 values (llama.cpp's mean_and_uncertainty).
std::pair<double, double> MeanAndError(double sum, double sum2, int64_t count) {
  if (count < 1) return {0, 0};
  const double f = sum / count;
  const double v = sum2 / count - f * f;
  return {f, v > 0 && count > 10 ? std::sqrt(v / (count - 1)) : 0};
}

double Covariance(double a, double b, double ab, int64_t count) {
  if (count < 10) return 0;
  return (ab / count - (a / count) * (b / count)) / (count - 1);
}

// The value at fraction of sorted values, interpolated (llama.cpp's percentile).
float Percentile(const std::vector<float>& v, float fraction) {
  if (fraction <= 0) return v.front();
  if (fraction >= 1) return v.back();
  float p = fraction * (v.size() - 1);
  const size_t i = static_cast<size_t>(p);
  p -= i;
  return (1 - p) * v[i] + p * v[std::min(i + 1, v.size() - 1)];
}

float Median(const std::vector<float>& v) {
  const size_t n = v.size();
  return n % 2 == 0 ? 0.5f * (v[n / 2] + v[n / 2 - 1]) : v[n / 2];
}

}  // namespace

absl::StatusOr<int> PerplexityChunks(int64_t n_tokens, int n_ctx, int max_chunks,
                                     const std::string& text_file) {
  if (n_ctx < 4) {
    return absl::InvalidArgumentError(
        absl::StrFormat("-c %d: a chunk needs at least 4 tokens (its second half is scored)", n_ctx));
  }
  if (n_tokens < 2 * int64_t{n_ctx}) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d token%s; perplexity at -c %d needs at least %d (two chunks, as llama.cpp asks)",
        text_file, n_tokens, n_tokens == 1 ? "" : "s", n_ctx, 2 * int64_t{n_ctx}));
  }
  if (max_chunks == 0) return absl::InvalidArgumentError("--chunks 0: no chunk to score");
  const int64_t all = n_tokens / n_ctx;
  return static_cast<int>(max_chunks < 0 ? all : std::min<int64_t>(all, max_chunks));
}

double TokenNll(absl::Span<const float> logits, int32_t tok) { return -TokenLogprob(logits, tok); }

double NllSums::Perplexity() const { return std::exp(nll / count); }

double NllSums::PerplexityError() const {
  const double mean = nll / count;
  const double var = nll2 / count - mean * mean;
  return var > 0 && count > 1 ? std::sqrt(var / (count - 1)) * Perplexity() : 0;
}

double CompressLogProbs(absl::Span<const float> logits, int32_t tok, uint16_t* out) {
  float max_logit = logits[0], min_logit = logits[0];
  for (float l : logits) max_logit = std::max(max_logit, l), min_logit = std::min(min_logit, l);
  min_logit = std::max(min_logit, max_logit - 16);
  double sum_exp = 0;
  for (float l : logits) sum_exp += std::exp(l - max_logit);
  const float log_sum_exp = static_cast<float>(std::log(sum_exp));
  const float min_log_prob = min_logit - max_logit - log_sum_exp;
  const float scale = (max_logit - min_logit) / 65535.f;
  std::memcpy(out, &scale, sizeof(float));
  std::memcpy(out + 2, &min_log_prob, sizeof(float));
  uint16_t* q = out + 4;
  if (scale != 0) {
    const float inv_scale = 1 / scale;
    for (size_t i = 0; i < logits.size(); ++i) {
      q[i] = logits[i] > min_logit ? static_cast<uint16_t>(NearestInt(inv_scale * (logits[i] - min_logit)))
                                   : 0;
    }
  } else {
    std::memset(q, 0, logits.size() * sizeof(uint16_t));
  }
  return max_logit + log_sum_exp - logits[tok];
}

void AccumulateKl(absl::Span<const float> logits, const uint16_t* base_row, int32_t tok,
                  KlStats* s) {
  float max_logit = logits[0];
  size_t imax = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > max_logit) max_logit = logits[i], imax = i;
  }
  double sum_exp = 0;
  for (float l : logits) sum_exp += std::exp(l - max_logit);
  const float log_sum_exp = static_cast<float>(std::log(sum_exp));
  float scale, min_log_prob;
  std::memcpy(&scale, base_row, sizeof(float));
  std::memcpy(&min_log_prob, base_row + 2, sizeof(float));
  const uint16_t* base = base_row + 4;

  const float nll = max_logit + log_sum_exp - logits[tok];
  s->sum_nll += nll;
  s->sum_nll2 += nll * nll;
  const float nll_base = -(scale * base[tok] + min_log_prob);
  s->sum_nll_base += nll_base;
  s->sum_nll_base2 += nll_base * nll_base;
  s->sum_nll_nll_base += nll * nll_base;

  const float log_norm = max_logit + log_sum_exp;
  double kld = 0;
  size_t imax_base = 0;
  float base_max = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float p_log_base = scale * base[i] + min_log_prob;
    if (i == 0 || p_log_base > base_max) base_max = p_log_base, imax_base = i;
    if (p_log_base > -16.f) kld += std::exp(p_log_base) * (p_log_base - logits[i] + log_norm);
  }
  s->sum_kld += kld;
  s->sum_kld2 += kld * kld;
  ++s->count;
  if (imax == imax_base) ++s->n_same_top;
  const float p_diff = std::exp(-nll) - std::exp(-nll_base);
  s->sum_p_diff += p_diff;
  const double p_diff2 = double{p_diff} * p_diff;
  s->sum_p_diff2 += p_diff2;
  s->sum_p_diff4 += p_diff2 * p_diff2;
  s->max_p_diff = std::max(s->max_p_diff, std::fabs(p_diff));
  s->kld_values.push_back(static_cast<float>(kld));
  s->p_diff_values.push_back(p_diff);
}

std::string KlChunkHeader() {
  return "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence    "
         "          Δp RMS            Same top p\n";
}

std::string KlChunkLine(int chunk, const KlStats& s) {
  const auto log_ppl = MeanAndError(s.sum_nll, s.sum_nll2, s.count);
  const double ppl = std::exp(log_ppl.first);
  const auto log_base = MeanAndError(s.sum_nll_base, s.sum_nll_base2, s.count);
  const double cov = Covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count);
  const double ratio_error = std::sqrt(log_ppl.second * log_ppl.second +
                                       log_base.second * log_base.second - 2 * cov);
  const auto kld = MeanAndError(s.sum_kld, s.sum_kld2, s.count);
  const auto mse = MeanAndError(s.sum_p_diff2, s.sum_p_diff4, s.count);
  const double rms = std::sqrt(mse.first);
  const double top = 1.0 * s.n_same_top / s.count;
  return absl::StrFormat(
      "%4d    %9.4f ± %9.4f    %10.5f ± %10.5f    %10.5f ± %10.5f    %6.3f ± %6.3f %%    "
      "%6.3f ± %6.3f %%\n",
      chunk, ppl, ppl * log_ppl.second, log_ppl.first - log_base.first, ratio_error, kld.first,
      kld.second, 100 * rms, 100 * (rms > 0 ? 0.5 / rms * mse.second : 0), 100 * top,
      100 * (s.count > 1 ? std::sqrt(top * (1 - top) / (s.count - 1)) : 0));
}

std::string KlSummary(KlStats s) {
  if (s.count < 100) return "";
  std::sort(s.kld_values.begin(), s.kld_values.end());
  std::sort(s.p_diff_values.begin(), s.p_diff_values.end());
  const auto log_ppl = MeanAndError(s.sum_nll, s.sum_nll2, s.count);
  const double ppl = std::exp(log_ppl.first), ppl_error = ppl * log_ppl.second;
  const auto log_base = MeanAndError(s.sum_nll_base, s.sum_nll_base2, s.count);
  const double base = std::exp(log_base.first), base_error = base * log_base.second;
  const double cov = Covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count);
  const double ratio = log_ppl.first - log_base.first;
  const double ratio_error = std::sqrt(log_ppl.second * log_ppl.second +
                                       log_base.second * log_base.second - 2 * cov);
  const double ppl_cov = ppl * base * cov;
  std::string out = "====== Perplexity statistics ======\n";
  absl::StrAppendFormat(&out, "Mean PPL(Q)                   : %10.6f ± %10.6f\n", ppl, ppl_error);
  absl::StrAppendFormat(&out, "Mean PPL(base)                : %10.6f ± %10.6f\n", base,
                        base_error);
  absl::StrAppendFormat(&out, "Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%\n",
                        100 * cov / (log_ppl.second * log_base.second));
  absl::StrAppendFormat(&out, "Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f\n", ratio,
                        ratio_error);
  absl::StrAppendFormat(&out, "Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f\n",
                        std::exp(ratio), std::exp(ratio) * ratio_error);
  absl::StrAppendFormat(&out, "Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f\n\n", ppl - base,
                        std::sqrt(ppl_error * ppl_error + base_error * base_error - 2 * ppl_cov));
  out += "====== KL divergence statistics ======\n";
  const auto kld = MeanAndError(s.sum_kld, s.sum_kld2, s.count);
  absl::StrAppendFormat(&out, "Mean    KLD: %10.6f ± %10.6f\n", kld.first, kld.second);
  const std::vector<float>& k = s.kld_values;
  absl::StrAppendFormat(&out, "Maximum KLD: %10.6f\n", k.back());
  for (float f : {0.999f, 0.99f, 0.95f, 0.9f}) {
    absl::StrAppendFormat(&out, "%4.1f%%   KLD: %10.6f\n", 100 * f, Percentile(k, f));
  }
  absl::StrAppendFormat(&out, "Median  KLD: %10.6f\n", Median(k));
  for (float f : {0.1f, 0.05f, 0.01f, 0.001f}) {
    absl::StrAppendFormat(&out, "%4.1f%%   KLD: %10.6f\n", 100 * f, Percentile(k, f));
  }
  absl::StrAppendFormat(&out, "Minimum KLD: %10.6f\n\n", k.front());
  out += "====== Token probability statistics ======\n";
  const auto dp = MeanAndError(s.sum_p_diff, s.sum_p_diff2, s.count);
  absl::StrAppendFormat(&out, "Mean    Δp: %6.3f ± %5.3f %%\n", 100 * dp.first, 100 * dp.second);
  const std::vector<float>& d = s.p_diff_values;
  absl::StrAppendFormat(&out, "Maximum Δp: %6.3f%%\n", 100 * d.back());
  for (float f : {0.999f, 0.99f, 0.95f, 0.9f, 0.75f}) {
    absl::StrAppendFormat(&out, "%4.1f%%   Δp: %6.3f%%\n", 100 * f, 100 * Percentile(d, f));
  }
  absl::StrAppendFormat(&out, "Median  Δp: %6.3f%%\n", 100 * Median(d));
  for (float f : {0.25f, 0.1f, 0.05f, 0.01f, 0.001f}) {
    absl::StrAppendFormat(&out, "%4.1f%%   Δp: %6.3f%%\n", 100 * f, 100 * Percentile(d, f));
  }
  absl::StrAppendFormat(&out, "Minimum Δp: %6.3f%%\n", 100 * d.front());
  const auto mse = MeanAndError(s.sum_p_diff2, s.sum_p_diff4, s.count);
  const double rms = std::sqrt(mse.first);
  absl::StrAppendFormat(&out, "RMS Δp    : %6.3f ± %5.3f %%\n", 100 * rms,
                        100 * (rms > 0 ? 0.5 / rms * mse.second : 0));
  const double top = 1.0 * s.n_same_top / s.count;
  absl::StrAppendFormat(&out, "Same top p: %6.3f ± %5.3f %%\n", 100 * top,
                        100 * std::sqrt(top * (1 - top) / (s.count - 1)));
  return out;
}

absl::StatusOr<BaseLogitsWriter> BaseLogitsWriter::Create(const std::string& path, int n_ctx,
                                                          int n_vocab,
                                                          absl::Span<const int32_t> chunk_tokens,
                                                          int n_chunk) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kl-divergence-base ", path, ": cannot be written: ", std::strerror(errno)));
  }
  BaseLogitsWriter w(path, f);
  const uint32_t ctx = static_cast<uint32_t>(n_ctx);
  bool ok = std::fwrite(kMagic, 1, sizeof(kMagic), f) == sizeof(kMagic) &&
            std::fwrite(&ctx, sizeof(ctx), 1, f) == 1 &&
            std::fwrite(&n_vocab, sizeof(n_vocab), 1, f) == 1 &&
            std::fwrite(&n_chunk, sizeof(n_chunk), 1, f) == 1 &&
            std::fwrite(chunk_tokens.data(), sizeof(int32_t), chunk_tokens.size(), f) ==
                chunk_tokens.size();
  if (!ok) return absl::DataLossError(absl::StrCat("--kl-divergence-base ", path, ": write failed"));
  return w;
}

BaseLogitsWriter::BaseLogitsWriter(BaseLogitsWriter&& other) noexcept
    : path_(std::move(other.path_)), file_(std::exchange(other.file_, nullptr)) {}

BaseLogitsWriter& BaseLogitsWriter::operator=(BaseLogitsWriter&& other) noexcept {
  if (this != &other) {
    if (file_ != nullptr) std::fclose(file_);
    path_ = std::move(other.path_);
    file_ = std::exchange(other.file_, nullptr);
  }
  return *this;
}

BaseLogitsWriter::~BaseLogitsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status BaseLogitsWriter::Write(absl::Span<const uint16_t> rows) {
  if (std::fwrite(rows.data(), sizeof(uint16_t), rows.size(), file_) != rows.size()) {
    return absl::DataLossError(absl::StrCat("--kl-divergence-base ", path_, ": write failed"));
  }
  return absl::OkStatus();
}

absl::Status BaseLogitsWriter::Close() {
  const int rc = std::fclose(std::exchange(file_, nullptr));
  if (rc != 0) return absl::DataLossError(absl::StrCat("--kl-divergence-base ", path_, ": close failed"));
  return absl::OkStatus();
}

absl::StatusOr<BaseLogits> BaseLogits::Read(const std::string& path, int n_vocab) {
  const std::string where = absl::StrCat("--kl-divergence-base ", path);
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::NotFoundError(absl::StrCat(where, ": cannot be opened: ", std::strerror(errno)));
  }
  struct Closer {
    std::FILE* f;
    ~Closer() { std::fclose(f); }
  } closer{f};
  char magic[sizeof(kMagic)];
  uint32_t ctx = 0;
  BaseLogits b;
  if (std::fread(magic, 1, sizeof(magic), f) != sizeof(magic) ||
      std::memcmp(magic, kMagic, sizeof(magic)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": not a file of base log-probabilities (no \"_logits_\" header)"));
  }
  if (std::fread(&ctx, sizeof(ctx), 1, f) != 1 || std::fread(&b.n_vocab, 4, 1, f) != 1 ||
      std::fread(&b.n_chunk, 4, 1, f) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": truncated in its header"));
  }
  b.n_ctx = static_cast<int>(ctx);
  if (b.n_ctx < 4 || ctx > (1u << 24) || b.n_chunk < 1 || b.n_chunk > (1 << 24) || b.n_vocab < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: a header of n_ctx %u, n_vocab %d, n_chunk %d is not one perplexity writes", where, ctx,
        b.n_vocab, b.n_chunk));
  }
  if (b.n_vocab != n_vocab) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: its vocabulary has %d tokens, the model's %d: a base from another model", where,
        b.n_vocab, n_vocab));
  }
  b.tokens.resize(static_cast<size_t>(b.n_ctx) * b.n_chunk);
  b.rows.resize(static_cast<size_t>(b.n_chunk) * ScoredPositions(b.n_ctx) *
                CompressedRowWidth(b.n_vocab));
  if (std::fread(b.tokens.data(), sizeof(int32_t), b.tokens.size(), f) != b.tokens.size() ||
      std::fread(b.rows.data(), sizeof(uint16_t), b.rows.size(), f) != b.rows.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: truncated: its header promises %d chunks of %d positions", where, b.n_chunk, b.n_ctx));
  }
  for (int32_t t : b.tokens) {
    if (t < 0 || t >= n_vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: token %d is outside the vocabulary [0, %d)", where, t, n_vocab));
    }
  }
  return b;
}

const uint16_t* BaseLogits::Row(int chunk, int scored) const {
  return rows.data() + (static_cast<size_t>(chunk) * ScoredPositions(n_ctx) + scored) *
                           CompressedRowWidth(n_vocab);
}

}  // namespace moegraph
