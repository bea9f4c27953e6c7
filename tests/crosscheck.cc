#include "tests/crosscheck.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/str_cat.h"
#include "loader/gguf.h"
#include "loader/status_util.h"
#include "tests/test_util.h"

namespace moegraph::crosscheck {
namespace {

using testing_util::CommandResult;
using testing_util::RunCommand;
using testing_util::TempPath;

std::vector<double> Softmax(const float* logits, int n) {
  const float max = *std::max_element(logits, logits + n);
  std::vector<double> p(n);
  double total = 0.0;
  for (int i = 0; i < n; ++i) total += p[i] = std::exp(static_cast<double>(logits[i]) - max);
  for (double& v : p) v /= total;
  return p;
}

nlohmann::json ReadData(const std::string& name) {
  std::ifstream in(std::string(MOEGRAPH_SOURCE_DIR) + "/tests/data/crosscheck/" + name);
  return nlohmann::json::parse(in, nullptr, false);
}

// The fixture a case's make-fixture flags write, loaded.
struct MadeModel {
  std::unique_ptr<GgufFile> file;
  Model model;
};
absl::StatusOr<MadeModel> MakeModel(const std::string& flags, const std::string& name) {
  const std::string path = TempPath(name);
  const CommandResult made =
      RunCommand(absl::StrCat(MOEGRAPH_BIN, " make-fixture ", flags, " -o ", path, " 2>&1"));
  if (made.exit_code != 0) return absl::InternalError(made.output);
  MadeModel m;
  MG_ASSIGN_OR_RETURN(m.file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(m.model, LoadModel(*m.file));
  return m;
}

}  // namespace

void ExpectGreedyTokensEqualLlamaCpps(absl::Span<const Backend> backends) {
  const nlohmann::json doc = ReadData("greedy.json");
  ASSERT_TRUE(doc.is_object()) << "cannot read tests/data/crosscheck/greedy.json";
  const std::vector<int32_t> prompt = doc["prompt"].get<std::vector<int32_t>>();
  // Seven architectures, glm4moe with and without QK-norm, qwen35moe with two
  // layer patterns.
  ASSERT_EQ(doc["cases"].size(), 9u);
  int n = 0;
  for (const nlohmann::json& c : doc["cases"]) {
    const std::string flags = c["make_fixture"].get<std::string>();
    SCOPED_TRACE(flags);
    const std::vector<int32_t> want = c["tokens"].get<std::vector<int32_t>>();
    absl::StatusOr<MadeModel> made = MakeModel(flags, absl::StrCat("greedy-", n++, ".gguf"));
    ASSERT_TRUE(made.ok()) << made.status();
    for (const Backend& backend : backends) {
      absl::StatusOr<std::vector<int32_t>> got =
          backend.greedy(made->model, prompt, static_cast<int>(want.size()));
      ASSERT_TRUE(got.ok()) << backend.name << ": " << got.status();
      EXPECT_EQ(*got, want) << backend.name;
    }
  }
}

void ExpectTeacherForcedProbabilitiesMatchLlamaCpps(absl::Span<const Backend> backends) {
  const nlohmann::json doc = ReadData("teacher-forced.json");
  ASSERT_TRUE(doc.is_object()) << "cannot read tests/data/crosscheck/teacher-forced.json";
  const std::vector<int32_t> tokens = doc["tokens"].get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), 64u);
  ASSERT_GE(doc["fixtures"].size(), 11u);
  for (const nlohmann::json& fixture : doc["fixtures"]) {
    const std::string type = fixture["expert_type"].get<std::string>();
    const std::string flags = fixture["make_fixture"].get<std::string>();
    SCOPED_TRACE(flags);
    absl::StatusOr<MadeModel> made = MakeModel(flags, "crosscheck-" + type + ".gguf");
    ASSERT_TRUE(made.ok()) << made.status();
    const Model& model = made->model;
    ASSERT_EQ(model.expert(model.config.n_layer_dense_lead, ExpertProj::kGate, 0).type, [&] {
      GgmlType t;
      EXPECT_TRUE(ggml_type_from_name(type, &t));
      return t;
    }());
    const int n_vocab = model.config.n_vocab;
    const nlohmann::json& top = fixture["top"];
    ASSERT_EQ(top.size(), tokens.size());
    for (const Backend& backend : backends) {
      SCOPED_TRACE(backend.name);
      absl::StatusOr<std::vector<float>> logits = backend.forward(model, tokens);
      ASSERT_TRUE(logits.ok()) << logits.status();
      ASSERT_EQ(logits->size(), tokens.size() * n_vocab);
      double max_diff = 0.0;
      int argmax_checked = 0, close = 0;
      for (size_t pos = 0; pos < tokens.size(); ++pos) {
        const std::vector<double> p = Softmax(logits->data() + pos * n_vocab, n_vocab);
        const nlohmann::json& theirs = top[pos];
        ASSERT_EQ(theirs.size(), 5u);
        double diff = 0.0;
        for (const nlohmann::json& pair : theirs) {
          const int id = pair[0].get<int>();
          const double want = pair[1].get<double>();
          ASSERT_TRUE(id >= 0 && id < n_vocab);
          diff = std::max(diff, std::fabs(p[id] - want));
          EXPECT_NEAR(p[id], want, backend.bound) << "position " << pos << " token " << id;
        }
        max_diff = std::max(max_diff, diff);
        close += diff <= kClose;
        if (theirs[0][1].get<double>() - theirs[1][1].get<double>() > 2 * backend.bound) {
          ++argmax_checked;
          const int ours = static_cast<int>(std::max_element(p.begin(), p.end()) - p.begin());
          EXPECT_EQ(ours, theirs[0][0].get<int>()) << "position " << pos;
        }
      }
      EXPECT_GE(close, backend.min_close) << "positions whose top 5 are within " << kClose;
      std::cout << "[ crosscheck ] " << arch_gguf_name(model.config.arch) << " " << type << " "
                << backend.name << ": top-5 probabilities within " << max_diff
                << " of llama.cpp's (within " << kClose << " at " << close
                << " of 64 positions); argmax equal at the " << argmax_checked
                << " positions past the margin\n";
    }
  }
}

}  // namespace moegraph::crosscheck
