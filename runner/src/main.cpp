// llmnpu-runner: generation from an exported program (.pte, its sidecar and cold rows file) without
// Python. Prefill in chunks on two worker threads (npu, cpu) under a scheduling policy, then decode
// with the program's decode method. Token ids in, token ids out (the tokenizer stays with the caller:
// `llmnpu run --pte F --native` drives this binary).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <sys/resource.h>

#include <nlohmann/json.hpp>

#include "decode.h"
#include "error.h"
#include "prefill.h"
#include "schedule.h"
#include "sidecar.h"
#include "trace.h"

using namespace llmnpu;

namespace {

const char* kUsage =
    "usage: llmnpu-runner --pte MODEL.pte (--prompt-ids FILE | --prompt-ids -) [--max-new-tokens N]\n"
    "                     [--temperature T] [--top-p P] [--seed S] [--policy inorder|overlap|ooo|cp]\n"
    "                     [--trace FILE] [--json] [--logits-out FILE] [--warmup] [--low-memory]\n"
    "       llmnpu-runner --pte MODEL.pte --dry-run --prompt-len N [--policy P]\n"
    "Prints the generated token ids, one per line; with --json a last line of timings.\n"
    "--warmup: one chunk of prefill and one decode step before the timed run (first-call set-up of\n"
    "every method, as a long-lived app has done before its first prompt).\n"
    "--low-memory: never hold the NPU methods and the decode step at once (one packing of each weight\n"
    "instead of two); decode then loads between the first token and the second.\n"
    "--dry-run: the policy's schedule on simulated time (each task takes its profiled cost), as JSON.\n";

struct Args {
  std::string pte, prompt_ids, trace, logits_out, policy = "ooo";
  long max_new_tokens = 32, prompt_len = 0;
  std::optional<double> temperature;
  double top_p = 1.0;
  std::optional<uint64_t> seed;
  bool json = false, dry_run = false, warmup = false, low_memory = false;
  std::optional<std::pair<int, int>> fail_at;
};

double number(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw InputError(flag + " needs a number, got '" + text + "'");
}

long integer(const std::string& flag, const std::string& text) {
  double v = number(flag, text);
  if (v != static_cast<long>(v)) throw InputError(flag + " needs an integer, got '" + text + "'");
  return static_cast<long>(v);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (flag == "--json") { a.json = true; continue; }
    if (flag == "--dry-run") { a.dry_run = true; continue; }
    if (flag == "--warmup") { a.warmup = true; continue; }
    if (flag == "--low-memory") { a.low_memory = true; continue; }
    if (i + 1 >= argc) throw InputError(flag + " needs a value (see --help)");
    std::string value = argv[++i];
    if (flag == "--pte") a.pte = value;
    else if (flag == "--prompt-ids") a.prompt_ids = value;
    else if (flag == "--max-new-tokens") a.max_new_tokens = integer(flag, value);
    else if (flag == "--temperature") a.temperature = number(flag, value);
    else if (flag == "--top-p") a.top_p = number(flag, value);
    else if (flag == "--seed") a.seed = static_cast<uint64_t>(integer(flag, value));
    else if (flag == "--policy") a.policy = value;
    else if (flag == "--trace") a.trace = value;
    else if (flag == "--logits-out") a.logits_out = value;
    else if (flag == "--prompt-len") a.prompt_len = integer(flag, value);
    else if (flag == "--fail-at") {   // CHUNK:SUBGRAPH gets a wrong-shaped input (tests)
      auto colon = value.find(':');
      if (colon == std::string::npos) throw InputError("--fail-at needs CHUNK:SUBGRAPH");
      a.fail_at = std::make_pair(static_cast<int>(integer(flag, value.substr(0, colon))),
                                 static_cast<int>(integer(flag, value.substr(colon + 1))));
    } else throw InputError("unknown option " + flag + " (see --help)");
  }
  if (a.pte.empty()) throw InputError("--pte is required (see --help)");
  if (a.temperature && !(*a.temperature > 0))
    throw InputError("temperature must be positive (omit it for greedy decoding)");
  if (!(a.top_p > 0 && a.top_p <= 1)) throw InputError("top-p must be in (0, 1]");
  if (a.max_new_tokens < 1) throw InputError("max new tokens must be at least 1");
  return a;
}

std::vector<int64_t> read_ids(const std::string& where) {
  std::ifstream file;
  std::istream* in = &std::cin;
  if (where != "-") {
    file.open(where);
    if (!file) throw InputError("cannot read prompt ids from " + where);
    in = &file;
  }
  std::vector<int64_t> ids;
  std::string word;
  while (*in >> word) {
    try {
      size_t used = 0;
      long long v = std::stoll(word, &used);
      if (used != word.size()) throw std::invalid_argument(word);
      ids.push_back(v);
    } catch (const std::exception&) {
      throw InputError("prompt ids must be integers separated by spaces, got '" + word + "'");
    }
  }
  return ids;
}

void check_prompt(const Sidecar& s, const std::vector<int64_t>& ids, long new_tokens) {
  if (ids.empty()) throw InputError("the prompt is empty: give at least one token id");
  for (auto id : ids)
    if (id < 0 || id >= s.vocab)
      throw InputError("token id " + std::to_string(id) + " is outside the vocabulary (0.." + std::to_string(s.vocab - 1) + ")");
  const long need = static_cast<long>(ids.size()) + new_tokens - 1;
  if (need > s.context)
    throw InputError("prompt of " + std::to_string(ids.size()) + " tokens + " + std::to_string(new_tokens) +
                     " new ones needs " + std::to_string(need) + " K/V slots, past the program's context of " +
                     std::to_string(s.context) + ": generate fewer tokens or export with a larger --context");
}

// The process's peak resident memory so far (getrusage reports KiB on Linux).
double peak_rss_mib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

nlohmann::json records_json(const std::vector<Record>& records) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : records)
    out.push_back({{"task", r.task}, {"chunk", r.chunk}, {"step", r.step},
                   {"processor", kProcessorNames[r.processor]}, {"start", r.start}, {"end", r.end}});
  return out;
}

int run(const Args& a) {
  using Clock = std::chrono::steady_clock;
  const Sidecar s = read_sidecar(a.pte);
  const Policy policy = parse_policy(a.policy);
  if (a.dry_run) {
    if (a.prompt_len < 1) throw InputError("--dry-run needs --prompt-len N (at least 1)");
    const int chunks = static_cast<int>((a.prompt_len + s.chunk_len - 1) / s.chunk_len);
    auto records = simulate(expand(s, chunks), policy);
    std::cout << nlohmann::json{{"policy", policy_name(policy)}, {"records", records_json(records)}}.dump() << "\n";
    return 0;
  }
  if (a.prompt_ids.empty()) throw InputError("give the prompt with --prompt-ids FILE (or - for standard input)");
  const std::vector<int64_t> ids = read_ids(a.prompt_ids);
  check_prompt(s, ids, a.max_new_tokens);

  const auto l0 = Clock::now();
  LoadedProgram program(a.pte, s, a.low_memory);
  const double load_s = std::chrono::duration<double>(Clock::now() - l0).count();

  double warmup_s = 0;
  if (a.warmup) {
    const auto w0 = Clock::now();
    const std::vector<int64_t> first_chunk(ids.begin(), ids.begin() + std::min<int64_t>(ids.size(), s.chunk_len));
    PrefillResult w = prefill(s, program, first_chunk, policy);
    if (static_cast<int64_t>(first_chunk.size()) < s.context) Decoder(s, program, w).step(first_chunk.back());
    program.cold->fetched = 0;
    program.switch_s = 0;
    warmup_s = std::chrono::duration<double>(Clock::now() - w0).count();
  }

  Sampling sampling;
  sampling.temperature = a.temperature;
  sampling.top_p = a.top_p;
  sampling.rng.seed(a.seed ? *a.seed : std::random_device{}());

  const auto start = Clock::now();
  PrefillResult pre = prefill(s, program, ids, policy, a.fail_at);
  const double prefill_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (!a.logits_out.empty()) {
    std::ofstream out(a.logits_out, std::ios::binary);
    out.write(reinterpret_cast<const char*>(pre.logits.data()), static_cast<std::streamsize>(pre.logits.size() * 4));
    if (!out) throw InputError("cannot write " + a.logits_out);
  }
  if (!a.trace.empty()) write_trace(a.trace, s, pre.records);

  auto is_eos = [&](int64_t t) { return std::find(s.eos_ids.begin(), s.eos_ids.end(), t) != s.eos_ids.end(); };
  int64_t token = next_token(pre.logits, sampling);
  const auto first = Clock::now();
  auto last = first;
  std::vector<int64_t> tokens = {token};
  std::cout << token << std::endl;
  Decoder decoder(s, program, pre);
  while (static_cast<long>(tokens.size()) < a.max_new_tokens && !is_eos(token)) {
    token = next_token(decoder.step(token), sampling);
    tokens.push_back(token);
    last = Clock::now();
    std::cout << token << std::endl;
  }
  if (a.json) {
    const double ttft = std::chrono::duration<double>(first - start).count();
    const double decode_s = std::chrono::duration<double>(last - first).count();
    double busy[2] = {0, 0};
    for (const auto& r : pre.records) busy[r.processor] += r.end - r.start;
    nlohmann::json j = {
        {"tokens", tokens}, {"prompt_tokens", ids.size()}, {"chunks", pre.chunks},
        {"policy", policy_name(s.has_profile || !uses_costs(policy) ? policy : Policy::kInorder)},
        {"load_s", load_s}, {"warmup_s", warmup_s}, {"prefill_s", prefill_s}, {"ttft_s", ttft}, {"decode_s", decode_s},
        {"prefill_tok_s", ids.size() / prefill_s},
        {"decode_tok_s", tokens.size() > 1 && decode_s > 0 ? nlohmann::json((tokens.size() - 1) / decode_s) : nlohmann::json()},
        {"decision_us", 1e6 * pre.decision_s / std::max(pre.decisions, 1L)}, {"decisions", pre.decisions},
        {"npu_busy_s", busy[kNpu]}, {"cpu_busy_s", busy[kCpu]}, {"wall_s", pre.wall_s},
        {"cold_rows", program.cold->fetched.load()}, {"stopped", is_eos(token) ? "eos" : "length"},
        {"low_memory", a.low_memory}, {"switch_s", program.switch_s}, {"peak_rss_mib", peak_rss_mib()}};
    std::cout << j.dump() << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const InputError& e) {
    std::cerr << "llmnpu-runner: error: " << e.what() << std::endl;
    return 2;
  } catch (const RunError& e) {
    std::cerr << "llmnpu-runner: error: " << e.what() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "llmnpu-runner: error: " << e.what() << std::endl;
    return 1;
  }
}
