#include "text/unicode.h"

#include <array>

namespace moegraph {
namespace {

// GPT-2's bytes_to_unicode: '!'..'~', '¡'..'¬' and '®'..'ÿ' stand for
// themselves; the other 68 bytes, in order, for U+0100, U+0101, ...
struct ByteAlphabet {
  std::array<std::string, 256> symbol;
  std::array<int, 512> byte_of;  // codepoint (< 512) -> byte, or -1

  ByteAlphabet() {
    byte_of.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t codepoint = printable ? static_cast<uint32_t>(b) : next++;
      symbol[static_cast<size_t>(b)] = EncodeUtf8(codepoint);
      byte_of[codepoint] = b;
    }
  }
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

// Decodes the codepoint at text[*pos] (valid UTF-8 assumed) and advances *pos.
uint32_t NextCodepoint(std::string_view text, size_t* pos) {
  const auto lead = static_cast<uint8_t>(text[*pos]);
  const int n = Utf8SequenceLength(lead);
  uint32_t codepoint = n == 1 ? lead : lead & (0x7Fu >> n);
  for (int i = 1; i < n && *pos + static_cast<size_t>(i) < text.size(); ++i) {
    codepoint =
        (codepoint << 6) | (static_cast<uint8_t>(text[*pos + static_cast<size_t>(i)]) & 0x3Fu);
  }
  *pos += static_cast<size_t>(n);
  return codepoint;
}

}  // namespace

int Utf8SequenceLength(uint8_t lead) {
  static constexpr int kByHighNibble[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kByHighNibble[lead >> 4];
}

size_t FindInvalidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto b0 = static_cast<uint8_t>(text[i]);
    if (b0 < 0x80) {
      ++i;
      continue;
    }
    int n = 0;
    uint32_t min = 0;
    if ((b0 & 0xE0) == 0xC0) {
      n = 2, min = 0x80;
    } else if ((b0 & 0xF0) == 0xE0) {
      n = 3, min = 0x800;
    } else if ((b0 & 0xF8) == 0xF0) {
      n = 4, min = 0x10000;
    } else {
      return i;
    }
    if (i + static_cast<size_t>(n) > text.size()) return i;
    uint32_t codepoint = b0 & (0x7Fu >> n);
    for (int k = 1; k < n; ++k) {
      const auto b = static_cast<uint8_t>(text[i + static_cast<size_t>(k)]);
      if ((b & 0xC0) != 0x80) return i;
      codepoint = (codepoint << 6) | (b & 0x3Fu);
    }
    if (codepoint < min || codepoint > 0x10FFFF || (codepoint >= 0xD800 && codepoint <= 0xDFFF)) {
      return i;
    }
    i += static_cast<size_t>(n);
  }
  return std::string_view::npos;
}

std::string ReplaceInvalidUtf8(std::string_view text) {
  std::string out;
  for (size_t bad = FindInvalidUtf8(text); bad != std::string_view::npos;
       bad = FindInvalidUtf8(text)) {
    out.append(text.substr(0, bad));
    out.append("\xEF\xBF\xBD");
    text.remove_prefix(bad + 1);
  }
  out.append(text);
  return out;
}

std::string EncodeUtf8(uint32_t codepoint) {
  std::string out;
  if (codepoint < 0x80) {
    out += static_cast<char>(codepoint);
  } else if (codepoint < 0x800) {
    out += static_cast<char>(0xC0 | (codepoint >> 6));
    out += static_cast<char>(0x80 | (codepoint & 0x3F));
  } else if (codepoint < 0x10000) {
    out += static_cast<char>(0xE0 | (codepoint >> 12));
    out += static_cast<char>(0x80 | ((codepoint >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (codepoint & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (codepoint >> 18));
    out += static_cast<char>(0x80 | ((codepoint >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((codepoint >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (codepoint & 0x3F));
  }
  return out;
}

std::string_view ByteToSymbol(uint8_t b) { return Alphabet().symbol[b]; }

std::string ByteEncode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += ByteToSymbol(static_cast<uint8_t>(c));
  return out;
}

bool ByteDecode(std::string_view text, std::string* bytes) {
  size_t pos = 0;
  while (pos < text.size()) {
    const uint32_t codepoint = NextCodepoint(text, &pos);
    const int b = codepoint < 512 ? Alphabet().byte_of[codepoint] : -1;
    if (b < 0) return false;
    *bytes += static_cast<char>(b);
  }
  return true;
}

}  // namespace moegraph
