#include "sidecar.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <set>

#include <fstream>
#include <sstream>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "digest.h"
#include "error.h"

namespace llmnpu {
namespace {

using nlohmann::json;

std::string sidecar_path(const std::string& pte) {
  auto slash = pte.find_last_of('/');
  auto dot = pte.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return pte + ".json";
  return pte.substr(0, dot) + ".json";
}

int64_t file_size(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) ? static_cast<int64_t>(st.st_size) : -1;
}

Subgraph read_subgraph(const json& e) {
  Subgraph s;
  s.index = e.at("index").get<int>();
  s.method = e.at("method").get<std::string>();
  s.kind = e.at("kind").get<std::string>();
  s.processor = e.at("processor").get<std::string>();
  if (!e.at("layer").is_null()) s.layer = e.at("layer").get<int>();
  s.is_static = e.at("static").get<bool>();
  s.inputs = e.at("inputs").get<std::vector<std::string>>();
  s.outputs = e.at("outputs").get<std::vector<std::string>>();
  s.linears = e.at("linears").get<std::vector<std::string>>();
  if (e.contains("input_groups")) s.input_groups = e["input_groups"].get<std::vector<std::vector<int>>>();
  if (e.contains("form")) {
    if ((e["form"] != "graph" && e["form"] != "norm-region" && e["form"] != "attention-region") || s.kind != "npu")
      throw InputError("subgraph " + s.method + " has an unknown form " + e["form"].dump() + ": export again");
    s.graph = e["form"] == "graph";
    s.norm_region = e["form"] == "norm-region";
    s.attention_region = e["form"] == "attention-region";
  }
  auto has = [](const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  if (s.attention_region) {
    const auto& a = e.at("attention");
    auto& at = s.attention;
    for (int i = 0; i < 2; ++i) {
      at.past[i] = a.at("past").at(i).get<std::string>();
      at.present[i] = a.at("present").at(i).get<std::string>();
    }
    at.mask = a.at("mask").get<std::string>();
    at.window = a.at("window").get<int64_t>();
    at.heads = a.at("heads").get<int64_t>();
    at.mask_value = a.at("mask_value").get<double>();
    s.linear_outputs = e.at("linear_outputs").get<std::vector<std::string>>();
    bool named = has(s.inputs, at.past[0]) && has(s.inputs, at.past[1]) && has(s.inputs, at.mask) &&
                 has(s.outputs, at.present[0]) && has(s.outputs, at.present[1]);
    for (const auto& name : s.linear_outputs) named = named && has(s.outputs, name);
    if (!named || s.linear_outputs.size() != s.linears.size() || at.window < 1 || at.heads < 1)
      throw InputError("attention region " + s.method + " names inputs or outputs it does not have, or a bad window: "
                       "export again");
  }
  if (s.norm_region) {
    const auto& enc = e.at("norm").at("x");
    s.norm_input.scale = enc.at("scale").get<double>();
    s.norm_input.zero = enc.at("zero").get<int>();
    s.norm_input.bits = enc.at("bits").get<int>();
    s.linear_outputs = e.at("linear_outputs").get<std::vector<std::string>>();
    if (s.linear_outputs.size() != s.linears.size() || s.inputs.size() != 1 || s.norm_input.bits < 2 ||
        s.norm_input.bits > 16 || !(s.norm_input.scale > 0))
      throw InputError("norm region " + s.method + " has a bad input encoding or linear outputs: export again");
    for (const auto& name : s.linear_outputs)
      if (std::find(s.outputs.begin(), s.outputs.end(), name) == s.outputs.end())
        throw InputError("norm region " + s.method + " names an output it does not have: export again");
  }
  if (e.contains("shadow")) {
    for (const auto& b : e["shadow"]) {
      ShadowBranch br;
      br.linear = b.at("linear").get<std::string>();
      br.input = b.at("input").get<int>();
      br.output = b.at("output").get<int>();
      if (!b.at("hits").is_null()) br.hits = b.at("hits").get<int>();
      s.shadow.push_back(br);
    }
  }
  if (s.processor != "npu" && s.processor != "cpu")
    throw InputError("subgraph " + s.method + " has an unknown processor '" + s.processor + "'");
  return s;
}

// The profile maps step numbers (JSON object keys) to seconds.
const json& object_at(const json& parent, const char* key, const std::string& path) {
  const json& v = parent.at(key);
  if (!v.is_object())
    throw InputError("sidecar " + path + " has a profile." + key + " that is not a table of steps: export the program again");
  return v;
}

int step_key(const std::string& k, const std::string& path) {
  bool digits = !k.empty() && k.size() < 9 && k.find_first_not_of("0123456789") == std::string::npos;
  if (!digits) throw InputError("sidecar " + path + " has a profile entry for step '" + k + "', not a step number: export the program again");
  return std::stoi(k);
}

void check_tasks(const Sidecar& s) {
  const size_t n = s.subgraphs.size();
  const auto& t = s.tasks;
  if (t.after.size() != n || t.after_previous.size() != n || t.processors.size() != n)
    throw InputError("the sidecar's task table does not match its subgraphs: export the program again");
  auto in_range = [n](int j) { return j >= 0 && static_cast<size_t>(j) < n; };
  for (size_t j = 0; j < n; ++j) {
    for (int d : t.after[j])
      if (!in_range(d) || static_cast<size_t>(d) >= j)
        throw InputError("the sidecar's task table has a bad dependency: export the program again");
    for (int d : t.after_previous[j])
      if (!in_range(d)) throw InputError("the sidecar's task table has a bad dependency: export the program again");
  }
  for (const auto* list : {&t.needed_kv, &t.needed_final})
    for (int j : *list)
      if (!in_range(j)) throw InputError("the sidecar's task table names an unknown step: export the program again");
}

// The task table must be the data flow of the subgraphs (format/tasks.py data_flow; format/sidecar.py
// _dependency_problem, whose messages these are): a missing dependency would let a task read a value
// not yet made (a race), a step left out of the needed sets one that never is (a stall). Empty if so.
std::string dependency_problem(const Sidecar& s) {
  const auto& outs = s.graph_outputs;
  const size_t layers = static_cast<size_t>(s.layers);
  std::map<std::string, int> producer;
  TaskTable flow;
  for (size_t j = 0; j < s.subgraphs.size(); ++j) {
    std::set<int> deps;
    for (const auto& name : s.subgraphs[j].inputs)
      if (auto it = producer.find(name); it != producer.end()) deps.insert(it->second);
    flow.after.emplace_back(deps.begin(), deps.end());
    for (const auto& name : s.subgraphs[j].outputs) producer[name] = static_cast<int>(j);
  }
  if (outs.size() != 1 + 2 * layers ||
      std::any_of(outs.begin(), outs.end(), [&](const std::string& x) { return !producer.count(x); }))
    return "graph.outputs are not the logits, K and V of every layer made by the subgraphs";
  std::map<std::string, int> past;
  for (size_t i = 0; i < layers; ++i) {
    past[past_name("k", static_cast<int64_t>(i))] = producer[outs[1 + i]];
    past[past_name("v", static_cast<int64_t>(i))] = producer[outs[1 + layers + i]];
  }
  for (const auto& sub : s.subgraphs) {
    std::set<int> deps;
    for (const auto& name : sub.inputs)
      if (auto it = past.find(name); it != past.end()) deps.insert(it->second);
    flow.after_previous.emplace_back(deps.begin(), deps.end());
  }
  const auto& t = s.tasks;
  if (t.after != flow.after || t.after_previous != flow.after_previous) return "tasks are not the data flow of the subgraphs";
  for (size_t j = 0; j < s.subgraphs.size(); ++j)
    if (t.processors[j] != s.subgraphs[j].processor) return "tasks.processors are not the subgraphs' processors";
  const std::set<int> kv(t.needed_kv.begin(), t.needed_kv.end()), final(t.needed_final.begin(), t.needed_final.end());
  for (const auto& [needed, name] : {std::pair{&kv, "needed_kv"}, std::pair{&final, "needed_final"}})
    for (int j : *needed) {
      for (int d : t.after[j])
        if (!needed->count(d)) return std::string("tasks.") + name + " leaves out a step that a needed step waits for";
      for (int d : t.after_previous[j])
        if (!kv.count(d)) return std::string("tasks.") + name + " leaves out a step that a needed step waits for";
    }
  for (size_t i = 1; i < outs.size(); ++i)
    if (!kv.count(producer[outs[i]])) return "the needed steps do not make the K/V and logits";
  if (!final.count(producer[outs[0]])) return "the needed steps do not make the K/V and logits";
  return "";
}

// A float as Python's repr writes it (and so json.dumps): the shortest digits that read back as the
// same double, ties to even (std::to_chars), in fixed notation for 1e-4 <= |x| < 1e16 ("0.0001",
// "2.0", "1000000000000000.0"), else as "1e-05" / "1.5e+16".
void put_float(double x, std::string& out) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);                      // [-]d[.ddd]e(+|-)XX
  if (sci[0] == '-') {
    out += '-';
    sci.erase(0, 1);
  }
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp10 = std::stoi(sci.substr(e + 1));
  const int n = static_cast<int>(digits.size()), point = exp10 + 1;   // digits d1 d2 ... x 10^(point - n)
  if (point <= -4 || point > 16) {
    out += digits[0];
    if (n > 1) out += "." + digits.substr(1);
    char ex[16];
    std::snprintf(ex, sizeof ex, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += ex;
  } else if (point <= 0) {
    out += "0." + std::string(-point, '0') + digits;
  } else if (point < n) {
    out += digits.substr(0, point) + "." + digits.substr(point);
  } else {
    out += digits + std::string(point - n, '0') + ".0";
  }
}

// The sidecar as format/sidecar.py sidecar_digest serialises it: json.dumps(sort_keys=True,
// separators=(",", ":")), non-ASCII escaped. nlohmann's objects keep their keys sorted and its strings,
// integers and literals print as Python's do; its floats do not always (another shortest-digits
// algorithm), so they are written here.
void canonical(const json& v, std::string& out) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [k, x] : v.items()) {
      if (!first) out += ',';
      first = false;
      out += json(k).dump(-1, ' ', true) + ':';
      canonical(x, out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) out += ',';
      canonical(v[i], out);
    }
    out += ']';
  } else if (v.is_number_float()) {
    put_float(v.get<double>(), out);
  } else {
    out += v.dump(-1, ' ', true);
  }
}

// sidecar_sha256: the SHA-256 of the sidecar's canonical form without it.
bool checksum_holds(const json& m) {
  if (!m.contains("sidecar_sha256") || !m["sidecar_sha256"].is_string()) return false;
  json body = m;
  body.erase("sidecar_sha256");
  std::string text;
  canonical(body, text);
  return sha256_hex(text) == m["sidecar_sha256"].get<std::string>();
}

}  // namespace

Sidecar read_sidecar(const std::string& pte, bool verify_pte) {
  if (file_size(pte) < 0) throw InputError("no such .pte file: " + pte);
  Sidecar s;
  s.path = sidecar_path(pte);
  std::ifstream in(s.path);
  if (!in)
    throw InputError(pte + " has no sidecar " + s.path + " beside it: export writes both; copy them together");
  json m;
  try {
    m = json::parse(in);
  } catch (const json::parse_error& e) {   // where, not what: its text quotes the damaged bytes
    throw InputError("sidecar " + s.path + " is not valid JSON (at byte " + std::to_string(e.byte) +
                     "): export the program again");
  } catch (const json::exception&) {
    throw InputError("sidecar " + s.path + " is not valid JSON: export the program again");
  }
  if (!m.is_object() || !m.contains("format") || !m["format"].is_string() ||
      m["format"].get<std::string>() != "llmnpu-pte-sidecar")
    throw InputError(s.path + " is not an llmnpu sidecar: export the program again (llmnpu export)");
  if (!m.contains("version") || !m["version"].is_number_integer() || m["version"].get<int>() != kSidecarVersion)
    throw InputError(s.path + " was written by another version of llmnpu export (format " +
                     (m.contains("version") ? m["version"].dump() : std::string("none")) + ", this runner reads " +
                     std::to_string(kSidecarVersion) + "): export the program again with this version");
  try {
    s.target = m.at("target").get<std::string>();
    s.chunk_len = m.at("chunk_len").get<int64_t>();
    s.context = m.at("context").get<int64_t>();
    const auto& model = m.at("model");
    s.layers = model.at("layers").get<int64_t>();
    s.kv_heads = model.at("kv_heads").get<int64_t>();
    s.head_dim = model.at("head_dim").get<int64_t>();
    s.vocab = model.at("vocab_size").get<int64_t>();
    s.graph_inputs = m.at("graph").at("inputs").get<std::vector<std::string>>();
    s.graph_outputs = m.at("graph").at("outputs").get<std::vector<std::string>>();
    for (const auto& e : m.at("subgraphs")) s.subgraphs.push_back(read_subgraph(e));
    const auto& t = m.at("tasks");
    s.tasks.after = t.at("after").get<std::vector<std::vector<int>>>();
    s.tasks.after_previous = t.at("after_previous").get<std::vector<std::vector<int>>>();
    s.tasks.needed_kv = t.at("needed_kv").get<std::vector<int>>();
    s.tasks.needed_final = t.at("needed_final").get<std::vector<int>>();
    s.tasks.processors = t.at("processors").get<std::vector<std::string>>();
    for (const auto& [name, lin] : m.at("linears").items()) {
      NpuLinear l;
      l.act_scale = lin.at("act_scale").get<double>();
      l.output_bits = lin.at("output").at("bits").get<int>();
      if (l.output_bits != 8 && l.output_bits != 16 && l.output_bits != 32)
        throw InputError("sidecar " + s.path + " gives " + name + " " + std::to_string(l.output_bits) +
                         "-bit outputs: export again with this version");
      l.split_channels = lin.at("split_channels").get<std::vector<std::vector<int>>>();
      for (const auto& f : lin.at("fine_outputs")) {
        FineOutput o;
        o.part = f.at("part").get<int>();
        o.scale = f.at("scale").get<double>();
        const auto range = f.at("range").get<std::vector<double>>();
        if (o.part < 0 || static_cast<size_t>(o.part) > l.split_channels.size() || !(o.scale > 0) ||
            range.size() != 2 || !(range[0] < range[1]))
          throw InputError("sidecar " + s.path + " gives " + name + " a bad second output encoding: export again");
        o.low = range[0];
        o.high = range[1];
        l.fine_outputs.push_back(o);
      }
      l.peak = lin.contains("peak");
      s.linears[name] = l;
    }
    const auto& sh = m.at("shadow");
    s.shadow_form = sh.at("form").get<std::string>();
    if (s.shadow_form == "sparse") {
      if (sh.contains("rows_file")) {   // absent when the program holds every linear's rows
        s.rows_file = sh.at("rows_file").get<std::string>();
        s.rows_bytes = sh.at("bytes").get<int64_t>();
      }
      const std::string dtype = sh.at("rows_dtype").get<std::string>();
      if (dtype != "float32" && dtype != "float16" && dtype != "int8")
        throw InputError("sidecar " + s.path + " has cold rows of type " + dtype + ": export again");
      s.rows_itemsize = dtype == "int8" ? 1 : dtype == "float16" ? 2 : 4;
      for (const auto& [name, lin] : sh.at("linears").items()) {
        ColdLinear c;
        c.cold_channels = lin.at("cold_channels").get<std::vector<int64_t>>();
        c.rows_offset = lin.at("rows_offset").get<int64_t>();
        c.in_features = lin.at("in_features").get<int64_t>();
        c.out_features = lin.at("out_features").get<int64_t>();
        c.clip = lin.at("clip").get<double>();
        if (s.rows_itemsize == 1) c.scales_offset = lin.at("scales_offset").get<int64_t>();
        if (lin.contains("rows_in")) {
          const std::string where = lin.at("rows_in").get<std::string>();
          if (where != "program" || s.rows_itemsize != 1)
            throw InputError("sidecar " + s.path + " reads the cold rows of " + name + " from " + where +
                             ": export again with this version");
          c.in_program = true;
        } else if (s.rows_file.empty()) {
          throw InputError("sidecar " + s.path + " names no rows file for " + name + ": export the program again");
        }
        s.cold[name] = c;
      }
    }
    if (!m.at("profile").is_null()) {
      s.has_profile = true;
      const auto& st = object_at(m["profile"], "static", s.path);
      const auto& dy = object_at(m["profile"], "dynamic", s.path);
      for (const auto& [k, v] : st.items()) s.profile_static[step_key(k, s.path)] = v.get<double>();
      for (const auto& [k, v] : dy.items()) s.profile_dynamic[step_key(k, s.path)] = v.get<std::vector<double>>();
    }
    s.decode_method = m.at("decode").at("method").get<std::string>();
    if (!m.at("tokenizer").is_null()) s.eos_ids = m["tokenizer"].at("eos_ids").get<std::vector<int64_t>>();
    s.pte_bytes = m.value("pte_bytes", int64_t{-1});
  } catch (const json::exception& e) {
    throw InputError("sidecar " + s.path + " lacks or garbles an entry (" + e.what() + "): export the program again");
  }
  if (s.chunk_len <= 0 || s.context < s.chunk_len || s.layers <= 0 || static_cast<int64_t>(s.graph_outputs.size()) != 1 + 2 * s.layers)
    throw InputError("sidecar " + s.path + " describes an impossible program: export the program again");
  check_tasks(s);
  if (const std::string problem = dependency_problem(s); !problem.empty())
    throw InputError("sidecar " + s.path + " is malformed (" + problem + "): export the program again");
  for (const auto& sub : s.subgraphs)
    for (const auto& b : sub.shadow)
      if (b.hits && !s.cold.count(b.linear))
        throw InputError("sidecar " + s.path + " has no cold rows entry for " + b.linear + ": export again");
  if (!checksum_holds(m))
    throw InputError("sidecar " + s.path + " was altered or damaged since export (its checksum fails): export the "
                     "program again");
  if (s.pte_bytes >= 0 && file_size(pte) != s.pte_bytes)
    throw InputError(s.path + " was written for another " + pte + " (its size differs): the .pte and sidecar do not match");
  if (verify_pte && m.value("pte_sha256", std::string()) != file_sha256_hex(pte))
    throw InputError(s.path + " was written for another " + pte + " (its SHA-256 differs): the .pte and sidecar do not match");
  return s;
}

double profile_cost(const Sidecar& s, int step, double position) {
  auto st = s.profile_static.find(step);
  if (st != s.profile_static.end()) return st->second;
  auto dy = s.profile_dynamic.find(step);
  if (dy == s.profile_dynamic.end() || dy->second.empty()) return 0.0;
  const auto& times = dy->second;
  const double last = static_cast<double>(times.size() - 1);
  if (position <= last) {
    const size_t low = static_cast<size_t>(position);
    const size_t high = std::min(low + 1, times.size() - 1);
    return times[low] + (times[high] - times[low]) * (position - static_cast<double>(low));
  }
  // attention reads (position + 1) chunks of keys
  return times.back() * (position + 1) / static_cast<double>(times.size());
}

}  // namespace llmnpu
