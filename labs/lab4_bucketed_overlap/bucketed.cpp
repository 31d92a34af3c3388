// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
// bucketed.cpp: lab 4's BucketedDDP. Your part: the members of BucketedDDP::State and the
// bodies below.
#include <fmt/format.h>

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/tensor_ops.h"
#include "lab4.h"

namespace dp::lab4 {

/// Everything a BucketedDDP keeps between hooks and steps.
struct BucketedDDP::State {
  // Your members.
};

BucketedDDP::BucketedDDP(Model& model, Communicator& comm, const BucketOptions& options) {
  (void)model;
  (void)comm;
  (void)options;
  throw NotImplemented("lab4::BucketedDDP::BucketedDDP");
}

BucketedDDP::~BucketedDDP() = default;  // each pending Work waits as it is destroyed

const std::vector<Bucket>& BucketedDDP::buckets() const {
  throw NotImplemented("lab4::BucketedDDP::buckets");
}

void BucketedDDP::finish_gradient_sync() {
  throw NotImplemented("lab4::BucketedDDP::finish_gradient_sync");
}

void BucketedDDP::set_gradient_sync(bool enabled) {
  (void)enabled;
  throw NotImplemented("lab4::BucketedDDP::set_gradient_sync");
}

}  // namespace dp::lab4
