// How many threads the kernels' at::parallel_for actually runs on. at::parallel_for is inlined
// from ATen's headers, so whether it is parallel is decided by this build's flags (-fopenmp),
// not by torch's: a build without OpenMP runs every kernel on one thread whatever
// torch.set_num_threads says. The platform logs this figure and the suite checks it.
#include <ATen/Parallel.h>

#include <atomic>

#include "kernels.h"

namespace tokenmill {
int64_t parallel_threads() {
  const int64_t items = 4 * at::get_num_threads();
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    const int64_t id = at::get_thread_num() + 1;
    for (int64_t now = seen.load(); now < id && !seen.compare_exchange_weak(now, id);) {
    }
  });
  return seen.load();
}
}  // namespace tokenmill
