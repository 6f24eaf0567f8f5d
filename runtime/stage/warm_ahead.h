// Warms the weights of the product a stage thread runs next, learnt from the order in which its products ran.
//
// A stage's decode steps run the same products (pipe::panel_linear and its kin) in the same order every step, so
// the product that followed this one last time is the one that comes next. After each product, the next one's
// weights are handed to an idle lent core to read ahead (SpareCores::warm) while this thread computes what lies
// between the two products. Only the calling thread's own products are remembered, and only while a pool of
// spare cores is lent to it (the stage threads of a session); what it remembers keeps the tensors alive, so no
// span it hands over can be freed before it is read.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace libpipe::stage {

// Called after a product by `weights` (its panels, in the order it reads them) ran on this thread.
void warm_next_product(const std::vector<at::Tensor>& weights);

}  // namespace libpipe::stage
