#!/usr/bin/env python3
"""Runs every command of the README's shell blocks, so that an example that fails is a test
that fails.

Usage: readme_commands.py --source DIR --build DIR --work DIR [--list] [README ...]

Each line of a ```sh block is a command (a trailing "# comment" is dropped; "a && b" is two
steps). The commands are read from the README at test time, never copied here, so an edited
example is the example tested. Each step runs in the scratch directory --work, with the
README's build/default replaced by --build.

A few steps are not run, because CI runs them itself or because running them here would run
this test inside itself; for each, the script checks that .ci/run does what the step asks
(RUN_BY_CI). A few run with a smaller workload than written, each with its reason (SMALLER:
arguments added, or an option's value replaced).
build/student is read as --build too: the full build has the student build's programs.
Any other command must end as its kind says: `dplab grade` of your code (the skeletons in a
fresh checkout) with status 0 or 1 and the score table, a check program run by hand
(grade_lab<N>) with status 0 or 1 and gtest's summary, a GPU example (--device cuda,
--backend nccl) on a machine without a GPU with status 1 and the error that says why,
every other command with status 0.
A step that matches none of the rules is an error: a new kind of example needs a rule.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import time

# Steps CI runs itself (.ci/run): checked to be in .ci/run instead of being run here.
RUN_BY_CI = [
    # (pattern of the step, what .ci/run must contain, why it is not run here)
    (r"^cmake --preset default$", "cmake --workflow --preset ci",
     "CI configures the same tree (the ci preset is default with warnings as errors)"),
    (r"^cmake --build --preset default$", "cmake --workflow --preset ci",
     "CI builds the same tree"),
    (r"^cmake --workflow --preset default$", "cmake --workflow --preset ci",
     "CI runs the same workflow (configure, build, every test); running it here would run "
     "this test inside itself"),
    (r"^ctest --preset default -L (unit|mpi)$", "cmake --workflow --preset ci",
     "CI's workflow runs every test, these labels included; this test is one of them"),
]

# Steps that run with a smaller workload than the README's, and why.
SMALLER = {
    "cmake --workflow --preset reference": (
        ["cmake", "--preset", "reference", "-B", "{work}/reference-build"],
        "configured only, in the scratch directory: the build under test has the same "
        "dplab-reference and check programs (the reference preset builds a subset of the ci "
        "preset's targets)"),
    "cmake --workflow --preset student": (
        ["cmake", "--preset", "student", "-B", "{work}/student-build"],
        "configured only, in the scratch directory: the build under test has the same dplab "
        "and check programs (the student preset builds a subset of the ci preset's targets)"),
    "build/default/bin/dplab bench-comm -n 8 --net ib-ndr": (
        ["--max-bytes", "16M"],
        "the sweep stops at 16 MiB instead of 256 MiB: each size's simulated time is the same "
        "alone or in the sweep, and the larger sizes cost only real copies (25 s of 8 ranks)"),
    "build/default/bin/dplab bench-comm -n 8 --op sendrecv --alpha 5 --bandwidth 25 --fit": (
        ["--max-bytes", "16M"],
        "the sweep stops at 16 MiB instead of 256 MiB: the fit still has 10 sizes, and the "
        "larger sizes cost only real copies (38 s of 8 ranks)"),
    "cmake --build build/student --target grade_lab5 dplab": (
        ["cmake", "--build", "build/student", "--target", "grade_lab5", "dplab", "--", "-n"],
        "a dry run (ninja -n) on the build under test, which has the student build's targets: "
        "it checks that the targets exist without rebuilding programs other tests are running"),
    "cmake --build build/student --target lab4_experiments": (
        ["cmake", "--build", "build/student", "--target", "lab4_experiments", "--", "-n"],
        "a dry run (ninja -n) on the build under test, which has the student build's targets: "
        "it checks that the target exists without rebuilding programs other tests are running"),
    "build/default/bin/dplab train -n 2 --model gpt --batch 16 --steps 300 --optimizer adamw "
    "--lr 0.001 --verify --checkpoint gpt.safetensors": (
        {"--steps": "20"},
        "20 steps instead of 300: the same training, verification and checkpoint for the "
        "sample that follows (300 steps take 2 min of CPU with --verify)"),
    "build/student/bin/dplab grade --backend mpi -n 4": (
        ["--lab", "1"],
        "lab 1 only: grading under mpi runs the same for every lab, and the selftests grade "
        "every lab's skeleton under mpi"),
    "build/reference/bin/dplab-reference grade": (
        ["--lab", "1"],
        "lab 1 only: the selftests grade every lab's reference, on the host and the emulated "
        "device, on more seeds (selftest_<lab>_reference_full_marks); all labs take 2 min"),
    "build/default/bin/dplab-reference grade --device emulated": (
        ["--lab", "1"],
        "lab 1 only: the selftests grade every lab's reference on the emulated device too"),
    "build/student/bin/dplab grade": (
        ["--lab", "2"],
        "lab 2 only (the step before grades lab 1): the selftests grade every lab's skeleton "
        "(selftest_<lab>_skeleton_scores_zero); all labs take 80 s"),
    "build/student/bin/dplab grade --json results.json --junit grades.xml": (
        ["--lab", "1"],
        "lab 1 only: the files are written the same way for one lab as for all of them"),
    "tools/run-benchmarks build/default": (
        ["--rounds", "1", "--", "--benchmark_filter=size:4KiB/|train_step/single/batch:64/"],
        "the full sweep takes many minutes; the script runs end to end, one round, on the "
        "smallest sizes"),
}


def commands_of(readme):
    """The commands of the ```sh blocks of `readme`, as (line number, text)."""
    commands = []
    in_block = False
    pending = ""
    with open(readme, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            stripped = line.strip()
            if stripped.startswith("```"):
                in_block = stripped == "```sh"
                continue
            if not in_block:
                continue
            text = pending + strip_comment(line.rstrip("\n"))
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            if text.strip():
                commands.append((number, " ".join(text.split())))
    return commands


def strip_comment(line):
    """`line` without a trailing shell comment (a '#' after a blank, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line


def ci_script(source):
    with open(os.path.join(source, ".ci", "run"), encoding="utf-8") as f:
        return f.read()


def run_step(step, args, log):
    """Runs one step; returns (passed, what happened)."""
    for pattern, needed, why in RUN_BY_CI:
        if re.match(pattern, step):
            if needed in ci_script(args.source):
                return True, f"run by CI (.ci/run: {needed}): {why}"
            return False, f"expected .ci/run to contain '{needed}' ({why})"

    argv = shlex.split(step)
    # Leading NAME=value words set the command's environment, as in the shell.
    environment = dict(os.environ)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        environment[name] = value
    cwd = args.work
    extra, note = SMALLER.get(step, ([], ""))
    if step.startswith("cmake "):
        if not note:
            return False, "no rule for this command: add one to tests/readme_commands.py"
        argv, cwd = [a.replace("{work}", args.work) for a in extra], args.source
    elif isinstance(extra, dict):
        # {option: value}: the option's value replaced (a repeated option is an error).
        for option, value in extra.items():
            argv[argv.index(option) + 1] = value
    else:
        argv += extra
    build = os.path.abspath(args.build)
    # build/student and build/reference hold subsets of the full build's programs.
    argv = [re.sub(r"^build/(default|student|reference)", build, a) for a in argv]
    program = os.path.basename(argv[0])
    if argv[0].startswith("tools/"):
        argv[0] = os.path.join(args.source, argv[0])
    elif not (argv[0].startswith(build) or argv[0] == "cmake"):
        return False, "no rule for this command: add one to tests/readme_commands.py"

    # What the examples expect to find: a host file for the several-machines example.
    if "--hostfile" in argv:
        with open(os.path.join(args.work, argv[argv.index("--hostfile") + 1]), "w") as f:
            f.write("localhost slots=64\n")
    student_grade = program == "dplab" and len(argv) > 1 and argv[1] == "grade"
    # A GPU example where there is none must fail with the error that says so, not crash.
    needs_gpu = ("cuda" in argv and "--device" in argv) or "nccl" in argv
    gpu_here = os.path.exists("/dev/nvidia0")
    student_checks = re.match(r"^grade_lab\d+$", program) is not None

    start = time.monotonic()
    try:
        result = subprocess.run(argv, cwd=cwd, env=environment, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"could not run it: {error}"
    seconds = time.monotonic() - start
    output = result.stdout.decode(errors="replace")
    log.write(f"$ {' '.join(shlex.quote(a) for a in argv)}\n{output}\n")
    if needs_gpu and not gpu_here:
        passed = result.returncode == 2 and re.search(
            r"sees no CUDA device|sees none|without CUDA|built without", output)
    elif student_grade:
        # Your code: 0 at full marks, 1 otherwise (the skeletons score 0), with the table.
        passed = result.returncode in (0, 1) and re.search(r"^total: \d", output, re.M)
    elif student_checks:
        # A check program run by hand: gtest's status (1 when a check fails) and its summary.
        passed = result.returncode in (0, 1) and re.search(r"^\[==========\] \d+ tests? from",
                                                            output, re.M)
    else:
        passed = result.returncode == 0
    tail = "\n".join(output.splitlines()[-15:])
    what = f"exit status {result.returncode} after {seconds:.1f} s"
    if note:
        what += f" (smaller workload: {note})"
    return bool(passed), what if passed else f"{what}; last lines:\n{tail}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("readmes", nargs="*")
    parser.add_argument("--source", required=True, help="the source tree")
    parser.add_argument("--build", required=True, help="the build tree the commands use")
    parser.add_argument("--work", required=True, help="a scratch directory to run them in")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per command")
    parser.add_argument("--list", action="store_true", help="only list the commands")
    args = parser.parse_args()
    args.source = os.path.abspath(args.source)
    args.work = os.path.abspath(args.work)
    readmes = args.readmes or [os.path.join(args.source, "README.md")]
    os.makedirs(args.work, exist_ok=True)

    failures = 0
    count = 0
    with open(os.path.join(args.work, "readme-commands.log"), "w") as log:
        for readme in readmes:
            for number, command in commands_of(readme):
                for step in [s.strip() for s in command.split("&&")]:
                    count += 1
                    where = f"{os.path.relpath(readme, args.source)}:{number}"
                    if args.list:
                        print(f"{where}: {step}")
                        continue
                    passed, what = run_step(step, args, log)
                    print(f"{'ok  ' if passed else 'FAIL'} {where}: {step}\n     {what}", flush=True)
                    failures += not passed
    if count == 0:
        print("no commands found: expected ```sh blocks in the README")
        return 1
    if not args.list:
        print(f"{count - failures} of {count} README steps passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
