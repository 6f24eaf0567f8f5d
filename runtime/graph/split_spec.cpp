#include "runtime/graph/split_spec.h"

#include <algorithm>
#include <cctype>
#include <set>

#include "runtime/error.h"

namespace libpipe::graph {

namespace {

[[noreturn]] void bad_syntax(const std::string& text, const std::string& why) {
  throw Error(Status::InvalidArgument, "split point '" + text + "' " + why +
                                           "; write MODULE:begin or MODULE:end (MODULE a dotted "
                                           "module path such as layers.3), or MODULE@K:end for the "
                                           "K-th call of a module called several times");
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

}  // namespace

SplitPoint parse_split_point(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) bad_syntax(text, "has no ':begin' or ':end'");
  SplitPoint sp;
  sp.text = text;
  const std::string where = text.substr(colon + 1);
  if (where == "begin") sp.begin = true;
  else if (where == "end") sp.begin = false;
  else bad_syntax(text, "ends in ':" + where + "', neither ':begin' nor ':end'");

  std::string path = text.substr(0, colon);
  if (const size_t at = path.find('@'); at != std::string::npos) {
    const std::string k = path.substr(at + 1);
    if (k.empty() || k.size() > 6 || !std::all_of(k.begin(), k.end(), [](unsigned char c) { return std::isdigit(c); }))
      bad_syntax(text, "has '@" + k + "' where a call number is expected");
    sp.call = std::stoi(k);
    path = path.substr(0, at);
  }
  if (path.empty()) bad_syntax(text, "names no module");
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) bad_syntax(text, "has an empty component in its module path");
    for (unsigned char c : part)
      if (!std::isalnum(c) && c != '_') bad_syntax(text, "has '" + std::string(1, c) + "' in its module path");
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  sp.path = path;
  return sp;
}

std::vector<std::string> nearest_module_paths(const Program& model, const std::string& path, size_t count) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (const auto& m : model.modules())
    if (!m.path.empty()) scored.emplace_back(edit_distance(m.path, path), m.path);
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < count; ++i) out.push_back(scored[i].second);
  return out;
}

std::vector<std::pair<size_t, size_t>> call_site_ranges(const Program& model, const std::vector<size_t>& sequence) {
  std::vector<std::pair<size_t, size_t>> ranges(model.call_sites().size(), {0, 0});
  std::vector<bool> seen(ranges.size(), false);
  for (size_t p = 0; p < sequence.size(); ++p) {
    for (int site : model.nodes()[sequence[p]].sites) {
      if (!seen[site]) ranges[site] = {p, p + 1};
      ranges[site].second = p + 1;
      seen[site] = true;
    }
  }
  return ranges;
}

std::vector<const ProgramNode*> open_contexts(const Program& model, const std::vector<size_t>& sequence) {
  std::vector<const ProgramNode*> open(sequence.size() + 1, nullptr);
  std::vector<const ProgramNode*> stack;
  for (size_t p = 0; p < sequence.size(); ++p) {
    open[p] = stack.empty() ? nullptr : stack.back();
    const ProgramNode* n = &model.nodes()[sequence[p]];
    if (n->role == NodeRole::ContextEnter) stack.push_back(n);
    if (n->role == NodeRole::ContextExit && !stack.empty()) stack.pop_back();
  }
  open[sequence.size()] = stack.empty() ? nullptr : stack.back();
  return open;
}

std::vector<Cut> resolve_split_points(const Program& model, const std::vector<size_t>& sequence,
                                      const std::vector<SplitPoint>& points) {
  const auto ranges = call_site_ranges(model, sequence);
  const auto contexts = open_contexts(model, sequence);
  std::set<std::string> known;
  for (const auto& m : model.modules()) known.insert(m.path);

  std::vector<Cut> cuts;
  for (const SplitPoint& sp : points) {
    if (!known.count(sp.path)) {
      throw Error(Status::Split, "split point '" + sp.text + "' names module '" + sp.path +
                                     "', which the model does not have; nearest module paths: " +
                                     join(nearest_module_paths(model, sp.path, 3)) +
                                     " (pipe inspect MODEL lists them all)");
    }
    int calls = 0;
    bool matched = false;
    for (size_t site = 0; site < model.call_sites().size(); ++site) {
      const CallSite& cs = model.call_sites()[site];
      if (cs.path != sp.path) continue;
      ++calls;
      if (sp.call >= 0 && cs.call != sp.call) continue;
      matched = true;
      const auto [start, end] = ranges[site];
      if (start == end)
        throw Error(Status::Split, "split point '" + sp.text + "': call " + std::to_string(cs.call) + " of " + sp.path +
                                       " happens inside an if/loop block, and only forward's top level "
                                       "can be cut; split at a module that encloses the block instead");
      const size_t position = sp.begin ? start : end;
      if (position == 0 || position == sequence.size())
        throw Error(Status::Split, "split point '" + sp.text + "' would leave stage " +
                                       (position == 0 ? std::string("0 empty: nothing runs before ")
                                                      : "after it empty: nothing runs after ") +
                                       sp.path + (sp.begin ? " begins" : " ends") + "; drop this split point");
      if (const ProgramNode* ctx = contexts[position])
        throw Error(Status::Split, "split point '" + sp.text + "' falls inside a `with` block (" + ctx->context +
                                       ") that changes how the code inside runs; cut before or after the "
                                       "whole `with` statement");
      cuts.push_back({position, sp.text + " (call " + std::to_string(cs.call) + ")"});
    }
    if (calls == 0)
      throw Error(Status::Split, "split point '" + sp.text + "': module " + sp.path +
                                     " exists but forward never calls it, so there is no boundary to cut at");
    if (!matched)
      throw Error(Status::Split, "split point '" + sp.text + "': " + sp.path + " is called " + std::to_string(calls) +
                                     " time" + (calls == 1 ? "" : "s") + ", so the call number must be below " +
                                     std::to_string(calls));
  }
  std::sort(cuts.begin(), cuts.end(), [](const Cut& a, const Cut& b) { return a.position < b.position; });
  std::vector<Cut> unique;
  for (auto& c : cuts) {
    if (!unique.empty() && unique.back().position == c.position) {
      unique.back().reason += ", " + c.reason;  // e.g. layers.0:end and layers.1:begin
      continue;
    }
    unique.push_back(std::move(c));
  }
  return unique;
}

}  // namespace libpipe::graph
