// The sidecar JSON beside a .pte (written by llmnpu_delegate/lower/pte.py; the format is llmnpu_delegate/format/):
// read once, checked, and turned into plain structs.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace llmnpu {

constexpr int kSidecarVersion = 13;  // format/sidecar.py VERSION

struct ShadowBranch {
  std::string linear;
  int input = 0;                // method input holding the activation
  int output = 0;               // method output the product is added to
  std::optional<int> hits;      // method output: largest residue per input channel (sparse form)
};

struct Subgraph {
  int index = 0;
  std::string method, kind, processor;   // kind: npu | cpu | shadow; processor: npu | cpu
  std::optional<int> layer;
  bool is_static = true;
  std::vector<std::string> inputs, outputs, linears;
  std::vector<std::vector<int>> input_groups;   // npu: activation-scale groups (indices into linears)
  bool graph = false;   // npu: a method holding more than linears, called with its tensors as a CPU one is
  // npu: a block norm and the linears it feeds (lower/norm_region.py): its input on the norm's 16-bit
  // grid in; the outputs no linear makes, then the linears' parts, merged into `linear_outputs`
  bool norm_region = false;
  struct { double scale = 1; int zero = 0, bits = 16; } norm_input;
  std::vector<std::string> linear_outputs;   // per linear, the output its merged product is
  // npu: RoPE, the chunk's attention against a fixed K/V window and the linears it feeds
  // (lower/attention_region.py): the inputs by name, the past K/V padded with zeros to `window` - C
  // rows and the boolean mask made additive (format/npu_io.py window_inputs); out the chunk's new K
  // and V (written after the past: the `present` outputs), the outputs no linear makes, the linears' parts
  bool attention_region = false;
  struct {
    std::string past[2], present[2], mask;
    int64_t window = 0, heads = 0;
    double mask_value = 0;
  } attention;
  std::vector<ShadowBranch> shadow;
};

// A second, finer 8-bit encoding of one part of a linear's output (format/npu_io.py FineOutput):
// the method returns that part twice; the fine value wins where it lies inside its range.
struct FineOutput {
  int part = 0;                 // 0: the main output; j: the j-th split channel group
  double scale = 0, low = 0, high = 0;
};

struct NpuLinear {
  double act_scale = 0;
  int output_bits = 8;                            // 8 or 16: requantized by the method; 32: float
  std::vector<std::vector<int>> split_channels;   // output channels the method returns on their own
  std::vector<FineOutput> fine_outputs;           // extra outputs after every split group, in order
  // The method computes the linear's shadow product over its peak channels too (placement piece
  // "peak", lower/norm_region.py): one more output, after every fine one, added on merge.
  bool peak = false;
};

struct ColdLinear {
  std::vector<int64_t> cold_channels;
  int64_t rows_offset = 0, in_features = 0, out_features = 0;
  int64_t scales_offset = -1;   // INT8 rows: the block's out_features float32 scales
  double clip = 0;
  // The rows are the program's own W^T (format/rows.py "rows_in": "program"): offsets into the .pte,
  // row c at rows_offset + c * out_features; else the rows file's, the i-th cold channel's i-th.
  bool in_program = false;
};

struct TaskTable {  // format/tasks.py dependency_table
  std::vector<std::vector<int>> after, after_previous;
  std::vector<int> needed_kv, needed_final;
  std::vector<std::string> processors;
};

struct Sidecar {
  std::string path, target;
  int64_t chunk_len = 0, context = 0, layers = 0, kv_heads = 0, head_dim = 0, vocab = 0;
  std::vector<std::string> graph_inputs, graph_outputs;
  std::vector<Subgraph> subgraphs;
  TaskTable tasks;
  std::map<std::string, NpuLinear> linears;
  // Every NPU output float: the NPU methods' INT8 linears are XNNPACK's dynamic ones, the decode's
  // kind, on the same weight bytes (lower/npu_subgraphs.py FloatOutputRegion).
  bool float_outputs() const {
    for (const auto& [name, l] : linears)
      if (l.output_bits != 32) return false;
    return !linears.empty();
  }
  std::string shadow_form, rows_file;
  int64_t rows_bytes = 0;
  int rows_itemsize = 4;   // the rows' items: 4 (float32), 2 (float16) or 1 (int8 codes, scaled)
  std::map<std::string, ColdLinear> cold;
  bool has_profile = false;
  std::map<int, double> profile_static;
  std::map<int, std::vector<double>> profile_dynamic;
  std::string decode_method;
  std::vector<int64_t> eos_ids;
  int64_t pte_bytes = -1;   // the .pte's size, when the sidecar records it
};

// Input name of one layer's past K (kind "k") or V in the chunk step (format/tasks.py past_name).
inline std::string past_name(const char* kind, int64_t layer) {
  return std::string("past_") + kind + "_" + std::to_string(layer);
}

// Reads and checks the sidecar of `pte` (model.pte -> model.json) as format/sidecar.py load_sidecar does:
// types, cross-references, the task table against the data flow, its checksum, and the .pte's size;
// with `verify_pte` also the .pte's SHA-256 (a read of the whole file, as the Python runner does on
// every load). Throws InputError.
Sidecar read_sidecar(const std::string& pte, bool verify_pte = false);

// Seconds of `step` at chunk `position`; a fractional position (a prompt after a past of part of a
// chunk) lies between two profiled ones (runtime/profile.py `Profile.cost`).
double profile_cost(const Sidecar& s, int step, double position);

}  // namespace llmnpu
