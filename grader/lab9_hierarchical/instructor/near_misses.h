// near_misses.h: plausible wrong answers to lab 9's design question, for
// grader/lab9_hierarchical/checks.cpp (instructors only: the student release leaves this
// folder out, since each is the right formula with one term changed, and so names it).
//
// The check grades the predictions against the simulated clock, which is the answer; these
// only make sure, on every run, that the draws put each plausible mistake at least 3% from
// it (a grader bug otherwise). The selftests' planted bugs predicts_with_one_alpha,
// predicts_the_flat_ring_at_nvlink_pace, flat_ring_without_the_hop_inside,
// flat_ring_with_the_worst_of_each_level and shards_without_padding are among them. Included by
// checks.cpp after NearMiss, DesignCase and step_on, in its anonymous namespace.
#pragma once

/// The right formulas with one term changed, each with the schedule it is a formula of.
inline std::vector<NearMiss> near_misses() {
  const auto hierarchical_with = [](const DesignCase& c, double across_alpha,
                                    double across_chunk_div, double across_steps) {
    const TwoLevelFabric& f = c.fabric;
    const double b = static_cast<double>(c.allreduce_bytes);
    const double k = f.ranks_per_node;
    return 2.0 * (k - 1) * step_on(f.intra, b / k) +
           across_steps * (across_alpha + b / across_chunk_div / f.inter.bytes_per_second);
  };
  return {
      {"the hierarchical all-reduce with one level's alpha only (the intra-node alpha across)",
       [=](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         return hierarchical_with(c, f.intra.alpha_seconds, f.ranks_per_node * f.nodes,
                                  2.0 * (f.nodes - 1));
       },
       [](const DesignTruth& t) { return t.hierarchical; }},
      {"the hierarchical all-reduce moving the whole buffer / N across (not / (k N))",
       [=](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         return hierarchical_with(c, f.inter.alpha_seconds, f.nodes, 2.0 * (f.nodes - 1));
       },
       [](const DesignTruth& t) { return t.hierarchical; }},
      {"the hierarchical all-reduce with 2 N steps across (not 2 (N - 1))",
       [=](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         return hierarchical_with(c, f.inter.alpha_seconds, f.ranks_per_node * f.nodes,
                                  2.0 * f.nodes);
       },
       [](const DesignTruth& t) { return t.hierarchical; }},
      {"the flat ring at the intra-node link's pace (not its slowest hop's)",
       [](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         const int p = f.nodes * f.ranks_per_node;
         return 2.0 * (p - 1) * step_on(f.intra, static_cast<double>(c.allreduce_bytes) / p);
       },
       [](const DesignTruth& t) { return t.flat; }},
      {"the flat ring's step as its hop across nodes only (not the slower of the two hops)",
       [](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         const int p = f.nodes * f.ranks_per_node;
         return 2.0 * (p - 1) * step_on(f.inter, static_cast<double>(c.allreduce_bytes) / p);
       },
       [](const DesignTruth& t) { return t.flat; }},
      {"the flat ring's step as the larger alpha plus the chunk at the smaller bandwidth",
       [](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         const int p = f.nodes * f.ranks_per_node;
         LinkModel worst;
         worst.alpha_seconds = std::max(f.intra.alpha_seconds, f.inter.alpha_seconds);
         worst.bytes_per_second = std::min(f.intra.bytes_per_second, f.inter.bytes_per_second);
         return 2.0 * (p - 1) * step_on(worst, static_cast<double>(c.allreduce_bytes) / p);
       },
       [](const DesignTruth& t) { return t.flat; }},
      {"full sharding's step without the padding (4 Psi / p bytes a shard, not 4 ceil(Psi / p))",
       [](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         const double p = f.nodes * f.ranks_per_node;
         const double shard = 4.0 * static_cast<double>(c.num_parameters) / p;
         return 2.0 * (p - 1) * std::max(step_on(f.intra, shard), step_on(f.inter, shard));
       },
       [](const DesignTruth& t) { return t.full_sharding; }},
      {"HSDP's step without the padding (4 Psi / k bytes a shard, not 4 ceil(Psi / k))",
       [](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         const double k = f.ranks_per_node;
         const double shard = 4.0 * static_cast<double>(c.num_parameters) / k;
         return 2.0 * (k - 1) * step_on(f.intra, shard) +
                2.0 * (f.nodes - 1) * step_on(f.inter, shard / f.nodes);
       },
       [](const DesignTruth& t) { return t.hsdp; }},
      {"full sharding as one collective (p - 1 steps, not 2 (p - 1))",
       [](const DesignCase& c) {
         TwoLevelFabric f = c.fabric;
         const std::size_t p = static_cast<std::size_t>(f.nodes * f.ranks_per_node);
         const double shard = 4.0 * static_cast<double>((c.num_parameters + p - 1) / p);
         return static_cast<double>(p - 1) *
                std::max(step_on(f.intra, shard), step_on(f.inter, shard));
       },
       [](const DesignTruth& t) { return t.full_sharding; }},
      {"HSDP with the shard's all-reduce across counted as a whole shard per step",
       [](const DesignCase& c) {
         const TwoLevelFabric& f = c.fabric;
         const auto k = static_cast<std::size_t>(f.ranks_per_node);
         const double shard = 4.0 * static_cast<double>((c.num_parameters + k - 1) / k);
         return 2.0 * static_cast<double>(k - 1) * step_on(f.intra, shard) +
                2.0 * (f.nodes - 1) * step_on(f.inter, shard);
       },
       [](const DesignTruth& t) { return t.hsdp; }},
  };
}
