#!/usr/bin/env python3
"""The README's worked example of adding a parameter, applied to a copy of train_gpt.cu.

    param_toy_edit.py README TRAIN_GPT_CU OUT

reads the example's lines from README.md's editing guide (the code block between the
`<!-- param-toy-edit -->` and `<!-- /param-toy-edit -->` markers; each line ends with `// in PLACE`,
one or more lines per place) and inserts them, verbatim and in order, into train_gpt.cu after their
place's anchor, which must be found exactly once. The build rule of tests/model/tests.cmake runs it; the test
imports it for the example's lines.
"""
import re
import sys

BEGIN, END = "<!-- param-toy-edit -->", "<!-- /param-toy-edit -->"
LINE = re.compile(r"^(?P<code>.*\S)\s+// in (?P<place>[A-Za-z_ ]+?)(?::.*)?$")


class EditError(Exception):
    pass


def example_lines(readme_text):
    """[(place, line)] of the README's example, in its order."""
    if readme_text.count(BEGIN) != 1 or readme_text.count(END) != 1:
        raise EditError(f"README.md: expected one {BEGIN} ... {END} block")
    block = readme_text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
    if len(block) < 3 or not block[0].startswith("```") or block[-1] != "```":
        raise EditError("README.md: the param-toy-edit block is not one fenced code block")
    out = []
    for line in block[1:-1]:
        m = LINE.match(line)
        if not m or m.group("place") not in ANCHORS:
            raise EditError(f"README.md: example line {line!r} does not end with '// in PLACE', PLACE one of "
                            f"{', '.join(ANCHORS)}")
        out.append((m.group("place"), line))
    if sorted(set(p for p, _ in out)) != sorted(ANCHORS):
        raise EditError(f"README.md: the example must give lines for each of {', '.join(ANCHORS)}")
    return out


def lines_of(readme_text):
    """{place: [its lines, in order]} of the README's example."""
    out = {}
    for place, line in example_lines(readme_text):
        out.setdefault(place, []).append(line)
    return out


def only(lines, pattern, start=None, what=""):
    """The index of the one line matching `pattern`: in the whole file, or in the block from line
    `start` to the first blank line (the anchor must be inside that block)."""
    lo, hi = 0, len(lines)
    if start is not None:
        lo, hi = start, next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    hits = [i for i in range(lo, hi) if re.search(pattern, lines[i])]
    if len(hits) != 1:
        raise EditError(f"train_gpt.cu: {what or pattern} found {len(hits)} times, expected once")
    return hits[0]


# Each place's anchor: the index of the line its example line goes after.
def last_params_field(lines):
    return only(lines, r"^\s*float\* scalars = nullptr;", only(lines, r"^struct Params \{$"), "struct Params' scalars field")


def last_registry_line(lines):
    return only(lines, r'^\s*visit\(ParamSpec\{"scalars"', only(lines, r"^void visit_params\("), "visit_params' scalars line")


def last_table_row(lines):
    return only(lines, r"^    \};$", only(lines, r"^std::vector<ParamRule> record71_param_table\(\) \{$"),
                "record71_param_table's closing brace") - 1


def work_order_first_line(lines):  # the list's first line, continuing on the next
    start = only(lines, r"^std::vector<std::string> record71_work_order\(\) \{$", what="record71_work_order")
    return only(lines, r"^    return \{.*,$", start, "record71_work_order's first line")


def function_body(lines, signature, pattern, what):
    """The line matching `pattern` inside the function whose definition matches `signature`."""
    start = only(lines, signature, what=what + "'s function")
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "}")
    hits = [i for i in range(start, end) if re.search(pattern, lines[i])]
    if len(hits) != 1:
        raise EditError(f"train_gpt.cu: {what} found {len(hits)} times, expected once")
    return hits[0]


def statement_end(lines, i):
    """The last line of the statement starting at line i (a call may continue over several lines)."""
    while not lines[i].rstrip().endswith(";"):
        i += 1
    return i


def forward_bigram_gather(lines):
    return statement_end(lines, function_body(lines, r"^void gpt_forward\(",
                                              r"^\s*embedding_gather\(a\.x0_bigram, p\.bigram_embed,",
                                              "gpt_forward's bigram gather"))


def backward_bigram_grad(lines):
    return statement_end(lines, function_body(lines, r"^void gpt_backward\(", r"^\s*embedding_backward\(g\.bigram_embed,",
                                              "gpt_backward's bigram gradient"))


ANCHORS = {
    "struct Params": last_params_field,
    "visit_params": last_registry_line,
    "param_table": last_table_row,
    "work_order": work_order_first_line,
    "gpt_forward": forward_bigram_gather,
    "gpt_backward": backward_bigram_grad,
}


def apply(readme_text, source_text):
    """train_gpt.cu with the example's lines inserted after their anchors, each indented as its anchor
    (a work-order entry under the list's first)."""
    lines = source_text.split("\n")
    by_place = lines_of(readme_text)
    inserts = []
    for place, block in by_place.items():
        at = ANCHORS[place](lines)
        anchor = lines[at]
        indent = " " * (anchor.index("{") + 1) if place == "work_order" else anchor[:len(anchor) - len(anchor.lstrip())]
        inserts.append((at, [indent + line for line in block]))
    for at, block in sorted(inserts, reverse=True):
        lines[at + 1:at + 1] = block
    return "\n".join(lines)


def main(argv):
    args = list(argv)
    if len(args) != 3:
        sys.exit(__doc__)
    readme, source, out = args
    try:
        text = apply(open(readme).read(), open(source).read())
    except EditError as e:
        sys.exit(f"param_toy_edit.py: {e}")
    with open(out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
