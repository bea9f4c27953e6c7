// A GGUF file rewritten with its weight matrices in one type, as llama.cpp's
// llama-quantize --pure does (src/llama-quant.cpp, llama_model_quantize_impl
// with params->pure): every key copied (general.file_type and
// general.quantization_version set as llama-quantize sets them), and every
// tensor that tensor_allows_quantization admits (2-D or more, named *weight,
// not a norm, not the router ffn_gate_inp, not ssm_conv1d) converted to the
// target type, or to tensor_type_fallback's where its rows do not fill the
// type's blocks (q4_K -> q5_0, q5_K -> q5_1, q6_K -> q8_0, q2_K/q3_K -> q4_0,
// iq4_xs -> iq4_nl; f16 where even that does not fit); the others copied as
// they are. Values are dequantized to f32 and quantized with ggml's reference
// quantizers (loader/quantize.h), so the bytes are llama-quantize's without an
// importance matrix.
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "loader/ggml_type.h"
#include "loader/gguf.h"

namespace moegraph {

// The type llama-quantize --pure gives tensor t for target.
GgmlType PureQuantizedType(const GgufTensor& t, GgmlType target);

// llama_ftype of a --pure run to target (general.file_type), or -1 where
// llama.cpp names none for that type.
int PureFileType(GgmlType target);

// Writes in's keys and tensors to out_path with PureQuantizedType's types.
// Errors name the file: a target moegraph cannot write, a tensor it cannot
// read, a write that fails. progress (may be empty) gets each tensor's name.
absl::Status RequantizeFile(const GgufFile& in, GgmlType target, const std::string& out_path,
                            const std::function<void(const std::string&)>& progress);

}  // namespace moegraph
