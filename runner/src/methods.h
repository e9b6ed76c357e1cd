// The program's methods as callables over named values: an NPU method gets its input rows on each
// activation group's INT8 grid and gives back one output per linear (split channels put back in
// place); a CPU method's shadow branches get their cold channels' products added from the rows file.
// Mirrors runtime/pte_runner.py (_npu_call, _cpu_call) and format/rows.py (ColdRows).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/runtime/core/hierarchical_allocator.h>

#include "cold_rows.h"
#include "sidecar.h"
#include "value.h"

namespace llmnpu {

// The NPU methods of a program whose HTP contexts do not fit together, loaded when called: from a
// Module of their block's own, kept while the calls stay in that block (export lowers a block's
// methods into one context) and released when a method of another block is called (the runtime
// frees a context only with its program). Mirrors runtime/pte_runner.py (_BlocksOnCall).
class BlocksOnCall {
 public:
  explicit BlocksOnCall(std::string pte) : pte_(std::move(pte)) {}
  // `sub`'s method, loaded (with its block's context) if it is not. Throws InputError.
  executorch::extension::Module& module_for(const Subgraph& sub);
  void release() { held_.reset(); }

 private:
  std::string pte_, block_;
  std::unique_ptr<executorch::extension::Module> held_;
};

// Calls one subgraph's method on one of the runner's Modules (or, for an NPU method loaded when
// called, on its block's: `on_call`). Mirrors runtime/pte_runner.py.
class MethodCall {
 public:
  MethodCall(const Sidecar& s, const Subgraph& sub, executorch::extension::Module& module, ColdRows& cold,
             BlocksOnCall* on_call = nullptr);
  // `inputs` in the subgraph's input order; outputs in its output order. `break_input`: pass a
  // wrong-shaped first input (tests of the failure path). Throws RunError.
  std::vector<ValuePtr> operator()(const std::vector<ValuePtr>& inputs, bool break_input = false) const;

 private:
  std::vector<std::shared_ptr<Value>> execute(std::vector<executorch::runtime::EValue> args) const;
  std::vector<ValuePtr> npu(const std::vector<ValuePtr>& inputs, bool break_input) const;
  std::vector<ValuePtr> norm_region(const std::vector<ValuePtr>& inputs, bool break_input) const;
  std::vector<ValuePtr> attention_region(const std::vector<ValuePtr>& inputs, bool break_input) const;
  // The linears' method outputs (`outs`, from `first` on: main, split groups, fine encodings) merged
  // into one [lead..., width] value per linear
  std::vector<ValuePtr> merge(std::vector<std::shared_ptr<Value>>& outs, size_t first,
                              const std::vector<int64_t>& lead, int64_t rows) const;
  std::vector<ValuePtr> cpu(const std::vector<ValuePtr>& inputs, bool break_input) const;
  const Sidecar& s_;
  const Subgraph& sub_;
  executorch::extension::Module& module_;
  ColdRows& cold_;
  BlocksOnCall* on_call_;
  std::vector<float> scales_;   // npu: one activation scale per input group
};

// The program loaded for the runner: one Module per prefill worker (a Module's temporary allocator
// is not safe across threads), each with one activation arena for its methods, and one for decode.
// XNNPACK's weights cache packs a weight the prefill and decode share once (methods.cpp).
class LoadedProgram {
 public:
  LoadedProgram(const std::string& pte, const Sidecar& s);
  static constexpr int kNpuModule = 0, kCpuModule = 1, kDecodeModule = 2;
  static int module_of(const Subgraph& sub);   // the prefill worker's Module that runs `sub`
  std::unique_ptr<executorch::extension::Module> modules[3];
  std::unique_ptr<ColdRows> cold;
  std::unique_ptr<BlocksOnCall> npu_on_call;   // set when the NPU methods do not fit loaded together
  bool npu_per_call = false;                   // whether they did not (kept after release_prefill)
  std::vector<MethodCall> calls;   // by subgraph index
  // Unloads the prefill's methods and frees their arenas and workspaces, for a process that prefills
  // once (decode needs none of them; the weights decode shares stay packed in XNNPACK's cache).
  void release_prefill();
  bool prefill_released() const { return !modules[kNpuModule]; }

 private:
  // A lane's planned activation memory: each buffer as large as the largest its methods plan
  struct Arena {
    std::vector<std::vector<uint8_t>> buffers;
    std::vector<executorch::runtime::Span<uint8_t>> spans;
    std::unique_ptr<executorch::runtime::HierarchicalAllocator> planned;
    void fit(const executorch::runtime::MethodMeta& meta);
    executorch::runtime::HierarchicalAllocator* allocator();   // after every fit
  };
  void load_prefill();
  void load_decode();
  bool over_test_room(const Subgraph& sub) const;
  Arena arenas_[2];   // by prefill Module
  const std::string pte_;
  const Sidecar& s_;
};

// "error 0x.. (Name)" for an ExecuTorch error code.
std::string error_text(executorch::runtime::Error e);

}  // namespace llmnpu
