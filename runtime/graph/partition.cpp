#include "runtime/graph/partition.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include "runtime/error.h"
#include "runtime/graph/split_spec.h"

namespace libpipe::graph {

std::vector<size_t> top_level_sequence(const Program& model) {
  std::vector<size_t> out;
  for (size_t id = 0; id < model.nodes().size(); ++id)
    if (model.nodes()[id].role != NodeRole::SplitMarker) out.push_back(id);
  return out;
}

namespace {

std::string parent_of(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? "" : path.substr(0, dot);
}

bool is_prefix_path(const std::string& prefix, const std::string& path) {
  return prefix.empty() || path == prefix ||
         (path.size() > prefix.size() && path.compare(0, prefix.size(), prefix) == 0 && path[prefix.size()] == '.');
}

}  // namespace

Segmentation segment(const Program& model, const std::vector<size_t>& sequence) {
  const auto ranges = call_site_ranges(model, sequence);
  const auto& sites = model.call_sites();

  // The layers are the calls of a module's children that share one class (ModuleList and
  // Sequential items: transformer.h.*, layers.*, layer1..layer4). Of all such groups of sibling
  // calls (two or more), the one covering the most of the model wins, so four projections inside
  // one attention block never beat the decoder layers that hold them.
  std::map<std::string, std::string> classes;
  for (const auto& m : model.modules()) classes[m.path] = m.class_name;
  auto class_of = [&](const std::string& path) {
    auto it = classes.find(path);
    return it == classes.end() ? "?" : it->second;
  };
  struct Group {
    size_t calls = 0;
    size_t covered = 0;
  };
  std::map<std::pair<std::string, std::string>, Group> groups;  // (container, class)
  for (size_t s = 0; s < sites.size(); ++s) {
    if (ranges[s].first == ranges[s].second) continue;
    Group& g = groups[{parent_of(sites[s].path), class_of(sites[s].path)}];
    ++g.calls;
    g.covered += ranges[s].second - ranges[s].first;
  }
  Segmentation seg;
  std::string layer_class;
  Group best;
  for (const auto& [key, g] : groups) {
    if (g.calls < 2) continue;
    if (g.covered > best.covered || (g.covered == best.covered && g.calls > best.calls)) {
      best = g;
      seg.container = key.first;
      layer_class = key.second;
    }
  }

  std::vector<bool> blocked(sequence.size() + 1, false);
  if (best.calls == 0) {
    for (size_t p = 0; p < sequence.size(); ++p) seg.layer_starts.push_back(p);
  } else {
    for (size_t s = 0; s < sites.size(); ++s) {
      const auto [start, end] = ranges[s];
      if (start == end) continue;
      if (parent_of(sites[s].path) == seg.container && class_of(sites[s].path) == layer_class)
        seg.layer_starts.push_back(start);
      // Cuts may fall inside the container's call and its ancestors' (that is where the layers
      // meet) and between the parts of a layer (attention | MLP, or between its own operations),
      // never inside any other module call: not through a layer's submodules, not through a
      // helper module outside the layers.
      const bool is_layer = parent_of(sites[s].path) == seg.container && class_of(sites[s].path) == layer_class;
      if (!is_prefix_path(sites[s].path, seg.container) && !is_layer)
        for (size_t p = start + 1; p < end; ++p) blocked[p] = true;
    }
    std::sort(seg.layer_starts.begin(), seg.layer_starts.end());
    seg.layer_starts.erase(std::unique(seg.layer_starts.begin(), seg.layer_starts.end()), seg.layer_starts.end());
  }
  // A cut between the first and the last use of a tensor the model writes in place (a cache) would put
  // that state in two stages, which a plan refuses: no policy chooses one, and the time policy's
  // segments never split it either.
  const auto& attributes = model.attributes();
  auto related = [](const std::vector<std::string>& a, const std::vector<std::string>& b) {
    const size_t n = std::min(a.size(), b.size());
    return std::equal(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(n), b.begin());
  };
  for (const AttributeRead& state : attributes) {
    if (state.writers.empty()) continue;
    size_t first = SIZE_MAX, last = 0;
    for (size_t p = 0; p < sequence.size(); ++p) {
      const ProgramNode& node = model.nodes()[sequence[p]];
      bool uses = std::find(state.writers.begin(), state.writers.end(), sequence[p]) != state.writers.end();
      for (size_t a : node.attributes) uses |= related(attributes[a].path, state.path);
      if (!uses) continue;
      first = std::min(first, p);
      last = std::max(last, p);
    }
    for (size_t p = first + 1; first != SIZE_MAX && p <= last; ++p) blocked[p] = true;
  }
  const auto contexts = open_contexts(model, sequence);
  for (size_t p = 1; p < sequence.size(); ++p)
    if (!blocked[p] && !contexts[p]) seg.allowed_cuts.push_back(p);
  return seg;
}

std::vector<size_t> min_max_partition(const std::vector<double>& costs, size_t parts) {
  const size_t k = costs.size();
  if (parts < 1) throw Error(Status::Split, "the number of stages must be at least 1");
  if (parts > k)
    throw Error(Status::Split, "cannot make " + std::to_string(parts) + " stages: the model has only " +
                                   std::to_string(k) + " place" + (k == 1 ? "" : "s") +
                                   " to put stage boundaries between (ask for at most " + std::to_string(k) + ")");
  std::vector<double> prefix(k + 1, 0.0);
  for (size_t i = 0; i < k; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[g][i]: the smallest possible largest group over the first i segments in g groups.
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(k + 1, inf));
  std::vector<std::vector<size_t>> from(parts + 1, std::vector<size_t>(k + 1, 0));
  best[0][0] = 0.0;
  for (size_t g = 1; g <= parts; ++g)
    for (size_t i = g; i <= k - (parts - g); ++i)
      for (size_t j = g - 1; j < i; ++j) {
        const double v = std::max(best[g - 1][j], prefix[i] - prefix[j]);
        // Among equal maxima prefer the later boundary, which keeps earlier stages no heavier.
        if (v < best[g][i] || (v == best[g][i] && j > from[g][i])) {
          best[g][i] = v;
          from[g][i] = j;
        }
      }
  std::vector<size_t> starts;
  for (size_t g = parts, i = k; g > 1; --g) {
    i = from[g][i];
    starts.push_back(i);
  }
  std::reverse(starts.begin(), starts.end());
  return starts;
}

std::vector<double> segment_param_bytes(const Program& model, const std::vector<size_t>& sequence,
                                        const std::vector<size_t>& bounds) {
  std::set<size_t> seen;  // each tensor counts for the first segment that reads it
  std::vector<double> bytes;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    double total = 0;
    for (size_t p = bounds[i]; p < bounds[i + 1]; ++p)
      for (size_t a : model.nodes()[sequence[p]].attributes)
        if (seen.insert(a).second) total += static_cast<double>(model.attributes()[a].tensor_bytes);
    bytes.push_back(total);
  }
  return bytes;
}

}  // namespace libpipe::graph
