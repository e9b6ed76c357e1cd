#include "methods.h"

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <optional>

#include <executorch/extension/tensor/tensor.h>
#include <executorch/extension/threadpool/threadpool_guard.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>

#include "error.h"
#include "platform.h"

namespace llmnpu {

using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::runtime::EValue;

std::string error_text(executorch::runtime::Error e) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "ExecuTorch error 0x%x", static_cast<unsigned>(e));
  return buf;
}

// ---------------------------------------------------------------- method calls

Module& BlocksOnCall::module_for(const Subgraph& sub) {
  const std::string block = sub.layer ? std::to_string(*sub.layer) : sub.method;
  if (!held_ || block != block_) {
    held_.reset();   // first: its context goes before the next one loads
    held_ = std::make_unique<Module>(pte_, Module::LoadMode::Mmap);
    block_ = block;
  }
  if (!held_->is_method_loaded(sub.method)) {
    auto err = held_->load_method(sub.method);
    if (err != executorch::runtime::Error::Ok) {
      held_.reset();
      throw InputError("cannot load method " + sub.method + " of " + pte_ + " (" + error_text(err) +
                       "; the delegate's log above says why): a QNN program needs " +
                       platform::backend_library_hint() + ", and each block's HTP contexts to fit in the HTP's "
                       "memory alone");
    }
  }
  return *held_;
}

MethodCall::MethodCall(const Sidecar& s, const Subgraph& sub, Module& module, ColdRows& cold, BlocksOnCall* on_call)
    : s_(s), sub_(sub), module_(module), cold_(cold), on_call_(on_call) {
  if (sub.kind == "npu" && !sub.graph && !sub.attention_region) {
    if (sub.inputs.size() != 1 || sub.input_groups.empty())
      throw InputError("NPU subgraph " + sub.method + " must have one input and its input groups: export again");
    for (const auto& group : sub.input_groups) {
      if (group.empty() || group[0] < 0 || static_cast<size_t>(group[0]) >= sub.linears.size())
        throw InputError("NPU subgraph " + sub.method + " has a bad input group: export again");
      auto it = s.linears.find(sub.linears[group[0]]);
      if (it == s.linears.end()) throw InputError("the sidecar lacks NPU linear " + sub.linears[group[0]] + ": export again");
      scales_.push_back(static_cast<float>(it->second.act_scale));
    }
  }
}

std::vector<std::shared_ptr<Value>> MethodCall::execute(std::vector<EValue> args) const {
  auto result = (on_call_ ? on_call_->module_for(sub_) : module_).execute(sub_.method, args);
  if (!result.ok()) throw RunError("method " + sub_.method + " returned " + error_text(result.error()));
  std::vector<std::shared_ptr<Value>> outs;
  for (const auto& ev : *result) {
    if (!ev.isTensor()) throw RunError("method " + sub_.method + " returned a non-tensor output");
    const auto& t = ev.toTensor();
    auto v = Value::make(t.scalar_type(), std::vector<int64_t>(t.sizes().begin(), t.sizes().end()));
    std::memcpy(v->bytes.data(), t.const_data_ptr(), t.nbytes());
    outs.push_back(std::move(v));
  }
  return outs;
}

namespace {

TensorPtr view(const Value& v, std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = v.shape;
  std::vector<executorch::aten::SizesType> sizes(shape.begin(), shape.end());
  return executorch::extension::from_blob(const_cast<uint8_t*>(v.bytes.data()), sizes, v.dtype);
}

}  // namespace

std::vector<ValuePtr> MethodCall::npu(const std::vector<ValuePtr>& inputs, bool break_input) const {
  const Value& x = *inputs.at(0);
  const int64_t in = x.shape.back(), rows = x.numel() / in;
  // Each group's rows already on its activation grid: clamp(round(x / scale), +-127) * scale, the
  // codes of kernels/ops.py `quantize` (HTP's own float -> int8 conversion rounds differently).
  std::vector<std::shared_ptr<Value>> grids;
  std::vector<TensorPtr> keep;
  std::vector<EValue> args;
  for (float scale : scales_) {
    auto g = Value::make(ScalarType::Float, {rows, in});
    const float* src = x.f32();
    float* dst = g->f32();
    for (int64_t i = 0; i < rows * in; ++i) {
      float q = std::nearbyint(src[i] / scale);
      dst[i] = std::min(std::max(q, -127.0f), 127.0f) * scale;
    }
    keep.push_back(view(*g, break_input ? std::vector<int64_t>{rows, in - 1} : std::vector<int64_t>{}));
    args.emplace_back(keep.back());
    grids.push_back(std::move(g));
  }
  auto outs = execute(std::move(args));
  return merge(outs, 0, std::vector<int64_t>(x.shape.begin(), x.shape.end() - 1), rows);
}

std::vector<ValuePtr> MethodCall::norm_region(const std::vector<ValuePtr>& inputs, bool break_input) const {
  const Value& x = *inputs.at(0);
  const int64_t in = x.shape.back(), rows = x.numel() / in;
  // The rows on the norm's input grid, as kernels/npu_attention.py Encoding.round: x / scale clamped
  // to the codes less the zero point, rounded half to even, times the scale
  const auto& enc = sub_.norm_input;
  const float scale = static_cast<float>(enc.scale);
  const float lo = static_cast<float>(-enc.zero), hi = static_cast<float>((int64_t{1} << enc.bits) - 1 - enc.zero);
  auto g = Value::make(ScalarType::Float, {rows, in});
  const float* src = x.f32();
  float* dst = g->f32();
  for (int64_t i = 0; i < rows * in; ++i) dst[i] = std::nearbyint(std::min(std::max(src[i] / scale, lo), hi)) * scale;
  std::vector<TensorPtr> keep = {view(*g, break_input ? std::vector<int64_t>{rows, in - 1} : std::vector<int64_t>{})};
  std::vector<EValue> args = {EValue(keep.back())};
  auto outs = execute(std::move(args));
  std::vector<int64_t> lead(x.shape.begin(), x.shape.end() - 1);
  const size_t others = sub_.outputs.size() - sub_.linears.size();
  if (outs.size() < others) throw RunError("method " + sub_.method + " returned too few outputs");
  auto linears = merge(outs, others, lead, rows);
  std::vector<ValuePtr> result;
  size_t o = 0;
  for (const auto& name : sub_.outputs) {
    auto at = std::find(sub_.linear_outputs.begin(), sub_.linear_outputs.end(), name);
    if (at != sub_.linear_outputs.end()) {
      result.push_back(linears[static_cast<size_t>(at - sub_.linear_outputs.begin())]);
      continue;
    }
    auto& v = outs[o++];
    auto shape = lead;
    shape.push_back(v->shape.back());
    v->shape = shape;
    result.push_back(v);
  }
  return result;
}

std::vector<ValuePtr> MethodCall::attention_region(const std::vector<ValuePtr>& inputs, bool break_input) const {
  const auto& a = sub_.attention;
  auto input = [&](const std::string& name) {
    return static_cast<size_t>(std::find(sub_.inputs.begin(), sub_.inputs.end(), name) - sub_.inputs.begin());
  };
  const size_t ik = input(a.past[0]), iv = input(a.past[1]), im = input(a.mask);
  const Value& past_k = *inputs.at(ik);
  const Value& mask = *inputs.at(im);
  if (past_k.shape.size() != 4 || mask.shape.size() < 2 || mask.dtype != ScalarType::Bool)
    throw RunError("attention region " + sub_.method + ": its past K or mask has an unexpected shape or type");
  const int64_t kvh = past_k.shape[1], p = past_k.shape[2], d = past_k.shape[3];
  const int64_t c = mask.shape[mask.shape.size() - 2], w = a.window;
  if (mask.numel() != c * (p + c) || a.heads % kvh)
    throw RunError("attention region " + sub_.method + ": its mask does not cover the past and the chunk");
  if (p + c > w)
    throw InputError("a past of " + std::to_string(p) + " tokens and a chunk of " + std::to_string(c) +
                     " pass the program's attention window of " + std::to_string(w) + ": prompt with fewer tokens");
  // As format/npu_io.py window_inputs: the past padded with zeros to w - c rows; the mask additive
  // over the window (0 where a query may look, mask_value elsewhere: every empty slot too), repeated
  // for the query heads of each K/V head
  std::vector<std::shared_ptr<Value>> made;
  std::vector<TensorPtr> keep;
  std::vector<EValue> args;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value* v = inputs[i].get();
    if (i == ik || i == iv) {
      auto pad = Value::make(ScalarType::Float, {1, kvh, w - c, d});
      for (int64_t h = 0; h < kvh; ++h)
        std::memcpy(pad->f32() + h * (w - c) * d, v->f32() + h * p * d, static_cast<size_t>(p * d) * sizeof(float));
      v = pad.get();
      made.push_back(std::move(pad));
    } else if (i == im) {
      const int64_t g = a.heads / kvh;
      auto add = Value::make(ScalarType::Float, {1, g * c, w});
      const float hidden = static_cast<float>(a.mask_value);
      const auto* allowed = reinterpret_cast<const bool*>(mask.bytes.data());
      for (int64_t r = 0; r < c; ++r)
        for (int64_t col = 0; col < w; ++col) {
          const bool seen = col < p ? allowed[r * (p + c) + col]
                                    : col >= w - c && allowed[r * (p + c) + p + col - (w - c)];
          for (int64_t j = 0; j < g; ++j) add->f32()[(j * c + r) * w + col] = seen ? 0.0f : hidden;
        }
      v = add.get();
      made.push_back(std::move(add));
    }
    auto shape = v->shape;
    if (break_input && i == 0) shape.push_back(1);
    keep.push_back(view(*v, shape));
    args.emplace_back(keep.back());
  }
  auto outs = execute(std::move(args));
  size_t others = 0;
  for (const auto& name : sub_.outputs)
    if (name != a.present[0] && name != a.present[1] &&
        std::find(sub_.linear_outputs.begin(), sub_.linear_outputs.end(), name) == sub_.linear_outputs.end())
      ++others;
  if (outs.size() < 2 + others) throw RunError("method " + sub_.method + " returned too few outputs");
  auto linears = sub_.linears.empty() ? std::vector<ValuePtr>{} : merge(outs, 2 + others, {1, c}, c);
  std::vector<ValuePtr> result;
  size_t o = 2;
  for (const auto& name : sub_.outputs) {
    auto at = std::find(sub_.linear_outputs.begin(), sub_.linear_outputs.end(), name);
    if (at != sub_.linear_outputs.end()) {
      result.push_back(linears[static_cast<size_t>(at - sub_.linear_outputs.begin())]);
    } else if (name == a.present[0] || name == a.present[1]) {
      // the past, then the chunk's new rows: cat along the positions, head by head
      const int k = name == a.present[0] ? 0 : 1;
      const Value& past = *inputs[k == 0 ? ik : iv];
      const Value& next = *outs[static_cast<size_t>(k)];
      if (next.numel() != kvh * c * d) throw RunError("method " + sub_.method + " returned a new K/V of another shape");
      auto cat = Value::make(ScalarType::Float, {1, kvh, p + c, d});
      for (int64_t h = 0; h < kvh; ++h) {
        std::memcpy(cat->f32() + h * (p + c) * d, past.f32() + h * p * d, static_cast<size_t>(p * d) * sizeof(float));
        std::memcpy(cat->f32() + (h * (p + c) + p) * d, next.f32() + h * c * d, static_cast<size_t>(c * d) * sizeof(float));
      }
      result.push_back(std::move(cat));
    } else {
      result.push_back(outs[o++]);
    }
  }
  return result;
}

std::vector<ValuePtr> MethodCall::merge(std::vector<std::shared_ptr<Value>>& all, size_t first,
                                        const std::vector<int64_t>& lead, int64_t rows) const {
  std::vector<std::shared_ptr<Value>> outs(all.begin() + static_cast<std::ptrdiff_t>(first), all.end());
  const size_t n = sub_.linears.size();
  // outputs: each linear's main one, its split groups (linear by linear), the fine encodings, then
  // the peak products
  size_t coarse = n, fine = 0, peaks = 0;
  for (const auto& name : sub_.linears) {
    coarse += s_.linears.at(name).split_channels.size();
    fine += s_.linears.at(name).fine_outputs.size();
    peaks += s_.linears.at(name).peak ? 1 : 0;
  }
  if (outs.size() != coarse + fine + peaks)
    throw RunError("method " + sub_.method + " returned " + std::to_string(outs.size()) + " outputs, the sidecar names " +
                   std::to_string(coarse + fine + peaks));
  for (size_t i = 0, before = n, t = coarse; i < n; ++i) {
    const auto& lin = s_.linears.at(sub_.linears[i]);
    for (const auto& f : lin.fine_outputs) {
      const Value& v = *outs[t++];
      Value& c = *outs[f.part == 0 ? i : before + static_cast<size_t>(f.part) - 1];
      if (v.numel() != c.numel()) throw RunError("method " + sub_.method + " returned mismatched fine outputs");
      // half a step inside the ends: a fine value at either end may have saturated (as in Python)
      const float lo = static_cast<float>(f.low + 0.5 * f.scale), hi = static_cast<float>(f.high - 0.5 * f.scale);
      const float* src = v.f32();
      float* dst = c.f32();
      for (int64_t j = 0; j < v.numel(); ++j)
        if (src[j] > lo && src[j] < hi) dst[j] = src[j];
    }
    before += lin.split_channels.size();
  }
  std::vector<ValuePtr> merged;
  size_t k = n, peak = coarse + fine;
  for (size_t i = 0; i < n; ++i) {
    const auto& splits = s_.linears.at(sub_.linears[i]).split_channels;
    std::shared_ptr<Value> y;
    if (splits.empty()) {
      y = outs[i];
    } else {
      // columns of cat(main, split groups...) are channels keep + split, in that order
      std::vector<const Value*> parts = {outs[i].get()};
      std::vector<int64_t> split;
      for (const auto& group : splits) {
        if (k >= outs.size()) throw RunError("method " + sub_.method + " returned too few outputs");
        parts.push_back(outs[k++].get());
        split.insert(split.end(), group.begin(), group.end());
      }
      int64_t width = 0;
      for (const auto* p : parts) width += p->shape.back();
      std::vector<char> is_split(static_cast<size_t>(width), 0);
      for (auto c : split) is_split.at(static_cast<size_t>(c)) = 1;
      std::vector<int64_t> channel;
      for (int64_t c = 0; c < width; ++c)
        if (!is_split[c]) channel.push_back(c);
      channel.insert(channel.end(), split.begin(), split.end());
      y = Value::make(ScalarType::Float, {rows, width});
      int64_t col = 0;
      for (const auto* p : parts) {
        const int64_t w = p->shape.back();
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < w; ++j) y->f32()[r * width + channel[col + j]] = p->f32()[r * w + j];
        col += w;
      }
    }
    if (s_.linears.at(sub_.linears[i]).peak) {
      // its peak product added (one float add, as RegionSpec.merge)
      const Value& d = *outs[peak++];
      if (d.numel() != y->numel()) throw RunError("method " + sub_.method + " returned a mismatched peak product");
      float* dst = y->f32();
      const float* src = d.f32();
      for (int64_t j = 0; j < y->numel(); ++j) dst[j] += src[j];
    }
    auto shape = lead;
    shape.push_back(y->shape.back());
    y->shape = shape;
    merged.push_back(std::move(y));
  }
  return merged;
}

std::vector<ValuePtr> MethodCall::cpu(const std::vector<ValuePtr>& inputs, bool break_input) const {
  std::vector<TensorPtr> keep;
  std::vector<EValue> args;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto shape = inputs[i]->shape;
    if (break_input && i == 0) shape.push_back(1);
    keep.push_back(view(*inputs[i], shape));
    args.emplace_back(keep.back());
  }
  auto outs = execute(std::move(args));
  const size_t n = sub_.outputs.size();
  if (outs.size() < n) throw RunError("method " + sub_.method + " returned too few outputs");
  for (const auto& b : sub_.shadow) {
    if (!b.hits) continue;
    if (static_cast<size_t>(*b.hits) >= outs.size() || static_cast<size_t>(b.input) >= inputs.size() ||
        static_cast<size_t>(b.output) >= n)
      throw RunError("method " + sub_.method + ": shadow branch indices out of range");
    cold_.add_product(b.linear, *inputs[b.input], *outs[*b.hits], *outs[b.output]);
  }
  return std::vector<ValuePtr>(outs.begin(), outs.begin() + n);
}

std::vector<ValuePtr> MethodCall::operator()(const std::vector<ValuePtr>& inputs, bool break_input) const {
  if (sub_.norm_region) return norm_region(inputs, break_input);
  if (sub_.attention_region) return attention_region(inputs, break_input);
  return sub_.kind == "npu" && !sub_.graph ? npu(inputs, break_input) : cpu(inputs, break_input);
}

// ---------------------------------------------------------------- loading

// XNNPACK's weights cache packs a weight once for every Module that runs it with the same kernel.
// Its backend holds one process-wide mutex through every execute of a method loaded with the cache,
// so the two prefill lanes must not both run such methods all the time (they would take turns: the
// prefill ran 16 % slower); decode never runs beside either. So:
// - decode always loads with the cache;
// - float NPU outputs (the program's NPU linears are XNNPACK's dynamic INT8 ones, decode's kind, on
//   the same bytes: lower/npu_subgraphs.py FloatOutputRegion): the NPU lane's methods too, so every
//   decoder linear is packed once; of the CPU lane's, only the method that holds the INT8 LM head
//   (decode's too), which runs once per prompt, at its end;
// - 8-bit NPU outputs (static INT8 kernels, packed another way than decode's): the CPU lane's
//   methods, for the LM head, the one weight they share with decode.
static bool cached_weights(const Sidecar& s, const Subgraph& sub) {
  if (!s.float_outputs()) return sub.processor == "cpu";
  if (sub.processor == "npu") return true;
  const auto& outs = sub.outputs;   // the LM head's method gives the graph's first output, the logits
  return !s.graph_outputs.empty() && std::find(outs.begin(), outs.end(), s.graph_outputs.front()) != outs.end();
}

static void weights_cache(bool on) {
  executorch::runtime::BackendOptions<1> xnn;
  xnn.set_option("weight_cache_enabled", on);
  (void)executorch::runtime::set_option("XnnpackBackend", xnn.view());   // NotFound: no XNNPACK, fine
}

LoadedProgram::LoadedProgram(const std::string& pte, const Sidecar& s) : pte_(pte), s_(s) {
  // One XNNPACK workspace per program, i.e. per worker's Module: one workspace for all (the wheel's
  // default) would make the two workers take turns; one per delegate call re-grows (and page-faults)
  // every attention method's scratch memory at each longer past: 2.5x slower attention, measured.
  executorch::runtime::BackendOptions<1> xnn;
  xnn.set_option("workspace_sharing_mode", 1);
  (void)executorch::runtime::set_option("XnnpackBackend", xnn.view());   // NotFound: no XNNPACK, fine

  auto slash = pte.find_last_of('/');
  cold = std::make_unique<ColdRows>(s, slash == std::string::npos ? "." : pte.substr(0, slash), pte);
  // One planned arena per prefill worker: the methods of its Module share one activation buffer,
  // sized to the largest of *its* methods (ExecuTorch's own sharing sizes it to the largest method of
  // the whole program: the attention's 22 MiB for the NPU lane's linears too), instead of one buffer
  // per method. Safe because under every policy the schedule gives each processor one worker that
  // runs one task at a time (the out-of-order policies reorder a lane's tasks, never overlap them),
  // and every output is copied out of the arena (MethodCall::execute) before its Module runs again.
  // Decode has a Module of its own, so its step keeps an arena of its own beside the CPU worker's
  // (sharing that one slowed the step).
  for (auto& m : modules) m = std::make_unique<Module>(pte, Module::LoadMode::Mmap);
  load_prefill();
  load_decode();
  platform::advise_random_reads(pte);   // the table's rows are read a few at a time (platform.h)
  for (const auto& sub : s.subgraphs)
    calls.emplace_back(s, sub, *modules[module_of(sub)], *cold,
                       module_of(sub) == kNpuModule ? npu_on_call.get() : nullptr);
}

int LoadedProgram::module_of(const Subgraph& sub) {
  return sub.processor == "npu" ? kNpuModule : kCpuModule;
}

void LoadedProgram::Arena::fit(const executorch::runtime::MethodMeta& meta) {
  if (buffers.size() < meta.num_memory_planned_buffers()) buffers.resize(meta.num_memory_planned_buffers());
  for (size_t i = 0; i < meta.num_memory_planned_buffers(); ++i) {
    auto size = meta.memory_planned_buffer_size(i);
    if (size.ok() && static_cast<size_t>(*size) > buffers[i].size()) buffers[i].resize(static_cast<size_t>(*size));
  }
}

executorch::runtime::HierarchicalAllocator* LoadedProgram::Arena::allocator() {
  if (!planned) {
    for (auto& b : buffers) spans.emplace_back(b.data(), b.size());
    planned = std::make_unique<executorch::runtime::HierarchicalAllocator>(
        executorch::runtime::Span<executorch::runtime::Span<uint8_t>>(spans.data(), spans.size()));
  }
  return planned.get();
}

void LoadedProgram::load_prefill() {
  for (const auto& sub : s_.subgraphs) {
    const int lane = module_of(sub);
    auto meta = modules[lane]->method_meta(sub.method);
    if (!meta.ok())
      throw InputError("the program " + pte_ + " has no method " + sub.method + ": is it a program from llmnpu export?");
    arenas_[lane].fit(*meta);
  }
  // The prefill methods run one per worker thread, single-threaded each: XNNPACK takes its thread
  // pool when a method loads, so they load with the pool disabled.
  executorch::extension::threadpool::NoThreadPoolGuard single;
  for (const auto& sub : s_.subgraphs) {
    const int lane = module_of(sub);
    auto& module = *modules[lane];
    if (module.is_method_loaded(sub.method)) continue;   // identical subgraphs share one method
    if (lane == kNpuModule && npu_on_call) continue;
    weights_cache(cached_weights(s_, sub));
    auto err = lane == kNpuModule && s_.target == "qnn" && over_test_room(sub)
                   ? executorch::runtime::Error::MemoryAllocationFailed
                   : module.load_method(sub.method, arenas_[lane].allocator());
    if (err == executorch::runtime::Error::Ok) continue;
    if (lane != kNpuModule || s_.target != "qnn")
      throw InputError("cannot load method " + sub.method + " of " + pte_ + " (" + error_text(err) +
                       "; the delegate's log above says why)");
    // The HTP's memory does not hold every context at once (a chunk-1,024 program on the HTP
    // simulator): the NPU methods load when called, a block at a time. The contexts loaded so far go
    // with the Module; each block must load alone, here, not inside a prompt.
    std::fprintf(stderr, "llmnpu-runner: the NPU's memory does not hold all of %s's contexts at once (%s did not "
                 "load beside the others): its NPU methods load when called, which is slower\n",
                 pte_.c_str(), sub.method.c_str());
    modules[kNpuModule] = std::make_unique<Module>(pte_, Module::LoadMode::Mmap);
    npu_on_call = std::make_unique<BlocksOnCall>(pte_);
    npu_per_call = true;
    for (const auto& npu : s_.subgraphs)
      if (module_of(npu) == kNpuModule) npu_on_call->module_for(npu);
    npu_on_call->release();
  }
}

// A test's stand-in for a small HTP (LLMNPU_RUNNER_TEST_NPU_BLOCKS=n): the NPU methods of the first n
// blocks load, the next one fails as the simulator's does when its memory is full. Never set otherwise.
bool LoadedProgram::over_test_room(const Subgraph& sub) const {
  const char* room = std::getenv("LLMNPU_RUNNER_TEST_NPU_BLOCKS");
  if (!room || !*room || npu_on_call) return false;
  int blocks = 0;
  std::optional<int> last;
  for (const auto& other : s_.subgraphs) {
    if (module_of(other) != kNpuModule) continue;
    if (!blocks || other.layer != last) ++blocks, last = other.layer;
    if (&other == &sub) return blocks > std::atoi(room);
  }
  return false;
}

void LoadedProgram::release_prefill() {
  calls.clear();   // they refer to the Modules
  npu_on_call.reset();
  modules[kNpuModule].reset();
  modules[kCpuModule].reset();
  for (auto& arena : arenas_) arena = Arena{};
}

void LoadedProgram::load_decode() {
  weights_cache(true);                                                  // decode: both cores, cache on
  auto err = modules[kDecodeModule]->load_method(s_.decode_method);
  if (err != executorch::runtime::Error::Ok)
    throw InputError("cannot load method " + s_.decode_method + " of " + pte_ + " (" + error_text(err) + ")");
}

}  // namespace llmnpu
