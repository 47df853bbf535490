"""Print the node ids of the tests a pytest JUnit XML report skipped, one per line, for .ci/run
to run them again once the optional test peers (triton, the routers) are installed.

Usage: python .ci/skipped_ids.py REPORT.xml ROOT
A JUnit classname is dotted: the test file's module path, then any test classes; the file is
the longest prefix that exists under ROOT as a .py file.
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def node_id(classname: str, name: str, root: Path) -> str:
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (root / path).is_file():
            return "::".join([path.as_posix(), *parts[cut:], name])
    raise SystemExit(f"skipped_ids: no test file for classname {classname!r} under {root}")


def main() -> None:
    report, root = sys.argv[1], Path(sys.argv[2])
    ids = {node_id(case.get("classname"), case.get("name"), root)
           for case in ET.parse(report).iter("testcase") if case.find("skipped") is not None}
    print("\n".join(sorted(ids)))


if __name__ == "__main__":
    main()
