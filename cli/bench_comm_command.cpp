// dplab bench-comm: lab 0's exercise. Sweeps message sizes over one communication op and
// prints time, algbw and busbw the way NVIDIA's nccl-tests do (doc/PERFORMANCE.md), on
// the simulated clock (--net) or the real one (local threads, or mpi processes; with
// --device cuda, buffers on the GPU, also on nccl):
//
//   dplab bench-comm -n 8 --net ib-ndr                 ring all-reduce on simulated NDR
//   dplab bench-comm -n 8 --op sendrecv --alpha 5 --bandwidth 25
//   dplab bench-comm -n 8 --op sendrecv --mystery 7 --csv > t.csv   a hidden network
//   dplab bench-comm -n 4                              the local backend's real speed
//   dplab run -n 4 --backend mpi -- bench-comm         Open MPI processes
//   dplab bench-comm --backend nccl --device cuda      every GPU of this machine
//
// algbw = S / t with S the whole array; busbw = algbw x 2(n-1)/n for all-reduce,
// x (n-1)/n for reduce-scatter and all-gather, x 1 for broadcast and sendrecv. Students fit
// alpha and beta to the times (t = a + b S) with any tool (--csv writes rows a spreadsheet
// or awk reads); --fit prints the least-squares line and what it means for the op's
// algorithm. The default sweep, 64 B to 256 MiB by factors of 4, holds every size lab 0's
// handout quotes. --mystery draws a network whose alpha and bandwidth stay hidden, so the
// fit is the only way to learn them; dplab-reference (instructors) adds --reveal.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "option_checks.h"
#include "simulation_options.h"

namespace dp::cli {
namespace {

// dplab-reference is the instructors' program: only it reveals a mystery network.
#if DP_REFERENCE_BUILD
constexpr bool kInstructorBuild = true;
#else
constexpr bool kInstructorBuild = false;
#endif

struct BenchArguments {
  int world_size = 0;  // 0: 8 on local, every process under mpi, every GPU on nccl
  std::string backend = "local";
  std::string device = "host";  // where the buffers live: host, cuda or emulated
  std::string op = "allreduce";
  std::string min_bytes = "64";  // 64 B x 4^k: 4 KiB, 4 MiB, 16 MiB and 256 MiB are rows
  std::string max_bytes = "256M";
  int factor = 4;
  int iterations = 5;  // on a simulated network 1 and 0 unless given (see run_bench)
  int warmup = 1;
  bool iterations_given = false;  // --iters or --warmup on the command line
  bool fit = false;
  bool csv = false;
  std::string mystery_seed;  // a seed: simulate a hidden network drawn from it
  bool reveal = false;       // dplab-reference only: print the mystery network
  SimulationArguments simulation;
};

/// "42" -> 42: the seed of --mystery, a whole number >= 0.
std::uint64_t parse_seed(const std::string& text) {
  std::uint64_t seed = 0;
  const char* end = text.data() + text.size();
  const auto [rest, status] = std::from_chars(text.data(), end, seed);
  if (status != std::errc() || rest != end)
    throw Error(fmt::format("--mystery '{}' is not a seed: expected a whole number >= 0", text));
  return seed;
}

/// The hidden network of `--mystery seed`: alpha log-uniform in [1, 50] us (to 0.1 us),
/// bandwidth log-uniform in [1, 400] GB/s (to 3 significant digits). The ranges span the
/// presets of dp/clock.h (10 GbE to NVLink), so any fabric a student meets is plausible.
LinkModel mystery_link(std::uint64_t seed) {
  CounterRng rng(seed, /*stream=*/0x6d797374);  // "myst": apart from any other use of seed
  const auto log_uniform = [&rng](double low, double high) {
    return low * std::pow(high / low, static_cast<double>(rng.uniform()));
  };
  const double alpha_us = std::round(log_uniform(1, 50) * 10) / 10;
  const double gbps = log_uniform(1, 400);
  const double unit = std::pow(10.0, std::floor(std::log10(gbps)) - 2);
  return {alpha_us * 1e-6, std::round(gbps / unit) * unit * 1e9};
}

const std::vector<std::string>& op_names() {
  static const std::vector<std::string> names = {"allreduce", "reduce_scatter", "allgather",
                                                 "broadcast", "sendrecv"};
  return names;
}

double bus_factor(const std::string& op, int p) {
  const double n = p;
  if (op == "allreduce") return 2 * (n - 1) / n;
  if (op == "reduce_scatter" || op == "allgather") return (n - 1) / n;
  return 1.0;
}

/// The sizes of the sweep: min, min x factor, ..., up to max, each a multiple of 4 p bytes
/// (whole float32 elements, equal shards).
/// The most --iters and --warmup: far more than a measurement needs, and small enough that
/// warm-up plus iterations (and their count times the time) never overflow.
constexpr int kMaxIterations = 1'000'000;
/// The largest --max-bytes: beyond any machine's memory, and far enough below 2^64 that
/// rounding a size up to the ranks' granule cannot wrap around.
constexpr std::size_t kMaxSweepBytes = std::size_t{1} << 40;

std::vector<std::size_t> sweep(const BenchArguments& args, int p) {
  const std::size_t granule = 4 * static_cast<std::size_t>(p);
  const std::size_t low = parse_byte_size(args.min_bytes, "--min-bytes");
  const std::size_t high = parse_byte_size(args.max_bytes, "--max-bytes");
  if (low > high)
    throw Error(fmt::format("--min-bytes {} is larger than --max-bytes {}", low, high));
  if (high > kMaxSweepBytes)
    throw Error(fmt::format("--max-bytes {} is more than the largest sweep, {} (1T)", high,
                            kMaxSweepBytes));
  if (args.factor < 2) throw Error(fmt::format("--factor must be >= 2, got {}", args.factor));
  std::vector<std::size_t> sizes;
  for (std::size_t size = low; size <= high; size *= static_cast<std::size_t>(args.factor)) {
    const std::size_t rounded = std::max(granule, (size + granule - 1) / granule * granule);
    if (sizes.empty() || rounded != sizes.back()) sizes.push_back(rounded);
    if (size > high / static_cast<std::size_t>(args.factor)) break;
  }
  return sizes;
}

/// One op of `elements` floats on this rank's buffers (tensors on the --device).
std::unique_ptr<Work> issue(const std::string& op, Communicator& comm, Tensor& in, Tensor& out,
                            std::size_t elements, std::vector<std::unique_ptr<Work>>& extra) {
  const int p = comm.size();
  const std::size_t shard = elements / static_cast<std::size_t>(p);
  const TensorView whole = in.view(0, elements);
  if (op == "allreduce") return comm.allreduce(whole, ReduceOp::kSum);
  if (op == "reduce_scatter") return comm.reduce_scatter(whole, out.view(0, shard), ReduceOp::kSum);
  if (op == "allgather") return comm.allgather(in.view(0, shard), out.view(0, elements));
  if (op == "broadcast") return comm.broadcast(whole, 0);
  // sendrecv: every rank sends to the next and receives from the previous (a ring step).
  const int r = comm.rank();
  extra.push_back(comm.isend(whole, (r + 1) % p, 7));
  return comm.irecv(out.view(0, elements), (r + p - 1) % p, 7);
}

struct Row {
  std::size_t bytes;
  double seconds;
};

/// Least-squares line t = a + b S through the rows.
std::pair<double, double> fit_line(const std::vector<Row>& rows) {
  const double n = static_cast<double>(rows.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const Row& row : rows) {
    const double x = static_cast<double>(row.bytes);
    sx += x;
    sy += row.seconds;
    sxx += x * x;
    sxy += x * row.seconds;
  }
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  return {(sy - slope * sx) / n, slope};
}

/// Prints the fit to `out` (stdout, or stderr under --csv).
void print_fit(std::FILE* out, const std::string& op, int p, const std::vector<Row>& rows) {
  if (rows.size() < 2) return;
  const auto [a, b] = fit_line(rows);
  // What a and b are in the algorithm's alpha-beta model (dp/clock.h):
  //   ring all-reduce 2(p-1) alpha + 2(p-1)/p S beta; ring reduce-scatter and all-gather
  //   (p-1) alpha + (p-1)/p S beta; binomial broadcast ceil(lg p) (alpha + S beta);
  //   sendrecv alpha + S beta.
  double messages = 1;
  double volume = 1;
  if (op == "allreduce") {
    messages = 2.0 * (p - 1);
    volume = 2.0 * (p - 1) / p;
  } else if (op == "reduce_scatter" || op == "allgather") {
    messages = p - 1;
    volume = static_cast<double>(p - 1) / p;
  } else if (op == "broadcast") {
    messages = volume = std::ceil(std::log2(static_cast<double>(p)));
  }
  fmt::print(out, "# fit: t = {:.4g} us + S x {:.4g} ns/B over {} sizes\n", a * 1e6, b * 1e9,
             rows.size());
  if (p > 1 && b > 0)
    fmt::print(out,
               "# as the {} model: alpha = {:.4g} us, beta = {:.4g} ns/B (bandwidth {:.4g} GB/s)\n",
               op, a / messages * 1e6, b / volume * 1e9, volume / b / 1e9);
}

/// The processes of this job on this machine under mpi: Open MPI and MPICH export the count
/// to every process they start; another launcher is taken to have put all of `world_size`
/// here (the count that can only overestimate).
int mpi_processes_on_this_node(int world_size) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    const char* text = std::getenv(name);
    int count = 0;
    if (text == nullptr) continue;
    const char* end = text + std::strlen(text);
    if (const auto [last, error] = std::from_chars(text, end, count);
        error == std::errc() && last == end && count >= 1)
      return count;
  }
  return world_size;
}

/// Throws unless the buffers of the sweep (an input and an output of `bytes` per rank, for
/// the `ranks_here` ranks on this machine: the threads of this process, or under mpi every
/// process of the job that runs here) fit in half of this machine's memory. Each process of
/// an mpi job checks for all of them: counting only itself, eight processes of 2 GiB each
/// passed on a machine of 24 GiB.
void check_fits_in_memory(std::size_t bytes, int ranks_here, const char* where) {
  const double physical =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  const double needed = 2.0 * static_cast<double>(bytes) * ranks_here;
  constexpr double kGiB = 1 << 30;
  if (physical > 0 && needed > physical / 2)
    throw Error(fmt::format(
        "the sweep's largest size, {} bytes, needs two buffers of {:.1f} GiB on each of the {} "
        "ranks {}: {:.1f} GiB in all, more than half of this machine's {:.1f} GiB of "
        "memory: lower --max-bytes or -n",
        bytes, static_cast<double>(bytes) / kGiB, ranks_here, where, needed / kGiB,
        physical / kGiB));
}

void run_bench(const BenchArguments& args) {
  if (std::find(op_names().begin(), op_names().end(), args.op) == op_names().end())
    throw Error(
        fmt::format("unknown --op '{}': expected one of {}", args.op, fmt::join(op_names(), ", ")));
  if (args.iterations < 1) throw Error("--iters must be at least 1");
  int iterations = args.iterations;
  int warmup = args.warmup;
  LaunchOptions options;
  options.backend = parse_backend(args.backend);
  const Device device = select_device(args.device);
  if (device != Device::kHost && options.backend == Backend::kMpi)
    throw Error(
        "--device with --backend mpi: the mpi backend takes host buffers only; measure device "
        "buffers on --backend local (ranks as threads sharing the GPU) or nccl");
  if (device == Device::kHost && options.backend == Backend::kNccl)
    throw Error("--backend nccl takes device buffers only: add --device cuda (or emulated)");
  options.simulation = simulation_options(args.simulation);
  const bool mystery = !args.mystery_seed.empty();
  if (mystery) {
    // --nics-per-node comes with --ranks-per-node (simulation_options checks it).
    if (options.simulation.enabled || args.simulation.ranks_per_node > 0)
      throw Error(
          "--mystery draws its own network: drop --net, --alpha, --bandwidth, "
          "--ranks-per-node and --nics-per-node");
    options.simulation.enabled = true;
    options.simulation.network.name = "mystery";
    options.simulation.network.fabric = mystery_link(parse_seed(args.mystery_seed));
  }
  if (args.reveal && !mystery) throw Error("--reveal shows the network of --mystery SEED: add it");
  // The simulated clock is deterministic: every iteration of an op takes the same virtual
  // time, so one iteration gives the figure that five would (in a fifth of the wall time;
  // the copies and reductions still run for real).
  if (options.simulation.enabled && !args.iterations_given) {
    iterations = 1;
    warmup = 0;
  }
  if (options.simulation.enabled && options.backend != Backend::kLocal)
    throw Error(
        "--net and --mystery simulate the local backend; on mpi the clock is the wall clock");
  int world_size = args.world_size;
  if (options.backend == Backend::kMpi) {
    if (!started_by_mpi())
      throw Error(
          "--backend mpi: start the ranks with `dplab run -n N --backend mpi -- bench-comm`");
    if (world_size == 0) world_size = mpi_world_size();
  }
  // A GPU exists (select_device), or the emulated device's kEmulatedGpuCount.
  if (options.backend == Backend::kNccl && world_size == 0)
    world_size = started_by_mpi() ? mpi_world_size() : nccl_gpu_count();
  if (world_size == 0) world_size = 8;
  options.world_size = world_size;
  if (args.op == "sendrecv" && world_size < 2) throw Error("--op sendrecv needs at least 2 ranks");
  const std::vector<std::size_t> sizes = sweep(args, world_size);
  if (options.backend == Backend::kLocal)
    check_fits_in_memory(sizes.back(), world_size, "in this process");
  else if (options.backend == Backend::kMpi)
    check_fits_in_memory(sizes.back(), mpi_processes_on_this_node(world_size),
                         "of the job on this machine (one per mpi process)");
  else
    check_fits_in_memory(sizes.back(), 1, "in this process");
  const bool prints = mpi_world_rank() == 0;
  // Under --csv the rows alone go to stdout, so that `> file` is what a spreadsheet opens.
  std::FILE* notes = args.csv ? stderr : stdout;
  std::string clock = fmt::format("wall clock, {} backend", args.backend);
  if (mystery)  // never describe() it: that would print what the student must measure
    clock = fmt::format("simulated clock: mystery network {} (alpha and bandwidth hidden)",
                        args.mystery_seed);
  else if (options.simulation.enabled)
    clock = "simulated clock: " + options.simulation.describe();
  if (device != Device::kHost) clock += fmt::format(", buffers in {} memory", to_string(device));
  if (prints) {
    fmt::print(notes, "# dplab bench-comm: {} on {} ranks, {}\n", args.op, world_size, clock);
    if (options.simulation.enabled && !args.iterations_given)
      fmt::print(notes,
                 "# time: one iteration (the simulated clock is deterministic), slowest rank\n");
    else
      fmt::print(notes, "# time: mean of {} iterations after {} warm-up, slowest rank\n",
                 iterations, warmup);
    if (args.csv)
      fmt::print("bytes,count,time_us,algbw_gbps,busbw_gbps\n");
    else
      fmt::print("# {:>12} {:>12} {:>6} {:>6} {:>12} {:>12} {:>12}\n", "size(B)", "count", "type",
                 "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
  }
  std::vector<Row> rows;
  launch(options, [&](Communicator& comm) {
    const auto largest = static_cast<std::int64_t>(sizes.back() / sizeof(float));
    Tensor in({largest}, MemoryCategory::kCommunication, device);
    Tensor out({largest}, MemoryCategory::kCommunication, device);
    in.fill(1.0f);  // not dp::fill: setting up is not charged to the simulated clock
    for (std::size_t bytes : sizes) {
      const std::size_t elements = bytes / sizeof(float);
      double start = 0;
      for (int i = 0; i < warmup + iterations; ++i) {
        if (i == warmup) {
          comm.barrier();
          start = comm.clock().now();
        }
        std::vector<std::unique_ptr<Work>> extra;
        issue(args.op, comm, in, out, elements, extra)->wait();
        for (auto& work : extra) work->wait();
        // On a GPU, nccl's wait() only orders the compute stream: the time must include the
        // transfer itself.
        synchronize_device();
      }
      // The slowest rank's time (float: microseconds to 7 digits are plenty here).
      std::vector<float> elapsed = {
          static_cast<float>((comm.clock().now() - start) / iterations * 1e6)};
      comm.allreduce(std::span(elapsed), ReduceOp::kMax)->wait();
      if (comm.rank() != 0) continue;
      const double seconds = static_cast<double>(elapsed[0]) * 1e-6;
      const double algbw = seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
      const double busbw = algbw * bus_factor(args.op, comm.size());
      if (prints && args.csv)
        fmt::print("{},{},{:.7g},{:.6g},{:.6g}\n", bytes, elements, seconds * 1e6, algbw, busbw);
      else if (prints)
        fmt::print("  {:>12} {:>12} {:>6} {:>6} {:>12.2f} {:>12.3f} {:>12.3f}\n", bytes, elements,
                   "float", args.op == "allreduce" || args.op == "reduce_scatter" ? "sum" : "none",
                   seconds * 1e6, algbw, busbw);
      rows.push_back({bytes, seconds});
    }
  });
  if (prints && args.fit) print_fit(notes, args.op, world_size, rows);
  if (prints && args.reveal) {
    const LinkModel& link = options.simulation.network.fabric;
    fmt::print(notes, "# mystery network {}: alpha {:g} us, bandwidth {:g} GB/s\n",
               args.mystery_seed, link.alpha_seconds * 1e6, link.bytes_per_second / 1e9);
  }
}

}  // namespace

void add_bench_comm_command(CLI::App& app) {
  auto args = std::make_shared<BenchArguments>();
  CLI::App* bench = app.add_subcommand(
      "bench-comm", "Sweep message sizes over one op and print algbw and busbw (nccl-tests style)");
  bench
      ->add_option("-n,--world-size", args->world_size,
                   "Ranks (default: 8 on local, every process under mpi)")
      ->check(world_size_range());
  bench->add_option("--backend", args->backend, "local, mpi or nccl")->capture_default_str();
  bench
      ->add_option("--device", args->device,
                   "Where the buffers live: host, cuda (the GPU), or emulated (the CUDA device "
                   "emulated in host memory)")
      ->capture_default_str();
  bench->add_option("--op", args->op, fmt::format("The op: {}", fmt::join(op_names(), ", ")))
      ->capture_default_str();
  bench->add_option("--min-bytes", args->min_bytes, "Smallest size (K, M, G suffixes)")
      ->capture_default_str();
  bench->add_option("--max-bytes", args->max_bytes, "Largest size (K, M, G suffixes)")
      ->capture_default_str();
  bench->add_option("--factor", args->factor, "Each size is this many times the last")
      ->capture_default_str();
  CLI::Option* iterations =
      bench->add_option("--iters", args->iterations, "Timed iterations per size (simulated: 1)")
          ->capture_default_str()
          ->check(whole_number_in(1, kMaxIterations));
  CLI::Option* warmup =
      bench->add_option("--warmup", args->warmup, "Untimed iterations per size (simulated: 0)")
          ->capture_default_str()
          ->check(whole_number_in(0, kMaxIterations));
  bench->add_flag("--fit", args->fit, "Print the least-squares fit t = a + b S");
  bench->add_flag("--csv", args->csv,
                  "Print the rows as CSV (bytes,count,time_us,algbw_gbps,busbw_gbps) for a "
                  "spreadsheet or awk; the notes go to stderr");
  add_simulation_options(*bench, args->simulation);
  bench
      ->add_option("--mystery", args->mystery_seed,
                   "Simulate a network drawn from this seed (alpha 1-50 us, 1-400 GB/s) and "
                   "keep its alpha and bandwidth hidden: fit them")
      ->group("Simulated clock");
  if (kInstructorBuild)
    bench
        ->add_flag("--reveal", args->reveal, "Print the alpha and bandwidth of --mystery's network")
        ->group("Simulated clock");
  bench->callback([args, iterations, warmup] {
    args->iterations_given = iterations->count() > 0 || warmup->count() > 0;
    run_bench(*args);
  });
}

}  // namespace dp::cli
