#!/usr/bin/env python3
"""Each lab's handout tells the student the same checks and points as its rubric.

A student plans their work from the check table in labs/<lab>/README.md; the grader scores
from grader/<lab>/rubric.json. The two drifted once (lab 3's table named a check the rubric
no longer had, with other points), so this test compares them, check by check: the same
names in the same order, the same points, and a "Total: N points." line that is the
rubric's sum, which is 100 in every lab.

  tests/handout_rubric.py SOURCE_DIR
"""
import json
import pathlib
import re
import sys

ROW = re.compile(r"^\| `(?P<test>Lab\w+\.\w+)` \| (?P<points>\d+) \|")
TOTAL = re.compile(r"^Total: (?P<points>\d+) points\.$")


def compare(rubric_path: pathlib.Path, handout_path: pathlib.Path) -> list[str]:
    rubric = json.loads(rubric_path.read_text())
    expected = [(c["test"], int(c["points"])) for c in rubric["checks"]]
    rows, totals = [], []
    for line in handout_path.read_text().splitlines():
        if m := ROW.match(line):
            rows.append((m["test"], int(m["points"])))
        elif m := TOTAL.match(line):
            totals.append(int(m["points"]))
    problems = []
    if rows != expected:
        missing = [t for t in expected if t not in rows]
        extra = [t for t in rows if t not in expected]
        problems.append(
            f"{handout_path}: its check table differs from {rubric_path}:"
            f" missing or other points {missing}, not in the rubric {extra}"
            + ("" if missing or extra else " (the order differs)"))
    total = sum(points for _, points in expected)
    if total != 100:
        problems.append(f"{rubric_path}: the points total {total}, expected 100")
    if totals != [total]:
        problems.append(f"{handout_path}: expected one line 'Total: {total} points.',"
                        f" saw {totals or 'none'}")
    return problems


def main() -> int:
    source = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    rubrics = sorted(source.glob("grader/lab*/rubric.json"))
    if not rubrics:
        print(f"handout_rubric: no grader/lab*/rubric.json under {source}", file=sys.stderr)
        return 1
    problems = []
    for rubric in rubrics:
        lab = rubric.parent.name
        problems += compare(rubric, source / "labs" / lab / "README.md")
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"handout_rubric: {len(rubrics)} labs compared, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
