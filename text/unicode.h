// UTF-8, and the byte-level alphabet of GPT-2-style BPE vocabularies: every
// byte stands for one printable codepoint, so a token's text is valid UTF-8
// whatever bytes it holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moegraph {

// Bytes of the UTF-8 sequence a byte starts, from its high nibble, as llama.cpp
// counts them (a continuation or invalid byte counts 1).
int Utf8SequenceLength(uint8_t lead);

// The offset of the first byte that is not part of valid UTF-8 (overlong forms,
// surrogates and codepoints past U+10FFFF are invalid), or npos.
size_t FindInvalidUtf8(std::string_view text);

// The text with each byte FindInvalidUtf8 finds replaced by U+FFFD, one at a
// time (what JSON output with nlohmann's replace handler writes).
std::string ReplaceInvalidUtf8(std::string_view text);

std::string EncodeUtf8(uint32_t codepoint);

// Byte b as the byte-level alphabet writes it: printable Latin-1 bytes as
// themselves, the rest as U+0100 + n, UTF-8 encoded ("Ġ" for a space).
std::string_view ByteToSymbol(uint8_t b);
// The text with each byte replaced by its symbol.
std::string ByteEncode(std::string_view bytes);
// The inverse of ByteEncode; false when text holds a codepoint outside the
// alphabet (the bytes decoded so far are in *bytes).
bool ByteDecode(std::string_view text, std::string* bytes);

}  // namespace moegraph
