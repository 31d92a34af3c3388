// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// buckets.cpp: lab 4's bucket rule and the design question. Your part: the bodies of
// assign_buckets and predicted_best_bucket_cap_bytes.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "lab4.h"

namespace dp::lab4 {

std::vector<Bucket> assign_buckets(const Model& model, const BucketOptions& options) {
  (void)model;
  (void)options;
  throw NotImplemented("lab4::assign_buckets");
}

std::size_t predicted_best_bucket_cap_bytes(const BackwardProfile& profile, int world_size,
                                            const LinkModel& link) {
  if (world_size < 1) throw Error(fmt::format("world size {}; expected at least 1", world_size));
  (void)profile;
  (void)link;
  throw NotImplemented("lab4::predicted_best_bucket_cap_bytes");
}

}  // namespace dp::lab4
