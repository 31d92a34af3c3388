#!/usr/bin/env bash
# Lab 0's promises about `dplab bench-comm`: the default sweep prints every size the
# handout quotes, --csv output is rows a spreadsheet or awk can fit (with the handout's awk
# program), and a --mystery network never prints its alpha and bandwidth (only
# dplab-reference's --reveal does, when it is built).
#
#   check_bench_comm.sh DPLAB [DPLAB_REFERENCE]
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: check_bench_comm.sh DPLAB [DPLAB_REFERENCE]" >&2
  exit 2
fi
dplab="$1"
reference="${2:-}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
failures=0

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# expect_row OUTPUT SIZE TIME: the table has a row for SIZE bytes taking TIME us.
expect_row() {
  if ! grep -Eq "^ +$2 +[0-9]+ +float +[a-z]+ +$3 " <<<"$1"; then
    fail "expected a row of $2 bytes taking $3 us; the table is:"
    echo "$1" >&2
  fi
}

# 1. The default sweep (64 B x 4^k up to 256 MiB) holds the sizes the handout quotes, and
#    the times the handout gives for them: sendrecv on ib-ndr is about 2 us up to a few KiB.
#    (-n 2 times sendrecv as the handout's -n 8 does, one message per link and direction,
#    in a quarter of the memory.)
table="$("$dplab" bench-comm -n 2 --op sendrecv --net ib-ndr)"
for size in 64 1024 4096 65536 262144 4194304 16777216 67108864 268435456; do
  grep -Eq "^ +$size " <<<"$table" || fail "the default sweep has no row of $size bytes"
done
[[ "$(grep -Ec '^ +[0-9]+ ' <<<"$table")" == 12 ]] ||
  fail "the default sweep should have 12 sizes (64 B to 256 MiB by factors of 4)"
expect_row "$table" 64 2.00
expect_row "$table" 4096 2.08
expect_row "$table" 262144 7.24
# The all-reduce's busbw on 8 ranks: 0.255 GB/s at 4 KiB, 47.7 GB/s at 16 MiB.
table="$("$dplab" bench-comm -n 8 --net ib-ndr --max-bytes 16M)"
grep -Eq '^ +4096 .* 0\.255$' <<<"$table" ||
  fail "expected busbw 0.255 GB/s at 4 KiB:"$'\n'"$table"
grep -Eq '^ +16777216 .* 47\.724$' <<<"$table" ||
  fail "expected busbw 47.724 GB/s at 16 MiB:"$'\n'"$table"

# The simulated default is one iteration, because every iteration takes the same virtual
# time: the table equals that of the wall clock's default, 5 iterations after a warm-up.
one="$("$dplab" bench-comm -n 4 --net ib-ndr --max-bytes 4M | grep -v '^#')"
five="$("$dplab" bench-comm -n 4 --net ib-ndr --max-bytes 4M --iters 5 --warmup 1 | grep -v '^#')"
[[ "$one" == "$five" ]] ||
  fail "one simulated iteration should time as five:"$'\n'"$one"$'\n'"against"$'\n'"$five"

# 2. --csv: stdout holds a header and rows only; the notes go to stderr. The handout's awk
#    program fits the rows to the fabric's alpha (30 us) and beta (0.8 ns/B).
"$dplab" bench-comm -n 2 --op sendrecv --net 10gbe --max-bytes 16M --csv >"$scratch/t.csv" \
  2>"$scratch/notes.txt"
[[ "$(head -n 1 "$scratch/t.csv")" == "bytes,count,time_us,algbw_gbps,busbw_gbps" ]] ||
  fail "--csv: the first line should be the header; it is '$(head -n 1 "$scratch/t.csv")'"
if grep -Evq '^[0-9]+,[0-9]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+$' <(tail -n +2 "$scratch/t.csv"); then
  fail "--csv: every line after the header should be five numbers; stdout is:"
  cat "$scratch/t.csv" >&2
fi
grep -q '^# dplab bench-comm: sendrecv on 2 ranks' "$scratch/notes.txt" ||
  fail "--csv: the notes should go to stderr"
fit="$(awk -F, 'NR > 1 { n++; x += $1; y += $3; xx += $1 * $1; xy += $1 * $3 }
  END { b = (n * xy - x * y) / (n * xx - x * x); a = (y - b * x) / n
        printf "alpha = %.3g us, beta = %.3g ns/B\n", a, b * 1000 }' "$scratch/t.csv")"
[[ "$fit" == "alpha = 30 us, beta = 0.8 ns/B" ]] ||
  fail "the handout's awk fit of 10gbe should give alpha = 30 us, beta = 0.8 ns/B; got '$fit'"

# 3. --mystery: the network is hidden; two seeds give two networks.
mystery="$("$dplab" bench-comm -n 2 --op sendrecv --mystery 7 --max-bytes 1M 2>&1)"
grep -q 'mystery network 7 (alpha and bandwidth hidden)' <<<"$mystery" ||
  fail "--mystery 7 should say that its network is hidden; it printed:"$'\n'"$mystery"
if grep -qiE 'alpha [0-9]|[0-9] GB/s' <<<"$mystery"; then
  fail "--mystery 7 printed a network parameter:"$'\n'"$mystery"
fi
if "$dplab" bench-comm --mystery 7 --net ib-ndr >"$scratch/out.txt" 2>&1 ||
  ! grep -q -- '--mystery draws its own network' "$scratch/out.txt"; then
  fail "--mystery with --net should be an error; got: $(cat "$scratch/out.txt")"
fi
if "$dplab" bench-comm --mystery 4x >"$scratch/out.txt" 2>&1 ||
  ! grep -q -- "--mystery '4x' is not a seed: expected a whole number >= 0" "$scratch/out.txt"; then
  fail "--mystery 4x should be an error; got: $(cat "$scratch/out.txt")"
fi
if "$dplab" bench-comm --mystery 7 --reveal >"$scratch/out.txt" 2>&1; then
  fail "dplab (the students' program) should not accept --reveal"
fi

if [[ -n "$reference" ]]; then
  # The instructors' program reveals the network, and the student's fit finds it.
  revealed="$("$reference" bench-comm -n 2 --op sendrecv --mystery 7 --max-bytes 1M --fit --reveal)"
  truth="$(grep -o 'mystery network 7: alpha [0-9.]* us, bandwidth [0-9.]* GB/s' <<<"$revealed")" ||
    fail "--reveal should print the network; it printed:"$'\n'"$revealed"
  alpha="$(sed -E 's/.*alpha ([0-9.]+) us.*/\1/' <<<"$truth")"
  bandwidth="$(sed -E 's/.*bandwidth ([0-9.]+) GB.*/\1/' <<<"$truth")"
  grep -q "alpha = $alpha us, .*(bandwidth $bandwidth GB/s)" <<<"$revealed" ||
    fail "--fit should recover alpha $alpha us and $bandwidth GB/s:"$'\n'"$revealed"
  if grep -q "$alpha us\|$bandwidth GB/s" <<<"$mystery"; then
    fail "dplab bench-comm --mystery 7 printed alpha $alpha us or $bandwidth GB/s"
  fi
  other="$("$reference" bench-comm -n 2 --op sendrecv --mystery 8 --max-bytes 64 --reveal)"
  if grep -q "alpha $alpha us, bandwidth $bandwidth GB/s" <<<"$other"; then
    fail "--mystery 7 and --mystery 8 drew the same network"
  fi
fi

if [[ $failures -gt 0 ]]; then
  echo "check_bench_comm.sh: $failures checks failed" >&2
  exit 1
fi
echo "check_bench_comm.sh: the default sweep, --csv and --mystery behave as lab 0 says"
