"""``python -m pagedexperts``: the ``pagedexperts`` command (``pagedexperts.cli``)."""

import sys

from pagedexperts.cli import main

if __name__ == "__main__":  # importing the module (tests/project/test_optional_extras.py) runs nothing
    sys.exit(main())
