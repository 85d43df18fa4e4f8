#include "engine/flat_parameters.h"

#include <algorithm>
#include <optional>
#include <set>
#include <tuple>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

namespace gossip {
namespace {

std::string label(const std::vector<std::string>& names, size_t i) {
  const std::string index = "parameters[" + std::to_string(i) + "]";
  return names.size() > i ? "'" + names[i] + "' (" + index + ")" : index;
}

// The bytes a tensor's elements lie in within its storage, [begin, end); none for an empty
// tensor or one without storage.
struct Extent {
  const void* storage;
  int64_t begin;
  int64_t end;
  size_t index;  // into the parameters
};

std::optional<Extent> extent_of(const at::Tensor& p, size_t index) {
  if (!p.defined() || !p.has_storage() || p.numel() == 0) return std::nullopt;
  int64_t last = 0;  // the last element's offset from the first; torch's strides are >= 0
  for (int64_t d = 0; d < p.dim(); ++d) last += (p.size(d) - 1) * p.stride(d);
  const int64_t item = static_cast<int64_t>(p.element_size());
  return Extent{p.storage().unsafeGetStorageImpl(), p.storage_offset() * item,
                (p.storage_offset() + last + 1) * item, index};
}

// `marks`, a CPU scratch tensor standing for p's storage from byte `origin` on, viewed as p's
// bytes. A dimension of stride 0 (an expanded tensor) repeats the same bytes and is kept once,
// so that the view can be written.
at::Tensor bytes_of(const at::Tensor& marks, int64_t origin, const at::Tensor& p) {
  const int64_t item = static_cast<int64_t>(p.element_size());
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  for (int64_t d = 0; d < p.dim(); ++d) {
    sizes.push_back(p.stride(d) == 0 ? 1 : p.size(d));
    strides.push_back(p.stride(d) * item);
  }
  sizes.push_back(item);
  strides.push_back(1);
  return marks.as_strided(sizes, strides, p.storage_offset() * item - origin);
}

void refuse_overlap(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                    size_t a, size_t b) {
  const size_t i = std::min(a, b);
  const size_t j = std::max(a, b);
  TORCH_CHECK_VALUE(!params[i].is_same(params[j]), "gossip_ext: parameter ", label(names, j),
                    " is listed twice (also as parameters[", i, "])");
  TORCH_CHECK_VALUE(false, "gossip_ext: ", names.empty() ? "" : "parameters ", label(names, i),
                    " and ", label(names, j),
                    " overlap in memory: two tensors over one storage, or one a view of the "
                    "other. Flattening gives each parameter a slot of its own in the gossip "
                    "buffer, which would silently untie them. Share a weight by using one "
                    "Parameter object in both places (module.parameters() lists it once), or give "
                    "each its own storage (nn.Parameter(t.clone())).");
}

}  // namespace

void check_disjoint_parameters(const std::vector<at::Tensor>& params,
                               const std::vector<std::string>& names) {
  std::vector<Extent> extents;
  for (size_t i = 0; i < params.size(); ++i) {
    if (auto extent = extent_of(params[i], i)) extents.push_back(*extent);
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& x, const Extent& y) {
    return std::tie(x.storage, x.begin, x.index) < std::tie(y.storage, y.begin, y.index);
  });
  // Clusters: runs of one storage in which each extent begins before the furthest end so far.
  // Only a cluster of two or more can hold an overlap.
  size_t start = 0;
  while (start < extents.size()) {
    size_t furthest = start;  // the extent reaching furthest so far
    size_t stop = start + 1;
    for (; stop < extents.size() && extents[stop].storage == extents[start].storage &&
           extents[stop].begin < extents[furthest].end;
         ++stop) {
      // A dense tensor fills its extent, and every extent begins with a byte of its tensor.
      if (params[extents[furthest].index].is_non_overlapping_and_dense()) {
        refuse_overlap(params, names, extents[furthest].index, extents[stop].index);
      }
      if (extents[stop].end > extents[furthest].end) furthest = stop;
    }
    if (stop - start > 1) {
      // Some tensors with gaps (strided views) whose extents meet: mark the bytes each covers.
      const int64_t origin = extents[start].begin;
      const at::Tensor marks = at::zeros({extents[furthest].end - origin}, at::kByte);
      for (size_t k = start; k < stop; ++k) {
        const at::Tensor bytes = bytes_of(marks, origin, params[extents[k].index]);
        if (k > start && bytes.any().item<bool>()) {
          // Which one it overlaps: every earlier tensor writes its index + 1 over its bytes.
          const at::Tensor owners = at::zeros({marks.numel()}, at::kInt);
          for (size_t e = start; e < k; ++e) {
            bytes_of(owners, origin, params[extents[e].index])
                .fill_(static_cast<int64_t>(extents[e].index) + 1);
          }
          const int64_t owner =
              bytes_of(owners, origin, params[extents[k].index]).max().item<int64_t>();
          refuse_overlap(params, names, static_cast<size_t>(owner - 1), extents[k].index);
        }
        bytes.fill_(1);
      }
    }
    start = stop;
  }
}

void FlatParameterGroup::check_views() const {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    // Storage identity and offset, not data pointers: an empty tensor has a null data pointer.
    const bool views_flat = p.scalar_type() == flat.scalar_type() && p.is_contiguous() &&
                            p.storage().is_alias_of(flat.storage()) &&
                            p.storage_offset() == flat.storage_offset() + offsets[i];
    TORCH_CHECK(views_flat, "gossip_ext: parameter '", names[i],
                "' no longer views its flat gossip buffer: its storage was replaced after "
                "wrapping (for example `param.data = t`), so gossip would no longer reach it. "
                "Update parameters in place instead (param.data.copy_(t)).");
  }
}

std::vector<FlatParameterGroup> flatten_parameters(const std::vector<at::Tensor>& params,
                                                   const std::vector<std::string>& names) {
  TORCH_CHECK_VALUE(!params.empty(),
                    "gossip_ext: the module has no parameters; there is nothing to gossip");
  TORCH_CHECK_VALUE(names.empty() || names.size() == params.size(), "gossip_ext: got ",
                    names.size(), " parameter names for ", params.size(), " parameters");
  auto name_of = [&](size_t i) {
    return names.empty() ? "parameters[" + std::to_string(i) + "]" : names[i];
  };

  std::set<const void*> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), "gossip_ext: parameter '", name_of(i), "' is undefined");
    TORCH_CHECK_TYPE(p.layout() == at::kStrided, "gossip_ext: parameter '", name_of(i),
                     "' has layout ", p.layout(), "; only dense (strided) parameters can gossip");
    TORCH_CHECK_TYPE(at::isFloatingType(p.scalar_type()), "gossip_ext: parameter '", name_of(i),
                     "' has dtype ", p.scalar_type(),
                     "; only floating-point parameters can be averaged by gossip");
    TORCH_CHECK_VALUE(p.device() == params[0].device(), "gossip_ext: parameter '", name_of(i),
                      "' is on ", p.device(), " but parameter '", name_of(0), "' is on ",
                      params[0].device(), "; all parameters must be on one device");
    TORCH_CHECK_VALUE(seen.insert(p.unsafeGetTensorImpl()).second, "gossip_ext: parameter '",
                      name_of(i), "' is listed twice");
  }
  check_disjoint_parameters(params, names);

  std::vector<FlatParameterGroup> groups;
  std::vector<size_t> group_of(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    size_t g = 0;
    while (g < groups.size() && groups[g].params[0].scalar_type() != params[i].scalar_type()) ++g;
    if (g == groups.size()) groups.emplace_back();
    group_of[i] = g;
    groups[g].params.push_back(params[i]);
    groups[g].names.push_back(name_of(i));
  }

  for (FlatParameterGroup& group : groups) {
    int64_t total = 0;
    for (const at::Tensor& p : group.params) {
      group.offsets.push_back(total);
      total += p.numel();
    }
    group.flat = at::empty({total}, group.params[0].options().requires_grad(false));
    for (size_t i = 0; i < group.params.size(); ++i) {
      at::Tensor& p = group.params[i];
      at::Tensor view = group.flat.narrow(0, group.offsets[i], p.numel()).view(p.sizes());
      view.copy_(p.detach());
      p.set_data(view);
    }
  }
  return groups;
}

}  // namespace gossip
