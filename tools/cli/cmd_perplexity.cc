// moegraph perplexity: llama-perplexity's measures of a model on a text
// (quality/perplexity.h): the perplexity over chunks of -c tokens scored on
// their second halves, or with --kl-divergence-base FILE that and the chunks'
// log-probabilities saved, or with --kl-divergence the KL divergence and token
// probability statistics against such a file (its tokens, no -f); with
// --record-routing the experts each position chose, as a routing trace of the
// text (moegraph simulate's input). Progress on
// stderr, the results on stdout. Every check of the text, the flags and the
// base file runs before the weights are read.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/status_util.h"
#include "quality/perplexity.h"
#include "text/tokenizer.h"
#include "text/vocab.h"
#include "tools/cli/commands.h"
#include "tools/cli/decoder.h"

ABSL_FLAG(int32_t, b, 2048, "positions a forward pass takes at once (with -ub, the smaller)");
ABSL_FLAG(int32_t, chunks, -1, "chunks to score; -1: all");
ABSL_FLAG(std::string, kl_divergence_base, "", "base log-probabilities file");
ABSL_FLAG(bool, kl_divergence, false, "KL divergence against --kl-divergence-base");

namespace moegraph {
namespace {

// llama-perplexity's -c default.
constexpr int kDefaultContext = 512;

// What is scored: the chunks' tokens (n_chunk * n_ctx), from the text or the base file.
struct Scoring {
  int n_ctx = 0;
  int n_chunk = 0;
  std::vector<int32_t> tokens;
  std::optional<BaseLogits> base;  // --kl-divergence
};

// The text's tokens and chunks, or the base file's; every check before any weight.
absl::StatusOr<Scoring> PlanScoring(const Vocab& vocab) {
  Scoring s;
  const std::string base_path = absl::GetFlag(FLAGS_kl_divergence_base);
  MG_ASSIGN_OR_RETURN(std::optional<std::string> text, PromptText());
  const int chunks = absl::GetFlag(FLAGS_chunks);
  if (chunks == 0) return absl::InvalidArgumentError("--chunks 0: no chunk to score");
  if (absl::GetFlag(FLAGS_kl_divergence)) {
    if (base_path.empty()) {
      return absl::InvalidArgumentError(
          "--kl-divergence needs --kl-divergence-base FILE, the base run's log-probabilities");
    }
    if (text.has_value()) {
      return absl::InvalidArgumentError(
          "--kl-divergence scores the base file's own tokens: drop -f/-p");
    }
    MG_ASSIGN_OR_RETURN(BaseLogits base, BaseLogits::Read(base_path, vocab.size()));
    s.n_ctx = base.n_ctx;
    s.n_chunk = chunks < 0 ? base.n_chunk : std::min(chunks, base.n_chunk);
    s.tokens.assign(base.tokens.begin(), base.tokens.begin() + int64_t{s.n_chunk} * s.n_ctx);
    s.base = std::move(base);
    return s;
  }
  if (!text.has_value()) {
    return absl::InvalidArgumentError("a text is required: -f FILE (or -p TEXT)");
  }
  s.n_ctx = absl::GetFlag(FLAGS_ctx) != 0 ? absl::GetFlag(FLAGS_ctx) : kDefaultContext;
  MG_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Create(vocab));
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Tokenize(*text, true, false);
  if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("-f: ", ids.status().message()));
  const std::string name = absl::GetFlag(FLAGS_f).empty() ? "-p" : absl::GetFlag(FLAGS_f);
  MG_ASSIGN_OR_RETURN(s.n_chunk, PerplexityChunks(static_cast<int64_t>(ids->size()), s.n_ctx,
                                                  chunks, name));
  s.tokens.assign(ids->begin(), ids->begin() + int64_t{s.n_chunk} * s.n_ctx);
  return s;
}

absl::Status Perplexity() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  const int batch = absl::GetFlag(FLAGS_b);
  MG_ASSIGN_OR_RETURN(DecoderFlags flags, ReadDecoderFlags());
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(*file));
  const bool add_bos = vocab.add_bos;
  const int32_t bos = vocab.bos;
  MG_ASSIGN_OR_RETURN(Scoring s, PlanScoring(vocab));
  if (batch < 1 || (batch >= s.n_ctx && batch % s.n_ctx != 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "-b %d: a batch below -c %d or a multiple of it (as llama.cpp asks)", batch, s.n_ctx));
  }
  const std::string record = absl::GetFlag(FLAGS_record_routing);
  if (!record.empty() && flags.cuda) {
    return absl::InvalidArgumentError(
        "--record-routing: the CPU backend records routing here; add --backend cpu");
  }
  const std::string base_out = absl::GetFlag(FLAGS_kl_divergence_base);
  const bool kl = s.base.has_value();
  std::optional<BaseLogitsWriter> writer;
  if (!kl && !base_out.empty()) {
    MG_ASSIGN_OR_RETURN(writer, BaseLogitsWriter::Create(base_out, s.n_ctx, vocab.size(),
                                                         s.tokens, s.n_chunk));
  }

  flags.every_position_logits = true;
  flags.cpu.ubatch = std::min(flags.cpu.ubatch, batch);
  MG_ASSIGN_OR_RETURN(Model model, LoadModel(*file));
  if (model.config.n_vocab != vocab.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d logits a position for a vocabulary of %d tokens: the scores would not be "
        "llama.cpp's",
        path, model.config.n_vocab, vocab.size()));
  }
  MG_RETURN_IF_ERROR(ApplyExpertsUsed(flags, path, &model, stderr));
  MG_RETURN_IF_ERROR(CheckContext(model, flags.cuda, flags.cpu, s.n_ctx, stderr));
  MG_RETURN_IF_ERROR(AutoHostCache(model, s.n_ctx, &flags, stderr));
  MG_RETURN_IF_ERROR(CheckHostCache(model, flags.host_cache_bytes));
  MG_RETURN_IF_ERROR(ReadWeights(file.get(), flags.load, stderr));
  std::fputs(StartupLines(flags).c_str(), stderr);
  MG_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> decoder,
                      Decoder::Create(model, flags, s.n_ctx, stderr));

  const int n_vocab = vocab.size();
  const int first = s.n_ctx / 2;
  const int scored = ScoredPositions(s.n_ctx);
  std::fprintf(stderr, "perplexity: calculating perplexity over %d chunks, n_ctx=%d, "
               "batch_size=%d, n_seq=1\n", s.n_chunk, s.n_ctx, batch);
  NllSums sums;
  KlStats kl_stats;
  std::vector<uint16_t> rows(writer ? static_cast<size_t>(scored) * CompressedRowWidth(n_vocab)
                                    : 0);
  for (int c = 0; c < s.n_chunk; ++c) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<int32_t> chunk(s.tokens.begin() + int64_t{c} * s.n_ctx,
                               s.tokens.begin() + int64_t{c + 1} * s.n_ctx);
    if (add_bos && bos >= 0) chunk[0] = bos;
    MG_ASSIGN_OR_RETURN(std::vector<float> logits, decoder->AllLogits(chunk));
    for (int j = first; j < s.n_ctx - 1; ++j) {
      const absl::Span<const float> row(logits.data() + int64_t{j} * n_vocab, n_vocab);
      const int32_t next = s.tokens[int64_t{c} * s.n_ctx + j + 1];
      if (kl) {
        AccumulateKl(row, s.base->Row(c, j - first), next, &kl_stats);
      } else if (writer) {
        sums.Add(CompressLogProbs(
            row, next, rows.data() + int64_t{j - first} * CompressedRowWidth(n_vocab)));
      } else {
        sums.Add(TokenNll(row, next));
      }
    }
    if (writer) MG_RETURN_IF_ERROR(writer->Write(rows));
    if (c == 0) {
      const double pass =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "perplexity: %.2f seconds per pass - ETA %.2f minutes\n", pass,
                   pass * s.n_chunk / 60);
      if (kl) std::fputs(KlChunkHeader().c_str(), stderr);
    }
    if (kl) {
      std::fputs(KlChunkLine(c + 1, kl_stats).c_str(), stderr);
    } else {
      std::fprintf(stderr, "[%d]%.4f,", c + 1, sums.Perplexity());
    }
    std::fflush(stderr);
  }
  std::fputc('\n', stderr);
  MG_ASSIGN_OR_RETURN(const std::string experts, decoder->ExpertSummary());
  std::fprintf(stderr, "perplexity: experts: %s\n", experts.c_str());
  if (writer) MG_RETURN_IF_ERROR(writer->Close());
  if (!record.empty()) {
    // Every position of every chunk, in order: a routing trace of the text.
    MG_ASSIGN_OR_RETURN(const std::vector<int32_t> routing, decoder->Routing());
    MG_RETURN_IF_ERROR(WriteRoutingRecord(routing, model.config, record));
    std::fprintf(stderr, "perplexity: routing of %d positions written to %s\n",
                 s.n_chunk * s.n_ctx, record.c_str());
  }
  if (kl) {
    const std::string summary = KlSummary(kl_stats);
    if (summary.empty()) {
      std::printf("%lld positions scored: too few for the statistics (llama.cpp wants 100)\n",
                  static_cast<long long>(kl_stats.count));
    }
    std::fputs(summary.c_str(), stdout);
  } else {
    std::printf("Final estimate: PPL = %.4f +/- %.5f\n", sums.Perplexity(),
                sums.PerplexityError());
  }
  return absl::OkStatus();
}

}  // namespace

int RunPerplexity(const std::vector<std::string>& args) {
  return RunModelCommand("perplexity", args, Perplexity);
}

}  // namespace moegraph
