// Routing traces: the JSONL interchange form (with a small strict JSON parser,
// so no JSON dependency) and the binary form described in trace.h.
#include "residency/trace.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "loader/check.h"
#include "loader/quant.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

constexpr char kMagic[4] = {'M', 'G', 'T', 'R'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kFlagWeights = 1;
constexpr size_t kHeaderBytes = 32;
// Ids are u16 and kMissingExpert is reserved, so ids stop one below it.
constexpr int64_t kMaxExperts = kMissingExpert;
constexpr int64_t kMaxLayers = 1 << 16;
constexpr int kMaxJsonDepth = 64;
// A JSONL file may leave rows out, but memory must stay proportional to the
// file: refuse a layout with more than this many (step, layer) pairs per row.
constexpr int64_t kMaxPairsPerRow = 64;

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using FilePtr = std::unique_ptr<FILE, FileCloser>;

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  FilePtr file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) return absl::NotFoundError(absl::StrCat(path, ": cannot open for reading"));
  std::string data;
  char buffer[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file.get())) > 0) data.append(buffer, n);
  if (std::ferror(file.get())) {
    return absl::DataLossError(absl::StrCat(path, ": read error at byte ", data.size()));
  }
  return data;
}

absl::Status WriteWholeFile(const std::string& path, std::string_view data) {
  FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  }
  const size_t written = std::fwrite(data.data(), 1, data.size(), file);
  const bool closed = std::fclose(file) == 0;
  if (written != data.size() || !closed) {
    return absl::DataLossError(absl::StrCat(path, ": write failed after byte ", written));
  }
  return absl::OkStatus();
}

void CheckShape(const RoutingTrace& trace) {
  MG_CHECK(trace.n_layer >= 1 && trace.k >= 1 && trace.n_steps >= 0, "trace geometry");
  MG_CHECK(trace.n_expert >= trace.k && trace.n_expert <= kMaxExperts, "trace n_expert");
  const size_t cells = static_cast<size_t>(trace.n_steps) * trace.n_layer * trace.k;
  MG_CHECK(trace.ids.size() == cells, "trace ids size");
  MG_CHECK(trace.weights.empty() || trace.weights.size() == cells, "trace weights size");
}

absl::Status CheckHint(const TraceReadOptions& options) {
  if (options.n_expert_hint < 0 || options.n_expert_hint > kMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat("--experts ", options.n_expert_hint,
                                                   " is out of range [0, ", kMaxExperts, "]"));
  }
  return absl::OkStatus();
}

// ---- a strict JSON parser (RFC 8259 grammar, one value per text) ----

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0.0;
  bool integral = false;  // written without fraction or exponent, and fits int64
  int64_t integer = 0;
  std::string text;
  std::vector<JsonValue> items;
  // An object's members as parallel lists (a pair holding the type being
  // defined is not portable: clang's libstdc++ checks reject it).
  std::vector<std::string> member_names;
  std::vector<JsonValue> member_values;

  const JsonValue* Find(std::string_view key) const {
    for (size_t i = 0; i < member_names.size(); ++i) {
      if (member_names[i] == key) return &member_values[i];
    }
    return nullptr;
  }
};

class JsonParser {
 public:
  explicit JsonParser(std::string_view text) : text_(text) {}

  // The whole text must be exactly one value, with optional whitespace around it.
  absl::Status ParseDocument(JsonValue* out) {
    SkipSpace();
    MG_RETURN_IF_ERROR(ParseValue(out, 0));
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the JSON value");
    return absl::OkStatus();
  }

 private:
  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("column ", pos_ + 1, ": ", Av(what)));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\r' || text_[pos_] == '\n')) {
      ++pos_;
    }
  }

  bool Consume(std::string_view literal) {
    if (text_.substr(pos_, literal.size()) != literal) return false;
    pos_ += literal.size();
    return true;
  }

  absl::Status ParseValue(JsonValue* out, int depth) {
    if (depth > kMaxJsonDepth) return Error("nesting too deep");
    if (pos_ >= text_.size()) return Error("unexpected end of line");
    const char c = text_[pos_];
    if (c == '{') return ParseObject(out, depth);
    if (c == '[') return ParseArray(out, depth);
    if (c == '"') {
      out->type = JsonValue::Type::kString;
      return ParseString(&out->text);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber(out);
    if (Consume("true")) {
      out->type = JsonValue::Type::kBool;
      out->boolean = true;
      return absl::OkStatus();
    }
    if (Consume("false")) {
      out->type = JsonValue::Type::kBool;
      return absl::OkStatus();
    }
    if (Consume("null")) return absl::OkStatus();
    return Error(absl::StrCat("unexpected character '", Av(text_.substr(pos_, 1)), "'"));
  }

  absl::Status ParseObject(JsonValue* out, int depth) {
    out->type = JsonValue::Type::kObject;
    ++pos_;  // '{'
    SkipSpace();
    if (Consume("}")) return absl::OkStatus();
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a string key");
      std::string key;
      MG_RETURN_IF_ERROR(ParseString(&key));
      if (out->Find(key) != nullptr) return Error(absl::StrCat("duplicate key \"", key, "\""));
      SkipSpace();
      if (!Consume(":")) return Error("expected ':' after a key");
      SkipSpace();
      JsonValue value;
      MG_RETURN_IF_ERROR(ParseValue(&value, depth + 1));
      out->member_names.push_back(std::move(key));
      out->member_values.push_back(std::move(value));
      SkipSpace();
      if (Consume("}")) return absl::OkStatus();
      if (!Consume(",")) return Error("expected ',' or '}' in an object");
    }
  }

  absl::Status ParseArray(JsonValue* out, int depth) {
    out->type = JsonValue::Type::kArray;
    ++pos_;  // '['
    SkipSpace();
    if (Consume("]")) return absl::OkStatus();
    while (true) {
      SkipSpace();
      JsonValue value;
      MG_RETURN_IF_ERROR(ParseValue(&value, depth + 1));
      out->items.push_back(std::move(value));
      SkipSpace();
      if (Consume("]")) return absl::OkStatus();
      if (!Consume(",")) return Error("expected ',' or ']' in an array");
    }
  }

  absl::Status ParseHex4(uint32_t* out) {
    if (pos_ + 4 > text_.size()) return Error("truncated \\u escape");
    uint32_t value = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      value <<= 4;
      if (c >= '0' && c <= '9') {
        value |= c - '0';
      } else if (c >= 'a' && c <= 'f') {
        value |= c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        value |= c - 'A' + 10;
      } else {
        return Error("bad hex digit in a \\u escape");
      }
    }
    *out = value;
    return absl::OkStatus();
  }

  static void AppendUtf8(uint32_t code, std::string* out) {
    if (code < 0x80) {
      out->push_back(static_cast<char>(code));
    } else if (code < 0x800) {
      out->push_back(static_cast<char>(0xc0 | (code >> 6)));
      out->push_back(static_cast<char>(0x80 | (code & 0x3f)));
    } else if (code < 0x10000) {
      out->push_back(static_cast<char>(0xe0 | (code >> 12)));
      out->push_back(static_cast<char>(0x80 | ((code >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (code & 0x3f)));
    } else {
      out->push_back(static_cast<char>(0xf0 | (code >> 18)));
      out->push_back(static_cast<char>(0x80 | ((code >> 12) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | ((code >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (code & 0x3f)));
    }
  }

  absl::Status ParseString(std::string* out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= text_.size()) return Error("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return absl::OkStatus();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) return Error("unterminated string");
      const char escape = text_[pos_++];
      switch (escape) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t code = 0;
          MG_RETURN_IF_ERROR(ParseHex4(&code));
          if (code >= 0xdc00 && code <= 0xdfff) return Error("lone low surrogate in a \\u escape");
          if (code >= 0xd800 && code <= 0xdbff) {
            uint32_t low = 0;
            if (!Consume("\\u")) return Error("high surrogate without a low one");
            MG_RETURN_IF_ERROR(ParseHex4(&low));
            if (low < 0xdc00 || low > 0xdfff) return Error("high surrogate without a low one");
            code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
          }
          AppendUtf8(code, out);
          break;
        }
        default:
          return Error(absl::StrCat("bad escape '\\", Av(text_.substr(pos_ - 1, 1)), "'"));
      }
    }
  }

  bool AtDigit() const { return pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9'; }

  absl::Status ParseNumber(JsonValue* out) {
    const size_t start = pos_;
    Consume("-");
    if (!AtDigit()) return Error("expected a digit");
    if (text_[pos_] == '0') {
      ++pos_;
      if (AtDigit()) return Error("leading zero in a number");
    }
    while (AtDigit()) ++pos_;
    bool integral = true;
    if (Consume(".")) {
      integral = false;
      if (!AtDigit()) return Error("expected a digit after '.'");
      while (AtDigit()) ++pos_;
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (!Consume("+")) Consume("-");
      if (!AtDigit()) return Error("expected a digit in the exponent");
      while (AtDigit()) ++pos_;
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    out->type = JsonValue::Type::kNumber;
    // from_chars does not depend on the C locale, unlike strtod.
    const std::from_chars_result parsed = std::from_chars(first, last, out->number);
    if (parsed.ec != std::errc() || parsed.ptr != last) {
      pos_ = start;
      return Error("number out of range");
    }
    if (integral) {
      const std::from_chars_result as_int = std::from_chars(first, last, out->integer);
      out->integral = as_int.ec == std::errc() && as_int.ptr == last;
    }
    return absl::OkStatus();
  }

  std::string_view text_;
  size_t pos_ = 0;
};

// ---- JSONL reading ----

struct JsonlRow {
  int32_t dataset = 0;  // index into the datasets seen, in order of appearance
  int64_t problem_id = 0;
  int64_t token = 0;
  int32_t layer = 0;
  int64_t line = 0;
  size_t first_id = 0;  // into the flat id (and weight) lists
};

class JsonlReader {
 public:
  JsonlReader(const std::string& path, const TraceReadOptions& options)
      : path_(path), options_(options) {}

  absl::StatusOr<RoutingTrace> Read() {
    MG_RETURN_IF_ERROR(CheckHint(options_));
    MG_ASSIGN_OR_RETURN(const std::string data, ReadWholeFile(path_));
    size_t start = 0;
    int64_t line = 0;
    while (start < data.size()) {
      size_t end = data.find('\n', start);
      if (end == std::string::npos) end = data.size();
      ++line;
      const std::string_view text(data.data() + start, end - start);
      if (text.find_first_not_of(" \t\r") != std::string_view::npos) {
        MG_RETURN_IF_ERROR(ParseLine(text, line));
      }
      start = end + 1;
    }
    if (rows_.empty()) return absl::InvalidArgumentError(absl::StrCat(path_, ": no rows"));
    return Assemble();
  }

 private:
  absl::Status LineError(int64_t line, std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ":", line, ": ", Av(what)));
  }

  absl::StatusOr<int64_t> Integer(const JsonValue& object, std::string_view key, int64_t line) {
    const JsonValue* value = object.Find(key);
    if (value == nullptr) return LineError(line, absl::StrCat("missing field \"", Av(key), "\""));
    if (value->type != JsonValue::Type::kNumber || !value->integral) {
      return LineError(line, absl::StrCat("field \"", Av(key), "\" must be an integer"));
    }
    return value->integer;
  }

  // An optional key that, when present, must be a positive integer equal on every line.
  absl::Status OptionalCount(const JsonValue& object, std::string_view key, int64_t line,
                             int64_t limit, int64_t* seen, int64_t* seen_line) {
    if (object.Find(key) == nullptr) return absl::OkStatus();
    MG_ASSIGN_OR_RETURN(const int64_t value, Integer(object, key, line));
    if (value < 1 || value > limit) {
      return LineError(line, absl::StrCat("\"", Av(key), "\" ", value, " is out of range [1, ",
                                          limit, "]"));
    }
    if (*seen != 0 && *seen != value) {
      return LineError(line, absl::StrCat("\"", Av(key), "\" ", value, " differs from ", *seen,
                                          " on line ", *seen_line));
    }
    *seen = value;
    *seen_line = line;
    return absl::OkStatus();
  }

  absl::Status ParseLine(std::string_view text, int64_t line) {
    JsonValue object;
    absl::Status parsed = JsonParser(text).ParseDocument(&object);
    if (!parsed.ok()) return LineError(line, absl::StrCat("not JSON: ", parsed.message()));
    if (object.type != JsonValue::Type::kObject) return LineError(line, "not a JSON object");

    JsonlRow row;
    row.line = line;
    const JsonValue* dataset = object.Find("dataset");
    if (dataset == nullptr) return LineError(line, "missing field \"dataset\"");
    if (dataset->type != JsonValue::Type::kString) {
      return LineError(line, "field \"dataset\" must be a string");
    }
    const auto [it, inserted] =
        dataset_index_.emplace(dataset->text, static_cast<int32_t>(dataset_index_.size()));
    row.dataset = it->second;
    MG_ASSIGN_OR_RETURN(row.problem_id, Integer(object, "problem_id", line));

    MG_ASSIGN_OR_RETURN(const int64_t layer, Integer(object, "layer", line));
    if (layer < 0 || layer >= kMaxLayers) {
      return LineError(line,
                       absl::StrCat("layer ", layer, " is out of range [0, ", kMaxLayers, ")"));
    }
    row.layer = static_cast<int32_t>(layer);

    const bool has_idx = object.Find("token_idx") != nullptr;
    const bool has_pos = object.Find("token_pos") != nullptr;
    if (has_idx && has_pos) return LineError(line, "both \"token_idx\" and \"token_pos\"");
    if (!has_idx && !has_pos) {
      return LineError(line, "missing field \"token_idx\" (or \"token_pos\")");
    }
    MG_ASSIGN_OR_RETURN(row.token, Integer(object, has_idx ? "token_idx" : "token_pos", line));

    MG_RETURN_IF_ERROR(OptionalCount(object, "n_layer", line, kMaxLayers, &n_layer_key_,
                                     &n_layer_key_line_));
    MG_RETURN_IF_ERROR(OptionalCount(object, "n_expert", line, kMaxExperts, &n_expert_key_,
                                     &n_expert_key_line_));

    const JsonValue* experts = object.Find("experts");
    if (experts == nullptr) return LineError(line, "missing field \"experts\"");
    if (experts->type != JsonValue::Type::kArray || experts->items.empty()) {
      return LineError(line, "field \"experts\" must be a non-empty array of integers");
    }
    const int64_t k = static_cast<int64_t>(experts->items.size());
    if (k_ == 0) {
      k_ = k;
    } else if (k != k_) {
      return LineError(line, absl::StrCat("\"experts\" has ", k, " ids, line ", rows_[0].line,
                                          " has ", k_));
    }
    row.first_id = ids_.size();
    for (int64_t i = 0; i < k; ++i) {
      const JsonValue& id = experts->items[i];
      if (id.type != JsonValue::Type::kNumber || !id.integral) {
        return LineError(line, absl::StrCat("experts[", i, "] must be an integer"));
      }
      const int64_t limit = options_.n_expert_hint > 0 ? options_.n_expert_hint : kMaxExperts;
      if (id.integer < 0 || id.integer >= limit) {
        return LineError(line, absl::StrCat("expert id ", id.integer, " is out of range [0, ",
                                            limit, ")",
                                            options_.n_expert_hint > 0 ? " (--experts)" : ""));
      }
      for (int64_t j = 0; j < i; ++j) {
        if (ids_[row.first_id + j] == id.integer) {
          return LineError(line, absl::StrCat("expert id ", id.integer, " appears twice"));
        }
      }
      ids_.push_back(static_cast<uint16_t>(id.integer));
      if (id.integer > max_id_) {
        max_id_ = id.integer;
        max_id_line_ = line;
      }
    }

    const JsonValue* probs = object.Find("gating_probs");
    const bool row_has_weights = probs != nullptr;
    if (rows_.empty()) {
      has_weights_ = row_has_weights;
    } else if (row_has_weights != has_weights_) {
      return LineError(line, absl::StrCat(row_has_weights ? "has" : "lacks",
                                          " \"gating_probs\", unlike line ", rows_[0].line));
    }
    if (row_has_weights) {
      if (probs->type != JsonValue::Type::kArray) {
        return LineError(line, "field \"gating_probs\" must be an array of numbers");
      }
      if (static_cast<int64_t>(probs->items.size()) != k) {
        return LineError(line, absl::StrCat("\"gating_probs\" has ", probs->items.size(),
                                            " values but \"experts\" has ", k));
      }
      for (size_t i = 0; i < probs->items.size(); ++i) {
        if (probs->items[i].type != JsonValue::Type::kNumber) {
          return LineError(line, absl::StrCat("gating_probs[", i, "] must be a number"));
        }
        weights_.push_back(f32_to_f16(static_cast<float>(probs->items[i].number)));
      }
    }
    if (row.layer > max_layer_) {
      max_layer_ = row.layer;
      max_layer_line_ = line;
    }
    rows_.push_back(row);
    return absl::OkStatus();
  }

  absl::StatusOr<RoutingTrace> Assemble() {
    RoutingTrace trace;
    trace.k = static_cast<int32_t>(k_);
    trace.n_layer = static_cast<int32_t>(max_layer_ + 1);
    if (n_layer_key_ != 0) {
      if (max_layer_ >= n_layer_key_) {
        return LineError(max_layer_line_, absl::StrCat("layer ", max_layer_, " is not below "
                                                       "\"n_layer\" ", n_layer_key_));
      }
      trace.n_layer = static_cast<int32_t>(n_layer_key_);
    }
    int64_t n_expert = max_id_ + 1;
    if (options_.n_expert_hint > 0) {
      if (n_expert_key_ != 0 && n_expert_key_ != options_.n_expert_hint) {
        return LineError(n_expert_key_line_, absl::StrCat("\"n_expert\" ", n_expert_key_,
                                                          " disagrees with --experts ",
                                                          options_.n_expert_hint));
      }
      n_expert = options_.n_expert_hint;
    } else if (n_expert_key_ != 0) {
      if (max_id_ >= n_expert_key_) {
        return LineError(max_id_line_, absl::StrCat("expert id ", max_id_, " is not below "
                                                    "\"n_expert\" ", n_expert_key_));
      }
      n_expert = n_expert_key_;
    }
    trace.n_expert = static_cast<int32_t>(n_expert);
    if (trace.n_expert < trace.k) {
      return LineError(rows_[0].line, absl::StrCat("k ", trace.k, " exceeds the ", trace.n_expert,
                                                   " experts"));
    }

    // Datasets order by name, not by first appearance.
    std::vector<int32_t> dataset_rank(dataset_index_.size());
    int32_t rank = 0;
    for (const auto& [name, index] : dataset_index_) dataset_rank[index] = rank++;
    for (JsonlRow& row : rows_) row.dataset = dataset_rank[row.dataset];

    auto step_key = [](const JsonlRow& r) { return std::tuple(r.dataset, r.problem_id, r.token); };
    std::stable_sort(rows_.begin(), rows_.end(), [&](const JsonlRow& a, const JsonlRow& b) {
      return std::tuple(step_key(a), a.layer) < std::tuple(step_key(b), b.layer);
    });
    int64_t n_steps = 0;
    for (size_t i = 0; i < rows_.size(); ++i) {
      if (i > 0 && step_key(rows_[i]) == step_key(rows_[i - 1])) {
        if (rows_[i].layer == rows_[i - 1].layer) {
          return LineError(rows_[i].line, absl::StrCat("repeats the (step, layer) row of line ",
                                                       rows_[i - 1].line));
        }
      } else {
        ++n_steps;
      }
    }
    const int64_t pairs = n_steps * trace.n_layer;
    if (pairs > kMaxPairsPerRow * static_cast<int64_t>(rows_.size()) + kMaxPairsPerRow) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ": only ", rows_.size(), " of ", pairs,
          " (step, layer) rows are present; too sparse to be a routing trace"));
    }

    trace.n_steps = n_steps;
    trace.ids.assign(static_cast<size_t>(pairs) * trace.k, kMissingExpert);
    if (has_weights_) trace.weights.assign(trace.ids.size(), 0);
    int64_t step = -1;
    for (size_t i = 0; i < rows_.size(); ++i) {
      if (i == 0 || step_key(rows_[i]) != step_key(rows_[i - 1])) ++step;
      const size_t to = trace.row_offset(step, rows_[i].layer);
      std::copy_n(ids_.begin() + rows_[i].first_id, trace.k, trace.ids.begin() + to);
      if (has_weights_) {
        std::copy_n(weights_.begin() + rows_[i].first_id, trace.k, trace.weights.begin() + to);
      }
    }
    return trace;
  }

  const std::string& path_;
  const TraceReadOptions& options_;
  std::map<std::string, int32_t> dataset_index_;
  std::vector<JsonlRow> rows_;
  std::vector<uint16_t> ids_;
  std::vector<uint16_t> weights_;
  int64_t k_ = 0;
  bool has_weights_ = false;
  int64_t max_id_ = -1;
  int64_t max_id_line_ = 0;
  int64_t max_layer_ = -1;
  int64_t max_layer_line_ = 0;
  int64_t n_layer_key_ = 0;
  int64_t n_layer_key_line_ = 0;
  int64_t n_expert_key_ = 0;
  int64_t n_expert_key_line_ = 0;
};

// ---- binary form ----

uint32_t LoadU32(const std::string& data, size_t offset) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(data[offset + i]);
  return v;
}

uint64_t LoadU64(const std::string& data, size_t offset) {
  return LoadU32(data, offset) | (static_cast<uint64_t>(LoadU32(data, offset + 4)) << 32);
}

uint16_t LoadU16(const std::string& data, size_t offset) {
  return static_cast<uint16_t>(static_cast<uint8_t>(data[offset]) |
                               (static_cast<uint8_t>(data[offset + 1]) << 8));
}

void StoreLittleEndian(uint64_t value, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

bool IsJsonlPath(std::string_view path) {
  constexpr std::string_view kExtension = ".jsonl";
  return path.size() >= kExtension.size() &&
         path.substr(path.size() - kExtension.size()) == kExtension;
}

// A number as the shortest text that reads back to the same float.
void AppendFloat(float value, std::string* out) {
  char buffer[32];
  const std::to_chars_result r = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out->append(buffer, r.ptr);
}

}  // namespace

absl::StatusOr<RoutingTrace> ReadTraceJsonl(const std::string& path,
                                            const TraceReadOptions& options) {
  return JsonlReader(path, options).Read();
}

absl::StatusOr<RoutingTrace> ReadTraceBinary(const std::string& path,
                                             const TraceReadOptions& options) {
  MG_RETURN_IF_ERROR(CheckHint(options));
  MG_ASSIGN_OR_RETURN(const std::string data, ReadWholeFile(path));
  auto error = [&](size_t offset, std::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": byte ", offset, ": ", Av(what)));
  };
  if (data.size() < kHeaderBytes) {
    return error(data.size(), absl::StrCat("file ends inside the ", kHeaderBytes, "-byte header"));
  }
  if (data.compare(0, 4, kMagic, 4) != 0) return error(0, "not a routing trace (magic \"MGTR\")");
  const uint32_t version = LoadU32(data, 4);
  if (version != kVersion) return error(4, absl::StrCat("unsupported version ", version));
  const uint32_t n_layer = LoadU32(data, 8);
  const uint32_t n_expert = LoadU32(data, 12);
  const uint32_t k = LoadU32(data, 16);
  const uint64_t n_steps = LoadU64(data, 20);
  const uint32_t flags = LoadU32(data, 28);
  if (n_layer < 1 || n_layer > kMaxLayers) {
    return error(8, absl::StrCat("n_layer ", n_layer, " is out of range [1, ", kMaxLayers, "]"));
  }
  if (n_expert < 1 || n_expert > kMaxExperts) {
    return error(12,
                 absl::StrCat("n_expert ", n_expert, " is out of range [1, ", kMaxExperts, "]"));
  }
  if (k < 1 || k > n_expert) {
    return error(16, absl::StrCat("k ", k, " is out of range [1, n_expert ", n_expert, "]"));
  }
  if ((flags & ~kFlagWeights) != 0) return error(28, absl::StrCat("unknown flags ", flags));
  if (options.n_expert_hint > 0 && static_cast<uint32_t>(options.n_expert_hint) != n_expert) {
    return error(12, absl::StrCat("n_expert ", n_expert, " disagrees with --experts ",
                                  options.n_expert_hint));
  }
  const bool has_weights = (flags & kFlagWeights) != 0;
  const uint64_t bytes_per_step = static_cast<uint64_t>(n_layer) * k * 2 * (has_weights ? 2 : 1);
  const uint64_t body = data.size() - kHeaderBytes;
  if (n_steps > body / bytes_per_step || n_steps * bytes_per_step != body) {
    return error(20, absl::StrCat("n_steps ", n_steps, " needs ",
                                  n_steps > body / bytes_per_step
                                      ? std::string("more")
                                      : absl::StrCat(n_steps * bytes_per_step),
                                  " bytes after the header; the file has ", body));
  }

  RoutingTrace trace;
  trace.n_layer = static_cast<int32_t>(n_layer);
  trace.n_expert = static_cast<int32_t>(n_expert);
  trace.k = static_cast<int32_t>(k);
  trace.n_steps = static_cast<int64_t>(n_steps);
  const size_t cells = static_cast<size_t>(n_steps) * n_layer * k;
  trace.ids.resize(cells);
  for (size_t i = 0; i < cells; ++i) trace.ids[i] = LoadU16(data, kHeaderBytes + 2 * i);
  if (has_weights) {
    trace.weights.resize(cells);
    const size_t base = kHeaderBytes + 2 * cells;
    for (size_t i = 0; i < cells; ++i) trace.weights[i] = LoadU16(data, base + 2 * i);
  }
  for (size_t row = 0; row < cells / k; ++row) {
    const uint16_t* ids = &trace.ids[row * k];
    const size_t row_byte = kHeaderBytes + 2 * row * k;
    const bool missing = ids[0] == kMissingExpert;
    for (uint32_t i = 0; i < k; ++i) {
      if (missing) {
        if (ids[i] != kMissingExpert) return error(row_byte + 2 * i, "a missing row holds an id");
        if (has_weights && trace.weights[row * k + i] != 0) {
          return error(kHeaderBytes + 2 * (cells + row * k + i), "a missing row has a weight");
        }
        continue;
      }
      if (ids[i] >= n_expert) {
        return error(row_byte + 2 * i, absl::StrCat("expert id ", ids[i], " is out of range [0, ",
                                                    n_expert, ")"));
      }
      for (uint32_t j = 0; j < i; ++j) {
        if (ids[j] == ids[i]) {
          return error(row_byte + 2 * i, absl::StrCat("expert id ", ids[i], " appears twice"));
        }
      }
    }
  }
  return trace;
}

absl::StatusOr<RoutingTrace> ReadTrace(const std::string& path, const TraceReadOptions& options) {
  return IsJsonlPath(path) ? ReadTraceJsonl(path, options) : ReadTraceBinary(path, options);
}

absl::Status WriteTrace(const RoutingTrace& trace, const std::string& path) {
  return IsJsonlPath(path) ? WriteTraceJsonl(trace, path) : WriteTraceBinary(trace, path);
}

absl::Status WriteTraceJsonl(const RoutingTrace& trace, const std::string& path) {
  CheckShape(trace);
  const std::string geometry =
      absl::StrCat(", \"n_layer\": ", trace.n_layer, ", \"n_expert\": ", trace.n_expert);
  std::string out;
  for (int64_t step = 0; step < trace.n_steps; ++step) {
    for (int32_t layer = 0; layer < trace.n_layer; ++layer) {
      if (!trace.present(step, layer)) continue;
      absl::StrAppend(&out, "{\"dataset\": \"moegraph\", \"problem_id\": 0, \"layer\": ", layer,
                      ", \"token_idx\": ", step, geometry, ", \"experts\": [");
      const size_t offset = trace.row_offset(step, layer);
      for (int32_t i = 0; i < trace.k; ++i) {
        absl::StrAppend(&out, i > 0 ? ", " : "", trace.ids[offset + i]);
      }
      out += "]";
      if (!trace.weights.empty()) {
        out += ", \"gating_probs\": [";
        for (int32_t i = 0; i < trace.k; ++i) {
          if (i > 0) out += ", ";
          AppendFloat(f16_to_f32(trace.weights[offset + i]), &out);
        }
        out += "]";
      }
      out += "}\n";
    }
  }
  return WriteWholeFile(path, out);
}

absl::Status WriteTraceBinary(const RoutingTrace& trace, const std::string& path) {
  CheckShape(trace);
  std::string out(kMagic, sizeof(kMagic));
  StoreLittleEndian(kVersion, 4, &out);
  StoreLittleEndian(static_cast<uint32_t>(trace.n_layer), 4, &out);
  StoreLittleEndian(static_cast<uint32_t>(trace.n_expert), 4, &out);
  StoreLittleEndian(static_cast<uint32_t>(trace.k), 4, &out);
  StoreLittleEndian(static_cast<uint64_t>(trace.n_steps), 8, &out);
  StoreLittleEndian(trace.weights.empty() ? 0 : kFlagWeights, 4, &out);
  out.reserve(kHeaderBytes + 2 * (trace.ids.size() + trace.weights.size()));
  for (uint16_t id : trace.ids) StoreLittleEndian(id, 2, &out);
  // A missing row's weights are written as 0, as the reader expects.
  for (size_t i = 0; i < trace.weights.size(); ++i) {
    StoreLittleEndian(trace.ids[i - i % trace.k] == kMissingExpert ? 0 : trace.weights[i], 2, &out);
  }
  return WriteWholeFile(path, out);
}

}  // namespace moegraph
