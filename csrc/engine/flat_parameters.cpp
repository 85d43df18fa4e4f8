#include "engine/flat_parameters.h"

#include <set>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace gossip {

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
