#include "transport/store_check_in.h"

#include <exception>
#include <vector>

#include "common/error.h"

namespace gossip {

void store_check_in(c10d::Store& store, const std::string& key, int rank, int world_size,
                    std::chrono::milliseconds timeout, const std::string& what) {
  const auto rank_key = [&](int r) { return detail::str_cat(key, "/", r); };
  store.set(rank_key(rank), std::vector<uint8_t>{1});
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(rank_key(r));
  try {
    store.wait(keys, timeout);
    return;
  } catch (const std::exception&) {
    // Timed out, or the store failed: name the ranks that did not check in.
  }
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) {
    try {
      if (!store.check({rank_key(r)})) missing.push_back(r);
    } catch (const std::exception&) {
      missing.push_back(r);
    }
  }
  throw TimeoutError(detail::str_cat("gossip_ext: rank ", rank, " timed out after ",
                                     timeout.count(), " ms waiting for ranks ", missing, " to ",
                                     what, " (store key ", key, ")"),
                     {missing, std::nullopt, "", timeout});
}

}  // namespace gossip
