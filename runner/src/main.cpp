// llmnpu-runner: generation from an exported program (.pte, its sidecar and cold rows file) without
// Python. Prefill in chunks on two worker threads (npu, cpu) under a scheduling policy, then decode
// with the program's decode method. Token ids in, token ids out (the tokenizer stays with the caller:
// `llmnpu run --pte F --native` drives this binary). With --serve it answers prompt after prompt
// and keeps the last prompt's K/V, so a prompt that starts like the last one (a conversation's next
// turn) prefills only what follows the shared part (`llmnpu chat --pte F --native` drives that).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>


#include <nlohmann/json.hpp>

#include "cold_rows.h"
#include "decode.h"
#include "error.h"
#include "platform.h"
#include "prefill.h"
#include "schedule.h"
#include "sidecar.h"
#include "trace.h"

using namespace llmnpu;

namespace {

const char* kUsage =
    "usage: llmnpu-runner --pte MODEL.pte (--prompt-ids FILE | --prompt-ids -) [--max-new-tokens N]\n"
    "                     [--temperature T] [--top-p P] [--seed S] [--policy inorder|overlap|ooo|cp]\n"
    "                     [--trace FILE] [--json] [--logits-out FILE] [--warmup] [--verify]\n"
    "       llmnpu-runner --pte MODEL.pte --serve [--max-new-tokens N] [sampling, --policy]\n"
    "       llmnpu-runner --pte MODEL.pte --dry-run --prompt-len N [--policy P]\n"
    "Prints the generated token ids, one per line; with --json a last line of timings.\n"
    "--warmup: one chunk of prefill and one decode step before the timed run (first-call set-up of\n"
    "every method, as a long-lived app has done before its first prompt).\n"
    "--logits-out FILE: the logits behind each generated token, float32, one row of the vocabulary each\n"
    "(the prompt's last position, then every decode step).\n"
    "--serve: one request per line on standard input, {\"ids\": [...], \"max_new_tokens\": N,\n"
    "\"logits_out\": FILE} (the last two optional); each is answered with its token ids, one per line,\n"
    "then a JSON line of timings with \"cached_tokens\" (prompt tokens whose K/V were kept from the\n"
    "previous request), or a JSON line {\"error\": ...}. The K/V kept are the previous prompt's own.\n"
    "--dry-run: the policy's schedule on simulated time (each task takes its profiled cost), as JSON.\n"
    "--verify: also check the .pte's SHA-256 against the sidecar's (reads the whole file once; without it,\n"
    "its size). The sidecar's own checksum is always checked.\n";

struct Args {
  std::string pte, prompt_ids, trace, logits_out, policy = "ooo";
  long max_new_tokens = 32, prompt_len = 0;
  std::optional<double> temperature;
  double top_p = 1.0;
  std::optional<uint64_t> seed;
  bool json = false, dry_run = false, warmup = false, serve = false, verify = false;
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
    if (flag == "--serve") { a.serve = true; continue; }
    if (flag == "--verify") { a.verify = true; continue; }
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

nlohmann::json records_json(const std::vector<Record>& records) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : records)
    out.push_back({{"task", r.task}, {"chunk", r.chunk}, {"step", r.step},
                   {"processor", kProcessorNames[r.processor]}, {"start", r.start}, {"end", r.end}});
  return out;
}

struct Answer {
  std::vector<int64_t> tokens;
  PrefillResult pre;
  nlohmann::json summary;
};

// Prefill `ids` after `past`, then decode up to `max_new` tokens, each printed on its own line as it
// comes; the summary holds the timings of this prompt. `keep_kv`: the prompt's K/V stay in the
// answer (--serve reuses them); else the prefill's methods are released before decode and the K/V
// dropped as the decode cache takes them.
Answer answer(const Sidecar& s, LoadedProgram& program, const std::vector<int64_t>& ids, const Past* past,
              long max_new, Sampling& sampling, Policy policy, std::optional<std::pair<int, int>> fail_at,
              const std::string& logits_out, const std::string& trace, bool keep_kv) {
  using Clock = std::chrono::steady_clock;
  const long fetched = program.cold->fetched.load();
  const auto start = Clock::now();
  Answer out;
  out.pre = prefill(s, program, ids, policy, fail_at, past);
  const PrefillResult& pre = out.pre;
  const double prefill_s = std::chrono::duration<double>(Clock::now() - start).count();
  // the prompt's last logits, then each decode step's: one float32 row per generated token
  std::ofstream logits_file;
  auto write_logits = [&](const std::vector<float>& row) {
    if (logits_out.empty()) return;
    if (!logits_file.is_open()) logits_file.open(logits_out, std::ios::binary);
    logits_file.write(reinterpret_cast<const char*>(row.data()), static_cast<std::streamsize>(row.size() * 4));
    if (!logits_file) throw InputError("cannot write " + logits_out);
  };
  write_logits(pre.logits);
  if (!trace.empty()) write_trace(trace, s, pre.records);

  auto is_eos = [&](int64_t t) { return std::find(s.eos_ids.begin(), s.eos_ids.end(), t) != s.eos_ids.end(); };
  int64_t token = next_token(pre.logits, sampling);
  const auto first = Clock::now();
  auto last = first;
  out.tokens = {token};
  std::cout << token << std::endl;
  if (!keep_kv) program.release_prefill();   // this process prefills no other prompt
  Decoder decoder(s, program, out.pre, /*release=*/!keep_kv);
  while (static_cast<long>(out.tokens.size()) < max_new && !is_eos(token)) {
    const std::vector<float> logits = decoder.step(token);
    write_logits(logits);
    token = next_token(logits, sampling);
    out.tokens.push_back(token);
    last = Clock::now();
    std::cout << token << std::endl;
  }
  const double ttft = std::chrono::duration<double>(first - start).count();
  const double decode_s = std::chrono::duration<double>(last - first).count();
  double busy[2] = {0, 0};
  for (const auto& r : pre.records) busy[r.processor] += r.end - r.start;
  const size_t reused = past ? static_cast<size_t>(past->length()) : 0;
  out.summary = {
      {"tokens", out.tokens}, {"prompt_tokens", reused + ids.size()}, {"cached_tokens", reused},
      {"chunks", pre.chunks},
      {"policy", policy_name(s.has_profile || !uses_costs(policy) ? policy : Policy::kInorder)},
      {"prefill_s", prefill_s}, {"ttft_s", ttft}, {"decode_s", decode_s},
      {"prefill_tok_s", ids.size() / prefill_s},
      {"decode_tok_s", out.tokens.size() > 1 && decode_s > 0 ? nlohmann::json((out.tokens.size() - 1) / decode_s)
                                                             : nlohmann::json()},
      {"decision_us", 1e6 * pre.decision_s / std::max(pre.decisions, 1L)}, {"decisions", pre.decisions},
      {"npu_busy_s", busy[kNpu]}, {"cpu_busy_s", busy[kCpu]}, {"wall_s", pre.wall_s},
      {"cold_rows", program.cold->fetched.load() - fetched}, {"stopped", is_eos(token) ? "eos" : "length"},
      {"npu_on_call", program.npu_per_call}};
  return out;
}

// --serve: requests line by line; the last prompt's ids and K/V are kept, and a request reuses the
// longest prefix it shares with them (all but its last token at most: its logits are needed).
// What a request gets wrong is answered with an error line and the next request is read; a method
// that fails ends the process, as in a single run.
int serve(const Args& a, const Sidecar& s, LoadedProgram& program, Sampling& sampling, Policy policy) {
  std::vector<int64_t> held;
  std::vector<ValuePtr> held_k, held_v;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      nlohmann::json request;
      std::vector<int64_t> ids;
      long max_new = a.max_new_tokens;
      std::string logits_out;
      try {
        request = nlohmann::json::parse(line);
        ids = request.at("ids").get<std::vector<int64_t>>();
        if (request.contains("max_new_tokens")) max_new = request.at("max_new_tokens").get<long>();
        if (request.contains("logits_out")) logits_out = request.at("logits_out").get<std::string>();
      } catch (const nlohmann::json::exception&) {
        throw InputError("a request is one JSON object per line: {\"ids\": [token ids], \"max_new_tokens\": N}");
      }
      if (max_new < 1) throw InputError("max new tokens must be at least 1");
      check_prompt(s, ids, max_new);
      size_t shared = 0;
      while (shared < held.size() && shared < ids.size() && held[shared] == ids[shared]) ++shared;
      shared = std::min(shared, ids.size() - 1);
      Past past;
      if (shared > 0) past = first_tokens(held_k, held_v, static_cast<int64_t>(shared));
      const std::vector<int64_t> rest(ids.begin() + static_cast<std::ptrdiff_t>(shared), ids.end());
      Answer ans = answer(s, program, rest, shared ? &past : nullptr, max_new, sampling, policy, std::nullopt,
                          logits_out, "", /*keep_kv=*/true);
      held = ids;
      held_k = ans.pre.k;
      held_v = ans.pre.v;
      ans.summary["peak_rss_mib"] = platform::peak_rss_mib();
      std::cout << ans.summary.dump() << std::endl;
    } catch (const InputError& e) {
      std::cout << nlohmann::json{{"error", e.what()}}.dump() << std::endl;
    }
  }
  return 0;
}

int run(const Args& a) {
  using Clock = std::chrono::steady_clock;
  const Sidecar s = read_sidecar(a.pte, a.verify);
  const Policy policy = parse_policy(a.policy);
  if (a.dry_run) {
    if (a.prompt_len < 1) throw InputError("--dry-run needs --prompt-len N (at least 1)");
    const int chunks = static_cast<int>((a.prompt_len + s.chunk_len - 1) / s.chunk_len);
    auto records = simulate(expand(s, chunks), policy);
    std::cout << nlohmann::json{{"policy", policy_name(policy)}, {"records", records_json(records)}}.dump() << "\n";
    return 0;
  }
  if (a.serve && !a.prompt_ids.empty()) throw InputError("--serve reads its prompts from standard input: drop --prompt-ids");
  if (!a.serve && a.prompt_ids.empty())
    throw InputError("give the prompt with --prompt-ids FILE (or - for standard input)");
  const std::vector<int64_t> ids = a.serve ? std::vector<int64_t>{} : read_ids(a.prompt_ids);
  if (!a.serve) check_prompt(s, ids, a.max_new_tokens);

  const auto l0 = Clock::now();
  LoadedProgram program(a.pte, s);
  const double load_s = std::chrono::duration<double>(Clock::now() - l0).count();

  double warmup_s = 0;
  if (a.warmup && a.serve) throw InputError("--warmup times one prompt: drop it with --serve");
  if (a.warmup) {
    const auto w0 = Clock::now();
    const std::vector<int64_t> first_chunk(ids.begin(), ids.begin() + std::min<int64_t>(ids.size(), s.chunk_len));
    PrefillResult w = prefill(s, program, first_chunk, policy);
    if (static_cast<int64_t>(first_chunk.size()) < s.context) Decoder(s, program, w).step(first_chunk.back());
    program.cold->fetched = 0;
    warmup_s = std::chrono::duration<double>(Clock::now() - w0).count();
  }

  Sampling sampling;
  sampling.temperature = a.temperature;
  sampling.top_p = a.top_p;
  sampling.rng.seed(a.seed ? *a.seed : std::random_device{}());
  if (a.serve) return serve(a, s, program, sampling, policy);

  Answer ans = answer(s, program, ids, nullptr, a.max_new_tokens, sampling, policy, a.fail_at, a.logits_out, a.trace,
                      /*keep_kv=*/false);
  if (a.json) {
    nlohmann::json j = ans.summary;
    j.update({{"load_s", load_s}, {"warmup_s", warmup_s}, {"platform", platform::kName},
              {"cold_kernels", cold_kernels()},
              {"peak_rss_mib", platform::peak_rss_mib()}});
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
